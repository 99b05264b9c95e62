"""The counting rules: each one read from the tokenizer's own settings (``applies``), proved against the tokenizer
on probe texts (``verify``), and the counting it makes possible.

A rule that does not apply, or that the tokenizer disproves, is off; counting is then slower, never wrong.
"""

from __future__ import annotations

import bisect
import copy
import json
import re
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, cast

from ..._memo import Memo, text_key_size
from ._split import Splitter, common_prefix

__all__ = ["RULES", "AsciiWords", "ByteBound", "LineBlocks", "Pieces", "Rule", "RuleReport", "Segments", "Tokenizer"]

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


class Tokenizer:
    """A ``tokenizers.Tokenizer`` as the rules read and call it: its added tokens read once, and every encode
    counting the characters it was sent (``chars``: what caching saves)."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self._plain: Any = None  # a copy without padding or truncation, made when needed (see encoder)
        self.chars = 0
        self.added: list[Any] = [token for token in backend.get_added_tokens_decoder().values() if token.content]
        # (content, pattern): lstrip / rstrip tokens swallow the whitespace beside them, which then costs no token.
        self.patterns: list[tuple[str, str | None]] = [(token.content, _swallowing(token)) for token in self.added]
        self.splitter = Splitter(self.patterns) if self.patterns else None
        # A special token that is one token on its own: a piece is counted as it is encoded after it.
        plain = (t.content for t in self.added if t.special and not t.lstrip and not t.rstrip)
        self.anchor = next((c for c in plain if len(self.encoder().encode(c, add_special_tokens=False)) == 1), None)

    def fork(self) -> Tokenizer:
        """The same tokenizer with a character count of its own."""
        clone = copy.copy(self)
        clone.chars = 0
        return clone

    def encoder(self) -> Any:
        """The tokenizer to encode with: the caller's, or a private copy of it while the caller's has padding or
        truncation switched on (transformers leaves a call's ``padding=``/``truncation=`` on the shared backend,
        and either would change the lengths)."""
        backend = self.backend
        if getattr(backend, "padding", None) is None and getattr(backend, "truncation", None) is None:
            return backend
        if self._plain is None:
            plain = type(backend).from_str(backend.to_str())
            plain.no_padding()
            plain.no_truncation()
            self._plain = plain
        return self._plain

    def full(self, text: str) -> int:
        """The reference: tokens of ``text`` encoded at once (no special tokens added)."""
        self.chars += len(text)
        return len(self.encoder().encode(text, add_special_tokens=False))

    def batch(self, texts: list[str], *, after: str = "") -> list[int]:
        """:meth:`full` of each text in one batch (in parallel); with ``after`` (a one-token added token), each
        text's tokens when it follows that token."""
        self.chars += sum(map(len, texts))
        encoder = self.encoder()
        # Only lengths are needed: the "fast" batch call skips computing character offsets where it exists.
        encode = getattr(encoder, "encode_batch_fast", encoder.encode_batch)
        encodings = encode([after + text for text in texts] if after else texts, add_special_tokens=False)
        skip = 1 if after else 0
        return [len(encoding) - skip for encoding in encodings]

    def bpe_lengths(self, words: list[str]) -> list[int]:
        """Tokens of ASCII pre-tokens, each encoded by the BPE model alone (no pre-tokenizer run)."""
        self.chars += sum(map(len, words))
        tokenize = self.backend.model.tokenize
        return [len(tokenize(word.translate(_BYTE_SYMBOLS))) for word in words]


def _swallowing(token: Any) -> str | None:
    if not (token.lstrip or token.rstrip):
        return None
    content = re.escape(str(token.content))
    return (r"\s*" if token.lstrip else "") + content + (r"\s*" if token.rstrip else "")


def _samples(tokenizer: Tokenizer) -> list[str]:
    """The probe texts around added tokens (the first 64 and the last 64, in turn): after one, before one, two
    in a row, at the start."""
    added = [token.content for token in tokenizer.added]
    specials = added[:64] + added[-64:]
    samples: list[str] = []
    for i, text in enumerate(_PROBE_TEXTS):
        token = specials[i % len(specials)] if specials else ""
        samples.append(text + token + text + token + " " + text)
        samples.append(token + text + "\n" + token + token + text)
    return samples


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


