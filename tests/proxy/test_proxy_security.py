"""``contextkeeper serve`` against hostile and careless clients (issue 34): bounded input, credentials never shown,
tenants kept apart, abandoned requests cancelled, typed 4xx for malformed input, browsers and rebinding refused,
errors labelled by who failed, and only allowlisted paths forwarded.

Every test drives the real proxy (uvicorn on 127.0.0.1) with raw HTTP clients or the official openai SDK, in front
of tests/openai_server.py's ChatServer, which counts prompts with the real Qwen2 tokenizer and records what reached
it. Each check is written from variants of a finding (other fields, sizes, orders), not only its reproduction.
"""

from __future__ import annotations

import base64
import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx2")

import httpx2
import openai

import contextkeeper as ck
from assets import require_assets, tokenizer_dir
from conftest import hf_tokenizer
from contextkeeper.proxy import Proxy, ProxyConfigError, ProxyServer, default_config
from contextkeeper.proxy.access import Access
from contextkeeper.proxy.limits import InputLimits
from proxy_helpers import RecordingChatServer, debug, load_history, route, running_proxy, scrape, tenant, total

CONTEXT = 1024
ANSWER = 32


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    require_assets()
    return hf_tokenizer("qwen2")


@pytest.fixture
def upstream(tokenizer: Any) -> Iterator[RecordingChatServer]:
    with RecordingChatServer(tokenizer_dir("qwen2"), max_model_len=CONTEXT, tokenizer=tokenizer) as running:
        yield running


@pytest.fixture
def keeper(tokenizer: Any) -> ck.ContextKeeper:
    return ck.ContextKeeper(tokenizer, context_window=CONTEXT)


SMALL = InputLimits(body_bytes=256 * 1024, messages=40, message_chars=20_000, tools_bytes=8 * 1024, depth=32)


@pytest.fixture
def proxy(keeper: ck.ContextKeeper, upstream: RecordingChatServer) -> Iterator[ProxyServer]:
    with running_proxy([route(keeper)], upstream.base_url, limits=SMALL) as server:
        yield server


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": load_history(2), "max_tokens": ANSWER, **extra}


def post(server: ProxyServer, body: Any, *, raw: bytes | None = None, **headers: str) -> httpx2.Response:
    """A chat request as bytes (``raw``) or JSON, with the client key and JSON content type unless overridden."""
    sent = {"authorization": "Bearer client-key", "content-type": "application/json", **headers}
    data = raw if raw is not None else json.dumps(body).encode()
    return httpx2.post(f"{server.base_url}/chat/completions", content=data, headers=sent, timeout=30)


def refused(response: httpx2.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert error["code"] == code, error
    return dict(error)


# -------------------------------------------------------------------------------------- 2: bounded input


def test_bodies_over_the_limit_are_refused_before_they_are_read(
    proxy: ProxyServer, upstream: RecordingChatServer
) -> None:
    big = chat(messages=[{"role": "user", "content": "x" * (300 * 1024)}])
    error = refused(post(proxy, big), 413, "body_too_large")
    assert "limits.body_bytes" in error["message"]
    # Without a Content-Length (chunked): refused while the body is still arriving, not after it ends.
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{proxy.port}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        sock.sendall(head.encode())
        piece = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"y" * 65536
        for _ in range(6):  # 384 KB: over the limit, and the body never ends
            sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            piece = b"y" * 65536
        answer = ""
        while "body_too_large" not in answer:
            got = sock.recv(65536).decode("latin-1")
            if not got:
                break
            answer += got
    assert answer.startswith("HTTP/1.1 413"), answer[:200]
    assert "body_too_large" in answer
    # A huge extra field is not forwarded either.
    refused(post(proxy, chat(extra_field="z" * (400 * 1024))), 413, "body_too_large")
    assert upstream.requests == []


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (chat(messages=[{"role": "user", "content": f"m{i}"} for i in range(41)]), "messages_exceeded"),
        (chat(messages=[{"role": "user", "content": "w " * 10_001}]), "message_chars_exceeded"),
        (
            chat(messages=[{"role": "user", "content": [{"type": "text", "text": "p" * 15_000}] * 2}]),
            "message_chars_exceeded",
        ),
        (
            chat(
                messages=[
                    {"role": "user", "content": "go"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "a" * 25_000}}
                        ],
                    },
                ]
            ),
            "message_chars_exceeded",
        ),
        (
            chat(
                tools=[
                    {"type": "function", "function": {"name": f"tool_{i}", "description": "d" * 300}} for i in range(40)
                ]
            ),
            "tools_bytes_exceeded",
        ),
    ],
    ids=["messages", "chars", "parts", "tool-arguments", "tools"],
)
def test_shapes_over_the_limits_are_413s(
    proxy: ProxyServer, upstream: RecordingChatServer, keeper: ck.ContextKeeper, body: dict[str, Any], code: str
) -> None:
    error = refused(post(proxy, body), 413, code)
    assert "Fix:" in error["message"]
    assert upstream.requests == []
    assert keeper.sessions() == []  # nothing of a refused request is kept
    assert len(keeper.transcript) == 0


