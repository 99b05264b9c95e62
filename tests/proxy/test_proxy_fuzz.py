"""A fuzzer over the proxy's HTTP surface (issue 34): hypothesis draws chat bodies (every field of a chat request
with values of every JSON type, odd strings, deep and wide shapes), raw bodies, paths, methods and headers, and
sends them to a real ``contextkeeper serve`` (uvicorn on 127.0.0.1) in front of tests/openai_server.py's
ChatServer. Whatever is sent, the proxy answers with an HTTP status and, for its own errors, OpenAI's error shape:
never a 500 of its own making, never a dropped connection, and it keeps answering honest requests.

Bounded: a fixed number of examples per property (``FUZZ_EXAMPLES``, default 150), no shrinking deadline.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx2")

import httpx2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import contextkeeper as ck
from assets import require_assets, tokenizer_dir
from conftest import hf_tokenizer
from contextkeeper.proxy import InputLimits, ProxyServer
from proxy_helpers import RecordingChatServer, route, running_proxy

CONTEXT = 1024
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "150"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,  # the same examples every run: a failure found in CI is found again locally
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# Strings that break naive code: surrogates (as JSON escapes), NUL and controls, bidi marks, long runs.
odd_text = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["\x00", "\u202e", "\ufeff", "\r\n", "%00", "../..", "{{ 7*7 }}", "<|im_end|>", "\\ud800"]),
    st.text(alphabet=st.characters(codec="utf-8"), min_size=200, max_size=2000),
)
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70), st.floats(allow_nan=False), odd_text
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(odd_text, inner, max_size=4)),
    max_leaves=20,
)
roles = st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "developer", "function"]), odd_text)
content = st.one_of(
    odd_text,
    st.none(),
    st.lists(
        st.one_of(
            st.fixed_dictionaries({"type": st.just("text"), "text": odd_text}),
            st.fixed_dictionaries({"type": odd_text}, optional={"text": json_values, "image_url": json_values}),
            json_values,
        ),
        max_size=3,
    ),
    json_values,
)
tool_call = st.fixed_dictionaries(
    {"id": odd_text, "type": st.just("function")},
    optional={"function": st.fixed_dictionaries({"name": odd_text}, optional={"arguments": json_values})},
)
message = st.one_of(
    st.fixed_dictionaries(
        {"role": roles},
        optional={
            "content": content,
            "tool_calls": st.lists(tool_call, max_size=2),
            "tool_call_id": odd_text,
            "name": odd_text,
        },
    ),
    json_values,
)
chat_bodies = st.fixed_dictionaries(
    {"messages": st.one_of(st.lists(message, max_size=6), json_values)},
    optional={
        "model": st.one_of(st.just("m"), json_values),
        "max_tokens": st.one_of(st.integers(min_value=-5, max_value=5000), json_values),
        "max_completion_tokens": json_values,
        "stream": st.one_of(st.booleans(), json_values),
        "stream_options": json_values,
        "tools": st.one_of(st.lists(json_values, max_size=3), json_values),
        "n": json_values,
        "best_of": json_values,
        "user": json_values,
        "prompt_cache_key": json_values,
        "temperature": json_values,
        "documents": json_values,
        "chat_template_kwargs": json_values,
    },
)


@pytest.fixture(scope="module")
def running() -> Iterator[tuple[ProxyServer, RecordingChatServer]]:
    require_assets()
    tokenizer = hf_tokenizer("qwen2")
    keeper = ck.ContextKeeper(tokenizer, context_window=CONTEXT, kv_capacity=16 * CONTEXT)
    limits = InputLimits(body_bytes=512 * 1024, messages=64, message_chars=50_000, depth=24)
    with (
        RecordingChatServer(tokenizer_dir("qwen2"), max_model_len=CONTEXT, tokenizer=tokenizer) as upstream,
        running_proxy([route(keeper)], upstream.base_url, limits=limits, attempts=1) as proxy,
    ):
        yield proxy, upstream


def answered_well(response: httpx2.Response) -> None:
    """A status the proxy chose, and for its own errors OpenAI's error shape; never a 500 of its own."""
    assert 200 <= response.status_code < 600
    if response.request.method == "HEAD":
        return  # no body to read
    if response.status_code >= 400 and response.headers.get("content-type", "").startswith("application/json"):
        error = response.json().get("error")
        assert isinstance(error, dict), response.text[:300]
        assert error.get("code") != "proxy_error", error
    if response.status_code == 500:
        # A 500 is only ever the upstream's own, passed back: JSON with its error.
        assert response.headers.get("content-type", "").startswith("application/json"), response.text[:300]