# -- the rules ---------------------------------------------------------------------------------------------------
class Rule(ABC):
    """One way of counting faster than encoding the whole text, exact where it holds."""

    name: ClassVar[str]
    claim: ClassVar[str]  # what it asserts of the tokenizer, in a few words
    needs: ClassVar[tuple[str, ...]] = ("pieces",)  # rules it composes with: off when they are

    memos: tuple[Memo[str, Any], ...] = ()  # what it caches

    @abstractmethod
    def __init__(self, tokenizer: Tokenizer) -> None:
        """Built only for a tokenizer it applies to (see :meth:`applies`)."""

    @classmethod
    def applies(cls, tokenizer: Tokenizer) -> bool:
        """Whether the tokenizer's own settings allow the rule."""
        return cls.refusal(tokenizer) is None

    @classmethod
    @abstractmethod
    def refusal(cls, tokenizer: Tokenizer) -> str | None:
        """Why the tokenizer's settings rule it out, or None."""

    @abstractmethod
    def verify(self, tokenizer: Tokenizer) -> bool:
        """Whether the tokenizer agrees with the rule on its probe texts."""

    def clear(self) -> None:
        """Forget what the rule cached."""
        for memo in self.memos:
            memo.clear()


class Pieces(Rule):
    """A text's tokens are one per added-token match plus each piece's own: the tokenizer cuts at added tokens
    before anything else. A piece is counted as it is encoded after an added token (the anchor), except the piece
    at the very start, which some SentencePiece tokenizers prefix with a space."""

    name = "pieces"
    claim = "a text counts as its pieces between added tokens"
    needs = ()

    @classmethod
    def refusal(cls, tokenizer: Tokenizer) -> str | None:
        if tokenizer.splitter is None:
            return "the tokenizer has no added tokens to cut at"
        if any(token.single_word for token in tokenizer.added):
            return "a single_word added token matches only between word borders, so cuts depend on the text beside"
        if tokenizer.anchor is None:
            return "no special added token encodes to one token, so there is none to count pieces after"
        return None

    def __init__(self, tokenizer: Tokenizer) -> None:
        assert tokenizer.splitter is not None
        assert tokenizer.anchor is not None
        self.split = tokenizer.splitter.split
        self.anchor = tokenizer.anchor
        self._first: Memo[str, int] = Memo("pieces.first", sizer=text_key_size)
        self.memos = (self._first,)

    def first(self, piece: str, tokenizer: Tokenizer) -> int:
        """Tokens of the piece at the start of a text (encoded alone), from a cache."""
        cached = self._first.get(piece)
        if cached is None:
            cached = tokenizer.full(piece)
            self._first.put(piece, cached)
        return cached

    def after(self, pieces: list[str], tokenizer: Tokenizer) -> list[int]:
        """Tokens of each piece after an added token, in one batch."""
        return tokenizer.batch(pieces, after=self.anchor)

    def verify(self, tokenizer: Tokenizer) -> bool:
        cuts = [self.split(sample) for sample in _samples(tokenizer)]
        pieces = list(dict.fromkeys(piece for parts in cuts for piece in parts[2::2] if piece))
        after = dict(zip(pieces, self.after(pieces, tokenizer), strict=True))
        for parts in cuts:
            first = tokenizer.full(parts[0]) if parts[0] else 0
            counted = len(parts) // 2 + first + sum(after[piece] for piece in parts[2::2] if piece)
            if counted != tokenizer.full("".join(parts)):
                return False
        return True

    @property
    def cached(self) -> int:
        return len(self._first)


_INFOS = {(a, b): (a, b) for a in (False, True) for b in (False, True)}


