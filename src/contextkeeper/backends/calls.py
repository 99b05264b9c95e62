"""One wrapped call: fit, admit, send, recover, record — written once, driven by a sync and an async loop.

The per-attempt steps live on :class:`Call` (``prepare``, ``failed``, ``done``); :func:`call_sync` and
:func:`call_async` only differ in how they wait (tenacity's ``Retrying`` vs ``AsyncRetrying``) and in running
the CPU-bound fit on a worker thread so an event loop is never blocked by it.

Recovery. A refusal for length teaches the keeper about the server: the limit it reported, and the tokens it
counted beyond ours (a hidden system prompt, a different template). Both are kept per server, so later calls fit
under them and are not refused again. A refusal without numbers shrinks the budget by a step that doubles. A
local out-of-memory error shrinks the prompt to three quarters. Transport errors (timeouts, 429, 5xx, malformed
replies) are retried with exponential backoff, and only they wait.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import inspect
import logging
import sys
import threading
import time
import warnings
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from .._exceptions import ContextLengthExceeded, OutOfMemory, ProviderError, TransportError
from .base import Backend, Reply, Request
from .errors import Failure, classify

if TYPE_CHECKING:
    from ..keeper import ContextKeeper, Fit
    from ..ledger import Ledger, Ticket

__all__ = ["CallReport", "DriftWarning", "ServerState", "call_async", "call_sync"]

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
    hidden: int = 0  # tokens the server counts beyond our count (a hidden prompt, another template)
    rejects: int = 0
    recoveries: int = 0
    drift_warned: bool = False
    last_drift: int | None = None


@dataclass(frozen=True, kw_only=True)
class CallReport:
    """One wrapped call: how many attempts, what was recovered, the counts on both sides, admission, memory."""

    server: str
    attempts: int
    recoveries: tuple[str, ...]
    tokens: int  # our exact count of the prompt sent last
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

    def server(self, name: str) -> ServerState:
        with self.lock:
            return self.servers.setdefault(name, ServerState())


@dataclass(frozen=True, kw_only=True)
class Options:
    """Settings of one wrapped client."""

    attempts: int = 4  # calls per request, the first included
    backoff: float = 0.5  # seconds before the first transport retry; doubles each time
    max_backoff: float = 8.0
    conversation: str = "default"  # the transcript key
    answer_keys: tuple[str, ...] = ("max_completion_tokens", "max_tokens")


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
        self.max_tokens: int | None = next(
            (int(params[key]) for key in options.answer_keys if params.get(key) is not None), None
        )
        self.answer = self.max_tokens if self.max_tokens is not None else self.keeper.policy.answer_tokens
        self.server = calls.server(backend.server)
        self.shrink = 0  # tokens withheld after refusals without numbers, or out-of-memory errors
        self.cap: int | None = None  # prompt cap after an out-of-memory error
        self.attempts = 0
        self.recoveries: list[str] = []
        self.transport_failures: list[Failure] = []  # what the backoff reads: how many, and any Retry-After
        self.fit: Fit | None = None
        self.ticket: Ticket | None = None
        self.admission = "unlimited"
        self.started = time.perf_counter()

    # ---------------------------------------------------------------------------------------- steps
    def _fit(self, withheld: int) -> Fit:
        from ..keeper import Fit

        with self.calls.lock:  # a keeper's incremental state follows one fit at a time
            fit = self.keeper.fit(self.messages, tools=self.tools, max_tokens=self.answer + withheld)
        report = fit.report
        if withheld:
            answer = self.answer
            why = f"{withheld:,} tokens withheld below the limit ({', '.join(self._withheld_reasons())})"
            report = report.with_slots(
                lambda slots: {**slots, "answer": answer, "withheld": withheld},
                max_tokens=answer,
                notes=(*report.notes, why),
            )
        fit = Fit(messages=fit.messages, tokens=fit.tokens, report=report)
        self.keeper.last_fit = fit
        return fit

    def _withheld_reasons(self) -> list[str]:
        reasons = []
        if self.server.limit is not None and self.server.limit < self.keeper.limit:
            reasons.append(f"the server's limit is {self.server.limit:,}")
        if self.server.hidden:
            reasons.append(f"the server counts {self.server.hidden:,} tokens we cannot see")
        if self.shrink:
            reasons.append(f"{self.shrink:,} after refusals")
        if self.cap is not None:
            reasons.append(f"prompt capped at {self.cap:,} after running out of memory")
        return reasons or ["admission"]

    def _withheld(self) -> int:
        limit = self.keeper.limit
        effective = min(limit, self.server.limit or limit) - self.server.hidden - self.shrink
        if self.cap is not None:
            effective = min(effective, self.cap + self.answer)
        return max(0, limit - effective)

    def prepare(self) -> Generator[tuple[int, int], Ticket, Request]:
        """Fit under everything learned so far, then ask the driver for room in the ledger (it yields
        ``(tokens, minimum)`` and receives the ticket; sync and async drivers wait differently)."""
        self.attempts += 1
        withheld = self._withheld()
        fit = self._fit(withheld)
        if self.calls.ledger is not None:
            need = fit.tokens + self.answer
            floor = fit.tokens - fit.report.history_after + self.answer  # never-trimmed parts plus the answer
            ticket = yield need, floor
            self.ticket = ticket
            if ticket.tokens < need:  # mode "shrink": fit again into what was granted
                fit = self._fit(max(withheld, self.keeper.limit - ticket.tokens))  # prompt + answer <= granted
                ticket.resize(fit.tokens + self.answer)
                self.admission = f"shrunk to {fit.tokens + self.answer:,} tokens"
            elif ticket.waited:
                self.admission = f"waited {ticket.waited:.2f} s"
            else:
                self.admission = "admitted"
        self.fit = fit
        params = dict(self.params)
        params["messages"] = fit.messages
        return Request(
            messages=fit.messages,
            tools=self.tools,
            max_tokens=self.max_tokens,
            params=params,
            stream=bool(params.get("stream")),
            finish=self.finish,
        )

    def prepared(self) -> Request:
        """:meth:`prepare`, admitted by blocking (sync calls)."""
        steps = self.prepare()
        ask = _advance(steps, None)
        while not isinstance(ask, Request):
            assert self.calls.ledger is not None
            ask = _advance(steps, self.calls.ledger.acquire(ask[0], minimum=ask[1], label=self._label()))
        return ask

    async def prepared_async(self) -> Request:
        """:meth:`prepare` with the fit on a worker thread and admission awaited on the loop: a blocked
        admission must not hold an executor thread the loop needs (name resolution, for one)."""
        steps = self.prepare()
        ask = await asyncio.to_thread(_advance, steps, None)
        while not isinstance(ask, Request):
            assert self.calls.ledger is not None
            ticket = await self.calls.ledger.acquire_async(ask[0], minimum=ask[1], label=self._label())
            ask = await asyncio.to_thread(_advance, steps, ticket)
        return ask

    def _label(self) -> str:
        return f"{self.backend.server} call {self.calls.calls + 1}"

    def _release(self) -> None:
        if self.ticket is not None:
            self.ticket.release()
            self.ticket = None

    def failed(self, exc: BaseException) -> None:
        """Learn from the failure and raise what the retry loop acts on: a ProviderError to retry, or the
        caller's own exception unchanged."""
        self._release()
        failure = classify(exc)
        if failure.kind == "other":
            raise exc
        raise self._learn(failure) from exc

    def _learn(self, failure: Failure) -> ProviderError:
        fit = self.fit
        report = fit.report if fit is not None else None
        sent = fit.tokens if fit is not None else 0
        if failure.kind == "context":
            before = self._withheld()
            with self.calls.lock:
                self.server.rejects += 1
                if failure.limit is not None:
                    self.server.limit = failure.limit
                if failure.prompt_tokens is not None:
                    self.server.hidden = max(self.server.hidden, failure.prompt_tokens - sent)
                if failure.excess and failure.limit is None:
                    # Only the overshoot is known: the server's limit is at most what we sent less that.
                    self.server.limit = min(self.server.limit or self.keeper.limit, sent - failure.excess)
            if self._withheld() <= before:  # nothing new learned: step down, further each time
                step = max(64, self.keeper.limit // 20)
                self.shrink = max(step, 2 * self.shrink)
            self.recoveries.append(
                f"refused for length ({sent:,} tokens sent; server said limit {failure.limit}, prompt "
                f"{failure.prompt_tokens}): refit {self._withheld():,} tokens below the limit"
            )
            return ContextLengthExceeded(
                f"the server refused the prompt as too long after {self.attempts} attempt(s): we sent {sent:,} "
                f"tokens with {self.answer:,} reserved for the answer; the server reported a limit of "
                f"{failure.limit} and a prompt of {failure.prompt_tokens} tokens. Fix: set context_window to the "
                "server's max_model_len (or n_ctx), lower max_tokens, or let more attempts run (attempts=...). "
                f"Server said: {failure.message[:300]}",
                limit=failure.limit,
                prompt_tokens=failure.prompt_tokens,
                report=report,
                attempts=self.attempts,
            )
        if failure.kind == "oom":
            self.cap = max(1, (sent * 3) // 4)
            self.recoveries.append(f"out of memory at {sent:,} prompt tokens: refit to at most {self.cap:,}")
            return OutOfMemory(
                f"the model ran out of memory on a {sent:,}-token prompt with {self.answer:,} answer tokens, after "
                f"{self.attempts} attempt(s). Fix: lower context_window or max_tokens, set gpu= and concurrency= "
                "so the limit comes from the memory model, or use a smaller KV dtype",
                report=report,
                attempts=self.attempts,
            )
        self.recoveries.append(f"transport error: {failure.message[:120]}")
        self.transport_failures.append(failure)
        return TransportError(
            f"the call failed after {self.attempts} attempt(s): {failure.message[:300]}. Fix: check the server, "
            "raise attempts=... or the client's timeout",
            report=report,
            attempts=self.attempts,
        )

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

    def finish(self, reply: Reply) -> None:
        """The call's end (for a stream: when it was consumed or closed): learn, report, record."""
        self._release()
        fit = self.fit
        assert fit is not None
        drift = None
        if reply.prompt_tokens is not None:
            drift = reply.prompt_tokens - fit.tokens
            with self.calls.lock:
                self.server.last_drift = drift
                if drift > self.server.hidden:
                    self.server.hidden = drift  # the server sees tokens we do not: keep room for them
                warn = drift != 0 and not self.server.drift_warned
                if warn:
                    self.server.drift_warned = True
            if warn:
                counted = (
                    f"{self.backend.server} counted {reply.prompt_tokens:,} prompt tokens where the keeper counted "
                    f"{fit.tokens:,} ({drift:+,})."
                )
                if drift > 0:
                    advice = (
                        f" Later calls keep {drift:,} tokens free for the difference. Fix: pass the server's own "
                        "chat template (chat_template=...) and tokenizer"
                    )
                else:  # fewer than sent: a server that cuts prompts silently (Ollama does, past num_ctx)
                    advice = (
                        " The server may have cut the prompt without saying so. Fix: set context_window to the "
                        "server's context (Ollama: num_ctx), and pass its own chat template and tokenizer"
                    )
                warnings.warn(counted + advice, DriftWarning, stacklevel=_caller_level())
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

    def _report(self, reply: Reply | None, drift: int | None) -> CallReport:
        fit = self.fit
        tokens = fit.tokens if fit is not None else 0
        kv_bytes, share = self.keeper.kv_bytes(tokens + self.answer)
        return CallReport(
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
        )

    def error(self, exc: BaseException) -> None:
        """The call failed for good: record it (with the last fit) and free its admission."""
        self._release()
        if self.fit is not None:
            self.keeper.last_call = self._report(None, None)
        self._record(None, exc)

    def _record(self, reply: Reply | None, exc: BaseException | None) -> None:
        with self.calls.lock:
            self.calls.calls += 1
        transcript = self.calls.transcript
        if transcript is None or self.fit is None:
            return
        transcript.add(
            self.messages,
            self.fit,
            conversation=self.options.conversation,
            tools=self.tools,
            received=reply.message if reply is not None else None,
            usage=(
                {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens}
                if reply is not None and reply.prompt_tokens is not None
                else None
            ),
            error=exc,
            attempts=self.attempts,
        )

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
        retry=tenacity.retry_if_exception_type((ContextLengthExceeded, OutOfMemory, TransportError)),
        wait=lambda state: call.wait(state.outcome.exception() if state.outcome else None),
        reraise=True,
    )


def call_sync(call: Call) -> Any:
    """Run ``call`` to its end, retrying per the recovery rules."""
    import tenacity

    try:
        for attempt in _retrying(call, tenacity.Retrying):
            with attempt:
                request = call.prepared()
                try:
                    reply = call.backend.complete(request)
                    if inspect.isawaitable(reply):
                        raise TypeError("this backend is async: wrap an async client or use the async call")
                except BaseException as exc:
                    call.failed(exc)
                return call.done(cast(Reply, reply))
    except BaseException as exc:
        call.error(exc)
        raise
    raise AssertionError("unreachable: tenacity either returns or raises")  # pragma: no cover


async def call_async(call: Call) -> Any:
    """The async :func:`call_sync`: the fit and admission run on a worker thread, the backend on the loop."""
    import tenacity

    CALLER_LOOP.set(asyncio.get_running_loop())
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


def calls_of(keeper: ContextKeeper) -> Calls:
    """The shared call state of ``keeper`` (made on first use)."""
    state: Calls | None = getattr(keeper, "_calls", None)
    if state is None:
        state = keeper._make_calls()
    return state
