"""The facts a summary must keep, and whether a summary kept them.

:func:`extract` pulls checkable facts out of transcript texts: numbers (with dates and times), identifiers
(codes like ``ORD-4471``, UUIDs, versions, emails, URLs, file paths), proper names, constraint sentences
(*must*, *never*, *only*, *do not* ...) and open tasks (TODOs, pending items, questions nobody answered).
:func:`missing` says which of them a summary lacks, comparing normalised forms: Unicode NFKC, casefolded,
whitespace collapsed, thousands separators removed, so ``"1,000"`` matches ``"1000"`` and ``3 pm`` matches
``15:00``.

Extraction aims at precision: a faithful summary must pass. Text inside fenced code blocks is skipped, names
are bounded to the most frequent few, and each :class:`Source` says which kinds of fact it may yield (the
summary strategy takes constraints from what the user said, not from tool output).
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation

__all__ = [
    "ALL_KINDS",
    "Fact",
    "Source",
    "content_words",
    "extract",
    "missing",
    "normalize",
]

# What a Source may yield. "questions": its questions count as open tasks (the caller knows none was answered).
ALL_KINDS: frozenset[str] = frozenset({"numbers", "ids", "names", "constraints", "tasks"})

MAX_NAMES = 8  # names kept: the most frequent ones
CONTENT_SHARE = 0.6  # share of a sentence's content words a summary sentence must hold
_MAX_CONTENT_WORDS = 20  # longer sentences are cut down to the clause that holds the trigger


@dataclass(frozen=True)
class Fact:
    """One thing a summary must keep.

    ``kind``: number, date, time, id, email, url, path, name, constraint or task. ``text``: as written in the
    source. ``key``: the normalised form used to match and de-duplicate.
    """

    kind: str
    text: str
    key: str

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class Source:
    """A text and the kinds of fact it may yield (see :data:`ALL_KINDS`, plus ``"questions"``)."""

    text: str
    kinds: frozenset[str] = field(default=ALL_KINDS)


# ------------------------------------------------------------------------------------------ normalising

_DASHES = re.compile(r"[\u2010\u2011\u2012\u2013\u2014\u2015\u2212\ufe58\ufe63\uff0d]")
_SINGLE_QUOTES = re.compile(r"[\u2018\u2019\u201a\u201b\u2032]")
_DOUBLE_QUOTES = re.compile(r"[\u201c\u201d\u201e\u201f\u2033\u00ab\u00bb]")
# Digit-group separators: 1,000 / 1 000 (any space) / 1'000. Removed only before a group of exactly 3 digits.
_GROUP_SEPARATOR = re.compile(r"(?<=\d)[,'\u2019\u00a0\u202f\u2009 ](?=\d{3}(?!\d))")
_SPACE_GROUPS = re.compile(r"(?<![\d.,])\d{1,3}(?:[\u00a0\u202f\u2009 '\u2019]\d{3})+(?![\d])")


def _join_space_groups(text: str) -> str:
    """``1 000`` (plain, no-break or thin spaces, apostrophes) → ``1000``; comma groups are left alone."""
    return _SPACE_GROUPS.sub(lambda match: re.sub(r"[\u00a0\u202f\u2009 '\u2019]", "", match.group()), text)


def _canonical_text(text: str) -> str:
    """NFKC, one kind of dash and quote, space-grouped numbers joined; case kept."""
    text = _join_space_groups(text)
    text = unicodedata.normalize("NFKC", text)
    text = _DASHES.sub("-", text)
    text = _SINGLE_QUOTES.sub("'", text)
    return _DOUBLE_QUOTES.sub('"', text)


def normalize(text: str) -> str:
    """The comparison form: NFKC, casefolded, dashes and quotes unified, whitespace collapsed, and digit-group
    separators removed (``"1,000"`` → ``"1000"``)."""
    text = _canonical_text(text).casefold()
    text = _GROUP_SEPARATOR.sub("", text)
    return re.sub(r"\s+", " ", text).strip()


# ---------------------------------------------------------------------------------------------- words


def _set(words: str) -> frozenset[str]:
    return frozenset(words.split())


_WORD = re.compile(r"[^\W_]+(?:'[^\W_]+)*")

# Function words in the languages a transcript is most often in; they never count as content or as names.
_STOPWORDS: frozenset[str] = _set(
    """
    a about above after again against all am an and any are aren't as at be because been before being below
    between both but by can could did didn't do does doesn't doing down during each few for from further get
    got had hadn't has hasn't have haven't having he he'd he'll he's her here here's hers herself him himself
    his how how's i i'd i'll i'm i've if in into is isn't it it's its itself let let's me more most my myself
    nor of off on once or other ought our ours ourselves out over own same she she'd she'll she's so some such
    than that that's the their theirs them themselves then there there's these they they'd they'll they're
    they've this those through to too until up very was wasn't we we'd we'll we're we've were weren't what
    what's when when's where where's which while who who's whom why why's will with would wouldn't you you'd
    you'll you're you've your yours yourself yourselves also just now still yet ok okay yes hi hello hey
    thanks thank please sure great good fine sorry dear well oh ah so really maybe perhaps like one shall
    may might much many lot lots thing things something anything everything nothing way want wants wanted
    know think see look let's go going get gets make made need needs new next last first right here there
    le la les un une des du de et ou est sont pour par avec dans sur au aux ce cette ces qui que quoi mais
    je tu il elle nous vous ils elles mon ma mes ton ta tes son sa ses notre votre leur leurs
    der die das den dem des ein eine einen einem einer und oder ist sind für mit auf aus bei von zu zum zur
    ich du er sie es wir ihr mein meine dein deine sein seine unser unsere euer eure im am
    el los las una unos unas y o es son para por con en del al que pero yo tú él ella nosotros ellos mi mis
    tu tus su sus
    summary understood conversation earlier assistant user tool
    """
)

# Constraint vocabulary, by family. A summary keeps a constraint when one of its sentences holds a word of the
# constraint's family and most of its content words ("must not" → negation family, so "never" will do).
_NEGATION = _set(
    "never not no don't doesn't didn't mustn't shouldn't cannot can't won't isn't aren't forbidden prohibited "
    "without avoid nor none nie niemals nicht kein keine keinen jamais pas sans ohne nunca ni sin"
)
_ONLY = _set(
    "only exclusively solely nur ausschließlich seulement uniquement exclusivement solo sólo solamente únicamente"
)
_OBLIGATION = _set(
    "must always required require requires requirement mandatory need needs needed ensure has have sure "
    "muss müssen immer erforderlich pflicht doit doivent toujours obligatoire debe deben siempre "
    "obligatorio necesario"
)
_LIMIT = _set(
    "most least max maximum min minimum limit limited within under over exceed exceeds before after later "
    "earlier than höchstens mindestens maximal maximale moins plus máximo mínimo"
)
_MODAL_WORDS = _NEGATION | _ONLY | _OBLIGATION | _LIMIT
# A summary keeps an open task or question in a sentence that says it is open (or asks it).
_OPEN = _set(
    "todo to-do tbd fixme open pending unresolved unanswered outstanding still yet next follow remaining remains "
    "asked asks question questions whether wants wanted need needs must will should awaiting waiting later "
    "offen ausstehend frage noch attente question reste pendiente pregunta todavía"
)

# Words that make a sentence a constraint (a narrower list than the families: "not" alone is no constraint).
_CONSTRAINT_TRIGGER = re.compile(
    r"\b(?:must|mustn't|never|always|only|required|requires?|mandatory|forbidden|prohibited|"
    r"not\s+(?:allowed|permitted)|under\s+no\s+circumstances|should\s+not|shouldn't|do\s+not|don't|"
    r"make\s+sure|at\s+(?:most|least)|no\s+(?:more|less|later|earlier)\s+than|"
    r"muss|müssen|niemals|nie|immer|nur|darf\s+nicht|dürfen\s+nicht|"
    r"doit|doivent|jamais|toujours|seulement|uniquement|ne\s+pas|"
    r"debe|deben|nunca|siempre|solo|sólo|solamente|únicamente)\b"
)
_TASK_TRIGGER = re.compile(
    r"(?:\btodo\b|\bto-do\b|\bfixme\b|\btbd\b|\bpending\b|\bfollow[- ]up\b|\bunresolved\b|\boutstanding\b|"
    r"\bopen (?:question|issue|item|task|point)s?\b|\bstill (?:need|needs|has to|have to|to)\b|"
    r"\bnot (?:yet|done|finished|resolved)\b|\bnext steps?\b|\bremind (?:me|us)\b|\bwaiting (?:for|on)\b|"
    r"\bawaiting\b|\bà faire\b|\ben attente\b|\boffen\b|\bausstehend\b|\bpendiente\b)"
)

_SUFFIXES = ("ations", "ation", "ments", "ment", "ingly", "ings", "ing", "ies", "ied", "ed", "es", "s", "ly")


def _stem(word: str) -> str:
    """A light English stemmer: ``shipping``/``ships``/``shipped`` → ``ship``, ``requires`` → ``requir``."""
    if word.isdigit() or len(word) <= 3:
        return word
    for suffix in _SUFFIXES:
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            stem = word[: -len(suffix)]
            if suffix in ("ies", "ied"):
                return stem + "y"
            if len(stem) >= 4 and stem[-1] == stem[-2] and stem[-1] not in "lsz":
                stem = stem[:-1]  # shipp → ship
            return stem
    if word.endswith("e") and len(word) >= 5:
        return word[:-1]  # require → requir
    return word


def _words(normalised: str) -> list[str]:
    return _WORD.findall(normalised)


def content_words(text: str) -> frozenset[str]:
    """Stemmed words of ``text`` that carry meaning: no function words, no constraint vocabulary."""
    out: set[str] = set()
    for word in _words(normalize(text)):
        bare = word.split("'")[0] if word.endswith("'s") else word
        if bare in _STOPWORDS or bare in _MODAL_WORDS or (len(bare) < 2 and not bare.isdigit()):
            continue
        out.add(_stem(bare))
    return frozenset(out)


def _families(normalised: str) -> set[frozenset[str]]:
    """The constraint families a (normalised) sentence belongs to; the negation family wins over the others."""
    words = set(_words(normalised))
    if words & _NEGATION or "n't" in normalised:
        return {_NEGATION}
    found: set[frozenset[str]] = set()
    if words & _ONLY:
        found.add(_ONLY)
    if words & _LIMIT and re.search(r"\b(?:at (?:most|least)|no (?:more|less|later|earlier) than)\b", normalised):
        found.add(_LIMIT)
    if not found or words & _OBLIGATION:
        found.add(_OBLIGATION)
    return found


# -------------------------------------------------------------------------------------------- sentences

_CODE_FENCE = re.compile(r"```.*?(?:```|\Z)", re.DOTALL)
_BULLET = re.compile(r"^\s*(?:[-*•+>]+|\d{1,2}[.)]|#+)\s+")
_SENTENCE_END = re.compile(r"(?<=[.!?。！？])\s+")
_ABBREVIATION = re.compile(r"(?:\b[^\W\d_]|\b(?:e\.g|i\.e|etc|vs|dr|mr|mrs|ms|st|no|nr|approx|incl|ca|cf))\.$", re.I)


def _strip_code(text: str) -> str:
    return _CODE_FENCE.sub("\n", text)


def _sentences(text: str) -> Iterator[str]:
    """Sentences of ``text``: lines, split after ``.!?`` (not after abbreviations), bullets removed."""
    for line in text.splitlines():
        line = _BULLET.sub("", line).strip()
        if not line:
            continue
        pending = ""
        for piece in _SENTENCE_END.split(line):
            pending = f"{pending} {piece}" if pending else piece
            if _ABBREVIATION.search(pending):
                continue
            yield pending.strip()
            pending = ""
        if pending.strip():
            yield pending.strip()


def _clause(sentence: str, trigger: re.Pattern[str]) -> str:
    """A long sentence cut to the clause holding the trigger, so matching asks for what matters."""
    if len(content_words(sentence)) <= _MAX_CONTENT_WORDS:
        return sentence
    for clause in re.split(r"[,;:]\s+|\s+(?:and|but|or|which|because)\s+", sentence):
        if trigger.search(normalize(clause)):
            return clause.strip()
    return sentence


# ---------------------------------------------------------------------------------------------- numbers

_NUMBER_NAMES = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen twenty"
)
_NUMBER_WORDS: dict[str, int] = {word: value for value, word in enumerate(_NUMBER_NAMES.split())}
_NUMBER_WORDS.update({"thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70, "eighty": 80})
_NUMBER_WORDS.update({"ninety": 90, "hundred": 100, "thousand": 1000, "dozen": 12, "a dozen": 12})
_NUMBER_WORDS.update({"first": 1, "second": 2, "third": 3, "fourth": 4, "fifth": 5, "half": 50})
_NUMBER_WORD = re.compile(
    r"\b(" + "|".join(sorted(_NUMBER_WORDS, key=len, reverse=True)) + r")(?:-(one|two|three|four|five|six|seven|"
    r"eight|nine))?\b"
)
_SCALES: dict[str, int] = {
    "k": 10**3,
    "thousand": 10**3,
    "m": 10**6,
    "mn": 10**6,
    "mio": 10**6,
    "million": 10**6,
    "millions": 10**6,
    "bn": 10**9,
    "billion": 10**9,
    "billions": 10**9,
}
_NUMBER = re.compile(
    r"(?<![\w.,])(?<!\d[.,])"
    r"(?P<cur>[$€£¥₹₩]\s?)?"
    r"(?P<num>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d{1,3}(?:\.\d{3})+(?:,\d+)?|\d+(?:[.,]\d+)?)"
    r"(?![.,]\d)"
    r"(?P<suf>\s?(?:%|percent\b|per\s?cent\b|k\b|mn\b|mio\b|m\b|bn\b|thousand\b|millions?\b|billions?\b))?",
    re.IGNORECASE,
)
_LIST_MARKER = re.compile(r"(?m)^(\s*)\d{1,2}[.)](?=\s)")


def _decimal_forms(body: str) -> list[Decimal]:
    """The values a digit string may mean, most likely first (``3,500`` is 3500, or 3.5 in much of Europe)."""
    readings: list[str] = []
    if re.fullmatch(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?", body):
        readings.append(body.replace(",", ""))
        if body.count(",") == 1 and "." not in body:
            readings.append(body.replace(",", "."))
    elif re.fullmatch(r"\d{1,3}(?:\.\d{3})+(?:,\d+)?", body):
        readings.append(body.replace(".", "").replace(",", "."))
        if body.count(".") == 1 and "," not in body:
            readings.append(body)
    else:
        readings.append(body.replace(",", "."))
    values: list[Decimal] = []
    for reading in readings:
        try:
            values.append(Decimal(reading))
        except InvalidOperation:
            continue
    return values


def _fmt(value: Decimal) -> str:
    text = format(value.normalize(), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def _number_forms(match: re.Match[str]) -> list[str]:
    values = _decimal_forms(match.group("num"))
    suffix = (match.group("suf") or "").strip().casefold().replace(" ", "")
    scale = _SCALES.get(suffix)
    forms = [_fmt(value) for value in values]
    if scale is not None:
        forms += [_fmt(value * scale) for value in values]
    return list(dict.fromkeys(forms))


def _summary_numbers(text: str) -> set[str]:
    """Every value a summary states: digits in any grouping, scaled amounts and English number words."""
    forms: set[str] = set()
    canonical = _canonical_text(text)
    for match in _NUMBER.finditer(canonical):
        forms.update(_number_forms(match))
    for match in re.finditer(r"\d+(?:\.\d+)?", _GROUP_SEPARATOR.sub("", canonical)):
        forms.update(_fmt(value) for value in _decimal_forms(match.group()))
    lowered = canonical.casefold()
    for match in _NUMBER_WORD.finditer(lowered):
        value = _NUMBER_WORDS[match.group(1)]
        if match.group(2):
            value += _NUMBER_WORDS[match.group(2)]
        forms.add(str(value))
    return forms


# ------------------------------------------------------------------------------------------ dates, times

_MONTHS: dict[str, int] = {}
for _number, _names in enumerate(
    (
        "january jan janvier januar enero",
        "february feb février fevrier februar febrero",
        "march mar mars märz marzo",
        "april apr avril abril",
        "may mai mayo",
        "june jun juin juni junio",
        "july jul juillet juli julio",
        "august aug août aout agosto",
        "september sep sept septembre septiembre",
        "october oct octobre oktober octubre",
        "november nov novembre noviembre",
        "december dec décembre decembre dezember diciembre",
    ),
    start=1,
):
    for _name in _names.split():
        _MONTHS[_name] = _number
_MONTH = "|".join(sorted(_MONTHS, key=len, reverse=True))
_ORDINAL = r"(?:st|nd|rd|th|er|e|\.)?"
_DATE = re.compile(
    rf"(?P<iso>(?<![\d-])(?P<iy>\d{{4}})-(?P<im>\d{{1,2}})-(?P<id>\d{{1,2}})(?![\d-]))"
    rf"|(?P<slash>(?<![\d/.])(?P<sa>\d{{1,2}})(?P<sep>[/.])(?P<sb>\d{{1,2}})(?P=sep)(?P<sy>\d{{4}}|\d{{2}})(?![\d/]))"
    rf"|(?P<dm>(?<!\d)(?P<dd>\d{{1,2}}){_ORDINAL}\s+(?:of\s+|de\s+)?(?P<dmon>{_MONTH})\b\.?(?:,?\s+(?P<dy>\d{{4}}))?)"
    rf"|(?P<md>\b(?P<mmon>{_MONTH})\b\.?\s+(?P<md_d>\d{{1,2}})(?:st|nd|rd|th)?(?!\d)(?:,?\s+(?P<my>\d{{4}}))?)",
    re.IGNORECASE,
)
_TIME = re.compile(
    r"(?<![\d:.])(?P<h>\d{1,2}):(?P<m>\d{2})(?::\d{2})?(?!\d)(?:\s*(?P<ap>[ap])\.?m\.?\b)?"
    r"|(?<![\d:.])(?P<h2>\d{1,2})\s*(?P<ap2>[ap])\.?m\.?\b"
    r"|(?<![\d:.])(?P<h3>\d{1,2})\s*h\s*(?P<m3>\d{2})\b",
    re.IGNORECASE,
)
DateKey = tuple[int | None, int, int]


def _date_candidates(match: re.Match[str], *, source: bool) -> list[DateKey]:
    """(year, month, day) readings of a date match; empty when it is no valid date."""
    groups = match.groupdict()
    found: list[tuple[int | None, int, int]] = []
    if groups["iso"]:
        found.append((int(groups["iy"]), int(groups["im"]), int(groups["id"])))
    elif groups["slash"]:
        a, b, year = int(groups["sa"]), int(groups["sb"]), int(groups["sy"])
        year = year + 2000 if year < 100 else year
        found += [(year, b, a), (year, a, b)]
    else:
        month_name = groups["dmon"] or groups["mmon"]
        if source and month_name.casefold() in ("may", "mar", "mai") and not month_name[0].isupper():
            return []  # "you may 2 ..." is no date
        day = int(groups["dd"] or groups["md_d"])
        year_text = groups["dy"] or groups["my"]
        found.append((int(year_text) if year_text else None, _MONTHS[month_name.casefold()], day))
    return [(y, m, d) for y, m, d in found if 1 <= m <= 12 and 1 <= d <= 31]


def _date_key(candidates: Sequence[DateKey]) -> str:
    year, month, day = candidates[0]
    return f"{year:04d}-{month:02d}-{day:02d}" if year is not None else f"--{month:02d}-{day:02d}"


def _time_forms(match: re.Match[str]) -> list[str]:
    groups = match.groupdict()
    if groups["h"] is not None:
        hour, minute, half = int(groups["h"]), int(groups["m"]), groups["ap"]
    elif groups["h2"] is not None:
        hour, minute, half = int(groups["h2"]), 0, groups["ap2"]
    else:
        hour, minute, half = int(groups["h3"]), int(groups["m3"]), None
    if minute > 59 or hour > 23 or (half and not 1 <= hour <= 12):
        return []
    if half:
        hour = hour % 12 + (12 if half.casefold() == "p" else 0)
    return [f"{hour:02d}:{minute:02d}"]


# --------------------------------------------------------------------------------------------- identifiers

_URL = re.compile(r"\b(?:https?://|www\.)[^\s<>()\[\]{}\"'`]+", re.IGNORECASE)
_EMAIL = re.compile(r"(?<![\w.+-])[\w.+-]+@[\w-]+(?:\.[\w-]+)+")
_UUID = re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b", re.IGNORECASE)
_EXTENSIONS = (
    "py|pyi|ipynb|js|mjs|ts|tsx|jsx|json|jsonl|yaml|yml|toml|ini|cfg|conf|env|md|rst|txt|csv|tsv|log|sh|bash|ps1|"
    "sql|db|sqlite|html|htm|css|xml|pdf|docx?|xlsx?|pptx?|png|jpe?g|gif|svg|webp|mp3|mp4|wav|zip|tar|gz|tgz|"
    "go|rs|java|kt|c|h|cc|cpp|hpp|cs|rb|php|swift|lock|gguf|safetensors|bin|pt|onnx|parquet|dockerfile"
)
_PATH = re.compile(
    r"(?<![\w/.\\])[A-Za-z]:\\(?:[\w .-]+\\)*[\w.-]+"  # C:\Users\me\file.txt
    r"|(?<![\w/.])(?:~|\.{1,2})?/(?:[\w.-]+/)*[\w.-]*[\w]"  # /etc/nginx/nginx.conf, ./run.sh, ~/notes
    r"|(?<![\w/.])[\w.-]+(?:/[\w.-]+){2,}"  # src/contextkeeper/strategies
    rf"|(?<![\w/.])[\w.-]+/[\w.-]*\.(?:{_EXTENSIONS})\b"  # src/app.py
    rf"|(?<![\w/.@-])[\w-]+(?:\.[\w-]+)*\.(?:{_EXTENSIONS})\b(?![\w/]|\.\w)",  # config.yaml
    re.IGNORECASE,
)
_VERSION = re.compile(r"(?<![\w.])v?\d+(?:\.\d+){2,}(?![\w]|\.\d)", re.IGNORECASE)
_TOKEN = re.compile(r"(?<![\w-])\w(?:[\w-]*\w)?(?![\w-])")
_NUMBER_UNIT = re.compile(
    r"\d+(?:[.,]\d+)?(?:st|nd|rd|th|er|e|x|h|hr|hrs|min|mins|s|sec|secs|ms|us|ns|d|w|y|yr|yrs|mo|k|m|mm|cm|km|"
    r"g|kg|mg|lb|lbs|oz|l|ml|b|kb|mb|gb|tb|kib|mib|gib|tib|bps|kbps|mbps|gbps|hz|khz|mhz|ghz|v|w|kw|kwh|mah|"
    r"px|pt|em|rem|am|pm|c|f|p|bn|mn|eur|usd|gbp|jpy|chf)"
)


def _is_identifier(token: str) -> bool:
    """Codes like ``ORD-4471``, ``A350-900``, ``H200``, ``a3f9c2d``, ``user_id``; not ``follow-up`` or ``24h``."""
    if token.isdigit() or not any(char.isalpha() for char in token):
        return False  # digits only (555-0100, 10-15): counted as numbers
    has_digit = any(char.isdigit() for char in token)
    if "_" in token.strip("_"):
        return True
    if has_digit:
        if _NUMBER_UNIT.fullmatch(token.casefold()):
            return False
        return "-" in token or any(char.isupper() for char in token) or len(token) >= 4
    if "-" in token:
        return any(len(part) >= 2 and part.isupper() for part in token.split("-"))
    return False


# ------------------------------------------------------------------------------------------------ names

_CAPITALISED = re.compile(r"[^\W\d_]+(?:['’-][^\W\d_]+)*")
_INITIAL_BEFORE = set("\n.!?:;\"“”«»'‘’(*•>#[–—-|")


def _masked(text: str, spans: Iterable[tuple[int, int]]) -> str:
    chars = list(text)
    for start, stop in spans:
        for index in range(start, stop):
            if chars[index] != "\n":
                chars[index] = " "
    return "".join(chars)


def _is_initial(text: str, start: int) -> bool:
    index = start - 1
    while index >= 0 and text[index] in " \t":
        index -= 1
    return index < 0 or text[index] in _INITIAL_BEFORE


def _heading_line(line: str) -> bool:
    words = _CAPITALISED.findall(line)
    if len(words) < 2:
        return line.lstrip().startswith("#")
    capitalised = sum(1 for word in words if word[0].isupper())
    return line.lstrip().startswith("#") or capitalised / len(words) >= 0.7


@dataclass
class _NameTally:
    counts: Counter[str] = field(default_factory=Counter)
    initial: Counter[str] = field(default_factory=Counter)
    first_seen: dict[str, tuple[int, str]] = field(default_factory=dict)
    lowercase: Counter[str] = field(default_factory=Counter)
    order: int = 0

    def add(self, phrase: list[str], *, initial_only: bool) -> None:
        text = " ".join(phrase)
        key = normalize(text)
        if initial_only:
            self.initial[key] += 1
        else:
            self.counts[key] += 1
        if key not in self.first_seen:
            self.first_seen[key] = (self.order, text)
            self.order += 1

    def scan(self, text: str) -> None:
        for word in _CAPITALISED.findall(text):
            if word.islower():
                self.lowercase[normalize(word)] += 1
        for line in text.split("\n"):
            if _heading_line(line):
                continue
            phrase: list[str] = []
            phrase_initial = False
            last_end = -1
            for match in _CAPITALISED.finditer(line):
                word = match.group()
                is_name = _name_word(word)
                joined = bool(phrase) and line[last_end : match.start()] == " "
                if is_name and joined and word.isupper() == phrase[-1].isupper():
                    phrase.append(word)
                else:
                    self._flush(phrase, phrase_initial)
                    phrase = [word] if is_name else []
                    phrase_initial = _is_initial(line, match.start()) if is_name else False
                last_end = match.end()
            self._flush(phrase, phrase_initial)

    def _flush(self, phrase: list[str], initial: bool) -> None:
        if not phrase:
            return
        words = list(phrase)
        if initial and not words[0].isupper():
            # A sentence's first word is capitalised anyway: it is a name only when seen elsewhere too.
            first = normalize(words[0])
            if first not in _STOPWORDS and self.lowercase[first] == 0:
                self.add(words[:1], initial_only=True)
            words = words[1:]
        if words:
            self.add(words, initial_only=False)

    def top(self, limit: int) -> list[Fact]:
        scores: Counter[str] = Counter()
        for key, count in self.counts.items():
            words = key.split()
            if len(words) == 1 and self.lowercase[key] >= count:
                continue  # an ordinary word written with a capital now and then
            scores[key] = count + self.initial[key]
        # "Dana" after "Dana Whitfield" is the same name: count it there (matching needs half the words anyway).
        for key in [key for key in scores if " " not in key]:
            longer = [phrase for phrase in scores if " " in phrase and key in phrase.split()]
            if longer:
                best = max(longer, key=lambda phrase: (scores[phrase], -self.first_seen[phrase][0]))
                scores[best] += scores.pop(key)
        ranked = sorted(scores, key=lambda key: (-scores[key], self.first_seen[key][0]))
        return [Fact("name", self.first_seen[key][1], key) for key in ranked[:limit]]


def _name_word(word: str) -> bool:
    if not word[0].isupper():
        return False
    folded = normalize(word)
    if folded in _STOPWORDS or folded in _MODAL_WORDS or folded.split("'")[0] in _STOPWORDS:
        return False
    if word.isupper():
        return len(word) >= 2 and folded not in _SHOUTED
    return True


_SHOUTED = _set("todo fixme tbd asap fyi note important urgent warning error ok nb ps re fw am pm")


# ---------------------------------------------------------------------------------------------- extract


def extract(texts: Iterable[str | Source], *, max_names: int = MAX_NAMES) -> tuple[Fact, ...]:
    """The facts in ``texts`` a summary must keep, de-duplicated, in order of first appearance (names last,
    most frequent first). A plain string yields every kind; a :class:`Source` only its ``kinds``."""
    facts: dict[tuple[str, str], Fact] = {}
    tally = _NameTally()
    for source in texts:
        if isinstance(source, str):
            source = Source(source)
        text = _canonical_text(_strip_code(source.text))
        if not text.strip() or not source.kinds:
            continue
        for fact in _source_facts(text, source.kinds, tally):
            facts.setdefault((fact.kind, fact.key), fact)
    ordered = list(facts.values())
    ordered += [fact for fact in tally.top(max_names) if ("name", fact.key) not in facts]
    return tuple(ordered)


def _source_facts(text: str, kinds: frozenset[str], tally: _NameTally) -> Iterator[Fact]:
    """The facts of one source's ``text`` but its names, which go to ``tally`` (they are ranked over all sources)."""
    spans: list[tuple[int, int]] = []  # text that a fact already claimed
    # Identifiers first: they hold digits, dots and slashes that must not read as numbers or dates.
    for claim in (_identifier_facts, _date_facts, _time_facts, _version_facts, _token_facts):
        yield from claim(text, kinds, spans)
    masked = _masked(text, spans)
    if "numbers" in kinds:
        unlisted = _LIST_MARKER.sub(lambda match: match.group(1) + " " * len(match.group(0).lstrip()), masked)
        for match in _NUMBER.finditer(unlisted):
            forms = _number_forms(match)
            if forms:
                yield Fact("number", match.group().strip(), forms[0])
    if "names" in kinds:
        tally.scan(masked)
    if kinds & {"constraints", "tasks", "questions"}:
        for sentence in _sentences(text):
            yield from _sentence_facts(sentence, kinds)


