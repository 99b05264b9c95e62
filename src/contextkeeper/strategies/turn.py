"""Compacting the current turn of an agent loop, when it alone does not fit.

The new request is the newest user message and everything after it: in an agent loop, every tool round since
the user spoke. Normally none of it is trimmed. When that turn alone is over the budget, its older tool rounds
give way, oldest first, before the fit is refused. Their results are cleared to placeholders first, and then
whole rounds are dropped. The user's message and the last round (the results the model must answer now) stay
verbatim, and every call keeps its result.
"""

from __future__ import annotations

from collections.abc import Callable

from .base import Action, Item, Items, with_content

__all__ = ["PLACEHOLDER", "compact_turn"]

PLACEHOLDER = "[tool result cleared: {tool}, {chars} characters]"


def _rounds(request: Items) -> tuple[Items, list[list[Item]]]:
    """The request split into its head (the user's message) and its tool rounds (an assistant message and the
    tool results that follow it)."""
    head: list[Item] = []
    rounds: list[list[Item]] = []
    for item in request:
        if item.role == "assistant":
            rounds.append([item])
        elif rounds:
            rounds[-1].append(item)
        else:
            head.append(item)
    return tuple(head), rounds


def compact_turn(request: Items, fits: Callable[[Items], bool]) -> tuple[Items, Action] | None:
    """The smallest change to ``request`` that ``fits``: clear the results of the fewest oldest rounds, else
    clear them all and drop the fewest oldest rounds; never the user's message or the last round. None when
    there is nothing to change or even the most compacted turn does not fit. Both searches are binary (each
    step is one count), since clearing or dropping more never makes the turn longer."""
    head, rounds = _rounds(request)
    if len(rounds) < 2:
        return None
    older, last = rounds[:-1], rounds[-1]
    names = {str(call.id): call.name for r in rounds for call in (r[0].message.tool_calls or ())}
    marker = PLACEHOLDER.split("{", 1)[0]

    def clear(r: list[Item]) -> list[Item]:
        out = []
        for item in r:
            if item.role == "tool" and not item.text().startswith(marker):
                tool = names.get(str(item.message.tool_call_id or ""), "tool")
                text = PLACEHOLDER.format(tool=tool, chars=f"{len(item.text()):,}")
                item = Item(with_content(item.message, text), None, item.message)
            out.append(item)
        return out

    cleared = [clear(r) for r in older]

    def assemble(cut: int, drop: int = 0) -> Items:
        kept = cleared[drop:cut] + older[cut:]
        return (*head, *(item for r in kept for item in r), *last)

    def smallest(low: int, high: int, ok: Callable[[int], bool]) -> int | None:
        if not ok(high):
            return None
        while low < high:
            middle = (low + high) // 2
            if ok(middle):
                high = middle
            else:
                low = middle + 1
        return low

    n = len(older)
    cut = smallest(1, n, lambda k: fits(assemble(k)))
    if cut is not None:
        return assemble(cut), _action(sum(1 for r in cleared[:cut] for i in r if i.origin is None), 0)
    drop = smallest(1, n, lambda d: fits(assemble(n, d)))
    if drop is None:
        return None
    return assemble(n, drop), _action(sum(1 for r in cleared[drop:] for i in r if i.origin is None), drop)


def _action(cleared: int, dropped: int) -> Action:
    detail = f"the current turn alone was over the budget: cleared {cleared} of its older tool result(s)"
    if dropped:
        detail += f" and dropped its {dropped} oldest tool round(s)"
    return Action(strategy="prune_tool_results", detail=detail, saved=None, units=cleared + dropped)
