"""What one wrapped call learns from the server across its attempts, and what it keeps free because of it: a refusal
for length gives the server's limit or what it counts beyond our count (kept for the call's retries at once, and
for later calls by the shared state's rules), a refusal without numbers a step down, an out-of-memory error a cap on
the prompt, a transport error a backoff; a learned offset that leaves no room is probed once without it."""

from __future__ import annotations

import contextlib
import sys
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._exceptions import DriftWarning, ProviderError, TransportError
from ..servers.dialects import DIALECTS
from ..servers.kinds import Drift, fewer_advice, kind_of_error
from .errors import Attempted, Failure, provider_error

if TYPE_CHECKING:
    from ..fit.report import Fit
    from .loop import Call, _Scoped

__all__ = ["Recovery"]


@dataclass(eq=False)
class _Drift:
    """One drift (server count minus ours) of a plain request: measured on a reply, or implied by a refusal."""

    at: float  # time.monotonic()
    tokens: int
    source: str  # "reply" | "refusal"


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


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


class Recovery:
    """One call's learning and what it withholds: the offsets it keeps free, the shrink and cap after refusals
    without numbers or out-of-memory errors, the probe of a learned offset, and the backoff of transport errors."""

    def __init__(self, call: Call) -> None:
        self.call = call  # what changes per attempt: its fit, features, session, answer, attempts
        self.calls, self.keeper, self.server = call.calls, call.keeper, call.server
        self.backend, self.options = call.backend, call.options
        self.shrink = 0  # tokens withheld after refusals without numbers, or out-of-memory errors
        self.cap: int | None = None  # prompt cap after an out-of-memory error
        self.implied = 0  # what this call's refusals implied the server counts beyond ours (for its own retries)
        self.drift: _Drift | None = None  # this call's drift in the server's window (one per call: the latest)
        self.checking = False  # this attempt was sent without the learned offsets, to measure them (a probe)
        self.checked = False
        self.sent_offset: tuple[int, str | None] = (0, None)  # what the last attempt sent kept free, and why
        self.recoveries: list[str] = []
        self.transport_failures: list[Failure] = []  # what the backoff reads: how many, and any Retry-After

    def reasons(self, trusted: bool = False) -> list[tuple[str, str]]:
        """Why tokens are withheld below the keeper's limit, each with what would free them."""
        reasons = []
        limit = self.limit()
        if limit is not None and limit < self.keeper.limit:
            reasons.append(
                (
                    f"the server's own limit is {limit:,}, learned from its refusal",
                    "raise the server's context (vLLM --max-model-len, llama.cpp --ctx-size, Ollama num_ctx): "
                    "context_window is not what binds",
                )
            )
        hidden, _, why = self.offset(trusted)
        if hidden:
            wait = self.probe_wait()
            if wait:
                why += f"; a check without it went to the server recently, the next may go in {wait:.0f} s"
            reasons.append(
                (
                    f"the server counts {hidden:,} tokens we cannot see ({why})",
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
        if self.call.admitting.granted is not None:
            reasons.append(
                (
                    f"admission granted {self.call.admitting.granted:,} tokens while other calls held the rest",
                    "lower concurrency, or give the KV cache more room",
                )
            )
        return reasons or [("admission", "lower concurrency")]

    def scope(self) -> _Scoped | None:
        """This conversation's learned offset for requests with these features (None for a plain request)."""
        if not self.call.features or self.call.session is None:
            return None
        return self.calls.scoped(self.call.session, self.backend.server, self.call.features)

    def limit(self) -> int | None:
        """The server's limit for this request: server-wide, and its scope's own (from an overshoot) when less."""
        limit = self.calls.limit(self.server)
        scope = self.scope()
        if scope is not None and scope.limit is not None:
            limit = scope.limit if limit is None else min(limit, scope.limit)
        return limit

    def offset(self, trusted: bool = False) -> tuple[int, str | None, str]:
        """``(tokens, label, why)``: what this attempt keeps free for what the server counts beyond our count, where
        it comes from (see :attr:`CallReport.hidden_from`) and why, in words. ``trusted``: the probe, without any."""
        if trusted:
            return 0, "probe" if self.checking else None, ""
        scope = self.scope()
        learned: tuple[int, str | None, str]
        if scope is not None:
            kinds = ", ".join(sorted(self.call.features))
            how = "measured on" if scope.source == "reply" else "implied by a refusal of"
            learned = (scope.hidden, "scope", f"{how} this conversation's requests with {kinds}")
        else:
            limit = self.limit()
            learned = self.calls.plain(self.server, min(self.keeper.limit, limit or self.keeper.limit))
        if self.implied > learned[0]:
            return self.implied, "refusal", "implied by this call's refusal"
        return learned

    def probe_key(self) -> tuple[str, str | None, frozenset[str]]:
        scoped = self.options.conversation if self.call.features else None
        return self.backend.server, scoped, self.call.features

    def probe_wait(self) -> float:
        """Seconds until this request's scope may be probed again (0: now)."""
        last = self.calls.probes.get(self.probe_key())
        every = self.calls.rules.probe_every
        return 0.0 if last is None else max(0.0, every - (time.monotonic() - last))

    def withheld(self, trusted: bool = False) -> int:
        limit = self.keeper.limit
        server_limit = self.limit()
        hidden = self.offset(trusted)[0]
        effective = min(limit, server_limit or limit) - hidden - (0 if trusted else self.shrink)
        if self.cap is not None:
            effective = min(effective, self.cap + self.call.answer)
        return max(0, limit - effective)

    def learn(self, failure: Failure) -> ProviderError:
        """Learn what ``failure`` says about the server (its limit, hidden tokens) or the model (its memory),
        note the recovery, and give the error to raise if no attempt is left (worded in :mod:`.errors`)."""
        fit = self.call.fit
        sent = fit.tokens if fit is not None else 0
        if failure.kind == "context":
            before = self.withheld()
            note = ""
            name = self.backend.server
            with self.calls.lock:
                server = self.server
                server.rejects += 1
                server.kind = server.kind or kind_of_error(failure.message)
                if failure.limit is not None:
                    server.limit = failure.limit  # the server's max_model_len: a fact of the server, not the request
                if failure.prompt_tokens is not None and failure.prompt_tokens > sent:
                    implied = failure.prompt_tokens - sent
                    self.implied = max(self.implied, implied)  # this call's retries keep it free at once
                    if self.checking:
                        note = ", refused without the learned offsets too"
                    if self.call.charged and self.call.session is not None:
                        self.calls.charge(self.call.session, name, self.call.charged, hidden=implied, source="refusal")
                        kinds = ", ".join(sorted(self.call.charged))
                        note += f"; charged to this conversation's requests with {kinds}"
                    else:
                        self.note_drift(implied, "refusal")
                        ceiling = min(self.keeper.limit, self.limit() or self.keeper.limit)
                        most = int(ceiling * self.calls.rules.share)
                        if implied > most:
                            share = self.calls.rules.share
                            note += f"; later calls keep at most {most:,} of it ({share:.0%} of the limit)"
                if failure.excess and failure.limit is None:
                    # Only the overshoot is known: the limit is at most what we sent less that. For a request with
                    # features the overshoot includes what they cost, so that limit is the scope's alone.
                    derived = sent - failure.excess
                    if self.call.charged and self.call.session is not None:
                        self.calls.charge(self.call.session, name, self.call.charged, limit=derived)
                    else:
                        server.limit = min(server.limit or self.keeper.limit, derived)
            self.calls.push(name)
            if self.withheld() <= before:  # nothing new learned: step down, further each time
                step = max(64, self.keeper.limit // 20)
                self.shrink = max(step, 2 * self.shrink)
            self.recoveries.append(
                f"refused for length ({sent:,} tokens sent; server said limit {failure.limit}, prompt "
                f"{failure.prompt_tokens}{note}): refit {self.withheld():,} tokens below the limit"
            )
        elif failure.kind == "oom":
            self.cap = max(1, (sent * 3) // 4)
            self.recoveries.append(f"out of memory at {sent:,} prompt tokens: refit to at most {self.cap:,}")
        else:
            self.recoveries.append(f"transport error: {failure.message[:120]}")
            self.transport_failures.append(failure)
        attempted = Attempted(
            sent=sent,
            answer=self.call.answer,
            answer_key=self.call.answer_key,
            attempts=self.call.attempts,
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

    def note_drift(self, tokens: int, source: str) -> None:
        """Put this call's drift in the server's window of plain requests, in place of the one it put there before
        (each call counts once: what its reply measured, else what its last refusal implied). Under the lock."""
        window = self.server.drifts
        if self.drift is not None:
            with contextlib.suppress(ValueError):  # (it may have rolled out of the window meanwhile)
                window.remove(self.drift)
        self.drift = _Drift(at=time.monotonic(), tokens=tokens, source=source)
        window.append(self.drift)

    def warn_drift(self, fit: Fit, counted: int, drift: int) -> None:
        text = (
            f"{self.backend.server} counted {counted:,} prompt tokens where the keeper counted {fit.tokens:,} "
            f"({drift:+,})."
        )
        rules = self.calls.rules
        if drift > 0 and self.call.charged:
            kinds = ", ".join(sorted(self.call.charged))
            advice = (
                f" The request carried {kinds}, which the server renders into the prompt and the keeper cannot "
                f"count: this conversation's later requests with {kinds} keep {drift:,} tokens free; other "
                "requests are not affected. Fix: none needed"
            )
        elif drift > 0:
            advice = (
                f" Later calls keep it free while replies agree (the {_ordinal(rules.agree)} largest of the last "
                f"{rules.window} drifts, at most {rules.share:.0%} of the limit). Fix: pass the server's own chat "
                "template (chat_template=...) and tokenizer"
            )
        else:
            last = fit.messages[-1] if fit.messages else None
            role = last.get("role") if isinstance(last, dict) else getattr(last, "role", None)
            strict = sum(
                1
                for tool in self.call.tools or ()
                if isinstance(tool, dict) and isinstance(tool.get("function"), dict) and "strict" in tool["function"]
            )
            advice = fewer_advice(
                self.server.kind, Drift(tokens=-drift, final_assistant=role == "assistant", strict_tools=strict)
            )
        warnings.warn(text + self.dialect_advice() + advice, DriftWarning, stacklevel=_caller_level())

    def dialect_advice(self) -> str:
        """The likeliest cause when the server is one whose preprocessing the keeper does not follow."""
        kind, dialect = self.server.kind, self.keeper.server
        if kind is None or dialect is None or kind not in DIALECTS or kind == dialect.name:
            return ""
        return (
            f" The server is {kind}, and the keeper counts {dialect.name}'s preprocessing (roles, tool schemas, "
            f"BOS, a final assistant message and more differ). Fix: ContextKeeper(..., server={kind!r}) "
            "(docs/dialects.md)."
        )
