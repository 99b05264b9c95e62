"""The pre-token rule for DeepSeek V3's tokenizer (``deepseek``): its three splits in sequence (runs of up to three
numbers, runs of CJK ideographs and kana, then its word pattern) cut by one regex of our own, each distinct
pre-token encoded once by the BPE model. The cut equals the tokenizer's own pre-tokenizer, counts equal the
tokenizer's, the tokenizer disproves a rule with one character in the wrong class, and whole DeepSeek V3.1
prompts in every script count as ``apply_chat_template`` encodes them."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

import contextkeeper as ck
from assets import template, tokenizer_dir
from conftest import assert_counts_like_the_tokenizer, assert_switched_off, hf_tokenizer, verified_pieces
from contextkeeper.tokens.pieces import AsciiWords, ByteBound, LineBlocks, PieceCounter, Pieces, Segments
from contextkeeper.tokens.pieces._rules import (
    _COVERED_BLOCKS,
    DeepSeekWords,
    _Classes,
    _coverage,
    _deepseek_pattern,
    _symbols,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from agent_conversation import SCRIPTS, TOOLS, build, build_script

TEMPLATE = "deepseek-ai-DeepSeek-V3.1"


def _raw(vocab: str) -> Any:
    """The vocabulary's own tokenizer.json, as the tokenizers library loads it."""
    return Tokenizer.from_file(str(tokenizer_dir(vocab) / "tokenizer.json"))


def _counter(vocab: str = "deepseek-v4") -> PieceCounter:
    return verified_pieces(vocab)  # type: ignore[no-any-return]


def _rule(pieces: PieceCounter) -> DeepSeekWords:
    rule = pieces._deepseek
    assert rule is not None, pieces.rules
    return rule


def _theirs(pieces: PieceCounter, text: str) -> list[str]:
    return [word for word, _ in pieces._tokenizer.backend.pre_tokenizer.pre_tokenize_str(text)]


def _ours(rule: DeepSeekWords, text: str) -> list[str]:
    return [_symbols(word) for word in rule.findall(text)]


# -- which tokenizers get the rule -------------------------------------------------------------------------------------
@pytest.mark.parametrize("load", ["transformers", "tokenizer.json"])
def test_the_rule_is_on_for_deepseek_v4_and_reported(load: str) -> None:
    backend = hf_tokenizer("deepseek-v4").backend_tokenizer if load == "transformers" else _raw("deepseek-v4")
    pieces = PieceCounter(backend)
    assert "deepseek" in pieces.rules.on  # read from the settings
    assert pieces.verify()
    assert pieces.rules.on == ("pieces", "segments", "blocks", "deepseek", "bound")
    assert "Llama 3, Qwen2 or Qwen3.5" in (pieces.rules.why_off("unicode") or "")
    assert not _rule(pieces)._nfc  # its normaliser is an empty Sequence: it changes nothing
    assert backend.normalizer.normalize_str("cafe\u0301 Ｓ") == "cafe\u0301 Ｓ"


def test_deepseek_llm_has_another_pre_tokenizer_and_not_the_rule() -> None:
    # The first DeepSeek LLM's vocabulary, as the test assets hold it (converted from llama.cpp's GGUF file), is
    # ByteLevel with GPT-2's regex, not the three splits: the rule is off, and says why.
    pieces = _counter("deepseek-llm")
    assert "deepseek" not in pieces.rules.on
    assert "DeepSeek V3's digit, CJK and word splits" in (pieces.rules.why_off("deepseek") or "")
    text = "请求 1234567 失败：上游服务超时。Запрос\u00a0«503»"
    assert pieces.alone(text) == pieces.full(text)


# -- the defect: DeepSeek pieces were all sent to the tokenizer --------------------------------------------------------
@pytest.mark.parametrize(
    "line",
    [
        "Request {i} failed: the upstream service returned HTTP 503 after 30.5 s; rolled back to v2.14.1.",
        "请求 {i} 失败：上游服务超时，我们回滚了部署。リクエスト{i}はタイムアウトで失敗しました。",
        "Запрос {i} завершился ошибкой: сервис вернул «503» после таймаута.",
        "الطلب {i} فشل لأن الخدمة أعادت خطأ بعد انتهاء المهلة، وقمنا بالتراجع.",
    ],
)
def test_a_deepseek_text_costs_its_distinct_pre_tokens_only(line: str) -> None:
    pieces = PieceCounter(hf_tokenizer("deepseek-v4").backend_tokenizer)
    pieces.verify()
    text = "\n".join(line.format(i=i * 7919) for i in range(200))
    assert pieces.alone(text) == pieces.full(text)
    spent = pieces.encoded_chars - len(text)  # less what full() encoded
    assert 0 < spent < len(text) / 10, spent  # the words and signs once, and the digit groups
    changed = text + " 一二三"  # new pre-tokens: " ", the ideographs, and the last sign without its newline
    before = pieces.encoded_chars
    assert pieces.alone(changed) == pieces.full(changed)
    assert 0 < pieces.encoded_chars - before - len(changed) <= 6


