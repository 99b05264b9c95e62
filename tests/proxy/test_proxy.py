"""``contextkeeper serve``: the OpenAI-compatible proxy, driven by real clients (the official openai SDK, sync,
async and streaming, and a raw httpx client) with tests/openai_server.py's ChatServer as its upstream.

The upstream counts prompts with transformers alone, the way vLLM does, so "the prompt tokens the upstream
counted == the proxy's header == our exact count" is a real check. Everything runs on 127.0.0.1 with ephemeral
ports; the proxy is uvicorn on a thread (and once the real CLI in a subprocess).
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx2")

import httpx2
import openai

import contextkeeper as ck
from assets import require_assets, template, tokenizer_dir
from conftest import hf_tokenizer
from contextkeeper.cli import main
from contextkeeper.proxy import Proxy, ProxyConfigError, ProxyServer, load_config
from proxy_helpers import WORDS, RecordingChatServer, debug, load_history, load_turn, route, running_proxy, tenant

CONTEXT = 1024
ANSWER = 64
user_text, long_history = load_turn, load_history


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


@pytest.fixture
def proxy(keeper: ck.ContextKeeper, upstream: RecordingChatServer) -> Iterator[ProxyServer]:
    with running_proxy([route(keeper)], upstream.base_url) as server:
        yield server


def sdk(server: ProxyServer, key: str = "client-key") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=20)


def exact(tokenizer: Any, messages: list[dict[str, Any]], tools: Any = None) -> int:
    """Our count of what reached the upstream, by a keeper that took no part in the exchange."""
    return ck.ContextKeeper(tokenizer, context_window=CONTEXT).count(messages, tools=tools)


# ------------------------------------------------------------------------------------------------ chat


def test_long_chat_comes_back_fitted(proxy: ProxyServer, upstream: RecordingChatServer, tokenizer: Any) -> None:
    client = sdk(proxy)
    history: list[dict[str, Any]] = [{"role": "system", "content": "You are a terse assistant."}]
    dropped = []
    for turn in range(30):
        history.append({"role": "user", "content": user_text(turn)})
        raw = client.chat.completions.with_raw_response.create(model="m", messages=history, max_tokens=ANSWER)
        reply = raw.parse()
        history.append({"role": "assistant", "content": reply.choices[0].message.content})
        record = upstream.requests[-1]
        header = int(raw.headers["x-contextkeeper-prompt-tokens"])
        assert record.prompt_tokens == header == exact(tokenizer, record.body["messages"])
        assert header + ANSWER <= CONTEXT
        assert reply.usage is not None
        assert reply.usage.prompt_tokens == header
        dropped.append(int(raw.headers["x-contextkeeper-messages-dropped"]))
        if dropped[-1]:
            assert "sliding_window:" in raw.headers["x-contextkeeper-actions"]
        else:
            assert raw.headers["x-contextkeeper-actions"] == "none"
    assert upstream.accepted == 30
    assert upstream.rejected == 0
    assert dropped[0] == 0
    assert dropped[-1] > 0
    assert len(history) == 61  # the client's own list is its own


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city, now.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def test_request_tools_and_answer_budget_are_reserved(tokenizer: Any) -> None:
    qwen = template("Qwen-Qwen2.5-7B-Instruct")  # a template that renders the tool schemas
    keeper = ck.ContextKeeper(tokenizer, context_window=CONTEXT, chat_template=qwen)
    answer = 200  # max_completion_tokens wins over max_tokens, as in the wrapped client
    with (
        RecordingChatServer(
            tokenizer_dir("qwen2"), max_model_len=CONTEXT, tokenizer=tokenizer, chat_template=qwen
        ) as upstream,
        running_proxy([route(keeper)], upstream.base_url) as proxy,
    ):
        raw = sdk(proxy).chat.completions.with_raw_response.create(
            model="m",
            messages=long_history(30),
            tools=TOOLS,
            max_completion_tokens=answer,
            max_tokens=8,
            extra_headers={"X-Conversation-Id": "tools"},
        )
        record = upstream.requests[-1]
        header = int(raw.headers["x-contextkeeper-prompt-tokens"])
        assert record.body["tools"] == TOOLS
        assert record.prompt_tokens == header
        assert header == keeper.fresh().count(record.body["messages"], tools=TOOLS)
        assert header + answer <= CONTEXT
        report = debug(proxy.url, "tools").json()["report"]
    assert report["max_tokens"] == answer
    assert report["slots"]["tools"] > 0


def test_async_sdk_keeps_conversations_apart(
    proxy: ProxyServer, upstream: RecordingChatServer, keeper: ck.ContextKeeper, tokenizer: Any
) -> None:
    async def chat(client: openai.AsyncOpenAI, name: str) -> list[int]:
        history: list[dict[str, Any]] = [{"role": "system", "content": f"You help {name}."}]
        tokens = []
        for turn in range(8):
            history.append({"role": "user", "content": user_text(turn)})
            raw = await client.chat.completions.with_raw_response.create(
                model="m", messages=history, max_tokens=ANSWER, extra_headers={"X-Conversation-Id": name}
            )
            assert raw.headers["x-contextkeeper-conversation"] == name
            tokens.append(int(raw.headers["x-contextkeeper-prompt-tokens"]))
            history.append({"role": "assistant", "content": raw.parse().choices[0].message.content})
        return tokens

    async def run() -> list[list[int]]:
        client = openai.AsyncOpenAI(base_url=proxy.base_url, api_key="k", max_retries=0, timeout=20)
        async with client:
            return list(await asyncio.gather(*(chat(client, f"user-{n}") for n in range(3))))

    results = asyncio.run(run())
    assert all(t + ANSWER <= CONTEXT for tokens in results for t in tokens)
    counted = sorted(r.prompt_tokens or 0 for r in upstream.requests)
    assert counted == sorted(t for tokens in results for t in tokens)  # each header is what the upstream counted
    for record in upstream.requests:
        assert record.prompt_tokens == exact(tokenizer, record.body["messages"])
    assert {f"{tenant('k')}/user-{n}" for n in range(3)} <= set(keeper.sessions())


def test_stream_passes_chunk_by_chunk(tokenizer: Any, keeper: ck.ContextKeeper) -> None:
    words = [f"{WORDS[i % len(WORDS)]} " for i in range(12)]
    with (
        RecordingChatServer(
            tokenizer_dir("qwen2"), max_model_len=CONTEXT, tokenizer=tokenizer, stream_chunk_words=1, chunk_delay=0.05
        ) as upstream,
        running_proxy([route(keeper)], upstream.base_url) as proxy,
    ):
        upstream.replies.extend(["".join(words), "".join(words)])
        history = long_history(25)
        stream = sdk(proxy).chat.completions.create(model="m", messages=history, max_tokens=ANSWER, stream=True)
        arrivals, parts = [], []
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                arrivals.append(time.perf_counter())
                parts.append(chunk.choices[0].delta.content)
        assert parts == words
        # Twelve words 50 ms apart: passed on as they came, not gathered into one answer.
        assert arrivals[-1] - arrivals[0] >= 0.35
        record = upstream.requests[-1]
        assert record.body["stream"] is True
        assert record.prompt_tokens == exact(tokenizer, record.body["messages"])
        assert record.prompt_tokens is not None
        assert record.prompt_tokens + ANSWER <= CONTEXT

        # The same through a raw HTTP client: server-sent events, one JSON chunk per event, then [DONE].
        with httpx2.Client(timeout=20) as raw:
            body = {"model": "m", "messages": history, "max_tokens": ANSWER, "stream": True}
            with raw.stream("POST", f"{proxy.base_url}/chat/completions", json=body) as response:
                assert response.status_code == 200
                assert response.headers["content-type"].startswith("text/event-stream")
                assert int(response.headers["x-contextkeeper-prompt-tokens"]) == record.prompt_tokens
                events = [line for line in response.iter_lines() if line]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(line.removeprefix("data: ")) for line in events[:-1]]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == "".join(words)
        conversation = response.headers["x-contextkeeper-conversation"]
        seen = debug(proxy.url, conversation, key=None).json()  # the raw client sent no key
        assert seen["stream"] is True
        assert seen["chunks"] == len(chunks)
        assert seen["error"] is None
        assert seen["call"]["error"] is None  # the call ended when the stream did


def test_a_client_that_leaves_mid_stream_gives_its_admission_back(tokenizer: Any) -> None:
    keeper = ck.ContextKeeper(tokenizer, context_window=CONTEXT, kv_capacity=4 * CONTEXT)
    with (
        RecordingChatServer(
            tokenizer_dir("qwen2"), max_model_len=CONTEXT, tokenizer=tokenizer, stream_chunk_words=1, chunk_delay=0.1
        ) as upstream,
        running_proxy([route(keeper)], upstream.base_url) as proxy,
    ):
        upstream.replies.append(" ".join(WORDS * 3))
        stream = sdk(proxy).chat.completions.create(
            model="m",
            messages=long_history(5),
            max_tokens=ANSWER,
            stream=True,
            extra_headers={"X-Conversation-Id": "gone"},
        )
        assert keeper.ledger.active > 0  # the stream holds its tokens while it is open
        next(iter(stream))
        stream.close()  # the client hangs up after one chunk
        deadline = time.monotonic() + 10
        while (keeper.ledger.active or proxy.proxy.debug.get(tenant(), "gone") is None) and time.monotonic() < deadline:
            time.sleep(0.05)  # the proxy notices at the next upstream chunk
        assert keeper.ledger.active == 0
        seen = proxy.proxy.debug.get(tenant(), "gone")
        assert seen is not None
        assert seen.error is not None
        assert seen.error.startswith("client_gone: the client left after 1 chunk(s)")
        assert seen.call is not None
        assert seen.call.error is not None  # the call is recorded as failed, with what had arrived


def test_context_refusal_is_recovered(tokenizer: Any, keeper: ck.ContextKeeper) -> None:
    hidden = 200  # what the upstream counts beyond what the client sends (a hidden system prompt)
    with (
        RecordingChatServer(
            tokenizer_dir("qwen2"), max_model_len=CONTEXT, tokenizer=tokenizer, hidden_tokens=hidden
        ) as upstream,
        running_proxy([route(keeper)], upstream.base_url) as proxy,
    ):
        raw = sdk(proxy).chat.completions.with_raw_response.create(
            model="m", messages=long_history(30), max_tokens=ANSWER, extra_headers={"X-Conversation-Id": "refused"}
        )
        assert raw.http_response.status_code == 200
        # vLLM's refusal caps the count it reports at the largest input plus one, so the keeper learns a lower
        # bound on what the server adds: each refusal teaches more, until a fit is accepted.
        *refused, accepted = upstream.requests
        assert refused
        for request in refused:
            assert request.status == 400
            assert "context length is only 1024 tokens" in (request.error or "")
        assert accepted.accepted
        assert accepted.prompt_tokens is not None
        assert accepted.prompt_tokens + ANSWER <= CONTEXT
        assert int(raw.headers["x-contextkeeper-prompt-tokens"]) == accepted.prompt_tokens - hidden
        seen = debug(proxy.url, "refused").json()
        assert seen["call"]["attempts"] == len(upstream.requests)
        assert any("refused for length" in r for r in seen["call"]["recoveries"])


def test_503_is_retried_and_upstream_status_is_kept(
    upstream: RecordingChatServer, keeper: ck.ContextKeeper, tokenizer: Any
) -> None:
    with running_proxy([route(keeper)], upstream.base_url, attempts=2) as proxy:
        client = sdk(proxy)
        upstream.fail_next("503")
        reply = client.chat.completions.create(model="m", messages=long_history(2), max_tokens=ANSWER)
        assert reply.choices[0].message.content
        assert [r.status for r in upstream.requests] == [503, 200]

        upstream.fail_next("503", times=2)  # every attempt: the upstream's status comes back
        with pytest.raises(openai.InternalServerError) as failed:
            client.chat.completions.create(model="m", messages=long_history(2), max_tokens=ANSWER)
        assert failed.value.status_code == 503
        error = failed.value.response.json()["error"]
        assert error["code"] == "upstream_unavailable"
        assert "after 2 attempt(s)" in error["message"]


def test_other_upstream_errors_come_back_unchanged(upstream: RecordingChatServer, keeper: ck.ContextKeeper) -> None:
    wrong = f"http://127.0.0.1:{upstream.port}/elsewhere/v1"  # the upstream answers 404 there
    with running_proxy([route(keeper)], wrong) as proxy:
        chat = {"model": "m", "messages": long_history(1), "max_tokens": 8}
        response = httpx2.post(f"{proxy.base_url}/chat/completions", json=chat, timeout=20)
    assert response.status_code == 404
    assert response.json()["error"]["message"] == "no route /elsewhere/v1/chat/completions"  # the upstream's body
    assert len(upstream.seen) == 1  # not retried: a 404 is no transport error


def test_unreachable_upstream_is_a_502(keeper: ck.ContextKeeper) -> None:
    with running_proxy([route(keeper)], "http://127.0.0.1:9/v1", attempts=2) as proxy:
        response = httpx2.post(
            f"{proxy.base_url}/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
            timeout=20,
        )
        assert response.status_code == 502
        assert response.json()["error"]["code"] == "upstream_unavailable"
        assert httpx2.get(f"{proxy.base_url}/models", timeout=20).status_code == 502


def test_requests_the_keeper_cannot_fit_are_400s(proxy: ProxyServer, upstream: RecordingChatServer) -> None:
    url = f"{proxy.base_url}/chat/completions"
    huge = [{"role": "user", "content": " ".join(WORDS * 200)}]
    response = httpx2.post(url, json={"model": "m", "messages": huge, "max_tokens": ANSWER}, timeout=20)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "request_too_large"
    assert "Fix:" in error["message"]
    assert f"{CONTEXT:,}" in error["message"]

    robot = [{"role": "robot", "content": "beep"}]
    response = httpx2.post(url, json={"model": "m", "messages": robot}, timeout=20)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_messages"
    assert "robot" in response.json()["error"]["message"]

    response = httpx2.post(url, content=b"{not json", headers={"content-type": "application/json"}, timeout=20)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"
    assert upstream.requests == []  # none of them reached the upstream


# ------------------------------------------------------------------------------------------ pass-through


def test_models_and_other_paths_pass_through(proxy: ProxyServer, upstream: RecordingChatServer) -> None:
    assert [model.id for model in sdk(proxy).models.list().data] == ["test-model"]
    direct = httpx2.get(f"{upstream.base_url}/models", timeout=10).json()
    through = httpx2.get(f"{proxy.base_url}/models", headers={"X-Custom": "kept"}, timeout=10)
    assert through.status_code == 200
    assert {**through.json()["data"][0], "created": 0} == {**direct["data"][0], "created": 0}
    method, path, headers = upstream.seen[-1]
    assert (method, path, headers["x-custom"]) == ("GET", "/v1/models", "kept")
    assert headers["host"] == f"127.0.0.1:{upstream.port}"

    # Any other path, body, query and status as they are.
    queried = httpx2.get(f"{proxy.base_url}/models?limit=1", timeout=10)
    assert queried.status_code == 404
    assert upstream.seen[-1][1] == "/v1/models?limit=1"
    missing = httpx2.post(f"{proxy.base_url}/embeddings", json={"input": "x"}, timeout=10)
    assert missing.status_code == 404
    assert upstream.seen[-1][:2] == ("POST", "/v1/embeddings")
    assert missing.json() == httpx2.post(f"{upstream.base_url}/embeddings", json={"input": "x"}, timeout=10).json()


# ---------------------------------------------------------------------------------------- conversations


def test_debug_endpoint_has_the_last_fit(proxy: ProxyServer) -> None:
    raw = sdk(proxy).chat.completions.with_raw_response.create(
        model="m", messages=long_history(20), max_tokens=ANSWER, extra_headers={"X-Conversation-Id": "debug-1"}
    )
    seen = debug(proxy.url, "debug-1")
    assert seen.status_code == 200
    data = seen.json()
    assert data["conversation"] == "debug-1"
    assert data["conversation_source"] == "header"
    assert data["prompt_tokens"] == int(raw.headers["x-contextkeeper-prompt-tokens"]) == data["report"]["tokens"]
    assert data["report"]["limit"] == CONTEXT
    assert data["report"]["max_tokens"] == ANSWER
    assert data["report"]["messages_before"] - data["report"]["messages_after"] == int(
        raw.headers["x-contextkeeper-messages-dropped"]
    )
    assert sum(v for k, v in data["report"]["slots"].items() if k != "answer") == data["prompt_tokens"]
    timing = raw.headers["server-timing"]  # the fit's own time, in milliseconds
    assert timing.startswith("fit;dur=")
    assert float(timing.removeprefix("fit;dur=")) == pytest.approx(data["report"]["seconds"] * 1000, abs=0.001)
    assert data["call"]["attempts"] == 1
    assert data["call"]["server_prompt_tokens"] == data["prompt_tokens"]
    listed = debug(proxy.url).json()
    assert "debug-1" in listed["conversations"]
    unknown = debug(proxy.url, "nobody")
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "unknown_conversation"


def test_conversation_identity_from_each_source(
    proxy: ProxyServer, upstream: RecordingChatServer, keeper: ck.ContextKeeper
) -> None:
    client = sdk(proxy)

    def conversation(messages: list[dict[str, Any]], **kwargs: Any) -> str:
        raw = client.chat.completions.with_raw_response.create(model="m", messages=messages, max_tokens=16, **kwargs)
        return str(raw.headers["x-contextkeeper-conversation"])

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    assert conversation(chat, extra_headers={"X-Conversation-Id": "from-header"}, user="ignored") == "from-header"
    assert conversation(chat, user="user-7", prompt_cache_key="ignored") == "user-7"
    assert upstream.requests[-1].body["user"] == "user-7"  # still sent on
    assert conversation(chat, prompt_cache_key="cache-3") == "cache-3"
    derived = conversation(chat)
    assert derived.startswith("conv-")
    later = [*chat, {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "And now?"}]
    assert conversation(later) == derived  # the same chat, turn after turn
    other = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Another chat"}]
    assert conversation(other) != derived
    assert {f"{tenant()}/{name}" for name in ("from-header", "user-7", "cache-3", derived)} <= set(keeper.sessions())
    sources = {
        name: debug(proxy.url, name).json()["conversation_source"]
        for name in ("from-header", "user-7", "cache-3", derived)
    }
    assert sources == {"from-header": "header", "user-7": "user", "cache-3": "prompt_cache_key", derived: "derived"}


def test_answers_are_not_held_for_a_delayed_ack(proxy: ProxyServer) -> None:
    # With Nagle's algorithm on the proxy's sockets, an answer's body waits for the client's delayed ACK of its
    # headers: every answer then takes 40 ms or more, however little the proxy does.
    with httpx2.Client(timeout=10) as client:
        seconds = []
        for _ in range(15):
            started = time.perf_counter()
            assert client.get(f"{proxy.url}/contextkeeper/conversations").status_code == 200
            seconds.append(time.perf_counter() - started)
    assert min(seconds) < 0.03  # the fastest of them: a busy machine slows some answers, Nagle's holds every one


# ------------------------------------------------------------------------------------------------ auth


def test_client_authorization_is_forwarded(proxy: ProxyServer, upstream: RecordingChatServer) -> None:
    client = sdk(proxy, key="client-secret")
    client.chat.completions.create(model="m", messages=long_history(1), max_tokens=16)
    client.models.list()
    assert [headers["authorization"] for _, _, headers in upstream.seen] == ["Bearer client-secret"] * 2


def test_proxy_key_guards_and_upstream_gets_its_own(
    upstream: RecordingChatServer, keeper: ck.ContextKeeper, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    settings = {"api_key": "proxy-secret", "upstream_api_key": "upstream-secret"}
    with running_proxy([route(keeper)], upstream.base_url, **settings) as proxy:
        with pytest.raises(openai.AuthenticationError) as refused:
            sdk(proxy, key="wrong").chat.completions.create(model="m", messages=long_history(1), max_tokens=16)
        assert refused.value.response.json()["error"]["code"] == "invalid_api_key"
        chat = {"model": "m", "messages": long_history(1)}
        assert httpx2.post(f"{proxy.base_url}/chat/completions", json=chat, timeout=10).status_code == 401
        assert httpx2.get(f"{proxy.base_url}/models", timeout=10).status_code == 401
        assert httpx2.get(f"{proxy.url}/contextkeeper/conversations", timeout=10).status_code == 401
        assert upstream.seen == []  # refused at the proxy

        client = sdk(proxy, key="proxy-secret")
        client.chat.completions.create(model="m", messages=long_history(1), max_tokens=16)
        client.models.list()
        assert [headers["authorization"] for _, _, headers in upstream.seen] == ["Bearer upstream-secret"] * 2
    assert "secret" not in caplog.text  # keys are never logged


# --------------------------------------------------------------------------------------------- config


def test_config_file_routes_models_to_their_keepers(
    tmp_path: Path, upstream: RecordingChatServer, tokenizer: Any
) -> None:
    (tmp_path / "template.jinja").write_text(tokenizer.chat_template, encoding="utf-8")
    (tmp_path / "proxy.toml").write_text(
        f"""
