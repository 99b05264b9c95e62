"""Exact, cached token counts of rendered prompts.

Hugging Face tokenizers cut the input at added tokens (the special tokens a chat template writes) before
anything else, then normalise, pre-tokenise and encode each piece on its own. So the length of
``encode(text)`` is the number of added-token matches plus the sum of each piece's own length, where a piece
is encoded the way it is encoded after an added token — except the piece at the very start of the text, which
some SentencePiece tokenizers prefix with a space. We count every distinct piece once and remember it, so a
long conversation costs its new pieces only.

Two finer rules apply to byte-level BPE tokenizers with the Llama 3, Qwen2/Qwen3 or Qwen3.5 split pattern:
a long piece is counted in blocks cut at line starts (every line start is a pre-token border there), and an
ASCII piece is cut into pre-tokens by our own regex, each distinct pre-token encoded once by the BPE model
(``_word_rule``): the tokenizer's own work per pre-token, without its per-call overhead.

Each rule is checked against the tokenizer itself when the counter is built (``PieceCounter.verify``); a
tokenizer that breaks one (for example added tokens matched on normalised text) is counted without it —
slower, never wrong.
"""

from __future__ import annotations

import bisect
import copy
import json
import operator
import re
import zlib
from collections.abc import Callable, Sequence
from typing import Any, cast

