"""The counting rules: each one read from the tokenizer's own settings (``applies``), proved against the tokenizer
on probe texts (``verify``), and the counting it makes possible.

A rule that does not apply, or that the tokenizer disproves, is off; counting is then slower, never wrong.
"""

from __future__ import annotations

import bisect
import codecs
import copy
import functools
import itertools
import json
import re
import string
import unicodedata
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, cast

from ..._memo import Memo, memoize, text_key_size
from ._split import Splitter, common_prefix

__all__ = [
    "RULES",
    "AsciiWords",
    "ByteBound",
    "DeepSeekWords",
    "LineBlocks",
    "Pieces",
    "Rule",
    "RuleReport",
    "Segments",
    "SpaceWords",
    "Tokenizer",
    "UnicodeWords",
]

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

# Text of every covered script, written for these probes: words, digits, punctuation and spacing of each, and
# the mixtures a prompt holds (code and JSON with non-ASCII strings, decomposed accents, no-break spaces).
_SCRIPT_PROBES = (
    "Le déploiement a échoué après le délai ; l'équipe l'a annulé. Größe, Straße, Übersicht — año, niño, żółć.",
    "Tiếng Việt: yêu cầu thất bại vì dịch vụ trả về lỗi sau khi hết thời gian chờ đợi.",
    "Το αίτημα απέτυχε μετά το χρονικό όριο· ἀρχὴ ἥμισυ παντός; ΟΚ, «έλεγχος».",
    "Запрос завершился ошибкой после таймаута: «503», ёж, їжак, ґанок, Ё-моё! Ъ.",
    "Բարև ձեզ, ինչպե՞ս եք։ שלום עולם, הבקשה נכשלה. עִבְרִית",
    "فشل الطلب بعد انتهاء المهلة، وقمنا بالتراجع عن النشر؟ ١٢٣٫٤٥ مُحَمَّد ۱۲۳",
    "अनुरोध विफल हुआ क्योंकि सेवा ने त्रुटि लौटाई। १२३४ क़लम, ज़रूर",
    "বাংলা ভাষা ১২৩। ਪੰਜਾਬੀ ਬੋਲੀ। ગુજરાતી ભાષા। ଓଡ଼ିଆ ଭାଷା। தமிழ் மொழி ௧௨௩. తెలుగు భాష. ಕನ್ನಡ ಭಾಷೆ. മലയാളം ഭാഷ.",
    "คำขอล้มเหลวเพราะหมดเวลา ๑๒๓ ครั้ง ฯลฯ ๆ",
    "გამარჯობა, მსოფლიო! 요청이 시간 초과로 실패했습니다. 다시 시도하세요? ᄀᄁᄂ",
    "リクエストがタイムアウトで失敗しました。ﾃｽﾄ、ひらがな「引用」『二重』〜ー・",
    "请求因为上游服务超时而失败，我们已经回滚了部署。（全角：１２３ＡＢＣ！）㐀㐁",
    "€ 12,50 → £ ≥ ± ∑ ∞ √ ≠ ✓ ☐ ★ ─│┌┐└┘├┤ ░▒▓ “quoted” ‘single’ … • ‰ ™ © ® ¿¡ §¶ °C ½ ² ⁿ ₂ Ⅻ ①",
    "a\u00a0b\u2009c\u3000d\u2028e\u202ff  \u3000\u3000\n\u00a0\n\u2003x \u0085y\u200bz\u200d",
    "cafe\u0301 nai\u0308ve n\u0303 o\u0302\u0323 \u0301\u0301 x\u0300\u0327",
    '{"名前": "値", "ключ": [1, 2.5, "три"], "note": "¿qué?"}\n    return "Ошибка"  # комментарий\n',
    "l'été c'est don't it's ſ'S 'ſ 'Ｓ 'ｓ we'ＬＬ ǅ'ǆ",
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

    def bpe_lengths(self, words: list[str], *, symbols: Callable[[str], str] | None = None) -> list[int]:
        """Tokens of pre-tokens, each mapped to its symbols (default: its byte-level ones) and encoded by the BPE
        model alone (no normaliser or pre-tokenizer run)."""
        self.chars += sum(map(len, words))
        tokenize = self.backend.model.tokenize
        return [len(tokenize(symbol)) for symbol in map(symbols or _symbols, words)]


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


# A normaliser that does nothing (DeepSeek's tokenizer.json has one).
_NO_NORMALIZER = {"type": "Sequence", "normalizers": []}
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
    or None (unknown). True for BPE whose pre-tokenizer only cuts: its first symbols are the bytes (byte-level
    BPE) or the characters (each one symbol, or with byte fallback at most its bytes, or one unknown), a merge
    only joins symbols, and an added token is one token for at least one character. The normaliser must then not
    lengthen the text: none does not, nor does an empty Sequence, nor a Replace of one character by one that is a
    single symbol (Gemma's spaces by "▁"); NFC leaves ASCII text as it is."""
    parts = _bpe_parts(backend)
    if parts is None:
        return None
    steps, normalizer = parts
    if any(step.get("type") not in _CUTTING or step.get("add_prefix_space") for step in steps if step):
        return None
    if normalizer is None or normalizer == _NO_NORMALIZER or _one_for_one(normalizer, backend):
        return "any"
    if normalizer.get("type") == "NFC":
        return "ascii"
    return None


def _one_for_one(normalizer: dict[str, Any], backend: Any) -> bool:
    """Whether ``normalizer`` replaces one character by one character that is a token of its own (so each
    replaced character still makes at most one symbol)."""
    pattern, content = normalizer.get("pattern") or {}, normalizer.get("content")
    if normalizer.get("type") != "Replace" or set(pattern) != {"String"} or not isinstance(content, str):
        return False
    if len(pattern["String"]) != 1 or len(content) != 1:
        return False
    try:
        return backend.token_to_id(content) is not None
    except Exception:
        return False


def _space_words(backend: Any) -> str | None:
    """The symbol the normaliser writes for a space, when a BPE tokenizer encodes a text as one word: it replaces
    each space by one symbol (Gemma's "▁") and its pre-tokenizer cuts nothing (none, or a Split on the space,
    which the normaliser has already replaced), and its model joins no word-level extras (no merges skipped for
    words in the vocabulary, no subword prefix or word suffix). Else None."""
    parts = _bpe_parts(backend)
    if parts is None:
        return None
    steps, normalizer = parts
    if normalizer is None or not _one_for_one(normalizer, backend) or normalizer["pattern"]["String"] != " ":
        return None
    if any(step and (step.get("type") != "Split" or step.get("pattern") != {"String": " "}) for step in steps):
        return None
    model = backend.model
    if getattr(model, "ignore_merges", True) or getattr(model, "continuing_subword_prefix", None):
        return None
    if getattr(model, "end_of_word_suffix", None):
        return None
    return str(normalizer["content"])


def _borders(vocabulary: Sequence[str], symbol: str) -> tuple[str, bool]:
    """What the vocabulary says of cutting before a ``symbol`` and around newlines: the characters after which a
    ``symbol`` starts no cut (those some token holds right before it), and whether no token holds a newline beside
    another character (so runs of newlines are words of their own)."""
    # Regexes over the vocabulary joined once by NUL (a loop over Gemma's 262,144 tokens takes 0.2 s). Tokens that
    # hold a NUL themselves, if any, are looked at apart.
    joined = "\x00".join(vocabulary)
    odd = [token for token in vocabulary if "\x00" in token] if joined.count("\x00") >= len(vocabulary) else []
    found = set(re.findall(f"([^\\x00{re.escape(symbol)}]){re.escape(symbol)}", joined))
    for token in odd:
        found.update(token[i - 1] for i in range(1, len(token)) if token[i] == symbol)
    mixed = re.search("[^\n\x00]\n|\n[^\n\x00]", joined) or any("\n" in t and t.strip("\n") for t in odd)
    return "".join(sorted(found - {symbol})), not mixed


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
# DeepSeek V3 and later (V3.1, V4): a Sequence of three Splits, each run on every piece the one before made and
# keeping its matches and the gaps between them as pieces (Isolated): runs of up to three numbers, runs of CJK
# ideographs (U+4E00-U+9FA5) and kana, then the word pattern (its file holds real CR and LF characters).
_DEEPSEEK_DIGITS = r"\p{N}{1,3}"
_DEEPSEEK_KANA = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_DEEPSEEK_WORDS = (
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
    "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"
)
_DEEPSEEK_SPLITS = (_DEEPSEEK_DIGITS, _DEEPSEEK_KANA, _DEEPSEEK_WORDS)
_LINE_SAFE_PATTERNS = frozenset({_LLAMA3_SPLIT, _QWEN2_SPLIT, _QWEN35_SPLIT, _DEEPSEEK_WORDS})
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
    if normalizer not in (None, {"type": "NFC"}, _NO_NORMALIZER):
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


# Pieces under the Split patterns below are cut into pre-tokens by this module's own regex: the pattern with its
# Unicode classes written out as character classes (Python's `re` has no `\p{..}`), and each distinct pre-token is
# encoded once, by the BPE model itself: that is what the tokenizer does per pre-token. What it does on top (its
# own regex engine, byte alignments, an encoding object per piece) is most of the time of counting a long prompt.
_WORD_SPLITS = frozenset({_LLAMA3_SPLIT, _QWEN2_SPLIT, _QWEN35_SPLIT})
# What `\s` matches in the tokenizer's regex engine (Oniguruma, on UTF-8): Unicode's White_Space, that is tab to CR,
# NEL and the space, line and paragraph separators. Python's `str.isspace` adds U+001C-U+001F; Oniguruma does not.
_SPACE_CODES = frozenset({0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x85})
_SPACE_CATEGORIES = frozenset({"Zs", "Zl", "Zp"})
_ESCAPES = re.compile(r"\\(p\{(\w)\}|[sS]|.)|(\[\^?)|(\])")


def _char_class(chars: str) -> str:
    """``chars`` (sorted) as the inside of a regex character class: runs as ranges, every character escaped."""
    out: list[str] = []
    start = previous = -2
    for code in map(ord, chars):
        if code != previous + 1:
            if start >= 0:
                out.append(_range(start, previous))
            start = code
        previous = code
    if start >= 0:
        out.append(_range(start, previous))
    return "".join(out)


def _range(first: int, last: int) -> str:
    return f"\\u{first:04x}" if first == last else f"\\u{first:04x}-\\u{last:04x}"


@dataclass(frozen=True)
class _Classes:
    r"""Characters sorted into the split patterns' classes, each a sorted string: letters (`\p{L}`), numbers
    (`\p{N}`), marks (`\p{M}`), whitespace (`\s`, as Oniguruma has it), and the rest of ``chars``."""

    chars: str
    letters: str
    numbers: str
    marks: str
    spaces: str
    others: str

    @classmethod
    def of(cls, chars: str) -> _Classes:
        """The characters of ``chars`` (sorted, distinct) that this Python's unicodedata has assigned, by class."""
        groups: dict[str, list[str]] = {"L": [], "N": [], "M": [], "s": [], "": []}
        kept: list[str] = []
        at = 0
        # By runs of one category (a block of ideographs is one run): the loop is per run, not per character.
        for category, run in itertools.groupby(map(unicodedata.category, chars)):
            end = at + len(list(run))
            block, at = chars[at:end], end
            if category == "Cn":
                continue
            kept.append(block)
            if category in _SPACE_CATEGORIES:
                groups["s"].append(block)
            elif category == "Cc":
                groups["s"].extend(c for c in block if ord(c) in _SPACE_CODES)
                groups[""].extend(c for c in block if ord(c) not in _SPACE_CODES)
            else:
                groups.get(category[0], groups[""]).append(block)
        return cls("".join(kept), *("".join(groups[key]) for key in ("L", "N", "M", "s", "")))  # still sorted

    @functools.cached_property
    def punctuation(self) -> str:
        r"""The characters of ``others`` in `\p{P}`."""
        return "".join(c for c in self.others if unicodedata.category(c)[0] == "P")

    @functools.cached_property
    def symbols(self) -> str:
        r"""The characters of ``others`` in `\p{S}`."""
        return "".join(c for c in self.others if unicodedata.category(c)[0] == "S")

    @functools.cached_property
    def formats(self) -> str:
        """The characters of ``others`` in neither: controls that are not whitespace, and format characters."""
        return "".join(c for c in self.others if unicodedata.category(c)[0] not in "PS")

    def written_out(self, pattern: str, cut: str = "") -> str:
        r"""``pattern`` for Python's `re`: `\p{L}`, `\p{N}`, `\p{M}`, `\p{P}`, `\p{S}` and `\s` as classes of these
        characters, `\S` as the class of all other characters. Right for text of ``chars`` only.

        With ``cut`` (sorted characters that an earlier split has already cut into pieces of their own): the
        pattern as it runs on the pieces between them. No class matches a character of ``cut``, and neither does
        `\S`, so a look-ahead `(?!\S)` sees one as the end of the piece it is."""
        inside = {
            "L": self.letters,
            "N": self.numbers,
            "M": self.marks,
            "P": self.punctuation,
            "S": self.symbols,  # `\p{S}`; `\S` is written out below
            "s": self.spaces,
        }
        cut_class = _char_class(cut)
        if cut:
            drop = re.compile(f"[{cut_class}]+").sub
            inside = {key: drop("", chars) for key, chars in inside.items()}
        bodies: dict[str, str] = {}  # each class written out once (a pattern may name one several times)
        in_class = False

        def replace(found: re.Match[str]) -> str:
            nonlocal in_class
            escape, name, opening, closing = found.groups()
            if opening or closing:
                in_class = bool(opening)
                # A negated class must not match a cut character either.
                return "[^" + cut_class if opening == "[^" else found.group()
            if escape == "S":
                assert not in_class, "\\S inside a class is not written out"
                return "[^" + _char_class("".join(sorted(self.spaces + cut))) + "]"
            key = name or escape
            if key not in inside:
                return found.group()  # another escape (\r, \n, ...): the same in both engines
            if key not in bodies:
                bodies[key] = _char_class(inside[key])
            body = bodies[key]
            return body if in_class else f"[{body}]" if body else "(?!)"

        return _ESCAPES.sub(replace, pattern)


_ASCII = _Classes.of("".join(map(chr, range(128))))
# The non-ASCII characters the pre-token rule counts: these blocks of the BMP, as far as this Python's unicodedata
# has their characters assigned (a character it does not know may be a letter to the tokenizer). A piece with any
# other character (emoji, other planes, other blocks) goes to the tokenizer.
_COVERED_BLOCKS = (
    (0x0080, 0x02FF),  # Latin-1 Supplement, Latin Extended-A and -B, IPA Extensions, Spacing Modifier Letters
    (0x0300, 0x036F),  # Combining Diacritical Marks
    (0x0370, 0x03FF),  # Greek and Coptic
    (0x0400, 0x052F),  # Cyrillic, Cyrillic Supplement
    (0x0530, 0x05FF),  # Armenian, Hebrew
    (0x0600, 0x06FF),  # Arabic
    (0x0750, 0x077F),  # Arabic Supplement
    (0x0900, 0x0D7F),  # Devanagari, Bengali, Gurmukhi, Gujarati, Oriya, Tamil, Telugu, Kannada, Malayalam
    (0x0E00, 0x0E7F),  # Thai
    (0x10A0, 0x11FF),  # Georgian, Hangul Jamo
    (0x1E00, 0x1FFF),  # Latin Extended Additional (Vietnamese), Greek Extended
    (0x2000, 0x2BFF),  # punctuation, super- and subscripts, currency, letterlike, arrows, maths, box drawing, shapes
    (0x3000, 0x30FF),  # CJK Symbols and Punctuation, Hiragana, Katakana
    (0x3400, 0x4DBF),  # CJK Unified Ideographs Extension A
    (0x4E00, 0x9FFF),  # CJK Unified Ideographs
    (0xAC00, 0xD7AF),  # Hangul Syllables
    (0xFF00, 0xFFEF),  # Halfwidth and Fullwidth Forms
)


@dataclass(frozen=True)
class _Coverage:
    """The characters the pre-token rule covers (ASCII and ``_COVERED_BLOCKS``), sorted into classes; a regex that
    finds any other character; and the text that proves the classes against a tokenizer's own split."""

    classes: _Classes
    uncovered: re.Pattern[str]
    probe: str


@memoize("pieces.coverage", sizer=lambda key, coverage: 4 * len(coverage.classes.chars) + 4 * len(coverage.probe))
def _coverage() -> _Coverage:
    """Built once per process (tens of milliseconds: every covered character's category is read)."""
    blocks = [range(128), *(range(first, last + 1) for first, last in _COVERED_BLOCKS)]
    classes = _Classes.of("".join(map(chr, itertools.chain.from_iterable(blocks))))
    return _Coverage(classes, re.compile(f"[^{_char_class(classes.chars)}]"), _class_probe(classes))


def _class_probe(classes: _Classes) -> str:
    """A text on which a regex cuts alike with our classes and with the tokenizer's only if every covered
    character is in the same class in both: each class as one run after an ASCII character of it (a run breaks
    where a character is of another class), numbers also between letters (which they would join as letters),
    the characters a contraction could match case-insensitively after an apostrophe, and runs of ASCII."""
    non_ascii = {name: _beyond(getattr(classes, name), "\x7f") for name in _CLASS_NAMES}
    # Letters whose case folding starts with a contraction's letter; ideographs and syllabaries (from U+3000 to the
    # fullwidth forms) have no case.
    cased = non_ascii["letters"]
    cased = cased[: bisect.bisect_left(cased, "\u3000")] + _beyond(cased, "\ufeff")
    folding = [char for char in cased if char.casefold()[0] in "strevmld"]
    contractions = " ".join(f"'{c} '{c}e 'r{c} 'v{c} '{c}l 'l{c} x'{c}" for c in folding)
    return "\n".join(
        (
            "x" + non_ascii["letters"],
            "x" + non_ascii["marks"],
            "." + non_ascii["others"],
            " " + non_ascii["spaces"] + "x " + non_ascii["spaces"] + "\n" + non_ascii["spaces"],
            "x" + "x".join(non_ascii["numbers"]) + "x",
            "1" + non_ascii["numbers"],
            contractions,
            _ASCII_PROBE,
        )
    )


_CLASS_NAMES = ("letters", "numbers", "marks", "spaces", "others")


def _beyond(chars: str, last: str) -> str:
    """The characters of sorted ``chars`` after ``last``."""
    return chars[bisect.bisect_right(chars, last) :]


def _byte_symbols() -> str:
    """Byte-level BPE's symbol for each byte, as a 256-character decoding table: printable characters stand for
    themselves, the other bytes are numbered from U+0100 in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    others = iter(range(0x100, 0x200))
    return "".join(chr(byte) if byte in printable else chr(next(others)) for byte in range(256))


_BYTE_SYMBOLS = _byte_symbols()


def _symbols(word: str) -> str:
    """The byte-level symbols of ``word``'s UTF-8 bytes, as the tokenizer's ByteLevel step writes them (a charmap
    decode: thirty times faster than ``str.translate`` on CJK text)."""
    return codecs.charmap_decode(word.encode("utf-8"), "strict", _BYTE_SYMBOLS)[0]


def _word_split(backend: Any) -> str | None:
    """The one Split pattern of a byte-level BPE tokenizer when the pre-token rules know it, else None."""
    splits = _byte_level_splits(backend)
    return splits[0] if splits is not None and len(splits) == 1 and splits[0] in _WORD_SPLITS else None


@memoize("pieces.unicode_words", sizer=lambda key, regex: 8 * len(regex.pattern) + 65536)
def _unicode_words(pattern: str) -> re.Pattern[str]:
    """The pre-token regex for pieces of covered characters under one of the Split patterns listed above."""
    return re.compile(_coverage().classes.written_out(pattern))


def _word_rule(backend: Any) -> re.Pattern[str] | None:
    """The pre-token regex for ASCII pieces, or None: only for byte-level BPE whose one cut is a Split with a
    pattern listed above (see ``_byte_level_splits``)."""
    pattern = _word_split(backend)
    return re.compile(_ASCII.written_out(pattern)) if pattern is not None else None


def _deepseek_split(backend: Any) -> bool:
    """Whether the pre-tokenizer is DeepSeek V3's three Splits, then ByteLevel (see ``_byte_level_splits``)."""
    return _byte_level_splits(backend) == list(_DEEPSEEK_SPLITS)


def _class(chars: str, then: str = "") -> str:
    """``chars`` (sorted) as a regex character class followed by ``then``; "" when there are none."""
    return f"[{_char_class(chars)}]{then}" if chars else ""


def _deepseek_pattern(classes: _Classes) -> str:
    r"""DeepSeek's three splits in sequence as one regex for Python's `re`, right for text of ``classes.chars``:
    its matches, in order, are the pieces the last split makes (the pre-tokens). One regex can, because which
    piece of the first two splits a character falls in is told by the character alone:

    - A number is matched only by the first alternative, in runs of up to three from the start of a run of
      numbers, as the first split cuts it: no later alternative matches one.
    - So is a CJK ideograph or kana (the second split's class): a run of them is one piece of the second split,
      and on it the word pattern matches letters and marks (after an optional mark or format character), or
      punctuation and symbols; it holds no whitespace, no ASCII, and nothing else.
    - On the pieces between them, the word pattern itself, written out with those characters cut
      (``_Classes.written_out``): no class matches one, and `(?!\S)` sees one as the end of the piece.
    - Where the word pattern matches nothing (a control or format character that is not the optional prefix of
      a letter or mark after it), the run of such positions is a piece of its own, as Isolated keeps a gap."""
    kana = re.compile(_DEEPSEEK_KANA)
    numbers, marks, formats = classes.numbers, classes.marks, classes.formats
    words = _merged(classes.letters, marks)
    signs = _merged(classes.punctuation, classes.symbols)
    kana_words, other_words = _class("".join(kana.findall(words))), _class(kana.sub("", words))
    kana_formats, other_formats = "".join(kana.findall(formats)), kana.sub("", formats)
    alternatives = [
        _class(numbers, "{1,3}"),
        classes.written_out(_DEEPSEEK_WORDS, _merged("".join(kana.findall(classes.chars)), numbers)),
        kana_words and _class("".join(kana.findall(_merged(marks, formats))), "?") + kana_words + "+",
        _class("".join(kana.findall(signs)), "+"),
        # The gaps: runs of format characters, each not followed by a letter or mark of its own piece.
        kana_formats and f"(?:{_class(kana_formats)}(?!{kana_words or '(?!)'}))+",
        other_formats and f"(?:{_class(other_formats)}(?!{other_words or '(?!)'}))+",
    ]
    return "|".join(alternative for alternative in alternatives if alternative)


def _merged(*parts: str) -> str:
    """Sorted strings of distinct characters as one sorted string."""
    return "".join(sorted("".join(parts)))


@memoize("pieces.deepseek_words", sizer=lambda key, regex: 8 * len(regex.pattern) + 65536)
def _deepseek_words() -> re.Pattern[str]:
    """DeepSeek's pre-token regex for pieces of covered characters (ASCII ones included: a regex written out for
    ASCII alone, with its small classes, cuts ASCII text no faster)."""
    return re.compile(_deepseek_pattern(_coverage().classes))


# The contexts DeepSeek's splits turn on, in ASCII: digit runs of one to seven, every ASCII punctuation character
# before letters (the first alternative), punctuation runs before newlines, control characters before letters
# (the optional prefix) and not (a gap).
_DEEPSEEK_ASCII = (
    " ".join("1234567"[:n] for n in range(1, 8)) + " x1234567y 3.14159 1,234,567.89 v2.14.1 0x1F 2026-11-05T09:30Z",
    "".join(f"{p}ab {p}Z{p}{p}" for p in string.punctuation) + ' a.b.c ._ .NET \'tis "Hi" [x](y) #tag @me',
    "..\n\n !?\r\n -->\n\n\tx ;;\r\r\n\n  }}\n  ] )\n\n\n;",
    "\x00\x01a \x01\x02. \x1f\x1fb\x7f\x7f x\x00 \x08\n\x0e9 \x7f'",
)
# And beyond ASCII: digits of other scripts in runs, CJK and kana beside Latin, digits, spaces and marks (the
# second split's borders), punctuation before letters, sign runs before newlines, format characters.
_DEEPSEEK_CONTEXTS = (
    "١٢٣٤٥٦٧ ١٢٣٤x١٢ ５５５５５５５ ०१२३४५६ ¹²³⁴ ½⅓ Ⅻⅻ ①②③④ 〇一二 3.14159 ١٫٥",
    "abc漢字かなカナdef 漢a a漢 漢1 1漢 12345漢字67 ーa aー カ\u0301 a\u3099 ア\u3099 か\u3099\u309a ゛a ゠ア ・a a・",
    "。漢 漢。 「引用」 漢\n\n 漢 \u3000漢\u3000 \u200b漢 漢\u200b 漢\u200ba é漢é ٣漢٣ Ａ漢Ａ ｶﾅ漢 㐀漢 龥龦 한漢",
    "".join(f"{p}é {p}Ж" for p in string.punctuation) + " «abc» ¿Qué? —Ну «да» „Wort“ ‹x› ·a ‐b",
    "«»\n\n →\r\n …\n \u3001\u3002\n\n 。\r\n x ±\n\n\n ™\r ‰‰\n",
    "x\u3000\u3000. x\u00a0\u00a0. a \u200b b a\u200b\u200bb \u200b\n \u00ad\u00ad- x\u00ad \u200e\u200fא \x85\x85x",
)


@memoize("pieces.deepseek_probe", sizer=lambda key, probe: 4 * len(probe))
def _deepseek_probe() -> str:
    """A text on which our cut and the tokenizer's agree only if every covered character is in the same class in
    both (see ``_class_probe``), for DeepSeek's splits: letters and marks as one run after a letter (a
    character of any other class breaks it), punctuation and symbols after "." (the same), whitespace, format
    characters after a letter and before "." and a letter (gaps; a joined pair tells them from whitespace),
    numbers between letters and between dots and in one run (a number is cut off on its own, in threes), and
    the contexts above."""
    classes = _coverage().classes

    def beyond(*parts: str) -> str:
        return _beyond("".join(sorted("".join(parts))), "\x7f")

    words, signs = beyond(classes.letters, classes.marks), beyond(classes.punctuation, classes.symbols)
    spaces, formats, numbers = beyond(classes.spaces), beyond(classes.formats), beyond(classes.numbers)
    return "\n".join(
        (
            "x" + words,
            "." + signs,
            " " + spaces + "x " + spaces + "\n" + spaces,
            "x" + formats + "." + formats + "x" + formats + formats,
            "x" + "x".join(numbers) + "x",
            "." + ".".join(numbers) + ".",
            "1" + numbers,
            *_DEEPSEEK_CONTEXTS,
            *_DEEPSEEK_ASCII,
            _ASCII_PROBE,
        )
    )


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
        self.findall: Callable[[str], list[str]] = words.findall  # a piece's pre-tokens, in order
        self._tokens: Memo[str, int] = Memo("pieces.words", sizer=text_key_size)
        self.memos = (self._tokens,)

    def takes(self, piece: str) -> bool:
        """Whether the rule counts ``piece``: an ASCII one."""
        return piece.isascii()

    def count(self, texts: list[str], tokenizer: Tokenizer) -> list[int]:
        """Tokens of ASCII pieces: the sum of their pre-tokens' counts, each distinct pre-token encoded once (and
        remembered) by the BPE model, as the tokenizer encodes every pre-token."""
        split = list(map(self.findall, texts))
        cache = self._tokens
        counts: dict[str, int | None] = {word: cache.get(word) for word in set().union(*split)}
        new = [word for word, n in counts.items() if n is None]
        if new:
            found = list(zip(new, self.lengths(new, tokenizer), strict=True))
            counts.update(found)
            cache.put_many(found)
        get = cast(Callable[[str], int], counts.__getitem__)  # every value is set by now
        return [sum(map(get, words)) for words in split]

    def lengths(self, words: list[str], tokenizer: Tokenizer) -> list[int]:
        """Tokens of each word (a pre-token), as the BPE model alone encodes it."""
        return tokenizer.bpe_lengths(words)

    def verify(self, tokenizer: Tokenizer) -> bool:
        probes = [text for text in (*_PROBE_TEXTS, _ASCII_PROBE) if text.isascii()]
        return self.count(probes, tokenizer) == list(map(tokenizer.full, probes))


class UnicodeWords(AsciiWords):
    """A piece of covered characters (ASCII and ``_COVERED_BLOCKS``) counts as its pre-tokens, cut by the split
    pattern written out for those characters, each encoded by the BPE model. Under an NFC normaliser only pieces
    it leaves as they are; any other piece goes to the tokenizer."""

    name = "unicode"
    claim = "a piece of the covered scripts counts as its pre-tokens"

    def __init__(self, tokenizer: Tokenizer) -> None:
        pattern = _word_split(tokenizer.backend)
        parts = _bpe_parts(tokenizer.backend)
        assert pattern is not None
        assert parts is not None
        self.findall = _unicode_words(pattern).findall
        self._uncovered = _coverage().uncovered.search
        self._nfc = parts[1] == {"type": "NFC"}  # else none (see _byte_level_splits)
        self._tokens = Memo("pieces.unicode", sizer=text_key_size)
        self.memos = (self._tokens,)

    def takes(self, piece: str) -> bool:
        """Whether the rule counts ``piece``: every character covered, and none the normaliser would change."""
        return self._uncovered(piece) is None and (not self._nfc or unicodedata.is_normalized("NFC", piece))

    def verify(self, tokenizer: Tokenizer) -> bool:
        """The cut: our pre-tokens, as byte-level symbols, are the tokenizer's own on the class probe (after its
        normaliser); and the counts: equal to encoding on text of every script."""
        backend = tokenizer.backend
        probe = _coverage().probe
        if self._nfc:
            probe = backend.normalizer.normalize_str(probe)
        ours = [_symbols(word) for word in self.findall(probe)]
        if ours != [word for word, _ in backend.pre_tokenizer.pre_tokenize_str(probe)]:
            return False
        probes = [text for text in (*_SCRIPT_PROBES, *_PROBE_TEXTS, _ASCII_PROBE) if self.takes(text)]
        return self.count(probes, tokenizer) == list(map(tokenizer.full, probes))


class DeepSeekWords(UnicodeWords):
    """A piece of covered characters counts as its pre-tokens under DeepSeek V3's three splits (numbers, CJK and
    kana runs, words; see ``_deepseek_pattern``), each encoded by the BPE model. Other pieces go to the
    tokenizer."""

    name = "deepseek"
    claim = "a piece of the covered scripts counts as its pre-tokens under DeepSeek's three splits"

    @classmethod
    def refusal(cls, tokenizer: Tokenizer) -> str | None:
        if not _deepseek_split(tokenizer.backend):
            return "the pre-tokenizer is not byte-level BPE with DeepSeek V3's digit, CJK and word splits"
        return None

    def __init__(self, tokenizer: Tokenizer) -> None:
        parts = _bpe_parts(tokenizer.backend)
        assert parts is not None
        self.findall = _deepseek_words().findall
        self._uncovered = _coverage().uncovered.search
        self._nfc = parts[1] == {"type": "NFC"}  # else none (see _byte_level_splits)
        self._tokens = Memo("pieces.deepseek", sizer=text_key_size)
        self.memos = (self._tokens,)

    def takes(self, piece: str) -> bool:
        """Whether the rule counts ``piece``: every character covered (an ASCII piece is, and is in NFC, without
        a search), and none the normaliser would change."""
        return piece.isascii() or super().takes(piece)

    def verify(self, tokenizer: Tokenizer) -> bool:
        """The cut: our pre-tokens, as byte-level symbols, are the tokenizer's own on the class probe (after its
        normaliser); and the counts: equal to encoding on text of every script and on the probe's contexts."""
        backend = tokenizer.backend
        probe = _deepseek_probe()
        if self._nfc:
            probe = backend.normalizer.normalize_str(probe)
        ours = [_symbols(word) for word in self.findall(probe)]
        if ours != [word for word, _ in backend.pre_tokenizer.pre_tokenize_str(probe)]:
            return False
        texts = (*_SCRIPT_PROBES, *_DEEPSEEK_CONTEXTS, *_DEEPSEEK_ASCII, *_PROBE_TEXTS, _ASCII_PROBE)
        probes = [text for text in texts if self.takes(text)]
        return self.count(probes, tokenizer) == list(map(tokenizer.full, probes))


class SpaceWords(AsciiWords):
    """A piece counts as its words, cut before each space that no token runs across, each encoded by the BPE
    model (see ``_space_words``): a tokenizer that encodes a whole text as one BPE word (Gemma's) then costs its
    distinct words, as byte-level ones do.

    Exact because a merge only ever makes a token of the vocabulary: where no token holds the character before a
    space followed by the space's symbol, no merge joins the two, and the symbols on either side merge as they
    would apart. The characters that some token holds before that symbol (Gemma 4's ">", in ">▁</") start no cut;
    where no token mixes a newline with other characters, runs of newlines are words of their own too. Both are
    read from the vocabulary when the rule is built."""

    name = "spaces"
    claim = "a piece counts as its words cut before spaces no token runs across"

    @classmethod
    def refusal(cls, tokenizer: Tokenizer) -> str | None:
        if _space_words(tokenizer.backend) is None:
            return "the tokenizer is not BPE that replaces spaces by one symbol and then cuts nothing"
        return None

    def __init__(self, tokenizer: Tokenizer) -> None:
        symbol = _space_words(tokenizer.backend)
        assert symbol is not None
        no_cut, lines_apart = _borders(list(tokenizer.backend.get_vocab(with_added_tokens=False)), symbol)
        keep = re.escape(" " + symbol + no_cut)
        cuts = [f"(?<=[^{keep}])(?= )"]
        if lines_apart:
            cuts.append(r"(?<=[^\n])(?=\n)|(?<=\n)(?=[^\n])")
        self.findall = re.compile("|".join(cuts)).split  # the words, in order
        self.symbol = symbol
        self._tokens = Memo("pieces.spaces", sizer=text_key_size)
        self.memos = (self._tokens,)

    def takes(self, piece: str) -> bool:
        """Whether the rule counts ``piece``: any piece."""
        return True

    def lengths(self, words: list[str], tokenizer: Tokenizer) -> list[int]:
        """Tokens of each word, its spaces written as the normaliser writes them."""
        return tokenizer.bpe_lengths(words, symbols=lambda word: word.replace(" ", self.symbol))

    def verify(self, tokenizer: Tokenizer) -> bool:
        """The counts equal encoding on text of every script, alone and after an added token."""
        probes = [*_SCRIPT_PROBES, *_PROBE_TEXTS, _ASCII_PROBE, " ".join(_SCRIPT_PROBES) + "\n\n  \n<b> </b> x\n"]
        counts = self.count(probes, tokenizer)
        if counts != list(map(tokenizer.full, probes)):
            return False
        return tokenizer.anchor is None or counts == tokenizer.batch(probes, after=tokenizer.anchor)


class ByteBound(Rule):
    """A text has at most as many tokens as UTF-8 bytes (``kind`` ``"any"``) or, ASCII text only, characters
    (``"ascii"``): an upper bound without tokenizing (see ``_byte_bound``)."""

    name = "bound"
    claim = "a text has at most one token per UTF-8 byte"
    needs = ()

    @classmethod
    def refusal(cls, tokenizer: Tokenizer) -> str | None:
        if _byte_bound(tokenizer.backend) is None:
            return "not BPE whose pre-tokenizer only cuts and whose normaliser keeps the length"
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
RULES: tuple[type[Rule], ...] = (
    Pieces,
    Segments,
    LineBlocks,
    AsciiWords,
    UnicodeWords,
    DeepSeekWords,
    SpaceWords,
    ByteBound,
)


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
