"""``contextkeeper serve``'s HTTP server against slow and malformed clients (issue 34: items 11, 12's 431, 9's
Content-Length with Transfer-Encoding).

The proxy is real uvicorn run by ProxyServer on 127.0.0.1 (an ephemeral port) in front of tests/openai_server.py's
ChatServer, which records every request it gets. Hostile clients are raw sockets, so that the bytes on the wire are
exactly the attack (no client library tidies them up); honest clients use httpx2. Short limits keep each test to a
few seconds, and every wait is bounded.
"""

from __future__ import annotations

import contextlib
import json
import selectors
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx2")

import httpx2

import contextkeeper as ck
from assets import tokenizer_dir
from conftest import hf_tokenizer
from contextkeeper.proxy import Proxy, ProxyServer
from contextkeeper.proxy._protocol import LINGER_SECONDS
from contextkeeper.proxy.server import ServerLimits
from proxy_helpers import RecordingChatServer, percentile, route

CONTEXT = 1024
TIMEOUT = 1.0  # header, body and keep-alive timeouts of the tests' servers
MARGIN = 1.0  # how much later than its timeout a connection may end (a loaded 2-core machine)
LINGER = LINGER_SECONDS  # a refused connection reads and discards for at most this long
LIMITS = ServerLimits(
    header_timeout=TIMEOUT,
    body_timeout=TIMEOUT,
    min_body_rate=200,
    keep_alive_timeout=TIMEOUT,
    max_header_bytes=32 * 1024,
)
JSON = "Content-Type: application/json"
JSON_TYPE = {"content-type": "application/json"}
CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 8}).encode()


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return hf_tokenizer("qwen2")


@pytest.fixture
def upstream(tokenizer: Any) -> Iterator[RecordingChatServer]:
    with RecordingChatServer(tokenizer_dir("qwen2"), max_model_len=CONTEXT, tokenizer=tokenizer) as running:
        yield running


@contextlib.contextmanager
def serving(tokenizer: Any, upstream: RecordingChatServer, limits: ServerLimits = LIMITS) -> Iterator[ProxyServer]:
    keeper = ck.ContextKeeper(tokenizer, context_window=CONTEXT)
    proxy = Proxy([route(keeper)], upstream=upstream.base_url, backoff=0.01)
    server = ProxyServer(proxy, port=0, limits=limits).start(timeout=20)
    try:
        yield server
    finally:
        server.close()


# --------------------------------------------------------------------------------------------- raw HTTP


def head(method: str, path: str, *lines: str) -> bytes:
    return "\r\n".join([f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *lines, "", ""]).encode("latin-1")


def chat_request(*lines: str, body: bytes = CHAT) -> bytes:
    """A whole chat request with ``lines`` among its headers."""
    return head("POST", "/v1/chat/completions", JSON, f"Content-Length: {len(body)}", *lines) + body


