"""The proxy's HTTP/1.1 connections: uvicorn's h11 protocol with the deadlines and bounds it lacks.

uvicorn times out only an idle keep-alive connection and bounds a head only while it is incomplete. Here every
connection also has:

- a **head deadline**: the request line and headers must arrive within ``header_timeout`` seconds (of the
  connection opening, or of the head's first byte on a reused one). A partial head then gets a 408; a connection
  that sent nothing is closed without a word (there is no request to answer).
- a **body deadline**: while a body is being read (and reading is not paused by our own back-pressure), the client
  may be silent for at most ``body_timeout`` seconds, and after that grace it must average ``min_body_rate``
  bytes per second. Otherwise a 408, and the app's ``receive()`` answers ``http.disconnect`` at once.
- **bounded heads**: a head over ``max_header_bytes`` gets a 431 (a request line alone over it: 414), whether it
  arrives in pieces (h11's buffer bound) or in one read (measured when parsed).
- **unambiguous framing** (RFC 9112): ``Content-Length`` together with ``Transfer-Encoding``, a transfer coding
  other than a lone ``chunked``, conflicting lengths and obsolete line folding get a 400; none reaches the app.
- **a connection limit**: past ``max_connections`` open connections (or that many requests in flight) a 503.

Every refusal is one JSON body in OpenAI's error shape with ``Connection: close``, written by the protocol (a
refused head never reaches the app; an app reading a body that times out gets ``http.disconnect``, and what it
sends after is dropped), followed by a *lingering close*: our side is shut for writing and what the client still
sends is read and thrown away for up to :data:`LINGER_SECONDS`, so that the client reads the answer instead of a
TCP reset (a socket closed with unread input resets the connection, and the reset can overtake the answer).
"""

from __future__ import annotations

import asyncio
import http
import logging
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import h11
from uvicorn._types import ASGIReceiveCallable, ASGISendCallable, Scope
from uvicorn.config import Config
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle
from uvicorn.server import ServerState

from .._exceptions import ConfigurationError
from .errors import error_body

__all__ = ["LINGER_SECONDS", "LimitedH11Protocol", "ServerLimits", "protocol_class"]

log = logging.getLogger("contextkeeper.proxy")

# How long a refused connection keeps reading (and discarding) after its answer before it is closed; a client
# that closes first ends it sooner.
LINGER_SECONDS = 2.0

_BLANK_LINE = re.compile(rb"\n\r?\n")  # the end of a head, as h11 finds it
_FOLDED_LINE = re.compile(rb"\n[ \t]")  # a header line continued on the next (obs-fold, RFC 9112 5.2)
_Next = h11.Event | type[h11.NEED_DATA] | type[h11.PAUSED]  # what h11's next_event() returns
_ECHOED_BYTES = re.compile(r":? b['\"].*", re.DOTALL)  # h11 quotes the offending line: never echo client bytes


@dataclass(frozen=True, kw_only=True)
class ServerLimits:
    """How long and how much the proxy's HTTP server waits for and takes from one client.

    ``header_timeout``: seconds for a whole request head (request line and headers) to arrive, from the
    connection opening or the head's first byte; ``body_timeout``: the longest silence while a body is read, and
    the grace before ``min_body_rate`` (bytes per second a body must average; 0: no rate) applies;
    ``keep_alive_timeout``: seconds an idle connection is kept between requests; ``max_header_bytes``: the largest
    request head; ``max_connections``: open connections (and requests in flight) served at once, more get a 503;
    ``graceful_shutdown``: seconds in-flight requests get to finish when the server stops.
    """

    header_timeout: float = 10.0
    body_timeout: float = 10.0
    min_body_rate: int = 1024
    keep_alive_timeout: float = 5.0
    max_header_bytes: int = 32 * 1024
    max_connections: int = 1000
    graceful_shutdown: float = 5.0

    def __post_init__(self) -> None:
        for field in fields(self):
            name, value = field.name, getattr(self, field.name)
            whole = field.type in (int, "int")
            smallest = {"min_body_rate": 0, "max_header_bytes": 1024, "max_connections": 1}.get(name, 0)
            wrong = isinstance(value, bool) or not isinstance(value, int if whole else (int, float))
            if not wrong:
                wrong = value < smallest if whole else not (math.isfinite(value) and value > 0)
            if wrong:
                want = f"a whole number >= {smallest}" if whole else "a number of seconds > 0"
                raise ConfigurationError(
                    f"server limit {name} must be {want}, got {value!r}. Fix: set {name} to {want} "
                    f"(the default is {field.default!r})"
                )


