"""Helpers for tests of ``contextkeeper serve``: an upstream that also records request headers, and a proxy run
in-process by uvicorn on a thread (loopback, ephemeral ports, bounded waits)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import contextkeeper as ck
from contextkeeper.proxy import ModelEntry, Proxy, ProxyServer, Route
from openai_server import ChatServer


class RecordingChatServer(ChatServer):
    """tests/openai_server.py's ChatServer, keeping each request's method, path and headers (lower-cased) too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[str, str, dict[str, str]]] = []

    def start(self) -> RecordingChatServer:
        super().start()
        httpd = self._httpd
        assert httpd is not None
        base: Any = httpd.RequestHandlerClass
        seen = self.seen

        class Recording(base):  # type: ignore[misc,valid-type]
            def _note(self) -> None:
                seen.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))

            def do_GET(self) -> None:
                self._note()
                super().do_GET()

            def do_POST(self) -> None:
                self._note()
                super().do_POST()

        # The server makes a handler per request from this attribute, so swapping it takes effect at once.
        httpd.RequestHandlerClass = Recording
        return self

    def chat_headers(self) -> list[dict[str, str]]:
        return [headers for method, path, headers in self.seen if path.endswith("/chat/completions")]


def route(keeper: ck.ContextKeeper, match: str = "*", name: str | None = None) -> Route:
    """A proxy route for a ready keeper (tests build keepers from an already loaded tokenizer)."""
    entry = ModelEntry(match=match, tokenizer=keeper.name or "tokenizer")
    return Route(name=name or f"models[0] (match {match!r})", entry=entry, keeper=keeper)


@contextlib.contextmanager
def running_proxy(routes: list[Route], upstream: str, **settings: Any) -> Iterator[ProxyServer]:
    """A started proxy for ``routes`` in front of ``upstream`` on 127.0.0.1 (an ephemeral port)."""
    settings.setdefault("backoff", 0.01)
    proxy = Proxy(routes, upstream=upstream, **settings)
    server = ProxyServer(proxy, port=0).start(timeout=20)
    try:
        yield server
    finally:
        server.close()
