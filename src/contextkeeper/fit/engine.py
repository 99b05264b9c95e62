"""One fit, start to end: the data flows one way.

:func:`fit` prepares the request once (:class:`Ask`), then reads history back to a horizon and runs the
pipeline (:func:`read`, giving a :class:`Draft`); when strategies left room and older history was left unread,
it reads further and fits again. The draft it keeps is checked against every guarantee and handed back in the
caller's format with its report (:func:`finish`). State between fits lives only in the conversation's
:class:`~contextkeeper.fit.session.Session`; state within one read only in its :class:`Counts` and :class:`Draft`.
"""

from __future__ import annotations

import bisect
import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

from .._exceptions import ContextKeeperError, InvariantViolation, MessageError
from .._memo import shared_prefix
from ..messages import Conversation, Message, MessageLike
from ..messages.conversation import group_units, restore_conversation
from ..strategies.base import (
    Action,
    FitState,
    Foresight,
    Item,
    Items,
    LLMCall,
    Pipeline,
    Reapplying,
    needs_backend,
    reads_beyond,
    run_sync,
)
from ..strategies.prune_tool_results import Cleared
from ..strategies.registry import closed
from ..strategies.turn import compact_turn
from ..tokens import PromptBounding, ToolFreezing
from ..tokens.breakdown import head_counts, prompt_slots
from ..tokens.prefix import PrefixOf, meter_for
from .budget import Budget
from .raw import fingerprint, role_of, texts_of
from .report import Fit, FitReport, _Breakdown
from .session import Rates, Session, Sticky

__all__ = ["Ask", "Counts", "Draft", "Setup", "fit"]

READS = 6  # reads per fit at most: the first, then further back while strategies leave room


@dataclass(frozen=True)
class Setup:
    """What the keeper's configuration gives a fit: the pipeline, the policy's horizon (characters per token;
    0: read everything) and its name, and the summarizer as a backend (None: summarising steps are skipped)."""

    pipeline: Pipeline
    horizon: float
    policy: str
    backend: Callable[[LLMCall], str] | None
    shared: Any = None  # a shared.SharedState: summaries and their leases across processes (None: this one only)

    def runs(self, strategy: Any) -> bool:
        """Whether ``strategy`` runs in a fit: a summarising step only with a summarizer (the sliding window
        covers for it otherwise)."""
        return self.backend is not None or not needs_backend(strategy)


def _chars(message: Any, role: str, rates: Rates) -> float:
    """A message's size in the chat's own characters (see :class:`~contextkeeper.fit.session.Rates`)."""
    text, calls = texts_of(message)
    return len(text) * (rates.results if role == "tool" else 1.0) + len(calls) * rates.calls


# Calibrating a new conversation's characters per token: its newest texts of each kind (tool results, and the
# rest), up to this many characters or messages, are counted exactly (they are the ones most likely kept, and the
# counter remembers their words).
_SAMPLE_CHARS = 6_000
_SAMPLE_MESSAGES = 24
_MARGIN = 1.15  # read this much beyond the estimate, so the window has whole turns to choose from
_SAMPLED = (0.5, 12.0)  # the range a measured characters-per-token figure is kept in
_BEYOND = 2.0  # how much further the read goes when a step summarises the history that does not fit
# Tokens a template writes around each message (role headers, end markers; more around tool calls and results).
_PER_MESSAGE = 6


_KINDS = ("text", "results", "calls")


def _samples(ask: Ask) -> dict[str, list[str]]:
    """The newest texts of each kind, in one pass from the end: the text of messages other than tool results,
    tool results, and tool calls; each kind until it holds ``_SAMPLE_CHARS`` characters or ``_SAMPLE_MESSAGES``
    texts."""
    samples: dict[str, list[str]] = {kind: [] for kind in _KINDS}
    sizes = dict.fromkeys(_KINDS, 0)
    open_kinds = set(_KINDS)
    for index in range(len(ask.messages) - 1, ask.sys_end - 1, -1):
        if not open_kinds:
            break
        text, calls = texts_of(ask.messages[index])
        found = (("results", text),) if ask.roles[index] == "tool" else (("text", text), ("calls", calls))
        for kind, sample in found:
            if sample and kind in open_kinds:
                samples[kind].append(sample)
                sizes[kind] += len(sample)
                if sizes[kind] >= _SAMPLE_CHARS or len(samples[kind]) >= _SAMPLE_MESSAGES:
                    open_kinds.discard(kind)
    return samples


