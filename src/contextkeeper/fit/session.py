"""What a keeper remembers of each conversation between its fits: a typed :class:`Session` per conversation, in
a bounded least-recently-used list. Nothing else in the fit path keeps state from one fit to the next."""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._memo import IdentityMemo
from ..messages import Conversation, Message
from ..strategies.base import Items, Memory
from ..strategies.prune_tool_results import Cleared
from ..tokens import BatchTextCounting, Forgetting, Forking, TextBounding, TextCounting, TokenCounter
from ..tokens.breakdown import HeadCounts
from .raw import fingerprint

if TYPE_CHECKING:
    from .report import Fit

__all__ = ["DEFAULT_CONVERSATION", "Rates", "Session", "Sessions", "Sticky", "WindowState"]

DEFAULT_CONVERSATION = "default"


@dataclass(frozen=True)
class Rates:
    """How many of the chat's own characters (its messages' text) one character of a tool result, and of a tool
    call written out, is worth in tokens: JSON, logs and code run at fewer characters per token than prose."""

    results: float = 1.0
    calls: float = 1.0


@dataclass(frozen=True)
class Sticky:
    """The previous fit: the caller's messages it saw, where its history started, and its rewrites by source."""

    inputs: tuple[Any, ...]
    sys_end: int
    start: int
    # Each rewrite by the id of the caller's message it descends from; the entry holds that message, so the id
    # stays unique while it is remembered.
    rewrites: dict[int, tuple[Message, Message]]
    # What the next fit can take as is when it reads from the same start: the validated messages it read (from
    # ``horizon``), the system items, the fitted history (rewrites applied) and where its request began.
    conversation: Conversation | None = None
    horizon: int = -1
    system: Items = ()
    history: tuple[Items, ...] = ()
    last_user: int = -1
    adopted: bool = False  # taken up from another process's WindowState (its rewrites are not objects here)


@dataclass(frozen=True)
class WindowState:
    """Where a conversation's prompt begins, as another process can take it up: the window start and the rewrites
    a fit re-applies, by position and by tool call id (not by object), so a replica that takes the conversation
    over keeps the boundary where it was and the prompt's prefix, and a server's prefix cache, stay valid.

    ``start``: the caller's index of the first history message kept; ``length`` and ``sys_end``: how many messages
    the fit it comes from saw, and where their system prompt ended; ``fingerprint``: a hash of the messages at
    ``start`` and ``length - 1`` (a list that differs there is another conversation, or an edited one: it is fitted
    from scratch); ``cleared``: the tool calls whose results ``prune_tool_results`` cleared (they stay cleared)."""

    start: int
    length: int
    sys_end: int
    fingerprint: str
    cleared: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "start": self.start,
            "length": self.length,
            "sys_end": self.sys_end,
            "fingerprint": self.fingerprint,
            "cleared": list(self.cleared),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WindowState:
        return cls(
            start=int(data["start"]),
            length=int(data["length"]),
            sys_end=int(data["sys_end"]),
            fingerprint=str(data["fingerprint"]),
            cleared=tuple(str(call) for call in data.get("cleared") or ()),
        )


def _marginal(counter: TokenCounter) -> Callable[[str], int]:
    """Tokens of a snippet for a counter without :class:`TextCounting`: what it adds to a user message."""

    def count(text: str) -> int:
        return int(counter.count([{"role": "user", "content": text}])) - int(
            counter.count([{"role": "user", "content": ""}])
        )

    return count


