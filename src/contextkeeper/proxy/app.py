"""The proxy itself: an ASGI app (Starlette) in front of an OpenAI-compatible server.

``POST /v1/chat/completions`` goes through the keeper's wrapped-call machinery (:mod:`..backends.calls`, the
same steps as ``keeper.wrap(openai.AsyncOpenAI(...))``): fitted with the request's own ``tools`` and answer
budget, admitted against the KV capacity, sent with the openai SDK, refusals for length recovered and transport
errors retried within the same bounds, recorded in the keeper's transcript. Streams pass through chunk by chunk.
Every other path is forwarded unchanged (method, query, body and headers, hop-by-hop headers aside), its answer
streamed back as it comes.

Each chat answer says what was done in its headers (``X-Contextkeeper-Prompt-Tokens``, ``-Messages-Dropped``,
``-Actions``, ``-Conversation``, and the fits' time as ``Server-Timing: fit;dur=<ms>``);
``GET /contextkeeper/conversations/{id}`` shows the latest exchange of a conversation with the fit's whole report.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route as HTTPRoute
from starlette.types import Send

from ..backends.calls import Call, CallReport, Options, call_async, calls_of
from .config import ProxyConfig, Route, build_routes
from .errors import error_body, error_reply
from .identity import HEADER, Identity, InvalidConversation, identify
from .observe import DebugStore, Exchange, Observer

if TYPE_CHECKING:
    import httpx2
    import openai

    from ..backends.base import Reply
    from ..backends.base import Request as Sent
    from ..backends.openai import OpenAIBackend
    from ..report import Fit
    from ..strategies.base import Action
    from .metrics import ProxyMetrics

__all__ = ["Proxy"]

log = logging.getLogger("contextkeeper.proxy")

# Headers of one connection, never forwarded (RFC 9110 7.6.1), and those each hop sets itself.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
    }
)
_HOP_BY_HOP_BYTES = frozenset(name.encode("ascii") for name in HOP_BY_HOP)
# What the SDK sets for the chat request it sends (the client's would describe the client's own request).
_SDK_SETS = frozenset({"content-length", "content-type", "accept", "accept-encoding", "authorization", HEADER})
# What the proxy's own chat answer sets (the body is re-encoded, so the upstream's framing does not apply).
_ANSWER_SETS = frozenset({"content-length", "content-encoding", "content-type", "date", "server"})
# Body fields the wrapped call reads itself; every other field travels as the SDK's extra_body, as sent.
_NAMED = ("model", "stream", "max_tokens", "max_completion_tokens", "tools")
_ANSWER_KEYS = ("max_completion_tokens", "max_tokens")
_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]


@dataclass
class _Seen:
    """The upstream's answer headers for one chat request, caught by the HTTP client's response hook."""

    headers: list[tuple[bytes, bytes]] = dataclasses.field(default_factory=list)


_UPSTREAM: contextvars.ContextVar[_Seen | None] = contextvars.ContextVar("contextkeeper_proxy_seen", default=None)


class _ProxyCall(Call):
    """A wrapped call that keeps its own report (``keeper.last_call`` is whichever call ended last), and times
    its fits and its time upstream for the metrics."""

    report: CallReport | None = None

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.fit_seconds: list[float] = []
        self.upstream_seconds: float | None = None
        self._sent: float | None = None

    def _fit(self, withheld: int, trusted: bool = False) -> Fit:
        fit = super()._fit(withheld, trusted)
        self.fit_seconds.append(fit.report.seconds)
        return fit

    async def prepared_async(self) -> Sent:
        request = await super().prepared_async()
        self._sent = time.perf_counter()
        return request

    def _back(self) -> None:
        """An attempt is over (answered, failed, or its stream ended): add its time upstream."""
        if self._sent is not None:
            self.upstream_seconds = (self.upstream_seconds or 0.0) + time.perf_counter() - self._sent
            self._sent = None

    def failed(self, exc: BaseException) -> None:
        self._back()
        super().failed(exc)

    def finish(self, reply: Reply) -> BaseException | None:
        self._back()
        return super().finish(reply)

    def error(self, exc: BaseException) -> None:
        self._back()
        super().error(exc)

    def _report(self, reply: Reply | None, drift: int | None, error: BaseException | str | None = None) -> CallReport:
        report = super()._report(reply, drift, error)
        self.report = report
        return report


class _Relay(StreamingResponse):
    """A streamed answer whose source is closed however the stream ends (read to the end, the client gone)."""

    def __init__(self, content: AsyncIterator[bytes], *, close: Callable[[], Awaitable[None]], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._close = close

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
                await self._close()


def _hop_by_hop(headers: Iterable[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """The hop-by-hop headers of one message: the fixed ones and those its Connection header names."""
    named = {
        token.strip().lower()
        for key, value in headers
        if key.lower() == b"connection"
        for token in value.split(b",")
        if token.strip()
    }
    return _HOP_BY_HOP_BYTES | named


def _split_upstream(url: str) -> tuple[str, str, str]:
    """``(base, origin, prefix)`` of the upstream's OpenAI base URL; a URL without a path means ``/v1``."""
    parsed = urlsplit(url)
    path = parsed.path.rstrip("/") or "/v1"
    origin = f"{parsed.scheme}://{parsed.netloc}"
    return origin + path, origin, path