class _WatchedFlow(FlowControl):
    """uvicorn's flow control, telling the protocol when reading pauses or resumes (a paused body is our doing,
    not the client's, so its clock stops)."""

    def __init__(self, transport: asyncio.Transport, on_reading: Callable[[bool], None]) -> None:
        super().__init__(transport)
        self._on_reading = on_reading

    def pause_reading(self) -> None:
        if not self.read_paused:
            super().pause_reading()
            self._on_reading(False)

    def resume_reading(self) -> None:
        if self.read_paused:
            super().resume_reading()
            self._on_reading(True)


class _GuardedConnection(h11.Connection):
    """h11's server side, showing each event to the protocol before uvicorn acts on it. A request the protocol
    refuses (or one h11 cannot parse) is answered by the protocol and never reaches uvicorn: uvicorn is told that
    more data is needed, and the protocol discards whatever follows."""

    def __init__(self, guard: LimitedH11Protocol, max_head_bytes: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_head_bytes)
        self._guard = guard

    def next_event(self) -> _Next:
        guard = self._guard
        if guard.refused:
            return h11.NEED_DATA
        if self.their_state is h11.IDLE and guard.head is None:
            # A new head starts at the first unprocessed byte: keep our own copy of it from here on.
            guard.head = bytearray(self.trailing_data[0])
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as exc:
            guard.malformed(exc)
            return h11.NEED_DATA
        return guard.seen(event)


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol under :class:`ServerLimits` (``limits``: set by :func:`protocol_class`)."""

    limits: ClassVar[ServerLimits] = ServerLimits()

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.conn = _GuardedConnection(self, self.limits.max_header_bytes)
        self._inner_app = self.app
        self.app = self._run_app
        self.refused = False  # answered by us: nothing more is parsed, the rest is discarded
        self.head: bytearray | None = None  # the bytes of the head being received (None: not receiving one)
        self._head_timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None
        # The body being received: its byte count, its active (not paused) seconds before ``_body_since``, the
        # start of the running active stretch (None: paused or no body), the last time bytes came or reading resumed.
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_bytes = 0
        self._body_active = 0.0
        self._body_since: float | None = None
        self._body_last = 0.0
        self._in_body = False

    # ------------------------------------------------------------------------------------------- transport
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = _WatchedFlow(transport, self._reading_changed)
        if len(self.connections) > self.limits.max_connections:
            self._refuse_busy("open connections")
            return
        self._head_timer = self.loop.call_later(self.limits.header_timeout, self._head_expired)

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return  # lingering: read and thrown away
        if self.head is not None:
            self.head += data
        super().data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._head_timer, self._body_timer, self._linger_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = self._linger_timer = None
        self._in_body = False
        super().connection_lost(exc)

    def shutdown(self) -> None:
        if self.refused:
            self.transport.close()
            return
        try:
            super().shutdown()
        except h11.LocalProtocolError:  # h11 cannot say goodbye in its state: just close
            self.transport.close()

    # ------------------------------------------------------------------------------------------------ events
    def seen(self, event: _Next) -> _Next:
        """``event`` as uvicorn should see it (``NEED_DATA`` in place of a request we refused)."""
        if event is h11.NEED_DATA:
            their = self.conn.their_state
            if their is h11.IDLE and self.head and self._head_timer is None:
                # The first bytes of a head on a reused connection: the keep-alive wait is over, the head's starts.
                self._unset_keepalive_if_required()
                self._head_timer = self.loop.call_later(self.limits.header_timeout, self._head_expired)
            elif their is h11.SEND_BODY and self._in_body:
                self._arm_body()
            return event
        if isinstance(event, h11.Request):
            return self._request(event)
        if isinstance(event, h11.Data) and self._in_body:
            self._body_bytes += len(event.data)
            self._body_last = self.loop.time()
        elif isinstance(event, h11.EndOfMessage):
            self._end_body()
        return event

    def _request(self, event: h11.Request) -> _Next:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        head, self.head = self.head or bytearray(), None
        limits = self.limits
        end = _BLANK_LINE.search(head)
        size = end.end() if end is not None else len(head)
        if size > limits.max_header_bytes:
            self._refuse_large(head)
            return h11.NEED_DATA
        if end is not None and _FOLDED_LINE.search(head, 0, end.start()):
            self._refuse(
                400,
                "obsolete_line_folding",
                "a header line of this request is folded onto the next (obs-fold, RFC 9112 5.2), which this proxy "
                "does not accept. Fix: send each header on one line",
            )
            return h11.NEED_DATA
        names = {name.lower() for name, _ in event.headers}
        if b"content-length" in names and b"transfer-encoding" in names:
            self._refuse(
                400,
                "ambiguous_message_length",
                "the request has both Content-Length and Transfer-Encoding, so its length is ambiguous "
                "(RFC 9112 6.3). Fix: send one of them",
            )
            return h11.NEED_DATA
        if len(self.tasks) >= limits.max_connections or len(self.connections) > limits.max_connections:
            self._refuse_busy("requests in flight")
            return h11.NEED_DATA
        if self.conn.their_state is h11.SEND_BODY:
            self._begin_body()
        return event

    def malformed(self, exc: h11.RemoteProtocolError) -> None:
        """Answer a request h11 could not parse (its head, or its body: then that request is under way)."""
        in_head = self.head is not None
        if exc.error_status_hint == 431 and in_head:
            self._refuse_large(self.head or bytearray())
            return
        # h11's reason without the bytes it quotes (they may hold a credential).
        reason = _ECHOED_BYTES.sub("", str(exc)).strip() or "malformed request"
        self._refuse(
            400,
            "invalid_http_request",
            f"the request {'head' if in_head else 'body'} is not valid HTTP/1.1 ({reason}). Fix: send one "
            "Content-Length or Transfer-Encoding: chunked, and headers as RFC 9112 writes them",
            during=None if in_head else self.cycle,
        )

    # -------------------------------------------------------------------------------------------------- head
    def _head_expired(self) -> None:
        self._head_timer = None
        if self.refused or self.conn.their_state is not h11.IDLE:
            return
        if not self.head:
            # Nothing was asked on this connection: close it without an answer.
            self.transport.close()
            return
        self._refuse(
            408,
            "request_timeout",
            f"the request head did not arrive within {self.limits.header_timeout:g} s. Fix: send the request line "
            "and headers at once (the server's header_timeout)",
        )

    # -------------------------------------------------------------------------------------------------- body
    def _begin_body(self) -> None:
        now = self.loop.time()
        self._in_body = True
        self._body_bytes = 0
        self._body_active = 0.0
        self._body_last = now
        if self.conn.they_are_waiting_for_100_continue:
            # The client sends its body only once the app asks for it (uvicorn then answers 100 Continue and
            # resumes reading): until then its silence is not its fault.
            self._body_since = None
            self.flow.pause_reading()
            return
        self._body_since = None if self.flow.read_paused else now

    def _end_body(self) -> None:
        self._in_body = False
        self._body_since = None
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _reading_changed(self, reading: bool) -> None:
        if not self._in_body or self.refused:
            return
        now = self.loop.time()
        if reading:
            self._body_since = now
            self._body_last = now
            self._arm_body()
        elif self._body_since is not None:
            self._body_active += now - self._body_since
            self._body_since = None
            if self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None

    def _body_deadline(self) -> float:
        """When the body being read is overdue (inf while reading is paused)."""
        if self._body_since is None:
            return math.inf
        limits = self.limits
        deadline = self._body_last + limits.body_timeout
        if limits.min_body_rate:
            # Active seconds allowed so far: the grace plus what the bytes received pay for at the minimum rate.
            allowed = limits.body_timeout + self._body_bytes / limits.min_body_rate
            deadline = min(deadline, self._body_since + allowed - self._body_active)
        return deadline

    def _arm_body(self) -> None:
        # One timer per body: it re-arms itself when bytes have moved the deadline on, so a chunk costs no timer.
        if self._body_timer is None and self._body_since is not None:
            self._body_timer = self.loop.call_at(self._body_deadline(), self._body_check)

    def _body_check(self) -> None:
        self._body_timer = None
        if not self._in_body or self.refused:
            return
        deadline = self._body_deadline()
        if deadline > self.loop.time():
            if deadline < math.inf:
                self._body_timer = self.loop.call_at(deadline, self._body_check)
            return
        limits = self.limits
        rate = f" or averaged under {limits.min_body_rate:,} bytes/s" if limits.min_body_rate else ""
        self._refuse(
            408,
            "request_timeout",
            f"the request body stalled: nothing arrived for {limits.body_timeout:g} s{rate} "
            f"({self._body_bytes:,} bytes received). Fix: send the body without pauses (the server's body_timeout "
            "and min_body_rate)",
            during=self.cycle,
        )

    # ---------------------------------------------------------------------------------------------- refusals
    def _refuse_large(self, head: bytearray) -> None:
        limit = self.limits.max_header_bytes
        line_end = head.find(b"\n")
        if line_end < 0 or line_end + 1 > limit:
            self._refuse(
                414,
                "uri_too_long",
                f"the request line is over {limit:,} bytes. Fix: send a shorter URL (the server's max_header_bytes)",
            )
            return
        self._refuse(
            431,
            "request_header_fields_too_large",
            f"the request head (request line and headers) is over {limit:,} bytes. Fix: send fewer or smaller "
            "headers (the server's max_header_bytes)",
        )

    def _refuse_busy(self, what: str) -> None:
        limit = self.limits.max_connections
        self._refuse(
            503,
            "server_busy",
            f"this proxy serves at most {limit:,} connections and requests at once, and all are taken ({what}). "
            "Fix: retry shortly, or raise the server's max_connections",
            retry_after="1",
        )

    def _refuse(
        self,
        status: int,
        code: str,
        message: str,
        *,
        retry_after: str | None = None,
        during: RequestResponseCycle | None = None,
    ) -> None:
        """Answer ``status`` now and close the connection, lingering. ``during``: the request under way, whose app
        is told the client left; if its answer has begun, no second one can follow, and the connection is just
        closed."""
        if self.refused:
            return
        self.refused = True
        self.head = None
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None
        self._in_body = False
        self._unset_keepalive_if_required()
        if during is not None and not during.response_complete:
            # The app may be waiting on this request's body: its receive() now answers http.disconnect, and
            # whatever it sends is dropped.
            during.disconnected = True
            during.message_event.set()
        if during is not None and during.response_started:
            log.info("closed the connection of %s (%s) after its answer had begun", self._peer(), code)
            self.transport.close()
            return
        kind = "invalid_request_error" if status < 500 else "server_error"
        body = error_body(message, type=kind, code=code)
        headers = [
            *self.server_state.default_headers,
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        if retry_after is not None:
            headers.append((b"retry-after", retry_after.encode()))
        lines = [b"HTTP/1.1 %d %s\r\n" % (status, http.HTTPStatus(status).phrase.encode())]
        lines += [name + b": " + value + b"\r\n" for name, value in headers]
        self.transport.write(b"".join([*lines, b"\r\n", body]))
        log.info("answered %d %s to %s and closed the connection", status, code, self._peer())
        self._linger()

    def _linger(self) -> None:
        self.flow.resume_reading()
        self.transport.resume_reading()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._linger_timer = self.loop.call_later(LINGER_SECONDS, self.transport.close)

    def _peer(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "a client"

    # ---------------------------------------------------------------------------------------------------- app
    async def _run_app(self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        try:
            await self._inner_app(scope, receive, send)
        except Exception:
            if not self.refused:
                raise
            # The app learnt of our refusal as a disconnect (Starlette raises ClientDisconnect): expected, quiet.
            log.debug("the app ended with an error after its connection was refused", exc_info=True)


def protocol_class(limits: ServerLimits) -> type[LimitedH11Protocol]:
    """A :class:`LimitedH11Protocol` class for ``uvicorn.Config(http=...)`` that applies ``limits``."""
    return type("LimitedH11Protocol", (LimitedH11Protocol,), {"limits": limits})
