"""ContextKeeper.fit: reserve-then-budget, the strategies in a pipeline, and the invariants of every fit."""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import contextkeeper as ck
from assets import template, tokenizer_dir
from conftest import hf_tokenizer
from contextkeeper.keeper import ContextKeeper, RequestTooLarge
from contextkeeper.strategies import Foresight, Pipeline, build_strategy
from contextkeeper.strategies.policy import Policy, PolicyStep
from contextkeeper.strategies.sliding_window import SlidingWindow
from conversations import TOOLS
from strategy_state import QWEN, agent_chat, check_invariants, keeper, plain_chat


def test_a_conversation_that_fits_comes_back_unchanged() -> None:
    k = keeper(32768)
    messages = agent_chat(3)
    original = copy.deepcopy(messages)
    fit = k.fit(messages, tools=TOOLS, max_tokens=1024)
    assert fit.messages == messages
    assert messages == original
    assert fit.report.tokens_before == fit.tokens
    assert fit.report.actions == ()
    assert sum(v for s, v in fit.report.slots.items() if s != "answer") == fit.tokens
    check_invariants(k, messages, fit, TOOLS, 1024)


@pytest.mark.parametrize(("name", "vocab"), [(QWEN, "qwen2"), ("meta-llama-Llama-3.3-70B-Instruct", "llama-bpe")])
def test_report_slots_sum_to_the_prompt(name: str, vocab: str) -> None:
    k = keeper(4096, PolicyStep(strategy="prune_tool_results", keep_last=2, clear_at_least=100), name=name, vocab=vocab)
    fit = k.fit(agent_chat(30), tools=TOOLS, max_tokens=512)
    slots = fit.report.slots
    assert sum(v for s, v in slots.items() if s != "answer") == fit.tokens
    assert all(v >= 0 for v in slots.values())
    assert slots["answer"] == 512
    assert slots["tools"] > 100
    assert fit.report.actions[0].strategy == "prune_tool_results"
    assert all(a.saved > 0 for a in fit.report.actions)


def test_request_too_large_says_by_how_much_and_what_to_do() -> None:
    k = keeper(600)
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "word " * 400}]
    with pytest.raises(RequestTooLarge) as error:
        k.fit(messages, tools=TOOLS, max_tokens=256)
    assert error.value.needed > error.value.limit == 600
    text = str(error.value)
    assert "over the limit of 600" in text
    assert "lower max_tokens" in text
    assert "tools" in text


def test_limit_from_model_and_gpu() -> None:
    k = ContextKeeper(
        str(tokenizer_dir("qwen2")),
        chat_template=template(QWEN),
        context_window=1_000_000,
        model="qwen2.5-7b",
        gpu="RTX 4090",
        concurrency=8,
        policy=Policy(name="p"),
    )
    plan = ck.plan("qwen2.5-7b", "RTX 4090", context=32768, concurrency=8)
    assert k.limit == min(plan.max_context, 32768)
    assert "GPU" in k.limit_source or "maximum context" in k.limit_source
    with pytest.raises(ck.ConfigurationError, match="needs model"):
        ContextKeeper(str(tokenizer_dir("qwen2")), chat_template=template(QWEN), context_window=10, gpu="H100")


# --------------------------------------------------------------------------------------------- properties

_words = st.text(alphabet=st.sampled_from(list("abcdefgh ijklmnop éü中文 🙂 {}[]\n")), min_size=0, max_size=60)


@st.composite
def conversations(draw: st.DrawFn) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": "sys " + draw(_words)})
    for turn in range(draw(st.integers(1, 8))):
        messages.append({"role": "user", "content": f"u{turn} " + draw(_words) * draw(st.integers(1, 6))})
        if draw(st.booleans()):
            calls = []
            for c in range(draw(st.integers(1, 3))):  # parallel calls
                args = json.dumps({"q": draw(_words)})
                calls.append(
                    {"id": f"c{turn}_{c}", "type": "function", "function": {"name": "search", "arguments": args}}
                )
            messages.append({"role": "assistant", "content": None, "tool_calls": calls})
            for c in calls:
                messages.append(
                    {"role": "tool", "tool_call_id": c["id"], "content": draw(_words) * draw(st.integers(1, 20))}
                )
        answer: dict[str, Any] = {"role": "assistant", "content": f"a{turn} " + draw(_words)}
        if draw(st.booleans()):
            answer["reasoning_content"] = draw(_words)
        messages.append(answer)
    messages.append({"role": "user", "content": "final " + draw(_words)})
    return messages


