"""One wrapped call: record, fit, admit, send, recover, record — written once, driven by a sync and an async loop.

The per-attempt steps live on :class:`Call` (``begin``, ``prepare``, ``failed``, ``done``, ``finish``);
:func:`call_sync` and :func:`call_async` only differ in how they wait (tenacity's ``Retrying`` vs
``AsyncRetrying``) and in running the CPU-bound fit and the transcript's first write on a worker thread so an
event loop is never blocked by them.

Write ahead. Before the first fit, the caller's messages go to the transcript (committed, for a SQLite file), and
the call's entry is completed or marked failed when it ends, so a crash in between loses nothing it was given.

Recovery. A refusal for length teaches the keeper about the server: the limit it stated (a server-wide fact, its
max_model_len), and the tokens it counted beyond ours. A reply's ``usage.prompt_tokens`` measures the same drift
exactly. What is learned from those drifts is bounded, scoped and heals (:class:`LearnRules`):

- *Plain requests* (none of the :func:`request_features` our count cannot see) share one offset per server, the
  K-th largest of the last N drifts (3rd of 8; with fewer, the smallest), so one outlier moves nothing, a few
  agreeing replies do, and a drift no longer seen rolls out of the window (or out of its TTL). It never exceeds a
  share of the limit (25%). Each call adds one drift: what its reply measured, else what its refusal implied.
- *Requests with features* (``documents``, ``chat_template_kwargs``, a per-request ``chat_template``, an image, ...)
  are charged to their own scope: the conversation's session (evicted with it) holds what such requests of that
  conversation cost beyond our count, per server and feature set; other conversations and plain requests never
  see it. A limit derived from such a request's overshoot stays in its scope too.
- A refusal's implied offset applies to the call's own retries at once, so the call recovers.
- A request our own check refuses only because of learned offsets is sent once without them (a probe: once per
  call, and per server and scope at most once per ``probe_every`` seconds), and what it measures (its reply's
  usage or its refusal's numbers) is learned, so the state always heals.

With shared state, each replica writes its own facts, and a reader combines the fresh ones (the lower median of
their offsets, the least stated limit): one replica cannot move the others (see :mod:`contextkeeper.calls.shared`).

A refusal without numbers shrinks the budget by a step that doubles. A local out-of-memory error shrinks the prompt
to three quarters. Transport errors (timeouts, 429, 5xx, malformed replies, a stream that breaks before its first
chunk) are retried with exponential backoff, and only they wait. This is the only retry policy of a wrapped call:
the openai SDK's own retries are turned off for the requests the wrapper sends.

Admission. A request for ``n`` answers (or vLLM's ``best_of``, which generates that many) is admitted as the prompt
plus ``max(n, best_of)`` answers: the server keeps one copy of the prompt's KV blocks, shared by the sequences
(vLLM forks them from the prompt's blocks; with prefix caching they are shared outright), and each sequence grows
its own answer. The fit is per sequence and unchanged: the prompt plus one answer fits the context.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import inspect
import logging
import math
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol, cast

from .._exceptions import (
    ConfigurationError,
    ContextLengthExceeded,
    DriftWarning,
    OutOfMemory,
    RequestTooLarge,
    StreamInterrupted,
    TranscriptUnavailable,
    TransportError,
)
from ..fit.budget import Reserve
from ..fit.report import Fit
from ..servers.dialects import Dialect
from ..tokens.media import PART_MODALITY
from . import tracing
from .admission import Admitting
from .base import Backend, Reply, Request
from .errors import classify
from .recording import CallRecord
from .recovery import Recovery, _Drift, _ordinal
from .shared import ServerFacts, WrittenFacts, lower_median

if TYPE_CHECKING:
    from ..fit.session import Session
    from .ledger import Ledger, Ticket
    from .redis_ledger import RedisLedger
    from .shared import SharedState

__all__ = [
    "PROMPT_FIELDS",
    "CallReport",
    "DriftWarning",
    "LearnRules",
    "ServerState",
    "cached_tokens_of",
    "call_async",
    "call_sync",
    "request_features",
    "sequences_of",
]

log = logging.getLogger("contextkeeper")

#: The event loop of an async wrapped call, seen by the fit's worker thread (asyncio.to_thread copies context):
#: an async summarizer is run on that loop, where its client lives.
CALLER_LOOP: contextvars.ContextVar[asyncio.AbstractEventLoop | None] = contextvars.ContextVar(
    "contextkeeper_caller_loop", default=None
)


@dataclass(frozen=True, kw_only=True)
class LearnRules:
    """How offsets learned from drifts grow, are bounded and decay (the module docstring says why).

    ``agree``/``window``: a plain offset is the ``agree``-th largest of the last ``window`` drifts (with fewer, the
    smallest); ``share``: the most it may be, of the least of the server's and the keeper's limit; ``ttl``: seconds
    a drift, or a scope's offset, counts; ``probe_every``: seconds between two probes of one server and scope;
    ``scopes``: the scopes (server and feature set) one conversation keeps."""

    agree: int = 3
    window: int = 8
    share: float = 0.25
    ttl: float = 3600.0
    probe_every: float = 30.0
    scopes: int = 8

    def __post_init__(self) -> None:
        for name in ("agree", "window", "scopes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigurationError(f"LearnRules({name}={value!r}): {name} must be a whole number >= 1")
        if self.agree > self.window:
            raise ConfigurationError(
                f"LearnRules(agree={self.agree}, window={self.window}): agreement needs at most the window's drifts"
            )
        if not 0 < self.share < 1:
            raise ConfigurationError(f"LearnRules(share={self.share!r}): the share of the limit must be in (0, 1)")
        for name in ("ttl", "probe_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ConfigurationError(f"LearnRules({name}={value!r}): {name} must be a number of seconds >= 0")


#: Request fields an OpenAI-compatible server (vLLM, SGLang) renders into the prompt beside the messages, which the
#: keeper's count does not see, each with the value that changes nothing (``...``: any value set counts).
PROMPT_FIELDS: Mapping[str, Any] = MappingProxyType(
    {
        "documents": ...,  # handed to the chat template (RAG templates render them)
        "chat_template": ...,  # a per-request template
        "chat_template_kwargs": ...,  # splatted into the template (enable_thinking, thinking, controls...)
        "mm_processor_kwargs": ...,  # how many tokens an image or a video becomes
        "add_generation_prompt": True,
        "continue_final_message": False,
        "add_special_tokens": False,
    }
)


def _given(value: Any) -> bool:
    """A value the caller set (the openai SDK's ``NOT_GIVEN`` and ``omit`` are not)."""
    return value is not None and type(value).__name__ not in ("NotGiven", "Omit")


def _sources(params: Mapping[str, Any]) -> tuple[Mapping[str, Any], ...]:
    """The call's arguments, and their ``extra_body`` (where the SDK carries fields it does not know)."""
    extra = params.get("extra_body")
    return (params, extra) if isinstance(extra, Mapping) else (params,)


def request_features(messages: Any, params: Mapping[str, Any]) -> frozenset[str]:
    """What the server counts in this request that the keeper's count cannot see exactly: the names of the known
    :data:`PROMPT_FIELDS` it sets (in ``params`` or their ``extra_body``), and the kinds of media its messages carry
    (``"image"``, ``"audio"``, ``"video"``, ``"file"``: their cost per part is an estimate). Unknown fields are not
    features (servers ignore them), so a client cannot grow the keeper's state by inventing names."""
    found: set[str] = set()
    for source in _sources(params):
        for name, neutral in PROMPT_FIELDS.items():
            value = source.get(name)
            if not _given(value) or value == neutral:
                continue
            if neutral is ... and isinstance(value, (str, list, tuple, dict)) and not value:
                continue  # an empty template, document list or kwargs changes nothing
            found.add(name)
    for message in messages if isinstance(messages, (list, tuple)) else ():
        content = _get(message, "content")
        if isinstance(content, (list, tuple)):
            for part in content:
                kind = _get(part, "type")
                if isinstance(kind, str) and kind in PART_MODALITY:
                    found.add(PART_MODALITY[kind])
    return frozenset(found)


def sequences_of(params: Mapping[str, Any]) -> int:
    """The answers the server generates for one prompt: ``max(n, best_of)`` (each 1 when not given, in ``params``
    or their ``extra_body``). Raises :class:`ConfigurationError` for a value that is not a whole number >= 1."""
    most = 1
    for source in _sources(params):
        for name in ("n", "best_of"):
            value = source.get(name)
            if not _given(value):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigurationError(
                    f"{name} must be a whole number >= 1 (the answers the server generates for the prompt), got "
                    f"{value!r}. Fix: pass {name}=1 or more, or leave it out"
                )
            most = max(most, value)
    return most


@dataclass
class _Scoped:
    """What one conversation's requests with one feature set cost beyond our count, on one server."""

    hidden: int
    at: float  # time.monotonic() when learned
    source: str  # "reply" | "refusal"
    limit: int | None = None  # derived from an overshoot refusal of this scope (not a server-wide fact)


@dataclass
class ServerState:
    """What the keeper learned about one server: its own observations, and the facts other replicas share."""

    limit: int | None = None  # the context length the server stated in a refusal (or an overshoot implied)
    kind: str | None = None  # the server software, when recognised: "vllm", "llama.cpp", "ollama", "openai"
    drifts: deque[_Drift] = field(default_factory=lambda: deque(maxlen=8), repr=False)  # plain requests' latest
    peers: dict[str, WrittenFacts] = field(default_factory=dict, repr=False)  # other replicas' facts, by writer
    accepted: int = 0  # the largest prompt the server accepted (a stated limit below it is wrong)
    rejects: int = 0
    recoveries: int = 0
    drift_warned: bool = False
    scope_warned: bool = False  # (the same, for a drift of a request with features)
    last_drift: int | None = None
    shared: ServerFacts | None = field(default=None, repr=False)  # the facts this process last shared
    shared_at: float = field(default=0.0, repr=False)  # when (time.monotonic())
    pulled: bool = field(default=False, repr=False)  # read from the shared state once (later: with each admission)

    def agreed(self, rules: LearnRules, now: float, source: str | None = None) -> tuple[int, int] | None:
        """``(offset, drifts)``: the offset this process's live drifts (of ``source`` only, when given) agree on,
        and how many there are; None without any."""
        live = sorted(
            (d.tokens for d in self.drifts if now - d.at <= rules.ttl and source in (None, d.source)), reverse=True
        )
        if not live:
            return None
        value = live[rules.agree - 1] if len(live) >= rules.agree else live[-1]
        return max(0, value), len(live)

    def facts(self, rules: LearnRules, now: float) -> ServerFacts:
        """What this process shares of what it learned itself."""
        own, measured = self.agreed(rules, now), self.agreed(rules, now, "reply")
        return ServerFacts(
            limit=self.limit,
            hidden=own[0] if own else 0,
            measured=measured[0] if measured else 0,
            kind=self.kind,
            samples=own[1] if own else 0,
        )


@dataclass(frozen=True, kw_only=True)
class CallReport:
    """One wrapped call: how many attempts, what was recovered, the counts on both sides, admission, memory."""

    server: str
    attempts: int
    recoveries: tuple[str, ...]
    tokens: int  # our exact count of the prompt sent last (0: no prompt was made)
    max_tokens: int  # the answer reserved
    server_prompt_tokens: int | None  # the server's count (usage.prompt_tokens), when it reported one
    completion_tokens: int | None  # the answer's tokens, when the server reported them
    drift: int | None  # server minus ours
    withheld: int  # tokens kept free below the keeper's limit as the call ended (server limit, hidden, shrinking)
    admission: str  # "unlimited", "admitted", "waited 0.20 s", "shrunk to N tokens"
    kv_bytes: int | None  # the KV cache the prompt plus answer takes on the model's runtime (model given)
    kv_share: float | None  # of the KV capacity on the GPU (model and GPU given)
    cache_bytes: int | None  # what a local model's cache really held
    seconds: float
    server_kind: str | None = None  # the server software, when recognised
    error: str | None = None  # why the call failed (None: it succeeded)
    # The prefix cache: the prompt tokens the server says it reused (usage.prompt_tokens_details.cached_tokens, or
    # llama.cpp's timings.cache_n), beside the prediction: the tokens of the prompt that are a prefix of the
    # conversation's previous prompt (fit.report.prefix_tokens).
    cached_tokens: int | None = None
    prefix_tokens: int | None = None
    # What the last attempt kept free for what the server counts beyond our count (``withheld`` is what the keeper
    # keeps free after the call, for the calls that follow), and where that came from: "agreed" (this process's
    # drifts agree), "shared" (the replicas' lower median), "scope" (this conversation's requests with these
    # features), "refusal" (this call's own refusal), "probe" (sent without any, to measure).
    hidden: int = 0
    hidden_from: str | None = None
    features: tuple[str, ...] = ()  # what the server counts that our count cannot see (request_features)
    sequences: int = 1  # answers generated (n, best_of): admitted as the prompt plus this many answers

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["recoveries"] = list(self.recoveries)
        data["features"] = list(self.features)
        return data


class Keeper(Protocol):
    """The few members of a keeper a wrapped call uses (:class:`~contextkeeper.keeper.ContextKeeper` has them)."""

    @property
    def limit(self) -> int: ...
    @property
    def policy(self) -> Any: ...  # its ``answer_tokens``: the answer reserved when a call names none
    @property
    def server(self) -> Dialect: ...  # whose preprocessing counts follow, for the drift advice
    @property
    def monitor(self) -> Any: ...  # a MemoryMonitor sampled after each call, or None

    def fit(
        self,
        messages: Any,
        *,
        tools: Any = None,
        max_tokens: int | None = None,
        reserve: Reserve | None = None,
        conversation: str | None = None,
    ) -> Fit: ...

    def session(self, conversation: str | None = None) -> Session: ...

    def kv_bytes(self, tokens: int) -> tuple[int | None, float | None]: ...


@dataclass(frozen=True, kw_only=True)
class Hooks:
    """What the owner of a call hears as it goes, as httpx's event hooks: each event a tuple of callables.

    ``fit``: each fit of an attempt (the keeper keeps the latest as ``last_fit``); ``attempt``: a request leaves for
    the backend; ``back``: an attempt is over (answered, failed, or its stream ended); ``report``: the call's
    report at its end (``last_call``). A hook must not raise: it runs inside the call."""

    fit: tuple[Callable[[Fit], None], ...] = ()
    attempt: tuple[Callable[[Request], None], ...] = ()
    back: tuple[Callable[[], None], ...] = ()
    report: tuple[Callable[[CallReport], None], ...] = ()

    def __add__(self, other: Hooks) -> Hooks:
        return Hooks(
            fit=self.fit + other.fit,
            attempt=self.attempt + other.attempt,
            back=self.back + other.back,
            report=self.report + other.report,
        )


NO_HOOKS = Hooks()


@dataclass
class Calls:
    """What every wrapped client of one keeper shares: the fit lock, servers learned, the ledger, the
    transcript, counters."""

    keeper: Keeper
    hooks: Hooks = NO_HOOKS  # the keeper's own: it records the latest fit and call
    lock: threading.RLock = field(default_factory=threading.RLock)
    servers: dict[str, ServerState] = field(default_factory=dict)
    ledger: Ledger | None = None
    transcript: Any = None
    calls: int = 0
    shared: SharedState | None = None  # what replicas learn once (ContextKeeper(shared=...))
    # A Redis ledger on the shared state's own Redis: each admission's script also reads the server's facts (a copy
    # under the pool's hash tag), so a call needs no round trip of its own for them.
    facts_ledger: RedisLedger | None = None
    rules: LearnRules = field(default_factory=LearnRules)
    # Offsets of requests with features, owned by their conversation's session (gone when it is evicted): per
    # session, the latest few (server, feature set) scopes.
    scopes: weakref.WeakKeyDictionary[Session, OrderedDict[tuple[str, frozenset[str]], _Scoped]] = field(
        default_factory=weakref.WeakKeyDictionary, repr=False
    )
    # When each (server, conversation or None, feature set) was last probed (time.monotonic()), the latest few.
    probes: OrderedDict[tuple[str, str | None, frozenset[str]], float] = field(default_factory=OrderedDict, repr=False)

    def server(self, name: str, kind: str | None = None) -> ServerState:
        with self.lock:
            state = self.servers.get(name)
            if state is None:
                state = self.servers[name] = ServerState(drifts=deque(maxlen=self.rules.window))
            state.kind = state.kind or kind
            return state

    # -------------------------------------------------------------------------------- what is learned
    def _fresh_peers(self, state: ServerState) -> list[ServerFacts]:
        if self.shared is None or not state.peers:
            return []
        now, ttl = time.time(), self.shared.ttl
        return [record.facts for record in state.peers.values() if record.fresh(now, ttl)]

    def limit(self, state: ServerState) -> int | None:
        """The server's limit: the least stated by this process and the fresh replicas, leaving out any below a
        prompt the server accepted (disproved)."""
        with self.lock:
            stated = [state.limit, *(facts.limit for facts in self._fresh_peers(state))]
            known = [limit for limit in stated if limit is not None and limit >= state.accepted]
            return min(known) if known else None

    def plain(self, state: ServerState, ceiling: int) -> tuple[int, str | None, str]:
        """``(tokens, label, why)``: what plain requests to this server keep free for what it counts beyond our
        count, where it comes from ("agreed", "shared"), and why in words; ``ceiling``: the limit the share is of."""
        rules, now = self.rules, time.monotonic()
        with self.lock:
            own = state.agreed(rules, now)
            votes = [facts.hidden for facts in self._fresh_peers(state) if facts.votes]
        if own is None and not votes:
            return 0, None, ""
        if votes:
            value = lower_median([own[0], *votes] if own is not None else votes)
            label, why = "shared", f"the lower median of {len(votes) + (own is not None)} replicas' agreed offsets"
        else:
            assert own is not None
            value, count = own
            label = "agreed"
            why = (
                f"agreed: the {_ordinal(rules.agree)} largest of the last {count} drifts seen"
                if count >= rules.agree
                else f"the smallest of the {count} drift(s) seen so far"
            )
        most = int(ceiling * rules.share)
        if value > most:
            value, why = most, f"{why}, bounded to {rules.share:.0%} of the limit"
        return value, label, why

    def scoped(self, session: Session, server: str, features: frozenset[str]) -> _Scoped | None:
        """The live offset of ``session``'s requests with ``features`` to ``server``, or None."""
        with self.lock:
            entries = self.scopes.get(session)
            entry = entries.get((server, features)) if entries is not None else None
            if entry is None or entries is None:
                return None
            if time.monotonic() - entry.at > self.rules.ttl:
                del entries[(server, features)]
                return None
            entries.move_to_end((server, features))
            return entry

    def charge(
        self,
        session: Session,
        server: str,
        features: frozenset[str],
        *,
        hidden: int | None = None,
        source: str = "reply",
        limit: int | None = None,
        accepted: int | None = None,
    ) -> None:
        """Learn what ``session``'s requests with ``features`` cost on ``server``: a reply's measured ``hidden``
        replaces the scope's offset, a refusal's raises it (its count may be capped); ``limit`` lowers the scope's
        own limit, and a prompt ``accepted`` above it drops it."""
        with self.lock:
            entries = self.scopes.setdefault(session, OrderedDict())
            key = (server, features)
            entry = entries.pop(key, None)
            if entry is None:
                entry = _Scoped(hidden=0, at=time.monotonic(), source=source)
            if hidden is not None:
                if source == "reply" or hidden > entry.hidden:
                    entry.hidden, entry.source = max(0, hidden), source
                entry.at = time.monotonic()
            if limit is not None:
                entry.limit = limit if entry.limit is None else min(entry.limit, limit)
            if accepted is not None and entry.limit is not None and accepted > entry.limit:
                entry.limit = None  # the server took more than that: the limit was wrong
            entries[key] = entry
            while len(entries) > self.rules.scopes:
                entries.popitem(last=False)

    def probe(self, key: tuple[str, str | None, frozenset[str]]) -> float:
        """Claim a probe of ``key`` (server, conversation or None, feature set): 0.0 when claimed, else the seconds
        until the next may go."""
        now = time.monotonic()
        with self.lock:
            last = self.probes.get(key)
            if last is not None and now - last < self.rules.probe_every:
                return self.rules.probe_every - (now - last)
            self.probes[key] = now
            self.probes.move_to_end(key)
            while len(self.probes) > 1024:
                self.probes.popitem(last=False)
            return 0.0

    # ------------------------------------------------------------------------------------ replicas
    def pull(self, name: str) -> None:
        """Take what other replicas learned about server ``name`` since this process last looked (with a facts
        ledger, only the first time: later admissions bring them)."""
        if self.shared is None:
            return
        with self.lock:
            state = self.server(name)
            if self.facts_ledger is not None and state.pulled:
                return
        records = self.shared.server_records(name)
        self.adopt(name, records)
        with self.lock:
            state.pulled = True

    def adopt(self, name: str, records: list[WrittenFacts]) -> bool:
        """Take the replicas' ``records`` about server ``name`` (this process's own left out: it knows better);
        True if they changed."""
        own = self.shared.writer if self.shared is not None else None
        peers = {record.writer: record for record in records if record.writer != own}
        with self.lock:
            state = self.server(name)
            if peers == state.peers:
                return False
            state.peers = peers
            state.kind = state.kind or next((r.facts.kind for r in peers.values() if r.facts.kind), None)
            return True

    def push(self, name: str) -> None:
        """Share what this process learned about server ``name`` itself, when it changed (or, unchanged, a while
        after it was last written, so that it stays fresh)."""
        if self.shared is None:
            return
        now = time.monotonic()
        with self.lock:
            state = self.server(name)
            facts = state.facts(self.rules, now)
            if facts == state.shared and now - state.shared_at < self.shared.ttl / 4:
                return
            state.shared, state.shared_at = facts, now
        copies = (self.facts_ledger.facts_key(name),) if self.facts_ledger is not None else ()
        self.shared.learn_server(name, facts, copies=copies)


@dataclass(frozen=True, kw_only=True)
class Options:
    """Settings of one wrapped client."""

    attempts: int = 4  # calls per request, the first included
    backoff: float = 0.5  # seconds before the first transport retry; doubles each time
    max_backoff: float = 8.0
    conversation: str = "default"  # the keeper's session for these calls, and their transcript key
    lease: float | None = 300.0  # seconds a stream's admission lasts without a chunk read (None: until it ends)
    answer_keys: tuple[str, ...] = ("max_completion_tokens", "max_tokens")


def options(**given: Any) -> Options:
    """:class:`Options` from ``keeper.wrap(client, **given)``, every value checked."""
    known = {f.name for f in dataclasses.fields(Options)}
    unknown = sorted(set(given) - known)
    if unknown:
        raise ConfigurationError(
            f"keeper.wrap() got unknown option(s) {', '.join(map(repr, unknown))}. Fix: use "
            f"{', '.join(sorted(known - {'answer_keys'}))}"
        )

    def number(name: str, low: float, *, whole: bool = False, none: bool = False) -> None:
        value: Any = given.get(name, getattr(Options, name, None))
        if value is None and none:
            return
        ok = not isinstance(value, bool) and isinstance(value, (int if whole else (int, float)))
        if not ok or not math.isfinite(value) or value < low:
            kind = "an integer" if whole else "a number"
            raise ConfigurationError(f"keeper.wrap(..., {name}={value!r}): {name} must be {kind} >= {low}")

    number("attempts", 1, whole=True)
    number("backoff", 0)
    number("max_backoff", 0)
    number("lease", 0.001, none=True)
    if not isinstance(given.get("conversation", "-"), str) or not given.get("conversation", "-"):
        raise ConfigurationError(
            f"keeper.wrap(..., conversation={given['conversation']!r}): the conversation key must be a non-empty string"
        )
    return Options(**given)


class Call:
    """One wrapped call across its attempts."""

    def __init__(
        self,
        calls: Calls,
        backend: Backend,
        options: Options,
        messages: Any,
        tools: Any,
        params: dict[str, Any],
        *,
        hooks: Hooks = NO_HOOKS,
    ) -> None:
        self.calls = calls
        self.keeper = calls.keeper
        self.hooks = calls.hooks + hooks
        self.backend = backend
        self.options = options
        self.messages = messages
        self.tools = list(tools) if tools else None
        self.params = params
        key = next((key for key in options.answer_keys if params.get(key) is not None), None)
        self.answer_key = key
        self.max_tokens: int | None = int(params[key]) if key is not None else None
        self.answer = self.max_tokens if self.max_tokens is not None else self.keeper.policy.answer_tokens
        self.server = calls.server(backend.server, getattr(backend, "kind", None))
        self.sequences = 1  # answers the server generates (n, best_of), read in begin
        self.features: frozenset[str] = frozenset()  # what our count cannot see (begin): picks what is withheld
        self.charged = self.features  # those the fitted prompt kept (media can be trimmed): where drifts go
        self.session: Session | None = None  # the conversation's session: it owns the scoped offsets
        self.attempts = 0
        self.sent = 0  # requests that went to the backend (an attempt refused by our own checks never did)
        self.fit: Fit | None = None
        self.admitting = Admitting(calls, backend.server, options.lease if params.get("stream") else None)
        self.recording = CallRecord(calls.transcript, options.conversation, messages, self.tools)
        self.recovery = Recovery(self)
        self.started = time.perf_counter()
        self.trace: tracing.CallTrace | None = None  # its spans, when a tracer provider is set

    # ---------------------------------------------------------------------------------------- steps
    def begin(self) -> None:
        """Write ahead: the caller's messages go to the transcript first (a store over the network answers while
        the call fits; :meth:`prepare` waits for them to be durable before the request leaves). With shared
        state, take what other replicas learned about the server, while that write travels."""
        self.sequences = sequences_of(self.params)  # a bad n or best_of is refused before anything is kept
        self.features = self.charged = request_features(self.messages, self.params)
        self.recording.begin()
        try:
            self.calls.pull(self.backend.server)
        except BaseException as exc:
            self.error(exc)  # (its inputs are written: the entry says why the call went no further)
            raise
        self.trace = tracing.start(self)

    def _fit(self, withheld: int, trusted: bool = False) -> Fit:
        with tracing.fitting(self.trace) as traced:
            fit = self._fit_once(withheld, trusted)
            traced(fit)
        return fit

    def _fit_once(self, withheld: int, trusted: bool) -> Fit:
        # The conversation's own session: its fits follow one another, other conversations fit alongside.
        fit = self.keeper.fit(
            self.messages,
            tools=self.tools,
            max_tokens=self.max_tokens,
            reserve=self._reserve(withheld, trusted),
            conversation=self.options.conversation,
        )
        report = fit.report
        if withheld:
            answer = self.answer
            reasons = ", ".join(why for why, _ in self.recovery.reasons(trusted))
            why = f"{withheld:,} tokens withheld below the limit ({reasons})"
            report = report.with_slots(
                lambda slots: {**slots, "answer": answer, "withheld": withheld},
                max_tokens=answer,
                notes=(*report.notes, why),
            )
        fit = Fit(messages=fit.messages, tokens=fit.tokens, report=report)
        for hook in self.hooks.fit:
            hook(fit)
        return fit

    def _reserve(self, withheld: int, trusted: bool) -> Reserve:
        """How this fit's reserve is made up, for the keeper's errors: the answer's setting and what is withheld."""
        reasons = self.recovery.reasons(trusted) if withheld else []
        return Reserve(
            answer_setting=self.answer_key,
            withheld=withheld,
            why="; ".join(why for why, _ in reasons),
            fix="; or ".join(dict.fromkeys(fix for _, fix in reasons)),
        )

    def prepare(self) -> Generator[tuple[int, int], Ticket, Request]:
        """Fit under everything learned so far, then ask the driver for room in the ledger (it yields
        ``(tokens, minimum)`` and receives the ticket; sync and async drivers wait differently)."""
        self.attempts += 1
        self.recovery.checking = False
        self.admitting.granted = None
        if self.features and self.session is None:
            # (the session the fit uses: kept while the call runs, so what is learned lands where it was measured)
            self.session = self.keeper.session(self.options.conversation)
        withheld = self.recovery.withheld()
        try:
            fit = self._fit(withheld)
        except RequestTooLarge as refused:
            # Learned offsets may be wrong (a server that overstated a prompt, a drift no longer there): rather
            # than refuse this request, and every later one, send it once without them and learn from the answer.
            # At most once per call, and per server and scope once per probe_every seconds.
            trusted = self.recovery.withheld(trusted=True)
            if self.recovery.checked or trusted >= withheld:
                raise
            why = self.recovery.offset()[2]
            fit = self._fit(trusted, trusted=True)
            if self.calls.probe(self.recovery.probe_key()) > 0:  # probed recently: the reasons say when the next may go
                raise refused from None
            self.recovery.recoveries.append(
                f"the {withheld - trusted:,} tokens withheld for what the server counts beyond our count ({why}) "
                "left no room for the request: sent without them once, to check them"
            )
            self.recovery.checking = self.recovery.checked = True
            withheld = trusted
        if self.calls.ledger is not None:
            answers = self.sequences * self.answer  # n sequences share the prompt's blocks, each has its answer
            need = fit.tokens + answers
            floor = fit.tokens - fit.report.history_after + answers  # never-trimmed parts plus the answers
            ticket = yield need, floor
            self.admitting.ticket = ticket
            # Through a facts ledger the admission read the replicas' facts (none: there are none, or all expired).
            records = WrittenFacts.array(ticket.facts) if ticket.facts else []
            read = self.calls.facts_ledger is not None and self.calls.adopt(self.backend.server, records)
            if read and self.recovery.withheld(self.recovery.checking) > withheld:
                # Another replica learned the server meanwhile (read with the admission): fit under it, and hold
                # only what that prompt needs.
                withheld = self.recovery.withheld(self.recovery.checking)
                fit = self._fit(withheld, trusted=self.recovery.checking)
                need = fit.tokens + answers
                if need < ticket.tokens:
                    ticket.resize(need)
            if ticket.tokens < need:  # mode "shrink": fit again into what was granted
                self.admitting.granted = ticket.tokens
                room = ticket.tokens - answers + self.answer  # for the prompt and one answer
                fit = self._fit(max(withheld, self.keeper.limit - room), trusted=self.recovery.checking)
                ticket.resize(fit.tokens + answers)
                self.admitting.status = f"shrunk to {fit.tokens + answers:,} tokens"
            elif ticket.waited:
                self.admitting.status = f"waited {ticket.waited:.2f} s"
            else:
                self.admitting.status = "admitted"
        self.fit = fit
        self.recovery.sent_offset = self.recovery.offset(self.recovery.checking)[:2]
        if self.features:
            self.charged = request_features(fit.messages, self.params)
        self.recording.durable()  # write-ahead: nothing leaves before the inputs are committed
        params = dict(self.params)
        params["messages"] = fit.messages
        request = Request(
            messages=fit.messages,
            tools=self.tools,
            max_tokens=self.max_tokens,
            params=params,
            stream=bool(params.get("stream")),
            finish=self.finish,
            renew=self.admitting.renew,
        )
        if self.trace is not None:
            self.trace.sent(request)
        self.sent += 1
        return request

    def prepared(self) -> Request:
        """:meth:`prepare`, admitted by blocking (sync calls)."""
        steps = self.prepare()
        ask = _advance(steps, None)
        while not isinstance(ask, Request):
            ledger, settings = self.admitting.ask(ask)
            ask = _advance(steps, ledger.acquire(ask[0], **settings))
        return self._leaving(ask)

    async def prepared_async(self) -> Request:
        """:meth:`prepare` with the fit on a worker thread and admission awaited on the loop: a blocked
        admission must not hold an executor thread the loop needs (name resolution, for one)."""
        steps = self.prepare()
        ask = await asyncio.to_thread(_advance, steps, None)
        while not isinstance(ask, Request):
            ledger, settings = self.admitting.ask(ask)
            ticket = await ledger.acquire_async(ask[0], **settings)
            ask = await asyncio.to_thread(_advance, steps, ticket)
        return self._leaving(ask)

    def _leaving(self, request: Request) -> Request:
        for hook in self.hooks.attempt:
            hook(request)
        return request

    def _back(self) -> None:
        for hook in self.hooks.back:
            hook()

    def failed(self, exc: BaseException) -> None:
        """Learn from the failure and raise what the retry loop acts on: a ProviderError to retry, or the
        caller's own exception unchanged."""
        self._back()
        self.admitting.release()
        failure = classify(exc)
        if self.trace is not None:
            self.trace.failed(exc, failure.kind)
        if failure.kind == "other":
            raise exc
        raise self.recovery.learn(failure) from exc

    def done(self, reply: Reply) -> Any:
        if not reply.pending:
            self.finish(reply)
        return reply.result

    def finish(self, reply: Reply) -> BaseException | None:
        """The call's end (for a stream: when it was consumed, closed, collected or broke): learn, report,
        record. Returns the error to raise for a reply that failed (a stream that broke after its first chunk)."""
        self._back()
        self.admitting.release()
        if reply.server_kind is not None:
            self.server.kind = reply.server_kind
        if reply.error is not None:
            return self._broke(reply)
        fit = self.fit
        assert fit is not None
        drift = None
        if reply.prompt_tokens is not None:
            drift = reply.prompt_tokens - fit.tokens
            name = self.backend.server
            with self.calls.lock:
                server = self.server
                server.last_drift = drift
                server.accepted = max(server.accepted, reply.prompt_tokens)
                if server.limit is not None and reply.prompt_tokens > server.limit:
                    server.limit = None  # it took more than the limit a refusal gave: that limit was wrong
                # Measured: what the server counts beyond ours is this. It replaces what this call's refusals
                # implied, in the call and where it was charged: the scope, or this call's drift in the window.
                if self.charged and self.session is not None:
                    self.calls.charge(
                        self.session, name, self.charged, hidden=drift, source="reply", accepted=reply.prompt_tokens
                    )
                else:
                    self.recovery.note_drift(drift, "reply")
                self.recovery.implied = 0
                # Once per server for plain requests, and once for requests with features (another cause).
                warned = "scope_warned" if self.charged else "drift_warned"
                warn = drift != 0 and not getattr(server, warned)
                if warn:
                    setattr(server, warned, True)
            self.calls.push(name)
            if warn:
                self.recovery.warn_drift(fit, reply.prompt_tokens, drift)
        if self.recovery.recoveries:
            with self.calls.lock:
                self.server.recoveries += 1
        report = self._reported(reply, drift)
        self._record(reply, None)
        self._log(fit, report)
        monitor = self.keeper.monitor
        if monitor is not None:
            monitor.request_done(label=f"call {self.calls.calls}")
        return None

    def _broke(self, reply: Reply) -> BaseException | None:
        """A stream that did not end normally: map what broke it, and record the call as failed with what had
        arrived."""
        error = cause = reply.error
        if isinstance(cause, BaseException) and not isinstance(cause, StreamInterrupted):
            failure = classify(cause)
            if failure.kind == "transport":
                partial = str((reply.message or {}).get("content") or "")
                error = StreamInterrupted(
                    f"the stream broke after {reply.chunks} chunk(s) had reached you ({len(partial):,} characters "
                    f"of the reply): {failure.message[:300].rstrip('.')}. It was not retried, since part of the "
                    "reply had been passed on; the call is recorded as failed with that part. Fix: send the request "
                    "again (keeper.transcript keeps it), check the server and the network, or raise the client's "
                    "timeout",
                    partial=partial,
                    chunks=reply.chunks,
                    report=self.fit.report if self.fit is not None else None,
                    attempts=self.attempts,
                    cause=cause,
                )
        self._reported(reply, None, error)
        self._record(reply, error)
        return error if isinstance(error, BaseException) else None

    @property
    def recoveries(self) -> list[str]:
        """What the call recovered from, in order (refusals, out of memory, transport errors)."""
        return self.recovery.recoveries

    @property
    def admission(self) -> str:
        """How the call was admitted: "unlimited", "admitted", "waited 0.42 s" or "shrunk to N tokens"."""
        return self.admitting.status

    def _record(self, reply: Reply | None, exc: BaseException | str | None) -> None:
        with self.calls.lock:
            self.calls.calls += 1
        self.recording.end(reply, exc, fit=self.fit, attempts=self.attempts, sent=self.sent)

    def _report(self, reply: Reply | None, drift: int | None, error: BaseException | str | None = None) -> CallReport:
        fit = self.fit
        tokens = fit.tokens if fit is not None else 0
        kv_bytes, share = self.keeper.kv_bytes(tokens + self.sequences * self.answer)
        hidden, hidden_from = self.recovery.sent_offset
        report = CallReport(
            server=self.backend.server,
            attempts=self.attempts,
            recoveries=tuple(self.recovery.recoveries),
            tokens=tokens,
            max_tokens=self.answer,
            server_prompt_tokens=reply.prompt_tokens if reply is not None else None,
            completion_tokens=reply.completion_tokens if reply is not None else None,
            drift=drift,
            withheld=self.recovery.withheld(),
            admission=self.admitting.status,
            kv_bytes=kv_bytes,
            kv_share=share,
            cache_bytes=reply.cache_bytes if reply is not None else None,
            seconds=time.perf_counter() - self.started,
            server_kind=self.server.kind,
            error=None if error is None else (error if isinstance(error, str) else f"{type(error).__name__}: {error}"),
            cached_tokens=_cached(reply),
            prefix_tokens=fit.report.prefix_tokens if fit is not None else None,
            hidden=hidden,
            hidden_from=hidden_from if hidden or self.recovery.checking else None,  # (a probe keeps nothing free)
            features=tuple(sorted(self.features)),
            sequences=self.sequences,
        )
        if self.trace is not None:
            self.trace.end(report, reply)
        return report

    def _reported(self, reply: Reply | None, drift: int | None, error: BaseException | str | None = None) -> CallReport:
        """The call's report, handed to the ``report`` hooks."""
        report = self._report(reply, drift, error)
        for hook in self.hooks.report:
            hook(report)
        return report

    def error(self, exc: BaseException) -> None:
        """The call failed for good (a fit that cannot fit included): record it and free its admission."""
        self._back()
        self.admitting.release()
        try:
            self._reported(None, None, exc)
        finally:
            self._record(None, exc)

    @staticmethod
    def _log(fit: Fit, report: CallReport) -> None:
        if not log.isEnabledFor(logging.INFO):
            return
        slots = ", ".join(f"{k} {v:,}" for k, v in fit.report.slots.items())
        actions = "; ".join(f"{a.strategy}: {a.detail}" for a in fit.report.actions) or "none"
        log.info(
            "%s: %s prompt tokens (%s); strategies: %s; attempts %d; admission %s",
            report.server,
            f"{fit.tokens:,}",
            slots,
            actions,
            report.attempts,
            report.admission,
        )


def _get(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


def cached_tokens_of(response: Any) -> int | None:
    """The prompt tokens a server reused from its prefix cache, as its response (SDK object or dict, or a stream's
    usage chunk) reports them: ``usage.prompt_tokens_details.cached_tokens`` (OpenAI, vLLM, SGLang, recent
    llama-server), else llama-server's ``timings.cache_n``; None where neither is given."""
    details = _get(_get(response, "usage"), "prompt_tokens_details")
    cached = _get(details, "cached_tokens") if details is not None else None
    if cached is None:
        timings = _get(response, "timings")
        cached = _get(timings, "cache_n") if timings is not None else None
    return int(cached) if isinstance(cached, (int, float)) and not isinstance(cached, bool) else None


def _cached(reply: Reply | None) -> int | None:
    if reply is None:
        return None
    known = getattr(reply, "cached_tokens", None)  # a stream's, read from its usage chunk
    return int(known) if isinstance(known, int) else cached_tokens_of(reply.result)


def _advance(steps: Generator[tuple[int, int], Ticket, Request], ticket: Ticket | None) -> tuple[int, int] | Request:
    """The next admission request of ``steps``, or its Request when done (StopIteration cannot cross threads)."""
    try:
        return next(steps) if ticket is None else steps.send(ticket)
    except StopIteration as done:
        return cast(Request, done.value)


def _retrying(call: Call, cls: Any) -> Any:
    import tenacity

    return cls(
        stop=tenacity.stop_after_attempt(call.options.attempts),
        # A transcript that cannot store the inputs is not the provider's transport: no retry sends them again.
        retry=tenacity.retry_if_exception_type((ContextLengthExceeded, OutOfMemory, TransportError))
        & tenacity.retry_if_not_exception_type(TranscriptUnavailable),
        wait=lambda state: call.recovery.wait(state.outcome.exception() if state.outcome else None),
        reraise=True,
    )


def call_sync(call: Call) -> Any:
    """Run ``call`` to its end, retrying per the recovery rules."""
    import tenacity

    call.begin()
    try:
        for attempt in _retrying(call, tenacity.Retrying):
            with attempt:
                request = call.prepared()
                try:
                    reply = call.backend.complete(request)
                    if inspect.isawaitable(reply):
                        if inspect.iscoroutine(reply):
                            reply.close()  # never awaited: say so once, here, not as a warning at exit
                        raise TypeError("this backend is async: wrap an async client or use the async call")
                except BaseException as exc:
                    call.failed(exc)
                return call.done(cast(Reply, reply))
    except BaseException as exc:
        call.error(exc)
        raise
    raise AssertionError("unreachable: tenacity either returns or raises")  # pragma: no cover


async def call_async(call: Call) -> Any:
    """The async :func:`call_sync`: the first write, the fit and admission off the loop, the backend on it."""
    import tenacity

    CALLER_LOOP.set(asyncio.get_running_loop())
    await asyncio.to_thread(call.begin)
    try:
        async for attempt in _retrying(call, tenacity.AsyncRetrying):
            with attempt:
                request = await call.prepared_async()
                try:
                    reply = call.backend.complete(request)
                    if inspect.isawaitable(reply):
                        reply = await reply
                except BaseException as exc:
                    call.failed(exc)
                return call.done(cast(Reply, reply))
    except BaseException as exc:
        call.error(exc)
        raise
    raise AssertionError("unreachable: tenacity either returns or raises")  # pragma: no cover
