"""Where a prompt's tokens go: system, tools, history, request and the template's own overhead."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .._exceptions import ChatTemplateError
from ..messages import Conversation
from .base import MessagesLike, TokenCounter, ToolsLike

__all__ = ["Breakdown", "breakdown", "split_slots"]


@dataclass(frozen=True, kw_only=True)
class Breakdown:
    """An exact total split into slots by marginal cost.

    Each slot is what its messages add when appended in prompt order (their role headers included), so the
    slots always sum to ``tokens``. ``template_overhead`` is the generation prompt plus anything the template
    renders for an empty conversation; ``tools`` is what the tool schemas add (0 when the template ignores
    them).
    """

    tokens: int
    system: int
    tools: int
    history: int
    request: int
    template_overhead: int
    messages: dict[str, int]
    estimated: bool = False
    notes: tuple[str, ...] = field(default=())

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["notes"] = list(self.notes)
        return data


def split_slots(conversation: Conversation) -> tuple[int, int]:
    """Boundaries ``(end_of_system, start_of_request)`` as message indices.

    The system slot is the leading system/developer messages; the request is the pending turn, from the newest
    user message to the end (with any tool calls and results the model must now answer).
    """
    end_system = 0
    for unit in conversation.units():
        if unit.kind != "system":
            break
        end_system = unit.stop
    start_request = end_system
    for index in range(len(conversation) - 1, end_system - 1, -1):
        if conversation[index].role == "user":
            start_request = index
            break
    else:
        units = conversation.units()
        start_request = units[-1].start if units and units[-1].kind != "system" else len(conversation)
    return end_system, start_request


def breakdown(counter: TokenCounter, messages: MessagesLike, *, tools: ToolsLike = None) -> Breakdown:
    """Count ``messages`` and ``tools`` and split the exact total into slots."""
    conversation = messages if isinstance(messages, Conversation) else Conversation.from_messages(messages)
    end_system, start_request = split_slots(conversation)
    items = list(conversation)

    def count(upto: int, *, with_tools: bool, generation: bool) -> int:
        part = Conversation.from_messages(items[:upto])
        return counter.count(part, tools=tools if with_tools else None, add_generation_prompt=generation)

    def prefix(upto: int) -> int | None:
        # Some templates refuse partial conversations (a lone system message, no user turn): that slot then
        # merges into the next one instead of failing the whole breakdown.
        try:
            return count(upto, with_tools=False, generation=False)
        except ChatTemplateError:
            return None

    measure = getattr(counter, "measure", None)
    if callable(measure):
        measured = measure(conversation, tools=tools)
        total, estimated, notes = measured.tokens, measured.estimated, tuple(measured.notes)
    else:
        total, estimated, notes = counter.count(conversation, tools=tools), False, ()
    no_tools = count(len(items), with_tools=False, generation=True) if tools else total
    finished = count(len(items), with_tools=False, generation=False)
    empty = prefix(0) or 0
    system_end = prefix(end_system) if end_system else empty
    history_end = prefix(start_request) if start_request > end_system else system_end
    system_end = empty if system_end is None else system_end
    history_end = system_end if history_end is None else history_end
    return Breakdown(
        tokens=total,
        system=system_end - empty,
        tools=total - no_tools,
        history=history_end - system_end,
        request=finished - history_end,
        template_overhead=empty + (no_tools - finished),
        messages={
            "system": end_system,
            "history": start_request - end_system,
            "request": len(items) - start_request,
        },
        estimated=estimated,
        notes=notes,
    )
