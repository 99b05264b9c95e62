"""One wrapped call: record, fit, admit, send, recover, record — written once, driven by a sync and an async loop.

The per-attempt steps live on :class:`Call` (``begin``, ``prepare``, ``failed``, ``done``, ``finish``);
:func:`call_sync` and :func:`call_async` only differ in how they wait (tenacity's ``Retrying`` vs
``AsyncRetrying``) and in running the CPU-bound fit and the transcript's first write on a worker thread so an
event loop is never blocked by them.

Write ahead. Before the first fit, the caller's messages go to the transcript (committed, for a SQLite file), and
the call's entry is completed or marked failed when it ends, so a crash in between loses nothing it was given.

Recovery. A refusal for length teaches the keeper about the server: the limit it reported, and the tokens it
counted beyond ours (a hidden system prompt, a different template). Both are kept per server, so later calls fit
under them and are not refused again. What a refusal implies is bounded (at most half the server's limit) and
heals: the first reply that reports its usage replaces it with what was measured, and a request that cannot fit
under it alone is sent once without it, to check it. A refusal without numbers shrinks the budget by a step that
doubles. A local out-of-memory error shrinks the prompt to three quarters. Transport errors (timeouts, 429, 5xx,
malformed replies, a stream that breaks before its first chunk) are retried with exponential backoff, and only
they wait. This is the only retry policy of a wrapped call: the openai SDK's own retries are turned off for the
requests the wrapper sends.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import inspect
import logging
import math
import sys
import threading
import time
import warnings
from collections import deque
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from .. import tracing
from .._exceptions import (
    ConfigurationError,
    ContextLengthExceeded,
    OutOfMemory,
    ProviderError,
    StreamInterrupted,
    TranscriptUnavailable,
    TransportError,
)
from ..dialects import DIALECTS
from ..shared import ServerFacts
from .base import Backend, Reply, Request
from .errors import Attempted, Failure, classify, provider_error
from .servers import Drift, fewer_advice, kind_of_error

if TYPE_CHECKING:
    from ..keeper import ContextKeeper, Fit, Reserve
    from ..ledger import Ledger, Ticket
    from ..redis_ledger import RedisLedger
    from ..shared import SharedState
    from ..transcript import Begun, TranscriptEntry

__all__ = ["CallReport", "DriftWarning", "ServerState", "cached_tokens_of", "call_async", "call_sync"]

log = logging.getLogger("contextkeeper")

#: The event loop of an async wrapped call, seen by the fit's worker thread (asyncio.to_thread copies context):
#: an async summarizer is run on that loop, where its client lives.
CALLER_LOOP: contextvars.ContextVar[asyncio.AbstractEventLoop | None] = contextvars.ContextVar(
    "contextkeeper_caller_loop", default=None
)


class DriftWarning(UserWarning):
    """The server counted the prompt differently from the keeper (warned once per server)."""


@dataclass
class ServerState:
    """What the keeper learned about one server."""

    limit: int | None = None  # the context length the server reported
    hidden: int = 0  # tokens kept free for what the server counts beyond our count
    measured: int = 0  # the part of ``hidden`` measured on replies (usage.prompt_tokens), not implied by refusals
    confirmed: bool = False  # a refusal of a check sent without the implied offset bore it out
    rejects: int = 0
    recoveries: int = 0
    drift_warned: bool = False
    last_drift: int | None = None
    kind: str | None = None  # the server software, when recognised: "vllm", "llama.cpp", "ollama", "openai"
    drifts: deque[int] = field(default_factory=lambda: deque(maxlen=8), repr=False)  # the latest measured
    shared: ServerFacts | None = field(default=None, repr=False)  # the facts as last read from or shared with replicas
    pulled: bool = field(default=False, repr=False)  # read from the shared state once (later: with each admission)

    def facts(self) -> ServerFacts:
        """What replicas share of this state."""
        return ServerFacts(
            limit=self.limit, hidden=self.hidden, measured=self.measured, confirmed=self.confirmed, kind=self.kind
        )

    def adopt(self, facts: ServerFacts) -> None:
        """Take what another replica learned."""
        self.limit, self.hidden, self.measured = facts.limit, facts.hidden, facts.measured
        self.confirmed = facts.confirmed
        self.kind = self.kind or facts.kind
        self.shared = facts


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
    withheld: int  # tokens kept free below the keeper's limit (server limit, hidden tokens, shrinking)
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

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["recoveries"] = list(self.recoveries)
        return data


@dataclass
class Calls:
    """What every wrapped client of one keeper shares: the fit lock, servers learned, the ledger, the
    transcript, counters."""

    keeper: ContextKeeper
    lock: threading.RLock = field(default_factory=threading.RLock)
    servers: dict[str, ServerState] = field(default_factory=dict)
    ledger: Ledger | None = None
    transcript: Any = None
    calls: int = 0
    shared: SharedState | None = None  # what replicas learn once (ContextKeeper(shared=...))
    # A Redis ledger on the shared state's own Redis: each admission's script also reads the server's facts (a copy
    # under the pool's hash tag), so a call needs no round trip of its own for them.
    facts_ledger: RedisLedger | None = None

    def server(self, name: str, kind: str | None = None) -> ServerState:
        with self.lock:
            state = self.servers.setdefault(name, ServerState())
            state.kind = state.kind or kind
            return state

    def pull(self, name: str) -> None:
        """Take what other replicas learned about server ``name`` since this process last looked (with a facts
        ledger, only the first time: later admissions bring them)."""
        if self.shared is None:
            return
        with self.lock:
            state = self.servers.setdefault(name, ServerState())
            if self.facts_ledger is not None and state.pulled:
                return
        facts = self.shared.server(name)
        self.adopt(name, facts)
        with self.lock:
            state.pulled = True

    def adopt(self, name: str, facts: ServerFacts | None) -> bool:
        """Take ``facts`` (about server ``name``, as replicas share them) when they are new; True if they were."""
        with self.lock:
            state = self.servers.setdefault(name, ServerState())
            if facts is None or facts == state.shared:
                return False
            state.adopt(facts)
            return True

    def push(self, name: str) -> None:
        """Share what this process learned about server ``name``, when it changed."""
        if self.shared is None:
            return
        with self.lock:
            state = self.servers.setdefault(name, ServerState())
            facts = state.facts()
            if facts == state.shared:
                return
            state.shared = facts
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
        self, calls: Calls, backend: Backend, options: Options, messages: Any, tools: Any, params: dict[str, Any]
    ) -> None:
        self.calls = calls
        self.keeper = calls.keeper
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
        self.shrink = 0  # tokens withheld after refusals without numbers, or out-of-memory errors
        self.cap: int | None = None  # prompt cap after an out-of-memory error
        self.granted: int | None = None  # what a shrinking admission granted (prompt plus answer)
        self.checking = False  # this attempt was sent without what refusals implied, to check it
        self.checked = False
        self.attempts = 0
        self.recoveries: list[str] = []
        self.transport_failures: list[Failure] = []  # what the backoff reads: how many, and any Retry-After
        self.fit: Fit | None = None
        self.ticket: Ticket | None = None
        self.begun: Begun | None = None  # the inputs as written ahead
        self.entry: TranscriptEntry | None = None  # their entry, once durable
        self.admission = "unlimited"
        self.started = time.perf_counter()
        self.trace: tracing.CallTrace | None = None  # its spans, when a tracer provider is set

    # ---------------------------------------------------------------------------------------- steps
    def begin(self) -> None:
        """Write ahead: the caller's messages go to the transcript first (a store over the network answers while
        the call fits; :meth:`prepare` waits for them to be durable before the request leaves). With shared
        state, take what other replicas learned about the server, while that write travels."""
        transcript = self.calls.transcript
        if transcript is not None:
            inputs = self.messages if isinstance(self.messages, (list, tuple)) else []
            self.begun = transcript.begin(inputs, conversation=self.options.conversation, tools=self.tools)
        try:
            self.calls.pull(self.backend.server)
        except BaseException as exc:
            self.error(exc)  # (its inputs are written: the entry says why the call went no further)
            raise
        self.trace = tracing.start(self)

    def _durable(self) -> None:
        """Wait until the inputs :meth:`begin` wrote are committed (a failure is the transcript's typed error)."""
        if self.begun is not None and self.entry is None:
            self.entry = self.begun.wait()

    def _fit(self, withheld: int, trusted: bool = False) -> Fit:
        with tracing.fitting(self.trace) as traced:
            fit = self._fit_once(withheld, trusted)
            traced(fit)
        return fit

    def _fit_once(self, withheld: int, trusted: bool) -> Fit:
        from ..keeper import Fit

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
            reasons = ", ".join(why for why, _ in self._reasons(trusted))
            why = f"{withheld:,} tokens withheld below the limit ({reasons})"
            report = report.with_slots(
                lambda slots: {**slots, "answer": answer, "withheld": withheld},
                max_tokens=answer,
                notes=(*report.notes, why),
            )
        fit = Fit(messages=fit.messages, tokens=fit.tokens, report=report)
        self.keeper.last_fit = fit
        return fit

    def _reserve(self, withheld: int, trusted: bool) -> Reserve:
        """How this fit's reserve is made up, for the keeper's errors: the answer's setting and what is withheld."""
        from ..keeper import Reserve

        reasons = self._reasons(trusted) if withheld else []
        return Reserve(
            answer_setting=self.answer_key,
            withheld=withheld,
            why="; ".join(why for why, _ in reasons),
            fix="; or ".join(dict.fromkeys(fix for _, fix in reasons)),
        )

    def _reasons(self, trusted: bool = False) -> list[tuple[str, str]]:
        """Why tokens are withheld below the keeper's limit, each with what would free them."""
        reasons = []
        limit = self.server.limit
        if limit is not None and limit < self.keeper.limit:
            reasons.append(
                (
                    f"the server's own limit is {limit:,}, learned from its refusal",
                    "raise the server's context (vLLM --max-model-len, llama.cpp --ctx-size, Ollama num_ctx): "
                    "context_window is not what binds",
                )
            )
        hidden = self._hidden(trusted)
        if hidden:
            reasons.append(
                (
                    f"the server counts {hidden:,} tokens we cannot see",
                    "pass the server's own chat template and tokenizer, or have it add fewer tokens of its own "
                    "(a hidden system prompt)",
                )
            )
        if self.shrink and not trusted:
            reasons.append(
                (
                    f"{self.shrink:,} after refusals without numbers",
                    "set context_window to the server's context (vLLM max_model_len, llama.cpp n_ctx)",
                )
            )
        if self.cap is not None:
            reasons.append(
                (
                    f"prompt capped at {self.cap:,} after running out of memory",
                    "free GPU memory (a smaller KV dtype, fewer sequences at once)",
                )
            )
        if self.granted is not None:
            reasons.append(
                (
                    f"admission granted {self.granted:,} tokens while other calls held the rest",
                    "lower concurrency, or give the KV cache more room",
                )
            )
        return reasons or [("admission", "lower concurrency")]

    def _hidden(self, trusted: bool) -> int:
        """The tokens the server counts beyond ours: all that was learned, or (``trusted``) only what was measured
        on replies or borne out by a second refusal."""
        if trusted and not self.server.confirmed:
            return self.server.measured
        return self.server.hidden

    def _withheld(self, trusted: bool = False) -> int:
        limit = self.keeper.limit
        effective = min(limit, self.server.limit or limit) - self._hidden(trusted) - (0 if trusted else self.shrink)
        if self.cap is not None:
            effective = min(effective, self.cap + self.answer)
        return max(0, limit - effective)

    def prepare(self) -> Generator[tuple[int, int], Ticket, Request]:
        """Fit under everything learned so far, then ask the driver for room in the ledger (it yields
        ``(tokens, minimum)`` and receives the ticket; sync and async drivers wait differently)."""
        from ..keeper import RequestTooLarge

        self.attempts += 1
        self.checking = False
        self.granted = None
        withheld = self._withheld()
        try:
            fit = self._fit(withheld)
        except RequestTooLarge:
            # What refusals implied may be wrong (a server that overstates the prompt): rather than refuse this
            # request and every later one, send it once without that, and learn from the answer.
            trusted = self._withheld(trusted=True)
            if self.checked or trusted >= withheld:
                raise
            fit = self._fit(trusted, trusted=True)
            self.recoveries.append(
                f"the {withheld - trusted:,} tokens that refusals implied left no room for the request: sent "
                "without them once, to check them"
            )
            self.checking = self.checked = True
            withheld = trusted
        if self.calls.ledger is not None:
            need = fit.tokens + self.answer
            floor = fit.tokens - fit.report.history_after + self.answer  # never-trimmed parts plus the answer
            ticket = yield need, floor
            self.ticket = ticket
            facts = ServerFacts.from_json(ticket.facts) if ticket.facts else None
            if self.calls.adopt(self.backend.server, facts) and self._withheld() > withheld:
                # Another replica learned the server meanwhile (read with the admission): fit under it, and hold
                # only what that prompt needs.
                withheld = self._withheld()
                fit = self._fit(withheld)
                need = fit.tokens + self.answer
                if need < ticket.tokens:
                    ticket.resize(need)
            if ticket.tokens < need:  # mode "shrink": fit again into what was granted
                self.granted = ticket.tokens
                fit = self._fit(max(withheld, self.keeper.limit - ticket.tokens), trusted=self.checking)
                ticket.resize(fit.tokens + self.answer)
                self.admission = f"shrunk to {fit.tokens + self.answer:,} tokens"
            elif ticket.waited:
                self.admission = f"waited {ticket.waited:.2f} s"
            else:
                self.admission = "admitted"
        self.fit = fit
        self._durable()  # write-ahead: nothing leaves before the inputs are committed
        params = dict(self.params)
        params["messages"] = fit.messages
        request = Request(
            messages=fit.messages,
            tools=self.tools,
            max_tokens=self.max_tokens,
            params=params,
            stream=bool(params.get("stream")),
            finish=self.finish,
            renew=self.renew,
        )
        if self.trace is not None:
            self.trace.sent(request)
        return request

    def prepared(self) -> Request:
        """:meth:`prepare`, admitted by blocking (sync calls)."""
        steps = self.prepare()
        ask = _advance(steps, None)
        while not isinstance(ask, Request):
            ledger, settings = self._admission(ask)
            ask = _advance(steps, ledger.acquire(ask[0], **settings))
        return ask

    async def prepared_async(self) -> Request:
        """:meth:`prepare` with the fit on a worker thread and admission awaited on the loop: a blocked
        admission must not hold an executor thread the loop needs (name resolution, for one)."""
        steps = self.prepare()
        ask = await asyncio.to_thread(_advance, steps, None)
        while not isinstance(ask, Request):
            ledger, settings = self._admission(ask)
            ticket = await ledger.acquire_async(ask[0], **settings)
            ask = await asyncio.to_thread(_advance, steps, ticket)
        return ask

    def _admission(self, ask: tuple[int, int]) -> tuple[Ledger, dict[str, Any]]:
        """The ledger to ask for ``ask`` (tokens, minimum), and how: through a facts ledger, the server's shared
        facts come back with the admission."""
        settings: dict[str, Any] = {"minimum": ask[1], "label": self._label(), "lease": self._lease()}
        if self.calls.facts_ledger is not None:
            return self.calls.facts_ledger, {**settings, "facts": self.backend.server}
        assert self.calls.ledger is not None
        return self.calls.ledger, settings

    def _lease(self) -> float | None:
        """A stream's admission is a lease (it may be kept and never read); a plain call gives its tokens back
        when it returns or raises."""
        return self.options.lease if self.params.get("stream") else None

    def _label(self) -> str:
        return f"{self.backend.server} call {self.calls.calls + 1}"

    def _release(self) -> None:
        if self.ticket is not None:
            self.ticket.release(wait=False)  # a shared ledger gives the tokens back behind the call
            self.ticket = None

    def renew(self) -> None:
        """A sign of life (a stream chunk): the admission's lease starts again."""
        ticket = self.ticket
        if ticket is not None:
            ticket.renew()

    def failed(self, exc: BaseException) -> None:
        """Learn from the failure and raise what the retry loop acts on: a ProviderError to retry, or the
        caller's own exception unchanged."""
        self._release()
        failure = classify(exc)
        if self.trace is not None:
            self.trace.failed(exc, failure.kind)
        if failure.kind == "other":
            raise exc
        raise self._learn(failure) from exc

    def _learn(self, failure: Failure) -> ProviderError:
        """Learn what ``failure`` says about the server (its limit, hidden tokens) or the model (its memory),
        note the recovery, and give the error to raise if no attempt is left (worded in :mod:`.errors`)."""
        fit = self.fit
        sent = fit.tokens if fit is not None else 0
        if failure.kind == "context":
            before = self._withheld()
            bounded = ""
            with self.calls.lock:
                server = self.server
                server.rejects += 1
                server.kind = server.kind or kind_of_error(failure.message)
                if failure.limit is not None:
                    server.limit = failure.limit
                if failure.prompt_tokens is not None and failure.prompt_tokens > sent:
                    implied = failure.prompt_tokens - sent
                    # Sanity: a server that hides more than half of its own context is more likely miscounting.
                    most = (server.limit or self.keeper.limit) // 2
                    if implied > most:
                        bounded = f", bounded to {most:,} (half the server's limit)"
                    server.hidden = max(server.hidden, min(implied, most))
                    if self.checking:
                        server.confirmed = True  # refused without the offset too: it holds
                if failure.excess and failure.limit is None:
                    # Only the overshoot is known: the server's limit is at most what we sent less that.
                    server.limit = min(server.limit or self.keeper.limit, sent - failure.excess)
            self.calls.push(self.backend.server)
            if self._withheld() <= before:  # nothing new learned: step down, further each time
                step = max(64, self.keeper.limit // 20)
                self.shrink = max(step, 2 * self.shrink)
            self.recoveries.append(
                f"refused for length ({sent:,} tokens sent; server said limit {failure.limit}, prompt "
                f"{failure.prompt_tokens}{bounded}): refit {self._withheld():,} tokens below the limit"
            )
        elif failure.kind == "oom":
            self.cap = max(1, (sent * 3) // 4)
            self.recoveries.append(f"out of memory at {sent:,} prompt tokens: refit to at most {self.cap:,}")
        else:
            self.recoveries.append(f"transport error: {failure.message[:120]}")
            self.transport_failures.append(failure)
        attempted = Attempted(
            sent=sent,
            answer=self.answer,
            answer_key=self.answer_key,
            attempts=self.attempts,
            report=fit.report if fit is not None else None,
        )
        return provider_error(failure, attempted)

    def wait(self, exc: BaseException | None) -> float:
        """Seconds before the next attempt: only transport errors wait."""
        if not isinstance(exc, TransportError) or not self.transport_failures:
            return 0.0
        failure = self.transport_failures[-1]
        if failure.retry_after is not None:
            return min(failure.retry_after, self.options.max_backoff)
        tries = len(self.transport_failures)
        return float(min(self.options.backoff * 2 ** max(0, tries - 1), self.options.max_backoff))

    def done(self, reply: Reply) -> Any:
        if not reply.pending:
            self.finish(reply)
        return reply.result

    def finish(self, reply: Reply) -> BaseException | None:
        """The call's end (for a stream: when it was consumed, closed, collected or broke): learn, report,
        record. Returns the error to raise for a reply that failed (a stream that broke after its first chunk)."""
        self._release()
        if reply.server_kind is not None:
            self.server.kind = reply.server_kind
        if reply.error is not None:
            return self._broke(reply)
        fit = self.fit
        assert fit is not None
        drift = None
        if reply.prompt_tokens is not None:
            drift = reply.prompt_tokens - fit.tokens
            with self.calls.lock:
                server = self.server
                server.last_drift = drift
                # Measured: what the server counts beyond ours is this (the latest few, for templates whose
                # difference varies); it replaces whatever a refusal implied, which may have been wrong.
                server.drifts.append(drift)
                server.measured = max(0, *server.drifts)
                server.hidden = server.measured
                server.confirmed = False
                if server.limit is not None and reply.prompt_tokens > server.limit:
                    server.limit = None  # it took more than the limit a refusal gave: that limit was wrong
                warn = drift != 0 and not server.drift_warned
                if warn:
                    server.drift_warned = True
            self.calls.push(self.backend.server)
            if warn:
                self._warn_drift(fit, reply.prompt_tokens, drift)
        if self.recoveries:
            with self.calls.lock:
                self.server.recoveries += 1
        report = self._report(reply, drift)
        self.keeper.last_call = report
        self._record(reply, None)
        self._log(fit, report)
        monitor = getattr(self.keeper, "monitor", None)
        if monitor is not None:
            monitor.request_done(label=f"call {self.calls.calls}")
        return None

    def _warn_drift(self, fit: Fit, counted: int, drift: int) -> None:
        text = (
            f"{self.backend.server} counted {counted:,} prompt tokens where the keeper counted {fit.tokens:,} "
            f"({drift:+,})."
        )
        if drift > 0:
            advice = (
                f" Later calls keep {drift:,} tokens free for the difference. Fix: pass the server's own chat "
                "template (chat_template=...) and tokenizer"
            )
        else:
            last = fit.messages[-1] if fit.messages else None
            role = last.get("role") if isinstance(last, dict) else getattr(last, "role", None)
            strict = sum(
                1
                for tool in self.tools or ()
                if isinstance(tool, dict) and isinstance(tool.get("function"), dict) and "strict" in tool["function"]
            )
            advice = fewer_advice(
                self.server.kind, Drift(tokens=-drift, final_assistant=role == "assistant", strict_tools=strict)
            )
        warnings.warn(text + self._dialect_advice() + advice, DriftWarning, stacklevel=_caller_level())

    def _dialect_advice(self) -> str:
        """The likeliest cause when the server is one whose preprocessing the keeper does not follow."""
        kind, dialect = self.server.kind, getattr(self.keeper, "server", None)
        if kind is None or dialect is None or kind not in DIALECTS or kind == dialect.name:
            return ""
        return (
            f" The server is {kind}, and the keeper counts {dialect.name}'s preprocessing (roles, tool schemas, "
            f"BOS, a final assistant message and more differ). Fix: ContextKeeper(..., server={kind!r}) "
            "(docs/dialects.md)."
        )

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
        self.keeper.last_call = self._report(reply, None, error)
        self._record(reply, error)
        return error if isinstance(error, BaseException) else None

    def _report(self, reply: Reply | None, drift: int | None, error: BaseException | str | None = None) -> CallReport:
        fit = self.fit
        tokens = fit.tokens if fit is not None else 0
        kv_bytes, share = self.keeper.kv_bytes(tokens + self.answer)
        report = CallReport(
            server=self.backend.server,
            attempts=self.attempts,
            recoveries=tuple(self.recoveries),
            tokens=tokens,
            max_tokens=self.answer,
            server_prompt_tokens=reply.prompt_tokens if reply is not None else None,
            completion_tokens=reply.completion_tokens if reply is not None else None,
            drift=drift,
            withheld=self._withheld(),
            admission=self.admission,
            kv_bytes=kv_bytes,
            kv_share=share,
            cache_bytes=reply.cache_bytes if reply is not None else None,
            seconds=time.perf_counter() - self.started,
            server_kind=self.server.kind,
            error=None if error is None else (error if isinstance(error, str) else f"{type(error).__name__}: {error}"),
            cached_tokens=_cached(reply),
            prefix_tokens=fit.report.prefix_tokens if fit is not None else None,
        )
        if self.trace is not None:
            self.trace.end(report, reply)
        return report

    def error(self, exc: BaseException) -> None:
        """The call failed for good (a fit that cannot fit included): record it and free its admission."""
        self._release()
        try:
            self.keeper.last_call = self._report(None, None, exc)
        finally:
            self._record(None, exc)

    def _record(self, reply: Reply | None, exc: BaseException | str | None) -> None:
        with self.calls.lock:
            self.calls.calls += 1
        transcript = self.calls.transcript
        if transcript is None:
            return
        details: dict[str, Any] = {
            "received": reply.message if reply is not None else None,
            "usage": (
                {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens}
                if reply is not None and reply.prompt_tokens is not None
                else None
            ),
            "error": exc,
            "attempts": self.attempts,
        }
        try:
            if self.begun is not None:
                if self.begun.error is not None and self.begun.error is exc:
                    return  # the inputs never reached the transcript: that is the error the caller gets
                self._durable()
            if self.entry is not None:
                # Not waited for (a store over the network commits it behind; the inputs were durable before the
                # request left): the caller gets its reply without a round trip.
                transcript.end(self.entry, self.fit, wait=False, **details)
            else:
                inputs = self.messages if isinstance(self.messages, (list, tuple)) else []
                transcript.add(inputs, self.fit, conversation=self.options.conversation, tools=self.tools, **details)
        except Exception:
            # The inputs were written ahead; what failed is the end of the entry. The caller's call stands.
            log.exception("could not complete call %s in the transcript", self.entry.call if self.entry else "?")

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


_INSIDE = ("contextkeeper.", "tenacity", "openai", "httpx", "asyncio", "concurrent.")


def _caller_level() -> int:
    """The ``stacklevel`` that points a warning at the application's line that made the call, past our own
    frames and the retry, SDK and event-loop frames between them."""
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and str(frame.f_globals.get("__name__", "")).startswith(_INSIDE):
        frame = frame.f_back
        level += 1
    return level


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
        wait=lambda state: call.wait(state.outcome.exception() if state.outcome else None),
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


_FIRST_USE = threading.Lock()


def calls_of(keeper: ContextKeeper) -> Calls:
    """The shared call state of ``keeper``, made once on first use (threads that wrap at the same moment get the
    same state)."""
    state: Calls | None = getattr(keeper, "_calls", None)
    if state is None:
        with _FIRST_USE:
            state = getattr(keeper, "_calls", None)
            if state is None:
                state = keeper._make_calls()
    return state
