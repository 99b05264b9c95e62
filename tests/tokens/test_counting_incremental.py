"""Incremental counting: a turn costs its new text, windows cost nothing new, caches stay bounded, and after any
sequence of edits the warm count equals a fresh full count."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import contextkeeper as ck
from assets import template
from conftest import fresh_pieces, hf_tokenizer, verified_pieces
from contextkeeper._memo import cache_usage, set_cache_bytes
from contextkeeper.tokens.pieces import PieceCounter
from contextkeeper.tokens.pieces._rules import _blocks, _line_safe, _word_rule
from conversations import TOOLS, call

FAMILIES = [
    ("Qwen-Qwen2.5-7B-Instruct", "qwen2"),
    ("meta-llama-Llama-3.3-70B-Instruct", "llama-bpe"),
    ("microsoft-Phi-3.5-mini-instruct", "phi-3"),  # SentencePiece: the first-piece prefix-space rule
    ("Qwen-Qwen3-0.6B", "qwen2"),  # strips reasoning from earlier turns: history text changes as turns arrive
]


def fresh_count(name: str, vocab: str, messages: list[dict[str, Any]], tools: Any) -> int:
    tokenizer = hf_tokenizer(vocab)
    fmt = ck.HFChatTemplateCounter(tokenizer, chat_template=template(name)).content_format
    plain, _ = ck.server_view(messages, content_format=fmt)
    ids = tokenizer.apply_chat_template(
        plain, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False, chat_template=template(name)
    )
    return len(ids)


_text = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)),
    max_size=60,
) | st.sampled_from(["", " ", "\n\n", "```py\nx = 1\n```", "ünïcödé 中文 🙂", "<|im_end|>", "  spaced  "])

_edit = st.one_of(
    st.tuples(st.just("turn"), _text, _text),
    st.tuples(st.just("tool"), _text, _text),
    st.tuples(st.just("drop"), st.integers(1, 3), st.just("")),
    st.tuples(st.just("replace"), st.integers(0, 5), _text),
)


def _apply(messages: list[dict[str, Any]], edit: tuple[Any, Any, Any], step: int) -> list[dict[str, Any]]:
    kind, a, b = edit
    out = list(messages)
    if kind == "turn":
        out += [{"role": "assistant", "content": a or "ok"}, {"role": "user", "content": b or "next"}]
    elif kind == "tool":
        call_id = f"s{step:08d}"
        out += [
            {"role": "assistant", "content": None, "tool_calls": [call(call_id, "run_sql", sql=a)]},
            {"role": "tool", "tool_call_id": call_id, "content": b},
            {"role": "assistant", "content": "done"},
            {"role": "user", "content": "and then?"},
        ]
    elif kind == "drop":  # drop the oldest units after the system prompt, keep the history starting on a user turn
        conversation = ck.Conversation.from_messages(out)
        units = [u for u in conversation.units() if u.kind != "system"]
        keep_from = units[min(a, len(units) - 1)].start
        while keep_from < len(out) and out[keep_from]["role"] != "user":
            keep_from += 1
        if keep_from < len(out):
            out = out[:1] + out[keep_from:]
    else:  # replace a tool result's content
        tool_indices = [i for i, m in enumerate(out) if m["role"] == "tool"]
        if tool_indices:
            i = tool_indices[a % len(tool_indices)]
            out[i] = {**out[i], "content": f"[cleared: {len(out[i]['content'])} chars] {b}"}
    return out


@pytest.mark.parametrize(("name", "vocab"), FAMILIES)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(_edit, min_size=1, max_size=6), with_tools=st.booleans())
def test_incremental_count_equals_fresh_count_after_any_edits(
    name: str, vocab: str, edits: list[tuple[Any, Any, Any]], with_tools: bool
) -> None:
    counter = ck.HFChatTemplateCounter(hf_tokenizer(vocab), chat_template=template(name))
    tools = TOOLS if with_tools else None
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "start"},
    ]
    counter.count(messages, tools=tools)
    for step, edit in enumerate(edits):
        messages = _apply(messages, edit, step)
        assert counter.count(messages, tools=tools) == fresh_count(name, vocab, messages, tools), edit


def _long_conversation(turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."}]
    for i in range(turns):
        call_id = f"t{i:08d}"
        messages += [
            {"role": "user", "content": f"Question {i}: how many rows in shard {i}?"},
            {"role": "assistant", "content": None, "tool_calls": [call(call_id, "run_sql", sql=f"SELECT {i}")]},
            {"role": "tool", "tool_call_id": call_id, "content": json.dumps({"rows": list(range(i, i + 40))})},
            {"role": "assistant", "content": f"Shard {i} has 40 rows starting at {i}."},
        ]
    messages.append({"role": "user", "content": "Summarise."})
    return messages


def test_a_new_turn_costs_its_own_text() -> None:
    counter = ck.HFChatTemplateCounter(hf_tokenizer("qwen2"), chat_template=template("Qwen-Qwen2.5-7B-Instruct"))
    messages = _long_conversation(60)
    counter.count(messages, tools=TOOLS)
    history_chars = counter.encoded_chars
    new_turn = [
        {"role": "assistant", "content": "Sixty shards, forty rows each."},
        {"role": "user", "content": "Great — now list the three largest shards by row count, please."},
    ]
    before = counter.encoded_chars
    counter.count(messages + new_turn, tools=TOOLS)
    spent = counter.encoded_chars - before
    new_text = sum(len(m["content"]) for m in new_turn)
    assert spent <= new_text + 200, (spent, new_text)  # the new pieces plus their role headers
    # ASCII text is tokenized by distinct pre-tokens: the 60 turns cost their distinct words and signs once.
    assert 0 < spent < history_chars < sum(len(str(m.get("content") or "")) for m in messages) / 20


def test_counting_a_kept_window_tokenizes_nothing_new() -> None:
    counter = ck.HFChatTemplateCounter(
        hf_tokenizer("llama-bpe"), chat_template=template("meta-llama-Llama-3.3-70B-Instruct")
    )
    messages = _long_conversation(40)
    full = counter.count(messages)
    window = messages[:1] + messages[-41:]  # system + the last ten turns + the request
    before = counter.encoded_chars
    windowed = counter.count(window)
    assert counter.encoded_chars - before == 0
    assert windowed < full
    assert windowed == fresh_count("meta-llama-Llama-3.3-70B-Instruct", "llama-bpe", window, None)


def test_piece_cache_is_bounded() -> None:
    """The piece caches share the byte budget: far more distinct pieces than fit are counted exactly, and the
    caches never hold more than the budget."""
    backend = hf_tokenizer("qwen2").backend_tokenizer
    pieces = PieceCounter(backend)
    special = "<|im_start|>"
    limit = 64 * 1024
    set_cache_bytes(limit)
    try:
        for i in range(2_000):
            text = f"{special}piece number {i}{special}"
            assert pieces.count(text) == pieces.full(text)
            assert cache_usage().held <= limit
        assert 0 < pieces.cached_pieces < 2_000
    finally:
        set_cache_bytes(None)


@pytest.mark.parametrize("vocab", ["qwen2", "llama-bpe", "phi-3", "llama-spm", "gemma-4", "deepseek-v4", "qwen35"])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_piece_rule_matches_whole_text_encoding(vocab: str, data: st.DataObject) -> None:
    """The split-at-added-tokens rule (first piece included) proven per tokenizer family on random texts."""
    backend = hf_tokenizer(vocab).backend_tokenizer
    specials = [t.content for t in backend.get_added_tokens_decoder().values()][:200]
    pieces = fresh_pieces(vocab)
    assert pieces.fast
    parts = data.draw(st.lists(st.one_of(_text, st.sampled_from(specials)), min_size=1, max_size=12))
    text = "".join(parts)
    assert pieces.count(text) == pieces.full(text)


@pytest.mark.parametrize("vocab", ["qwen2", "llama-bpe", "phi-3"])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_counts_resumed_from_a_shared_prefix_equal_whole_text_encoding(vocab: str, data: st.DataObject) -> None:
    """Consecutive texts that share a prefix and then diverge anywhere (inside a token or a piece)."""
    backend = hf_tokenizer(vocab).backend_tokenizer
    specials = [t.content for t in backend.get_added_tokens_decoder().values()][:50]
    pieces = fresh_pieces(vocab)
    token = st.sampled_from(specials)
    base = "".join(data.draw(st.lists(st.one_of(_text, token), min_size=1, max_size=20)))
    texts = [base]
    for _ in range(4):
        cut = data.draw(st.integers(0, len(texts[-1])))
        tail = "".join(data.draw(st.lists(st.one_of(_text, token), max_size=6)))
        texts.append(texts[-1][:cut] + tail)
    for text in texts:
        assert pieces.count(text) == pieces.full(text)


@pytest.mark.parametrize("vocab", ["qwen2", "llama-bpe", "phi-3", "llama-spm", "gemma-4"])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_counts_summed_over_segments_equal_whole_text_encoding(vocab: str, data: st.DataObject) -> None:
    """Segments cut anywhere: on a token, inside one (a segment ending in a token's first half), inside a piece;
    several counts in a row reuse the per-segment cache."""
    backend = hf_tokenizer(vocab).backend_tokenizer
    specials = [t.content for t in backend.get_added_tokens_decoder().values() if t.content][:50]
    pieces = fresh_pieces(vocab)
    token = st.sampled_from(specials)
    half = token.map(lambda t: t[: max(1, len(t) // 2)])  # a token's beginning
    rest = token.map(lambda t: t[max(1, len(t) // 2) :])
    segment = st.lists(st.one_of(_text, token, half, rest), min_size=0, max_size=5).map("".join)
    pool = data.draw(st.lists(segment, min_size=1, max_size=8))
    for _ in range(3):
        segments = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=10))
        assert pieces.count_segments(segments) == pieces.full("".join(segments)), segments


@pytest.mark.parametrize("vocab", ["qwen2", "llama-bpe", "gemma-4"])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_segment_counts_resumed_from_the_previous_call_equal_whole_text_encoding(
    vocab: str, data: st.DataObject
) -> None:
    """Consecutive segment lists edited as a chat and its window are: grown at the end, dropped at the start, a
    middle segment rewritten, inserted or removed; the runs shared with the previous call are taken whole."""
    backend = hf_tokenizer(vocab).backend_tokenizer
    specials = [t.content for t in backend.get_added_tokens_decoder().values() if t.content][:50]
    pieces = fresh_pieces(vocab)
    token = st.sampled_from(specials)
    half = token.map(lambda t: t[: max(1, len(t) // 2)])
    segment = st.lists(st.one_of(_text, token, token, half), min_size=0, max_size=4).map("".join)
    segments = data.draw(st.lists(segment, min_size=1, max_size=12))
    for _ in range(6):
        assert pieces.count_segments(segments) == pieces.full("".join(segments)), segments
        edit = data.draw(st.sampled_from(["grow", "drop", "rewrite", "insert", "remove", "same"]))
        at = data.draw(st.integers(0, len(segments)))
        if edit == "grow":
            segments = segments + data.draw(st.lists(segment, min_size=1, max_size=3))
        elif edit == "drop":
            segments = segments[:1] + segments[1 + at // 2 :]
        elif edit == "rewrite" and at < len(segments):
            segments = [*segments[:at], data.draw(segment), *segments[at + 1 :]]
        elif edit == "insert":
            segments = [*segments[:at], data.draw(segment), *segments[at:]]
        elif edit == "remove" and at < len(segments):
            segments = segments[:at] + segments[at + 1 :]
    assert pieces.count_segments(segments) == pieces.full("".join(segments)), segments


def test_a_segment_list_changed_in_the_middle_looks_only_at_the_middle() -> None:
    pieces = PieceCounter(hf_tokenizer("qwen2").backend_tokenizer)
    segments = [f"<|im_start|>user\nmessage {i}<|im_end|>\n" for i in range(200)]
    pieces.count_segments(segments)
    seen: list[list[tuple[bool, str]]] = []
    count_chunks = pieces._count_chunks

    def recording(chunks: list[tuple[bool, str]]) -> list[int]:
        seen.append(chunks)
        return count_chunks(chunks)

    pieces._count_chunks = recording  # type: ignore[method-assign]
    edited = [*segments[:100], "<|im_start|>user\nrewritten<|im_end|>\n", *segments[101:]]
    assert pieces.count_segments(edited) == pieces.full("".join(edited))
    # The rewritten segment and its neighbours (a border beside a changed segment is not taken on trust).
    assert seen == [[(False, segment) for segment in edited[99:102]]]
    grown = [*edited, "<|im_start|>assistant\n"]
    assert pieces.count_segments(grown) == pieces.full("".join(grown))
    assert seen[-1] == [(False, segment) for segment in grown[-2:]]


_PRINTABLE = frozenset(chr(c) for c in range(0x21, 0x7F))
_LINE_SAFE = {"qwen2": True, "llama-bpe": True, "qwen35": True, "deepseek-v4": True, "harmony-on-qwen2": True}
_LINE_SAFE |= dict.fromkeys(("deepseek-llm", "gemma-4", "llama-spm", "phi-3"), False)
# Lines as tool results write them, and what sits at a line start or end: whitespace runs before a newline, CRLF,
# a "/" after a newline (o200k's pattern runs across that one), digits, CJK, combining marks, contractions.
_line = st.lists(
    _text
    | st.sampled_from(["  ", "\t", "\r", "/", "'s", "123456", "中文", "\u0301", "é", "}", "{", "-", " x", "\u00a0"]),
    max_size=6,
).map("".join)


@pytest.mark.parametrize("vocab", sorted(_LINE_SAFE))
@settings(max_examples=80, deadline=None)
@given(lines=st.lists(_line, min_size=1, max_size=12), size=st.integers(1, 40))
def test_a_piece_cut_at_line_starts_counts_the_same_where_the_rule_is_on(
    vocab: str, lines: list[str], size: int
) -> None:
    backend = hf_tokenizer(vocab).backend_tokenizer
    assert _line_safe(backend) is _LINE_SAFE[vocab]
    text = "\n".join(lines)
    blocks = _blocks(text, size)
    assert "".join(blocks) == text
    assert all(block.lstrip(" \t")[:1] in _PRINTABLE for block in blocks[1:])
    if _LINE_SAFE[vocab]:
        whole = len(backend.encode(text, add_special_tokens=False))
        assert sum(len(backend.encode(block, add_special_tokens=False)) for block in blocks) == whole, blocks


@pytest.mark.parametrize(
    ("vocab", "start", "end"),
    [("qwen2", "<|im_start|>", "<|im_end|>"), ("llama-bpe", "<|start_header_id|>", "<|eot_id|>")],
)
def test_a_piece_that_extends_another_reuses_its_first_blocks(vocab: str, start: str, end: str) -> None:
    # Llama 3 writes the tool schemas and the first user message as one piece: a new first message must not cost
    # the schemas again.
    pieces = PieceCounter(hf_tokenizer(vocab).backend_tokenizer)
    assert pieces.in_blocks
    # An emoji on every line, so every block is tokenized (ASCII text and the scripts the pre-token rules cover go
    # by pre-tokens, see the next tests).
    schemas = "Given the following functions:\n\n" + json.dumps(TOOLS, indent=4).replace("\n", " 📦\n") + "\n\n"
    spent = []
    for question in ("What is the weather in Paris?", "And in Rome, tomorrow?"):
        text = f"{start}user{end}{schemas}{question}{end}"
        before = pieces.encoded_chars
        assert pieces.count(text) == pieces.full(text)
        spent.append(pieces.encoded_chars - before - len(text))  # less what full() encoded
    assert spent[0] > len(schemas) > 2 * spent[1] > 0, spent  # the schemas' blocks but the last are reused


@pytest.mark.parametrize("first", ["2026-11-25T07:51:00Z WARN retry budget exhausted — shipment job", "{"])
def test_a_tool_result_counted_alone_reuses_its_blocks_in_the_prompt_but_its_last_line(first: str) -> None:
    # truncate's cap counts a result on its own; the prompt holds it between a lead-in and a closing tag.
    pieces = PieceCounter(hf_tokenizer("qwen2").backend_tokenizer)
    rows = (f'  "row {i}": {{"id": {i * 7919 % 10007}, "status": "queued — for review 📦"}},' for i in range(90))
    lines = [first, *rows]
    result = "\n".join([*lines, "}"])
    prompt = f"<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n"
    assert pieces.count(prompt) == pieces.full(prompt)
    before = pieces.encoded_chars
    assert pieces.alone_many([result]) == [pieces.full(result)]
    spent = pieces.encoded_chars - before - len(result)  # less what full() encoded
    assert 0 < spent <= len(lines[-1]) + 2, spent


_WORDS = {"qwen2": True, "llama-bpe": True, "qwen35": True, "harmony-on-qwen2": True}
_WORDS |= dict.fromkeys(("deepseek-v4", "deepseek-llm", "gemma-4", "llama-spm", "phi-3"), False)
# ASCII text, every character possible, with more of what pre-tokens are cut at: whitespace runs (also VT, FF and
# the separators Python counts as whitespace but the tokenizer does not), contractions, digit runs, punctuation.
_ascii = st.lists(
    st.characters(min_codepoint=0, max_codepoint=127)
    | st.sampled_from([" ", "  ", "\n", "\r\n", "\t", "\x0b", "\x0c", "\x1c", "'s", "'LL", "'t", "1234567", "x", "Ab"])
    | st.sampled_from(["<|im_end|>", "<|eot_id|>", "\n\n  ", " -> ", "}}\n", "'", "::"]),
    max_size=40,
).map("".join)


@pytest.mark.parametrize("vocab", sorted(_WORDS))
@settings(max_examples=150, deadline=None)
@given(text=_ascii)
def test_ascii_counted_by_pre_tokens_equals_the_tokenizer_where_the_rule_is_on(vocab: str, text: str) -> None:
    backend = hf_tokenizer(vocab).backend_tokenizer
    assert (_word_rule(backend) is not None) is _WORDS[vocab]
    pieces = verified_pieces(vocab).fork()
    assert ("words" in pieces.rules.on) is _WORDS[vocab]
    whole = len(backend.encode(text, add_special_tokens=False))
    assert pieces.count(text) == whole
    assert pieces.alone(text) == whole
    if pieces._words is not None and "<|" not in text:
        assert pieces._words.count([text], pieces._tokenizer) == [whole]


def test_a_repeated_pre_token_is_encoded_once() -> None:
    pieces = PieceCounter(hf_tokenizer("llama-bpe").backend_tokenizer)
    rows = "\n".join(f'{{"id": {i}, "status": "queued for review"}}' for i in range(200))
    assert pieces.alone(rows) == pieces.full(rows)
    spent = pieces.encoded_chars - len(rows)  # less what full() encoded
    assert 0 < spent < len(rows) / 10, spent  # the distinct pre-tokens only: 200 ids, a few words and signs
    assert pieces.alone(rows.replace("queued", "parked")) == pieces.full(rows.replace("queued", "parked"))
    assert pieces.encoded_chars - 2 * len(rows) - spent == len("parked")  # the one new pre-token


def test_padding_or_truncation_left_on_the_callers_tokenizer_changes_no_count() -> None:
    # transformers leaves a call's padding= / truncation= settings on the shared backend tokenizer.
    from transformers import AutoTokenizer

    from assets import tokenizer_dir

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir("qwen2")))
    chat = [{"role": "user", "content": "A long question about flights and fares. " * 60}]
    clean = ck.HFChatTemplateCounter(hf_tokenizer("qwen2"), chat_template=template("Qwen-Qwen2.5-7B-Instruct"))
    expected = clean.count(chat, tools=TOOLS)
    tokenizer.backend_tokenizer.enable_truncation(max_length=16)
    tokenizer.backend_tokenizer.enable_padding(length=4096)
    counter = ck.HFChatTemplateCounter(tokenizer, chat_template=template("Qwen-Qwen2.5-7B-Instruct"))
    assert counter.count(chat, tools=TOOLS) == expected
    assert counter.text_tokens("word " * 300) == clean.text_tokens("word " * 300)
    assert counter.text_tokens_many(["one two", "three " * 400]) == clean.text_tokens_many(["one two", "three " * 400])
    assert tokenizer.backend_tokenizer.truncation is not None  # the caller's settings are left as they were


def test_a_segment_that_ends_inside_a_token_is_joined_with_the_next() -> None:
    backend = hf_tokenizer("qwen2").backend_tokenizer
    pieces = PieceCounter(backend)
    segments = ["hello <|im_", "<|im_start|>x", "<|im_end|>\n", "<|im_start|>y"]
    assert pieces.count_segments(segments) == pieces.full("".join(segments))
    # "<|im_" + "end|>" is one added token across the border: counted whole, not as two segments.
    segments = ["a<|im_", "end|>b"]
    assert pieces.count_segments(segments) == pieces.full("".join(segments)) == pieces.full("a<|im_end|>b")


def test_a_repeated_prompt_resumes_near_its_end() -> None:
    counter = ck.HFChatTemplateCounter(hf_tokenizer("qwen2"), chat_template=template("Qwen-Qwen2.5-7B-Instruct"))
    messages = _long_conversation(30)
    text = counter.render(messages)
    counter.count_text(text)
    pieces = counter._pieces
    assert pieces is not None
    assert pieces._segments is not None
    start, _, _ = pieces._segments.resume_point(text + "more", pieces._last, pieces._bounds, pieces._totals)
    assert start > len(text) - 100


_BOUND_COUNTERS: dict[str, ck.HFChatTemplateCounter] = {}


@pytest.mark.parametrize(("vocab", "rule"), [("qwen2", "ascii"), ("llama-bpe", "any"), ("phi-3", None)])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=80) | _text)
def test_the_byte_bound_never_undercounts(vocab: str, rule: str | None, text: str) -> None:
    # Byte-level BPE: at most one token per UTF-8 byte (NFC may lengthen non-ASCII text, so Qwen's bound covers
    # ASCII only); SentencePiece models get no bound.
    if vocab not in _BOUND_COUNTERS:
        _BOUND_COUNTERS[vocab] = ck.HFChatTemplateCounter(
            hf_tokenizer(vocab), chat_template=template("Qwen-Qwen2.5-7B-Instruct")
        )
    counter = _BOUND_COUNTERS[vocab]
    assert counter._pieces is not None
    bound_rule = counter._pieces._bound
    assert (bound_rule.kind if bound_rule is not None else None) == rule
    bound = counter.text_tokens_bound(text)
    if bound is not None:
        assert counter.text_tokens(text) <= bound
    assert (bound is None) == (rule is None or (rule == "ascii" and not text.isascii()))


def test_a_fork_shares_the_piece_cache_but_not_the_resume_state() -> None:
    tokenizer = hf_tokenizer("qwen2")
    counter = ck.HFChatTemplateCounter(tokenizer, chat_template=template("Qwen-Qwen2.5-7B-Instruct"))
    side = counter.fork()
    chat = [{"role": "user", "content": "A long question about flights " * 40}]
    side.count(chat, tools=TOOLS)
    before = counter.encoded_chars
    assert counter.count(chat, tools=TOOLS) == fresh_count("Qwen-Qwen2.5-7B-Instruct", "qwen2", chat, TOOLS)
    assert counter.encoded_chars - before < 100  # the side counter's pieces were not tokenized again
    grown = [*chat, {"role": "assistant", "content": "Sure."}, {"role": "user", "content": "And trains?"}]
    assert side.count(grown) == fresh_count("Qwen-Qwen2.5-7B-Instruct", "qwen2", grown, None)
    assert counter.count(grown, tools=TOOLS) == fresh_count("Qwen-Qwen2.5-7B-Instruct", "qwen2", grown, TOOLS)


@pytest.mark.parametrize(("name", "vocab"), [("Qwen-Qwen3-0.6B", "qwen2"), ("openai-gpt-oss-120b", "harmony-on-qwen2")])
def test_a_prompt_counted_again_is_rendered_again_only_when_something_changed(
    name: str, vocab: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fit counts its final prompt, then reads that prompt's text for its prefix report: the second read takes
    the counter's last render. Anything else (other messages, tools or flag; a template that writes the date,
    once its second has passed) renders, and every count equals the template applied whole."""
    counter = ck.HFChatTemplateCounter(hf_tokenizer(vocab), chat_template=template(name))
    renders: list[int] = []
    own = counter._server_segments
    monkeypatch.setattr(counter, "_server_segments", lambda *a: renders.append(1) or own(*a))
    clock = [1_000_000.0]
    monkeypatch.setattr("contextkeeper.tokens.hf.time.time", lambda: clock[0])
    messages = _long_conversation(8)
    expected = fresh_count(name, vocab, messages, TOOLS)
    assert counter.count(messages, tools=TOOLS) == expected
    assert counter.count(list(messages), tools=TOOLS) == expected
    assert len(renders) == 1  # the same dicts are the same validated messages: nothing to render
    assert counter.count(messages, tools=None) == fresh_count(name, vocab, messages, None)
    assert counter.count(messages, tools=TOOLS) == expected
    assert len(renders) == 3
    edited = [*messages[:-1], {"role": "user", "content": "Summarise, in one line."}]
    assert counter.count(edited, tools=TOOLS) == fresh_count(name, vocab, edited, TOOLS)
    assert len(renders) == 4
    closed = counter.count(edited, tools=TOOLS, add_generation_prompt=False)
    assert len(renders) == 5
    assert closed < counter.count(edited, tools=TOOLS)
    clock[0] += 1  # a template that writes the date renders anew in the next second; others need not
    assert counter.count(edited, tools=TOOLS) == fresh_count(name, vocab, edited, TOOLS)
    assert len(renders) == (7 if counter.renders_date else 6)