def test_refused_requests_leave_nothing_behind(proxy: ProxyServer, keeper: ck.ContextKeeper) -> None:
    for size in (300 * 1024, 500 * 1024):
        refused(post(proxy, chat(messages=[{"role": "user", "content": "q" * size}])), 413, "body_too_large")
    refused(post(proxy, None, raw=b'{"messages": ' + b"[" * 3000 + b"]" * 3000 + b"}"), 400, "nested_too_deep")
    assert keeper.sessions() == []
    assert len(keeper.transcript) == 0
    # Within the input limits but over the context: the keeper refuses it, and records the refusal, not the payload.
    for words in (2_000, 3_000):
        huge = [{"role": "system", "content": "rule " * words}, {"role": "user", "content": "hi"}]
        refused(post(proxy, chat(messages=huge), **{"x-conversation-id": "big"}), 400, "request_too_large")
    entries = keeper.transcript.entries()
    assert [entry.status for entry in entries] == ["refused", "refused"]
    assert all(entry.inputs == () and entry.report["refused"]["messages"] == 2 for entry in entries)
    assert keeper.transcript.history(f"{tenant()}/big") == []


# ------------------------------------------------------------------------------------ 3: credentials


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize("password", ["hunter2", "p@ss:w/rd%", "s3cr3t-only-user"])
def test_upstream_url_credentials_are_sent_but_never_shown(
    keeper: ck.ContextKeeper, upstream: RecordingChatServer, password: str, caplog: pytest.LogCaptureFixture
) -> None:
    from urllib.parse import quote

    caplog.set_level("DEBUG")
    user = "" if password.endswith("only-user") else "svc"
    secret = quote(password, safe="")
    userinfo = f"{user}:{secret}" if user else secret
    url = upstream.base_url.replace("http://", f"http://{userinfo}@")
    with running_proxy([route(keeper)], url) as proxy:
        answer = post(proxy, chat(), authorization="")
        assert answer.status_code == 200
        expected = (f"{user}:{password}" if user else f"{password}:").encode()
        assert upstream.chat_headers()[-1]["authorization"] == "Basic " + base64.b64encode(expected).decode()
        assert password not in proxy.proxy.upstream
        assert secret not in proxy.proxy.upstream
        shown = debug(proxy.url, answer.headers["x-contextkeeper-conversation"], key=None).text
        assert "report" in shown
        for text in (shown, repr(proxy.proxy.access), caplog.text):
            assert password not in text
            assert secret not in text
    # The same URL with nothing listening: the 502 names the server without its password.
    dead = f"http://{userinfo}@127.0.0.1:{_closed_port()}/v1"
    with running_proxy([route(keeper)], dead, attempts=1) as proxy:
        for response in (post(proxy, chat()), httpx2.get(f"{proxy.base_url}/models", timeout=10)):
            assert response.status_code == 502
            assert password not in response.text
            assert secret not in response.text
        assert "127.0.0.1" in response.text  # a forwarded request's 502 names the server it could not reach


def test_one_upstream_credential_only(keeper: ck.ContextKeeper) -> None:
    with pytest.raises(ck.ConfigurationError, match="one of two credentials"):
        Proxy([route(keeper)], upstream="http://u:p@127.0.0.1:9/v1", upstream_api_key="k")


def test_serve_prints_the_upstream_without_its_password(upstream: RecordingChatServer, tmp_path: Path) -> None:
    url = upstream.base_url.replace("http://", "http://svc:TopSecret99@")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "contextkeeper",
            "serve",
            "--upstream",
            url,
            "--tokenizer",
            str(tokenizer_dir("qwen2")),
            "--context-window",
            str(CONTEXT),
            "--port",
            "0",
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert "listening" in line
        assert "TopSecret99" not in line
        assert "127.0.0.1" in json.loads(line)["upstream"]
    finally:
        process.terminate()
        out, err = process.communicate(timeout=30)
    assert "TopSecret99" not in out + err