def _rate(session: Session, texts: list[str]) -> float | None:
    """Characters per token of ``texts``, counted exactly; None when the counter refuses one (the messages are
    not validated yet: the read that follows says what is wrong, and where)."""
    many = session.text_tokens_many
    try:
        tokens = sum(many(texts)) if many is not None else sum(map(session.text_tokens, texts))
    except ContextKeeperError:
        return None
    return min(_SAMPLED[1], max(_SAMPLED[0], sum(map(len, texts)) / max(tokens, 1)))


def calibrated(session: Session, ask: Ask, per_token: float) -> float:
    """Characters per token for the first read of a conversation, measured on its newest messages: CJK or
    Devanagari text runs at one or two characters per token where English runs at five, and each depends on the
    tokenizer (Greek: 1.1 characters per token for Qwen's, 2.5 for Llama 3's). Tool results and tool calls (JSON,
    logs, code) are measured apart, as ``session.rates``. ``per_token`` (the policy's) when there is nothing to
    measure, or when it reads everything (0)."""
    if not per_token:
        return per_token
    rates = {kind: _rate(session, texts) for kind, texts in _samples(ask).items() if texts}
    measured = {kind: rate for kind, rate in rates.items() if rate is not None}
    own = measured.get("text", per_token / _MARGIN)
    session.rates = Rates(**{kind: own / rate for kind, rate in measured.items() if kind != "text"})
    session.sparsest = max(measured.values(), default=None)
    return own * _MARGIN


def assemble(units: Sequence[Items]) -> Conversation:
    """A Conversation of already validated units, without validating them again (the counter takes it as is).
    Strategies keep each unit's shape (a rewritten tool result keeps its call id), and the fit is validated
    at the end by the invariant check; the units are grouped only if a counter asks for them."""
    messages = tuple([item.message for unit in units for item in unit])
    size = len(messages)
    formats = cast(tuple[Literal["message"], ...], ("message",) * size)
    return restore_conversation(messages, formats, (None,) * size)


class _LazyRoles:
    """The messages' roles, read only when asked for (a fit on the sticky path never needs most of them)."""

    def __init__(self, messages: Sequence[Any]) -> None:
        self._messages = messages

    def __getitem__(self, index: int) -> str:
        return role_of(self._messages[index])


@dataclass(frozen=True)
class Ask:
    """One fit's request, prepared once for all its reads: the caller's messages, where the system prompt ends
    and the new request starts, the counter's copy of the tools, the budget, and the previous fit when the chat
    only grew since (re-applied first)."""

    messages: Sequence[Any]
    roles: _LazyRoles
    sys_end: int
    last_user: int
    tools: list[Any] | None
    budget: Budget
    sticky: Sticky | None
    started: float

    @classmethod
    def of(
        cls,
        session: Session,
        messages: Sequence[MessageLike],
        tools: Sequence[Any] | None,
        budget: Budget,
        started: float,
    ) -> Ask:
        if not isinstance(messages, (list, tuple)):
            raise MessageError(
                f"expected a list of messages, got {type(messages).__name__}",
                index=None,
                fix="pass a list such as [{'role': 'user', 'content': '...'}]",
            )
        counter = session.counter
        tool_list = (
            (counter.freeze_tools(tools) if isinstance(counter, ToolFreezing) else list(tools)) if tools else None
        )
        sys_end = 0
        while sys_end < len(messages) and role_of(messages[sys_end]) in ("system", "developer"):
            sys_end += 1
        last_user = next(
            (i for i in range(len(messages) - 1, sys_end - 1, -1) if role_of(messages[i]) == "user"), len(messages)
        )
        return cls(
            messages=messages,
            roles=_LazyRoles(messages),
            sys_end=sys_end,
            last_user=last_user,
            tools=tool_list,
            budget=budget,
            sticky=_sticky(session, messages, sys_end, last_user) or _adopted(session, messages, sys_end, last_user),
            started=started,
        )


