"""The FitState the strategy tests run on: a system message, a history and a request, counted exactly.

``make_state`` builds what the keeper hands a strategy: the history grouped into units (an assistant message
with its tool results is one unit), every item carrying its position in the caller's list as ``origin``, the
request's user text as ``query``, and a ``count`` that renders system + history + request through a real
counter every time (a :class:`Counted`, which also tallies its calls).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from contextkeeper import Conversation, Message
from contextkeeper.strategies import FitState, Item
from contextkeeper.strategies.base import Unit

# A history as the tests write it: message dicts in order (grouped into units by the library's own rule),
# message dicts already grouped into units, or units built earlier (kept as the very same objects).
History = Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]] | Sequence[Unit]


def messages(system: Unit, units: Sequence[Unit], request: Unit) -> list[Message]:
    """The prompt's messages, in order."""
    return [item.message for unit in (system, *units, request) for item in unit]


class Counted:
    """The exact count of system + history + request through ``counter``; counts its calls."""

    def __init__(self, counter: Any, system: Unit, request: Unit) -> None:
        self.counter, self.system, self.request = counter, system, request
        self.calls = 0

    def __call__(self, units: Sequence[Unit]) -> int:
        self.calls += 1
        return int(self.counter.count(messages(self.system, units, self.request)))


def _numbered(groups: Sequence[Sequence[Mapping[str, Any]]], start: int) -> tuple[Unit, ...]:
    index = start
    units: list[Unit] = []
    for group in groups:
        unit = []
        for data in group:
            unit.append(Item(Message.from_dict(dict(data)), index))
            index += 1
        units.append(tuple(unit))
    return tuple(units)


def _units(
    system: Mapping[str, Any], history: History, request: Mapping[str, Any]
) -> tuple[Unit, tuple[Unit, ...], Unit]:
    first = history[0] if history else None
    if isinstance(first, tuple) and all(isinstance(item, Item) for item in first):
        built: tuple[Unit, ...] = tuple(history)  # type: ignore[arg-type]
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
    memory: dict[str, Any] | None = None,
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
        memory={} if memory is None else memory,
    )