def test_a_wrapped_client_with_userinfo_is_reported_without_it(upstream: RecordingChatServer, tokenizer: Any) -> None:
    keeper = ck.ContextKeeper(tokenizer, context_window=CONTEXT)
    url = upstream.base_url.replace("http://", "http://svc:Wrapped77@")
    client = keeper.wrap(openai.OpenAI(base_url=url, api_key="k", max_retries=0, timeout=20))
    client.chat.completions.create(model="m", messages=load_history(1), max_tokens=ANSWER)
    assert keeper.last_call is not None
    assert "Wrapped77" not in keeper.last_call.server
    assert "Wrapped77" not in json.dumps(keeper.last_call.to_dict())


# ------------------------------------------------------------------------------------------ 6: tenants


def test_tenants_never_share_or_see_each_others_conversations(
    proxy: ProxyServer, keeper: ck.ContextKeeper, upstream: RecordingChatServer
) -> None:
    alice, bob = "alice-key", "bob-key"
    for key, words in ((alice, "alpha"), (bob, "bravo")):
        messages = [{"role": "user", "content": f"{words} secret plans"}]
        answer = post(proxy, chat(messages=messages, user="ceo@example.com"), authorization=f"Bearer {key}")
        assert answer.status_code == 200
        assert answer.headers["x-contextkeeper-conversation"] == "ceo@example.com"
        answer = post(proxy, chat(messages=messages), authorization=f"Bearer {key}", **{"x-conversation-id": "same"})
        assert answer.status_code == 200
    # One conversation each, per id: a second tenant writing under "same" wrote its own.
    assert {f"{tenant(alice)}/same", f"{tenant(bob)}/same", f"{tenant(alice)}/ceo@example.com"} <= set(
        keeper.sessions()
    )
    history = keeper.transcript.history(f"{tenant(alice)}/same")
    assert "alpha" in json.dumps(history)
    assert "bravo" not in json.dumps(history)
    # The debug views: each tenant lists and reads its own; the other's ids are unknown to it.
    assert sorted(debug(proxy.url, key=alice).json()["conversations"]) == ["ceo@example.com", "same"]
    assert debug(proxy.url, "same", key=bob).json()["tenant"] == tenant(bob)
    assert "alpha" not in debug(proxy.url, "same", key=bob).text
    assert debug(proxy.url, key=None).json()["conversations"] == []  # keyless callers are one tenant, its own
    refused(debug(proxy.url, "same", key="mallory-key"), 404, "unknown_conversation")
    # Derived ids include the tenant: two tenants whose chats open alike do not share one.
    opening = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    derived = {
        key: post(proxy, chat(messages=opening), authorization=f"Bearer {key}").headers["x-contextkeeper-conversation"]
        for key in (alice, bob)
    }
    assert derived[alice] != derived[bob]


def test_named_keys_admin_key_and_tenant_header(keeper: ck.ContextKeeper, upstream: RecordingChatServer) -> None:
    access = Access(keys={"team-a": "ka", "team-b": "kb"}, admin_key="root", allowed_hosts=("127.0.0.1",))
    with running_proxy([route(keeper)], upstream.base_url, access=access, upstream_api_key="up") as proxy:
        refused(post(proxy, chat(), authorization="Bearer nope"), 401, "invalid_api_key")
        for key in ("ka", "kb"):
            assert post(proxy, chat(), authorization=f"Bearer {key}", **{"x-conversation-id": "c"}).status_code == 200
        assert {"team-a/c", "team-b/c"} <= set(keeper.sessions())
        assert all(headers["authorization"] == "Bearer up" for headers in upstream.chat_headers())
        assert debug(proxy.url, key="ka").json()["conversations"] == ["c"]
        everything = debug(proxy.url, key="root").json()["conversations"]
        assert sorted(everything) == ["team-a/c", "team-b/c"]
        assert debug(proxy.url, "team-b/c", key="root").json()["tenant"] == "team-b"
        refused(debug(proxy.url, "team-b/c", key="ka"), 404, "unknown_conversation")
    gateway = Access(keys={"gw": "gateway-key"}, tenant_header="x-tenant", allowed_hosts=("127.0.0.1",))
    with running_proxy([route(keeper)], upstream.base_url, access=gateway) as proxy:
        for who in ("u1", "u2"):
            headers = {"authorization": "Bearer gateway-key", "x-tenant": who, "x-conversation-id": "c"}
            assert post(proxy, chat(), **headers).status_code == 200
        assert {"u1/c", "u2/c"} <= set(keeper.sessions())
        bad = post(proxy, chat(), authorization="Bearer gateway-key", **{"x-tenant": "a/b"})
        refused(bad, 400, "invalid_tenant")


