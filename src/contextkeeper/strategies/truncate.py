"""Cut oversize messages and text attachments in the middle, with a marker, to an exact token cap."""

from __future__ import annotations

import functools
from typing import Any

from pydantic import Field, field_validator

from ..messages import Message, Role
from .base import Action, FitState, Item, Items, StrategySettings, register


def cut_middle(text: str, cap: int, tokens_of: Any, marker: str) -> str:
    """The longest head + marker + tail of ``text`` (equal shares) whose tokens are at most ``cap``."""
    if tokens_of(text) <= cap:
        return text
    low, high = 0, len(text) // 2  # characters kept at each end
    best = marker.format(cut="all") if tokens_of(marker.format(cut="all")) <= cap else ""
    while low <= high:
        keep = (low + high) // 2
        candidate = text[:keep] + marker.format(cut=len(text) - 2 * keep) + text[len(text) - keep :]
        if tokens_of(candidate) <= cap:
            best = candidate
            low = keep + 1
        else:
            high = keep - 1
    return best


def _texts(message: Message) -> list[str]:
    """The texts the cap applies to: the string content, or each text part's text."""
    content = message.content
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [t for part in content if part.type == "text" and (t := part.as_text()) is not None]
    return []


@register("truncate")
class Truncate(StrategySettings):
    """Messages (and text parts of multi-part content) over ``max_tokens`` tokens are cut in the middle.

    ``roles``: which messages may be cut (tool results and user attachments by default; assistant turns and the
    system prompt are left whole). The cap is exact with the model's tokenizer.
    """

    max_tokens: int = Field(default=4096, ge=1)
    roles: tuple[Role, ...] = ("tool", "user")
    marker: str = Field(
        default="\n[… {cut} characters cut …]\n", json_schema_extra={"allowed": "a string ({cut} optional)"}
    )

    @field_validator("marker")
    @classmethod
    def _check_marker(cls, value: str) -> str:
        try:
            value.format(cut=1)
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"not a format string with {{cut}} only ({exc})") from None
        return value

    def kept_chars(self, role: str, chars: float, newer_results: int, per_token: float = 4.0) -> float:
        """A message over the cap keeps about the cap (at ``per_token`` characters per token)."""
        return min(chars, per_token * self.max_tokens) if role in self.roles else chars

    def apply(self, state: FitState) -> FitState:
        # Messages whose every text is under the cap by a bound alone are passed over; the texts of the others
        # are tokenized in one batch first (cached by text: a later fit pays only for new messages).
        long: set[int] = set()  # ids of the items to check (alive with the history)
        texts: list[str] = []
        for unit in state.history:
            for item in unit:
                if item.role in self.roles:
                    unsure = [text for text in _texts(item.message) if not self._short(state, text)]
                    if unsure:
                        long.add(id(item))
                        texts.extend(unsure)
        if not long:
            return state
        state.prefetch_tokens(texts)
        new: list[Items] = []
        cut = 0
        key = ("truncate", self.max_tokens, self.marker)
        for unit in state.history:
            items = list(unit)
            for position, item in enumerate(items):
                if id(item) not in long:
                    continue
                replaced = state.reuse(item.message, key, functools.partial(self._cut, item, state))
                if replaced.message is not item.message:
                    items[position] = replaced
                    cut += 1
            new.append(tuple(items))
        if not cut:
            return state
        saved = state.saving(new)
        detail = f"cut {cut} message(s) to {self.max_tokens} tokens"
        return state.with_history(new, Action(strategy="truncate", detail=detail, saved=saved, units=cut))

    def _short(self, state: FitState, text: str) -> bool:
        """Under the cap by a bound alone (no tokenizing)."""
        if state.text_bound is None:
            return False
        bound = state.text_bound(text)
        return bound is not None and bound <= self.max_tokens

    def _cut(self, item: Item, state: FitState) -> Message:
        """The cut message, or the message itself when nothing is over the cap."""
        content = item.message.content
        data = item.message.to_dict()
        if isinstance(content, str):
            if state.within(content, self.max_tokens):
                return item.message
            data["content"] = cut_middle(content, self.max_tokens, state.tokens_of, self.marker)
            return Message.from_dict(data)
        if isinstance(content, list):
            changed = False
            parts: list[Any] = []
            for part, raw in zip(content, data["content"], strict=True):
                text = part.as_text()
                if text is not None and part.type == "text" and not state.within(text, self.max_tokens):
                    raw = {**raw, "text": cut_middle(text, self.max_tokens, state.tokens_of, self.marker)}
                    changed = True
                parts.append(raw)
            if changed:
                data["content"] = parts
                return Message.from_dict(data)
        return item.message
