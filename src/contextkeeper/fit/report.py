"""What a fit returns: the fitted messages, their exact count, and the report of what was done and why."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..strategies.base import Action
from ..tokens.prefix import PrefixOf

__all__ = ["Fit", "FitReport"]


@dataclass(frozen=True, kw_only=True)
class FitReport:
    """What a fit did: the limit and where it came from, every slot, each strategy's savings, the time."""

    limit: int
    limit_source: str
    max_tokens: int
    tokens: int
    tokens_before: int | None  # None when history beyond the horizon was never read (counting it costs time)
    messages_before: int
    messages_after: int
    unread: int  # messages beyond the horizon, dropped without being read
    actions: tuple[Action, ...]
    seconds: float
    policy: str
    notes: tuple[str, ...] = ()
    # The slots and the history before and after: they need the never-trimmed parts counted on their own, which
    # no fit decision needs, so they are counted when first read.
    _breakdown: _Breakdown = field(repr=False, compare=False)
    # The prefix shared with the previous prompt of the conversation: compared by token ids when first read.
    _prefix: PrefixOf = field(default_factory=lambda: PrefixOf(None, None, None), repr=False, compare=False)

    @property
    def slots(self) -> dict[str, int]:
        """Tokens per slot in prompt order (system, tools, history, request, template overhead, answer); the
        slots before the answer sum to ``tokens``."""
        return dict(self._breakdown.get()[0])

    @property
    def history_before(self) -> int | None:
        """History tokens before the strategies (None when the history as read was never counted)."""
        return self._breakdown.get()[1]

    @property
    def history_after(self) -> int:
        """History tokens in the fitted prompt."""
        return self._breakdown.get()[2]

    @property
    def prefix_tokens(self) -> int | None:
        """Tokens of this prompt that are a prefix of the previous prompt of this conversation, by token ids,
        exactly: what a server's prefix cache can reuse at best. 0 for the first prompt of the conversation's
        session; None when this prompt or the previous one holds media priced by an estimate, or the counter has
        no token ids to compare."""
        return self._prefix.get()

    @property
    def prefill_tokens(self) -> int | None:
        """Tokens a server with a prefix cache holding the previous prompt must still prefill (``tokens`` less
        ``prefix_tokens``; None where that is None)."""
        prefix = self._prefix.get()
        return None if prefix is None else self.tokens - prefix

    def with_slots(self, change: Callable[[dict[str, int]], dict[str, int]], **fields: Any) -> FitReport:
        """A copy with ``fields`` replaced and the slots passed through ``change`` (still counted when read)."""
        return dataclasses.replace(self, _breakdown=self._breakdown.then(change), **fields)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {}
        for item in dataclasses.fields(self):
            if item.name in ("_breakdown", "_prefix"):
                continue
            data[item.name] = getattr(self, item.name)
            if item.name == "tokens_before":
                data.update(slots=self.slots, history_before=self.history_before, history_after=self.history_after)
        data["prefix_tokens"] = self.prefix_tokens
        data["actions"] = [dataclasses.asdict(a) for a in self.actions]
        data["notes"] = list(self.notes)
        return data


class _Breakdown:
    """Computed once, on first read, by whichever thread reads first; pickles as its values."""

    def __init__(self, compute: Callable[[], tuple[dict[str, int], int | None, int]]) -> None:
        self._compute: Callable[[], tuple[dict[str, int], int | None, int]] | None = compute
        self._value: tuple[dict[str, int], int | None, int] | None = None
        self._lock = threading.Lock()

    @classmethod
    def known(cls, slots: dict[str, int], before: int | None, after: int) -> _Breakdown:
        made = cls(lambda: (slots, before, after))
        made.get()
        return made

    def get(self) -> tuple[dict[str, int], int | None, int]:
        value = self._value
        if value is None:
            with self._lock:
                if self._value is None:
                    assert self._compute is not None
                    self._value = self._compute()
                    self._compute = None  # drops what the computation held (the keeper, the fit's units)
                value = self._value
        return value

    def then(self, change: Callable[[dict[str, int]], dict[str, int]]) -> _Breakdown:
        def compute() -> tuple[dict[str, int], int | None, int]:
            slots, before, after = self.get()
            return change(dict(slots)), before, after

        return _Breakdown(compute)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Breakdown.known, self.get())


@dataclass(frozen=True)
class Fit:
    """The fitted prompt: ``messages`` in the caller's format, ``tokens`` its exact count, and the report."""

    messages: list[Any]
    tokens: int
    report: FitReport