@pytest.mark.parametrize(("metrics", "debug_scope"), [("admin", "admin"), ("off", "off"), ("any", "tenant")])
def test_metrics_and_debug_access(
    keeper: ck.ContextKeeper, upstream: RecordingChatServer, metrics: str, debug_scope: str
) -> None:
    access = Access(
        keys={"t": "tk"},
        admin_key="root",
        allowed_hosts=("127.0.0.1",),
        metrics=metrics,  # type: ignore[arg-type]
        debug=debug_scope,  # type: ignore[arg-type]
    )
    with running_proxy([route(keeper)], upstream.base_url, access=access) as proxy:
        assert post(proxy, chat(), authorization="Bearer tk").status_code == 200

        def get(path: str, key: str | None) -> int:
            headers = {"authorization": f"Bearer {key}"} if key else {}
            return httpx2.get(f"{proxy.url}{path}", headers=headers, timeout=10).status_code

        tenant_metrics = {"admin": 403, "off": 403, "any": 200}[metrics]
        assert get("/metrics", "tk") == tenant_metrics
        assert get("/metrics", None) == 401
        assert get("/metrics", "root") == (403 if metrics == "off" else 200)
        tenant_debug = {"admin": 403, "off": 403, "tenant": 200}[debug_scope]
        assert get("/contextkeeper/conversations", "tk") == tenant_debug
        assert get("/contextkeeper/conversations", "root") == (403 if debug_scope == "off" else 200)


def test_loopback_scrapes_metrics_without_the_key(keeper: ck.ContextKeeper, upstream: RecordingChatServer) -> None:
    access = Access(keys={"t": "tk"}, allowed_hosts=("127.0.0.1",))  # metrics="loopback", the default
    with running_proxy([route(keeper)], upstream.base_url, access=access) as proxy:
        assert httpx2.get(f"{proxy.url}/metrics", timeout=10).status_code == 200
        assert httpx2.get(f"{proxy.url}/contextkeeper/conversations", timeout=10).status_code == 401


# ------------------------------------------------------------------------------------- 7: cancellation