async def _nothing() -> None:
    return None


def _chat_sender(sdk: openai.AsyncOpenAI) -> Callable[..., Awaitable[Any]]:
    """``sdk.chat.completions.create`` less its conversion of the arguments, which walks every message against
    the SDK's parameter types (about a millisecond a request): a proxied body is already the JSON the server
    takes. The request goes through the SDK's own ``post``, so its headers, response types, streams and
    exceptions are the same."""
    import openai
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    async def create(
        *, extra_headers: Mapping[str, Any] | None = None, extra_body: Mapping[str, Any] | None = None, **params: Any
    ) -> Any:
        body = {key: value for key, value in params.items() if not isinstance(value, openai.Omit)}
        options: openai.RequestOptions = {}
        if extra_headers:
            options["headers"] = extra_headers
        if extra_body:
            options["extra_json"] = extra_body
        return await sdk.post(
            "/chat/completions",
            cast_to=ChatCompletion,
            body=body,
            options=options,
            stream=bool(body.get("stream")),
            stream_cls=openai.AsyncStream[ChatCompletionChunk],
        )

    return create


def _json(data: Any) -> bytes:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def _dump(obj: Any) -> Any:
    """An SDK object as the JSON the upstream sent (fields it did not send left out)."""
    to_dict = getattr(obj, "to_dict", None)
    return to_dict(mode="json", exclude_unset=True) if callable(to_dict) else obj


def _actions(actions: Sequence[Action]) -> str:
    """The fit's actions, compact: ``strategy:tokens saved`` each (``?``: the history before was not counted)."""
    parts = [f"{a.strategy}:{'?' if a.saved is None else a.saved}" for a in actions]
    return quote(",".join(parts), safe=":,?-_.") or "none"