from .._memo import Memo, shared_prefix, shared_suffix, text_key_size

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
# Every ASCII character, and the whitespace, contraction and digit runs the pre-token rule must cut alike.
_ASCII_PROBE = "".join(map(chr, range(128))) + (
    " I'LL  don't\t\n \n\r\n  x12345 y  \x0b\x0c z \x1c\x1d\x1e\x1f w   \n\n\t  '  's 'S 3.14159 -- ~/a/b  "
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


_NO_SEGMENTS: tuple[list[str], list[int], list[int], int] = ([], [], [], 0)
_INFOS = {(a, b): (a, b) for a in (False, True) for b in (False, True)}


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


# Pre-tokenizers that only cut the text (they add and change no characters; ByteLevel maps each byte to one
# symbol, and is accepted only without its prefix space).
_CUTTING = frozenset({"Split", "ByteLevel", "Digits", "Punctuation", "Whitespace", "WhitespaceSplit"})


def _bpe_parts(backend: Any) -> tuple[list[dict[str, Any]], dict[str, Any] | None] | None:
    """The pre-tokenizer steps and the normaliser of a BPE tokenizer without dropout, or None (another model, or
    not a tokenizers.Tokenizer we can read). Read from the parts' own settings: serialising the whole tokenizer,
    vocabulary included, takes 0.2 s."""
    try:
        model = backend.model
        if type(model).__name__ != "BPE" or getattr(model, "dropout", None):
            return None
        pre = json.loads(backend.pre_tokenizer.__getstate__()) if backend.pre_tokenizer is not None else {}
        normalizer = json.loads(backend.normalizer.__getstate__()) if backend.normalizer is not None else None
    except Exception:
        return None
    steps = (pre.get("pretokenizers") or []) if pre.get("type") == "Sequence" else [pre]
    return steps, normalizer


def _byte_bound(backend: Any) -> str | None:
    """When a text provably has at most as many tokens as UTF-8 bytes: ``"any"`` text, ``"ascii"`` text only,
    or None (unknown). True for byte-level BPE: every symbol is one byte, a merge only joins symbols, and an
    added token is one token for at least one character; a normaliser must then not lengthen the text (none
    does not; NFC leaves ASCII text as it is)."""
    parts = _bpe_parts(backend)
    if parts is None:
        return None
    steps, normalizer = parts
    if not any(step.get("type") == "ByteLevel" for step in steps):
        return None
    if any(step.get("type") not in _CUTTING or step.get("add_prefix_space") for step in steps):
        return None
    if normalizer is None:
        return "any"
    if normalizer.get("type") == "NFC":
        return "ascii"
    return None


# Split patterns under which a line start (see _LINE_START) is always a pre-token border, whatever text follows:
# "\n" is matched only by whitespace atoms that end their match (`\s*[\r\n]+`, a trailing `[\r\n]*`), no
# optional prefix may be a newline, and `\s*[\r\n]+` is tried before `\s+(?!\S)`, so a chunk that ends in "\n" is
# cut the same alone as followed by the next line. (GPT-2's own pattern lacks that alternative, and o200k's
# `[\r\n/]*` runs into a following "/": neither is listed.)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (  # Qwen2 and Qwen3
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LINE_SAFE_PATTERNS = frozenset(
    {
        _LLAMA3_SPLIT,
        _QWEN2_SPLIT,
        _QWEN35_SPLIT,
        # DeepSeek V3 and later (after its digit and CJK cuts); its file holds real CR and LF characters
        "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
        "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
    }
)
# Pieces this long are counted in blocks cut at line starts. Where to cut is decided by the text alone (a line
# start ends a block when the line before it has a CRC-32 of 0 modulo _EVERY, about every 8 lines), so the same lines
# are cut the same wherever they sit: a tool result counted on its own (truncate's cap) and inside its message,
# the tool schemas before one first user message and another (Llama 3 writes them as one piece), or a long text
# and its cut-down copy share all blocks but the ones at their ends. One long piece is also tokenized in parallel.
# More cuts keep those end blocks small: at every line start in a piece's first _LEAD characters (a template's
# lead-in such as "user\n<tool_response>\n" is cut off, so the text after it is cut as it is on its own), and at
# every line start in its last _LEAD characters plus the one before them (a template's closing text such as
# "\n</tool_response>" is cut off, and so is the text's own last line, which differs by the newline after it).
_SPLIT_AT = 1024
_EVERY = 8
_LEAD = 32
# After "\n", before spaces or tabs and then a printable ASCII character: whitespace that held another newline
# would be one pre-token with the first ("\n \n" is matched whole by `\s*[\r\n]+`).
_LINE_START = re.compile(r"\n(?=[ \t]*[!-~])")


def _byte_level_splits(backend: Any) -> list[str] | None:
    """The regexes of a byte-level BPE tokenizer's Split steps, in order, when its pre-tokenizer only cuts (Splits
    that keep each match whole, then ByteLevel without its prefix space or regex, last) and its normaliser is
    none or NFC (which composes nothing onto a printable ASCII character); else None. A Split given a plain
    string, not a regex, is listed as ""."""
    parts = _bpe_parts(backend)
    if parts is None:
        return None
    steps, normalizer = parts
    if normalizer not in (None, {"type": "NFC"}, {"type": "Sequence", "normalizers": []}):
        return None
    if not steps or steps[-1].get("type") != "ByteLevel":
        return None
    level, splits = steps[-1], steps[:-1]
    if level.get("add_prefix_space") or level.get("use_regex", True):
        return None
    if any(step.get("type") != "Split" or step.get("behavior") != "Isolated" or step.get("invert") for step in splits):
        return None
    return [str((step.get("pattern") or {}).get("Regex") or "") for step in splits]


def _line_safe(backend: Any) -> bool:
    """Whether cutting a piece at line starts leaves its token count unchanged: byte-level BPE whose
    pre-tokenizer only cuts (see ``_byte_level_splits``), one cut a Split with a pattern listed above. Further
    cuts (digits, CJK runs) only add borders."""
    splits = _byte_level_splits(backend)
    return splits is not None and any(pattern in _LINE_SAFE_PATTERNS for pattern in splits)


def _blocks(piece: str, every: int = _EVERY) -> list[str]:
    """``piece`` cut at the line starts chosen by the lines before them (see ``_EVERY``), at those in its first
    and last ``_LEAD`` characters, and at the last one before its last ``_LEAD`` characters."""
    starts = [found.start() + 1 for found in _LINE_START.finditer(piece)]
    tail = len(piece) - _LEAD
    last = bisect.bisect_right(starts, tail) - 1  # the last line start before the tail (its lines are cut too)
    blocks: list[str] = []
    start = line = 0
    for index, at in enumerate(starts):
        if at <= _LEAD or index >= last or zlib.crc32(piece[line:at].encode("utf-8", "surrogatepass")) % every == 0:
            blocks.append(piece[start:at])
            start = at
        line = at
    blocks.append(piece[start:])
    return blocks


# ASCII pieces under the Split patterns below are cut into pre-tokens by this module's own regex (the pattern's
# classes written out for ASCII: letters A-Z a-z, digits 0-9, and what the tokenizer's `\s` matches there: tab,
# LF, VT, FF, CR and space), and each distinct pre-token is encoded once, by the BPE model itself: that is what
# the tokenizer does per pre-token. What it does on top (its own regex engine, byte alignments, an encoding object
# per piece) is most of the time of counting a long prompt.
_S = "\t\n\x0b\x0c\r "
_ASCII_WORDS = (
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\nA-Za-z0-9]?[A-Za-z]+|{digits}| ?[^" + _S + "A-Za-z0-9]+[\r\n]*"
    "|[" + _S + "]*[\r\n]+|[" + _S + "]+(?![^" + _S + "])|[" + _S + "]+"
)
_WORD_PATTERNS = {
    _LLAMA3_SPLIT: _ASCII_WORDS.format(digits="[0-9]{1,3}"),
    _QWEN2_SPLIT: _ASCII_WORDS.format(digits="[0-9]"),
    _QWEN35_SPLIT: _ASCII_WORDS.format(digits="[0-9]"),  # no ASCII character is a mark (\p{M})
}