attempts = 2

[[models]]
match = ["qwen*", "small-*"]
tokenizer = "{tokenizer_dir("qwen2")}"
chat_template = "template.jinja"
context_window = 512

[[models]]
match = "*"
tokenizer = "{tokenizer_dir("qwen2")}"
context_window = {CONTEXT}
""",
        encoding="utf-8",
    )
    config = load_config(tmp_path / "proxy.toml", upstream=upstream.base_url)
    assert config.attempts == 2
    assert config.upstream == upstream.base_url
    server = ProxyServer(Proxy.from_config(config), port=0).start(timeout=20)
    try:
        client = sdk(server)
        limits = {}
        for model in ("Qwen-Small", "other"):
            raw = client.chat.completions.with_raw_response.create(
                model=model, messages=long_history(20), max_tokens=ANSWER, extra_headers={"X-Conversation-Id": model}
            )
            assert int(raw.headers["x-contextkeeper-prompt-tokens"]) == upstream.requests[-1].prompt_tokens
            seen = debug(server.url, model).json()
            limits[model] = (seen["route"], seen["report"]["limit"])
    finally:
        server.close()
    assert limits == {
        "Qwen-Small": ("models[0] (match 'qwen*', 'small-*')", 512),
        "other": ("models[1] (match '*')", CONTEXT),
    }


def test_bad_config_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "proxy.toml"
    bad.write_text(
        f"""
