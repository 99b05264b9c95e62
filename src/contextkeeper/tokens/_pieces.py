"""Exact, cached token counts of rendered prompts.

Hugging Face tokenizers cut the input at added tokens (the special tokens a chat template writes) before
anything else, then normalise, pre-tokenise and encode each piece on its own. So the length of
``encode(text)`` is the number of added-token matches plus the sum of each piece's own length, where a piece
is encoded the way it is encoded after an added token — except the piece at the very start of the text, which
some SentencePiece tokenizers prefix with a space. We count every distinct piece once and remember it, so a
long conversation costs its new pieces only.

The rule is checked against the tokenizer itself when the counter is built (``PieceCounter.verify``); a
tokenizer that breaks it (for example added tokens matched on normalised text) is counted by encoding the
whole text instead — slower, never wrong.
"""

from __future__ import annotations

import bisect
import copy
import json
import re
from typing import Any

__all__ = ["PieceCounter"]

_PROBE_TEXTS = (
    "Hello world",
    " leading space",
    "\n\ntrailing newlines\n\n",
    "  two spaces  ",
    "ünïcödé 中文 🙂 émoji",
    "```python\ndef f(x):\n    return x * 2\n```",
    '{"key": [1, 2.5, "three"], "nested": {"a": null}}',
    "\t tab and\r\ncarriage",
    "",
    "x",
)


def _trie_pattern(tokens: list[str]) -> str:
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


def _common_prefix(a: str, b: str) -> int:
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


class _Splitter:
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
        regexes = [
            re.escape(first) + _trie_pattern([t[1:] for t in tokens]) for first, tokens in sorted(groups.items())
        ]
        if swallowing:
            swallowing.sort(key=lambda item: -len(item[0]))
            regexes.append("|".join(p for _, p in swallowing))
        self._finders = [re.compile(r).finditer for r in regexes]
        # One group (the common case: every token starts with "<"): re.split does it all in C.
        self._single = re.compile("(" + regexes[0] + ")").split if len(regexes) == 1 else None

    def split(self, text: str) -> list[str]:
        if self._single is not None:
            return self._single(text)
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


class _Generational:
    """A bounded cache: two generations of dicts, the older dropped when the newer fills up.

    Plain dict hits, no per-hit bookkeeping, and at most ``2 * limit`` entries.
    """

    __slots__ = ("_limit", "_new", "_old")

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._new: dict[str, int] = {}
        self._old: dict[str, int] = {}

    def get(self, key: str) -> int | None:
        value = self._new.get(key)
        if value is None:
            value = self._old.get(key)
            if value is not None:
                self.put(key, value)
        return value

    def put(self, key: str, value: int) -> None:
        if len(self._new) >= self._limit:
            self._old = self._new
            self._new = {}
        self._new[key] = value

    def __len__(self) -> int:
        return len(self._new) + len(self._old)

    def clear(self) -> None:
        self._new.clear()
        self._old.clear()


# Pre-tokenizers that only cut the text (they add and change no characters; ByteLevel maps each byte to one
# symbol, and is accepted only without its prefix space).
_CUTTING = frozenset({"Split", "ByteLevel", "Digits", "Punctuation", "Whitespace", "WhitespaceSplit"})


def _byte_bound(backend: Any) -> str | None:
    """When a text provably has at most as many tokens as UTF-8 bytes: ``"any"`` text, ``"ascii"`` text only,
    or None (unknown). True for byte-level BPE: every symbol is one byte, a merge only joins symbols, and an
    added token is one token for at least one character; a normaliser must then not lengthen the text (none
    does not; NFC leaves ASCII text as it is)."""
    try:  # the parts' own settings (serialising the whole tokenizer, vocabulary included, takes 0.2 s)
        model = backend.model
        if type(model).__name__ != "BPE" or getattr(model, "dropout", None):
            return None
        pre = json.loads(backend.pre_tokenizer.__getstate__()) if backend.pre_tokenizer is not None else {}
        normalizer = json.loads(backend.normalizer.__getstate__()) if backend.normalizer is not None else None
    except Exception:  # not a tokenizers.Tokenizer we can read: no bound
        return None
    steps = (pre.get("pretokenizers") or []) if pre.get("type") == "Sequence" else [pre]
    if not any(step.get("type") == "ByteLevel" for step in steps):
        return None
    if any(step.get("type") not in _CUTTING or step.get("add_prefix_space") for step in steps):
        return None
    if normalizer is None:
        return "any"
    if normalizer.get("type") == "NFC":
        return "ascii"
    return None