# The passes of _source_facts, in order. Each skips what an earlier one claimed, and claims its matches in ``spans``
# whatever ``kinds`` lets it yield: a URL's digits are never a number, even where only numbers are asked for.


def _identifier_facts(text: str, kinds: frozenset[str], spans: list[tuple[int, int]]) -> Iterator[Fact]:
    """URLs, emails, UUIDs and paths, without the punctuation that ends the sentence around them."""
    for kind, pattern in (("url", _URL), ("email", _EMAIL), ("id", _UUID), ("path", _PATH)):
        for match in pattern.finditer(text):
            value = match.group().rstrip(".,;:!?)")
            start, stop = match.start(), match.start() + len(value)
            if _overlaps(spans, start, stop):
                continue
            spans.append((start, stop))
            if "ids" in kinds:
                yield Fact(kind, value, _identifier_key(kind, value))


def _date_facts(text: str, kinds: frozenset[str], spans: list[tuple[int, int]]) -> Iterator[Fact]:
    for match in _DATE.finditer(text):
        if _overlaps(spans, *match.span()):
            continue
        candidates = _date_candidates(match, source=True)
        if not candidates:
            continue
        spans.append(match.span())
        if "numbers" in kinds:
            yield Fact("date", match.group().strip(), _date_key(candidates))


