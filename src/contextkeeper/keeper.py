"""ContextKeeper: reserve-then-budget fitting of a conversation into the model's context.

The order is reserve-then-budget: the new request (never trimmed), the answer (``max_tokens``), the tools (as the
template renders them), then history, made to fit by the policy's strategies, cheapest first, and closed by a
sliding window over whole units. Every count is the template's exact count; every fit is checked against its
invariants before it is returned.
"""

from __future__ import annotations

import asyncio
import bisect
import copy
import dataclasses
import inspect
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from ._exceptions import ConfigurationError, ContextKeeperError, MessageError
from ._memo import Memo
from .messages import Conversation, Message, MessageLike, _group_units, _restore_conversation
from .policy import Policy, resolve_policy
from .strategies._turn import compact_turn
from .strategies.base import Action, FitState, Foresight, Item, LLMCall, Unit, run_sync
from .strategies.sliding_window import SlidingWindow
from .tokens import TemplateLimits, TokenCounter, load_counter
from .tokens._incremental import shared_prefix
from .tokens.breakdown import HeadCounts, head_counts, prompt_slots

__all__ = ["ContextKeeper", "Fit", "FitReport", "InvariantViolation", "RequestTooLarge", "Reserve"]


class RequestTooLarge(ContextKeeperError, ValueError):
    """The parts that are never trimmed (system prompt, tools, the new request) plus the answer do not fit.

    ``needed`` is what they take with the answer, ``limit`` the limit that binds (the keeper's, less what a
    wrapped call withheld for the server), ``withheld`` those tokens, ``fix`` what to change."""

    def __init__(self, message: str, *, needed: int, limit: int, withheld: int = 0, fix: str | None = None) -> None:
        self.needed = needed
        self.limit = limit
        self.withheld = withheld
        self.fix = fix
        super().__init__(message)


@dataclass(frozen=True, kw_only=True)
class Reserve:
    """How a fit's reserve below the limit is made up, beyond the answer: ``answer_setting`` names the caller's
    argument that set the answer (None: ``max_tokens``, or the policy's ``answer_tokens`` when none was given);
    ``withheld`` tokens are kept free as well (a wrapped call's learned server limit, hidden tokens...), ``why``
    says what they are for and ``fix`` what frees them. Errors then name the limit that binds."""

    answer_setting: str | None = None
    withheld: int = 0
    why: str = ""
    fix: str = ""


class InvariantViolation(ContextKeeperError, AssertionError):
    """A fit broke one of its guarantees (a bug in a strategy): the fit is refused rather than returned."""


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

    def with_slots(self, change: Callable[[dict[str, int]], dict[str, int]], **fields: Any) -> FitReport:
        """A copy with ``fields`` replaced and the slots passed through ``change`` (still counted when read)."""
        return dataclasses.replace(self, _breakdown=self._breakdown.then(change), **fields)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {}
        for item in dataclasses.fields(self):
            if item.name == "_breakdown":
                continue
            data[item.name] = getattr(self, item.name)
            if item.name == "tokens_before":
                data.update(slots=self.slots, history_before=self.history_before, history_after=self.history_after)
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


def _role(message: Any) -> str:
    role = message.get("role") if isinstance(message, dict) else getattr(message, "role", None)
    return str(role) if role is not None else ""


def _chars(message: Any) -> int:
    content = message.get("content") if isinstance(message, dict) else getattr(message, "content", None)
    if isinstance(content, str):
        size = len(content)
    elif isinstance(content, list):
        size = sum(len(str(part.get("text", ""))) if isinstance(part, dict) else 16 for part in content)
    else:
        size = 0
    calls = message.get("tool_calls") if isinstance(message, dict) else getattr(message, "tool_calls", None)
    return size + (len(str(calls)) if calls else 0)


def _assemble(units: Sequence[Unit]) -> Conversation:
    """A Conversation of already validated units, without validating them again (the counter takes it as is).
    Strategies keep each unit's shape (a rewritten tool result keeps its call id), and the fit is validated
    at the end by the invariant check; the units are grouped only if a counter asks for them."""
    messages = tuple([item.message for unit in units for item in unit])
    size = len(messages)
    formats = cast(tuple[Literal["message"], ...], ("message",) * size)
    return _restore_conversation(messages, formats, (None,) * size)


def _text_counter(counter: Any) -> Any:
    method = getattr(counter, "text_tokens", None)
    if method is not None:
        return method

    def marginal(text: str) -> int:  # any counter: what the text adds to a user message
        return int(counter.count([{"role": "user", "content": text}])) - int(
            counter.count([{"role": "user", "content": ""}])
        )

    return marginal


async def _awaited(value: Awaitable[Any]) -> Any:
    return await value


class _LazyRoles:
    """The messages' roles, read only when asked for (a fit on the sticky path never needs most of them)."""

    def __init__(self, messages: Sequence[Any]) -> None:
        self._messages = messages

    def __getitem__(self, index: int) -> str:
        return _role(self._messages[index])


@dataclass(frozen=True)
class _Sticky:
    """The previous fit: the caller's messages it saw, where its history started, and its rewrites by source."""

    inputs: tuple[Any, ...]
    sys_end: int
    start: int
    rewrites: dict[int, tuple[Message, Message]]
    # What the next fit can take as is when it reads from the same start: the validated messages it read (from
    # ``horizon``), the system items, the fitted history (rewrites applied) and where its request began.
    conversation: Conversation | None = None
    horizon: int = -1
    system: Unit = ()
    history: tuple[Unit, ...] = ()
    last_user: int = -1


