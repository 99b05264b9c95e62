"""engine.py on its own: a read's count memo, when to read further, and the prepared request."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

import contextkeeper as ck
from assets import template
from conftest import hf_tokenizer
from contextkeeper.fit import engine
from contextkeeper.fit.budget import Budget
from contextkeeper.fit.session import Session
from contextkeeper.strategies import Item, base
from contextkeeper.strategies.base import Action
from conversations import call

QWEN = "Qwen-Qwen2.5-7B-Instruct"


class Counting:
    """A real counter that also says how often it was asked."""

    def __init__(self) -> None:
        self.inner = ck.HFChatTemplateCounter(hf_tokenizer("qwen2"), chat_template=template(QWEN), name=QWEN)
        self.calls = 0

    def count(self, messages: Any, *, tools: Any = None, add_generation_prompt: bool = True) -> int:
        self.calls += 1
        return self.inner.count(messages, tools=tools, add_generation_prompt=add_generation_prompt)


def chat(turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
    for t in range(turns):
        messages += [{"role": "user", "content": f"question {t} " * 20}, {"role": "assistant", "content": f"a{t}"}]
    return [*messages, {"role": "user", "content": "and now?"}]


def budget(limit: int = 4096, answer: int = 100) -> Budget:
    return Budget.of(
        limit, "context_window", max_tokens=answer, policy="p", policy_answer=answer, reserve=ck.fit.Reserve()
    )


def parts(counter: Any, messages: list[dict[str, Any]]) -> tuple[Session, engine.Ask, tuple[Any, ...], list[Any]]:
    session = Session.of("x", counter, fork=False)
    ask = engine.Ask.of(session, messages, None, budget(), 0.0)
    conversation = ck.Conversation.from_messages(messages)
    units = [tuple(Item(m, i) for i, m in zip(u.indices, u.messages, strict=True)) for u in conversation.units()]
    return session, ask, units[0], units[1:]


def test_each_distinct_history_is_counted_once_and_exactly() -> None:
    counter = Counting()
    messages = chat(6)
    session, ask, system, (*history, request) = parts(counter, messages)
    counts = engine.Counts(session, ask, system, request)
    assert counts.peek(history) is None  # nothing counted yet
    whole = counts.count(history)
    assert whole == counter.inner.count(messages)
    asked = counter.calls
    assert counts.count(list(history)) == whole  # an equal list of the same units: no new count
    assert counts.count(tuple(history)) == whole
    assert counter.calls == asked
    assert counts.peek(history) == whole
    assert counts.count(history[2:]) == counter.inner.count([messages[0], *messages[3:]])
    assert counts.base() == counter.inner.count([messages[0], messages[-1]])


def test_counts_made_before_the_request_was_compacted_are_not_reused() -> None:
    counter = Counting()
    messages = chat(4)
    session, ask, system, (*history, request) = parts(counter, messages)
    counts = engine.Counts(session, ask, system, request)
    before = counts.count(history)
    shorter = (Item(ck.Message(role="user", content="and?"), None, request[0].message),)
    counts.compacted(shorter)
    after = counts.count(history)
    assert after == counter.inner.count([*messages[:-1], {"role": "user", "content": "and?"}])
    assert after < before
    assert counts.fixed is None


@pytest.mark.parametrize(
    ("tokens", "unread", "wider"),
    [
        (3996, 40, None),  # the read already fills 90% of the budget
        (1000, 0, None),  # nothing was left unread
        (2000, 40, 4.75 * max(1.25, 1.1 * 3996 / 2000)),  # in proportion to what the read yielded
        (100, 40, 4.75 * 4.0),  # at most four times as far
        (3550, 40, 4.75 * 1.25),  # at least a quarter further
        (2000, -40, None),  # the window dropped units of this read: older ones cannot be kept either
    ],
)
def test_how_far_the_next_read_goes(tokens: int, unread: int, wider: float | None) -> None:
    messages = chat(3)
    ask = engine.Ask.of(Session.of("x", Counting(), fork=False), messages, None, budget(), 0.0)
    dropped = unread < 0
    actions = (Action(strategy="sliding_window", detail="dropped", units=3),) if dropped else ()

    class State:
        pass

    class Draft:
        horizon = ask.sys_end + abs(unread)
        state = State()

    Draft.state.actions = actions  # type: ignore[attr-defined]
    Draft.tokens = tokens  # type: ignore[attr-defined]
    got = engine.further(ask, 4.75, Draft())  # type: ignore[arg-type]
    assert got == pytest.approx(wider) if wider is not None else got is None


def test_the_request_is_prepared_once() -> None:
    messages = [{"role": "system", "content": "s"}, {"role": "developer", "content": "d"}, *chat(2)[1:]]
    ask = engine.Ask.of(Session.of("x", Counting(), fork=False), messages, None, budget(), 0.0)
    assert (ask.sys_end, ask.last_user, ask.sticky) == (2, len(messages) - 1, None)
    with pytest.raises(ck.MessageError, match="expected a list of messages, got dict"):
        engine.Ask.of(Session.of("x", Counting(), fork=False), {"role": "user"}, None, budget(), 0.0)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ the first read of a chat
def _long_chat(words: list[str], turns: int = 160) -> list[dict[str, Any]]:
    """A deterministic chat whose text is drawn from ``words`` (joined without spaces for CJK)."""
    joiner = "" if all(len(w) <= 3 and not w.isascii() for w in words) else " "
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
    for t in range(turns):
        text = joiner.join(words[(t * 7 + i * 3) % len(words)] for i in range(40 + t % 30))
        messages += [{"role": "user", "content": f"{t}. {text}"}, {"role": "assistant", "content": text[::-1]}]
    return [*messages, {"role": "user", "content": words[0]}]


def _words(text: str) -> list[str]:
    return text.split()


_SCRIPTS = {
    "english": _words("the request failed because upstream service returned an error after timeout"),
    "chinese": _words("请求 失败 因为 上游 服务 返回 错误 超时 之后 我们 回滚 部署"),
    "greek": _words("το αίτημα απέτυχε επειδή η υπηρεσία επέστρεψε σφάλμα μετά το χρονικό όριο"),
    "hindi": _words("अनुरोध विफल हुआ क्योंकि सेवा ने त्रुटि लौटाई समय सीमा के बाद हमने"),
}


@pytest.mark.parametrize("script", sorted(_SCRIPTS))
def test_one_read_is_enough_in_any_script(script: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first read of a chat goes back about as far as the budget holds, whatever the script: the horizon
    measures the chat's characters per token on its newest messages (CJK or Devanagari text runs at one or two
    where English runs at four or five), so it neither reads twice nor reads several times what it keeps."""
    reads: list[int] = []
    real = engine.read

    def counted(*args: Any) -> engine.Draft:
        draft = real(*args)
        reads.append(draft.horizon)
        return draft

    monkeypatch.setattr(engine, "read", counted)
    keeper = ck.ContextKeeper(tokenizer=hf_tokenizer("qwen2"), chat_template=template(QWEN), context_window=4096)
    messages = _long_chat(_SCRIPTS[script])
    fit = keeper.fit(messages, max_tokens=256)
    assert fit.tokens == keeper.counter.count(fit.messages)  # exact, as always
    assert len(reads) == 1, f"{script}: read {len(reads)} times"
    read = len(messages) - reads[0]
    assert len(fit.messages) >= 0.6 * read, f"{script}: read {read} messages to keep {len(fit.messages)}"


