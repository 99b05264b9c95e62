"""The counting rules of the piece counter: which hold for each real vocabulary and why the others do not, a rule
the tokenizer disproves switched off, and every fast path equal to whole-text encoding on text of every script."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, normalizers

from assets import tokenizer_dir
from conftest import assert_switched_off, hf_tokenizer
from contextkeeper.tokens.pieces import RULES, AsciiWords, ByteBound, LineBlocks, PieceCounter, Pieces, Segments

# What each vocabulary of the test assets gets: the rules on after verify(), and the byte bound's kind.
EXPECTED: dict[str, tuple[set[str], str | None]] = {
    "qwen2": ({"pieces", "segments", "blocks", "words", "unicode", "bound"}, "ascii"),
    "harmony-on-qwen2": ({"pieces", "segments", "blocks", "words", "unicode", "bound"}, "ascii"),
    "qwen35": ({"pieces", "segments", "blocks", "words", "unicode", "bound"}, "ascii"),
    "llama-bpe": ({"pieces", "segments", "blocks", "words", "unicode", "bound"}, "any"),
    "deepseek-v4": ({"pieces", "segments", "blocks", "deepseek", "bound"}, "any"),
    "deepseek-llm": ({"pieces", "segments", "bound"}, "any"),
    "gemma-4": ({"pieces", "segments", "spaces", "bound"}, "any"),
    "llama-spm": ({"pieces", "segments"}, None),
    "phi-3": ({"pieces", "segments"}, None),
}


def _backend(vocab: str) -> Any:
    """A fresh tokenizers.Tokenizer of the vocabulary (one a test may change)."""
    return Tokenizer.from_file(str(tokenizer_dir(vocab) / "tokenizer.json"))


@pytest.mark.parametrize("vocab", sorted(EXPECTED))
def test_each_vocabulary_reports_which_rules_are_on_and_why_the_others_are_off(vocab: str) -> None:
    pieces = PieceCounter(hf_tokenizer(vocab).backend_tokenizer)
    assert not pieces.rules.verified
    assert pieces.verify()
    report = pieces.rules
    on, kind = EXPECTED[vocab]
    assert report.verified
    assert set(report.on) == on
    assert {name for name, _ in report.off} == {rule.name for rule in RULES} - on
    assert all(why for _, why in report.off)
    assert (pieces._bound.kind if pieces._bound is not None else None) == kind
    for name, why in report.off:
        assert f"off: {name}: {why}" in str(report)
        assert report.why_off(name) == why
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.on = ()  # type: ignore[misc]


class _EveryThreeCharacters(LineBlocks):
    """A false rule: a piece counts as its three-character slices (a BPE merge runs across such cuts)."""

    def cut(self, piece: str, every: int = 8) -> list[str]:
        return [piece[i : i + 3] for i in range(0, len(piece), 3)]


class _WithFalseBlocks(PieceCounter):
    candidates = (Pieces, Segments, _EveryThreeCharacters, AsciiWords, ByteBound)


def test_a_rule_the_tokenizer_disproves_is_switched_off_and_reported() -> None:
    pieces = _WithFalseBlocks(hf_tokenizer("qwen2").backend_tokenizer)
    assert_switched_off(pieces, "blocks", {"pieces", "segments", "words", "bound"})
    # A long piece of many lines, not ASCII (ASCII goes by pre-tokens): counted whole, and right.
    text = "<|im_start|>user\n" + "\n".join(f"строка {i}: значение — {i * 37}" for i in range(200)) + "<|im_end|>"
    assert pieces.count(text) == pieces.full(text)
    assert pieces.alone_many([text[20:]]) == [pieces.full(text[20:])]


def test_a_single_word_added_token_turns_piece_counting_off() -> None:
    # A single_word token matches only between word borders: where the text is cut depends on its neighbours.
    backend = _backend("qwen2")
    backend.add_tokens([AddedToken("<|w|>", single_word=True)])
    pieces = PieceCounter(backend)
    assert not pieces.verify()
    assert pieces.rules.on == ("bound",)
    assert "single_word" in (pieces.rules.why_off("pieces") or "")
    assert pieces.rules.why_off("words") == "needs the pieces rule, which is off"
    for text in ("a <|w|> b<|w|>c", "<|im_start|>x <|w|>\n<|w|><|im_end|>", "<|w|>"):
        assert pieces.count(text) == pieces.full(text)
        assert pieces.count_segments([text[:3], text[3:]]) == pieces.full(text)
        assert pieces.alone(text) == pieces.full(text)


def test_an_added_token_that_strips_whitespace_turns_segment_reuse_off() -> None:
    # An lstrip token swallows the spaces before it, however many: a match has no bounded length, so a border
    # cannot be decided from a bounded look at either side.
    backend = _backend("qwen2")
    backend.add_special_tokens([AddedToken("<|s|>", lstrip=True, rstrip=True)])
    pieces = PieceCounter(backend)
    assert pieces.verify()
    assert "segments" not in pieces.rules.on
    assert "lstrip" in (pieces.rules.why_off("segments") or "")
    segments = ["<|im_start|>user\nhello   ", "<|s|>  world", "   ", "<|s|><|im_end|>\n"]
    for _ in range(2):
        assert pieces.count_segments(segments) == pieces.full("".join(segments))
        assert pieces.count("".join(segments)) == pieces.full("".join(segments))
    assert pieces.count("".join(segments[:2])) == pieces.full("".join(segments[:2]))


# Text of every script, and what sits between: whitespace runs, code, JSON, emoji sequences, combining marks.
_SCRIPTS = {
    "latin": "abcdefghijklmnopqrstuvwxyzABCXYZ éüßøñçÀ'",
    "cjk": "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年，。、「」",
    "hangul": "한국어의문장입니다가나다",
    "cyrillic": "абвгдежзийклмнопрстуфхцчшщъыьэюяАБВЖЩЁё",
    "arabic": "ابتثجحخدذرزسشصضطظعغفقكلمنهوي،ًٌٍَُِّْ",
    "hebrew": "אבגדהוזחטיכלמנסעפצקרשת",
    "devanagari": "अआइईउऊएऐओऔकखगघचछजझटठडढणतथदधनपफबभमयरलवशषसह ािीुूेैोौंः्।",
    "thai": "กขคงจฉชซญดตถทนบปผพฟภมยรลวศษสหอฮะาิีึืุู่้๊๋",
    "emoji": "🙂👍🏽❤️🔥🇩🇪\u200d👨👩👧",
    "marks": "e\u0301a\u0308o\u0303\u0327\u20dd",
    "space": " \t\n\r\x0b\x0c\u00a0\u2009\u3000\u2028",
    "code": "def f(x):\n    return {'k': [1, 2.5, None]}  # ok\n;{}()[]<>=+-*/\\|&^%$#@!~`\"",
    "digits": "0123456789٠١٢٣४५६",
}
_word = st.sampled_from(sorted(_SCRIPTS)).flatmap(lambda name: st.text(st.sampled_from(_SCRIPTS[name]), max_size=30))
_COUNTERS: dict[str, tuple[PieceCounter, list[str]]] = {}


def _counter(vocab: str) -> tuple[PieceCounter, list[str]]:
    """One verified counter per vocabulary, kept warm across examples (its caches are part of what is tested)."""
    if vocab not in _COUNTERS:
        backend = hf_tokenizer(vocab).backend_tokenizer
        pieces = PieceCounter(backend)
        pieces.verify()
        specials = [t.content for t in backend.get_added_tokens_decoder().values() if t.content]
        _COUNTERS[vocab] = (pieces, specials[:40] + specials[-20:])
    return _COUNTERS[vocab]


@pytest.mark.parametrize("vocab", sorted(EXPECTED))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_fast_path_equals_whole_text_encoding_on_every_script(vocab: str, data: st.DataObject) -> None:
    pieces, specials = _counter(vocab)
    token = st.sampled_from(specials)
    line = st.lists(st.one_of(_word, _word, token), max_size=8).map("".join)
    lines = data.draw(st.lists(line, min_size=1, max_size=8))
    text = "\n".join(lines)
    if data.draw(st.booleans()):  # long: over the line-block size, as a long tool result is
        text = "\n".join([text] * (1100 // max(1, len(text)) + 1))
    whole = pieces.full(text)
    assert pieces.count(text) == whole
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    segments = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert pieces.count_segments(segments) == whole
    assert pieces.alone(text) == whole
    assert pieces.alone_many([*segments, text]) == [*map(pieces.full, segments), whole]
    bound = pieces.bound(text)
    assert bound is None or whole <= bound


@settings(max_examples=200, deadline=None)
@given(text=st.text(st.characters(codec="utf-8"), max_size=40))
def test_the_byte_bound_holds_for_byte_fallback_text(text: str) -> None:
    # Gemma 4's vocabulary is BPE over characters with byte fallback, and its normaliser writes each space as
    # "▁": a character missing from the vocabulary becomes its UTF-8 bytes, one token each, so any text (emoji,
    # private-use, control and unassigned characters, lone spaces) stays within its byte count.
    pieces, _ = _counter("gemma-4")
    assert pieces.bound(text) is not None
    assert pieces.full(text) <= pieces.bound(text)
    assert pieces.full(text + " \U000f0000\x00 ") <= pieces.bound(text + " \U000f0000\x00 ")


def test_a_normaliser_that_lengthens_the_text_turns_the_bound_off() -> None:
    # The same vocabulary with spaces replaced by a character it lacks (three byte-fallback tokens each, for a
    # one-byte space) is refused by the settings alone.
    backend = _backend("gemma-4")
    missing = next(chr(c) for c in range(0xF0000, 0xF0100) if backend.token_to_id(chr(c)) is None)
    backend.normalizer = normalizers.Replace(" ", missing)
    assert len(backend.encode("a b", add_special_tokens=False).ids) > len(b"a b")  # the bound would be false
    pieces = PieceCounter(backend)
    assert "bound" not in pieces.rules.on
    why = pieces.rules.why_off("bound")
    assert why == "not BPE whose pre-tokenizer only cuts and whose normaliser keeps the length"
