"""The proxy on uvicorn: in the foreground (``contextkeeper serve``) or on a background thread (tests, notebooks).

```python
with ProxyServer(Proxy.from_config(load_config("proxy.toml")), port=0, limits=ServerLimits(header_timeout=5)) as s:
    client = openai.OpenAI(base_url=s.base_url, api_key="...")
```

Connections are served by :class:`~contextkeeper.proxy._protocol.LimitedH11Protocol` (h11, pinned: the same
behaviour whether or not httptools is installed) under :class:`ServerLimits`: deadlines for a request's head and
body, a bounded head (431), unambiguous framing (400), a connection limit (503), each refusal in OpenAI's error
shape. WebSocket upgrades are off (the proxy has no WebSocket route, and an upgraded connection would leave these
limits behind).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn

from .._exceptions import ConfigurationError
from ._protocol import ServerLimits, protocol_class
from .access import loopback_host
from .app import Proxy

log = logging.getLogger("contextkeeper.proxy")

__all__ = ["ProxyServer", "ServerLimits"]


def _seconds(value: float) -> int:
    """``value`` for a uvicorn timeout: typed as whole seconds there, but only ever handed to asyncio, which takes
    fractions too (tests use short ones)."""
    return value  # type: ignore[return-value]


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, telling once it listens (and on which port, for port 0)."""

    def __init__(self, config: uvicorn.Config, on_ready: Callable[[str, int], None]) -> None:
        super().__init__(config)
        self._on_ready = on_ready

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn's own re-raises the signal once it has shut down; serving ends quietly here instead (a second
        # Ctrl-C still forces the exit).
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.servers:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self._on_ready(str(host), int(port))


class ProxyServer:
    """``proxy`` served by uvicorn on ``host:port`` (port 0: an ephemeral port, see :attr:`port`), each connection
    under ``limits`` (default: :class:`ServerLimits`'s defaults)."""

    def __init__(
        self,
        proxy: Proxy,
        *,
        host: str = "127.0.0.1",
        port: int = 8100,
        log_level: str = "warning",
        limits: ServerLimits | None = None,
    ) -> None:
        self.proxy = proxy
        self.limits = limits if limits is not None else ServerLimits()
        self.host = host
        self.requested_port = port
        self.port: int | None = None
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        config = uvicorn.Config(
            proxy.app,
            host=host,
            port=port,
            log_level=log_level,
            access_log=log_level in ("info", "debug", "trace"),
            lifespan="on",
            http=protocol_class(self.limits),
            ws="none",
            # uvicorn's own limit_concurrency stays off: the protocol counts connections itself (uvicorn's check
            # counts the asking connection against the limit) and answers 503 in OpenAI's error shape.
            timeout_keep_alive=_seconds(self.limits.keep_alive_timeout),
            h11_max_incomplete_event_size=self.limits.max_header_bytes,
            timeout_graceful_shutdown=_seconds(self.limits.graceful_shutdown),
        )
        self._server = _Uvicorn(config, self._listening)
        if not loopback_host(host):
            if not proxy.access.keyed:
                log.warning(
                    "the proxy listens on %s, beyond this machine, without a key of its own: anyone who reaches it can "
                    "use the upstream. Set a proxy key (Access(keys=...), api_key=), unless something in front "
                    "authenticates",
                    host,
                )
            if "*" not in proxy.access.allowed_hosts:
                log.warning(
                    "the proxy listens on %s but answers only requests whose Host is one of %s (allowed_hosts)",
                    host,
                    ", ".join(proxy.access.allowed_hosts),
                )
        self.on_ready: Callable[[ProxyServer], Any] | None = None

    def _listening(self, host: str, port: int) -> None:
        self.port = port
        self._ready.set()
        if self.on_ready is not None:
            self.on_ready(self)

    @property
    def connections(self) -> int:
        """How many client connections are open now (lingering refused ones included)."""
        return len(self._server.server_state.connections)

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("the proxy is not listening yet")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def base_url(self) -> str:
        """What clients pass as their OpenAI ``base_url``."""
        return self.url + "/v1"

    def _bind(self) -> socket.socket:
        """The listening socket, bound here so that a port in use is a clear error, not uvicorn's exit."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # IPPROTO_TCP, not 0: accepted sockets inherit it, and asyncio turns Nagle's algorithm off (TCP_NODELAY)
        # only on sockets that say TCP. With it on, an answer's body waits ~40 ms for the client's delayed ACK
        # of its headers.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.requested_port))
        except OSError as exc:
            sock.close()
            raise ConfigurationError(
                f"cannot listen on {self.host}:{self.requested_port}: {exc.strerror or exc}. Fix: pass --port another "
                "port (0: any free one), or --host an address of this machine"
            ) from None
        return sock

    def run(self) -> None:
        """Serve in this thread until interrupted (Ctrl-C, SIGTERM)."""
        sock = self._bind()
        try:
            self._server.run(sockets=[sock])
        finally:
            sock.close()
        if not self._server.started:
            raise ConfigurationError(f"the proxy could not start on {self.host}:{self.requested_port}; see the log")

    def start(self, timeout: float = 30.0) -> ProxyServer:
        """Serve on a background thread; returns once it listens (a RuntimeError after ``timeout`` seconds)."""
        if self._thread is not None:
            return self

        sock = self._bind()

        def serve() -> None:
            try:
                asyncio.run(self._server.serve(sockets=[sock]))
            except BaseException as exc:  # reported by start(), which waits for this thread
                self._failure = exc
            finally:
                sock.close()
                self._ready.set()

        self._thread = threading.Thread(target=serve, name="contextkeeper-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout) or self.port is None:
            self.close()
            raise RuntimeError(
                f"the proxy did not start listening on {self.host}:{self.requested_port} within {timeout:.0f} s"
                + (f": {self._failure}" if self._failure else "")
            )
        return self

    def close(self, timeout: float = 10.0) -> None:
        """Stop serving (in-flight requests get ``timeout`` seconds) and wait for the thread."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                self._server.force_exit = True
                self._thread.join(timeout)
            self._thread = None

    def __enter__(self) -> ProxyServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()
