"""engine.py on its own: a read's count memo, when to read further, and the prepared request."""

from __future__ import annotations

from typing import Any

import pytest

import contextkeeper as ck
from assets import template
from conftest import hf_tokenizer
from contextkeeper import engine
from contextkeeper.budget import Budget
from contextkeeper.session import Session
from contextkeeper.strategies import Item

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
    return Budget.of(limit, "context_window", max_tokens=answer, policy="p", policy_answer=answer, reserve=ck.Reserve())


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
    ],
)
def test_how_far_the_next_read_goes(tokens: int, unread: int, wider: float | None) -> None:
    messages = chat(3)
    ask = engine.Ask.of(Session.of("x", Counting(), fork=False), messages, None, budget(), 0.0)

    class Draft:
        horizon = ask.sys_end + unread

    Draft.tokens = tokens  # type: ignore[attr-defined]
    got = engine.further(ask, 4.75, Draft())  # type: ignore[arg-type]
    assert got == pytest.approx(wider) if wider is not None else got is None


def test_the_request_is_prepared_once() -> None:
    messages = [{"role": "system", "content": "s"}, {"role": "developer", "content": "d"}, *chat(2)[1:]]
    ask = engine.Ask.of(Session.of("x", Counting(), fork=False), messages, None, budget(), 0.0)
    assert (ask.sys_end, ask.last_user, ask.sticky) == (2, len(messages) - 1, None)
    with pytest.raises(ck.MessageError, match="expected a list of messages, got dict"):
        engine.Ask.of(Session.of("x", Counting(), fork=False), {"role": "user"}, None, budget(), 0.0)  # type: ignore[arg-type]