class Segments(Rule):
    """A border before an added token depends only on the text near it: where a segment starts with an added
    token and the one before cannot end inside one (no suffix of it is a proper prefix of an added token), the
    two count apart; and a text that shares a prefix with the previous one resumes from the last added token
    wholly inside that prefix."""

    name = "segments"
    claim = "a text cut before an added token counts as its two sides"

    @classmethod
    def refusal(cls, tokenizer: Tokenizer) -> str | None:
        if any(pattern is not None for _, pattern in tokenizer.patterns):
            return "an added token strips the whitespace beside it (lstrip/rstrip), so a match has no bounded length"
        return None

    def __init__(self, tokenizer: Tokenizer) -> None:
        assert tokenizer.splitter is not None
        contents = [content for content, _ in tokenizer.patterns]
        self.starts = tokenizer.splitter.starts  # an added token at offset 0
        self.longest = max(map(len, contents))
        self._prefixes = frozenset(c[:i] for c in contents for i in range(1, len(c)))
        self._first_chars = frozenset(c[0] for c in contents)
        # Per segment: whether it starts with an added token, whether it cannot end inside one.
        self._infos: Memo[str, tuple[bool, bool]] = Memo("pieces.infos", sizer=text_key_size)
        self.memos = (self._infos,)

    def ends_clean(self, segment: str) -> bool:
        """Whether no suffix of ``segment`` is a proper prefix of an added token."""
        tail = segment[1 - self.longest :] if self.longest > 1 else ""
        for char in self._first_chars:
            at = tail.find(char)
            while at >= 0:
                if tail[at:] in self._prefixes:
                    return False
                at = tail.find(char, at + 1)
        return True

    def info(self, segment: str, new: list[tuple[str, tuple[bool, bool]]]) -> tuple[bool, bool]:
        """(starts with an added token, ends clean), from the cache; a new one is added to ``new``."""
        info = self._infos.get(segment)
        if info is None:
            info = _INFOS[self.starts(segment) is not None, self.ends_clean(segment)]  # shared tuples
            new.append((segment, info))
        return info

    def chunks(self, texts: Sequence[str], begin: int, stop: int) -> list[tuple[int, str]]:
        """``texts[begin:stop]`` joined into chunks that count apart: (index of the first segment, text)."""
        info_of = self._infos.recent()
        new: list[tuple[str, tuple[bool, bool]]] = []
        found: list[tuple[int, str]] = []
        clean = False
        try:
            for index in range(begin, stop):
                segment = texts[index]
                info = info_of(segment) or self.info(segment, new)
                if index > begin and info[0] and clean:  # a chunk ends here
                    found.append((begin, _joined(texts, begin, index)))
                    begin = index
                clean = info[1]
        finally:
            if new:
                self._infos.put_many(new)  # in one batch: the cache's bookkeeping once per count
        if begin < stop:
            found.append((begin, _joined(texts, begin, stop)))
        return found

    def resume_point(self, text: str, last: str, bounds: list[int], totals: list[int]) -> tuple[int, int, int]:
        """Where counting ``text`` may start, given the previous text and its checkpoints (offsets of its added
        tokens, tokens before each): the last checkpoint wholly inside the prefix both texts share —
        ``(offset, tokens before it, checkpoints kept)``, or zeros."""
        if not last:
            return 0, 0, 0
        shared = common_prefix(text, last)
        # A token match that starts before the checkpoint ends within the longest token's length of it, so
        # everything the tokenizer decided before it depends only on shared text.
        kept = bisect.bisect_right(bounds, shared - self.longest)
        if kept == 0:
            return 0, 0, 0
        return bounds[kept - 1], totals[kept - 1], kept - 1

    def verify(self, tokenizer: Tokenizer) -> bool:
        assert tokenizer.splitter is not None
        for sample in _samples(tokenizer):
            parts = tokenizer.splitter.split(sample)
            whole = tokenizer.full(sample)
            at = 0
            for index, part in enumerate(parts):
                cut = at > 0 and index % 2 == 1 and self.ends_clean(sample[:at])
                if cut and tokenizer.full(sample[:at]) + tokenizer.full(sample[at:]) != whole:
                    return False
                at += len(part)
        return True


def _joined(texts: Sequence[str], start: int, stop: int) -> str:
    return texts[start] if stop - start == 1 else "".join(texts[start:stop])


class LineBlocks(Rule):
    """A long piece counts as its blocks cut at line starts (see ``_LINE_SAFE_PATTERNS``)."""

    name = "blocks"
    claim = "a piece counts as its blocks cut at line starts"

    @classmethod
    def refusal(cls, tokenizer: Tokenizer) -> str | None:
        if not _line_safe(tokenizer.backend):
            return "the pre-tokenizer is not byte-level BPE cut by a pattern under which a line start is a border"
        return None

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.size = _SPLIT_AT

    def cut(self, piece: str, every: int = _EVERY) -> list[str]:
        """The piece's blocks (see ``_blocks``)."""
        return _blocks(piece, every)

    def verify(self, tokenizer: Tokenizer) -> bool:
        text = "\n".join(_PROBE_TEXTS * 8)  # a long text of many lines, cut at every line start
        return sum(map(tokenizer.full, self.cut(text, every=1))) == tokenizer.full(text)


