"""Remove repetition: identical repeated messages, identical tool results, superseded summaries."""

from __future__ import annotations

import functools

from pydantic import Field

from .base import Action, FitState, Items, StrategySettings, register, with_content
from .summarize import SUMMARY_PREFIX


@register("dedupe")
class Dedupe(StrategySettings):
    """Keep the latest of identical messages; earlier copies become a short marker (pairs and order stay).

    ``min_chars``: shorter messages are left alone ("ok", "thanks" repeat naturally and cost nothing).
    """

    min_chars: int = Field(default=64, ge=0)
    marker: str = "[repeated later in the conversation]"

    def apply(self, state: FitState) -> FitState:
        history = list(state.history)
        # Superseded summaries: only the newest summary unit pair stays.
        summary_units = [
            i
            for i, unit in enumerate(history)
            if unit and unit[0].role == "user" and unit[0].text().startswith(SUMMARY_PREFIX)
        ]
        drop: set[int] = set()
        for i in summary_units[:-1]:
            drop.add(i)
            if i + 1 < len(history) and history[i + 1] and history[i + 1][0].role == "assistant":
                drop.add(i + 1)
        seen: set[tuple[str, str]] = set()
        changed = 0
        new: list[Items] = []
        # Walk newest first so the latest copy is the one kept.
        for index in range(len(history) - 1, -1, -1):
            if index in drop:
                continue
            items = list(history[index])
            for position, item in enumerate(items):
                if item.message.has_tool_calls or item.message.media_parts():
                    continue
                text = item.text()
                if len(text) < self.min_chars:
                    continue
                key = (item.role, text)
                if key in seen:
                    items[position] = state.reuse(
                        item.message,
                        ("dedupe", self.marker),
                        functools.partial(with_content, item.message, self.marker),
                    )
                    changed += 1
                else:
                    seen.add(key)
            new.append(tuple(items))
        new.reverse()
        if not changed and not drop:
            return state
        saved = state.saving(new)
        detail = f"{changed} repeated message(s) marked, {len(drop) // 2 or len(drop)} old summary unit(s) dropped"
        return state.with_history(new, Action(strategy="dedupe", detail=detail, saved=saved, units=changed))