class Counts:
    """The exact counts of one read: each distinct history counted once, however often strategies and triggers
    ask, and the never-trimmed parts (system prompt, request, tools) once, when first needed."""

    def __init__(self, session: Session, ask: Ask, system: Items, request: Items) -> None:
        self._session = session
        self._tools = ask.tools
        self.system = system
        self.request = request
        self._limit = ask.budget.prompt
        self.fixed: int | None = None  # the never-trimmed parts, once counted
        # By the ids of a history's units; each entry holds the units, so their ids are not reused while it lives.
        self._by_units: dict[tuple[int, ...], tuple[tuple[Items, ...], int]] = {}
        # The same by the tuple itself: a state's own history, asked for again, is found without a pass over its
        # units (tuples only: a list may change between two calls).
        self._by_object: dict[int, tuple[tuple[Items, ...], int]] = {}

    def compacted(self, request: Items) -> None:
        """The request was compacted (its older tool rounds cut): counts made with the old one no longer hold."""
        self.request = request
        self.fixed = None
        self._by_units.clear()
        self._by_object.clear()

    def known(self, units: Sequence[Items]) -> int | None:
        hit = self._by_object.get(id(units))
        if hit is not None and hit[0] is units:
            return hit[1]
        entry = self._by_units.get(tuple(map(id, units)))
        if entry is None or shared_prefix(entry[0], units) != len(units):
            return None
        if type(units) is tuple:
            self._by_object[id(units)] = (units, entry[1])
        return entry[1]

    def count(self, units: Sequence[Items]) -> int:
        """Exact prompt tokens with ``units`` as history."""
        if not units:
            return self.base()
        tokens = self.known(units)
        if tokens is None:
            tokens = int(self._session.counter.count(assemble((self.system, *units, self.request)), tools=self._tools))
            self._by_units[tuple(map(id, units))] = (tuple(units), tokens)
            if type(units) is tuple:
                self._by_object[id(units)] = (units, tokens)
        return tokens

    def peek(self, units: Sequence[Items]) -> int | None:
        """The count of ``units`` if it was made, without counting."""
        return self.fixed if not units else self.known(units)

    def base(self) -> int:
        """Exact tokens of the never-trimmed parts alone."""
        if self.fixed is None:
            self.fixed = side_count(self._session, assemble((self.system, self.request)), self._tools)
        return self.fixed

    def base_if_needed(self) -> int | None:
        """:meth:`base`, or None when an upper bound found without tokenizing (the rendered prompt's UTF-8
        length, for byte-level BPE) already shows the never-trimmed parts fit."""
        side = self._session.side
        if isinstance(side, PromptBounding):
            most = side.bound(assemble((self.system, self.request)), tools=self._tools)
            if most is not None and most <= self._limit:
                return None
        return self.base()


@dataclass
class Draft:
    """One read, fitted by the pipeline but not yet checked: where it read from, what it validated, and the state
    the strategies left."""

    horizon: int
    conversation: Conversation
    counts: Counts
    initial: tuple[Items, ...]
    state: FitState

    @property
    def tokens(self) -> int:
        return self.state.tokens()


def side_count(session: Session, messages: Conversation, tools: list[Any] | None) -> int:
    return int(session.side.count(messages, tools=tools))