class Proxy:
    """The proxy's ASGI app (``proxy.app``) with its routes (one keeper per model entry) and observers.

    ``upstream``: the server's OpenAI base URL (``http://127.0.0.1:8000/v1``). ``api_key``: the proxy's own key,
    which clients must send as ``Authorization: Bearer <key>``; then the upstream gets ``upstream_api_key``
    (or no key) instead. Without it the client's ``Authorization`` is forwarded (else ``upstream_api_key``).
    ``attempts``, ``backoff`` and ``max_backoff`` bound each chat request's retries as in ``keeper.wrap``;
    ``timeout`` is the seconds one upstream request may take."""

    def __init__(
        self,
        routes: Sequence[Route],
        *,
        upstream: str,
        api_key: str | None = None,
        upstream_api_key: str | None = None,
        attempts: int = 4,
        backoff: float = 0.5,
        max_backoff: float = 8.0,
        timeout: float = 600.0,
        debug_conversations: int = 1024,
    ) -> None:
        from ..backends.calls import options

        if not routes:
            raise ValueError("a proxy needs at least one route (a model entry with its keeper)")
        self.routes = list(routes)
        self.base, self.origin, self.prefix = _split_upstream(upstream)
        self.upstream = upstream
        self._api_key = api_key
        self._upstream_key = upstream_api_key
        self.timeout = timeout
        self.options: Options = options(attempts=attempts, backoff=backoff, max_backoff=max_backoff)
        self.debug = DebugStore(debug_conversations)
        self.observers: list[Observer] = [self.debug]
        self.metrics: ProxyMetrics | None = None
        try:
            from .metrics import ProxyMetrics
        except ImportError:  # prometheus-client is missing: /metrics says how to get it
            pass
        else:
            self.metrics = ProxyMetrics(self.routes)
            self.observe(self.metrics)
        self._http: httpx2.AsyncClient | None = None
        self._backend: OpenAIBackend | None = None
        self.app = Starlette(
            routes=[
                HTTPRoute("/v1/chat/completions", self.chat, methods=["POST"]),
                HTTPRoute("/metrics", self.scrape, methods=["GET"]),
                HTTPRoute("/contextkeeper/conversations", self.conversations, methods=["GET"]),
                HTTPRoute("/contextkeeper/conversations/{conversation:path}", self.conversation, methods=["GET"]),
                HTTPRoute("/{path:path}", self.forward, methods=_METHODS),
            ],
            lifespan=self._lifespan,
        )

    @classmethod
    def from_config(cls, config: ProxyConfig) -> Proxy:
        """A proxy from validated settings; builds a keeper per model entry (a ProxyConfigError names the entry
        whose keeper cannot be built)."""
        if config.upstream is None:
            from .config import ProxyConfigError

            raise ProxyConfigError(
                f"{config.source}: no upstream. Fix: pass --upstream URL (the server's OpenAI base URL, e.g. "
                'http://127.0.0.1:8000/v1) or set upstream = "..." in the config'
            )
        return cls(
            build_routes(config),
            upstream=config.upstream,
            api_key=config.api_key,
            upstream_api_key=config.upstream_api_key,
            attempts=config.attempts,
            backoff=config.backoff,
            max_backoff=config.max_backoff,
            timeout=config.timeout,
            debug_conversations=config.debug_conversations,
        )

    def observe(self, observer: Observer) -> None:
        """Call ``observer`` with every finished chat exchange (the one place a fit and a call are seen)."""
        self.observers.append(observer)

    def route_for(self, model: str) -> Route | None:
        """The first route whose entry matches ``model``."""
        return next((route for route in self.routes if route.matches(model)), None)

    # -------------------------------------------------------------------------------------- lifecycle
    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        import httpx2
        import openai

        from ..backends.openai import OpenAIBackend

        async def seen(response: httpx2.Response) -> None:
            holder = _UPSTREAM.get()
            if holder is not None:
                holder.headers = list(response.headers.raw)

        self._http = httpx2.AsyncClient(
            timeout=httpx2.Timeout(self.timeout, connect=min(10.0, self.timeout)),
            limits=httpx2.Limits(max_connections=1000, max_keepalive_connections=200),
            event_hooks={"response": [seen]},
        )
        # The key here is never sent: every chat request sets its own Authorization (or none).
        sdk = openai.AsyncOpenAI(
            base_url=self.base, api_key="unused", max_retries=0, timeout=self.timeout, http_client=self._http
        )
        self._backend = OpenAIBackend(sdk, create=_chat_sender(sdk))
        for route in self.routes:
            if route.entry.server == "auto" and route.keeper.detection is None:  # ask the upstream which it is
                probe = openai.AsyncOpenAI(base_url=self.base, api_key=self._upstream_key or "unused", max_retries=0)
                await anyio.to_thread.run_sync(route.keeper.wrap, probe)
        try:
            yield
        finally:
            await self._http.aclose()
            for route in self.routes:
                route.keeper.close()

    # ------------------------------------------------------------------------------------------- auth
    def _denied(self, request: Request) -> Response | None:
        """A 401 unless the request carries the proxy's key (when it has one)."""
        if self._api_key is None:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._api_key.encode()):
            return None
        message = (
            "this proxy needs its API key: send Authorization: Bearer <key>, with the key it was started with "
            "(--api-key, $CONTEXTKEEPER_PROXY_API_KEY or api_key in its config)"
        )
        return Response(
            error_body(message, type="invalid_request_error", code="invalid_api_key"),
            status_code=401,
            media_type="application/json",
            headers={"www-authenticate": "Bearer"},
        )

    def _authorization(self, request: Request) -> str | None:
        """The Authorization the upstream gets: the client's, unless the proxy has a key of its own."""
        given = None if self._api_key is not None else request.headers.get("authorization")
        if given:
            return given
        return f"Bearer {self._upstream_key}" if self._upstream_key else None

    # ------------------------------------------------------------------------------------------- chat
    async def chat(self, request: Request) -> Response:
        started = time.perf_counter()
        denied = self._denied(request)
        if denied is not None:
            self._done(None, None, None, False, 401, None, None, "invalid_api_key", started)
            return denied
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            return self._refuse(started, f"the request body is not JSON ({exc})", "invalid_json")
        if not isinstance(body, dict):
            return self._refuse(started, "the request body must be a JSON object", "invalid_json")
        messages = body.get("messages")
        model = body.get("model")
        if not isinstance(messages, list):
            return self._refuse(started, "messages must be a list of chat messages", "invalid_messages", "messages")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            return self._refuse(started, "tools must be a list of tool schemas", "invalid_tools", "tools")
        for key in _ANSWER_KEYS:
            value = body.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                return self._refuse(started, f"{key} must be a whole number >= 1, got {value!r}", "invalid_" + key, key)
        route = self.route_for(model if isinstance(model, str) else "")
        if route is None:
            names = "; ".join(route.name for route in self.routes)
            return self._refuse(
                started,
                f"no model entry of this proxy takes model {model!r} (entries: {names}). Fix: add a [[models]] "
                'entry whose match covers it, or a last entry with match = "*"',
                "model_not_configured",
                "model",
            )
        try:
            identity = identify(request.headers, body)
        except InvalidConversation as exc:
            return self._refuse(started, str(exc), "invalid_conversation")
        stream = bool(body.get("stream"))
        call = _ProxyCall(
            calls_of(route.keeper),
            self._sender(),
            dataclasses.replace(self.options, conversation=identity.id),
            messages,
            tools,
            self._params(body, request),
        )
        seen = _Seen()
        token = _UPSTREAM.set(seen)
        try:
            result = await call_async(call)
        except BaseException as exc:
            if not isinstance(exc, Exception):  # cancelled: the client went away before the answer
                self._done(identity, model, route, stream, 499, call.fit, call.report, "cancelled", started, timed=call)
                raise
            reply = error_reply(exc)
            error = f"{reply.code}: {' '.join(str(exc).split())[:300]}"
            self._done(identity, model, route, stream, reply.status, call.fit, call.report, error, started, timed=call)
            headers = {**reply.headers, **self._headers(call, identity, ())}
            return Response(reply.body, status_code=reply.status, headers=headers, media_type="application/json")
        finally:
            _UPSTREAM.reset(token)
        headers = self._headers(call, identity, seen.headers)
        if stream:
            return _Relay(
                self._events(result, call, identity, model, route, started),
                close=_nothing,  # the events' own end closes the stream
                headers={**headers, "cache-control": "no-cache", "x-accel-buffering": "no"},
                media_type="text/event-stream",
            )
        data = _json(_dump(result))
        self._done(identity, model, route, False, 200, call.fit, call.report, None, started, timed=call)
        return Response(data, headers=headers, media_type="application/json")

    def _sender(self) -> OpenAIBackend:
        if self._backend is None:
            raise RuntimeError("the proxy is not started: serve proxy.app with an ASGI server that runs its lifespan")
        return self._backend

    def _params(self, body: Mapping[str, Any], request: Request) -> dict[str, Any]:
        """The SDK's arguments for the chat request: the named ones, the rest as sent, and the headers."""
        import openai

        params = {key: body[key] for key in _NAMED if key in body}
        if "model" not in params:
            params["model"] = openai.omit
        extra = {key: value for key, value in body.items() if key not in _NAMED and key != "messages"}
        if extra:
            params["extra_body"] = extra
        headers: dict[str, Any] = {
            key: value
            for key, value in request.headers.items()
            if key not in HOP_BY_HOP and key not in _SDK_SETS and not key.startswith("x-stainless-")
        }
        authorization = self._authorization(request)
        headers["Authorization"] = authorization if authorization else openai.Omit()
        params["extra_headers"] = headers
        return params

    def _headers(self, call: _ProxyCall, identity: Identity, upstream: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
        """The upstream's answer headers (those that still apply) and what the keeper did."""
        headers: dict[str, str] = {}
        for raw_key, raw_value in upstream:
            key = raw_key.decode("latin-1").lower()
            if key not in HOP_BY_HOP and key not in _ANSWER_SETS:
                headers[key] = raw_value.decode("latin-1")
        fit = call.fit
        if fit is not None:
            report = fit.report
            headers["x-contextkeeper-prompt-tokens"] = str(fit.tokens)
            headers["x-contextkeeper-messages-dropped"] = str(max(0, report.messages_before - report.messages_after))
            headers["x-contextkeeper-actions"] = _actions(report.actions)
        headers["x-contextkeeper-conversation"] = identity.header_value
        if call.fit_seconds:  # the fits' time, the standard way (devtools and load tools read it); the upstream's kept
            timing = f"fit;dur={sum(call.fit_seconds) * 1000:.3f}"
            given = headers.get("server-timing")
            headers["server-timing"] = f"{given}, {timing}" if given else timing
        return headers

    async def _events(
        self, stream: Any, call: _ProxyCall, identity: Identity, model: Any, route: Route, started: float
    ) -> AsyncIterator[bytes]:
        """The stream as server-sent events, chunk by chunk; a stream that breaks ends with an error event."""
        chunks = 0
        error: str | None = None
        ended = False
        try:
            async for chunk in stream:
                chunks += 1
                yield b"data: " + _json(_dump(chunk)) + b"\n\n"
            ended = True
            yield b"data: [DONE]\n\n"
        except Exception as exc:  # the headers are sent: say it in the stream, as servers do
            ended = True
            reply = error_reply(exc)
            error = f"{reply.code}: {' '.join(str(exc).split())[:300]}"
            yield b"data: " + reply.body + b"\n\n"
        finally:
            if not ended:  # cancelled or closed: the client went away
                error = f"client_gone: the client left after {chunks} chunk(s), before the end of the stream"
            with anyio.CancelScope(shield=True):
                await stream.close()  # the call ends, and gives its admission back
            self._done(identity, model, route, True, 200, call.fit, call.report, error, started, chunks, timed=call)

    def _refuse(self, started: float, message: str, code: str, param: str | None = None) -> Response:
        self._done(None, None, None, False, 400, None, None, f"{code}: {message}", started)
        return Response(
            error_body(message, type="invalid_request_error", code=code, param=param),
            status_code=400,
            media_type="application/json",
        )

    def _done(
        self,
        identity: Identity | None,
        model: Any,
        route: Route | None,
        stream: bool,
        status: int,
        fit: Any,
        call: CallReport | None,
        error: str | None,
        started: float,
        chunks: int = 0,
        *,
        timed: _ProxyCall | None = None,
    ) -> None:
        """The one place an exchange is observed (debug store, and metrics and traces when they register)."""
        exchange = Exchange(
            conversation=identity.id if identity is not None else None,
            conversation_source=identity.source if identity is not None else None,
            model=model if isinstance(model, str) else None,
            route=route.name if route is not None else None,
            stream=stream,
            status=status,
            fit=fit,
            call=call,
            error=error,
            seconds=time.perf_counter() - started,
            chunks=chunks,
            fit_seconds=tuple(timed.fit_seconds) if timed is not None else (),
            upstream_seconds=timed.upstream_seconds if timed is not None else None,
        )
        for observer in self.observers:
            try:
                observer(exchange)
            except Exception:
                log.exception("a proxy observer failed on an exchange")

    # ---------------------------------------------------------------------------------------- metrics
    async def scrape(self, request: Request) -> Response:
        """``GET /metrics``: the proxy's own Prometheus metrics (the upstream's own /metrics is not forwarded)."""
        denied = self._denied(request)
        if denied is not None:
            return denied
        metrics = self.metrics
        if metrics is None:
            message = (
                "the proxy's metrics need prometheus-client, which is not installed. Fix: pip install "
                "'contextkeeper[proxy]' (or prometheus-client) and restart the proxy"
            )
            return Response(
                error_body(message, type="server_error", code="metrics_unavailable"),
                status_code=501,
                media_type="application/json",
            )
        # Off the loop: a Redis ledger's gauges are read over the network.
        body, content_type = await anyio.to_thread.run_sync(metrics.render, request.headers.get("accept"))
        return Response(body, headers={"content-type": content_type})

    # ------------------------------------------------------------------------------------------ debug
    async def conversation(self, request: Request) -> Response:
        denied = self._denied(request)
        if denied is not None:
            return denied
        name = request.path_params["conversation"]
        exchange = self.debug.get(name)
        if exchange is None:
            message = (
                f"no exchange of conversation {name!r} is remembered (the proxy keeps the latest of "
                f"{self.debug.size:,} conversations). Fix: check the id in the X-Contextkeeper-Conversation header"
            )
            return Response(
                error_body(message, type="invalid_request_error", code="unknown_conversation"),
                status_code=404,
                media_type="application/json",
            )
        try:
            data = _json(exchange.to_dict())
        except (TypeError, ValueError) as exc:  # a report field that is not JSON: say which, do not hide it
            log.exception("the exchange of conversation %r cannot be shown as JSON", name)
            message = f"the exchange of conversation {name!r} cannot be shown as JSON: {type(exc).__name__}: {exc}"
            return Response(
                error_body(message, type="server_error", code="report_not_json"),
                status_code=500,
                media_type="application/json",
            )
        return Response(data, media_type="application/json")

    async def conversations(self, request: Request) -> Response:
        denied = self._denied(request)
        if denied is not None:
            return denied
        return Response(_json({"conversations": self.debug.conversations()}), media_type="application/json")

    # ---------------------------------------------------------------------------------------- forward
    def _target(self, path: str, query: str) -> str:
        """The upstream URL of ``path``: under the proxy's ``/v1`` -> under the upstream's base, else its root."""
        under = path == "/v1" or path.startswith("/v1/")
        url = self.base + path[len("/v1") :] if under else self.origin + path
        return f"{url}?{query}" if query else url

    async def forward(self, request: Request) -> Response:
        """Any other request, passed on unchanged and its answer streamed back as it comes."""
        import httpx2

        denied = self._denied(request)
        if denied is not None:
            return denied
        assert self._http is not None, "the proxy is not started"
        drop = _hop_by_hop(request.headers.raw) | {b"authorization"}
        headers = [(key, value) for key, value in request.headers.raw if key.lower() not in drop]
        authorization = self._authorization(request)
        if authorization:
            headers.append((b"authorization", authorization.encode("latin-1")))
        has_body = "content-length" in request.headers or "transfer-encoding" in request.headers
        outgoing = self._http.build_request(
            request.method,
            self._target(request.url.path, request.url.query),
            headers=headers,
            content=request.stream() if has_body else None,
        )
        try:
            response = await self._http.send(outgoing, stream=True)
        except httpx2.TimeoutException as exc:
            return self._unreachable(504, f"the upstream did not answer in time: {type(exc).__name__}: {exc}")
        except httpx2.HTTPError as exc:
            return self._unreachable(502, f"the upstream cannot be reached: {type(exc).__name__}: {exc}")
        relay = _Relay(response.aiter_raw(), close=response.aclose, status_code=response.status_code)
        drop = _hop_by_hop(response.headers.raw)
        relay.raw_headers = [(key, value) for key, value in response.headers.raw if key.lower() not in drop]
        return relay

    def _unreachable(self, status: int, message: str) -> Response:
        fix = f"{message}. Fix: check that the server at {self.base} is running and reachable from the proxy"
        return Response(
            error_body(fix, type="server_error", code="upstream_unavailable"),
            status_code=status,
            media_type="application/json",
        )