@dataclass(eq=False)
class Session:
    """What a keeper remembers of one conversation between its fits. Each conversation has its own counters, so
    their incremental state (the renderer's reuse, the segment counts resumed at both ends) follows this chat
    alone, and its own lock, so fits of different conversations run side by side."""

    name: str
    counter: TokenCounter  # counts the long, growing prompt of this conversation
    side: TokenCounter  # counts its small fixed parts (system + request, the report's slots)
    text_tokens: Callable[[str], int]
    text_tokens_many: Callable[[Sequence[str]], list[int]] | None
    text_bound: Callable[[str], int | None] | None
    lock: threading.RLock = field(default_factory=threading.RLock)
    turn: int = 0  # fits made, failed ones included
    horizon: float | None = None  # characters per token the last read needed (None: the policy's)
    rates: Rates = field(default_factory=Rates)  # tool results and calls in the chat's own characters
    # The most characters per token measured on the chat's newest texts (prose, tool results, tool calls), or None:
    # what a trigger may take as certain that a prompt far over the budget is over it, without tokenizing it.
    sparsest: float | None = None
    sticky: Sticky | None = None  # the previous fit, re-applied first when the chat only grew
    previous: Conversation | None = None  # the messages the previous fit validated, reused where unchanged
    paired: tuple[tuple[Message, ...], tuple[Any, ...], list[int]] | None = None  # the last pairing check
    head_slots: tuple[tuple[Message, ...], Any, HeadCounts | None] | None = None  # the system prompt's counts
    # Rewrites handed back as dicts: a flat copy of each (False: not flat, made anew every time).
    dicts: IdentityMemo[Message, dict[str, Any] | bool] | None = None
    last_fit: Fit | None = None
    prompt_text: str | None = None  # the previous fit's prompt as the counter tokenizes it (for its shared prefix)
    prompted: bool = False  # a fit was made (its prompt_text None: not measurable by token ids)
    meter: Any = None  # the counter's prefix meter (contextkeeper.tokens.prefix), found on the first fit
    metered: bool = False
    memory: Memory = field(default_factory=Memory)  # the strategies' own state (FitState.memory)
    adopted: WindowState | None = None  # another process's window, taken up by the next fit (see adopt)

    @classmethod
    def of(cls, name: str, counter: TokenCounter, *, fork: bool) -> Session:
        """A session counting with ``counter``, or with forks of it (same tokenizer and caches, state of their
        own) when ``fork`` is set and the counter can fork."""
        main = counter.fork() if fork and isinstance(counter, Forking) else counter
        side = main.fork() if isinstance(main, Forking) else main
        return cls(
            name=name,
            counter=main,
            side=side,
            text_tokens=main.text_tokens if isinstance(main, TextCounting) else _marginal(main),
            text_tokens_many=main.text_tokens_many if isinstance(main, BatchTextCounting) else None,
            text_bound=main.text_tokens_bound if isinstance(main, TextBounding) else None,
        )

    def forget_inputs(self) -> None:
        """After a failed fit: let go of everything that holds the inputs it read (their validated messages, the
        counters' last prompt), so a refused request is not kept alive until this conversation's next fit. What
        the previous successful fit left (its window, its rewrites) stays."""
        self.previous = None
        self.paired = None
        self.head_slots = None
        for counter in (self.counter, self.side):
            if isinstance(counter, Forgetting):
                counter.forget()

    def window_state(self) -> WindowState | None:
        """This conversation's window start and rewrites, for another process to :meth:`adopt` (None before a fit,
        or after one that fitted from scratch, such as a fresh summary)."""
        sticky = self.sticky
        if sticky is None or not sticky.inputs or sticky.start >= len(sticky.inputs):
            return None
        cleared = self.memory.get(Cleared)
        return WindowState(
            start=sticky.start,
            length=len(sticky.inputs),
            sys_end=sticky.sys_end,
            fingerprint=fingerprint(sticky.inputs, sticky.start, len(sticky.inputs)),
            cleared=tuple(sorted(cleared)) if isinstance(cleared, set) else (),
        )

    def adopt(self, state: WindowState | Mapping[str, Any]) -> None:
        """Take up another process's window (a :class:`WindowState` or its ``to_dict()``): the next fit starts the
        history where that one did, with the same tool results cleared, when the caller's messages still match it."""
        self.adopted = state if isinstance(state, WindowState) else WindowState.from_dict(state)

    def dict_memo(self) -> IdentityMemo[Message, dict[str, Any] | bool]:
        """The rewrites this conversation handed back as dicts, made on first use; an :class:`IdentityMemo`, so
        bounded with every other cache by the shared byte budget."""
        if self.dicts is None:
            # An entry holds the message (a rewrite, counted where the strategies keep it) and a flat dict of it.
            self.dicts = IdentityMemo("keeper.dicts", sizer=lambda message, flat: sys.getsizeof(flat) + 128)
        return self.dicts


class Sessions:
    """The sessions of one keeper by conversation name, the least recently used dropped beyond ``limit`` (a
    dropped conversation's next fit is computed from scratch: slower, never different)."""

    def __init__(self, counter: TokenCounter, limit: int) -> None:
        self._counter = counter
        self._limit = limit
        self._lock = threading.Lock()
        self._by_name: OrderedDict[str, Session] = OrderedDict()

    def get(self, name: str) -> Session:
        with self._lock:
            session = self._by_name.get(name)
            if session is None:
                # The default conversation counts with the keeper's own counter, as a keeper of one chat always
                # has; every other one with forks of it.
                session = Session.of(name, self._counter, fork=name != DEFAULT_CONVERSATION)
                self._by_name[name] = session
                while len(self._by_name) > self._limit:
                    self._by_name.popitem(last=False)
            else:
                self._by_name.move_to_end(name)
            return session

    def drop(self, name: str) -> bool:
        with self._lock:
            return self._by_name.pop(name, None) is not None

    def names(self) -> list[str]:
        with self._lock:
            return list(self._by_name)