def fit(setup: Setup, session: Session, ask: Ask) -> Fit:
    """The longest prompt that fits ``ask.budget``, keeping what matters (the session's lock is held)."""
    per_token = calibrated(session, ask, setup.horizon) if session.horizon is None else session.horizon
    try:
        draft = read(setup, session, ask, per_token)
        for _ in range(READS - 1):
            wider = further(ask, per_token, draft)
            if wider is None:
                break
            per_token = wider
            draft = read(setup, session, ask, per_token)
        made = finish(setup, session, ask, draft)
    except BaseException:
        session.forget_inputs()  # a refused request's messages are not kept alive by this conversation
        raise
    finally:
        # Every fit is a turn, failed or not: per-turn budgets (the summarizer's calls) start afresh.
        session.turn += 1
    if per_token:
        session.horizon = per_token
    return made


def further(ask: Ask, per_token: float, draft: Draft) -> float | None:
    """How far the next read goes (characters per token), or None when ``draft`` is the fit: read further back
    when strategies (pruning, summaries) left room and older history was left unread."""
    limit = ask.budget.prompt
    tokens = draft.tokens
    if ask.sticky is not None or draft.horizon <= ask.sys_end or not per_token or tokens >= 0.9 * limit:
        return None
    if any(action.strategy == "sliding_window" and action.units for action in draft.state.actions):
        return None  # the window dropped some of what was read: older history cannot be kept either
    # In proportion to what this read yielded after the strategies (older history is assumed to shrink alike), a
    # little beyond the budget so the window has whole turns to choose from (between 1.25 and 4 times as far).
    return per_token * min(4.0, max(1.25, 1.1 * limit / max(tokens, 1)))


def read(setup: Setup, session: Session, ask: Ask, per_token: float) -> Draft:
    """Read history back to the horizon at ``per_token`` characters per token and run the pipeline."""
    sys_end, last_user, sticky = ask.sys_end, ask.last_user, ask.sticky
    horizon = sticky.start if sticky is not None else _horizon(setup, session, ask, per_token)
    selected = [*ask.messages[:sys_end], *ask.messages[horizon:]]
    conversation = Conversation.from_messages(selected, previous=session.previous)
    session.previous = conversation
    built = _grown(conversation, sticky, sys_end, horizon, last_user)
    if built is not None:
        system, history, request = built
    else:
        system, history, request = _units(conversation, sticky, sys_end, horizon, last_user)
    limit = ask.budget.prompt
    counts = Counts(session, ask, system, request)
    compacted: tuple[Action, ...] = ()
    # The never-trimmed parts: exactly counted only when a bound found without tokenizing does not already show
    # they fit (the report counts them when it is read). A chat that grew from the last fit is counted whole
    # first, as the first trigger would count it anyway: when it fits, its request fits too, and that needs no
    # other count (or render) at all.
    base = None if built is not None and history and counts.count(history) <= limit else counts.base_if_needed()
    if base is not None and base > limit:
        # An agent loop's current turn (one user message, many tool rounds) alone is over the budget: its older
        # rounds give way before the fit is refused; the user's message and the last round stay.
        turn = compact_turn(request, lambda r: side_count(session, assemble((system, r)), ask.tools) <= limit)
        if turn is None:
            without_tools = int(session.side.count([i.message for i in (*system, *request)])) if ask.tools else base
            raise ask.budget.too_large(base, without_tools)
        request, action = turn
        counts.compacted(request)
        compacted = (action,)
    state = FitState(
        system=system,
        history=tuple(history),
        request=request,
        limit=limit,
        count=counts.count,
        peek=counts.peek,
        text_tokens=session.text_tokens,
        text_tokens_many=session.text_tokens_many,
        text_bound=session.text_bound,
        sparsest=session.sparsest,
        query="\n".join(item.text() for item in request if item.role == "user"),
        turn=session.turn,
        actions=compacted,
        memory=session.memory,
        shared=setup.shared.conversation(session.name) if setup.shared is not None else None,
    )
    initial = state.history
    if sticky is not None and sticky.adopted:
        # Another process's window (Session.adopt): its cleared tool results are cleared again first, as that
        # process's rewrites would have been, so the prompt starts as it did there.
        for strategy, _ in setup.pipeline:
            if isinstance(strategy, Reapplying):
                state = strategy.reapply(state)
    steps, window = closed(setup.pipeline)
    for strategy, trigger in steps:
        if not setup.runs(strategy):
            continue
        if trigger(state):
            state = run_sync(strategy, state, setup.backend)
    after_cut = sticky is None and horizon > sys_end
    state = run_sync(window.closing(after_cut=after_cut), state)
    return Draft(horizon=horizon, conversation=conversation, counts=counts, initial=initial, state=state)


