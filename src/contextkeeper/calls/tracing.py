"""OpenTelemetry spans of wrapped calls: one per call, with a child per fit and one per upstream attempt.

Emitted by the wrapped-call steps (:mod:`.loop`), so ``keeper.wrap()`` users and the proxy get the same
spans. Only the OpenTelemetry API is used; the application installs the SDK and sets a tracer provider. Without
one (or without ``opentelemetry-api``) :func:`start` returns None and every hook is a no-op: nothing is read or
counted for a span nobody records.

```
chat {model}            CLIENT    the wrapped call, across its attempts (GenAI inference span)
├── contextkeeper.fit   INTERNAL  one per fit: limit, prompt tokens, each slot, actions, withheld
└── contextkeeper.upstream CLIENT one per request sent: the server's counts, or the failure
```

Attributes follow the GenAI semantic conventions (``gen_ai.operation.name``, ``gen_ai.provider.name`` and the
older ``gen_ai.system``, ``gen_ai.request.model``, ``gen_ai.request.max_tokens``, ``gen_ai.conversation.id``,
``gen_ai.usage.input_tokens``, ``gen_ai.usage.output_tokens``, ``gen_ai.response.finish_reasons``, ...) plus
``contextkeeper.*`` for the budget. Messages' content is never recorded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

    from ..fit.report import Fit
    from .base import Reply, Request
    from .loop import Call, CallReport

try:
    from opentelemetry import trace as _otel
    from opentelemetry.trace import SpanKind, Status, StatusCode
except ImportError:  # pragma: no cover - the API is optional: no spans
    _otel = None  # type: ignore[assignment]

# Users set a tracer provider and read spans; CallTrace, start and fitting are the wrapped call's hooks, not API.
__all__ = ["SCOPE"]

#: The instrumentation scope of the spans (the tracer's name).
SCOPE = "contextkeeper"

_cached: tuple[Any, Tracer] | None = None  # (provider, its tracer): a provider set later replaces it


def _tracer() -> Tracer | None:
    """The tracer of the global provider, or None while none is set (the API's proxy stands in for it)."""
    global _cached
    if _otel is None:
        return None
    provider = _otel.get_tracer_provider()
    if isinstance(provider, (_otel.ProxyTracerProvider, _otel.NoOpTracerProvider)):
        return None
    cached = _cached
    if cached is None or cached[0] is not provider:
        cached = _cached = (provider, provider.get_tracer(SCOPE, _version()))
    return cached[1]


def _version() -> str | None:
    # (read from the installed distribution, not the package root: nothing here imports the root back)
    from importlib import metadata

    try:
        return metadata.version("contextkeeper")
    except metadata.PackageNotFoundError:
        return None


def start(call: Call) -> CallTrace | None:
    """The spans of ``call``, its own span started now; None when no tracer provider is set."""
    tracer = _tracer()
    if tracer is None:
        return None
    trace = CallTrace(tracer, call)
    return trace if trace.span.is_recording() else None  # a sampler that drops it: no work for it either


def _provider(call: Call) -> str:
    """``gen_ai.provider.name``: the server software when recognised, "openai" for an OpenAI-compatible URL."""
    if call.server.kind:
        return call.server.kind
    server = call.backend.server
    return "openai" if server.startswith(("http://", "https://")) else server.partition(":")[0]


def _get(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


class CallTrace:
    """The open spans of one wrapped call (see the module's docstring for the tree)."""

    def __init__(self, tracer: Tracer, call: Call) -> None:
        self.tracer = tracer
        self.call = call
        model = call.params.get("model")
        self.model = model if isinstance(model, str) else None
        self.provider = _provider(call)
        common: dict[str, Any] = {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": self.provider,
            "gen_ai.system": self.provider,  # the name before gen_ai.provider.name, which older backends read
            "gen_ai.conversation.id": call.options.conversation,
        }
        if self.model is not None:
            common["gen_ai.request.model"] = self.model
        if call.max_tokens is not None:
            common["gen_ai.request.max_tokens"] = call.max_tokens
        parts = urlsplit(call.backend.server)
        if parts.hostname:
            common["server.address"] = parts.hostname
            with contextlib.suppress(ValueError):
                if parts.port is not None:
                    common["server.port"] = parts.port
        self.common = common
        self.span: Span = tracer.start_span(
            f"chat {self.model}" if self.model else "chat",
            kind=SpanKind.CLIENT,
            attributes={**common, "contextkeeper.stream": bool(call.params.get("stream"))},
        )
        self.context = _otel.set_span_in_context(self.span)
        self.upstream: Span | None = None
        self.ended = False

    # ------------------------------------------------------------------------------------------ hooks
    @contextlib.contextmanager
    def fit(self) -> Iterator[Callable[[Fit], None]]:
        """A span around one fit (current while it runs: a summarizer's own calls nest under it); the block
        calls what it yields with the fit."""
        span = self.tracer.start_span("contextkeeper.fit", context=self.context, kind=SpanKind.INTERNAL)
        with _otel.use_span(span, end_on_exit=True, record_exception=True, set_status_on_exception=True):
            yield lambda fit: span.set_attributes(_fit_attributes(fit))

    def sent(self, request: Request) -> None:
        """An attempt goes to the server: its span starts."""
        self._close_upstream()
        call = self.call
        attributes: dict[str, Any] = {**self.common, "contextkeeper.attempt": call.attempts}
        if call.fit is not None:
            attributes["contextkeeper.prompt_tokens"] = call.fit.tokens
        attributes["contextkeeper.admission"] = call.admission
        attributes["contextkeeper.stream"] = request.stream
        self.upstream = self.tracer.start_span(
            "contextkeeper.upstream", context=self.context, kind=SpanKind.CLIENT, attributes=attributes
        )

    def failed(self, exc: BaseException, kind: str) -> None:
        """The attempt failed (``kind``: context, oom, transport or other): its span ends with the error."""
        span = self.upstream
        if span is None:
            return
        self.upstream = None
        span.set_attribute("error.type", type(exc).__name__)
        span.set_attribute("contextkeeper.failure", kind)
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"[:300]))
        span.end()

    def end(self, report: CallReport, reply: Reply | None) -> None:
        """The call's end (a stream: when it ended): the open attempt's span and the call's own end."""
        if self.ended:  # a report made again (a failure while recording the end): the spans are closed
            return
        self.ended = True
        usage: dict[str, Any] = {}
        if report.server_prompt_tokens is not None:
            usage["gen_ai.usage.input_tokens"] = report.server_prompt_tokens
        elif report.tokens:
            usage["gen_ai.usage.input_tokens"] = report.tokens  # the server reported none: our exact count
        if report.completion_tokens is not None:
            usage["gen_ai.usage.output_tokens"] = report.completion_tokens
        if report.cached_tokens is not None:
            usage["gen_ai.usage.cache_read.input_tokens"] = report.cached_tokens
        result = reply.result if reply is not None else None
        response = _response_attributes(result)
        span = self.upstream
        self.upstream = None
        if span is not None:
            span.set_attributes({**usage, **response})
            if report.error is not None:
                _error(span, report.error)
            span.end()
        call = self.span
        fit = self.call.fit
        attributes: dict[str, Any] = {**usage, **response}
        if fit is not None:
            attributes.update(_fit_attributes(fit))
        attributes.update(
            {
                "contextkeeper.attempts": report.attempts,
                "contextkeeper.recoveries": list(report.recoveries),
                "contextkeeper.admission": report.admission,
                "contextkeeper.server": report.server,
            }
        )
        if report.drift is not None:
            attributes["contextkeeper.drift"] = report.drift
        if report.server_kind is not None:
            attributes["contextkeeper.server_kind"] = report.server_kind
        if report.kv_bytes is not None:
            attributes["contextkeeper.kv_bytes"] = report.kv_bytes
        if report.prefix_tokens is not None:
            attributes["contextkeeper.prefix_tokens"] = report.prefix_tokens
        call.set_attributes(attributes)
        if report.error is not None:
            _error(call, report.error)
        call.end()

    def _close_upstream(self) -> None:
        if self.upstream is not None:  # an attempt whose failure was not seen (should not happen): end it
            self.upstream.end()
            self.upstream = None


def _error(span: Span, error: str) -> None:
    span.set_attribute("error.type", error.partition(":")[0] or "error")
    span.set_status(Status(StatusCode.ERROR, error[:300]))


def _actions(fit: Fit) -> list[str]:
    return [f"{a.strategy}:{'?' if a.saved is None else a.saved}" for a in fit.report.actions]


def _fit_attributes(fit: Fit) -> dict[str, Any]:
    """The budget of one fit, as ``contextkeeper.*`` attributes."""
    report = fit.report
    slots = report.slots
    attributes: dict[str, Any] = {
        "contextkeeper.limit": report.limit,
        "contextkeeper.limit_source": report.limit_source,
        "contextkeeper.prompt_tokens": fit.tokens,
        "contextkeeper.max_tokens": report.max_tokens,
        "contextkeeper.withheld": slots.get("withheld", 0),  # what this fit kept free below the limit
        "contextkeeper.messages_before": report.messages_before,
        "contextkeeper.messages_after": report.messages_after,
        "contextkeeper.actions": _actions(fit),
        "contextkeeper.strategies": list(dict.fromkeys(a.strategy for a in report.actions)),
        "contextkeeper.strategies.policy": report.policy,
        "contextkeeper.fit_seconds": report.seconds,
    }
    if report.tokens_before is not None:
        attributes["contextkeeper.tokens_before"] = report.tokens_before
    for slot, tokens in slots.items():
        attributes[f"contextkeeper.slot.{slot}"] = tokens
    return attributes


def _response_attributes(result: Any) -> dict[str, Any]:
    """``gen_ai.response.*`` from a non-streamed response (a stream's result is the stream: nothing to read)."""
    if result is None:
        return {}
    attributes: dict[str, Any] = {}
    for key, name in (("gen_ai.response.id", "id"), ("gen_ai.response.model", "model")):
        value = _get(result, name)
        if isinstance(value, str):
            attributes[key] = value
    choices = _get(result, "choices")
    if isinstance(choices, Sequence) and not isinstance(choices, (str, bytes)):
        reasons = [_get(choice, "finish_reason") for choice in choices]
        if reasons and all(isinstance(reason, str) for reason in reasons):
            attributes["gen_ai.response.finish_reasons"] = reasons
    return attributes


def _ignore(fit: Fit) -> None:
    return None


def fitting(trace: CallTrace | None) -> contextlib.AbstractContextManager[Callable[[Fit], None]]:
    """``with fitting(call.trace) as note: ...; note(fit)``: the fit's span, or nothing."""
    return trace.fit() if trace is not None else contextlib.nullcontext(_ignore)