def test_a_deepseek_prompt_is_counted_without_the_tokenizers_batch() -> None:
    counter = ck.HFChatTemplateCounter(hf_tokenizer("deepseek-v4"), chat_template=template(TEMPLATE))
    messages = build_script("mixed", messages=60)
    counter.count(messages, tools=TOOLS)
    chars = sum(len(str(message.get("content") or "")) for message in messages)
    assert 0 < counter.encoded_chars < chars / 5, (counter.encoded_chars, chars)


# -- the cut, case by case: what the tokenizer does, and ours the same -------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("x1234567y", ["x", "123", "456", "7", "y"]),  # numbers in threes from the run's start, cut off
        (" 3.14159", [" ", "3", ".", "141", "59"]),
        ("١٢٣٤ ５５５５", ["١٢٣", "٤", " ", "５５５", "５"]),  # any \p{N}, not only ASCII digits
        ("abc漢字かなカナdef", ["abc", "漢字かなカナ", "def"]),  # CJK and kana runs cut out of a word
        ("请求失败。重试", ["请求失败", "。", "重试"]),  # "。" is not in the second split's class
        ("ア・イ ー", ["ア", "・", "イ", " ", "ー"]),  # inside a kana run: words and signs apart
        (" 漢\u3000漢", [" ", "漢", "\u3000", "漢"]),  # whitespace before a run is cut off before it
        ("カ\u0301", ["カ", "\u0301"]),  # a combining mark is not kana: a piece of its own
        (".NET (x) 'tis", [".NET", " (", "x", ")", " '", "tis"]),  # one ASCII sign before ASCII letters
        (".é «abc»", [".", "é", " «", "abc", "»"]),  # not before other letters
        ("ok!!\n\n  next", ["ok", "!!\n\n", " ", " next"]),  # signs take the newlines after them
        # A format character is the prefix of a letter after it, else a piece of its own (with its like).
        ("a\u200bb a\u200b\u200b b", ["a", "\u200bb", " a", "\u200b\u200b", " b"]),
    ],
)
def test_the_cut_is_the_tokenizers_own(text: str, expected: list[str]) -> None:
    pieces = _counter()
    rule = _rule(pieces)
    assert rule.takes(text)
    assert rule.findall(text) == expected
    assert _ours(rule, text) == _theirs(pieces, text)
    assert rule.count([text], pieces._tokenizer) == [pieces.full(text)]


# -- counts equal the tokenizer's on text of every script --------------------------------------------------------------
_KANA = [(0x3040, 0x30FF), (0x4E00, 0x9FA5)]
_BLOCK_TEXT = st.sampled_from(
    (*_COVERED_BLOCKS, *_KANA, (0x0000, 0x007F), (0x1F300, 0x1FAFF), (0xF900, 0xFAFF))
).flatmap(lambda block: st.text(st.characters(min_codepoint=block[0], max_codepoint=block[1]), max_size=12))
_SNIPPETS = [
    "déjà vu, Größe",
    "Tiếng Việt đã",
    "αίτημα ἀρχὴ",
    "запрос ёж їжак",
    "שָׁלוֹם",
    "الطلب، ١٢٣٤٥٦٧",
    "अनुरोध क़ १२३४",
    "ภาษาไทย ๑๒๓",
    "한국어 ᄀ",
    "リクエスト、ｶﾅ゙",
    "请求失败。",
    "（全角１２３４５）",
    "漢a",
    "a漢",
    "漢1",
    "1漢",
    "漢\n",
    "\u3000漢",
    "ー",
    "・",
    "゛",
    "\u3099",
    "€ → ≥ ✓ ─┐ “q” … ①",
    '{"k": ["три", 2.5], "n": 1234567, "pi": 3.14159}',
    "def f(x):\n    return x  # 注释\n",
    "1234567",
    "3.14159",
    "v2.14.1",
    "12,345.67",
    "0x1F",
    "(a)",
    ".b",
    "'s",
    "--x",
    "#tag",
    "@me",
    "!!\n\n",
    " «»\r\n",
    "…\n",
    "\n\n",
    "\r\n",
    "    ",
    "\t",
    "\u00a0",
    "\u3000\u3000",
    "\u2009\u202f",
    "\u2028",
    "\x85",
    "\x00",
    "\x1c\x1d",
    "\u200b",
    "\u200d",
    "\u00ad",
    "e\u0301",
    "a\u0308\u0323",
    "\u0301\u0301",
    "cafe\u0301",
    "🙂",
    "👍🏽",
    "❤️",
    "👨\u200d👩\u200d👧",
]
_TEXT = st.lists(st.one_of(_BLOCK_TEXT, st.sampled_from(_SNIPPETS)), max_size=10).map("".join)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_pre_tokens_and_counts_equal_the_tokenizer_on_every_script(data: st.DataObject) -> None:
    pieces = _counter()
    rule = _rule(pieces)
    texts = data.draw(st.lists(_TEXT, min_size=1, max_size=4))
    for text in texts:
        if rule.takes(text):
            assert _ours(rule, text) == _theirs(pieces, text)
    specials = ["<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"]
    assert_counts_like_the_tokenizer(pieces, rule, texts, specials)