def finish(setup: Setup, session: Session, ask: Ask, draft: Draft) -> Fit:
    """The kept draft, checked, remembered for the next fit, in the caller's format, with its report."""
    state, counts, horizon, sys_end = draft.state, draft.counts, draft.horizon, ask.sys_end
    system, request = counts.system, counts.request
    tokens = state.tokens()
    final = [item for unit in (system, *state.history, request) for item in unit]
    # Exact when some step counted the history as it came in; None when none had to (it was clearly over the
    # budget, and tokenizing text about to be dropped would only cost time).
    before = counts.peek(draft.initial) if horizon <= sys_end else None
    _check(session, final, tokens, ask.budget.prompt, system, request)
    # Only a fit that kept its guarantees is built on by the next one.
    _remember(session, ask, state.history, system=system, conversation=draft.conversation, horizon=horizon)
    prefix = _prefix(session, assemble((system, *state.history, request)), ask.tools)
    out = _caller_format(session, final, draft.conversation, sys_end, horizon, ask.messages)
    reserved = ask.budget.reserved

    def breakdown() -> tuple[dict[str, int], int | None, int]:
        # Read perhaps on another thread, while the session fits again: its lock keeps the side counter's
        # incremental state to one count at a time.
        with session.lock:
            fixed = counts.base()
            slots = _slots(session, system, request, ask.tools, fixed, tokens, reserved)
        return slots, (before - fixed) if before is not None else None, tokens - fixed

    report = FitReport(
        limit=ask.budget.limit,
        limit_source=ask.budget.limit_source,
        max_tokens=reserved,
        tokens=tokens,
        tokens_before=before,
        messages_before=len(ask.messages),
        messages_after=len(out),
        unread=horizon - sys_end,
        actions=state.actions,
        seconds=time.perf_counter() - ask.started,
        policy=setup.policy,
        notes=(f"{horizon - sys_end} older message(s) beyond the horizon were dropped unread",)
        if horizon > sys_end
        else (),
        _breakdown=_Breakdown(breakdown),
        _prefix=prefix,
    )
    return Fit(messages=out, tokens=tokens, report=report)


# ------------------------------------------------------------------------------------------------ reading
def _sticky(session: Session, messages: Sequence[Any], sys_end: int, last_user: int) -> Sticky | None:
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


def _adopted(session: Session, messages: Sequence[Any], sys_end: int, last_user: int) -> Sticky | None:
    """Another process's window for this conversation (``Session.adopt``), taken up once: its start, when the
    caller's list still holds the messages it saw there, and its cleared tool results."""
    state, session.adopted = session.adopted, None
    if state is None or session.sticky is not None:
        return None
    if state.sys_end != sys_end or state.length > len(messages) or not sys_end <= state.start < last_user:
        return None
    if fingerprint(messages, state.start, state.length) != state.fingerprint:
        return None
    cleared = session.memory.slot(Cleared)
    cleared.update(state.cleared)
    return Sticky(inputs=tuple(messages[: state.length]), sys_end=sys_end, start=state.start, rewrites={}, adopted=True)


