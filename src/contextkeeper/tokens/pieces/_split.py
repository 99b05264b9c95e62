"""Cutting a text at added tokens, as the tokenizer does before anything else, and comparing texts fast."""

from __future__ import annotations

import re
from typing import Any

__all__ = ["Splitter", "common_prefix"]


def trie_pattern(tokens: list[str]) -> str:
    """A regex matching any of ``tokens``, longest match first, factored by common prefixes."""
    trie: dict[str, Any] = {}
    for token in tokens:
        node = trie
        for char in token:
            node = node.setdefault(char, {})
        node[""] = {}

    def build(node: dict[str, Any]) -> str:
        ends = "" in node
        branches = [re.escape(char) + build(child) for char, child in sorted(node.items()) if char]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        if ends:  # a token ends here and longer ones continue: try the longer first (greedy), else stop here
            return "(?:" + body + ")?"
        return body

    return "(?:" + build(trie) + ")" if len(trie) else ""


def common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix, compared in blocks at memcmp speed."""
    limit = min(len(a), len(b))
    step = 1 << 16
    low = 0
    while low < limit and a[low : low + step] == b[low : low + step]:
        low += step
    if low >= limit:
        return limit
    high = min(low + step, limit)  # the first difference is in a[low:high]
    while low < high:
        middle = (low + high + 1) // 2
        if a[low:middle] == b[low:middle]:
            low = middle
        else:
            high = middle - 1
    return low


class Splitter:
    """``re.split``-shaped cutting of a text at added tokens, leftmost-longest like the tokenizer.

    One pattern per first character, each starting with that literal character so the regex engine can skip
    ahead at C speed (an alternation over hundreds of tokens tests every position instead), and a trie shape
    inside so common prefixes are matched once. Matches from the groups are merged left to right.
    """

    def __init__(self, patterns: list[tuple[str, str | None]]) -> None:
        groups: dict[str, list[str]] = {}
        swallowing: list[tuple[str, str]] = []
        for content, pattern in patterns:
            if pattern is None:
                groups.setdefault(content[0], []).append(content)
            else:
                swallowing.append((content, pattern))
        regexes = [re.escape(first) + trie_pattern([t[1:] for t in tokens]) for first, tokens in sorted(groups.items())]
        if swallowing:
            swallowing.sort(key=lambda item: -len(item[0]))
            regexes.append("|".join(p for _, p in swallowing))
        self._finders = [re.compile(r).finditer for r in regexes]
        self.starts = re.compile("|".join(f"(?:{r})" for r in regexes)).match  # an added token at offset 0
        # One group (the common case: every token starts with "<"): re.split does it all in C.
        self._single = re.compile("(" + regexes[0] + ")").split if len(regexes) == 1 else None
        # Several groups without whitespace-swallowing tokens: a text where only one group matches (Qwen's "<"
        # tokens, with no "[" one) is cut by that group's re.split alone.
        self._by_group = (
            None if swallowing else [(re.compile(r).search, re.compile("(" + r + ")").split) for r in regexes]
        )

    def split(self, text: str) -> list[str]:
        if self._single is not None:
            return self._single(text)
        if self._by_group is not None:
            found = [cut for search, cut in self._by_group if search(text) is not None]
            if len(found) <= 1:
                return found[0](text) if found else [text]
        # Leftmost first; at the same start the longest match wins.
        spans = sorted((m.span() for find in self._finders for m in find(text)), key=lambda s: (s[0], -s[1]))
        parts: list[str] = []
        last = 0
        for start, end in spans:
            if start < last or start == end:  # overlaps a token already taken
                continue
            parts.append(text[last:start])
            parts.append(text[start:end])
            last = end
        parts.append(text[last:])
        return parts