def test_abandoned_plain_requests_are_cancelled_and_free_their_room(tokenizer: Any) -> None:
    keeper = ck.ContextKeeper(tokenizer, context_window=CONTEXT, kv_capacity=CONTEXT + 64, admission_timeout=60)
    with (
        RecordingChatServer(
            tokenizer_dir("qwen2"), max_model_len=CONTEXT, tokenizer=tokenizer, response_delay=2.5
        ) as upstream,
        running_proxy([route(keeper)], upstream.base_url) as proxy,
    ):
        # A patient client holds most of the KV room for 2.5 s; impatient ones queue behind it and give up.
        patient = threading.Thread(target=post_with_timeout, args=(proxy, chat(max_tokens=900), 30.0))
        patient.start()
        deadline = time.monotonic() + 5
        while not keeper.ledger.active and time.monotonic() < deadline:
            time.sleep(0.01)
        assert keeper.ledger.active > 0
        answered: list[int] = []

        def give_up(number: int) -> None:
            body = chat(max_tokens=300 + number, messages=[{"role": "user", "content": f"question {number}"}])
            try:
                answered.append(post_with_timeout(proxy, body, 0.8).status_code)
            except httpx2.TimeoutException:
                return

        threads = [threading.Thread(target=give_up, args=(n,)) for n in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        patient.join(30)
        assert answered == []
        time.sleep(0.5)  # room the patient gave back would have admitted any request still queued
        assert len(upstream.requests) == 1  # the patient's: no abandoned request ever went upstream
        assert keeper.ledger.active == 0
        assert keeper.ledger.stats()["queued"] == 0
        statuses = [
            exchange.status
            for exchange in (proxy.proxy.debug.get(tenant(), key.partition("/")[2]) for key in keeper.sessions())
            if exchange is not None and exchange.model is not None
        ]
        assert sorted(statuses) == [200] + [499] * 8

        # Admitted and upstream when its client leaves: the room comes back at once, not when the upstream answers.
        left = threading.Thread(target=lambda: _swallow(post_with_timeout, proxy, chat(max_tokens=500), 0.5))
        left.start()
        left.join(10)
        deadline = time.monotonic() + 1.0
        while keeper.ledger.active and time.monotonic() < deadline:
            time.sleep(0.01)
        assert keeper.ledger.active == 0  # well before the upstream's 2.5 s


def _swallow(function: Any, *args: Any) -> None:
    with contextlib.suppress(httpx2.TimeoutException):
        function(*args)


def post_with_timeout(server: ProxyServer, body: dict[str, Any], seconds: float) -> httpx2.Response:
    headers = {"authorization": "Bearer client-key", "content-type": "application/json"}
    return httpx2.post(f"{server.base_url}/chat/completions", json=body, headers=headers, timeout=seconds)


# ---------------------------------------------------------------------------------- 9: typed 4xx


@pytest.mark.parametrize("levels", [200, 1_000, 50_000])
@pytest.mark.parametrize("where", ["messages", "extra"])
def test_deep_nesting_is_a_400(proxy: ProxyServer, upstream: RecordingChatServer, levels: int, where: str) -> None:
    nested = "[" * levels + "]" * levels
    if where == "messages":
        raw = b'{"model": "m", "messages": [{"role": "user", "content": ' + nested.encode() + b"}]}"
    else:
        raw = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "x": ' + nested.encode() + b"}"
    refused(post(proxy, None, raw=raw), 400, "nested_too_deep")
    assert upstream.requests == []


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "m", "user": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}',
        b'{"model": "\\udfff", "messages": [{"role": "user", "content": "hi"}]}',
        b'{"model": "m", "metadata": {"k": "a\\udc00b"}, "messages": [{"role": "user", "content": "hi"}]}',
        b'{"model": "m", "messages": [{"role": "system", "content": "s\\ud83d"}, {"role": "user", "content": "hi"}]}',
        b'{"model": "m", "prompt_cache_key": "\\ud801", "messages": [{"role": "user", "content": "hi"}]}',
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "\\ud800key": 1}',
    ],
    ids=["user", "model", "extra", "opening", "prompt-cache-key", "a-key"],
)
def test_lone_surrogates_are_400s(proxy: ProxyServer, upstream: RecordingChatServer, raw: bytes) -> None:
    refused(post(proxy, None, raw=raw), 400, "invalid_unicode")
    assert upstream.requests == []
    assert debug(proxy.url, key=None).status_code == 200  # the listing still answers


def test_escaped_pairs_outside_the_bmp_are_fine(proxy: ProxyServer) -> None:
    raw = b'{"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "smile \\ud83d\\ude00"}]}'
    assert post(proxy, None, raw=raw).status_code == 200


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("field", ["temperature", "top_p", "frequency_penalty"])
def test_non_finite_numbers_are_400s(
    proxy: ProxyServer, upstream: RecordingChatServer, constant: str, field: str
) -> None:
    raw = f'{{"model": "m", "{field}": {constant}, "messages": [{{"role": "user", "content": "hi"}}]}}'.encode()
    refused(post(proxy, None, raw=raw), 400, "invalid_json")
    assert upstream.requests == []


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stream", "false"),
        ("stream", "true"),
        ("stream", 1),
        ("stream", 0),
        ("n", 0),
        ("n", "2"),
        ("n", 1.5),
        ("n", 100_000),
        ("best_of", -1),
        ("max_tokens", True),
        ("stream_options", "yes"),
        ("logprobs", "true"),
    ],
)
def test_fields_of_the_wrong_type_are_400s(
    proxy: ProxyServer, upstream: RecordingChatServer, field: str, value: Any
) -> None:
    error = refused(post(proxy, chat(**{field: value})), 400, f"invalid_{field}")
    assert error["param"] == field
    assert upstream.requests == []


def test_malformed_forwarded_paths_are_4xx(proxy: ProxyServer, upstream: RecordingChatServer) -> None:
    base = proxy.url
    with httpx2.Client(timeout=10) as client:
        refused(client.get(f"{base}/v1/models%00"), 400, "invalid_path")
        refused(client.get(f"{base}/v1/mod%01els"), 400, "invalid_path")
        refused(client.get(f"{base}/v1/models/" + "a" * 10_000), 414, "path_too_long")
        refused(client.get(f"{base}/v1/models?q=" + "b" * 9_000), 414, "path_too_long")
    # Dot segments as a raw client sends them (httpx resolves them before sending).
    for path in ("/v1/models/../../slots", "/v1/models/%2e%2e/%2e%2e/slots", "/v1/models/./x", "/v1//models"):
        assert raw_get(proxy.port, path).startswith("HTTP/1.1 400"), path
    # 100 KB of path: past the server's bound on a request head.
    assert raw_get(proxy.port, "/v1/models/" + "a" * 100_000).split(" ", 2)[1] in ("400", "414", "431")
    assert [path for _, path, _ in upstream.seen] == []