def _time_facts(text: str, kinds: frozenset[str], spans: list[tuple[int, int]]) -> Iterator[Fact]:
    for match in _TIME.finditer(text):
        if _overlaps(spans, *match.span()):
            continue
        forms = _time_forms(match)
        if forms:
            spans.append(match.span())
            if "numbers" in kinds:
                yield Fact("time", match.group().strip(), forms[0])


def _version_facts(text: str, kinds: frozenset[str], spans: list[tuple[int, int]]) -> Iterator[Fact]:
    for match in _VERSION.finditer(text):
        groups = match.group().lstrip("vV").split(".")
        if _overlaps(spans, *match.span()) or all(len(group) == 3 for group in groups[1:]):
            continue  # 1.234.567 is a number
        spans.append(match.span())
        if "ids" in kinds:
            yield Fact("id", match.group(), normalize(match.group()))


def _token_facts(text: str, kinds: frozenset[str], spans: list[tuple[int, int]]) -> Iterator[Fact]:
    """Codes like ``ORD-4471``."""
    for match in _TOKEN.finditer(text):
        if _overlaps(spans, *match.span()) or not _is_identifier(match.group()):
            continue
        spans.append(match.span())
        if "ids" in kinds:
            yield Fact("id", match.group(), normalize(match.group()))