class AsciiWords(Rule):
    """An ASCII piece counts as its pre-tokens (cut by this module's regex), each encoded by the BPE model."""

    name = "words"
    claim = "an ASCII piece counts as its pre-tokens"

    @classmethod
    def refusal(cls, tokenizer: Tokenizer) -> str | None:
        if _word_rule(tokenizer.backend) is None:
            return "the pre-tokenizer is not byte-level BPE with one Llama 3, Qwen2 or Qwen3.5 split pattern"
        return None

    def __init__(self, tokenizer: Tokenizer) -> None:
        words = _word_rule(tokenizer.backend)
        assert words is not None
        self.findall = words.findall
        self._tokens: Memo[str, int] = Memo("pieces.words", sizer=text_key_size)
        self.memos = (self._tokens,)

    def count(self, texts: list[str], tokenizer: Tokenizer) -> list[int]:
        """Tokens of ASCII pieces: the sum of their pre-tokens' counts, each distinct pre-token encoded once (and
        remembered) by the BPE model, as the tokenizer encodes every pre-token."""
        split = list(map(self.findall, texts))
        cache = self._tokens
        counts: dict[str, int | None] = {word: cache.get(word) for word in set().union(*split)}
        new = [word for word, n in counts.items() if n is None]
        if new:
            found = list(zip(new, tokenizer.bpe_lengths(new), strict=True))
            counts.update(found)
            cache.put_many(found)
        get = cast(Callable[[str], int], counts.__getitem__)  # every value is set by now
        return [sum(map(get, words)) for words in split]

    def verify(self, tokenizer: Tokenizer) -> bool:
        probes = [text for text in (*_PROBE_TEXTS, _ASCII_PROBE) if text.isascii()]
        return self.count(probes, tokenizer) == list(map(tokenizer.full, probes))


class ByteBound(Rule):
    """A text has at most as many tokens as UTF-8 bytes (``kind`` ``"any"``) or, ASCII text only, characters
    (``"ascii"``): an upper bound without tokenizing (see ``_byte_bound``)."""

    name = "bound"
    claim = "a text has at most one token per UTF-8 byte"
    needs = ()

    @classmethod
    def refusal(cls, tokenizer: Tokenizer) -> str | None:
        if _byte_bound(tokenizer.backend) is None:
            return "not byte-level BPE whose pre-tokenizer only cuts and whose normaliser keeps the length"
        return None

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.kind = _byte_bound(tokenizer.backend)

    def bound(self, texts: Iterable[str]) -> int | None:
        """The bound for the texts' concatenation, or None (non-ASCII text under ``"ascii"``)."""
        total = 0
        for text in texts:
            if text.isascii():
                total += len(text)
            elif self.kind == "ascii":
                return None
            else:
                total += len(text.encode("utf-8"))
        return total

    def verify(self, tokenizer: Tokenizer) -> bool:
        for text in (*_PROBE_TEXTS, _ASCII_PROBE, *_samples(tokenizer)):
            most = self.bound((text,))
            if most is not None and tokenizer.full(text) > most:
                return False
        return True


# In build order: a rule comes after the rules it needs.
RULES: tuple[type[Rule], ...] = (Pieces, Segments, LineBlocks, AsciiWords, ByteBound)


@dataclass(frozen=True)
class RuleReport:
    """Which counting rules are on for a tokenizer, and why each other one is off."""

    on: tuple[str, ...]
    off: tuple[tuple[str, str], ...]  # (rule, why)
    verified: bool  # proved against the tokenizer (else only read from its settings)

    def why_off(self, name: str) -> str | None:
        return dict(self.off).get(name)

    def __str__(self) -> str:
        lines = [f"on: {', '.join(self.on) or 'none'}" + ("" if self.verified else " (not verified yet)")]
        lines += [f"off: {name}: {why}" for name, why in self.off]
        return "\n".join(lines)