def raw_get(port: int, path: str) -> str:
    """The head of the answer to ``GET path`` sent byte for byte."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
        return sock.recv(4096).decode("latin-1")


def test_not_json_and_not_a_chat_are_400s(proxy: ProxyServer) -> None:
    refused(post(proxy, None, raw=b""), 400, "invalid_json")
    refused(post(proxy, None, raw=b"\xff\xfe{"), 400, "invalid_json")
    refused(post(proxy, None, raw=b"[1, 2]"), 400, "invalid_json")
    refused(post(proxy, {"model": "m", "messages": "hi"}), 400, "invalid_messages")
    refused(post(proxy, chat(model=5)), 400, "invalid_model")


# --------------------------------------------------------------------------- 10: browsers and rebinding


def test_dns_rebinding_hosts_are_refused(proxy: ProxyServer, upstream: RecordingChatServer) -> None:
    port = proxy.port
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.nip.io", "attacker.localhost.example"):
        for path in ("/metrics", "/contextkeeper/conversations", "/v1/models"):
            response = httpx2.get(f"{proxy.url}{path}", headers={"host": host}, timeout=10)
            refused(response, 421, "host_not_allowed")
        refused(post(proxy, chat(), host=host), 421, "host_not_allowed")
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}"):
        assert httpx2.get(f"{proxy.url}/v1/models", headers={"host": host}, timeout=10).status_code == 200
    assert [path for _, path, _ in upstream.seen] == ["/v1/models"] * 4
    assert upstream.requests == []


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None]
)
def test_browser_simple_requests_are_refused(
    proxy: ProxyServer, upstream: RecordingChatServer, content_type: str | None
) -> None:
    headers = {"origin": "https://evil.example"}
    if content_type:
        headers["content-type"] = content_type
    refused(post(proxy, chat(), **headers), 403, "origin_not_allowed")
    # The same bodies without an Origin (not a browser) but not sent as JSON: 415.
    plain = {"content-type": content_type or ""}
    refused(post(proxy, chat(), **plain), 415, "unsupported_media_type")
    assert upstream.requests == []
    refused(httpx2.get(f"{proxy.url}/metrics", headers=headers, timeout=10), 403, "origin_not_allowed")


def test_allowed_origins_get_cors(keeper: ck.ContextKeeper, upstream: RecordingChatServer) -> None:
    access = Access(allowed_hosts=("127.0.0.1",), cors_origins=("https://app.example",))
    with running_proxy([route(keeper)], upstream.base_url, access=access) as proxy:
        preflight = httpx2.options(
            f"{proxy.base_url}/chat/completions",
            headers={
                "origin": "https://app.example",
                "access-control-request-method": "POST",
                "access-control-request-headers": "authorization, content-type",
            },
            timeout=10,
        )
        assert preflight.status_code == 204
        assert preflight.headers["access-control-allow-origin"] == "https://app.example"
        answer = post(proxy, chat(), origin="https://app.example")
        assert answer.status_code == 200
        assert answer.headers["access-control-allow-origin"] == "https://app.example"
        assert "x-contextkeeper-prompt-tokens" in answer.headers["access-control-expose-headers"]
        refused(post(proxy, chat(), origin="https://other.example"), 403, "origin_not_allowed")


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.20"])
def test_listening_beyond_loopback_needs_a_key(tokenizer: Any, upstream: RecordingChatServer, host: str) -> None:
    config = default_config(tokenizer=str(tokenizer_dir("qwen2")), context_window=CONTEXT, upstream=upstream.base_url)
    with pytest.raises(ProxyConfigError, match="without a key"):
        Proxy.from_config(config, host=host)
    keyed = default_config(
        tokenizer=str(tokenizer_dir("qwen2")), context_window=CONTEXT, upstream=upstream.base_url, api_key="k"
    )
    assert Proxy.from_config(keyed, host=host).access.allowed_hosts == ("*",)
    opened = default_config(
        tokenizer=str(tokenizer_dir("qwen2")),
        context_window=CONTEXT,
        upstream=upstream.base_url,
        allow_unauthenticated=True,
    )
    assert Proxy.from_config(opened, host=host).access.keyed is False
    assert Proxy.from_config(config, host="127.0.0.1").access.allowed_hosts == ("localhost", "127.0.0.1", "::1")


def test_cli_refuses_to_listen_beyond_loopback_without_a_key(upstream: RecordingChatServer) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "contextkeeper",
            "serve",
            "--upstream",
            upstream.base_url,
            "--tokenizer",
            str(tokenizer_dir("qwen2")),
            "--context-window",
            str(CONTEXT),
            "--host",
            "0.0.0.0",
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "without a key" in done.stderr


# ------------------------------------------------------------------------------------- 12: error labels


def test_an_upstream_429_keeps_its_retry_after(keeper: ck.ContextKeeper, upstream: RecordingChatServer) -> None:
    with running_proxy([route(keeper)], upstream.base_url, attempts=2, max_backoff=0.05) as proxy:
        upstream.fail_next("429", times=2, retry_after="7")
        response = post(proxy, chat())
        assert response.status_code == 429
        assert response.headers["retry-after"] == "7"
        assert len(upstream.requests) == 2


def test_ledger_outage_is_our_503(tokenizer: Any, upstream: RecordingChatServer) -> None:
    from engines import RedisServer

    with RedisServer() as redis:
        keeper = ck.ContextKeeper(
            tokenizer, context_window=CONTEXT, ledger=redis.url, ledger_pool="security", kv_capacity=8 * CONTEXT
        )
        with running_proxy([route(keeper)], upstream.base_url, attempts=1) as proxy:
            assert post(proxy, chat()).status_code == 200
            redis.stop()
            response = post(proxy, chat())
            error = refused(response, 503, "ledger_unavailable")
            assert response.headers["retry-after"]
            assert "upstream" not in error["code"]
        keeper.close()


def test_transcript_outage_is_our_503(tokenizer: Any, upstream: RecordingChatServer) -> None:
    from engines import PostgresServer

    with PostgresServer() as postgres:
        keeper = ck.ContextKeeper(tokenizer, context_window=CONTEXT, transcript=postgres.url)
        with running_proxy([route(keeper)], upstream.base_url, attempts=1) as proxy:
            assert post(proxy, chat()).status_code == 200
            postgres.stop()
            response = post(proxy, chat(messages=load_history(3)))
            refused(response, 503, "transcript_unavailable")
        keeper.close()


# ---------------------------------------------------------------------------------- 13: forwarding


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/slots"),
        ("POST", "/slots/0?action=erase"),
        ("POST", "/reset_prefix_cache"),
        ("POST", "/sleep"),
        ("POST", "/wake_up"),
        ("POST", "/v1/load_lora_adapter"),
        ("POST", "/v1/unload_lora_adapter"),
        ("POST", "/props"),
        ("POST", "/api/pull"),
        ("POST", "/api/delete"),
        ("GET", "/admin"),
    ],
)
def test_admin_paths_are_not_forwarded(
    proxy: ProxyServer, upstream: RecordingChatServer, method: str, path: str
) -> None:
    response = httpx2.request(method, f"{proxy.url}{path}", headers={"authorization": "Bearer k"}, timeout=10)
    error = refused(response, 404, "route_not_forwarded")
    assert "forward = [" in error["message"]
    assert upstream.seen == []


def test_configured_paths_are_forwarded(keeper: ck.ContextKeeper, upstream: RecordingChatServer) -> None:
    with running_proxy([route(keeper)], upstream.base_url, forward=["GET /slots", "POST /reset_prefix_cache"]) as proxy:
        httpx2.get(f"{proxy.url}/slots", timeout=10)
        httpx2.post(f"{proxy.url}/reset_prefix_cache", timeout=10)
        refused(httpx2.post(f"{proxy.url}/sleep", timeout=10), 404, "route_not_forwarded")
    assert [(method, path) for method, path, _ in upstream.seen] == [("GET", "/slots"), ("POST", "/reset_prefix_cache")]
    with running_proxy([route(keeper)], upstream.base_url, forward=["*"]) as proxy:
        httpx2.post(f"{proxy.url}/sleep", timeout=10)
    assert upstream.seen[-1][:2] == ("POST", "/sleep")


# ------------------------------------------------------------------------------------------ also seen


def test_headers_the_client_names_hop_by_hop_stay_on_the_chat_path(
    proxy: ProxyServer, upstream: RecordingChatServer
) -> None:
    answer = post(proxy, chat(), connection="keep-alive, x-private", **{"x-private": "1", "x-kept": "2"})
    assert answer.status_code == 200
    headers = upstream.chat_headers()[-1]
    assert "x-private" not in headers
    assert headers["x-kept"] == "2"


def test_passed_through_answers_have_one_date_and_server(proxy: ProxyServer) -> None:
    response = httpx2.get(f"{proxy.url}/v1/models", timeout=10)
    names = [name.lower() for name, _ in response.headers.multi_items()]
    assert names.count("date") == 1
    assert names.count("server") <= 1


def test_unfitted_routes_say_so(proxy: ProxyServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("WARNING", logger="contextkeeper.proxy")
    for path in ("/v1/responses", "/v1/messages", "/api/chat"):
        response = httpx2.post(f"{proxy.url}{path}", json={"model": "m", "input": "hi"}, timeout=10)
        assert response.headers["x-contextkeeper-fitted"].startswith("no")
    assert "/v1/responses is forwarded unfitted" in caplog.text


def test_local_refusals_are_not_upstream_attempts(proxy: ProxyServer, upstream: RecordingChatServer) -> None:
    huge = [{"role": "system", "content": "rule " * 2000}, {"role": "user", "content": "hi"}]
    refused(post(proxy, chat(messages=huge)), 400, "request_too_large")
    assert post(proxy, chat()).status_code == 200
    samples = scrape(proxy.url)
    assert total(samples, "contextkeeper_upstream_attempts_total") == len(upstream.requests) == 1


# ------------------------------------------------------------------------------------------------ config


def test_the_config_file_sets_every_guard(tmp_path: Path, upstream: RecordingChatServer) -> None:
    from contextkeeper.proxy import load_config

    config = tmp_path / "proxy.toml"
    config.write_text(
        f"""
