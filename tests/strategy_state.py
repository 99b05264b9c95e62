"""The FitState the strategy tests run on: a system message, a history and a request, counted exactly.

``make_state`` builds what the keeper hands a strategy: the history grouped into units (an assistant message
with its tool results is one unit), every item carrying its position in the caller's list as ``origin``, the
request's user text as ``query``, and a ``count`` that renders system + history + request through a real
counter every time (a :class:`Counted`, which also tallies its calls).

For strategies tested through a whole fit: ``keeper`` (a fresh keeper on a shared real counter whose policy is
the given steps), the conversations ``agent_chat`` and ``plain_chat``, and ``check_invariants``, what every fit
must keep.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import contextkeeper as ck
from assets import template
from conftest import hf_tokenizer
from contextkeeper import Conversation, Message
from contextkeeper.keeper import ContextKeeper
from contextkeeper.strategies import FitState, Item, Memory
from contextkeeper.strategies.base import Items
from contextkeeper.strategies.policy import Policy, PolicyStep

QWEN = "Qwen-Qwen2.5-7B-Instruct"

# A history as the tests write it: message dicts in order (grouped into units by the library's own rule),
# message dicts already grouped into units, or units built earlier (kept as the very same objects).
History = Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]] | Sequence[Items]


def messages(system: Items, units: Sequence[Items], request: Items) -> list[Message]:
    """The prompt's messages, in order."""
    return [item.message for unit in (system, *units, request) for item in unit]


class Counted:
    """The exact count of system + history + request through ``counter``; counts its calls."""

    def __init__(self, counter: Any, system: Items, request: Items) -> None:
        self.counter, self.system, self.request = counter, system, request
        self.calls = 0

    def __call__(self, units: Sequence[Items]) -> int:
        self.calls += 1
        return int(self.counter.count(messages(self.system, units, self.request)))


def _numbered(groups: Sequence[Sequence[Mapping[str, Any]]], start: int) -> tuple[Items, ...]:
    index = start
    units: list[Items] = []
    for group in groups:
        unit = []
        for data in group:
            unit.append(Item(Message.from_dict(dict(data)), index))
            index += 1
        units.append(tuple(unit))
    return tuple(units)


def _units(
    system: Mapping[str, Any], history: History, request: Mapping[str, Any]
) -> tuple[Items, tuple[Items, ...], Items]:
    first = history[0] if history else None
    if isinstance(first, tuple) and all(isinstance(item, Item) for item in first):
        built: tuple[Items, ...] = tuple(history)  # type: ignore[arg-type]
        after = max((item.origin for unit in built for item in unit if item.origin is not None), default=0)
        return _numbered([[system]], 0)[0], built, _numbered([[request]], after + 1)[0]
    if first is None or isinstance(first, Mapping):
        conversation = Conversation.from_messages([dict(system), *map(dict, history), dict(request)])  # type: ignore[arg-type]
        units = tuple(
            tuple(Item(message, origin) for origin, message in zip(unit.indices, unit.messages, strict=True))
            for unit in conversation.units()
        )
        return units[0], units[1:-1], units[-1]
    numbered = _numbered([[system], *history, [request]], 0)
    return numbered[0], numbered[1:-1], numbered[-1]


def make_state(
    counter: Any,
    system: Mapping[str, Any],
    history: History,
    request: Mapping[str, Any],
    *,
    limit: int,
    memory: Memory | None = None,
) -> FitState:
    """A FitState over ``system``, ``history`` and ``request`` whose counts come from ``counter``."""
    system_unit, units, request_unit = _units(system, history, request)
    return FitState(
        system=system_unit,
        history=units,
        request=request_unit,
        limit=limit,
        count=Counted(counter, system_unit, request_unit),
        query="\n".join(item.text() for item in request_unit if item.role == "user"),
        memory=Memory() if memory is None else memory,
    )


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