[[models]]
match = "qwen*"
tokenizer = "{tokenizer_dir("qwen2")}"
context_window = "big"
polcy = "default"
""",
        encoding="utf-8",
    )
    with pytest.raises(ProxyConfigError) as failed:
        load_config(bad)
    text = str(failed.value)
    assert text.startswith(f"{bad}: models[0] (match 'qwen*'): ")  # the file, the entry, then each key
    assert "context_window = 'big': wrong type" in text
    assert "did you mean policy?" in text
    assert "Fix:" in text

    assert main(["serve", "--upstream", "http://127.0.0.1:9/v1", "--config", str(bad)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1
    assert err.startswith("contextkeeper: ProxyConfigError: ")
    assert main(["serve", "--upstream", "http://127.0.0.1:9/v1", "--config", str(bad), "--json"]) == 2
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["type"] == "ProxyConfigError"
    assert "polcy" in error["message"]
    assert error["fix"]

    (tmp_path / "empty").mkdir()  # a folder without tokenizer files: the entry's keeper cannot be built
    unknown = tmp_path / "tok.toml"
    unknown.write_text('[[models]]\nmatch = "*"\ntokenizer = "empty"\ncontext_window = 512\n', encoding="utf-8")
    assert main(["serve", "--upstream", "http://127.0.0.1:9/v1", "--config", str(unknown)]) == 2
    assert f"{unknown}: models[0] (match '*'): folder " in capsys.readouterr().err  # read from the file's folder
    assert main(["serve", "--upstream", "http://127.0.0.1:9/v1"]) == 2  # no model entry at all
    assert "--tokenizer and --context-window" in capsys.readouterr().err


def test_cli_serve_listens_and_fits(upstream: RecordingChatServer, tokenizer: Any) -> None:
    command = [sys.executable, "-m", "contextkeeper", "serve", "--upstream", upstream.base_url]
    command += ["--tokenizer", str(tokenizer_dir("qwen2")), "--context-window", str(CONTEXT), "--port", "0"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout or ()], daemon=True).start()
    try:
        try:
            line = lines.get(timeout=60)
        except queue.Empty:
            pytest.fail(f"contextkeeper serve printed nothing in 60 s: {process.stderr and process.stderr.read()}")
        assert line.startswith("contextkeeper serve: listening on http://127.0.0.1:")
        base_url = line.split()[4]
        client = openai.OpenAI(base_url=base_url, api_key="k", max_retries=0, timeout=20)
        raw = client.chat.completions.with_raw_response.create(model="m", messages=long_history(25), max_tokens=ANSWER)
        assert int(raw.headers["x-contextkeeper-prompt-tokens"]) == upstream.requests[-1].prompt_tokens
        assert int(raw.headers["x-contextkeeper-prompt-tokens"]) + ANSWER <= CONTEXT
    finally:
        process.terminate()
        assert process.wait(timeout=20) == 0  # SIGTERM: a clean shutdown
    assert lines.empty()  # one line, nothing more


# ------------------------------------------------------------------------------------------------ live


@pytest.mark.server
def test_a_long_chat_through_the_proxy_to_llama_server() -> None:
    """40 turns through the proxy in front of a real llama-server (a tiny model on the qwen2 vocabulary, with the
    recorded template), half of them streamed, with tools and tool rounds: the server counts every prompt as the
    proxy's header says, nothing is refused, and late turns are fitted into the server's context."""
    from recorded_servers import RECORDED, live_llama_server
    from server_corpus import TEXTS, TOOL_SHAPES

    vocab, context, answer = "qwen2", 2048, 16
    tools = TOOL_SHAPES["tools-full"]
    texts = list(TEXTS.values())
    with live_llama_server(vocab, context) as server:
        keeper = ck.ContextKeeper(
            str(tokenizer_dir(vocab)),
            chat_template=template(RECORDED[vocab]["template"]),
            context_window=context,
            server="llama.cpp",
        )
        with running_proxy([route(keeper)], f"{server.url}/v1") as proxy:
            client = sdk(proxy)
            chat: list[dict[str, Any]] = [{"role": "system", "content": "Answer briefly."}]
            trimmed = 0
            for turn in range(40):
                chat.append({"role": "user", "content": f"{turn}: {texts[turn % len(texts)]}"})
                if turn % 4 == 3:
                    call = {
                        "id": f"c{turn}",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": "{}"},
                    }
                    chat.append({"role": "assistant", "content": None, "tool_calls": [call]})
                    chat.append({"role": "tool", "tool_call_id": f"c{turn}", "content": texts[(turn + 3) % len(texts)]})
                args: dict[str, Any] = {"model": "tiny", "messages": chat, "tools": tools, "max_tokens": answer}
                if turn % 2:
                    raw = client.chat.completions.with_raw_response.create(**args)
                    reply = raw.parse()
                    headers, usage, text = raw.headers, reply.usage, reply.choices[0].message.content or ""
                else:
                    with client.chat.completions.with_streaming_response.create(
                        **args, stream=True, stream_options={"include_usage": True}
                    ) as streamed:
                        chunks = list(streamed.parse())
                        headers = streamed.headers
                    usage = chunks[-1].usage
                    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                assert usage is not None, turn
                sent = int(headers["x-contextkeeper-prompt-tokens"])
                assert usage.prompt_tokens == sent, turn  # the server's own count of what the proxy sent
                assert sent + answer <= context
                trimmed += int(headers["x-contextkeeper-messages-dropped"]) > 0
                chat.append({"role": "assistant", "content": text})
    assert trimmed > 5  # the chat outgrew the server's context, so late turns were fitted