def _byte_symbols() -> dict[int, str]:
    """Byte-level BPE's symbol for each ASCII byte, as a ``str.translate`` table: printable characters stand for
    themselves, the other bytes are numbered from U+0100 in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [byte for byte in range(256) if byte not in printable]
    return {byte: chr(0x100 + others.index(byte)) for byte in range(128) if byte not in printable}


_BYTE_SYMBOLS = _byte_symbols()


def _word_rule(backend: Any) -> re.Pattern[str] | None:
    """The pre-token regex for ASCII pieces, or None: only for byte-level BPE whose one cut is a Split with a
    pattern listed above (see ``_byte_level_splits``)."""
    splits = _byte_level_splits(backend)
    pattern = _WORD_PATTERNS.get(splits[0]) if splits is not None and len(splits) == 1 else None
    return re.compile(pattern) if pattern is not None else None


class PieceCounter:
    """Counts ``len(tokenizer.encode(text, add_special_tokens=False))`` piece by piece, with a cache."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend  # a tokenizers.Tokenizer
        self._plain: Any = None  # its copy without padding or truncation, made when needed (see _encoder)
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
            if anchor is None and plain and len(self._encoder().encode(content, add_special_tokens=False)) == 1:
                anchor = content
        splitter = _Splitter(patterns) if patterns else None
        self._split = splitter.split if splitter is not None else None
        self._starts = splitter.starts if splitter is not None else None
        self._bound = _byte_bound(backend)
        self.in_blocks = _line_safe(backend)  # long pieces counted block by block (see _SPLIT_AT)
        self._words = _word_rule(backend)  # ASCII pieces counted by pre-tokens (see _word_rule)
        # Every cache is a Memo: bounded, with all of contextkeeper's caches, by the shared byte budget.
        self._word_tokens: Memo[str, int] = Memo("pieces.words", sizer=text_key_size)
        self._anchor = anchor
        self._after: Memo[str, int] = Memo("pieces.after", sizer=text_key_size)
        self._first: Memo[str, int] = Memo("pieces.first", sizer=text_key_size)
        self._alone: Memo[str, int] = Memo("pieces.alone", sizer=text_key_size)
        # Segment counting (see count_segments): counts of whole chunks (the head's apart, its first piece being
        # counted without the anchor), and per segment whether it starts with an added token and whether it
        # cannot end inside one (no suffix of it is a proper prefix of an added token).
        self._chunks: Memo[str, int] = Memo("pieces.chunks", sizer=text_key_size)
        self._heads: Memo[str, int] = Memo("pieces.heads", sizer=text_key_size)
        self._infos: Memo[str, tuple[bool, bool]] = Memo("pieces.infos", sizer=text_key_size)
        self._new_infos: list[tuple[str, tuple[bool, bool]]] | None = None  # infos found in this count
        contents = [content for content, _ in patterns]
        self._prefixes = frozenset(c[:i] for c in contents for i in range(1, len(c)))
        self._first_chars = frozenset(c[0] for c in contents)
        self.fast = self._split is not None and anchor is not None and not self.has_single_word
        # Characters sent to the tokenizer so far (for ASCII text under the pre-token rule: the new pre-tokens
        # handed to its BPE model): what caching saves is visible here.
        self.encoded_chars = 0
        # The previous text and its checkpoints, for resuming; off when tokens swallow whitespace, since such a
        # match has no bounded length.
        self._longest = max((len(content) for content, _ in patterns), default=0)
        self._resumable = all(p is None for _, p in patterns)
        self._last = ""
        self._bounds: list[int] = []
        self._totals: list[int] = []
        # count_segments' previous call: its non-empty segments, where each chunk starts, the tokens before it, total.
        self._segmented: tuple[list[str], list[int], list[int], int] = _NO_SEGMENTS

    # -- counting --------------------------------------------------------------------------------------------
    def _encoder(self) -> Any:
        """The tokenizer to encode with: the caller's, or a private copy of it while the caller's has padding or
        truncation switched on (transformers leaves a call's ``padding=``/``truncation=`` on the shared backend,
        and either would change the lengths)."""
        backend = self._backend
        if getattr(backend, "padding", None) is None and getattr(backend, "truncation", None) is None:
            return backend
        if self._plain is None:
            plain = type(backend).from_str(backend.to_str())
            plain.no_padding()
            plain.no_truncation()
            self._plain = plain
        return self._plain

    def full(self, text: str) -> int:
        """The reference: encode the whole text at once."""
        self.encoded_chars += len(text)
        return len(self._encoder().encode(text, add_special_tokens=False))

    def count(self, text: str) -> int:
        """Exact token count of ``text`` (no special tokens added); resumes from the previous text's checkpoints
        inside the prefix the two share."""
        if not self.fast or self._split is None:
            return self.full(text)
        start, base, kept = self._resume_point(text)
        parts = self._split(text[start:] if start else text)
        counts = [0] * len(parts)
        counts[1::2] = [1] * (len(parts) // 2)  # one token per added-token match
        if parts[0]:  # only at offset 0: a resumed suffix starts on an added token, so its first part is ""
            counts[0] = self._first_piece(parts[0])
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

    def count_segments(self, segments: Sequence[str]) -> int:
        """``count("".join(segments))``, from counts cached per segment.

        Exact: when a segment starts with an added token and the segment before it cannot end inside one (no
        suffix of it is a proper prefix of an added token), no added token of the whole text runs across their
        border, so the whole text's pieces are the two segments' pieces and the counts add up. Other segments are
        joined with the one before them and counted together.

        The chunks of the previous call are remembered with the tokens before each: the runs of segments this
        call shares with it at either end are taken whole, so only the segments in between are looked at."""
        if not self.fast or self._split is None or not self._resumable:
            return self.count("".join(segments))
        texts = [segment for segment in segments if segment]
        old, old_starts, old_before, old_total = self._segmented
        # Chunks [0, resume) and [stop, end) are the previous call's (a chunk border depends only on the two
        # segments beside it, so one inside a shared run is a border here too).
        shared = shared_prefix(texts, old, operator.eq)
        kept = bisect.bisect_left(old_starts, shared) - 1  # the last old chunk that starts inside the shared run
        resume = old_starts[kept] if kept >= 1 else 0
        starts = old_starts[: kept + 1] if kept >= 1 else []
        before = old_before[: kept + 1] if kept >= 1 else []
        total = old_before[kept] if kept >= 1 else 0
        stop, tail = len(texts), 0
        shift = len(texts) - len(old)
        if old and shared < len(texts):
            ended = shared_suffix(texts, old, operator.eq)
            first = bisect.bisect_left(old_starts, len(old) - ended + 1)  # its segment before is shared too
            if first < len(old_starts) and old_starts[first] + shift > resume:
                stop, tail = old_starts[first] + shift, old_total - old_before[first]
        elif old and shared == len(texts) == len(old):
            return old_total
        # The chunks in between: (start, text) of each, counted from the cache or in one batch.
        info_of = self._infos.recent()
        found: list[tuple[int, str]] = []
        begin = resume
        clean = False
        self._new_infos = []
        try:
            for index in range(resume, stop):
                segment = texts[index]
                info = info_of(segment) or self._info(segment)
                if index > begin and info[0] and clean:  # a chunk ends here
                    found.append((begin, texts[begin] if index - begin == 1 else "".join(texts[begin:index])))
                    begin = index
                clean = info[1]
        finally:
            if self._new_infos:
                self._infos.put_many(self._new_infos)
            self._new_infos = None
        if begin < stop:
            found.append((begin, texts[begin] if stop - begin == 1 else "".join(texts[begin:stop])))
        counts = self._count_chunks([(start == 0, chunk) for start, chunk in found])
        for (start, _), tokens in zip(found, counts, strict=True):
            starts.append(start)
            before.append(total)
            total += tokens
        if stop < len(texts):
            for start, tokens_before in zip(old_starts[first:], old_before[first:], strict=True):
                starts.append(start + shift)
                before.append(total + tokens_before - old_before[first])
            total += tail
        self._segmented = (texts, starts, before, total)
        return total

    def _count_chunks(self, chunks: list[tuple[bool, str]]) -> list[int]:
        """Tokens of each chunk (see :meth:`count_segments`), from the caches or with every new piece tokenized in
        one batch. A head chunk's first piece is counted without the anchor."""
        counts: list[int] = []
        misses: list[tuple[int, bool, str, list[str]]] = []
        assert self._split is not None
        for head, chunk in chunks:
            known = (self._heads if head else self._chunks).get(chunk)
            counts.append(known or 0)
            if known is None:
                misses.append((len(counts) - 1, head, chunk, self._split(chunk)))
        found = self._cut_tokens([parts for _, _, _, parts in misses], first=False)
        new_chunks: list[tuple[str, int]] = []
        for (position, head, chunk, parts), tokens in zip(misses, found, strict=True):
            if head:
                if parts[0]:  # text before the head's first added token
                    tokens += self._first_piece(parts[0])
                self._heads.put(chunk, tokens)
            else:
                new_chunks.append((chunk, tokens))
            counts[position] = tokens
        if new_chunks:
            self._chunks.put_many(new_chunks)
        return counts

    def _cut_tokens(self, cuts: list[list[str]], *, first: bool) -> list[int]:
        """Tokens of texts already cut at added tokens (``re.split`` shape): one per match plus each piece's count
        after an added token, the new pieces tokenized in one batch. The text before the first match is counted
        too when ``first``, which is right only where it counts as it would after an added token."""
        start = 0 if first else 2
        pieces: dict[str, int | None] = {}  # the pieces, with their cached counts
        for parts in cuts:
            for piece in parts[start::2]:
                if piece and piece not in pieces:
                    pieces[piece] = self._after.get(piece)
        new = [piece for piece, n in pieces.items() if n is None]
        if new:
            pieces.update(self._encode_new(new))
        return [len(parts) // 2 + sum(pieces[piece] or 0 for piece in parts[start::2] if piece) for parts in cuts]

    def _info(self, segment: str) -> tuple[bool, bool]:
        info = self._infos.get(segment)
        if info is None:
            assert self._starts is not None
            starts = self._starts(segment) is not None
            tail = segment[1 - self._longest :] if self._longest > 1 else ""
            ends_clean = True
            for char in self._first_chars:
                at = tail.find(char)
                while at >= 0 and ends_clean:
                    ends_clean = tail[at:] not in self._prefixes
                    at = tail.find(char, at + 1)
            info = _INFOS[starts, ends_clean]  # shared tuples: an entry holds no tuple of its own
            if self._new_infos is not None:
                self._new_infos.append((segment, info))  # put in one batch when the count is done
            else:
                self._infos.put(segment, info)
        return info

    def _first_piece(self, piece: str) -> int:
        cached = self._first.get(piece)
        if cached is None:
            cached = len(self._encoder().encode(piece, add_special_tokens=False))
            self.encoded_chars += len(piece)
            self._first.put(piece, cached)
        return cached

    def alone(self, text: str) -> int:
        """Tokens of ``text`` encoded on its own, from a cache keyed by the text; the resume state of
        :meth:`count` is left alone, so counting snippets between prompts costs the prompts nothing."""
        cached = self._alone.get(text)
        if cached is None:
            if self.fast and ((self.in_blocks and len(text) >= _SPLIT_AT) or (self._words and text.isascii())):
                return self.alone_many([text])[0]
            cached = len(self._encoder().encode(text, add_special_tokens=False))
            self.encoded_chars += len(text)
            self._alone.put(text, cached)
        return int(cached)

    def bound(self, text: str) -> int | None:
        """An upper bound on :meth:`alone` without tokenizing (UTF-8 bytes, see ``_byte_bound``), or None."""
        return self.bound_many((text,))

    def bound_many(self, texts: Sequence[str]) -> int | None:
        """:meth:`bound` of the texts' concatenation."""
        rule = self._bound
        if rule is None:
            return None
        total = 0
        for text in texts:
            if text.isascii():
                total += len(text)
            elif rule == "ascii":
                return None
            else:
                total += len(text.encode("utf-8"))
        return total

    def alone_many(self, texts: list[str]) -> list[int]:
        """:meth:`alone` of each text; the ones not cached are encoded in one batch (in parallel)."""
        cache = self._alone
        missing = list(dict.fromkeys(t for t in texts if cache.get(t) is None))
        if missing and (self.in_blocks or self._words) and self.fast and self._split is not None:
            # Byte-level BPE without a prefix space: a text's first piece counts as any piece after an added
            # token, so the text is its pieces, and long pieces are their blocks (shared with the prompt's).
            found = self._cut_tokens([self._split(text) for text in missing], first=True)
            cache.put_many(zip(missing, found, strict=True))
        elif missing:
            self.encoded_chars += sum(map(len, missing))
            encoder = self._encoder()
            encode = getattr(encoder, "encode_batch_fast", encoder.encode_batch)
            encodings = encode(missing, add_special_tokens=False)
            cache.put_many((text, len(encoding)) for text, encoding in zip(missing, encodings, strict=True))
        return [self.alone(t) for t in texts]

    def _resume_point(self, text: str) -> tuple[int, int, int]:
        """Where counting ``text`` may start: the last checkpoint of the previous text that lies wholly inside
        the prefix both texts share — ``(offset, tokens before it, checkpoints kept)``, or zeros."""
        last = self._last
        if not last:
            return 0, 0, 0
        shared = _common_prefix(text, last)
        # A token match that starts before the checkpoint ends within the longest token's length of it, so
        # everything the tokenizer decided before it depends only on shared text.
        kept = bisect.bisect_right(self._bounds, shared - self._longest)
        if kept == 0:
            return 0, 0, 0
        return self._bounds[kept - 1], self._totals[kept - 1], kept - 1

    def _encode_new(self, pieces: list[str]) -> dict[str, int]:
        unique = list(dict.fromkeys(pieces))
        words = self._words
        # ASCII pieces are counted by their pre-tokens (see _word_rule); long other pieces by blocks, whose ASCII
        # blocks are counted by pre-tokens again.
        blocks_of: dict[str, list[str]] = {}
        if self.in_blocks:
            blocks_of = {
                piece: _blocks(piece)
                for piece in unique
                if len(piece) >= _SPLIT_AT and (words is None or not piece.isascii())
            }
        todo = unique
        known: dict[str, int | None] = {}  # the blocks' cached counts, read once (the cache may turn over below)
        if blocks_of:
            known = {block: self._after.get(block) for blocks in blocks_of.values() for block in blocks}
            todo = [piece for piece in unique if piece not in blocks_of]
            todo.extend(block for block, n in known.items() if n is None)
        lengths: dict[str, int] = {}
        if words is not None:
            plain = [piece for piece in todo if piece.isascii()]
            if plain:
                lengths.update(zip(plain, self._by_words(plain), strict=True))
                todo = [piece for piece in todo if not piece.isascii()]
        if todo:
            self.encoded_chars += sum(len(p) for p in todo)
            anchor = self._anchor
            assert anchor is not None
            # Only lengths are needed: the "fast" batch call skips computing character offsets where it exists.
            encoder = self._encoder()
            encode = getattr(encoder, "encode_batch_fast", encoder.encode_batch)
            encodings = encode([anchor + p for p in todo], add_special_tokens=False)
            lengths.update((p, len(e) - 1) for p, e in zip(todo, encodings, strict=True))
        for piece, blocks in blocks_of.items():
            lengths[piece] = sum(lengths[block] if block in lengths else known[block] or 0 for block in blocks)
        self._after.put_many(lengths.items())
        return lengths

    def _by_words(self, texts: list[str]) -> list[int]:
        """Tokens of ASCII pieces: the sum of their pre-tokens' counts, each distinct pre-token encoded once (and
        remembered) by the BPE model, as the tokenizer encodes every pre-token."""
        assert self._words is not None
        split = list(map(self._words.findall, texts))
        cache = self._word_tokens
        counts: dict[str, int | None] = {word: cache.get(word) for word in set().union(*split)}
        new = [word for word, n in counts.items() if n is None]
        if new:
            self.encoded_chars += sum(map(len, new))
            tokenize = self._backend.model.tokenize
            found = [(word, len(tokenize(word.translate(_BYTE_SYMBOLS)))) for word in new]
            counts.update(found)
            cache.put_many(found)
        get = cast(Callable[[str], int], counts.__getitem__)  # every value is set by now
        return [sum(map(get, words)) for words in split]

    def fork(self) -> PieceCounter:
        """A counter sharing this one's piece caches (counts depend only on the piece text) with resume state of
        its own. The caches are thread-safe memos; an entry dropped between two threads' reads costs a re-encode,
        never a wrong count."""
        clone = copy.copy(self)
        clone.encoded_chars = 0
        clone._last, clone._bounds, clone._totals = "", [], []
        clone._segmented = _NO_SEGMENTS
        return clone

    # -- self-check ------------------------------------------------------------------------------------------
    def verify(self) -> bool:
        """Check the piece rule against whole-text encoding on probe texts; switch it off if it fails. The block
        and pre-token rules are checked on probes of their own, and switched off alone."""
        if not self.fast:
            return False
        if self._words is not None:
            probes = [text for text in (*_PROBE_TEXTS, _ASCII_PROBE) if text.isascii()]
            if self._by_words(probes) != list(map(self.full, probes)):
                self._words = None
        added = [t.content for t in self._backend.get_added_tokens_decoder().values() if t.content]
        specials = added[:64] + added[-64:]
        samples: list[str] = []
        for i, text in enumerate(_PROBE_TEXTS):
            token = specials[i % len(specials)] if specials else ""
            samples.append(text + token + text + token + " " + text)
            samples.append(token + text + "\n" + token + token + text)
        agree = all(self.count(sample) == self.full(sample) for sample in samples)
        if self.in_blocks:  # and the block rule on a long text of many lines
            text = "\n".join(_PROBE_TEXTS * 8)
            self.in_blocks = sum(map(self.full, _blocks(text, every=1))) == self.full(text)
        self.clear()
        self.fast = agree
        return agree

    def clear(self) -> None:
        self._word_tokens.clear()
        self._chunks.clear()
        self._heads.clear()
        self._infos.clear()
        self._after.clear()
        self._first.clear()
        self._alone.clear()
        self.encoded_chars = 0
        self._last, self._bounds, self._totals = "", [], []
        self._segmented = _NO_SEGMENTS

    @property
    def cached_pieces(self) -> int:
        return len(self._after) + len(self._first)