DEFAULT_CONVERSATION = "default"


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
    sticky: _Sticky | None = None  # the previous fit, re-applied first when the chat only grew
    previous: Conversation | None = None  # the messages the previous fit validated, reused where unchanged
    paired: tuple[tuple[Message, ...], tuple[Any, ...], list[int]] | None = None  # the last pairing check
    head_slots: tuple[tuple[Message, ...], Any, HeadCounts | None] | None = None  # the system prompt's counts
    dicts: Memo[int, tuple[Message, dict[str, Any] | None]] | None = None  # rewrites handed back as dicts
    last_fit: Fit | None = None
    memory: dict[str, Any] = field(default_factory=dict)  # the strategies' own state (FitState.memory)

    @classmethod
    def of(cls, name: str, counter: TokenCounter, *, fork: bool) -> Session:
        """A session counting with ``counter``, or with forks of it (same tokenizer and caches, state of their
        own) when ``fork`` is set and the counter can fork."""
        make = getattr(counter, "fork", None)
        main = make() if fork and callable(make) else counter
        make = getattr(main, "fork", None)
        side = make() if callable(make) else main
        return cls(
            name=name,
            counter=main,
            side=side,
            text_tokens=_text_counter(main),
            text_tokens_many=getattr(main, "text_tokens_many", None),
            text_bound=getattr(main, "text_tokens_bound", None),
        )


class _Sessions:
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