def _horizon(setup: Setup, session: Session, ask: Ask, per_token: float) -> int:
    """The first history message worth reading: older units cannot fit even at ``per_token`` characters per
    token, so they are dropped without being validated or tokenized. 0 characters per token: read all.

    A message's characters are what the pipeline's strategies expect to leave of it (see ``Foresight``): old
    tool results about to be cleared take little room, so the read goes back far enough to fill the budget after
    they are."""
    sys_end, last_user = ask.sys_end, ask.last_user
    if not per_token:
        return sys_end
    foresight = [_kept_chars(strategy) for strategy, _ in setup.pipeline if isinstance(strategy, Foresight)]
    budget = ask.budget.prompt * per_token
    if any(reads_beyond(strategy) and setup.runs(strategy) for strategy, _ in setup.pipeline):
        budget *= _BEYOND  # a step that summarises what does not fit needs that history read
    # The system prompt and the request are always kept: history has the rest of the budget.
    kept = (*range(sys_end), *range(last_user, len(ask.messages)))
    rates = session.rates
    overhead = _PER_MESSAGE * per_token  # what the template writes around each message
    used = sum(_chars(ask.messages[i], ask.roles[i], rates) + overhead for i in kept)
    results = 0  # tool results of history newer than the message at ``index``
    horizon = last_user
    for index in range(last_user - 1, sys_end - 1, -1):
        role = ask.roles[index]
        chars = _chars(ask.messages[index], role, rates)
        for kept_chars in foresight:
            chars = kept_chars(role, chars, results, per_token)
        used += chars + overhead
        results += role == "tool"
        if role == "user":
            if used > budget and horizon < last_user:
                break
            horizon = index
    else:
        return sys_end
    return horizon


def _kept_chars(strategy: Foresight) -> Callable[[str, float, int, float], float]:
    """The strategy's ``kept_chars``; one written before it took the chat's characters per token is called
    without them."""
    method = strategy.kept_chars
    try:
        takes_rate = len(inspect.signature(method).parameters) >= 4
    except (TypeError, ValueError):  # no signature to read (a builtin): call it as the protocol says
        takes_rate = True
    if takes_rate:
        return method
    older = cast(Callable[[str, float, int], float], method)
    return lambda role, chars, newer, per_token: older(role, chars, newer)


def _units(
    conversation: Conversation, sticky: Sticky | None, sys_end: int, horizon: int, last_user: int
) -> tuple[Items, list[Items], Items]:
    """System, history units and request of ``conversation`` (the caller's messages ``[:sys_end]`` and
    ``[horizon:]``), with the previous fit's rewrites re-applied."""
    origins = [*range(sys_end), *range(horizon, horizon + len(conversation) - sys_end)]
    items = [Item(message, index) for message, index in zip(conversation.messages, origins, strict=True)]
    system: Items = tuple(items[:sys_end])
    request: Items = tuple(item for item in items[sys_end:] if item.origin is not None and item.origin >= last_user)
    history: list[Items] = []
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


def _grown(
    conversation: Conversation, sticky: Sticky | None, sys_end: int, horizon: int, last_user: int
) -> tuple[Items, list[Items], Items] | None:
    """What :func:`_units` returns, built from the previous fit when the chat only grew since: its fitted history
    (every rewrite already applied) plus the units that arrived, so a turn costs what it added.

    Taken only when the previous fit read from the same start and its validated messages are the very first
    ones of ``conversation``; then rebuilding would give equal items and units (the previous fit's request,
    never rewritten, becomes history as it is). None: build from scratch."""
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
    added: list[Items] = []
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


# ------------------------------------------------------------------------------------------------ finishing
def _check(session: Session, final: list[Item], tokens: int, limit: int, system: Items, request: Items) -> None:
    """The guarantees of every fit; a violation is a bug, so the fit is refused."""
    problems = []
    if tokens > limit:
        problems.append(f"{tokens} prompt tokens exceed the {limit} available")
    if any(item.origin != i for i, item in enumerate(system)):
        problems.append("the system prompt was changed")
    # The user's message and the round the model must answer stay verbatim; older rounds of the same turn may be
    # compacted (each rewrite keeps its source) only when the turn alone was over the budget.
    if request and (request[0].origin is None or request[-1].origin is None):
        problems.append("the new request was changed")
    if any(item.origin is None and item.source is None for item in request):
        problems.append("the new request was changed")
    origins = [item.origin for item in final if item.origin is not None]
    if origins != sorted(origins) or len(set(origins)) != len(origins):
        problems.append("messages were reordered or repeated")
    try:
        _paired(session, tuple([item.message for item in final]))
    except MessageError as exc:
        problems.append(f"the fitted conversation is not valid: {exc}")
    if problems:
        raise InvariantViolation("fit invariant broken: " + "; ".join(problems))


