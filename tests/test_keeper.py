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
from contextkeeper.policy import Policy, PolicyStep
from contextkeeper.strategies import Foresight, Pipeline, build_strategy
from conversations import TOOLS

QWEN = "Qwen-Qwen2.5-7B-Instruct"


_COUNTERS: dict[tuple[str, str], Any] = {}


def keeper(context: int, *steps: PolicyStep, name: str = QWEN, vocab: str = "qwen2", **kwargs: Any) -> ContextKeeper:
    """A fresh keeper (its own session) on a shared counter (loading a tokenizer takes a second or two)."""
    if (name, vocab) not in _COUNTERS:
        _COUNTERS[name, vocab] = ck.HFChatTemplateCounter(hf_tokenizer(vocab), chat_template=template(name), name=name)
    policy = Policy(name="test", steps=steps, horizon=0)
    return ContextKeeper(_COUNTERS[name, vocab], context_window=context, policy=policy, **kwargs)


def agent_chat(turns: int, result_words: int = 120) -> list[dict[str, Any]]:
    """A system prompt, then turns of user -> assistant tool call -> tool result -> assistant answer."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a travel agent. Never book without consent."}
    ]
    for t in range(turns):
        messages.append({"role": "user", "content": f"Turn {t}: find flights to city {t} under {100 + t} EUR."})
        call_id = f"call{t:05d}"  # 9 letters or digits: valid for Mistral too
        args = json.dumps({"city": f"city {t}", "max_price": 100 + t})
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": call_id, "type": "function", "function": {"name": "search_flights", "arguments": args}}
                ],
            }
        )
        rows = " ".join(f"flight F{t}{i} departs {i:02d}:15 costs {90 + i} EUR;" for i in range(result_words // 8))
        messages.append({"role": "tool", "tool_call_id": call_id, "content": rows})
        messages.append({"role": "assistant", "content": f"I found {result_words // 8} flights to city {t}."})
    messages.append({"role": "user", "content": "Book the cheapest one to the last city, please."})
    return messages


def plain_chat(turns: int) -> list[dict[str, Any]]:
    """Alternating user / assistant turns without tools (for templates that accept nothing else)."""
    messages: list[dict[str, Any]] = []
    for t in range(turns):
        messages.append({"role": "user", "content": f"Question {t}: what is {t} squared, and why? " * 8})
        messages.append({"role": "assistant", "content": f"{t} squared is {t * t}, because {t} times {t}. " * 8})
    messages.append({"role": "user", "content": "Summarise what we did."})
    return messages


def check_invariants(k: ContextKeeper, messages: list[Any], fit: ck.keeper.Fit, tools: Any, max_tokens: int) -> None:
    counter = k.counter
    assert fit.tokens == counter.reference_count(fit.messages, tools=tools)  # exact through apply_chat_template
    assert fit.tokens + max_tokens <= k.limit
    system = [m for m in messages if m.get("role") == "system"][:1]
    assert fit.messages[: len(system)] == system
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    request = messages[last_user:]
    assert fit.messages[-len(request) :] == request
    ck.Conversation.from_messages(fit.messages)  # no orphaned call or result
    # Order kept, untouched messages equal their input: each output message is an input message (in order) or
    # a strategy's rewrite of one.
    position = 0
    for message in fit.messages:
        if message in messages[position:]:
            position = messages.index(message, position) + 1


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


def test_sliding_window_keeps_the_longest_suffix_of_whole_turns() -> None:
    k = keeper(4096)
    messages = agent_chat(30)
    original = copy.deepcopy(messages)
    fit = k.fit(messages, tools=TOOLS, max_tokens=512)
    assert messages == original  # the caller's list is never mutated
    check_invariants(k, messages, fit, TOOLS, 512)
    assert fit.messages[1]["role"] == "user"  # history starts on a user turn
    assert [a.strategy for a in fit.report.actions] == ["sliding_window"]
    # The best whole-turn suffix: one more turn would not fit.
    dropped = messages.index(fit.messages[1])
    previous_user = max(i for i in range(1, dropped) if messages[i]["role"] == "user")
    longer = [messages[0], *messages[previous_user:]]
    assert k.count(longer, tools=TOOLS) + 512 > k.limit


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


def test_prune_clears_old_results_in_batches_and_keeps_pairs() -> None:
    k = keeper(6000, PolicyStep(strategy="prune_tool_results", keep_last=2, clear_at_least=500))
    messages = agent_chat(25)
    fit = k.fit(messages, tools=TOOLS, max_tokens=512)
    check_invariants(k, messages, fit, TOOLS, 512)
    cleared = [m for m in fit.messages if m["role"] == "tool" and str(m["content"]).startswith("[tool result cleared")]
    kept = [m for m in fit.messages if m["role"] == "tool" and not str(m["content"]).startswith("[tool result")]
    assert cleared
    assert len(kept) >= 2
    prune = next(a for a in fit.report.actions if a.strategy == "prune_tool_results")
    assert prune.saved > 0
    # Cleared results stay cleared next turn (stable prefix), even though the new turn alone is below the batch.
    messages2 = [*messages, {"role": "assistant", "content": "Booked."}, {"role": "user", "content": "Thanks!"}]
    fit2 = k.fit(messages2, tools=TOOLS, max_tokens=512)
    cleared2 = [
        m for m in fit2.messages if m["role"] == "tool" and str(m["content"]).startswith("[tool result cleared")
    ]
    assert {m["tool_call_id"] for m in cleared} <= {m["tool_call_id"] for m in cleared2} | {
        m["tool_call_id"] for m in messages if m not in fit2.messages and m["role"] == "tool"
    }


def test_prune_excluded_tools_are_never_cleared() -> None:
    k = keeper(
        6000,
        PolicyStep(strategy="prune_tool_results", keep_last=0, clear_at_least=0, exclude_tools=("search_flights",)),
    )
    fit = k.fit(agent_chat(25), tools=TOOLS, max_tokens=512)
    assert not any(str(m.get("content")).startswith("[tool result cleared") for m in fit.messages)


def test_truncate_cuts_to_an_exact_cap() -> None:
    k = keeper(32768, PolicyStep(strategy="truncate", max_tokens=200, when="always"))
    messages = agent_chat(2, result_words=2000)
    fit = k.fit(messages, tools=TOOLS, max_tokens=512)
    check_invariants(k, messages, fit, TOOLS, 512)
    tool_texts = [m["content"] for m in fit.messages if m["role"] == "tool"]
    counter = k.counter
    assert all(counter.text_tokens(t) <= 200 for t in tool_texts)  # type: ignore[attr-defined]
    assert all("characters cut" in t for t in tool_texts)
    assert max(counter.text_tokens(t) for t in tool_texts) >= 190  # type: ignore[attr-defined]  # as long as the cap allows


def test_dedupe_marks_earlier_copies() -> None:
    k = keeper(32768, PolicyStep(strategy="dedupe", when="always", min_chars=10))
    messages = agent_chat(3)
    repeated = "Please remember: my passport number is X1234567 and I prefer aisle seats."
    messages.insert(1, {"role": "user", "content": repeated})
    messages.insert(2, {"role": "assistant", "content": "Noted."})
    messages.insert(-1, {"role": "user", "content": repeated})
    messages.insert(-1, {"role": "assistant", "content": "Noted again."})
    fit = k.fit(messages, tools=TOOLS, max_tokens=512)
    check_invariants(k, messages, fit, TOOLS, 512)
    texts = [m.get("content") for m in fit.messages]
    assert texts.count(repeated) == 1
    assert texts.index(repeated) > texts.index("[repeated later in the conversation]")


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


def test_the_window_leaves_the_slack_free_and_stops_within_the_tolerance() -> None:
    # When units must go the kept prompt ends at most at limit * (1 - slack), and either within ``tolerance`` of
    # that mark or as the longest suffix under it (one more user turn would cross the mark).
    from contextkeeper.strategies.sliding_window import SlidingWindow

    window = SlidingWindow()
    for turns, context in ((30, 4096), (60, 6000), (90, 3000)):
        k = keeper(context)
        messages = agent_chat(turns)
        fit = k.fit(messages, tools=TOOLS, max_tokens=512)
        check_invariants(k, messages, fit, TOOLS, 512)
        assert [a.strategy for a in fit.report.actions] == ["sliding_window"]
        budget = k.limit - 512
        mark = int(budget * (1 - window.slack))
        assert fit.tokens <= mark
        if fit.tokens < mark - int(budget * window.tolerance):
            dropped = messages.index(fit.messages[1])
            previous_user = max(i for i in range(1, dropped) if messages[i]["role"] == "user")
            assert k.count([messages[0], *messages[previous_user:]], tools=TOOLS) > mark


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
    from contextkeeper.strategies.base import FitState, Item

    def unit(text: str) -> tuple[Item, ...]:
        return (Item(Message.from_dict({"role": "user", "content": text})),)

    units = [unit("x" * (i * 7 % 13 + 1)) for i in range(40)]
    memory: dict[str, Any] = {}
    system, request = unit("sys"), unit("req")
    histories = [units[:10], units[:25], units[3:25], units[3:40], units[:5] + units[30:], units[:40]]
    for history in histories:
        state = FitState(system=system, history=tuple(history), request=request, limit=1, count=len, memory=memory)
        expected = 3 + 3 + sum(len(u[0].message.content) for u in history)
        assert state.chars() == expected


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
    from contextkeeper import engine

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
    assert reads[0] == 1 < reads[1]  # blind: a short first read, then a second one
    # Older history went unread, so the slack is left free as when the window drops units.
    assert aware_fit.report.unread > 0
    assert 0.9 * (context - answer) <= aware_fit.tokens <= 0.95 * (context - answer)


def test_after_a_cut_the_window_leaves_the_slack_free_even_when_the_history_fits() -> None:
    from contextkeeper.keeper import _assemble
    from contextkeeper.strategies import FitState, Item
    from contextkeeper.strategies.sliding_window import SlidingWindow

    counter = keeper(4096).counter
    conversation = ck.Conversation.from_messages(agent_chat(12))
    units = [tuple(Item(m, i) for i, m in zip(u.indices, u.messages, strict=True)) for u in conversation.units()]
    system, *history, request = units

    def count(kept: Any) -> int:
        return counter.count(_assemble((system, *kept, request)), tools=TOOLS)

    limit = int(count(history) / 0.97)  # the history fits, above the 95% mark
    state = FitState(system=system, history=tuple(history), request=request, limit=limit, count=count)
    assert SlidingWindow().apply(state) is state
    cut = SlidingWindow(after_cut=True).apply(state)
    assert [a.strategy for a in cut.actions] == ["sliding_window"]
    assert cut.tokens() <= 0.95 * limit
    assert cut.history == state.history[len(state.history) - len(cut.history) :]


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
