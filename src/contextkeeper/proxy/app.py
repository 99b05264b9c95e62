"""The proxy itself: an ASGI app (Starlette) in front of an OpenAI-compatible server.

``POST /v1/chat/completions`` goes through the keeper's wrapped-call machinery (:mod:`..calls.loop`, the
same steps as ``keeper.wrap(openai.AsyncOpenAI(...))``): fitted with the request's own ``tools`` and answer
budget, admitted against the KV capacity, sent with the openai SDK, refusals for length recovered and transport
errors retried within the same bounds, recorded in the keeper's transcript. Streams pass through chunk by chunk.
Every other path is forwarded unchanged (method, query, body and headers, hop-by-hop headers aside), its answer
streamed back as it comes.

Each chat answer says what was done in its headers (``X-Contextkeeper-Prompt-Tokens``, ``-Messages-Dropped``,
``-Actions``, ``-Conversation``, and the fits' time as ``Server-Timing: fit;dur=<ms>``);
``GET /contextkeeper/conversations/{id}`` shows the latest exchange of a conversation with the fit's whole report.

Every request is treated as possibly hostile (docs/proxy.md, "Security"): its ``Host`` and ``Origin`` are checked
and its caller's tenant found (:mod:`.access`) before anything else; a chat body is read within the input limits
and checked before the keeper sees it (:mod:`.limits`), large ones off the event loop; a client that goes away
cancels its call and gives its KV room back; only allowlisted paths are forwarded; credentials in the upstream URL
are never shown.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import contextvars
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote, urlsplit

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route as HTTPRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .._exceptions import ConfigurationError, RequestRejected
from ..calls.loop import Call, CallReport, Hooks, Options, call_async
from ..calls.redis_client import safe_url
from .access import UNFITTED, Access, Caller, Forwarding, loopback_host
from .config import ProxyConfig, Route, build_routes
from .errors import error_body, error_reply
from .identity import HEADER, Identity, identify
from .limits import OFF_LOOP_BYTES, InputLimits, check_chat, parse_json, read_body
from .observe import DebugStore, Exchange, Observer

if TYPE_CHECKING:
    import httpx2
    import openai

    from ..backends.openai import OpenAIBackend
    from ..fit.report import Fit
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
# Client headers never passed upstream: a browser's (the upstream is not the site it came from) and the proxy's own.
_NOT_FORWARDED = frozenset({"origin", "cookie", "referer", "x-forwarded-for"})
_NOT_FORWARDED_BYTES = frozenset(name.encode("ascii") for name in _NOT_FORWARDED)


@dataclass
class _Seen:
    """The upstream's answer headers for one chat request, caught by the HTTP client's response hook."""

    headers: list[tuple[bytes, bytes]] = dataclasses.field(default_factory=list)


_UPSTREAM: contextvars.ContextVar[_Seen | None] = contextvars.ContextVar("contextkeeper_proxy_seen", default=None)


class _Timing:
    """What the proxy hears of one chat request's call through its hooks: its fits' time, its time upstream
    (attempt by attempt) and its report (``keeper.last_call`` is whichever call of the keeper ended last)."""

    def __init__(self) -> None:
        self.fit_seconds: list[float] = []
        self.upstream_seconds: float | None = None
        self.report: CallReport | None = None
        self._sent: float | None = None

    def hooks(self) -> Hooks:
        return Hooks(fit=(self._fitted,), attempt=(self._leaving,), back=(self._back,), report=(self._reported,))

    def _fitted(self, fit: Fit) -> None:
        self.fit_seconds.append(fit.report.seconds)

    def _leaving(self, request: Any) -> None:
        self._sent = time.perf_counter()

    def _back(self) -> None:
        if self._sent is not None:
            self.upstream_seconds = (self.upstream_seconds or 0.0) + time.perf_counter() - self._sent
            self._sent = None

    def _reported(self, report: CallReport) -> None:
        self.report = report


@dataclass(frozen=True)
class _Chat:
    """One chat request on its way: whose, for which model and route, and its call with what was heard of it."""

    identity: Identity
    model: Any
    route: Route
    stream: bool
    call: Call
    timing: _Timing


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


@dataclass(frozen=True)
class Upstream:
    """The upstream's OpenAI base URL without credentials: ``base`` (``http://host:8000/v1``), ``origin``
    (``http://host:8000``), ``prefix`` (``/v1``; a URL without a path means ``/v1``), ``shown`` (for messages:
    nothing secret), and ``basic``: the ``Authorization`` its userinfo stood for (``http://user:pass@host``), which
    is sent as the upstream's credential and never shown."""

    base: str
    origin: str
    prefix: str
    shown: str
    basic: str | None = None

    @classmethod
    def parse(cls, url: str) -> Upstream:
        parsed = urlsplit(url)
        path = parsed.path.rstrip("/") or "/v1"
        host = parsed.hostname or ""
        netloc = f"[{host}]" if ":" in host else host
        if parsed.port is not None:
            netloc += f":{parsed.port}"
        origin = f"{parsed.scheme}://{netloc}"
        basic = None
        if parsed.username is not None or parsed.password is not None:
            pair = f"{unquote(parsed.username or '')}:{unquote(parsed.password or '')}"
            basic = "Basic " + base64.b64encode(pair.encode("utf-8")).decode("ascii")
        return cls(base=origin + path, origin=origin, prefix=path, shown=safe_url(origin + path), basic=basic)


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


_JSON_TYPES = ("application/json", "application/x-ndjson")
_CORS_HEADERS = "authorization, content-type, x-conversation-id, openai-organization, openai-project"
_EXPOSED = "x-contextkeeper-prompt-tokens, x-contextkeeper-messages-dropped, x-contextkeeper-actions, " + (
    "x-contextkeeper-conversation, x-contextkeeper-fitted, server-timing, x-request-id"
)


def _json_type(value: str | None) -> bool:
    """Whether a Content-Type is JSON (``application/json``, ``application/*+json``, any parameters)."""
    kind = (value or "").split(";", 1)[0].strip().lower()
    return kind in _JSON_TYPES or (kind.startswith("application/") and kind.endswith("+json"))


def _plain_reply(status: int, message: str, code: str, *, type: str = "invalid_request_error") -> Response:
    return Response(error_body(message, type=type, code=code), status_code=status, media_type="application/json")


class _Guard:
    """Every request's first check, before routing: its ``Host`` names this proxy (no DNS rebinding) and its
    ``Origin``, when a browser sent one, is allowed (CORS: preflights answered here, allowed origins' answers
    marked); everything else is refused in OpenAI's error shape."""

    def __init__(self, app: ASGIApp, access: Access) -> None:
        self.app = app
        self.access = access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {key.decode("latin-1").lower(): value.decode("latin-1") for key, value in scope["headers"]}
        if not self.access.host_allowed(headers.get("host")):
            message = (
                f"Host {headers.get('host', '')[:100]!r} does not name this proxy. Fix: call it by an allowed name, "
                "or add the name to allowed_hosts in the proxy's config"
            )
            await _plain_reply(421, message, "host_not_allowed")(scope, receive, send)
            return
        origin = headers.get("origin")
        if origin is not None and not self.access.origin_allowed(origin):
            message = (
                f"requests from the web origin {origin[:100]!r} are not allowed (a page cannot call this proxy "
                "with its credentials). Fix: add the origin to cors_origins in the proxy's config"
            )
            await _plain_reply(403, message, "origin_not_allowed")(scope, receive, send)
            return
        if origin is None:
            await self.app(scope, receive, send)
            return
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            preflight = Response(
                status_code=204,
                headers={
                    "access-control-allow-origin": origin,
                    "access-control-allow-methods": "GET, POST, OPTIONS",
                    "access-control-allow-headers": headers.get("access-control-request-headers", _CORS_HEADERS),
                    "access-control-max-age": "600",
                    "vary": "Origin",
                },
            )
            await preflight(scope, receive, send)
            return

        async def marked(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [
                    *message.get("headers", []),
                    (b"access-control-allow-origin", origin.encode("latin-1")),
                    (b"access-control-expose-headers", _EXPOSED.encode("latin-1")),
                    (b"vary", b"Origin"),
                ]
            await send(message)

        await self.app(scope, receive, marked)


async def _until_gone(receive: Receive) -> None:
    """Returns when the client disconnects (the body has been read: the next ASGI message is the disconnect)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class _Gone(Exception):
    """The client of a chat request went away before its answer."""


class Proxy:
    """The proxy's ASGI app (``proxy.app``) with its routes (one keeper per model entry) and observers.

    ``upstream``: the server's OpenAI base URL (``http://127.0.0.1:8000/v1``; userinfo in it is the upstream's
    credential, sent as Basic auth and never shown). ``access``: keys, tenants, hosts, origins and who reads the
    metrics and debug views (:class:`~.access.Access`); ``api_key`` is the shortcut for one proxy key, which
    clients must send as ``Authorization: Bearer <key>`` (then the upstream gets ``upstream_api_key``, its URL's
    userinfo, or no key instead; without a proxy key the client's ``Authorization`` is forwarded, else those).
    ``limits``: what one request may hold (:class:`~.limits.InputLimits`); ``forward``: ``METHOD /path`` globs
    passed to the upstream besides :data:`~.access.DEFAULT_FORWARD` (``"*"``: every path).
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
        access: Access | None = None,
        limits: InputLimits | None = None,
        forward: Sequence[str] = (),
    ) -> None:
        from ..calls.loop import options

        if not routes:
            raise ValueError("a proxy needs at least one route (a model entry with its keeper)")
        self.routes = list(routes)
        self.target = Upstream.parse(upstream)
        self.base, self.origin, self.prefix = self.target.base, self.target.origin, self.target.prefix
        self.upstream = self.target.shown
        if self.target.basic is not None and upstream_api_key is not None:
            raise ConfigurationError(
                "the upstream URL carries a user and password and upstream_api_key is set too: the upstream would "
                "get one of two credentials. Fix: keep one (the URL's userinfo is sent as Basic auth)"
            )
        if access is None:
            access = Access(
                keys={"default": api_key} if api_key else {}, allowed_hosts=("localhost", "127.0.0.1", "::1")
            )
        elif api_key is not None:
            raise ConfigurationError("give the proxy's key in access= or as api_key=, not both")
        self.access = access
        self.limits = limits or InputLimits()
        self.forwarding = Forwarding(forward)
        self._upstream_auth = f"Bearer {upstream_api_key}" if upstream_api_key else self.target.basic
        self.timeout = timeout
        self.options: Options = options(attempts=attempts, backoff=backoff, max_backoff=max_backoff)
        self.debug = DebugStore(debug_conversations)
        self.observers: list[Observer] = [self.debug]
        self.metrics: ProxyMetrics | None = None
        self._unfitted_said: set[str] = set()
        try:
            from .metrics import ProxyMetrics
        except ImportError:  # prometheus-client is missing: /metrics says how to get it
            pass
        else:
            self.metrics = ProxyMetrics(self.routes)
            self.observe(self.metrics)
        self._http: httpx2.AsyncClient | None = None
        self._backend: OpenAIBackend | None = None
        self.app = _Guard(
            Starlette(
                routes=[
                    HTTPRoute("/v1/chat/completions", self.chat, methods=["POST"]),
                    HTTPRoute("/metrics", self.scrape, methods=["GET"]),
                    HTTPRoute("/contextkeeper/conversations", self.conversations, methods=["GET"]),
                    HTTPRoute("/contextkeeper/conversations/{conversation:path}", self.conversation, methods=["GET"]),
                    HTTPRoute("/{path:path}", self.forward, methods=_METHODS),
                ],
                lifespan=self._lifespan,
            ),
            access,
        )

    @classmethod
    def from_config(cls, config: ProxyConfig, *, host: str = "127.0.0.1") -> Proxy:
        """A proxy from validated settings, served on ``host``; builds a keeper per model entry (a
        ProxyConfigError names the entry whose keeper cannot be built, or a setting that cannot hold)."""
        from .config import ProxyConfigError

        if config.upstream is None:
            raise ProxyConfigError(
                f"{config.source}: no upstream. Fix: pass --upstream URL (the server's OpenAI base URL, e.g. "
                'http://127.0.0.1:8000/v1) or set upstream = "..." in the config'
            )
        access = config.access(host)
        if not access.keyed and not loopback_host(host) and not config.allow_unauthenticated:
            raise ProxyConfigError(
                f"{config.source}: the proxy would listen on {host}, beyond this machine, without a key of its own: "
                "anyone who reaches it could use the upstream (and its key). Fix: set a proxy key (--api-key, "
                "$CONTEXTKEEPER_PROXY_API_KEY, api_key or [api_keys] in the config), or set "
                "allow_unauthenticated = true (--allow-unauthenticated) when something in front authenticates"
            )
        try:
            return cls(
                build_routes(config),
                upstream=config.upstream,
                upstream_api_key=config.upstream_api_key,
                attempts=config.attempts,
                backoff=config.backoff,
                max_backoff=config.max_backoff,
                timeout=config.timeout,
                debug_conversations=config.debug_conversations,
                access=access,
                limits=config.input_limits(),
                forward=config.forward,
            )
        except ProxyConfigError:
            raise
        except ConfigurationError as exc:
            raise ProxyConfigError(f"{config.source}: {exc}") from None

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
                probe = openai.AsyncOpenAI(
                    base_url=self.base,
                    api_key="unused",
                    max_retries=0,
                    default_headers={"Authorization": self._upstream_auth} if self._upstream_auth else None,
                )
                await anyio.to_thread.run_sync(route.keeper.wrap, probe)
        try:
            yield
        finally:
            await self._http.aclose()
            for route in self.routes:
                route.keeper.close()

    # ------------------------------------------------------------------------------------------- auth
    def _caller(self, request: Request) -> Caller | Response:
        """Who sent ``request``, or the 401 (or 400) to answer when its key does not pass."""
        client = request.client.host if request.client is not None else None
        try:
            caller = self.access.caller(request.headers.get("authorization"), request.headers, client)
        except RequestRejected as exc:
            return _plain_reply(exc.status, str(exc), exc.code)
        if caller is not None:
            return caller
        message = (
            "this proxy needs its API key: send Authorization: Bearer <key>, with a key it was started with "
            "(--api-key, $CONTEXTKEEPER_PROXY_API_KEY, api_key or [api_keys] in its config)"
        )
        return Response(
            error_body(message, type="invalid_request_error", code="invalid_api_key"),
            status_code=401,
            media_type="application/json",
            headers={"www-authenticate": "Bearer"},
        )

    def _authorization(self, request: Request) -> str | None:
        """The Authorization the upstream gets: the client's, unless the proxy has keys of its own (or the caller
        used the admin key); else the upstream's own credential (upstream_api_key, or its URL's userinfo)."""
        given = request.headers.get("authorization")
        if given and not self.access.keyed and not self._is_admin_key(given):
            return given
        return self._upstream_auth

    def _is_admin_key(self, authorization: str) -> bool:
        caller = self.access.caller(authorization, {}, None) if self.access.admin_key else None
        return caller is not None and caller.admin

    # ------------------------------------------------------------------------------------------- chat
    def _read_chat(self, raw: bytes, headers: Mapping[str, str], caller: Caller) -> tuple[dict[str, Any], Identity]:
        """A chat body parsed and checked, and its conversation (on a worker thread when the body is large)."""
        body = check_chat(parse_json(raw, self.limits), self.limits, len(raw))
        try:
            identity = identify(headers, body, caller.tenant)
        except ValueError as exc:
            raise RequestRejected(str(exc), code="invalid_conversation") from None
        return body, identity

    async def chat(self, request: Request) -> Response:
        started = time.perf_counter()
        caller = self._caller(request)
        if isinstance(caller, Response):
            self._done(None, caller.status_code, "invalid_api_key", started)
            return caller
        try:
            if not _json_type(request.headers.get("content-type")):
                raise RequestRejected(
                    f"a chat request's body must be sent as Content-Type: application/json, not "
                    f"{request.headers.get('content-type', 'none')[:60]!r}",
                    status=415,
                    code="unsupported_media_type",
                    fix="send the body as JSON with Content-Type: application/json",
                )
            raw = await read_body(request.headers, request.stream(), self.limits)
            if len(raw) > OFF_LOOP_BYTES:  # parsing and checking a large body must not stall other clients
                body, identity = await anyio.to_thread.run_sync(self._read_chat, raw, request.headers, caller)
            else:
                body, identity = self._read_chat(raw, request.headers, caller)
        except RequestRejected as exc:
            return self._refuse(started, exc, caller)
        del raw
        model = body.get("model")
        route = self.route_for(model if isinstance(model, str) else "")
        if route is None:
            names = "; ".join(route.name for route in self.routes)
            rejected = RequestRejected(
                f"no model entry of this proxy takes model {model!r:.100} (entries: {names}). Fix: add a [[models]] "
                'entry whose match covers it, or a last entry with match = "*"',
                code="model_not_configured",
                param="model",
            )
            return self._refuse(started, rejected, caller)
        stream = body.get("stream") is True
        timing = _Timing()
        call = Call(
            route.keeper.calls,
            self._sender(),
            dataclasses.replace(self.options, conversation=identity.key),
            body["messages"],
            body.get("tools"),
            self._params(body, request),
            hooks=timing.hooks(),
        )
        chat = _Chat(identity, model, route, stream, call, timing)
        seen = _Seen()
        token = _UPSTREAM.set(seen)
        try:
            result = await self._unless_gone(request, call)
        except _Gone:
            error = "client_gone: the client left before the answer; the call was cancelled and its KV room freed"
            self._done(chat, 499, error, started)
            return Response(status_code=499)
        except BaseException as exc:
            if not isinstance(exc, Exception):  # cancelled: the server is shutting down
                self._done(chat, 499, "cancelled", started)
                raise
            reply = error_reply(exc)
            error = f"{reply.code}: {' '.join(str(exc).split())[:300]}"
            self._done(chat, reply.status, error, started)
            headers = {**reply.headers, **self._headers(chat, ())}
            return Response(reply.body, status_code=reply.status, headers=headers, media_type="application/json")
        finally:
            _UPSTREAM.reset(token)
        headers = self._headers(chat, seen.headers)
        if stream:
            return _Relay(
                self._events(result, chat, started),
                close=_nothing,  # the events' own end closes the stream
                headers={**headers, "cache-control": "no-cache", "x-accel-buffering": "no"},
                media_type="text/event-stream",
            )
        data = _json(_dump(result))
        self._done(chat, 200, None, started)
        return Response(data, headers=headers, media_type="application/json")

    @staticmethod
    async def _unless_gone(request: Request, call: Call) -> Any:
        """The call's result, or :class:`_Gone` as soon as its client disconnects (the call is cancelled: a
        queued admission leaves the queue, a held one gives its tokens back, a request upstream is aborted)."""
        work = asyncio.ensure_future(call_async(call))
        watch = asyncio.ensure_future(_until_gone(request.receive))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (work, watch):
                if not task.done():
                    task.cancel()
        if work.done() and not work.cancelled():
            return work.result()
        with contextlib.suppress(BaseException):
            await work  # its own error handling frees what it held
        raise _Gone()

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
        drop = {name.decode("latin-1") for name in _hop_by_hop(request.headers.raw)}
        headers: dict[str, Any] = {
            key: value
            for key, value in request.headers.items()
            if key not in drop
            and key not in _SDK_SETS
            and key not in _NOT_FORWARDED
            and not key.startswith("x-stainless-")
        }
        authorization = self._authorization(request)
        headers["Authorization"] = authorization if authorization else openai.Omit()
        params["extra_headers"] = headers
        return params

    def _headers(self, chat: _Chat, upstream: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
        """The upstream's answer headers (those that still apply) and what the keeper did."""
        headers: dict[str, str] = {}
        for raw_key, raw_value in upstream:
            key = raw_key.decode("latin-1").lower()
            if key not in HOP_BY_HOP and key not in _ANSWER_SETS:
                headers[key] = raw_value.decode("latin-1")
        fit = chat.call.fit
        if fit is not None:
            report = fit.report
            headers["x-contextkeeper-prompt-tokens"] = str(fit.tokens)
            headers["x-contextkeeper-messages-dropped"] = str(max(0, report.messages_before - report.messages_after))
            headers["x-contextkeeper-actions"] = _actions(report.actions)
        headers["x-contextkeeper-conversation"] = chat.identity.header_value
        if (
            chat.timing.fit_seconds
        ):  # the fits' time, the standard way (devtools and load tools read it); the upstream's kept
            timing = f"fit;dur={sum(chat.timing.fit_seconds) * 1000:.3f}"
            given = headers.get("server-timing")
            headers["server-timing"] = f"{given}, {timing}" if given else timing
        return headers

    async def _events(self, stream: Any, chat: _Chat, started: float) -> AsyncIterator[bytes]:
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
            self._done(chat, 200, error, started, chunks)

    def _refuse(self, started: float, exc: RequestRejected, caller: Caller | None = None) -> Response:
        """A request refused before the keeper saw it: nothing of it is kept but the refusal."""
        self._done(None, exc.status, f"{exc.code}: {exc}"[:500], started)
        return Response(
            error_body(str(exc), type="invalid_request_error", code=exc.code, param=exc.param),
            status_code=exc.status,
            media_type="application/json",
        )

    def _done(self, chat: _Chat | None, status: int, error: str | None, started: float, chunks: int = 0) -> None:
        """The one place an exchange is observed (debug store, and metrics and traces when they register)."""
        identity = chat.identity if chat is not None else None
        exchange = Exchange(
            conversation=identity.id if identity is not None else None,
            conversation_source=identity.source if identity is not None else None,
            tenant=identity.tenant if identity is not None else None,
            model=chat.model if chat is not None and isinstance(chat.model, str) else None,
            route=chat.route.name if chat is not None else None,
            stream=chat.stream if chat is not None else False,
            status=status,
            fit=chat.call.fit if chat is not None else None,
            call=chat.timing.report if chat is not None else None,
            error=error,
            seconds=time.perf_counter() - started,
            chunks=chunks,
            fit_seconds=tuple(chat.timing.fit_seconds) if chat is not None else (),
            upstream_seconds=chat.timing.upstream_seconds if chat is not None else None,
            sent=chat.call.sent if chat is not None else 0,
        )
        for observer in self.observers:
            try:
                observer(exchange)
            except Exception:
                log.exception("a proxy observer failed on an exchange")

    # ---------------------------------------------------------------------------------------- metrics
    def _admitted(self, request: Request, scope: str) -> Caller | Response:
        """The caller of a metrics or debug request, when ``scope`` lets it in; else the answer to give."""
        client = request.client.host if request.client is not None else None
        loopback = client is not None and loopback_host(client)
        if scope == "loopback" and loopback and not self.access.keyed:
            return Caller("admin", admin=True, loopback=True)
        caller = self._caller(request)
        if isinstance(caller, Response):
            if scope == "loopback" and loopback:  # this machine's scraper needs no key
                return Caller("admin", admin=True, loopback=True)
            return caller
        if self.access.may(scope, caller):  # type: ignore[arg-type]
            return caller
        where = {
            "loopback": "from this machine (loopback) or with the admin key",
            "admin": "with the admin key",
            "off": "by nobody: it is switched off",
        }.get(scope, "with the admin key")
        return _plain_reply(403, f"this endpoint is served only {where}", "forbidden", type="permission_error")

    async def scrape(self, request: Request) -> Response:
        """``GET /metrics``: the proxy's own Prometheus metrics (the upstream's own /metrics is not forwarded)."""
        caller = self._admitted(request, self.access.metrics)
        if isinstance(caller, Response):
            return caller
        metrics = self.metrics
        if metrics is None:
            message = (
                "the proxy's metrics need prometheus-client, which is not installed. Fix: pip install "
                "'contextkeeper[proxy]' (or prometheus-client) and restart the proxy"
            )
            return _plain_reply(501, message, "metrics_unavailable", type="server_error")
        # Off the loop: a Redis ledger's gauges are read over the network.
        body, content_type = await anyio.to_thread.run_sync(metrics.render, request.headers.get("accept"))
        return Response(body, headers={"content-type": content_type})

    # ------------------------------------------------------------------------------------------ debug
    async def conversation(self, request: Request) -> Response:
        caller = self._admitted(request, self.access.debug)
        if isinstance(caller, Response):
            return caller
        name = request.path_params["conversation"]
        tenant = caller.tenant
        if caller.admin and "/" in name:  # the admin names a conversation as tenant/id (what its listing shows)
            tenant, _, name = name.partition("/")
        exchange = self.debug.get(tenant, name)
        if exchange is None:
            message = (
                f"no exchange of conversation {name[:300]!r} is remembered for this caller (the proxy keeps the latest "
                f"of {self.debug.size:,} conversations). Fix: check the id in the X-Contextkeeper-Conversation header"
            )
            return _plain_reply(404, message, "unknown_conversation")
        try:
            data = _json(exchange.to_dict())
        except (TypeError, ValueError) as exc:  # a report field that is not JSON: say which, do not hide it
            log.exception("the exchange of conversation %r cannot be shown as JSON", name)
            message = f"the exchange of conversation {name!r} cannot be shown as JSON: {type(exc).__name__}: {exc}"
            return _plain_reply(500, message, "report_not_json", type="server_error")
        return Response(data, media_type="application/json")

    async def conversations(self, request: Request) -> Response:
        caller = self._admitted(request, self.access.debug)
        if isinstance(caller, Response):
            return caller
        listed = self.debug.conversations(None if caller.admin else caller.tenant)
        if caller.admin:
            names = [f"{item['tenant']}/{item['conversation']}" for item in listed if isinstance(item, dict)]
            return Response(_json({"conversations": names}), media_type="application/json")
        return Response(_json({"conversations": listed}), media_type="application/json")

    # ---------------------------------------------------------------------------------------- forward
    def _target(self, path: str, query: str) -> str:
        """The upstream URL of ``path``: under the proxy's ``/v1`` -> under the upstream's base, else its root."""
        under = path == "/v1" or path.startswith("/v1/")
        url = self.base + path[len("/v1") :] if under else self.origin + path
        return f"{url}?{query}" if query else url

    def _checked_path(self, request: Request) -> str:
        """The request's path, refused when it is too long, holds control characters or dot segments, or is not on
        the forwarding allowlist."""
        raw = request.scope.get("raw_path") or request.url.path.encode("utf-8", "surrogateescape")
        query = request.scope.get("query_string", b"")
        if len(raw) + len(query) > self.limits.path_bytes:
            raise RequestRejected(
                f"the path and query take {len(raw) + len(query):,} bytes; this proxy forwards at most "
                f"{self.limits.path_bytes:,}",
                status=414,
                code="path_too_long",
                fix="raise limits.path_bytes in the proxy's config",
            )
        path = request.url.path
        segments = path.split("/")
        if (
            not path.startswith("/")
            or any(not char.isprintable() for char in path)
            or "\\" in path
            or any(segment in (".", "..") for segment in segments)
            or "//" in path
        ):
            raise RequestRejected(
                f"the path {path[:200]!r} holds control characters, backslashes or dot segments",
                code="invalid_path",
            )
        if not self.forwarding.allows(request.method, path):
            raise RequestRejected(
                f"{request.method} {path[:200]} is not forwarded by this proxy (only OpenAI-compatible client routes "
                "are, by default)",
                status=404,
                code="route_not_forwarded",
                fix=f'add "{request.method} {path[:200]}" to forward = [...] in the proxy config',
            )
        return path

    async def forward(self, request: Request) -> Response:
        """Any other allowlisted request, passed on unchanged and its answer streamed back as it comes."""
        import httpx2

        caller = self._caller(request)
        if isinstance(caller, Response):
            return caller
        try:
            path = self._checked_path(request)
            declared = request.headers.get("content-length")
            if declared is not None and declared.strip().isdigit() and int(declared) > self.limits.body_bytes:
                raise RequestRejected(
                    f"the request body is {int(declared):,} bytes; this proxy takes at most {self.limits.body_bytes:,}",
                    status=413,
                    code="body_too_large",
                    fix="raise limits.body_bytes in the proxy's config",
                )
        except RequestRejected as exc:
            return _plain_reply(exc.status, str(exc), exc.code)
        assert self._http is not None, "the proxy is not started"
        drop = _hop_by_hop(request.headers.raw) | {b"authorization"} | _NOT_FORWARDED_BYTES
        headers = [(key, value) for key, value in request.headers.raw if key.lower() not in drop]
        authorization = self._authorization(request)
        if authorization:
            headers.append((b"authorization", authorization.encode("latin-1")))
        has_body = "content-length" in request.headers or "transfer-encoding" in request.headers
        outgoing = self._http.build_request(
            request.method,
            self._target(path, request.url.query),
            headers=headers,
            content=self._bounded(request.stream()) if has_body else None,
        )
        try:
            response = await self._http.send(outgoing, stream=True)
        except RequestRejected as exc:
            return _plain_reply(exc.status, str(exc), exc.code)
        except httpx2.TimeoutException as exc:
            return self._unreachable(504, f"the upstream did not answer in time: {type(exc).__name__}")
        except httpx2.HTTPError as exc:
            return self._unreachable(502, f"the upstream cannot be reached: {type(exc).__name__}: {exc}")
        relay = _Relay(response.aiter_raw(), close=response.aclose, status_code=response.status_code)
        drop = _hop_by_hop(response.headers.raw) | {b"date", b"server"}  # the proxy's own server sets these
        relay.raw_headers = [(key, value) for key, value in response.headers.raw if key.lower() not in drop]
        unfitted = UNFITTED.get(path[len("/v1") :] if path.startswith("/v1/") else path) or UNFITTED.get(path)
        if unfitted is not None:
            relay.raw_headers.append((b"x-contextkeeper-fitted", f"no ({unfitted} is passed through)".encode()))
            if path not in self._unfitted_said:
                self._unfitted_said.add(path)
                log.warning(
                    "%s %s is forwarded unfitted: the keeper reads chat completions only, not %s (no trimming, "
                    "admission or transcript for it)",
                    request.method,
                    path,
                    unfitted,
                )
        return relay

    async def _bounded(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """A forwarded body, passed on as it arrives, cut off with a 413 past ``limits.body_bytes``."""
        size = 0
        async for chunk in chunks:
            size += len(chunk)
            if size > self.limits.body_bytes:
                raise RequestRejected(
                    f"the request body is over {self.limits.body_bytes:,} bytes, the most this proxy takes",
                    status=413,
                    code="body_too_large",
                    fix="raise limits.body_bytes in the proxy's config",
                )
            yield chunk

    def _unreachable(self, status: int, message: str) -> Response:
        text = safe_url(message).replace(self.base, self.upstream)
        fix = f"{text}. Fix: check that the server at {self.upstream} is running and reachable from the proxy"
        return _plain_reply(status, fix, "upstream_unavailable", type="server_error")