_LEADING_CONJUNCTION = re.compile(r"^(?:and|also|but|so|plus|then|oh|ok|okay)\b[,:]?\s+", re.IGNORECASE)


def _sentence_facts(sentence: str, kinds: frozenset[str]) -> Iterator[Fact]:
    sentence = _LEADING_CONJUNCTION.sub("", sentence)
    folded = normalize(sentence)
    if "constraints" in kinds and _CONSTRAINT_TRIGGER.search(folded):
        clause = _clause(sentence, _CONSTRAINT_TRIGGER)
        if content_words(clause):
            yield Fact("constraint", clause, normalize(clause))
            return
    if "tasks" in kinds and _TASK_TRIGGER.search(folded):
        clause = _clause(sentence, _TASK_TRIGGER)
        if content_words(clause):
            yield Fact("task", clause, normalize(clause))
            return
    if "questions" in kinds and sentence.rstrip().endswith(("?", "？")) and content_words(sentence):
        yield Fact("task", sentence, normalize(sentence))


def _overlaps(spans: list[tuple[int, int]], start: int, stop: int) -> bool:
    return any(start < end and begin < stop for begin, end in spans)


def _identifier_key(kind: str, value: str) -> str:
    key = normalize(value)
    if kind == "url":
        key = re.sub(r"^(?:https?://)?(?:www\.)?", "", key).rstrip("/")
    return key