class PieceCounter:
    """Counts ``len(tokenizer.encode(text, add_special_tokens=False))`` piece by piece, with a cache."""

    def __init__(self, backend: Any, *, cache_entries: int = 50_000) -> None:
        self._backend = backend  # a tokenizers.Tokenizer
        added = backend.get_added_tokens_decoder()  # id -> AddedToken
        patterns: list[tuple[str, str | None]] = []  # (content, pattern for whitespace-swallowing tokens)
        anchor: str | None = None
        self.has_single_word = False
        for token in added.values():
            content: str = token.content
            if not content:
                continue
            self.has_single_word |= bool(token.single_word)
            # lstrip / rstrip tokens swallow the whitespace beside them, which then costs no token.
            pattern = None
            if token.lstrip or token.rstrip:
                pattern = (r"\s*" if token.lstrip else "") + re.escape(content) + (r"\s*" if token.rstrip else "")
            patterns.append((content, pattern))
            plain = token.special and not token.lstrip and not token.rstrip
            if anchor is None and plain and len(backend.encode(content, add_special_tokens=False).ids) == 1:
                anchor = content
        self._split = _Splitter(patterns).split if patterns else None
        self._bound = _byte_bound(backend)
        self._anchor = anchor
        self._after = _Generational(cache_entries)
        self._first = _Generational(1024)
        self._alone = _Generational(16_384)
        self.fast = self._split is not None and anchor is not None and not self.has_single_word
        self.encoded_chars = 0  # characters sent to the tokenizer so far: what caching saves is visible here
        # The previous text and its checkpoints, for resuming; off when tokens swallow whitespace, since such a
        # match has no bounded length.
        self._longest = max((len(content) for content, _ in patterns), default=0)
        self._resumable = all(p is None for _, p in patterns)
        self._last = ""
        self._last_id: Any = None
        self._bounds: list[int] = []
        self._totals: list[int] = []

    # -- counting --------------------------------------------------------------------------------------------
    def full(self, text: str) -> int:
        """The reference: encode the whole text at once."""
        self.encoded_chars += len(text)
        return len(self._backend.encode(text, add_special_tokens=False).ids)

    def count(self, text: str, *, lineage: tuple[Any, Any, int] | None = None) -> int:
        """Exact token count of ``text`` (no special tokens added).

        ``lineage`` — ``(this text's id, the id of an earlier text, n)`` — says that ``text[:n]`` equals that
        earlier text's beginning; when that earlier text is the one counted last, the shared prefix need not be
        searched for. Ids are any values the caller keeps unique.
        """
        if not self.fast or self._split is None:
            return self.full(text)
        known = (
            lineage[2] if lineage is not None and self._last_id is not None and lineage[1] == self._last_id else None
        )
        self._last_id = lineage[0] if lineage is not None else None
        start, base, kept = self._resume_point(text, known)
        parts = self._split(text[start:] if start else text)
        counts = [0] * len(parts)
        counts[1::2] = [1] * (len(parts) // 2)  # one token per added-token match
        first = parts[0]
        if first:  # only at offset 0: a resumed suffix starts on an added token, so its first part is ""
            cached = self._first.get(first)
            if cached is None:
                cached = len(self._backend.encode(first, add_special_tokens=False).ids)
                self.encoded_chars += len(first)
                self._first.put(first, cached)
            counts[0] = cached
        missing: list[int] = []
        after = self._after
        for index in range(2, len(parts), 2):
            piece = parts[index]
            if piece:
                cached = after.get(piece)
                if cached is None:
                    missing.append(index)
                else:
                    counts[index] = cached
        if missing:
            lengths = self._encode_new([parts[i] for i in missing])
            for index in missing:
                counts[index] = lengths[parts[index]]
        # Checkpoints at every added token (offset, tokens before it) let the next count reuse this prefix.
        bounds, totals = self._bounds[:kept], self._totals[:kept]
        offset, total = start, base
        for index, part in enumerate(parts):
            if index % 2:
                bounds.append(offset)
                totals.append(total)
            offset += len(part)
            total += counts[index]
        if self._resumable:
            self._last, self._bounds, self._totals = text, bounds, totals
        return total

    def alone(self, text: str) -> int:
        """Tokens of ``text`` encoded on its own, from a cache keyed by the text; the resume state of
        :meth:`count` is left alone, so counting snippets between prompts costs the prompts nothing."""
        cached = self._alone.get(text)
        if cached is None:
            cached = len(self._backend.encode(text, add_special_tokens=False).ids)
            self.encoded_chars += len(text)
            self._alone.put(text, cached)
        return int(cached)

    def bound(self, text: str) -> int | None:
        """An upper bound on :meth:`alone` without tokenizing (UTF-8 bytes, see ``_byte_bound``), or None."""
        rule = self._bound
        if rule is None or (rule == "ascii" and not text.isascii()):
            return None
        return len(text.encode("utf-8"))

    def alone_many(self, texts: list[str]) -> list[int]:
        """:meth:`alone` of each text; the ones not cached are encoded in one batch (in parallel)."""
        cache = self._alone
        missing = list(dict.fromkeys(t for t in texts if cache.get(t) is None))
        if getattr(self._backend, "padding", None) is not None:  # a batch would be padded: one at a time
            return [self.alone(t) for t in texts]
        if missing:
            self.encoded_chars += sum(map(len, missing))
            encode = getattr(self._backend, "encode_batch_fast", self._backend.encode_batch)
            for text, encoding in zip(missing, encode(missing, add_special_tokens=False), strict=True):
                cache.put(text, len(encoding.ids))
        return [self.alone(t) for t in texts]

    def _resume_point(self, text: str, known: int | None = None) -> tuple[int, int, int]:
        """Where counting ``text`` may start: the last checkpoint of the previous text that lies wholly inside
        the prefix both texts share — ``(offset, tokens before it, checkpoints kept)``, or zeros."""
        last = self._last
        if not last:
            return 0, 0, 0
        shared = known if known is not None else _common_prefix(text, last)
        # A token match that starts before the checkpoint ends within the longest token's length of it, so
        # everything the tokenizer decided before it depends only on shared text.
        kept = bisect.bisect_right(self._bounds, shared - self._longest)
        if kept == 0:
            return 0, 0, 0
        return self._bounds[kept - 1], self._totals[kept - 1], kept - 1

    def _encode_new(self, pieces: list[str]) -> dict[str, int]:
        unique = list(dict.fromkeys(pieces))
        self.encoded_chars += sum(len(p) for p in unique)
        anchor = self._anchor
        assert anchor is not None
        # Only lengths are needed: the "fast" batch call skips computing character offsets where it exists.
        encode = getattr(self._backend, "encode_batch_fast", self._backend.encode_batch)
        encodings = encode([anchor + p for p in unique], add_special_tokens=False)
        lengths = {p: len(e.ids) - 1 for p, e in zip(unique, encodings, strict=True)}
        for piece, n in lengths.items():
            self._after.put(piece, n)
        return lengths

    def fork(self) -> PieceCounter:
        """A counter sharing this one's piece caches (counts depend only on the piece text) with resume state of
        its own. The caches are plain dicts: a lost entry between threads costs a re-encode, never a wrong count."""
        clone = copy.copy(self)
        clone.encoded_chars = 0
        clone._last, clone._last_id, clone._bounds, clone._totals = "", None, [], []
        return clone

    # -- self-check ------------------------------------------------------------------------------------------
    def verify(self) -> bool:
        """Check the piece rule against whole-text encoding on probe texts; switch it off if it fails."""
        if not self.fast:
            return False
        added = [t.content for t in self._backend.get_added_tokens_decoder().values() if t.content]
        specials = added[:64] + added[-64:]
        samples: list[str] = []
        for i, text in enumerate(_PROBE_TEXTS):
            token = specials[i % len(specials)] if specials else ""
            samples.append(text + token + text + token + " " + text)
            samples.append(token + text + "\n" + token + token + text)
        agree = all(self.count(sample) == self.full(sample) for sample in samples)
        self.clear()
        self.fast = agree
        return agree

    def clear(self) -> None:
        self._after.clear()
        self._first.clear()
        self._alone.clear()
        self.encoded_chars = 0
        self._last, self._bounds, self._totals = "", [], []
        self._last_id = None

    @property
    def cached_pieces(self) -> int:
        return len(self._after) + len(self._first)
