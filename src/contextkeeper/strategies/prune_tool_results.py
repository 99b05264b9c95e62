"""Replace old tool results with a short placeholder, keeping every call/result pair."""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence

from pydantic import Field, field_validator

from ..messages import Message
from .base import Action, FitState, Item, Items, StrategySettings, register, with_content

_Found = tuple[int, int, Item]
"""A tool result in the history: its unit's index, its index in the unit, the item."""


class Cleared(set[str]):
    """A conversation's memory of this strategy: the call ids whose results it cleared (a window adopted from
    another process brings its own: see ``Session.adopt``)."""


@register("prune_tool_results")
class PruneToolResults(StrategySettings):
    """Clear the content of old tool results (oldest first), leaving ``[tool result cleared: name, N characters]``.

    ``keep_last``: the newest results that stay; ``exclude_tools``: tools whose results always stay;
    ``clear_at_least``: fire only when about this many tokens (at 4 characters per token) can be cleared, so
    clearing happens in batches
    (a cleared result stays cleared in later fits, which keeps the prompt's prefix stable for caches);
    ``clear_inputs``: also replace the calls' arguments with ``{}``.
    """

    keep_last: int = Field(default=3, ge=0)
    exclude_tools: tuple[str, ...] = ()
    clear_at_least: int = Field(default=2048, ge=0)
    clear_inputs: bool = False
    placeholder: str = Field(
        default="[tool result cleared: {tool}, {chars} characters]",
        json_schema_extra={"allowed": "a string ({tool} and {chars} optional)"},
    )

    @field_validator("placeholder")
    @classmethod
    def _check_placeholder(cls, value: str) -> str:
        try:
            value.format(tool="t", chars="1")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"not a format string with {{tool}} and {{chars}} only ({exc})") from None
        return value

    def kept_chars(self, role: str, chars: float, newer_results: int, per_token: float = 4.0) -> float:
        """An old tool result shrinks to its placeholder (results of excluded tools cannot be told apart here)."""
        if role == "tool" and newer_results >= self.keep_last and not self.exclude_tools:
            return min(chars, len(self.placeholder) + 16)
        return chars

    def _cleared_prefixes(self) -> tuple[str, ...]:
        """How a result cleared earlier starts (the placeholder's text before its first field), so it is never
        cleared again (a placeholder of a placeholder)."""
        own = self.placeholder.split("{", 1)[0]
        return ("[tool result cleared:", own) if own else ("[tool result cleared:",)

    def apply(self, state: FitState) -> FitState:
        return self._clear(state, fresh_batch=True)

    def reapply(self, state: FitState) -> FitState:
        """Clear again only the results cleared before (the conversation's memory, which another process may have
        handed over: see ``Session.adopt``), whatever the trigger: the prompt's prefix stays as it was."""
        return self._clear(state, fresh_batch=False)

    def _clear(self, state: FitState, *, fresh_batch: bool) -> FitState:
        memory = state.memory.slot(Cleared)
        names, results = _tool_results(state.history)
        chosen = self._choose(results, names, memory, fresh_batch=fresh_batch)
        if not chosen:
            return state
        units = [list(unit) for unit in state.history]
        cleared_ids = {str(item.message.tool_call_id or "") for _, _, item in chosen}
        for u, p, item in chosen:
            tool = names.get(str(item.message.tool_call_id or ""), "tool")
            text = self.placeholder.format(tool=tool, chars=f"{len(item.text()):,}")
            units[u][p] = state.reuse(
                item.message, ("prune", text), functools.partial(with_content, item.message, text)
            )
        if self.clear_inputs:
            _clear_arguments(state, units, cleared_ids)
        memory.update(cleared_ids)
        # Units left as they were stay the very same tuples (caches keyed by identity keep them).
        new: list[Items] = [
            old if all(map(operator.is_, old, unit)) else tuple(unit)
            for old, unit in zip(state.history, units, strict=True)
        ]
        saved = state.saving(new)
        detail = f"cleared {len(chosen)} old tool result(s), kept the newest {self.keep_last}"
        return state.with_history(
            new, Action(strategy="prune_tool_results", detail=detail, saved=saved, units=len(chosen))
        )

    def _choose(
        self, results: list[_Found], names: dict[str, str], memory: set[str], *, fresh_batch: bool
    ) -> list[_Found]:
        """The old results to clear: those cleared in an earlier fit (they stay cleared) and, with ``fresh_batch``,
        the others once together they are worth clearing. Results of excluded tools, and placeholders, stay."""
        sticky: list[_Found] = []
        fresh: list[_Found] = []
        fresh_tokens = 0
        for u, p, item in results[: max(0, len(results) - self.keep_last)]:
            call_id = str(item.message.tool_call_id or "")
            if names.get(call_id, "") in self.exclude_tools or item.text().startswith(self._cleared_prefixes()):
                continue
            if call_id in memory:
                sticky.append((u, p, item))
            else:
                fresh.append((u, p, item))
                # An estimate (4 characters per token) decides the batch: counting exactly would tokenize text
                # that is about to be cleared. The savings reported are counted exactly.
                fresh_tokens += len(item.text()) // 4
        return sticky + (fresh if fresh_batch and fresh_tokens >= self.clear_at_least else [])


def _tool_results(history: Sequence[Items]) -> tuple[dict[str, str], list[_Found]]:
    """The tool name of each call id, and the tool results in ``history``, oldest first."""
    names: dict[str, str] = {}
    results: list[_Found] = []
    for u, unit in enumerate(history):
        for p, item in enumerate(unit):
            for call in item.message.tool_calls or ():
                names[str(call.id)] = call.name
            if item.role == "tool":
                results.append((u, p, item))
    return names, results


def _clear_arguments(state: FitState, units: list[list[Item]], cleared_ids: set[str]) -> None:
    """In ``units``, the calls whose results were cleared get ``{}`` for arguments (``"{}"`` where they were text)."""
    for unit_items in units:
        for p, item in enumerate(unit_items):
            if item.message.tool_calls and any(call.id in cleared_ids for call in item.message.tool_calls):
                data = item.message.to_dict()
                for call in data.get("tool_calls") or []:
                    if call.get("id") in cleared_ids:
                        function = call.get("function") or call
                        function["arguments"] = "{}" if isinstance(function.get("arguments"), str) else {}
                key = ("prune-inputs", tuple(sorted(cleared_ids)))
                unit_items[p] = state.reuse(item.message, key, functools.partial(Message.from_dict, data))