PROPERTY_EXAMPLES = int(os.environ.get("CONTEXTKEEPER_PROPERTY_EXAMPLES", "2000"))
_PROPERTY_KEEPERS: dict[int, ContextKeeper] = {}


def _property_keeper(context: int) -> ContextKeeper:
    if context not in _PROPERTY_KEEPERS:
        _PROPERTY_KEEPERS[context] = keeper(
            context,
            PolicyStep(strategy="dedupe"),
            PolicyStep(strategy="prune_tool_results", keep_last=1, clear_at_least=50),
            PolicyStep(strategy="truncate", max_tokens=60),
        )
    return _PROPERTY_KEEPERS[context]


@settings(max_examples=PROPERTY_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages=conversations(), context=st.sampled_from([700, 1200, 4096]), with_tools=st.booleans())
def test_every_fit_keeps_its_invariants(messages: list[dict[str, Any]], context: int, with_tools: bool) -> None:
    k = _property_keeper(context)
    tools = TOOLS if with_tools else None
    original = copy.deepcopy(messages)
    try:
        fit = k.fit(messages, tools=tools, max_tokens=128)
    except RequestTooLarge as error:
        refused: RequestTooLarge | None = error
    else:
        refused = None
    if refused is not None:  # only when system + tools + request + answer cannot fit: then by a real margin
        assert refused.needed > refused.limit
        return
    assert messages == original
    check_invariants(k, messages, fit, tools, 128)