def still_serving(proxy: ProxyServer) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "still there?"}], "max_tokens": 8}
    assert httpx2.post(f"{proxy.base_url}/chat/completions", json=body, timeout=30).status_code == 200


@FUZZ
@given(body=chat_bodies)
def test_any_chat_body_gets_a_typed_answer(running: tuple[ProxyServer, RecordingChatServer], body: Any) -> None:
    proxy, _ = running
    raw = json.dumps(body).encode("utf-8", "surrogatepass")
    with httpx2.Client(timeout=60) as client:
        response = client.post(
            f"{proxy.base_url}/chat/completions", content=raw, headers={"content-type": "application/json"}
        )
        answered_well(response)
        if body.get("stream") is True and response.status_code == 200:
            assert response.text.rstrip().endswith(("data: [DONE]", "}")), response.text[-200:]


@FUZZ
@given(
    raw=st.one_of(
        st.binary(max_size=2000),
        st.builds(lambda n, tail: b"[" * n + tail, st.integers(min_value=0, max_value=20_000), st.binary(max_size=20)),
        st.builds(lambda n: b'{"messages": ' + b"[" * n + b"]" * n + b"}", st.integers(min_value=1, max_value=20_000)),
        st.sampled_from([b"NaN", b'{"messages": [], "temperature": NaN}', b"\xff\xfe\x00{", b"{" * 3, b""]),
    ),
    content_type=st.sampled_from(["application/json", "application/json; charset=utf-8", "application/x+json"]),
)
def test_any_raw_body_gets_a_typed_answer(
    running: tuple[ProxyServer, RecordingChatServer], raw: bytes, content_type: str
) -> None:
    proxy, _ = running
    response = httpx2.post(
        f"{proxy.base_url}/chat/completions", content=raw, headers={"content-type": content_type}, timeout=60
    )
    answered_well(response)
    assert response.status_code < 500


path_segment = st.one_of(
    st.sampled_from(["v1", "models", "..", ".", "", "slots", "metrics", "contextkeeper", "conversations", "api"]),
    st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=0x2FF, exclude_characters="/?#"), max_size=12),
)


@FUZZ
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]),
    segments=st.lists(path_segment, min_size=1, max_size=6),
    query=st.text(max_size=30),
    headers=st.dictionaries(
        st.sampled_from(["origin", "host", "x-conversation-id", "authorization", "content-type", "connection"]),
        st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=40),
        max_size=3,
    ),
)
def test_any_path_method_and_headers_get_a_typed_answer(
    running: tuple[ProxyServer, RecordingChatServer],
    method: str,
    segments: list[str],
    query: str,
    headers: dict[str, str],
) -> None:
    from urllib.parse import quote

    proxy, _ = running
    path = "/" + "/".join(quote(segment, safe="") for segment in segments)
    url = f"{proxy.url}{path}" + (f"?{quote(query)}" if query else "")
    try:
        response = httpx2.request(method, url, headers=headers, content=b"{}", timeout=30)
    except httpx2.LocalProtocolError:
        return  # a header value httpx itself will not send
    answered_well(response)


def test_the_proxy_still_serves_after_the_fuzzing(running: tuple[ProxyServer, RecordingChatServer]) -> None:
    still_serving(running[0])