def test_pieces_the_rule_does_not_cover_go_to_the_tokenizer() -> None:
    pieces = _counter()
    rule = _rule(pieces)
    cases = {
        "Ошибка сервиса 🙂": False,  # emoji: another plane
        "❤️ ok": False,  # a variation selector: not in a covered block
        "请求失败\U00020000": False,  # CJK Extension B: another plane
        "\ue000 private": False,  # private use: not covered
        "ﬁ ligature": False,  # Alphabetic Presentation Forms: not covered
        "cafe\u0301 \x00\u200b 请求1234567": True,  # no normaliser: decomposed text is counted too
    }
    for text, taken in cases.items():
        assert rule.takes(text) is taken, text
        assert pieces.alone(text) == pieces.full(text)
        prompt = f"<｜User｜>{text}<｜Assistant｜>"
        assert pieces.count(prompt) == pieces.full(prompt)


# -- the classes, proved by the tokenizer ------------------------------------------------------------------------------
def _wrong(char: str, source: str, target: str) -> _Classes:
    """The covered characters' classes with ``char`` moved from one to another."""
    classes = _coverage().classes
    assert char in getattr(classes, source)
    return dataclasses.replace(
        classes,
        **{
            source: getattr(classes, source).replace(char, ""),
            target: "".join(sorted(getattr(classes, target) + char)),
        },
    )


@pytest.mark.parametrize(
    ("char", "source", "target"),
    [
        ("\u00a0", "spaces", "letters"),  # a no-break space taken for a letter
        ("\u3000", "spaces", "others"),  # the ideographic space taken for a format character
        ("\u0661", "numbers", "letters"),  # an Arabic-Indic digit taken for a letter
        ("\u2460", "numbers", "others"),  # a circled digit (No) taken for a format character
        ("\u30fb", "others", "letters"),  # the katakana middle dot, inside a kana run, taken for a letter
        ("\u30fc", "letters", "others"),  # the prolonged sound mark (Lm) taken for punctuation
        ("\u0301", "marks", "others"),  # a combining mark taken for a format character
        ("\u00ab", "others", "letters"),  # « taken for a letter
        ("\u200b", "others", "spaces"),  # the zero-width space (a format character) taken for whitespace
        ("\u00ad", "others", "marks"),  # the soft hyphen (a format character) taken for a mark
        ("\x00", "others", "spaces"),  # NUL taken for whitespace
        ("'", "others", "letters"),  # the apostrophe taken for a letter
    ],
)
def test_a_rule_the_tokenizer_disproves_is_switched_off(char: str, source: str, target: str) -> None:
    wrong = re.compile(_deepseek_pattern(_wrong(char, source, target))).findall

    class Wrong(DeepSeekWords):
        def __init__(self, tokenizer: Any) -> None:
            super().__init__(tokenizer)
            self.findall = wrong

    class WithWrongRule(PieceCounter):
        candidates = (Pieces, Segments, LineBlocks, AsciiWords, Wrong, ByteBound)

    pieces = WithWrongRule(hf_tokenizer("deepseek-v4").backend_tokenizer)
    assert_switched_off(pieces, "deepseek", {"pieces", "segments", "blocks", "bound"})
    text = f"<｜User｜>x{char}y {char}1 .{char} '{char}a 请求{char}失败 カ{char}ナ {char}{char}\n<｜Assistant｜>"
    assert pieces.count(text) == pieces.full(text)


# -- whole prompts -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("script", ["ascii", *sorted(SCRIPTS)])
def test_deepseek_prompts_in_every_script_count_as_the_chat_template_encodes_them(script: str) -> None:
    tokenizer = hf_tokenizer("deepseek-v4")
    source = template(TEMPLATE)
    counter = ck.HFChatTemplateCounter(tokenizer, chat_template=source)
    assert counter._pieces is not None
    assert "deepseek" in counter._pieces.rules.on
    conversation = build(40, seed=11) if script == "ascii" else build_script(script, messages=40, seed=11)
    for messages in (conversation[:20], conversation):  # cold, then grown by twenty messages
        while messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        plain, _ = ck.server_view(messages, content_format=counter.content_format)
        ids = tokenizer.apply_chat_template(
            plain, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False, chat_template=source
        )
        assert counter.count(messages, tools=TOOLS) == len(ids), (script, len(messages))