def _paired(session: Session, messages: tuple[Message, ...]) -> None:
    """Raise as ``Conversation.from_messages(messages)`` would when tool calls and results do not pair up.

    The messages are validated Message objects, so the check is their grouping into units. Units of the previous
    fit's prompt that lie in the prefix this one shares with it (the very same objects) are grouped already;
    grouping resumes at the last of them, which may have grown."""
    known = session.paired
    start, prefix = 0, ()
    if known is not None:
        old, units, starts = known
        shared = shared_prefix(messages, old)
        last = bisect.bisect_left(starts, shared) - 1  # the last unit that starts in the shared prefix
        if shared and last >= 0:
            start, prefix = starts[last], units[:last]
    grouped = prefix + group_units(messages, start)
    session.paired = (messages, grouped, [unit.start for unit in grouped])


def _remember(
    session: Session,
    ask: Ask,
    history: Sequence[Items],
    *,
    system: Items,
    conversation: Conversation,
    horizon: int,
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
    start = anchors[0] if anchors else ask.last_user
    session.sticky = Sticky(
        inputs=tuple(ask.messages),
        sys_end=ask.sys_end,
        start=start,
        rewrites=rewrites,
        conversation=conversation,
        horizon=horizon,
        system=system,
        history=tuple(history),
        last_user=ask.last_user,
    )


def _prefix(session: Session, prompt: Conversation, tools: list[Any] | None) -> PrefixOf:
    """This prompt's text kept for the next fit, and its shared prefix with the previous fit's (measured when the
    report is read)."""
    if not session.metered:
        session.meter, session.metered = meter_for(session.counter), True
    meter = session.meter
    try:
        text = meter.text(prompt, tools) if meter is not None else None
    except ContextKeeperError:  # rendered once already for the count: not expected, and never worth a failed fit
        text = None
    previous, session.prompt_text = session.prompt_text, text
    first, session.prompted = not session.prompted, True
    if previous is None and not first:
        return PrefixOf(None, None, None)  # the previous prompt could not be measured by ids
    return PrefixOf(meter, text, previous)


def _caller_format(
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
                # An unchanged plain dict goes back as the caller's own object (equal to itself, and free); other
                # mappings as a new plain dict.
                out.append(source if type(source) is dict else item.message.to_dict())
            elif fmt == "object":
                out.append(original[item.origin])
            else:
                out.append(item.message)
        else:
            out.append(_new_dict(session, item.message) if dicts else item.message)
    return out


def _new_dict(session: Session, message: Message) -> dict[str, Any]:
    """``message.to_dict()``: a new dict every time (the caller may change it), copied from a remembered one when
    every value is an immutable scalar (a cleared tool result, a marker), which is cheaper."""
    cache = session.dict_memo()
    known = cache.get(message)
    if known is None:
        data = message.to_dict()
        flat = all(value is None or type(value) in (str, int, float, bool) for value in data.values())
        cache.put(message, dict(data) if flat else False)  # the entry holds the message: its id stays unique
        return data
    return dict(known) if isinstance(known, dict) else message.to_dict()


def _slots(
    session: Session, system: Items, request: Items, tools: list[Any] | None, base: int, tokens: int, answer: int
) -> dict[str, int]:
    """Tokens per slot in prompt order (:func:`~contextkeeper.tokens.breakdown.prompt_slots`, the model
    ``breakdown`` and the CLI's ``count`` use too), then the answer. Only the small lists are counted."""
    head = [i.message for i in system]
    # The system prompt's own counts: taken once while it and the tools stay the same objects (the entry holds
    # them, so their ids are not reused).
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