class ContextKeeper:
    """Fits conversations into a model's context, exactly.

    ``tokenizer``: a tokenizer folder, a .gguf file, a hub id, ``mistral:<name>``, a transformers tokenizer or a
    ready :class:`TokenCounter`. The limit is the smallest of ``context_window``, the model's own maximum (when
    ``model`` is given) and, with ``gpu``, the longest context per sequence that fits at ``concurrency``.
    ``template_limits`` bounds what the chat template may do per render (a :class:`TemplateLimits`: steps,
    output, seconds, nesting); a template past a bound is refused with :class:`TemplateLimitExceeded`.
    ``policy``: a built-in name, a .toml file, a :class:`Policy`, or ``"auto"`` to match by model name.
    ``summarizer``: a callable taking an :class:`LLMCall` and returning text, for the summarize strategy.

    Wrapped calls (:meth:`wrap`): ``transcript`` (None: in memory; a path: a SQLite file) keeps everything sent
    and received; ``admission`` ("wait" or "shrink") and ``admission_timeout`` decide what a call does when
    the calls in flight already hold the KV capacity, which is ``kv_capacity`` tokens when given (a server's
    own figure, e.g. vLLM's "GPU KV cache size") or else planned from ``model`` and ``gpu`` at ``concurrency``;
    ``monitor`` (a :class:`~contextkeeper.diagnose.MemoryMonitor`) is sampled after every call.
    """

    def __init__(
        self,
        tokenizer: Any = None,
        *,
        context_window: int | None = None,
        chat_template: str | None = None,
        template_limits: TemplateLimits | None = None,
        policy: str | Policy | None = "default",
        model: Any = None,
        gpu: Any = None,
        concurrency: int = 1,
        runtime: str = "vllm",
        kv_dtype: str = "auto",
        summarizer: Any = None,
        conversations: int = 1024,
        transcript: Any = None,
        admission: Literal["wait", "shrink"] = "wait",
        admission_timeout: float = 30.0,
        kv_capacity: int | None = None,
        monitor: Any = None,
    ) -> None:
        if tokenizer is None:
            raise ConfigurationError(
                "ContextKeeper needs tokenizer=... (a folder, .gguf file, hub id or mistral:<name>)"
            )
        self.counter: TokenCounter = self._counter(tokenizer, chat_template, template_limits)
        self.name = str(getattr(self.counter, "name", tokenizer))
        self.model = None
        limits: list[tuple[int, str]] = []
        if context_window is not None:
            if isinstance(context_window, bool) or not isinstance(context_window, int) or context_window <= 0:
                raise ConfigurationError(f"context_window must be a positive integer, got {context_window!r}")
            limits.append((context_window, "context_window"))
        if model is not None:
            from .memory import ModelSpec

            self.model = model if isinstance(model, ModelSpec) else ModelSpec.from_config(model)
            if self.model.max_context:
                limits.append((self.model.max_context, f"the model's maximum context ({self.model.name})"))
            if gpu is not None:
                from .memory import plan

                wanted = min(n for n, _ in limits)
                result = plan(
                    self.model, gpu, context=wanted, concurrency=concurrency, runtime=runtime, kv_dtype=kv_dtype
                )
                limits.append(
                    (
                        result.context_limit(),  # says why, when not even one token fits
                        f"the GPU ({result.gpu}, {runtime}, {concurrency} concurrent sequence(s))",
                    )
                )
        elif gpu is not None:
            raise ConfigurationError("gpu=... needs model=... too (the KV cache per token comes from the model config)")
        if not limits:
            raise ConfigurationError("set context_window=N (or model=... so the model's maximum context applies)")
        self.limit, self.limit_source = min(limits, key=lambda pair: pair[0])
        if self.limit <= 0:
            raise ConfigurationError(f"no context fits: {self.limit_source} allows 0 tokens; use fewer sequences")
        self.policy = resolve_policy(policy, self.model.name if self.model else self.name)
        self.pipeline = self.policy.pipeline()
        self.summarizer = summarizer
        if isinstance(conversations, bool) or not isinstance(conversations, int) or conversations < 1:
            raise ConfigurationError(
                f"conversations must be a whole number >= 1 (the sessions a keeper remembers), got {conversations!r}"
            )
        self.conversations = conversations
        self._sessions = _Sessions(self.counter, conversations)
        self.last_fit: Fit | None = None  # the latest fit of any conversation
        # Wrapped calls (see wrap): what they share, made on first use.
        self.gpu, self.concurrency, self.runtime, self.kv_dtype = gpu, concurrency, runtime, kv_dtype
        from .transcript import check_transcript

        self._call_settings = {
            "transcript": cast(Any, check_transcript(transcript)),  # a bad value fails here, not at the first call
            "admission": admission,
            "timeout": admission_timeout,
            "capacity": kv_capacity,
        }
        self.monitor = monitor
        self.last_call: Any = None
        self._calls: Any = None

    def fresh(self) -> ContextKeeper:
        """The same keeper (counter, limit, policy, summarizer) without memory of earlier fits: the next fit is
        computed from scratch, whatever this keeper fitted before."""
        clone = copy.copy(self)
        clone._sessions = _Sessions(self.counter, self.conversations)
        clone.last_fit = None
        clone.last_call = None
        clone._calls = None
        return clone

    @staticmethod
    def _counter(tokenizer: Any, chat_template: str | None, limits: TemplateLimits | None) -> TokenCounter:
        if isinstance(tokenizer, str):
            return load_counter(tokenizer, chat_template=chat_template, template_limits=limits)
        if hasattr(tokenizer, "apply_chat_template"):
            from .tokens import HFChatTemplateCounter

            return HFChatTemplateCounter(tokenizer, chat_template=chat_template, template_limits=limits)
        if callable(getattr(tokenizer, "count", None)):
            if chat_template is not None or limits is not None:
                raise ConfigurationError(
                    "chat_template= and template_limits= apply when the keeper builds the counter; this tokenizer is "
                    "a ready counter. Fix: pass them to the counter itself (load_counter(..., chat_template=..., "
                    "template_limits=...)) or pass the tokenizer instead"
                )
            return tokenizer  # type: ignore[no-any-return]
        raise ConfigurationError(
            "tokenizer must be a spec string, a transformers tokenizer or a TokenCounter, got "
            f"{type(tokenizer).__name__}"
        )

    # ------------------------------------------------------------------------------------------ fit
    def fit(
        self,
        messages: Sequence[MessageLike],
        *,
        tools: Sequence[Any] | None = None,
        max_tokens: int | None = None,
        reserve: Reserve | None = None,
        conversation: str | None = None,
    ) -> Fit:
        """The longest prompt that fits with ``max_tokens`` reserved for the answer, keeping what matters.
        ``reserve``: tokens to keep free beyond the answer, and why (wrapped calls pass what they learned).
        ``conversation``: which chat this is (default: one implicit conversation). Each conversation has its
        own session, so a turn of one costs what it costs alone, whatever other chats the keeper fits between;
        fits of different conversations run in parallel."""
        started = time.perf_counter()
        if conversation is not None and (not isinstance(conversation, str) or not conversation):
            raise ConfigurationError(
                f"conversation must be a non-empty string naming the chat, got {conversation!r}. Fix: pass an id "
                "such as conversation='user-42', or leave it out for the keeper's one default conversation"
            )
        session = self._sessions.get(conversation or DEFAULT_CONVERSATION)
        with session.lock:
            fit = self._fit(session, messages, tools, max_tokens, reserve, started)
            session.last_fit = fit
        self.last_fit = fit
        return fit

    def sessions(self) -> list[str]:
        """The conversations this keeper remembers, the least recently fitted first."""
        return self._sessions.names()

    def forget(self, conversation: str | None = None) -> bool:
        """Drop what the keeper remembers of ``conversation`` (default: the default one); True if it had any."""
        return self._sessions.drop(conversation or DEFAULT_CONVERSATION)

    def _fit(
        self,
        session: Session,
        messages: Sequence[MessageLike],
        tools: Sequence[Any] | None,
        max_tokens: int | None,
        reserve: Reserve | None,
        started: float,
    ) -> Fit:
        answer = self.policy.answer_tokens if max_tokens is None else max_tokens
        if isinstance(answer, bool) or not isinstance(answer, int) or answer <= 0:
            raise ConfigurationError(f"max_tokens must be a positive integer, got {answer!r}")
        reserve = reserve if reserve is not None else Reserve()
        if isinstance(reserve.withheld, bool) or not isinstance(reserve.withheld, int) or reserve.withheld < 0:
            raise ConfigurationError(f"reserve.withheld must be an integer >= 0, got {reserve.withheld!r}")
        # What the reserve is made of, so an error names the limit and the setting that bind.
        made_of = (reserve, max_tokens is None)
        answer += reserve.withheld
        if not isinstance(messages, (list, tuple)):
            raise MessageError(
                f"expected a list of messages, got {type(messages).__name__}",
                index=None,
                fix="pass a list such as [{'role': 'user', 'content': '...'}]",
            )
        # The counter's own copy of the schemas when it makes one: compared with the caller's once per fit, not
        # once per count.
        freeze = getattr(session.counter, "freeze_tools", None)
        tool_list = (freeze(tools) if callable(freeze) else list(tools)) if tools else None
        sys_end = 0
        while sys_end < len(messages) and _role(messages[sys_end]) in ("system", "developer"):
            sys_end += 1
        last_user = next(
            (i for i in range(len(messages) - 1, sys_end - 1, -1) if _role(messages[i]) == "user"), len(messages)
        )
        roles = _LazyRoles(messages)
        # Read history back to the horizon; when strategies (pruning, summaries) leave room and older history was
        # left unread, read further (in proportion to what the first read yielded) and fit again. The keeper
        # remembers how far it had to read.
        per_token = self.policy.horizon if session.horizon is None else session.horizon
        prompt_limit = self.limit - answer
        sticky = self._sticky(session, messages, sys_end, last_user)

        def further(tokens: int, unread: int) -> float | None:
            """How far the next read goes (characters per token), or None when this read is the fit."""
            if sticky is not None or not unread or not per_token or tokens >= 0.9 * prompt_limit:
                return None
            # Read further back in proportion to what this read yielded after the strategies (older history is
            # assumed to shrink alike), a little beyond the budget so the window has whole turns to choose from
            # (between 1.25 and 4 times as far).
            return per_token * min(4.0, max(1.25, 1.1 * prompt_limit / max(tokens, 1)))

        try:
            for attempt in range(6):
                result = self._fit_once(
                    session,
                    messages,
                    roles,
                    sys_end,
                    last_user,
                    answer,
                    tool_list,
                    per_token,
                    started,
                    sticky,
                    further if attempt < 5 else None,
                    made_of,
                )
                if isinstance(result, Fit):
                    fit = result
                    break
                per_token = result
        finally:
            # Every fit is a turn, failed or not: per-turn budgets (the summarizer's calls) start afresh.
            session.turn += 1
        if per_token:
            session.horizon = per_token
        return fit

    @staticmethod
    def _sticky(session: Session, messages: Sequence[Any], sys_end: int, last_user: int) -> _Sticky | None:
        """The previous fit's window start and rewrites, when ``messages`` grew from the list it fitted (the same
        objects up to its end): re-applying them first keeps the prompt's prefix stable from turn to turn, so the
        counter (and a server's prefix cache) reuse it, and a turn that still fits needs no strategy at all."""
        previous = session.sticky
        if previous is None or previous.sys_end != sys_end or len(messages) < len(previous.inputs):
            return None
        if previous.start >= last_user:
            return None
        if shared_prefix(previous.inputs, messages) != len(previous.inputs):
            return None  # the caller edited or replaced earlier messages: fit from scratch
        return previous

    @staticmethod
    def _units(
        conversation: Conversation, sticky: _Sticky | None, sys_end: int, horizon: int, last_user: int
    ) -> tuple[Unit, list[Unit], Unit]:
        """System, history units and request of ``conversation`` (the caller's messages ``[:sys_end]`` and
        ``[horizon:]``), with the previous fit's rewrites re-applied."""
        origins = [*range(sys_end), *range(horizon, horizon + len(conversation) - sys_end)]
        items = [Item(message, index) for message, index in zip(conversation.messages, origins, strict=True)]
        system: Unit = tuple(items[:sys_end])
        request: Unit = tuple(item for item in items[sys_end:] if item.origin is not None and item.origin >= last_user)
        history: list[Unit] = []
        for unit in conversation.units():
            unit_items = tuple(items[i] for i in unit.indices)
            if unit_items and unit_items[0].origin is not None and sys_end <= unit_items[0].origin < last_user:
                history.append(unit_items)
        if history and history[0][0].role != "user" and horizon > sys_end:
            history = history[1:]  # the horizon always starts history on a user turn
        if sticky is not None and sticky.rewrites:
            rewrites = sticky.rewrites
            history = [
                tuple(
                    Item(rewrites[id(i.message)][1], None, i.message)
                    if id(i.message) in rewrites and rewrites[id(i.message)][0] is i.message
                    else i
                    for i in unit
                )
                for unit in history
            ]
        return system, history, request

    @staticmethod
    def _grown(
        conversation: Conversation, sticky: _Sticky | None, sys_end: int, horizon: int, last_user: int
    ) -> tuple[Unit, list[Unit], Unit] | None:
        """What :meth:`_units` returns, built from the previous fit when the chat only grew since: its fitted
        history (every rewrite already applied) plus the units that arrived, so a turn costs what it added.

        Taken only when the previous fit read from the same start and its validated messages are the very
        first ones of ``conversation``; then rebuilding would give equal items and units (the previous fit's
        request, never rewritten, becomes history as it is). None: build from scratch."""
        previous = sticky.conversation if sticky is not None else None
        if sticky is None or previous is None or sticky.horizon != horizon or not sticky.history:
            return None
        if sum(map(len, sticky.history)) != sticky.last_user - horizon:
            return None  # the previous history is not every message from its start to its request
        messages = conversation.messages
        if len(messages) < len(previous) or shared_prefix(messages, previous.messages) != len(previous):
            return None
        # Positions in ``conversation`` of the previous request's first message and this one's.
        offset = sys_end - horizon
        first_new = sticky.last_user + offset
        first_request = last_user + offset
        if not sys_end <= first_new <= first_request <= len(messages):
            return None
        units = conversation.units()
        added: list[Unit] = []
        request_items: list[Item] = []
        for unit in reversed(units):
            if unit.start < first_new:
                if unit.stop > first_new:
                    return None  # a unit across the old request's start: the shapes differ, build anew
                break
            unit_items = tuple(
                Item(message, index - offset) for index, message in zip(unit.indices, unit.messages, strict=True)
            )
            if unit.start >= first_request:
                request_items[:0] = unit_items
            elif unit.stop > first_request:
                return None
            else:
                added.append(unit_items)
        added.reverse()
        return sticky.system, [*sticky.history, *added], tuple(request_items)

    def _fit_once(
        self,
        session: Session,
        messages: Sequence[MessageLike],
        roles: _LazyRoles,
        sys_end: int,
        last_user: int,
        answer: int,
        tool_list: list[Any] | None,
        per_token: float,
        started: float,
        sticky: _Sticky | None = None,
        further: Callable[[int, int], float | None] | None = None,
        reserve: tuple[Reserve, bool] = (Reserve(), False),
    ) -> Fit | float:
        """One read and fit; or, when ``further`` says this read was too short, how far the next read goes (the
        checks and the report are left to the read that is kept)."""
        if sticky is not None:
            horizon = sticky.start
        else:
            horizon = self._horizon(messages, roles, sys_end, last_user, answer, per_token)
        selected = [*messages[:sys_end], *messages[horizon:]]
        conversation = Conversation.from_messages(selected, previous=session.previous)
        session.previous = conversation
        built = self._grown(conversation, sticky, sys_end, horizon, last_user)
        if built is not None:
            system, history, request = built
        else:
            system, history, request = self._units(conversation, sticky, sys_end, horizon, last_user)

        counted: dict[tuple[int, ...], tuple[tuple[Unit, ...], int]] = {}
        # The same, by the tuple itself: a state's own history, asked for again, is found without a pass over its
        # units (tuples only: a list may change between two calls). The entry holds the tuple, so its id is not
        # reused while it lives.
        by_object: dict[int, tuple[tuple[Unit, ...], int]] = {}

        def known(units: Sequence[Unit]) -> int | None:
            hit = by_object.get(id(units))
            if hit is not None and hit[0] is units:
                return hit[1]
            entry = counted.get(tuple(map(id, units)))
            if entry is None or shared_prefix(entry[0], units) != len(units):
                return None
            if type(units) is tuple:
                by_object[id(units)] = (units, entry[1])
            return entry[1]

        def count(units: Sequence[Unit]) -> int:
            # Strategies and triggers ask for the same history more than once: count each distinct one once. The
            # entry holds the units, so their ids cannot be reused by other tuples while it lives.
            if not units:
                return base_tokens()
            tokens = known(units)
            if tokens is None:
                tokens = int(session.counter.count(_assemble((system, *units, request)), tools=tool_list))
                counted[tuple(map(id, units))] = (tuple(units), tokens)
                if type(units) is tuple:
                    by_object[id(units)] = (units, tokens)
            return tokens

        def peek(units: Sequence[Unit]) -> int | None:
            return fixed[0] if not units else known(units)

        prompt_limit = self.limit - answer
        compacted: tuple[Action, ...] = ()
        # The never-trimmed parts: exactly counted only when a bound found without tokenizing does not already
        # show they fit (the report counts them when it is read). A chat that grew from the last fit is counted
        # whole first, as the first trigger would count it anyway: when it fits, its request fits too, and that
        # needs no other count (or render) at all.
        if built is not None and history and count(history) <= prompt_limit:
            base = None
        else:
            base = self._fixed_tokens(session, system, request, tool_list, prompt_limit)
        if base is not None and base > prompt_limit:
            # An agent loop's current turn (one user message, many tool rounds) alone is over the budget: its
            # older rounds give way before the fit is refused; the user's message and the last round stay.
            turn = compact_turn(
                request,
                lambda r: self._side_count(session, _assemble((system, r)), tool_list) <= prompt_limit,
            )
            if turn is None:
                raise self._too_large(session, base, answer, system, request, tool_list, reserve)
            request, action = turn
            base = None
            compacted = (action,)
        fixed: list[int | None] = [base]

        def base_tokens() -> int:
            known = fixed[0]
            if known is None:
                known = fixed[0] = self._side_count(session, _assemble((system, request)), tool_list)
            return known

        query = "\n".join(item.text() for item in request if item.role == "user")
        state = FitState(
            system=system,
            history=tuple(history),
            request=request,
            limit=prompt_limit,
            count=count,
            peek=peek,
            text_tokens=session.text_tokens,
            text_tokens_many=session.text_tokens_many,
            text_bound=session.text_bound,
            query=query,
            turn=session.turn,
            actions=compacted,
            memory=session.memory,
        )
        initial = state.history
        for strategy, trigger in self.pipeline:
            if getattr(strategy, "needs_backend", False) and self.summarizer is None:
                continue  # a summarising step without a summarizer: the sliding window covers it
            if trigger(state):
                state = run_sync(strategy, state, self._backend())
        state = run_sync(SlidingWindow(after_cut=sticky is None and horizon > sys_end), state)
        tokens = state.tokens()
        wider = further(tokens, horizon - sys_end) if further is not None else None
        if wider is not None:
            return wider
        final = [item for unit in (system, *state.history, request) for item in unit]
        # Exact when some step counted the history as it came in; None when none had to (it was clearly over the
        # budget, and tokenizing text about to be dropped would only cost time).
        before = peek(initial) if horizon <= sys_end else None
        self._check(session, final, tokens, prompt_limit, system, request, messages)
        # Only a fit that kept its guarantees is built on by the next one.
        self._remember(
            session,
            messages,
            sys_end,
            state.history,
            last_user,
            system=system,
            conversation=conversation,
            horizon=horizon,
        )
        out = self._caller_format(session, final, conversation, sys_end, horizon, messages)

        def breakdown() -> tuple[dict[str, int], int | None, int]:
            # Read perhaps on another thread, while the session fits again: its lock keeps the side counter's
            # incremental state to one count at a time.
            with session.lock:
                fixed_tokens = base_tokens()
                slots = self._slots(session, system, request, tool_list, fixed_tokens, tokens, answer)
            return slots, (before - fixed_tokens) if before is not None else None, tokens - fixed_tokens

        report = FitReport(
            limit=self.limit,
            limit_source=self.limit_source,
            max_tokens=answer,
            tokens=tokens,
            tokens_before=before,
            messages_before=len(messages),
            messages_after=len(out),
            unread=horizon - sys_end,
            actions=state.actions,
            seconds=time.perf_counter() - started,
            policy=self.policy.name,
            notes=(f"{horizon - sys_end} older message(s) beyond the horizon were dropped unread",)
            if horizon > sys_end
            else (),
            _breakdown=_Breakdown(breakdown),
        )
        return Fit(messages=out, tokens=tokens, report=report)

    @staticmethod
    def _side_count(session: Session, messages: Conversation, tools: list[Any] | None) -> int:
        return int(session.side.count(messages, tools=tools))

    def _fixed_tokens(
        self, session: Session, system: Unit, request: Unit, tools: list[Any] | None, prompt_limit: int
    ) -> int | None:
        """The exact tokens of the system prompt, the request and the tools, or None when an upper bound found
        without tokenizing (the rendered prompt's UTF-8 length, for byte-level BPE) already shows they fit."""
        fixed = _assemble((system, request))
        bound = getattr(session.side, "bound", None)
        most = bound(fixed, tools=tools) if callable(bound) else None
        if most is not None and most <= prompt_limit:
            return None
        return self._side_count(session, fixed, tools)

    @staticmethod
    def _remember(
        session: Session,
        messages: Sequence[Any],
        sys_end: int,
        history: Sequence[Unit],
        request: int,
        *,
        system: Unit = (),
        conversation: Conversation | None = None,
        horizon: int = -1,
    ) -> None:
        """Keep what the next fit re-applies first: the window start and each rewrite by its source."""
        anchors = [item.origin for item in history[0] if item.origin is not None] if history else []
        # A history that extends the previous one (the very same units first: a chat that grew) adds only its new
        # units' rewrites to the previous ones.
        previous = session.sticky
        shared = 0
        rewrites: dict[int, tuple[Message, Message]] = {}
        if previous is not None and previous.history:
            shared = shared_prefix(history, previous.history)
            if shared == len(previous.history):
                rewrites = dict(previous.rewrites)
            else:
                shared = 0
        added = history[shared:]
        made_up = any(item.origin is None and item.source is None for unit in added for item in unit)
        if made_up or (history and not anchors):
            session.sticky = None  # a summary or other unit without a source: fit from scratch next time
            return
        rewrites.update(
            (id(item.source), (item.source, item.message)) for unit in added for item in unit if item.source is not None
        )
        # No history kept: the window starts at this fit's request, which the next turn keeps as history.
        start = anchors[0] if anchors else request
        session.sticky = _Sticky(
            inputs=tuple(messages),
            sys_end=sys_end,
            start=start,
            rewrites=rewrites,
            conversation=conversation,
            horizon=horizon,
            system=system,
            history=tuple(history),
            last_user=request,
        )

    def _backend(self) -> Any:
        if self.summarizer is None:
            return None
        summarizer = self.summarizer

        def call(request: LLMCall) -> str:
            reply = summarizer(request)
            if inspect.isawaitable(reply):  # an async summarizer, reached from a wrapped async call's worker thread
                from .backends.calls import CALLER_LOOP

                loop = CALLER_LOOP.get()
                if loop is None:
                    return str(asyncio.run(_awaited(reply)))
                return str(asyncio.run_coroutine_threadsafe(_awaited(reply), loop).result())
            return str(reply)

        return call

    def _horizon(
        self, messages: Sequence[Any], roles: _LazyRoles, sys_end: int, last_user: int, answer: int, per_token: float
    ) -> int:
        """The first history message worth reading: older units cannot fit even at ``per_token`` characters per
        token, so they are dropped without being validated or tokenized. 0 characters per token: read all.

        A message's characters are what the pipeline's strategies expect to leave of it (see ``Foresight``): old
        tool results about to be cleared take little room, so the read goes back far enough to fill the budget
        after they are."""
        if not per_token:
            return sys_end
        foresight = [strategy for strategy, _ in self.pipeline if isinstance(strategy, Foresight)]
        budget = (self.limit - answer) * per_token
        used = 0
        results = 0  # tool results of history newer than the message at ``index``
        horizon = last_user
        for index in range(last_user - 1, sys_end - 1, -1):
            role = roles[index]
            chars = _chars(messages[index])
            for strategy in foresight:
                chars = strategy.kept_chars(role, chars, results)
            used += chars
            results += role == "tool"
            if role == "user":
                if used > budget and horizon < last_user:
                    break
                horizon = index
        else:
            return sys_end
        return horizon

    def _too_large(
        self,
        session: Session,
        base: int,
        answer: int,
        system: Unit,
        request: Unit,
        tools: list[Any] | None,
        made_of: tuple[Reserve, bool],
    ) -> RequestTooLarge:
        # ``answer`` is the whole reserve: the answer itself plus what the fit's Reserve withheld.
        reserve, from_policy = made_of
        withheld = min(reserve.withheld, answer)
        answer -= withheld
        limit = self.limit - withheld
        over = base + answer - limit
        without_tools = int(session.side.count([i.message for i in (*system, *request)])) if tools else base
        if reserve.answer_setting:
            lower = f"lower {reserve.answer_setting}"
        elif from_policy:
            lower = f"lower answer_tokens in the policy ({self.policy.name!r}) or pass a smaller max_tokens"
        else:
            lower = "lower max_tokens"
        trims = "send fewer or shorter tool schemas, shorten the request or the system prompt"
        if withheld:
            where = (
                f"the limit of {limit:,}: the keeper's {self.limit:,} ({self.limit_source}) less {withheld:,} "
                f"withheld ({reserve.why or 'for this call'})"
            )
            fix = f"{lower}, {trims}, or {reserve.fix or 'raise the limit that binds'}"
        else:
            where = f"the limit of {self.limit:,} ({self.limit_source})"
            fix = (
                f"{lower}, {trims}, or raise context_window (a model with a longer context, or fewer concurrent "
                "sequences on the GPU)"
            )
        return RequestTooLarge(
            f"the parts that are never trimmed need {base:,} tokens (tools {base - without_tools:,}; system prompt, "
            f"new request and template {without_tools:,}) plus {answer:,} reserved for the answer: {over:,} over "
            f"{where}. Fix: {fix}",
            needed=base + answer,
            limit=limit,
            withheld=withheld,
            fix=fix,
        )

    def _check(
        self,
        session: Session,
        final: list[Item],
        tokens: int,
        prompt_limit: int,
        system: Unit,
        request: Unit,
        original: Sequence[Any],
    ) -> None:
        """The guarantees of every fit; a violation is a bug, so the fit is refused."""
        problems = []
        if tokens > prompt_limit:
            problems.append(f"{tokens} prompt tokens exceed the {prompt_limit} available")
        if any(item.origin != i for i, item in enumerate(system)):
            problems.append("the system prompt was changed")
        # The user's message and the round the model must answer stay verbatim; older rounds of the same turn may
        # be compacted (each rewrite keeps its source) only when the turn alone was over the budget.
        if request and (request[0].origin is None or request[-1].origin is None):
            problems.append("the new request was changed")
        if any(item.origin is None and item.source is None for item in request):
            problems.append("the new request was changed")
        origins = [item.origin for item in final if item.origin is not None]
        if origins != sorted(origins) or len(set(origins)) != len(origins):
            problems.append("messages were reordered or repeated")
        try:
            self._paired(session, tuple([item.message for item in final]))
        except MessageError as exc:
            problems.append(f"the fitted conversation is not valid: {exc}")
        if problems:
            raise InvariantViolation("fit invariant broken: " + "; ".join(problems))

    @staticmethod
    def _paired(session: Session, messages: tuple[Message, ...]) -> None:
        """Raise as ``Conversation.from_messages(messages)`` would when tool calls and results do not pair up.

        The messages are validated Message objects, so the check is their grouping into units. Units of the
        previous fit's prompt that lie in the prefix this one shares with it (the very same objects) are
        grouped already; grouping resumes at the last of them, which may have grown."""
        known = session.paired
        start, prefix = 0, ()
        if known is not None:
            old, units, starts = known
            shared = shared_prefix(messages, old)
            last = bisect.bisect_left(starts, shared) - 1  # the last unit that starts in the shared prefix
            if shared and last >= 0:
                start, prefix = starts[last], units[:last]
        grouped = prefix + _group_units(messages, start)
        session.paired = (messages, grouped, [unit.start for unit in grouped])

    def _caller_format(
        self,
        session: Session,
        final: list[Item],
        conversation: Conversation,
        sys_end: int,
        horizon: int,
        original: Sequence[Any],
    ) -> list[Any]:
        # ``conversation`` holds the caller's messages [:sys_end] and [horizon:], in that order.
        shift = sys_end - horizon
        formats = conversation._formats
        out: list[Any] = []
        dicts = not formats or formats[0] == "dict"
        for item in final:
            if item.origin is not None:
                fmt = formats[item.origin if item.origin < sys_end else item.origin + shift]
                source = original[item.origin]
                if fmt == "dict":
                    # An unchanged plain dict goes back as the caller's own object (equal to itself, and free);
                    # other mappings as a new plain dict.
                    out.append(source if type(source) is dict else item.message.to_dict())
                elif fmt == "object":
                    out.append(original[item.origin])
                else:
                    out.append(item.message)
            else:
                out.append(self._new_dict(session, item.message) if dicts else item.message)
        return out

    @staticmethod
    def _new_dict(session: Session, message: Message) -> dict[str, Any]:
        """``message.to_dict()``: a new dict every time (the caller may change it), copied from a remembered one
        when every value is an immutable scalar (a cleared tool result, a marker), which is cheaper."""
        cache = session.dicts
        if cache is None:  # a Memo: bounded, with every other cache, by the shared byte budget
            # The entry holds the message (a rewrite, counted where the strategies keep it) and a flat dict of it
            # (new, its strings the message's own).
            cache = session.dicts = Memo("keeper.dicts", sizer=lambda key, entry: sys.getsizeof(entry[1]) + 128)
        entry = cache.get(id(message))
        if entry is None or entry[0] is not message:
            data = message.to_dict()
            flat = all(value is None or type(value) in (str, int, float, bool) for value in data.values())
            cache.put(id(message), (message, dict(data) if flat else None))  # holds the message: its id stays unique
            return data
        return dict(entry[1]) if entry[1] is not None else message.to_dict()

    @staticmethod
    def _slots(
        session: Session, system: Unit, request: Unit, tools: list[Any] | None, base: int, tokens: int, answer: int
    ) -> dict[str, int]:
        """Tokens per slot in prompt order (:func:`~contextkeeper.tokens.breakdown.prompt_slots`, the model
        ``breakdown`` and the CLI's ``count`` use too), then the answer. Only the small lists are counted."""
        head = [i.message for i in system]
        # The system prompt's own counts: taken once while it and the tools stay the same objects (the entry
        # holds them, so their ids are not reused).
        known = session.head_slots
        if (
            known is None
            or known[1] is not tools
            or len(known[0]) != len(head)
            or shared_prefix(known[0], head) != len(head)
        ):
            known = session.head_slots = (tuple(head), tools, head_counts(session.side.count, head, tools))
        asked = [i.message for i in request]
        slots = prompt_slots(session.side.count, head, asked, tools, total=tokens, base=base, head=known[2])
        return {**slots, "answer": answer}

    def count(self, messages: Sequence[MessageLike], *, tools: Sequence[Any] | None = None) -> int:
        """The exact prompt tokens of ``messages`` as given (no fitting)."""
        return int(self.counter.count(messages, tools=list(tools) if tools else None))

    # ------------------------------------------------------------------------------------ wrapped calls
    def wrap(self, client: Any, **options: Any) -> Any:
        """``client`` with its own call shape, every call fitted first: an ``openai.OpenAI`` / ``AsyncOpenAI``
        (``client.chat.completions.create(...)``, streams included), a transformers model (with
        ``tokenizer=...``) or text-generation pipeline, or a callable ``fn(messages, **kwargs)``, sync or async.
        The client itself is never patched. Options: ``attempts`` (calls per request, default 4), ``backoff``
        (seconds before the first transport retry), ``conversation`` (the transcript key)."""
        from .backends import wrap

        return wrap(self, client, **options)

    def _make_calls(self) -> Any:
        from .backends.calls import Calls
        from .ledger import Ledger, capacity_from_plan
        from .transcript import open_transcript

        settings = self._call_settings
        capacity = settings["capacity"]
        source = "kv_capacity" if capacity is not None else None
        if capacity is None and self.model is not None and self.gpu is not None:
            capacity = capacity_from_plan(
                self.model, self.gpu, concurrency=self.concurrency, runtime=self.runtime, kv_dtype=self.kv_dtype
            )
            source = "planned"
        calls = Calls(
            keeper=self,
            ledger=Ledger(capacity, mode=settings["admission"], timeout=settings["timeout"], source=source),
            transcript=open_transcript(settings["transcript"]),
        )
        self._calls = calls
        return calls

    @property
    def transcript(self) -> Any:
        """Everything wrapped calls sent and received, and what each fit dropped or rewrote."""
        from .backends.calls import calls_of

        return calls_of(self).transcript

    @property
    def ledger(self) -> Any:
        """The active tokens of wrapped calls in flight (admission against the GPU's KV capacity)."""
        from .backends.calls import calls_of

        return calls_of(self).ledger

    def kv_bytes(self, tokens: int) -> tuple[int | None, float | None]:
        """The KV cache ``tokens`` take for one sequence on the keeper's runtime, and their share of the GPU's KV
        capacity (None without a model, or without a GPU for the share)."""
        if self.model is None:
            return None, None
        from .memory import kv_report

        size = kv_report(self.model, tokens, runtime=self.runtime, kv_dtype=self.kv_dtype).bytes
        ledger = self._calls.ledger if self._calls is not None else None
        capacity = ledger.capacity if ledger is not None else None
        return size, (tokens / capacity if capacity else None)

    def close(self) -> None:
        """Close the transcript (a SQLite file keeps everything recorded)."""
        if self._calls is not None and self._calls.transcript is not None:
            self._calls.transcript.close()

    def __enter__(self) -> ContextKeeper:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