def test_the_horizon_leaves_the_request_its_room() -> None:
    """A request that takes most of the budget (a long tool result in it) leaves history the rest: the read
    stops where that rest is full, not where the whole budget would be."""
    keeper = ck.ContextKeeper(tokenizer=hf_tokenizer("qwen2"), chat_template=template(QWEN), context_window=4096)
    messages = _long_chat(_SCRIPTS["english"])
    messages[-1] = {"role": "user", "content": "summarise this log: " + "timeout at the gateway, retrying. " * 90}
    fit = keeper.fit(messages, max_tokens=256)
    read = len(messages) - 1 - fit.report.unread
    assert len(fit.messages) >= 0.6 * read, f"read {read} messages to keep {len(fit.messages)}"


def test_the_measured_rate_follows_the_script_and_the_kind_of_text() -> None:
    counter = ck.HFChatTemplateCounter(hf_tokenizer("qwen2"), chat_template=template(QWEN), name=QWEN)
    rates, weights = {}, {}
    for script in ("english", "chinese"):
        session = Session.of("x", counter, fork=False)
        messages = _long_chat(_SCRIPTS[script])
        messages[-2:-2] = [  # a tool round: JSON runs at fewer characters per token than prose
            {"role": "assistant", "content": None, "tool_calls": [call("c1", "run_sql", sql="SELECT 1")]},
            {"role": "tool", "tool_call_id": "c1", "content": '{"rows": [{"id": 1, "v": 2.5}, {"id": 2, "v": 7}]}'},
        ]
        ask = engine.Ask.of(session, messages, None, budget(), 0.0)
        rates[script] = engine.calibrated(session, ask, 4.75)
        weights[script] = session.rates.results
        assert engine.calibrated(session, ask, 0.0) == 0.0  # 0: read everything, nothing to measure
    assert rates["english"] > 4.0  # English prose: five or more characters per token
    assert 0.5 <= rates["chinese"] < 3.0  # CJK: about one and a half, with the margin
    # A character of JSON is worth more tokens beside English prose than beside Chinese.
    assert weights["english"] > 2 * weights["chinese"]