admin_key = "root-secret-42"
forward = ["GET /slots"]
cors_origins = ["https://app.example"]
metrics = "admin"
debug = "admin"
tenant_header = "X-Tenant"

[api_keys]
team-a = "ka-secret-17"

[limits]
body_bytes = 1000
answers = 4

[connections]
header_timeout = 2.5
max_connections = 10

[[models]]
match = "*"
tokenizer = "{tokenizer_dir("qwen2")}"
context_window = {CONTEXT}
""",
        encoding="utf-8",
    )
    loaded = load_config(config, upstream=upstream.base_url)
    proxy = Proxy.from_config(loaded)
    assert proxy.limits == InputLimits(body_bytes=1000, answers=4)
    assert loaded.server_limits().header_timeout == 2.5
    assert loaded.server_limits().max_connections == 10
    assert proxy.access.keys == {"team-a": "ka-secret-17"}
    assert proxy.access.admin_key == "root-secret-42"
    assert proxy.access.tenant_header == "x-tenant"
    assert proxy.forwarding.allows("GET", "/slots")
    assert "ka-secret-17" not in repr(loaded)
    assert "root-secret-42" not in repr(loaded)
    with ProxyServer(proxy, port=0, limits=loaded.server_limits()) as server:
        refused(post(server, chat(), authorization="Bearer ka-secret-17"), 413, "body_too_large")
        assert (
            post(
                server, chat(messages=[{"role": "user", "content": "hi"}]), authorization="Bearer ka-secret-17"
            ).status_code
            == 200
        )

    bad = (
        config.read_text()
        .replace("body_bytes = 1000", "body_byte = 1000\nmessages = 0")
        .replace("max_connections = 10", "max_connection = 10")
    )
    config.write_text(bad, encoding="utf-8")
    with pytest.raises(ProxyConfigError) as failure:
        load_config(config, upstream=upstream.base_url)
    message = str(failure.value)
    assert "body_byte" in message
    assert "max_connection" in message


# ----------------------------------------------------------------------------------------- fast paths

_JSON = st.recursive(
    st.one_of(
        st.none(), st.booleans(), st.integers(), st.text(alphabet='[]{}"\\\\ab\\n\\u00e9'), st.floats(allow_nan=False)
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(alphabet='[]{}"\\\\k'), inner, max_size=4)
    ),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(value=_JSON, ascii_only=st.booleans(), spaced=st.booleans())
def test_the_depth_read_from_the_bytes_is_the_depth_of_the_value(value: Any, ascii_only: bool, spaced: bool) -> None:
    from contextkeeper.proxy.limits import _depth, raw_depth

    separators = (", ", ": ") if spaced else (",", ":")
    raw = json.dumps(value, ensure_ascii=ascii_only, separators=separators).encode("utf-8")
    assert raw_depth(raw) == _depth(value, 10**6)