@dataclass
class Answer:
    """An HTTP answer as read off a raw socket."""

    status: int
    headers: dict[str, str]
    body: bytes

    def error(self) -> dict[str, Any]:
        """Its body in OpenAI's error shape (an AssertionError if it is not)."""
        assert self.headers.get("content-type", "").startswith("application/json"), (self.headers, self.body[:200])
        error = json.loads(self.body)["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        return dict(error)


def parse(buffer: bytes) -> tuple[Answer, int] | None:
    """The first complete answer in ``buffer`` and how many bytes it took, or None while it is incomplete."""
    end = buffer.find(b"\r\n\r\n")
    if end < 0:
        return None
    status_line, *lines = buffer[:end].decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    if len(buffer) < end + 4 + length:
        return None
    return Answer(int(status_line.split()[1]), headers, buffer[end + 4 : end + 4 + length]), end + 4 + length


def read_until_closed(sock: socket.socket, within: float) -> tuple[bytes, str]:
    """Everything the server sends until it closes (``"eof"``), resets (``"reset"``) or ``within`` seconds pass
    (``"open"``)."""
    deadline = time.monotonic() + within
    got = bytearray()
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            data = sock.recv(65536)
        except TimeoutError:
            break
        except ConnectionResetError:
            return bytes(got), "reset"
        if not data:
            return bytes(got), "eof"
        got += data
    return bytes(got), "open"


def exchange(server: ProxyServer, raw: bytes, within: float = 5.0) -> tuple[Answer | None, str, float]:
    """Send ``raw`` on a new connection; the first answer (None: none), how the connection ended, and seconds to
    that end."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port or 0), timeout=within) as sock:
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):  # a server that resets: seen below
            sock.sendall(raw)
        got, end = read_until_closed(sock, within)
    parsed = parse(got)
    return (parsed[0] if parsed else None), end, time.monotonic() - started


def honest_chats(server: ProxyServer, count: int | None = None, seconds: float | None = None) -> list[float]:
    """Seconds per chat request of an honest client (sequential, keep-alive), ``count`` of them or for
    ``seconds``; every one must succeed."""
    latencies: list[float] = []
    deadline = time.monotonic() + (seconds or 60.0)
    with httpx2.Client(timeout=10) as client:
        for _ in range(count or 10_000):
            if time.monotonic() >= deadline:
                break
            started = time.monotonic()
            response = client.post(f"{server.url}/v1/chat/completions", content=CHAT, headers=JSON_TYPE)
            latencies.append(time.monotonic() - started)
            assert response.status_code == 200, response.text[:300]
    return latencies


def wait_for_connections(server: ProxyServer, count: int, within: float) -> int:
    deadline = time.monotonic() + within
    while server.connections != count and time.monotonic() < deadline:
        time.sleep(0.02)
    return server.connections


# ------------------------------------------------------------------------------------------ slow clients


@dataclass
class Slow:
    """One hostile connection: ``first`` is sent at once, then ``trickle`` one byte a second (from the start, or
    for the ``reuse`` kinds from their first answer)."""

    kind: str
    first: bytes = b""
    trickle: bytes = b""
    sock: socket.socket | None = None
    got: bytearray = field(default_factory=bytearray)
    sent: int = 0
    trickle_from: float | None = None  # when its first trickled byte went out
    answered_at: float | None = None  # when its first answer was complete
    ended_at: float | None = None
    end: str = "open"


def drive(slow: list[Slow], port: int, within: float) -> float:
    """Connect every ``slow`` client and play its part until the server has closed them all or ``within``
    seconds pass; returns the start time. A connection is done when the server closes or resets it."""
    selector = selectors.DefaultSelector()
    started = time.monotonic()
    for client in slow:
        client.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        client.sock.setblocking(False)
        if client.first:
            client.sock.sendall(client.first)  # small: fits the socket buffer
        if not client.kind.startswith("reuse"):
            client.trickle_from = started
        selector.register(client.sock, selectors.EVENT_READ, client)
    deadline = started + within
    try:
        while any(c.ended_at is None for c in slow) and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=0.05):
                client = key.data
                try:
                    data = client.sock.recv(65536)
                except BlockingIOError:
                    continue
                except ConnectionResetError:
                    data, client.end = b"", "reset"
                if not data:
                    client.ended_at = time.monotonic()
                    client.end = "eof" if client.end == "open" else client.end
                    selector.unregister(client.sock)
                    client.sock.close()
                    continue
                client.got += data
                if client.answered_at is None and parse(bytes(client.got)) is not None:
                    client.answered_at = time.monotonic()
                    if client.trickle:
                        client.trickle_from = client.answered_at
            now = time.monotonic()
            for client in slow:
                due = client.trickle_from is not None and now >= client.trickle_from + client.sent
                if client.ended_at is None and due and client.sent < len(client.trickle):
                    with contextlib.suppress(OSError):  # the server may have closed it just now
                        client.sock.sendall(client.trickle[client.sent : client.sent + 1])
                    client.sent += 1
    finally:
        for client in slow:
            if client.ended_at is None and client.sock is not None:
                selector.unregister(client.sock)
                client.sock.close()
        selector.close()
    return started


def slow_clients() -> list[Slow]:
    """44 slowloris connections in five kinds."""
    trickled_head = chat_request("X-Padding: " + "p" * 64)
    body_head = head("POST", "/v1/chat/completions", JSON, "Content-Length: 4000")
    return (
        [Slow("head", trickle=trickled_head) for _ in range(10)]
        + [Slow("body", first=body_head, trickle=b'{"model": "m", "messages": []' + b" " * 200) for _ in range(10)]
        + [Slow("silent") for _ in range(8)]
        + [Slow("reuse-idle", first=chat_request()) for _ in range(8)]
        + [Slow("reuse-head", first=chat_request(), trickle=trickled_head) for _ in range(8)]
    )


def test_slow_clients_are_cut_off_while_honest_ones_are_served(tokenizer: Any, upstream: RecordingChatServer) -> None:
    with serving(tokenizer, upstream) as server:
        honest_chats(server, count=5)  # warm: the first fit builds caches
        alone = honest_chats(server, seconds=3.0)
        slow = slow_clients()
        driver = threading.Thread(target=lambda: started.append(drive(slow, server.port or 0, within=6.0)))
        started: list[float] = []
        driver.start()
        beside = honest_chats(server, seconds=3.0)
        driver.join(timeout=30)
        assert started, "the slow clients' driver did not finish"
        begin = started[0]

        still_open = [c.kind for c in slow if c.ended_at is None]
        assert not still_open, f"{len(still_open)} slow connections still open after 6 s: {still_open}"
        assert all(c.end == "eof" for c in slow), [c.end for c in slow]  # closed, never reset
        for client in slow:
            assert client.ended_at is not None
            if client.kind == "reuse-idle":
                assert client.answered_at is not None, client.got[:200]
                waited = client.ended_at - client.answered_at  # the keep-alive timeout
            else:  # the header (or body) timeout, from the connection or the reused one's first new byte
                waited = client.ended_at - (client.trickle_from or begin)
            assert waited <= TIMEOUT + MARGIN, f"a {client.kind} connection held {waited:.2f} s"
            parsed = parse(bytes(client.got))
            if client.kind == "silent":
                assert not client.got  # nothing was asked: nothing is answered
            elif client.kind == "reuse-idle":
                assert parsed is not None
                assert parsed[0].status == 200
                assert parsed[1] == len(client.got)  # then closed without a word
            else:
                if client.kind == "reuse-head":
                    assert parsed is not None
                    assert parsed[0].status == 200
                    parsed = parse(bytes(client.got[parsed[1] :]))
                assert parsed is not None, (client.kind, bytes(client.got[:300]))
                answer = parsed[0]
                assert answer.status == 408, (client.kind, answer)
                assert answer.headers["connection"] == "close"
                assert answer.error()["code"] == "request_timeout"
        # The server lets go of them too (a refused connection lingers at most LINGER seconds).
        assert wait_for_connections(server, 0, LINGER + MARGIN) == 0

    assert len(upstream.requests) == 5 + len(alone) + len(beside) + 16  # + the reuse kinds' first requests
    p99_alone, p99_beside = percentile(alone, 0.99), percentile(beside, 0.99)
    print(
        f"\nhonest chat p50/p99 alone {percentile(alone, 0.5) * 1000:.1f}/{p99_alone * 1000:.1f} ms ({len(alone)}), "
        f"beside 44 slow clients {percentile(beside, 0.5) * 1000:.1f}/{p99_beside * 1000:.1f} ms ({len(beside)})"
    )
    assert len(beside) >= 10
    assert p99_beside <= 2 * p99_alone + 0.1


# ------------------------------------------------------------------------------------------ large heads


@pytest.mark.parametrize(
    ("case", "raw", "status"),
    [
        ("one 64 KB header", chat_request("X-Big: " + "a" * 64 * 1024), 431),
        ("one 1 MB header", chat_request("X-Big: " + "a" * 2**20), 431),
        ("200 headers of 400 bytes", chat_request(*(f"X-H{i}: {'b' * 400}" for i in range(200))), 431),
        ("a 40 KB header in one read", chat_request("Authorization: Bearer " + "s" * 40 * 1024), 431),
        ("a 100 KB URL", head("GET", "/v1/models?q=" + "u" * 100 * 1024), 414),
    ],
)
def test_oversized_heads_are_answered_not_reset(
    tokenizer: Any, upstream: RecordingChatServer, case: str, raw: bytes, status: int
) -> None:
    with serving(tokenizer, upstream) as server:
        answer, end, _ = exchange(server, raw)
        assert answer is not None, f"{case}: no HTTP answer, the connection ended with {end}"
        assert answer.status == status, (case, answer)
        assert end == "eof", case  # answered, then closed: never a reset
        error = answer.error()
        assert error["type"] == "invalid_request_error"
        assert f"{LIMITS.max_header_bytes:,} bytes" in error["message"]
        assert "max_header_bytes" in error["message"]  # the setting that allows more
        assert "s" * 100 not in error["message"]  # the header is not echoed back
        assert not upstream.seen, case
        # The server is fine afterwards.
        answer, _, _ = exchange(server, chat_request("Connection: close"))
        assert answer is not None
        assert answer.status == 200
        assert len(upstream.requests) == 1


# ------------------------------------------------------------------------------------- ambiguous framing


def chunked(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n0\r\n\r\n"


FRAMING = [
    ("Content-Length, then Transfer-Encoding", [f"Content-Length: {len(CHAT)}", "Transfer-Encoding: chunked"], True),
    ("Transfer-Encoding, then Content-Length", ["Transfer-Encoding: chunked", "Content-Length: 5"], True),
    ("mixed case, a short length", ["transfer-encoding: Chunked", "content-length: 3"], True),
    ("two Content-Length values", [f"Content-Length: {len(CHAT)}", f"Content-Length: {len(CHAT) + 5}"], False),
    ("a coding other than chunked", ["Transfer-Encoding: gzip"], False),
    ("chunked after another coding", ["Transfer-Encoding: gzip, chunked"], True),
    ("chunked twice", ["Transfer-Encoding: chunked", "Transfer-Encoding: chunked"], True),
    ("an obs-folded header", [f"Content-Length: {len(CHAT)}", "X-Note: first", " second"], False),
    ("an obs-folded Content-Type", [f"Content-Length: {len(CHAT)}", "Content-Type: application/json;", "\tq=1"], False),
]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/embeddings"])
@pytest.mark.parametrize(("case", "lines", "is_chunked"), FRAMING, ids=[case for case, _, _ in FRAMING])
def test_ambiguous_framing_is_refused_before_the_upstream(
    tokenizer: Any, upstream: RecordingChatServer, path: str, case: str, lines: list[str], is_chunked: bool
) -> None:
    raw = head("POST", path, JSON, *lines) + (chunked(CHAT) if is_chunked else CHAT)
    with serving(tokenizer, upstream) as server:
        answer, end, _ = exchange(server, raw)
        assert answer is not None, f"{case}: no HTTP answer ({end})"
        assert answer.status == 400, (case, answer)
        assert answer.headers["connection"] == "close"
        assert end == "eof"
        assert answer.error()["type"] == "invalid_request_error"
        assert not upstream.seen, f"{case} reached the upstream"
        # The same request framed one way goes through (the test upstream answers chat only: 404 elsewhere).
        framed = head("POST", path, JSON, f"Content-Length: {len(CHAT)}", "Connection: close") + CHAT
        answer, _, _ = exchange(server, framed)
        assert answer is not None
        assert answer.status == (200 if path == "/v1/chat/completions" else 404), answer
        assert [seen[1] for seen in upstream.seen] == [path]


@pytest.mark.parametrize(
    "second",
    [
        ["Transfer-Encoding: chunked"],  # with chat_request's Content-Length
        ["X-Note: first", " second"],
    ],
    ids=["Content-Length with Transfer-Encoding", "obs-fold"],
)
def test_a_bad_request_pipelined_behind_a_good_one_is_refused(
    tokenizer: Any, upstream: RecordingChatServer, second: list[str]
) -> None:
    # Three requests in one write: the second's head is checked from h11's leftover bytes, not a fresh read.
    raw = chat_request() + chat_request(*second) + chat_request()
    with serving(tokenizer, upstream) as server:
        with socket.create_connection(("127.0.0.1", server.port or 0), timeout=5) as sock:
            sock.sendall(raw)
            got, end = read_until_closed(sock, 5.0)
        answers = []
        while (parsed := parse(got)) is not None:
            answers.append(parsed[0])
            got = got[parsed[1] :]
        assert [answer.status for answer in answers] == [200, 400], answers
        assert answers[1].error()["type"] == "invalid_request_error"
        assert end == "eof"
        assert len(upstream.requests) == 1  # the first; the third is never read


# ------------------------------------------------------------------------------------------------- bodies


def test_a_stalled_body_gets_408_and_a_slow_one_is_served(tokenizer: Any, upstream: RecordingChatServer) -> None:
    with serving(tokenizer, upstream) as server:
        for path in ("/v1/chat/completions", "/v1/embeddings"):  # read whole, and streamed to the upstream
            started = time.monotonic()
            with socket.create_connection(("127.0.0.1", server.port or 0), timeout=5) as sock:
                sock.sendall(head("POST", path, JSON, f"Content-Length: {len(CHAT)}") + CHAT[:20])
                got, end = read_until_closed(sock, TIMEOUT + MARGIN + 2.0)
            waited = time.monotonic() - started
            parsed = parse(got)
            assert parsed is not None, f"{path}: no answer to a stalled body within {waited:.1f} s ({end})"
            assert parsed[0].status == 408, parsed[0]
            assert parsed[0].error()["code"] == "request_timeout"
            assert end == "eof"
            assert waited <= TIMEOUT + MARGIN
        assert not [seen for seen in upstream.seen if seen[1].endswith("/chat/completions")]

        # An honest client on a slow link: pauses shorter than body_timeout, a rate above min_body_rate.
        with socket.create_connection(("127.0.0.1", server.port or 0), timeout=5) as sock:
            sock.sendall(chat_request("Connection: close")[: -len(CHAT)])  # the head
            for start in range(0, len(CHAT), 25):
                time.sleep(0.3)
                sock.sendall(CHAT[start : start + 25])
            got, end = read_until_closed(sock, 10.0)
        parsed = parse(got)
        assert parsed is not None, end
        assert parsed[0].status == 200, parsed[0]
        assert len(upstream.requests) == 1


# ----------------------------------------------------------------------------------------- the connection limit


def test_connections_past_the_limit_get_503_at_once(tokenizer: Any, upstream: RecordingChatServer) -> None:
    limits = ServerLimits(header_timeout=10.0, max_connections=4)
    with serving(tokenizer, upstream, limits) as server:
        held = [socket.create_connection(("127.0.0.1", server.port or 0), timeout=5) for _ in range(4)]
        try:
            assert wait_for_connections(server, 4, 5.0) == 4
            answer, end, seconds = exchange(server, chat_request())
            assert answer is not None, f"no answer past the connection limit ({end} after {seconds:.1f} s)"
            assert answer.status == 503
            assert answer.headers["retry-after"] == "1"
            error = answer.error()
            assert error["code"] == "server_busy"
            assert "max_connections" in error["message"]
            assert end == "eof"
            assert seconds < 1.0
            # A client that connects and waits is told too, without having to ask.
            with socket.create_connection(("127.0.0.1", server.port or 0), timeout=5) as sock:
                got, end = read_until_closed(sock, 1.0)
            parsed = parse(got)
            assert parsed is not None, end
            assert parsed[0].status == 503
            assert not upstream.seen
        finally:
            for sock in held:
                sock.close()
        assert wait_for_connections(server, 0, LINGER + MARGIN) == 0
        answer, _, _ = exchange(server, chat_request("Connection: close"))
        assert answer is not None
        assert answer.status == 200

        # Stopping does not wait on connections that asked nothing, are part-way through a head, or were refused.
        held = [socket.create_connection(("127.0.0.1", server.port or 0), timeout=5) for _ in range(5)]
        try:
            held[0].sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            assert parse(read_until_closed(held[4], 1.0)[0]) is not None  # the fifth: refused, lingering
            started = time.monotonic()
            server.close()
            assert time.monotonic() - started < limits.graceful_shutdown
            assert all(read_until_closed(sock, 1.0)[1] == "eof" for sock in held[:4])
        finally:
            for sock in held:
                sock.close()


# ------------------------------------------------------------------------------------------------ settings


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("header_timeout", 0),
        ("body_timeout", -1.0),
        ("keep_alive_timeout", float("nan")),
        ("graceful_shutdown", "5"),
        ("min_body_rate", -1),
        ("min_body_rate", 1.5),
        ("max_header_bytes", 100),
        ("max_connections", 0),
        ("max_connections", True),
    ],
)
def test_limits_refuse_nonsense_naming_the_setting(setting: str, value: Any) -> None:
    with pytest.raises(ck.ConfigurationError, match=rf"server limit {setting} must be .*Fix: set {setting}"):
        ServerLimits(**{setting: value})
    assert ServerLimits().max_header_bytes == 32 * 1024  # the defaults are valid
