"""The pre-token rule beyond ASCII (``unicode``): pieces of the covered scripts are cut by our own regex and each
distinct pre-token is encoded once by the BPE model; every count equals the tokenizer's, the tokenizer's own
split proves the character classes, and pieces the rule does not cover go to the tokenizer."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import contextkeeper as ck
from assets import template
from conftest import assert_counts_like_the_tokenizer, hf_tokenizer, raw_backend, verified_pieces
from contextkeeper.tokens.pieces import AsciiWords, ByteBound, LineBlocks, PieceCounter, Pieces, Segments
from contextkeeper.tokens.pieces._rules import _COVERED_BLOCKS, UnicodeWords, _coverage, _word_split

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from agent_conversation import SCRIPTS, TOOLS, build_script

# The vocabularies with the rule, as transformers loads them (Qwen's with an NFC normaliser), and Qwen2's own
# tokenizer.json, which has none.
VOCABS = ("qwen2", "qwen2-raw", "llama-bpe", "qwen35", "harmony-on-qwen2")


def _backend(vocab: str) -> Any:
    return raw_backend(vocab.removesuffix("-raw")) if vocab.endswith("-raw") else hf_tokenizer(vocab).backend_tokenizer


def _counter(vocab: str) -> PieceCounter:
    return verified_pieces(vocab)  # type: ignore[no-any-return]


def _unicode(pieces: PieceCounter) -> UnicodeWords:
    rule = pieces._unicode
    assert rule is not None, pieces.rules
    return rule


@pytest.mark.parametrize("vocab", VOCABS)
def test_the_rule_is_on_and_knows_the_normaliser(vocab: str) -> None:
    pieces = _counter(vocab)
    assert "unicode" in pieces.rules.on
    normaliser = pieces._tokenizer.backend.normalizer
    nfc = normaliser is not None
    assert _unicode(pieces)._nfc is nfc
    if nfc:  # what the normaliser is, read from the tokenizer itself
        assert normaliser.normalize_str("e\u0301") == "\u00e9"


# -- the defect: non-ASCII pieces were sent whole to the tokenizer ------------------------------------------------
@pytest.mark.parametrize(
    "line",
    [
        "Запрос {i} завершился ошибкой: сервис вернул «503» после таймаута.",
        "الطلب {i} فشل لأن الخدمة أعادت خطأ بعد انتهاء المهلة، وقمنا بالتراجع.",
        "अनुरोध {i} विफल हुआ क्योंकि सेवा ने त्रुटि लौटाई। हमने परिनियोजन वापस लिया।",
        "请求 {i} 失败：上游服务超时，我们回滚了部署。请求 {i} 失败：上游服务超时，我们回滚了部署。",
    ],
)
def test_a_non_ascii_text_costs_its_distinct_pre_tokens_only(line: str) -> None:
    pieces = PieceCounter(hf_tokenizer("qwen2").backend_tokenizer)
    pieces.verify()
    text = "\n".join(line.format(i=i) for i in range(200))
    assert pieces.alone(text) == pieces.full(text)
    spent = pieces.encoded_chars - len(text)  # less what full() encoded
    assert 0 < spent < len(text) / 10, spent  # the distinct pre-tokens: the words and signs once, the numbers
    changed = text + " ✓"  # new pre-tokens: " ✓", and the last sign without the newline it had before
    before = pieces.encoded_chars
    assert pieces.alone(changed) == pieces.full(changed)
    assert 0 < pieces.encoded_chars - before - len(changed) <= 3


def test_a_prompt_in_another_script_is_counted_without_the_tokenizers_batch() -> None:
    counter = ck.HFChatTemplateCounter(hf_tokenizer("qwen2"), chat_template=template("Qwen-Qwen3-0.6B"))
    messages = build_script("arabic", messages=60)
    counter.count(messages, tools=TOOLS)
    chars = sum(len(str(message.get("content") or "")) for message in messages)
    assert 0 < counter.encoded_chars < chars / 10, (counter.encoded_chars, chars)


# -- counts equal the tokenizer's on text of every script ---------------------------------------------------------
# Characters of every covered block (assigned or not: unassigned ones send their piece to the tokenizer), blocks
# beside them that are not covered, and real words, code, JSON, emoji sequences, decomposed accents and spaces.
_BLOCK_TEXT = st.sampled_from((*_COVERED_BLOCKS, (0x0780, 0x08FF), (0x1F300, 0x1FAFF), (0xF900, 0xFAFF))).flatmap(
    lambda block: st.text(st.characters(min_codepoint=block[0], max_codepoint=block[1]), max_size=12)
)
_SNIPPETS = [
    "déjà vu, Größe",
    "Tiếng Việt đã",
    "αίτημα ἀρχὴ",
    "запрос ёж їжак",
    "Բարև",
    "שָׁלוֹם",
    "الطلب، ١٢٣",
    "अनुरोध क़",
    "বাংলা",
    "தமிழ்",
    "ภาษาไทย",
    "ქართული",
    "한국어 ᄀ",
    "リクエスト、ｶﾅ",
    "请求失败。",
    "（全角１２３）",
    "€ → ≥ ✓ ─┐ “q” … ①",
    '{"k": ["три", 2.5]}',
    "def f(x):\n    return x  # 注释\n",
    "    ",
    "\n\n",
    "\r\n",
    "\u00a0",
    "\u3000\u3000",
    "\u2009\u202f",
    "\u2028",
    "\x85",
    "\x1c\x1d",
    "\u200b\u200d",
    "e\u0301",
    "a\u0308\u0323",
    "\u0301\u0301",
    "🙂",
    "👍🏽",
    "❤️",
    "🇩🇪",
    "👨\u200d👩\u200d👧",
    "'s",
    "'ſ",
    "'Ｓ",
    "ǅ'ǆ",
    "It'LL",
    "12345",
]
_TEXT = st.lists(st.one_of(_BLOCK_TEXT, st.sampled_from(_SNIPPETS)), max_size=10).map("".join)


@pytest.mark.parametrize("vocab", VOCABS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_counts_by_pre_tokens_equal_the_tokenizer_on_every_script(vocab: str, data: st.DataObject) -> None:
    pieces = _counter(vocab)
    assert_counts_like_the_tokenizer(pieces, _unicode(pieces), data.draw(st.lists(_TEXT, min_size=1, max_size=4)))


@pytest.mark.parametrize("vocab", VOCABS)
def test_pieces_the_rule_does_not_cover_go_to_the_tokenizer(vocab: str) -> None:
    pieces = _counter(vocab)
    rule = _unicode(pieces)
    nfc = rule._nfc
    cases = {
        "Ошибка сервиса 🙂": False,  # emoji: another plane
        "❤️ ok": False,  # a variation selector: not in a covered block
        "\u0378 Greek gap": False,  # unassigned in a covered block
        "ﬁ ligature": False,  # Alphabetic Presentation Forms: not covered
        "请求失败\U00020000": False,  # CJK Extension B: another plane
        "cafe\u0301": not nfc,  # decomposed: the NFC normaliser would compose it
        "\u2126 ohm sign": not nfc,  # NFC writes it as Greek omega
        "café, 请求, Ошибка\u00a0\u3000": True,
    }
    for text, taken in cases.items():
        assert rule.takes(text) is taken, text
        assert pieces.alone(text) == pieces.full(text)
        assert pieces.count(f"<|im_start|>{text}<|im_end|>") == pieces.full(f"<|im_start|>{text}<|im_end|>")


# -- the classes, proved by the tokenizer --------------------------------------------------------------------------
def test_the_whitespace_class_is_the_tokenizer_engines() -> None:
    # Oniguruma's \s is Unicode White_Space: tab to CR, NEL, and the space, line and paragraph separators; not the
    # separators U+001C-U+001F, which Python's str.isspace() counts. Every BMP character, by the tokenizer's split:
    # whitespace is cut off a following "." and joins a run of itself; a number is cut off too, but not joined.
    split = _backend("qwen2-raw").pre_tokenizer.pre_tokenize_str
    chars = [chr(code) for code in range(0x10000) if not 0xD800 <= code < 0xE000]
    cut = [len(split(f".{c}")) == 2 for c in chars]
    joined = [len(split(f"{c}{c}")) == 1 for c in chars]
    engine = {c for c, a, b in zip(chars, cut, joined, strict=True) if a and b and c not in "\r\n"}
    assert {"\x1c", "\x1d", "\x1e", "\x1f", "\u200b"}.isdisjoint(engine)
    assert {"\t", "\x0b", "\x0c", " ", "\x85", "\u00a0", "\u2028", "\u2029", "\u3000"} <= engine
    ours = set(_coverage().classes.spaces) - {"\r", "\n"}
    assert ours == {c for c in engine if c.isascii() or not _coverage().uncovered.search(c)}


def test_the_class_probe_holds_every_covered_character() -> None:
    coverage = _coverage()
    classes = coverage.classes
    assert set(coverage.probe) >= set(classes.chars)
    parts = (classes.letters, classes.numbers, classes.marks, classes.spaces, classes.others)
    assert sorted("".join(parts)) == list(classes.chars)  # each character in exactly one class
    assert coverage.uncovered.search(classes.chars) is None
    assert coverage.uncovered.search("\u0378")  # unassigned
    assert coverage.uncovered.search("🙂")  # another plane


def _moved(char: str, source: str, target: str) -> type[UnicodeWords]:
    """A false rule: the pre-token regex with one character in the wrong class."""

    class Moved(UnicodeWords):
        def __init__(self, tokenizer: Any) -> None:
            super().__init__(tokenizer)
            classes = _coverage().classes
            wrong = dataclasses.replace(
                classes,
                **{
                    source: getattr(classes, source).replace(char, ""),
                    target: "".join(sorted(getattr(classes, target) + char)),
                },
            )
            pattern = _word_split(tokenizer.backend)
            assert pattern is not None
            self.findall = re.compile(wrong.written_out(pattern)).findall

    return Moved


@pytest.mark.parametrize(
    ("char", "source", "target"),
    [
        ("\u00a0", "spaces", "letters"),  # a no-break space taken for a letter
        ("\x85", "spaces", "others"),  # NEL, which Oniguruma's \s matches
        ("\u0661", "numbers", "letters"),  # an Arabic-Indic digit taken for a letter
        ("\u9fa5", "letters", "others"),  # an ideograph taken for punctuation
        ("\u017f", "letters", "numbers"),  # long s, which a contraction ('s) matches case-insensitively
    ],
)
def test_a_unicode_rule_the_tokenizer_disproves_is_switched_off(char: str, source: str, target: str) -> None:
    class WithFalseUnicode(PieceCounter):
        candidates = (Pieces, Segments, LineBlocks, AsciiWords, _moved(char, source, target), ByteBound)

    pieces = WithFalseUnicode(hf_tokenizer("qwen2").backend_tokenizer)
    assert "unicode" in pieces.rules.on  # the settings allow it: only the tokenizer can say it is false
    assert pieces.verify()
    why = pieces.rules.why_off("unicode")
    assert why is not None
    assert "disagreed with the tokenizer" in why
    assert set(pieces.rules.on) == {"pieces", "segments", "blocks", "words", "bound"}
    text = f"<|im_start|>user\nx{char}y {char}1 '{char} 请求{char}失败 Ошибка{char}<|im_end|>"
    assert pieces.count(text) == pieces.full(text)


# -- whole prompts -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "vocab", "rule"),
    [
        ("Qwen-Qwen3-0.6B", "qwen2", "unicode"),
        ("meta-llama-Llama-3.3-70B-Instruct", "llama-bpe", "unicode"),
        ("google-gemma-4-31B-it", "gemma-4", "spaces"),  # the rule of test_pieces_spaces.py
    ],
)
def test_prompts_in_every_script_count_as_the_chat_template_encodes_them(name: str, vocab: str, rule: str) -> None:
    tokenizer = hf_tokenizer(vocab)
    counter = ck.HFChatTemplateCounter(tokenizer, chat_template=template(name))
    assert counter._pieces is not None
    assert rule in counter._pieces.rules.on
    for script in SCRIPTS:
        conversation = build_script(script, messages=40, seed=11)
        for messages in (conversation[:20], conversation):  # cold, then grown by twenty messages
            while messages[-1]["role"] == "assistant":
                messages = messages[:-1]
            plain, _ = ck.server_view(messages, content_format=counter.content_format)
            ids = tokenizer.apply_chat_template(
                plain,
                tools=TOOLS,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
                chat_template=template(name),
            )
            assert counter.count(messages, tools=TOOLS) == len(ids), (script, len(messages))