# ---------------------------------------------------------------------------------------------- missing


@dataclass(frozen=True)
class _Summary:
    """A summary, read once for every kind of check."""

    text: str
    words: frozenset[str]
    numbers: frozenset[str]
    dates: tuple[DateKey, ...]
    times: frozenset[str]
    sentences: tuple[tuple[str, frozenset[str]], ...]

    @classmethod
    def read(cls, summary: str) -> _Summary:
        canonical = _canonical_text(summary)
        dates: list[DateKey] = []
        for match in _DATE.finditer(canonical):
            dates += _date_candidates(match, source=False)
        times: set[str] = set()
        for match in _TIME.finditer(canonical):
            times.update(_time_forms(match))
        lowered = canonical.casefold()
        times.update({"12:00"} if re.search(r"\bnoon\b|\bmidday\b", lowered) else set())
        times.update({"00:00"} if re.search(r"\bmidnight\b", lowered) else set())
        sentences = tuple((normalize(sentence), content_words(sentence)) for sentence in _sentences(summary))
        text = normalize(summary)
        return cls(
            text=text,
            words=frozenset(_WORD.findall(text)) | frozenset(re.findall(r"[^\W_]+", text)),
            numbers=frozenset(_summary_numbers(summary)),
            dates=tuple(dates),
            times=frozenset(times),
            sentences=sentences,
        )

    def contains(self, key: str) -> bool:
        """``key`` (normalised) occurs in the summary, not as part of a longer word."""
        return re.search(rf"(?<!\w){re.escape(key)}(?!\w)", self.text) is not None

    def has_sentence(self, fact: Fact, families: set[frozenset[str]]) -> bool:
        needed = content_words(fact.text)
        if not needed:
            return True
        required = math.ceil(CONTENT_SHARE * len(needed) - 1e-9)
        for normalised, words in self.sentences:
            if sum(1 for word in needed if _word_in(word, words)) < required:
                continue
            present = set(_words(normalised))
            if any(present & family for family in families) or (_NEGATION in families and "n't" in normalised):
                return True
            if _OPEN in families and "?" in normalised:
                return True
        return False


