"""The space rule (``spaces``): a tokenizer that encodes a whole text as one BPE word (Gemma 4's writes each space
as "▁" and cuts nothing) counts a piece as its words cut before spaces, each distinct word encoded once by the BPE
model. Every count equals the tokenizer's, on text of every script, alone, after an added token and in whole
prompts (those in test_pieces_unicode.py); the cuts the vocabulary rules out are not made; a rule that makes them
anyway is disproved and switched off."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, normalizers

from conftest import assert_counts_like_the_tokenizer, assert_switched_off, hf_tokenizer, verified_pieces
from contextkeeper.tokens.pieces import ByteBound, PieceCounter, Pieces, Segments, SpaceWords
from contextkeeper.tokens.pieces._rules import Tokenizer as RuleTokenizer
from contextkeeper.tokens.pieces._rules import _borders

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from agent_conversation import build_script


def _spaces(pieces: PieceCounter) -> SpaceWords:
    rule = pieces._spaces
    assert rule is not None, pieces.rules
    return rule


def test_the_rule_is_on_for_gemma_and_reads_where_not_to_cut_from_the_vocabulary() -> None:
    pieces = verified_pieces("gemma-4")
    rule = _spaces(pieces)
    assert rule.symbol == "▁"
    # Gemma 4 has one token with a character before its space symbol, ">▁</": no space after a ">" starts a word.
    assert rule.findall("<b> </b>, and  two\n\nlines ") == ["<b> </b>,", " and", "  two", "\n\n", "lines", " "]
    for text in ("<b> </b>", "a </b>", "x  y", " lead", "tail ", "\n\n\n", "▁ ▁x"):
        assert rule.count([text], pieces._tokenizer) == [pieces.full(text)], text


@pytest.mark.parametrize("vocab", ["llama-spm", "phi-3", "qwen2", "deepseek-v4"])
def test_tokenizers_that_cut_or_prefix_their_text_do_not_get_the_rule(vocab: str) -> None:
    pieces = PieceCounter(hf_tokenizer(vocab).backend_tokenizer)
    why = pieces.rules.why_off("spaces")
    assert why == "the tokenizer is not BPE that replaces spaces by one symbol and then cuts nothing"


# Text of every script with the spacing a chat has (runs of spaces, newlines, tabs, no-break and ideographic
# spaces), markup with spaces between tags, code and JSON, and the tokenizer's own space symbol typed as text.
_SNIPPETS = [
    "déjà vu, Größe ",
    "Tiếng Việt đã",
    " αίτημα ἀρχὴ",
    "запрос ёж їжак ",
    "الطلب، ١٢٣ ",
    "अनुरोध क़ ",
    "请求失败。 ",
    "リクエスト、ｶﾅ",
    "한국어  ᄀ",
    '{"k": ["три", 2.5]}',
    "def f(x):\n    return x  # 注释\n",
    "<b> </b>",
    "> </",
    ">  <",
    "▁ ▁",
    "    ",
    "\n\n",
    "\r\n",
    "\t \t",
    "\u00a0 \u3000",
    "e\u0301 ",
    "🙂 👍🏽",
    "12345 678",
]
_TEXT = st.lists(
    st.one_of(st.sampled_from(_SNIPPETS), st.text(st.characters(codec="utf-8"), max_size=8)), max_size=12
).map("".join)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(texts=st.lists(_TEXT, min_size=1, max_size=4))
def test_counts_by_words_equal_the_tokenizer_on_every_script(texts: list[str]) -> None:
    pieces = verified_pieces("gemma-4")
    assert_counts_like_the_tokenizer(pieces, _spaces(pieces), texts)


def test_a_long_chat_costs_its_distinct_words() -> None:
    pieces = PieceCounter(hf_tokenizer("gemma-4").backend_tokenizer)
    assert pieces.verify()
    texts = [m["content"] for m in build_script("latin", messages=200, seed=5) if m.get("content")]
    sent = pieces._tokenizer.chars
    assert pieces.alone_many(texts) == [pieces.full(text) for text in texts]
    words = pieces._tokenizer.chars - sent - sum(map(len, texts))  # full() above sent every text once more
    assert 0 < words < sum(map(len, texts)) / 3  # repeated words are encoded once


class _EveryCut(SpaceWords):
    """A false rule: a cut before every space, as if no token ran across one."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self.findall = re.compile(r"(?<=[^ ▁])(?= )").split


def test_cutting_where_a_token_runs_across_the_space_is_disproved_and_switched_off() -> None:
    class WithEveryCut(PieceCounter):
        candidates = (Pieces, Segments, _EveryCut, ByteBound)

    pieces = WithEveryCut(hf_tokenizer("gemma-4").backend_tokenizer)
    assert_switched_off(pieces, "spaces", {"pieces", "segments", "bound"})
    text = "<start_of_turn>user\n<b> </b> ok<end_of_turn>"
    assert pieces.count(text) == pieces.full(text)


def _tiny(with_joined: bool) -> Any:
    """A real tokenizers BPE of a few symbols, spaces written as "▁", with or without a token that runs across
    the space in "a b"."""
    vocab = {"<unk>": 0, "<s>": 1, "a": 2, "b": 3, "▁": 4, "▁b": 5, "a▁": 6, "a▁b": 7, "c": 8}
    merges = [("a", "▁"), ("a▁", "b"), ("▁", "b")]
    if not with_joined:
        vocab = {token: i for i, token in enumerate(t for t in vocab if t not in ("a▁", "a▁b"))}
        merges = [("▁", "b")]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.add_special_tokens(["<s>"])
    return backend


@pytest.mark.parametrize("with_joined", [True, False])
def test_a_token_across_the_space_keeps_the_words_together(with_joined: bool) -> None:
    backend = _tiny(with_joined)
    rule = SpaceWords(RuleTokenizer(backend))
    assert _borders(list(backend.get_vocab()), "▁")[0] == ("a" if with_joined else "")
    assert rule.findall("a b c b") == (["a b", " c", " b"] if with_joined else ["a", " b", " c", " b"])
    assert len(backend.encode("a b", add_special_tokens=False).ids) == (1 if with_joined else 2)
    for text in ("a b", "a b c b", "ca  b", "b a"):
        assert rule.count([text], RuleTokenizer(backend)) == [len(backend.encode(text, add_special_tokens=False))]