@settings(max_examples=max(50, PROPERTY_EXAMPLES // 10), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages=conversations(), context=st.sampled_from([900, 1500]))
def test_a_growing_chat_fitted_turn_by_turn_keeps_every_invariant(messages: list[dict[str, Any]], context: int) -> None:
    """The same keeper over a chat that grows: each fit re-applies the previous window start and rewrites first
    (the sticky fast path), and must still be exact and complete."""
    k = keeper(
        context,
        PolicyStep(strategy="prune_tool_results", keep_last=1, clear_at_least=30),
        PolicyStep(strategy="truncate", max_tokens=80),
    )
    stops = [i + 1 for i, m in enumerate(messages) if m["role"] == "user"]
    for stop in stops:
        prefix = messages[:stop]
        try:
            fit = k.fit(prefix, tools=TOOLS, max_tokens=128)
        except RequestTooLarge:
            continue
        check_invariants(k, prefix, fit, TOOLS, 128)


@pytest.mark.slow
@settings(max_examples=10_000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages=conversations(), context=st.sampled_from([700, 1200, 4096]), with_tools=st.booleans())
def test_every_fit_keeps_its_invariants_10k(messages: list[dict[str, Any]], context: int, with_tools: bool) -> None:
    """The same property over 10,000 examples: ``pytest -m slow``."""
    test_every_fit_keeps_its_invariants.hypothesis.inner_test(messages, context, with_tools)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("name", "vocab"),
    [(QWEN, "qwen2"), ("Qwen-Qwen3-0.6B", "qwen2"), ("meta-llama-Llama-3.3-70B-Instruct", "llama-bpe")],
)
def test_a_turn_built_from_the_previous_fit_equals_one_built_from_scratch(name: str, vocab: str) -> None:
    """Per turn, the keeper extends the previous fit's history with what arrived instead of rebuilding it; the
    fits must be the very ones a rebuild gives (same messages, tokens and report), turn after turn."""
    steps = (
        PolicyStep(strategy="prune_tool_results", keep_last=2, clear_at_least=100),
        PolicyStep(strategy="truncate", max_tokens=200),
    )
    messages = agent_chat(40)
    stops = [i + 1 for i, m in enumerate(messages) if m["role"] in ("user", "tool")]
    fast, slow = keeper(3000, *steps, name=name, vocab=vocab), keeper(3000, *steps, name=name, vocab=vocab)
    slow._grown = lambda *args: None  # type: ignore[method-assign]  # always rebuilt from scratch
    grown = 0
    for stop in stops[5:]:
        sticky = fast._sessions.get("default").sticky
        fit = fast.fit(messages[:stop], tools=TOOLS, max_tokens=256)
        grown += sticky is not None and sticky.horizon == sticky.start
        reference = slow.fit(messages[:stop], tools=TOOLS, max_tokens=256)
        assert fit.messages == reference.messages
        assert fit.tokens == reference.tokens
        assert fit.report.slots == reference.report.slots
        assert [a.strategy for a in fit.report.actions] == [a.strategy for a in reference.report.actions]
    check_invariants(fast, messages[: stops[-1]], fit, TOOLS, 256)
    assert grown > 0


def test_an_earlier_message_edited_in_place_is_counted_as_it_is_now() -> None:
    k = keeper(3000, PolicyStep(strategy="prune_tool_results", keep_last=2, clear_at_least=100))
    messages = agent_chat(12)
    k.fit(messages, tools=TOOLS, max_tokens=256)
    target = next(i for i in range(len(messages) - 8, len(messages)) if messages[i]["role"] == "user")
    messages[target]["content"] += " and also a much longer note " * 20  # the same dict, changed in place
    messages.append({"role": "assistant", "content": "Done."})
    messages.append({"role": "user", "content": "Thanks."})
    fit = k.fit(messages, tools=TOOLS, max_tokens=256)
    check_invariants(k, messages, fit, TOOLS, 256)
    assert messages[target] in fit.messages


def test_the_report_counts_its_slots_when_read_and_survives_pickling() -> None:
    import pickle

    k = keeper(4096)
    messages = agent_chat(30)
    fit = k.fit(messages, tools=TOOLS, max_tokens=512)
    report = fit.report
    assert report._breakdown._value is None  # nothing counted the slots yet: no fit decision needs them
    slots = report.slots
    assert sum(v for s, v in slots.items() if s != "answer") == fit.tokens
    assert (
        report.history_after
        == slots["history"]
        == fit.tokens - slots["system"] - slots["tools"] - (slots["request"] + slots["template_overhead"])
    )
    data = report.to_dict()
    assert list(data)[:8] == [
        "limit", "limit_source", "max_tokens", "tokens", "tokens_before", "slots", "history_before", "history_after"
    ]  # fmt: skip
    assert data["slots"] == slots
    copied = pickle.loads(pickle.dumps(report))
    assert copied.slots == slots
    assert copied.history_after == report.history_after
    changed = report.with_slots(lambda s: {**s, "withheld": 7}, max_tokens=100)
    assert changed.slots == {**slots, "withheld": 7}
    assert changed.max_tokens == 100
    assert report.slots == slots  # the original is unchanged


@pytest.mark.parametrize(("name", "vocab"), [(QWEN, "qwen2"), ("meta-llama-Llama-3.3-70B-Instruct", "llama-bpe")])
def test_the_render_bound_is_never_below_the_count(name: str, vocab: str) -> None:
    counter = ck.HFChatTemplateCounter(hf_tokenizer(vocab), chat_template=template(name), name=name)
    for messages in (agent_chat(3), agent_chat(12, result_words=400), plain_chat(5)):
        for tools in (None, TOOLS):
            bound = counter.bound(messages, tools=tools)
            assert bound is not None
            assert counter.count(messages, tools=tools) <= bound


def test_state_chars_follow_a_history_that_shares_its_first_units() -> None:
    from contextkeeper.messages import Message
    from contextkeeper.strategies.base import FitState, Item, Memory

    def unit(text: str) -> tuple[Item, ...]:
        return (Item(Message.from_dict({"role": "user", "content": text})),)

    units = [unit("x" * (i * 7 % 13 + 1)) for i in range(40)]
    memory = Memory()
    system, request = unit("sys"), unit("req")
    histories = [units[:10], units[:25], units[3:25], units[3:40], units[:5] + units[30:], units[:40]]
    for history in histories:
        state = FitState(system=system, history=tuple(history), request=request, limit=1, count=len, memory=memory)
        expected = 3 + 3 + sum(len(u[0].message.content) for u in history)
        assert state.chars() == expected


_TEXT = st.text(st.characters(codec="utf-8"), max_size=30)
_ARGUMENTS = st.one_of(_TEXT.map(json.dumps), st.dictionaries(st.sampled_from("abc"), st.integers(), max_size=3))
_MESSAGE = st.one_of(
    st.builds(lambda role, text: {"role": role, "content": text}, st.sampled_from(["user", "system", "tool"]), _TEXT),
    st.lists(_TEXT, min_size=1, max_size=3).map(
        lambda parts: {"role": "user", "content": [{"type": "text", "text": part} for part in parts]}
    ),
    st.builds(
        lambda text, arguments: {
            "role": "assistant",
            "content": text or None,
            "tool_calls": [
                {"id": f"call{i}", "type": "function", "function": {"name": "f", "arguments": a}}
                for i, a in enumerate(arguments)
            ],
        },
        _TEXT,
        st.lists(_ARGUMENTS, min_size=1, max_size=3),
    ),
)


@settings(max_examples=60, deadline=None)
@given(units=st.lists(st.lists(_MESSAGE, min_size=1, max_size=4), min_size=1, max_size=6))
def test_unit_chars_read_from_the_items_equal_counting_the_units(units: list[list[dict[str, Any]]]) -> None:
    from contextkeeper.messages import Message
    from contextkeeper.strategies.base import FitState, Item, _unit_chars

    history = tuple(tuple(Item(Message.from_dict(m)) for m in unit) for unit in units)
    state = FitState(system=(), history=history, request=(), limit=1, count=len)
    reference = [_unit_chars(unit) for unit in history]
    assert state.unit_chars(history) == reference  # counted by the items
    assert state.unit_chars(history) == reference  # read back from them
    assert state.unit_chars(history[::-1]) == reference[::-1]


@dataclass(frozen=True)
class _Apply:
    """A strategy reduced to its ``apply``."""

    strategy: Any

    def apply(self, state: Any) -> Any:
        return self.strategy.apply(state)


def test_the_horizon_reads_old_tool_results_at_their_cleared_size(monkeypatch: pytest.MonkeyPatch) -> None:
    # A long agent chat whose old tool results the default pipeline clears: the keeper reads back as far as the
    # cleared history fills the budget (one read), not as far as the raw text would.
    messages = agent_chat(120, result_words=400)
    context, answer = 6000, 500
    counter = keeper(context).counter
    aware = ContextKeeper(counter, context_window=context, policy="default")
    blind = aware.fresh()
    # The same pipeline, asked nothing about what it will leave: those that could tell behind a plain ``apply``.
    blind.pipeline = Pipeline(
        tuple((_Apply(s) if isinstance(s, Foresight) else s, trigger) for s, trigger in aware.pipeline)
    )
    from contextkeeper.fit import engine

    reads: list[int] = []
    original = engine.read
    for k in (aware, blind):
        passes = 0

        def counting(*args: Any, **kwargs: Any) -> Any:
            nonlocal passes
            passes += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(engine, "read", counting)  # every read of history a fit makes
        fit = k.fit(messages, tools=TOOLS, max_tokens=answer)
        check_invariants(k, messages, fit, TOOLS, answer)
        reads.append(passes)
        if k is aware:
            aware_fit = fit
    assert reads[0] == 1
    # Blind, the read stops short (the raw results fill the budget sooner): a second read, or a fuller fit missed.
    assert reads[1] > 1 or (fit.report.unread > aware_fit.report.unread and fit.tokens < aware_fit.tokens)
    # Older history went unread, so the slack is left free as when the window drops units.
    assert aware_fit.report.unread > 0
    assert 0.9 * (context - answer) <= aware_fit.tokens <= (1 - SlidingWindow().slack) * (context - answer)


def test_strategies_say_what_they_leave_of_a_message() -> None:
    prune = build_strategy("prune_tool_results", {"keep_last": 2})
    truncate = build_strategy("truncate", {"max_tokens": 100})
    assert isinstance(prune, Foresight)
    assert isinstance(truncate, Foresight)
    assert prune.kept_chars("tool", 5000, newer_results=2) < 100  # cleared: its placeholder
    assert prune.kept_chars("tool", 5000, newer_results=1) == 5000  # among the newest two
    assert prune.kept_chars("assistant", 5000, newer_results=9) == 5000
    excluding = build_strategy("prune_tool_results", {"exclude_tools": ["memory"]})
    assert excluding.kept_chars("tool", 5000, newer_results=9) == 5000  # it cannot tell which tool it was
    assert truncate.kept_chars("tool", 5000, newer_results=0) == 400
    assert truncate.kept_chars("assistant", 5000, newer_results=0) == 5000
    assert not isinstance(build_strategy("dedupe"), Foresight)
