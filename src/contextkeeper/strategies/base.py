"""The strategy protocol, the state strategies work on, triggers, the registry and the pipeline driver.

A strategy has one method, ``apply(state) -> state``. Strategies that need a model (summaries) are generator
functions instead: they ``yield`` an :class:`LLMCall` and receive the reply text, so the same code runs under a
sync driver (:func:`run_sync`) and an async one (:func:`run_async`).

History is a tuple of units (an assistant message with all its tool results, or a user message); strategies
replace or drop whole units and never split one. Each message is an :class:`Item`: the message the template
sees and, while unchanged, the index of the caller's message it came from, so untouched messages go back to the
caller as their own objects.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import typing
from collections.abc import Awaitable, Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar, cast, runtime_checkable

from pydantic import Field, create_model

from .._exceptions import ConfigurationError
from .._memo import IdentityMemo, data_size, shared_prefix
from ..messages import Message
from .settings import Settings

__all__ = [
    "STRATEGIES",
    "Action",
    "Always",
    "Closing",
    "FitState",
    "Foresight",
    "Item",
    "LLMCall",
    "Memory",
    "NeedsBackend",
    "OverBudget",
    "Pipeline",
    "ReadsBeyond",
    "Reapplying",
    "Step",
    "Strategy",
    "StrategySettings",
    "Trigger",
    "TurnCount",
    "needs_backend",
    "reads_beyond",
    "register",
    "run_async",
    "run_sync",
    "with_content",
]


@dataclass(frozen=True)
class Item:
    """One message of the prompt: what the template sees, and the caller's index while it is unchanged."""

    message: Message
    origin: int | None = None
    source: Message | None = None  # for a rewrite: the message it was made from (see FitState.reuse)
    # Asked for on every pass over the history: read once. Set here rather than cached on first read, which would
    # give each of the hundreds of thousands of items a keeper holds a dict of its own for the collector to scan.
    role: str = field(init=False, repr=False, compare=False)
    # Characters of the message's text and tool-call arguments, counted on first read (-1: not yet). Kept on the
    # item, not in a cache keyed by units: such a cache held every unit of every earlier fit alive, with its items
    # and messages, for the collector to scan (about 190,000 objects per 50 conversations).
    _chars: int = field(default=-1, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", str(self.message.role))

    def chars(self) -> int:
        """Characters of the message's text and tool-call arguments (counted once; the message is immutable)."""
        known = self._chars
        if known < 0:
            known = _unit_chars((self,))
            object.__setattr__(self, "_chars", known)
        return known

    def text(self) -> str:
        """The message's text (content parts joined), for strategies that read it."""
        return "\n".join(self.message.text_parts())


Items = tuple[Item, ...]
"""The items of one unit (a system or user message, or an assistant message with its tool results), in order: what
strategies keep, drop or rewrite together. :class:`contextkeeper.messages.Unit` is where such a unit lies in a
conversation (its kind and index range)."""


# The rewrites kept per source message (one per strategy setting that rewrote it, newest first): a key that
# changes every turn, such as the set of pruned calls, cannot pile up versions of one message.
_REWRITES_PER_SOURCE = 8


def _rewrites_size(source: Message, made: tuple[tuple[Any, Message], ...]) -> int:
    # The source is the caller's message (counted where the counter keeps it); the rewrites are new: counted here.
    return sum(data_size(rewrite) + 128 for _, rewrite in made)


def _unit_chars(unit: Items) -> int:
    """Characters of a unit's text and tool-call arguments."""
    total = 0
    for item in unit:
        message = item.message
        total += sum(map(len, message.text_parts()))
        for call in message.tool_calls or ():
            arguments = call.function.arguments
            total += len(arguments) if isinstance(arguments, str) else len(str(arguments))
    return total


@dataclass(frozen=True, kw_only=True)
class Action:
    """What one strategy did in one fit."""

    strategy: str
    detail: str
    saved: int | None = 0  # tokens saved, counted before and after (None: the history before was never tokenized)
    units: int = 0  # units affected


@dataclass(frozen=True, kw_only=True)
class LLMCall:
    """A request a strategy makes of the summarizer backend: chat messages and an answer budget."""

    messages: tuple[dict[str, Any], ...]
    max_tokens: int
    purpose: str = "summary"


K = TypeVar("K")


class Memory:
    """A conversation's strategy state between fits, owned by its session: one typed slot per kind (a class),
    made on first use by calling the kind with no arguments. A strategy keeps its own state in a class of its
    own, so no two strategies can read or overwrite each other's by a shared key."""

    __slots__ = ("_slots",)

    def __init__(self) -> None:
        self._slots: dict[type[Any], Any] = {}

    def slot(self, kind: type[K]) -> K:
        """The slot of ``kind``, made (``kind()``) when it is not there yet."""
        found = self._slots.get(kind)
        if found is None:
            found = self._slots[kind] = kind()
        return cast(K, found)

    def get(self, kind: type[K]) -> K | None:
        """The slot of ``kind``, or None when nothing was kept there."""
        return cast("K | None", self._slots.get(kind))

    def put(self, value: K) -> K:
        """Keep ``value`` as the slot of its own class (replacing what was there)."""
        self._slots[type(value)] = value
        return value

    def kinds(self) -> list[type[Any]]:
        """The kinds kept so far."""
        return list(self._slots)


@dataclass(frozen=True)
class _Chars:
    """The characters of the last history counted, and its running totals unit by unit (see FitState.chars)."""

    history: tuple[Items, ...]
    total: int
    running: list[int]


class _Rewrites:
    """Rewritten messages kept the same objects across fits (see FitState.reuse), bounded with every other cache
    by the shared byte budget."""

    def __init__(self) -> None:
        self.made: IdentityMemo[Message, tuple[tuple[Any, Message], ...]] = IdentityMemo(
            "fit.rewrites", sizer=_rewrites_size
        )
        # A root entry holds two messages counted elsewhere (the rewrite here, the source by the counter).
        self.roots: IdentityMemo[Message, Message] = IdentityMemo("fit.rewrite_roots", sizer=lambda rewrite, root: 128)


@dataclass(frozen=True, kw_only=True)
class FitState:
    """Everything a strategy may read, and the history it may change.

    ``count(history)`` is the exact token count of the whole prompt (system, the given history, the request,
    the tools, the generation prompt) through the model's template; ``limit`` is what the prompt may use (the
    context minus the answer reservation). ``memory`` persists across fits of one conversation (summary caches,
    pruning batches): a :class:`Memory` of typed slots, each strategy owning the classes it keeps there.
    """

    system: Items
    history: tuple[Items, ...]
    request: Items
    limit: int
    count: Callable[[Sequence[Items]], int] = field(repr=False, compare=False)
    text_tokens: Callable[[str], int] | None = field(default=None, repr=False, compare=False)
    # ``text_tokens`` of many texts at once (a batch the tokenizer runs in parallel), when the counter has it.
    text_tokens_many: Callable[[Sequence[str]], list[int]] | None = field(default=None, repr=False, compare=False)
    # An upper bound on ``text_tokens`` found without tokenizing (None: not known for this text or tokenizer).
    text_bound: Callable[[str], int | None] | None = field(default=None, repr=False, compare=False)
    # The most characters per token measured on this chat's newest texts (None: not measured); see OverBudget.
    sparsest: float | None = field(default=None, repr=False, compare=False)
    peek: Callable[[Sequence[Items]], int | None] | None = field(default=None, repr=False, compare=False)
    query: str = ""
    turn: int = 0
    actions: tuple[Action, ...] = ()
    memory: Memory = field(default_factory=Memory, repr=False, compare=False)
    # This conversation's state shared with other processes (a shared.ConversationShare; None: this process only).
    shared: Any = field(default=None, repr=False, compare=False)

    def tokens(self, history: Sequence[Items] | None = None) -> int:
        """Exact prompt tokens with ``history`` (default: the current history)."""
        return self.count(self.history if history is None else history)

    def tokens_of(self, text: str) -> int:
        """Exact tokens of a piece of text with this model's tokenizer (no template, no special tokens)."""
        if self.text_tokens is None:
            raise ConfigurationError("this strategy needs the keeper's text counter (FitState.text_tokens)")
        return self.text_tokens(text)

    def within(self, text: str, cap: int) -> bool:
        """Exactly whether ``text`` has at most ``cap`` tokens; decided without tokenizing when an upper bound on
        its tokens (see ``text_bound``) already says so."""
        if self.text_bound is not None:
            bound = self.text_bound(text)
            if bound is not None and bound <= cap:
                return True
        return self.tokens_of(text) <= cap

    def prefetch_tokens(self, texts: Sequence[str]) -> None:
        """Warm :meth:`tokens_of` for ``texts`` in one batch (a no-op without a batch counter)."""
        if self.text_tokens_many is not None and texts:
            self.text_tokens_many(texts)

    def saving(self, history: Sequence[Items]) -> int | None:
        """Exact tokens ``history`` saves against the current history, or None when the current history was never
        counted (counting it would mean tokenizing text that a strategy is about to drop)."""
        before = self.peek(self.history) if self.peek is not None else self.tokens()
        return None if before is None else before - self.tokens(history)

    def chars(self) -> int:
        """Characters of the whole prompt's text (cheap; no tokenizer; remembered for the current history)."""
        known = self.memory.get(_Chars)
        if known is not None and known.history is self.history:
            return known.total
        # Per unit, by identity (units are immutable tuples, and a growing chat keeps its old ones): a fit costs
        # the units it has not seen. The history's running totals are kept too, so a history that shares its first
        # units with the last one counted (the very same tuples) is summed from where they part.
        history = self.history
        shared, running = 0, [0]
        if known is not None:
            shared = shared_prefix(history, known.history)
            running = known.running[: shared + 1]
        running.extend(itertools.accumulate(self.unit_chars(history[shared:]), initial=running.pop()))
        total = running[-1] + sum(self.unit_chars((self.system, self.request)))
        self.memory.put(_Chars(history, total, running))
        return total

    def unit_chars(self, units: Sequence[Items]) -> list[int]:
        """Characters of each unit's text and tool-call arguments (cheap; each item counts its own once)."""
        return [sum(item.chars() for item in unit) for unit in units]

    def over(self) -> int:
        """Tokens over the limit (negative: room left)."""
        return self.tokens() - self.limit

    def reuse(self, source: Message, key: Any, build: Callable[[], Message]) -> Item:
        """A rewritten message that is the very same object in every fit while its source and ``key`` are
        unchanged, so the counter's caches (keyed by message identity) keep working across fits.

        The item's ``source`` is the caller's message the rewrite descends from, also when ``source`` is itself
        a rewrite (a result cut in one fit and cleared in a later one): the keeper re-applies rewrites by the
        caller's message, so a chain of them is re-applied whole."""
        rewrites = self.memory.slot(_Rewrites)
        store, roots = rewrites.made, rewrites.roots
        known_root = roots.get(source)
        root = source if known_root is None else known_root
        made = store.get(source) or ()
        rewrite = next((message for known, message in made if known == key), None)
        if rewrite is None:
            rewrite = build()
            # A new tuple (an entry is never changed: its size was charged when it was put), newest key first.
            store.put(source, ((key, rewrite), *made[: _REWRITES_PER_SOURCE - 1]))
            if rewrite is not source:
                roots.put(rewrite, root)  # the entry holds the rewrite: its id stays unique
        return Item(rewrite, None, root)

    def with_history(self, history: Sequence[Items], action: Action | None = None) -> FitState:
        actions = self.actions + ((action,) if action is not None else ())
        return replace(self, history=tuple(history), actions=actions)

    def items(self) -> Iterator[Item]:
        for unit in self.history:
            yield from unit


Step = Generator[LLMCall, str, FitState]


@runtime_checkable
class Strategy(Protocol):
    """One way to make history smaller. ``apply`` returns the new state, or is a generator that yields
    :class:`LLMCall` requests and returns the new state."""

    def apply(self, state: FitState) -> FitState | Step: ...


@runtime_checkable
class Foresight(Protocol):
    """A strategy that can tell, from a message's size alone, about how much of it survives: the keeper reads
    that far back (see ``Policy.horizon``) before anything is validated or tokenized. An estimate: a wrong one
    costs a second read or some text tokenized and then dropped, never a wrong fit."""

    def kept_chars(self, role: str, chars: float, newer_results: int, per_token: float = 4.0) -> float:
        """Characters left of a history message with ``role`` and ``chars`` characters (text and tool-call
        arguments), when ``newer_results`` tool results of history come after it and the chat runs at about
        ``per_token`` characters per token."""
        ...


@runtime_checkable
class NeedsBackend(Protocol):
    """A strategy that asks a model (it yields :class:`LLMCall`): the keeper runs it only with a summarizer set,
    the closing window covering for it otherwise."""

    needs_backend: bool


@runtime_checkable
class ReadsBeyond(Protocol):
    """A strategy that works on history beyond what fits (it summarises what would be dropped): the keeper reads
    that much further back."""

    reads_beyond: bool


@runtime_checkable
class Reapplying(Protocol):
    """A strategy whose rewrites another process made are made again first, when a conversation's window is
    adopted from it, so the prompt starts as it did there."""

    def reapply(self, state: FitState) -> FitState: ...


@runtime_checkable
class Closing(Protocol):
    """A window that can close every fit: what is left after the pipeline's steps is made to fit by it. A
    pipeline's last such step is its closing window (see :func:`~.registry.closed`)."""

    def closing(self, *, after_cut: bool) -> Strategy:
        """This window as it closes a fit; ``after_cut``: older units are gone already (the read stopped short)."""
        ...


def needs_backend(strategy: object) -> bool:
    """Whether ``strategy`` asks a model."""
    return isinstance(strategy, NeedsBackend) and bool(strategy.needs_backend)


def reads_beyond(strategy: object) -> bool:
    """Whether ``strategy`` works on history beyond what fits."""
    return isinstance(strategy, ReadsBeyond) and bool(strategy.reads_beyond)


# ------------------------------------------------------------------------------------------- triggers


class Trigger:
    """When a strategy runs. Compose with ``|`` and ``&``."""

    def __call__(self, state: FitState) -> bool:
        raise NotImplementedError

    def __or__(self, other: Trigger) -> Trigger:
        return _Either(self, other)

    def __and__(self, other: Trigger) -> Trigger:
        return _Both(self, other)


@dataclass(frozen=True)
class _Either(Trigger):
    left: Trigger
    right: Trigger

    def __call__(self, state: FitState) -> bool:
        return self.left(state) or self.right(state)


@dataclass(frozen=True)
class _Both(Trigger):
    left: Trigger
    right: Trigger

    def __call__(self, state: FitState) -> bool:
        return self.left(state) and self.right(state)


@dataclass(frozen=True)
class Always(Trigger):
    def __call__(self, state: FitState) -> bool:
        return True


@dataclass(frozen=True)
class OverBudget(Trigger):
    """The prompt uses more than ``fraction`` of the limit (1.0: it does not fit); ``0 < fraction <= 1``."""

    fraction: float = 1.0

    def __post_init__(self) -> None:
        fraction = self.fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ConfigurationError(
                f"trigger over:{fraction!r}: the fraction of the budget must be a number in (0, 1], got {fraction!r}. "
                "Fix: use over:F with 0 < F <= 1 (over:0.8: at 80% of the budget), or over_budget"
            )

    def __call__(self, state: FitState) -> bool:
        # A prompt with more than CHARS_PER_TOKEN characters for every token of the budget is over it whatever
        # the tokenizer (tokens average 3 to 5 characters), and so is one with more than MEASURED_MARGIN times
        # the most characters per token measured on this chat's newest texts (CJK text runs at one or two): no
        # need to tokenize text that is about to go (a first read holds old tool results about to be cleared).
        most = self.fraction * state.limit
        chars = state.chars()
        if chars > CHARS_PER_TOKEN * most:
            return True
        if state.sparsest is not None and chars > MEASURED_MARGIN * state.sparsest * most:
            return True
        return state.tokens() > most


CHARS_PER_TOKEN = 8
# Older messages may run at more characters per token than the newest (another language, indented code): a
# prompt is taken as over only at twice the estimate, and an estimate off by as much only clears old tool
# results a little early; the fit's count stays exact either way.
MEASURED_MARGIN = 2.0


@dataclass(frozen=True)
class TurnCount(Trigger):
    """Every ``every``-th fit (the first fit is turn 0)."""

    every: int = 1

    def __post_init__(self) -> None:
        every = self.every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ConfigurationError(
                f"trigger every:{every!r}: the period must be a whole number >= 1, got {every!r}. "
                "Fix: use every:N with N >= 1 (every:1 runs on every fit)"
            )

    def __call__(self, state: FitState) -> bool:
        return state.turn % self.every == 0


# ------------------------------------------------------------------------------------------- registry

S = TypeVar("S")
STRATEGIES: dict[str, type[Any]] = {}
_SETTINGS: dict[str, type[Settings]] = {}


class StrategySettings(Settings):
    """Base of a strategy that is its own settings model: subclass it, declare the settings as fields (with
    ``Field`` bounds), add ``apply``, and :func:`register` it. Bad settings, from a policy file or from Python,
    are a ConfigurationError naming the key, the value and the allowed range."""

    name: typing.ClassVar[str] = ""


def register(name: str, *, settings: type[Settings] | None = None) -> Callable[[type[S]], type[S]]:
    """Class decorator: make a strategy available to policies under ``name``.

    Its settings model is ``settings`` when given, the class itself when it is a :class:`StrategySettings`, else
    one made from the class's constructor annotations (a dataclass's fields), so every policy step is checked
    before a fit runs."""

    def add(cls: type[S]) -> type[S]:
        model = settings if settings is not None else _own_model(cls)
        model.subject = f"strategy {name!r}"
        STRATEGIES[name] = cls
        _SETTINGS[name] = model
        cls.name = name  # type: ignore[attr-defined]
        return cls

    return add


def _own_model(cls: type[Any]) -> type[Settings]:
    if issubclass(cls, Settings):
        return cls
    # Any other class (a plain dataclass): a model of its constructor's keyword parameters and annotations.
    try:
        hints = typing.get_type_hints(cls if dataclasses.is_dataclass(cls) else cls.__init__)
    except Exception:  # annotations that do not resolve: check the keys only
        hints = {}
    factories = {f.name: f.default_factory for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
    fields: dict[str, Any] = {}
    for parameter in inspect.signature(cls).parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        annotation = hints.get(parameter.name, Any)
        factory = factories.get(parameter.name, dataclasses.MISSING)
        # The class's own defaults apply (only the keys a step sets are passed on); the model shows them in errors.
        if factory is not dataclasses.MISSING:
            fields[parameter.name] = (annotation, Field(default_factory=factory, validate_default=False))
        elif parameter.default is parameter.empty:
            fields[parameter.name] = (annotation, ...)
        else:
            fields[parameter.name] = (annotation, Field(default=parameter.default, validate_default=False))
    model: type[Settings] = create_model(f"{cls.__name__}Settings", __base__=Settings, **fields)
    return model


# ------------------------------------------------------------------------------------------- drivers

Backend = Callable[[LLMCall], str]
AsyncBackend = Callable[[LLMCall], Awaitable[str]]


def _resume(steps: Step, reply: str | None = None, error: BaseException | None = None) -> LLMCall | FitState:
    """Hand the strategy its reply (or the backend's error); its next model call, or its final state."""
    try:
        return steps.throw(error) if error is not None else steps.send(reply)  # type: ignore[arg-type]
    except StopIteration as done:
        final: FitState = done.value
        return final


def _needs(backend: object) -> None:
    if backend is None:
        raise ConfigurationError("this strategy needs a summarizer backend: pass summarizer=... to the keeper")


def run_sync(strategy: Strategy, state: FitState, backend: Backend | None = None) -> FitState:
    """Apply ``strategy``, answering its model calls with ``backend``."""
    result = strategy.apply(state)
    if isinstance(result, FitState):
        return result
    pending = _resume(result)  # send(None) starts the generator, as next() does
    while isinstance(pending, LLMCall):
        _needs(backend)
        assert backend is not None
        try:
            reply = backend(pending)
        except Exception as exc:
            pending = _resume(result, error=exc)
        else:
            pending = _resume(result, reply)
    return pending


async def run_async(strategy: Strategy, state: FitState, backend: AsyncBackend | Backend | None = None) -> FitState:
    """Apply ``strategy``, awaiting its model calls on ``backend`` (sync or async)."""
    result = strategy.apply(state)
    if isinstance(result, FitState):
        return result
    pending = _resume(result)
    while isinstance(pending, LLMCall):
        _needs(backend)
        assert backend is not None
        try:
            reply = backend(pending)
            if inspect.isawaitable(reply):
                reply = await reply
        except Exception as exc:
            pending = _resume(result, error=exc)
        else:
            pending = _resume(result, str(reply))
    return pending


def with_content(message: Message, content: str) -> Message:
    """``message`` with its content replaced (role, ids and every other field kept). A copy, not a new
    validation: only the content changes, and a string is valid content."""
    return message.model_copy(update={"content": content})


@dataclass(frozen=True)
class Pipeline:
    """Strategies in order, each with its trigger: the same list a policy file declares. ``closing``: the window
    that closes every fit (None: the last :class:`Closing` step's settings, else the plain sliding window)."""

    steps: tuple[tuple[Strategy, Trigger], ...]
    closing: Closing | None = None

    def __iter__(self) -> Iterator[tuple[Strategy, Trigger]]:
        return iter(self.steps)
