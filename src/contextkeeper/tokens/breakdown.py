"""Where a prompt's tokens go: system, tools, history, request and the template's own overhead."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .._exceptions import ChatTemplateError
from ..messages import Conversation
from .base import Measuring, MessagesLike, TokenCounter, ToolsLike

__all__ = ["SLOTS", "Breakdown", "HeadCounts", "breakdown", "head_counts", "prompt_slots", "split_slots"]


#: The slots of a prompt, in prompt order (a fit's report adds ``answer``, and ``withheld`` where it applies).
SLOTS = ("system", "tools", "history", "request", "template_overhead")


@dataclass(frozen=True, kw_only=True)
class Breakdown:
    """An exact total split into the slots of :func:`prompt_slots` (the same slots a fit's report names).

    The slots always sum to ``tokens``. ``template_overhead`` is the generation prompt plus anything the
    template renders for an empty conversation; ``tools`` is what the tool schemas add (0 when the template
    ignores them); ``messages`` says how many messages each of system, history and request holds.
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

    @property
    def slots(self) -> dict[str, int]:
        """The slots in prompt order, named as in a fit's ``report.slots``."""
        return {name: getattr(self, name) for name in SLOTS}

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
    """Count ``messages`` and ``tools`` and split the exact total into slots (see :func:`prompt_slots`)."""
    conversation = messages if isinstance(messages, Conversation) else Conversation.from_messages(messages)
    end_system, start_request = split_slots(conversation)
    items = list(conversation)
    tool_list = list(tools) if tools else None
    if isinstance(counter, Measuring):
        measured = counter.measure(conversation, tools=tool_list)
        total, estimated, notes = measured.tokens, measured.estimated, tuple(measured.notes)
    else:
        total, estimated, notes = counter.count(conversation, tools=tool_list), False, ()
    system, request = items[:end_system], items[start_request:]
    fixed = [*system, *request]
    base = total if len(fixed) == len(items) else int(counter.count(fixed, tools=tool_list))
    head = head_counts(counter.count, system, tool_list)
    slots = prompt_slots(counter.count, system, request, tool_list, total=total, base=base, head=head)
    return Breakdown(
        tokens=total,
        **slots,
        messages={
            "system": end_system,
            "history": start_request - end_system,
            "request": len(items) - start_request,
        },
        estimated=estimated,
        notes=notes,
    )


CountFn = Callable[..., int]  # a counter's count(messages, *, tools=..., add_generation_prompt=...)


@dataclass(frozen=True)
class HeadCounts:
    """The counts :func:`prompt_slots` takes of the system prompt alone (constant while it and the tools are)."""

    empty: int  # the template's output for no messages at all (0 when it refuses to render none)
    system: int  # the system messages alone, without a generation prompt
    with_tools: int  # the same with the tool schemas


def head_counts(count: CountFn, system: Sequence[Any], tools: list[Any] | None) -> HeadCounts | None:
    """The head counts of ``system`` and ``tools``, or None when the template refuses a system prompt without a
    request (Llama 3.1+ puts the tools into the first user message)."""
    try:
        empty = int(count([], add_generation_prompt=False))
    except ChatTemplateError:
        empty = 0
    try:
        alone = int(count(list(system), add_generation_prompt=False)) if system else empty
        with_tools = int(count(list(system), tools=tools, add_generation_prompt=False)) if tools else alone
    except ChatTemplateError:
        return None
    return HeadCounts(empty=empty, system=alone, with_tools=with_tools)


def prompt_slots(
    count: CountFn,
    system: Sequence[Any],
    request: Sequence[Any],
    tools: list[Any] | None,
    *,
    total: int,
    base: int,
    head: HeadCounts | None,
) -> dict[str, int]:
    """The one slot model of a prompt: ``system``, ``tools``, ``history``, ``request``, ``template_overhead``.

    Only the never-trimmed parts are counted (``base`` is the system prompt, the request and the tools with the
    generation prompt; ``total`` the whole prompt), so history is what it adds to them. Each other slot is what
    its part adds in prompt order: the system prompt to the template's empty output, the tools to the system
    prompt, the request to both; the overhead is the empty output plus the generation prompt. The slots sum to
    ``total``. When the template refuses a system prompt on its own (``head`` is None), each part's slot is
    what removing it saves instead.
    """
    fixed = [*system, *request]
    try:
        if head is None:
            raise ChatTemplateError("the template refuses the system prompt without a request")
        bare = int(count(fixed, tools=tools, add_generation_prompt=False))
        system_slot, tools_slot = head.system - head.empty, head.with_tools - head.system
        # A server that continues a final assistant message (llama.cpp) or makes it a user one (SGLang) writes
        # fewer tokens than the closed message without a generation prompt: that handling is the request's.
        bare = min(bare, base)
        request_slot, overhead = bare - head.with_tools, head.empty + base - bare
    except ChatTemplateError:
        no_tools = int(count(fixed)) if tools else base
        no_tools_bare = int(count(fixed, add_generation_prompt=False))
        try:
            request_slot = int(count(list(request), add_generation_prompt=False)) if request else 0
        except ChatTemplateError:
            request_slot = 0
        system_slot, tools_slot, overhead = no_tools_bare - request_slot, base - no_tools, no_tools - no_tools_bare
    return {
        "system": system_slot,
        "tools": tools_slot,
        "history": total - base,
        "request": request_slot,
        "template_overhead": overhead,
    }