def test_a_foresight_written_without_the_rate_is_called_without_it() -> None:
    class Older:
        def kept_chars(self, role: str, chars: float, newer_results: int) -> float:
            return chars / 2

    class Newer:
        def kept_chars(self, role: str, chars: float, newer_results: int, per_token: float = 4.0) -> float:
            return per_token

    assert engine._kept_chars(Older())("tool", 100.0, 3, 2.5) == 50.0  # type: ignore[arg-type]
    assert engine._kept_chars(Newer())("tool", 100.0, 3, 2.5) == 2.5  # type: ignore[arg-type]


# ------------------------------------------------------------------ over the budget without tokenizing
def _cjk_agent_chat(turns: int = 60) -> list[dict[str, Any]]:
    """A Chinese agent chat whose old tool results (long JSON rows) are what a first read finds most of."""
    words = _SCRIPTS["chinese"]
    messages: list[dict[str, Any]] = [{"role": "system", "content": "请简短回答。"}]
    for t in range(turns):
        text = "".join(words[(t * 5 + i) % len(words)] for i in range(30))
        rows = [
            {"编号": t * 100 + i, "说明": "".join(words[(t + i + j) % len(words)] for j in range(12))}
            for i in range(25)
        ]
        messages += [
            {"role": "user", "content": f"{t}. {text}"},
            {"role": "assistant", "content": "", "tool_calls": [call(f"c{t}", "query", q=text[:20])]},
            {"role": "tool", "tool_call_id": f"c{t}", "content": json.dumps(rows, ensure_ascii=False)},
            {"role": "assistant", "content": text[::-1]},
        ]
    return [*messages, {"role": "user", "content": "下一步呢？"}]


def test_a_read_far_over_the_budget_at_the_chats_own_rate_is_not_tokenized(monkeypatch: pytest.MonkeyPatch) -> None:
    """A first read holds old tool results about to be cleared. CJK text runs at under 8 characters per token, so
    only the rate measured on the chat's newest texts shows the read is over the budget before it is counted:
    the results are cleared without counting the read first (the report's saving is then unknown), and the fit
    keeps exactly what counting first would have kept."""

    def fitted() -> ck.Fit:
        keeper = ck.ContextKeeper(tokenizer=hf_tokenizer("qwen2"), chat_template=template(QWEN), context_window=8192)
        return keeper.fit(_cjk_agent_chat(), max_tokens=256)

    fit = fitted()
    assert fit.tokens == ck.HFChatTemplateCounter(hf_tokenizer("qwen2"), chat_template=template(QWEN)).count(
        fit.messages
    )
    pruned = fit.report.actions[0]
    assert pruned.strategy == "prune_tool_results"
    assert pruned.saved is None  # the read was never counted before its results were cleared
    monkeypatch.setattr(base, "MEASURED_MARGIN", float("inf"))  # the measured rate switched off
    counted = fitted()
    assert counted.report.actions[0].saved is not None  # counted first
    assert counted.report.actions[0].saved > 8192
    assert fit.messages == counted.messages
    assert fit.tokens == counted.tokens


def test_the_measured_rate_decides_only_far_over_the_budget() -> None:
    system, *history, request = (
        (Item(ck.Message(role="user", content=text)),) for text in ("s", "你好" * 1000, "再见" * 1000, "?")
    )
    asked: list[int] = []

    def count(units: Any) -> int:
        asked.append(len(units))
        return 4000

    state = base.FitState(system=system, history=tuple(history), request=request, limit=1000, count=count)
    trigger = base.OverBudget()
    assert trigger(state)
    assert asked == [2]  # 4,002 characters: under 8 a token, so counted
    asked.clear()
    assert trigger(replace(state, sparsest=1.5))
    assert asked == []  # over 2 × 1.5 characters a token: over without counting
    assert trigger(replace(state, sparsest=2.5))
    assert asked == [2]  # under 2 × 2.5: counted