def _word_in(word: str, words: frozenset[str]) -> bool:
    """``word`` or a close form of it (``deliver``/``delivery``: one a prefix of the other, at most 3 letters
    apart, the shorter at least 5 letters) is among ``words``."""
    if word in words:
        return True
    if len(word) < 5 or word.isdigit():
        return False
    return any(
        len(other) >= 5 and abs(len(other) - len(word)) <= 3 and (other.startswith(word) or word.startswith(other))
        for other in words
    )


def _has(fact: Fact, summary: _Summary) -> bool:
    kind = fact.kind
    if kind == "number":
        match = _NUMBER.search(_canonical_text(fact.text))
        forms = _number_forms(match) if match else [fact.key]
        return bool(summary.numbers.intersection(forms))
    if kind == "date":
        match = _DATE.search(_canonical_text(fact.text))
        wanted = _date_candidates(match, source=False) if match else []
        for year, month, day in wanted:
            for got_year, got_month, got_day in summary.dates:
                if (month, day) == (got_month, got_day) and (year is None or got_year in (None, year)):
                    return True
        return summary.contains(normalize(fact.text))
    if kind == "time":
        return fact.key in summary.times or summary.contains(normalize(fact.text))
    if kind == "url":
        return fact.key in summary.text
    if kind in ("id", "email", "path"):
        return summary.contains(fact.key)
    if kind == "name":
        words = re.findall(r"[^\W_]+", fact.key)
        present = sum(1 for word in words if word in summary.words)
        return present >= math.ceil(len(words) / 2)
    if kind == "constraint":
        return summary.has_sentence(fact, _families(fact.key))
    return summary.has_sentence(fact, {_OPEN})  # task


def missing(facts: Iterable[Fact], summary: str) -> tuple[Fact, ...]:
    """The facts ``summary`` does not keep, compared in normalised form.

    Numbers match by value (``1,000`` = ``1000`` = ``1 000``; ``$1.2M`` = ``1,200,000``; ``two`` = ``2``);
    dates by day and month (and year when both give one); times by clock value (``3 pm`` = ``15:00``);
    identifiers, emails and paths as whole tokens; URLs without scheme; names by at least half of their
    words; constraints by a sentence holding a word of the same family (negation, only, obligation, limit)
    and at least 60% of the constraint's content words; tasks by such a sentence that says they are open.
    """
    read = _Summary.read(summary)
    return tuple(fact for fact in facts if not _has(fact, read))
