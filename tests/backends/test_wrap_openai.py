"""keeper.wrap(openai.OpenAI / AsyncOpenAI) against a real OpenAI-compatible server on 127.0.0.1.

The server (tests/openai_server.py) counts with transformers alone, enforces its limit in vLLM's (and other
servers') words, can add tokens the client cannot see and can fail on purpose.
"""

from __future__ import annotations

import asyncio
import copy
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("openai")
pytest.importorskip("tenacity")

import openai

import contextkeeper as ck
from assets import require_assets, tokenizer_dir
from conftest import hf_tokenizer
from contextkeeper.calls import DriftWarning
from openai_server import ChatServer

WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima")


def user_text(turn: int, words: int = 40) -> str:
    return f"Turn {turn}: " + " ".join(WORDS[(turn * 7 + i) % len(WORDS)] for i in range(words)) + "?"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    require_assets()
    return hf_tokenizer("qwen2")


@pytest.fixture
def server(tokenizer: Any) -> Iterator[ChatServer]:
    with ChatServer(tokenizer_dir("qwen2"), max_model_len=1024, tokenizer=tokenizer) as running:
        yield running


def client_for(server: ChatServer, **kwargs: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="test", max_retries=0, **kwargs)


def keeper_for(tokenizer: Any, context: int = 1024, **kwargs: Any) -> ck.ContextKeeper:
    return ck.ContextKeeper(tokenizer, context_window=context, **kwargs)


def chat_loop(client: Any, keeper: ck.ContextKeeper, turns: int, *, max_tokens: int = 64) -> list[dict[str, Any]]:
    history: list[dict[str, Any]] = [{"role": "system", "content": "You are a terse assistant."}]
    for turn in range(turns):
        history.append({"role": "user", "content": user_text(turn)})
        before = copy.deepcopy(history)
        reply = client.chat.completions.create(model="m", messages=history, max_tokens=max_tokens)
        assert history == before  # the caller's list is never mutated
        history.append({"role": "assistant", "content": reply.choices[0].message.content})
    return history


def test_long_chat_completes_and_counts_match(server: ChatServer, tokenizer: Any) -> None:
    keeper = keeper_for(tokenizer)
    client = keeper.wrap(client_for(server))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DriftWarning)  # the same template: no drift at all
        history = chat_loop(client, keeper, 120)
    assert len(history) == 241
    assert server.rejected == 0
    assert server.accepted == 120
    # Every prompt the server counted is the count the keeper reported for it.
    assert keeper.transcript is not None
    entries = keeper.transcript.entries()
    assert len(entries) == 120
    for record, entry in zip(server.requests, entries, strict=True):
        assert record.prompt_tokens == entry.report["tokens"]
        assert entry.usage is not None
        assert entry.usage["prompt_tokens"] == record.prompt_tokens
    assert keeper.last_call.drift == 0
    # The chat outgrew the context: the late prompts were fitted, near the limit.
    assert max(r.prompt_tokens or 0 for r in server.requests) > 0.8 * (1024 - 64)
    assert entries[-1].dropped


def test_client_attributes_pass_through(server: ChatServer, tokenizer: Any) -> None:
    raw = client_for(server)
    client = ck.ContextKeeper(tokenizer, context_window=1024).wrap(raw)
    assert client.base_url == raw.base_url
    assert [m.id for m in client.models.list()] == ["test-model"]
    assert client.chat.completions.with_raw_response is not None
    assert "create" not in vars(raw.chat.completions)  # the caller's client is not patched


def test_hidden_tokens_learned_after_one_refusal(tokenizer: Any) -> None:
    prefix = "Hidden operator instructions: " + " ".join(WORDS) * 3
    with ChatServer(tokenizer_dir("qwen2"), max_model_len=1024, hidden_prefix=prefix, tokenizer=tokenizer) as server:
        keeper = keeper_for(tokenizer)
        client = keeper.wrap(client_for(server))
        # Start from a history that already fills the context, so the first call meets the limit.
        history: list[dict[str, Any]] = [{"role": "system", "content": "Be terse."}]
        for turn in range(30):
            history += [{"role": "user", "content": user_text(turn)}, {"role": "assistant", "content": "Noted."}]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for turn in range(30, 130):
                history.append({"role": "user", "content": user_text(turn)})
                reply = client.chat.completions.create(model="m", messages=history, max_tokens=64)
                history.append({"role": "assistant", "content": reply.choices[0].message.content})
        assert sum(issubclass(w.category, DriftWarning) for w in caught) == 1  # warned once
        assert server.hidden > 50
        assert server.accepted == 100  # no failed turn
        assert server.rejected == 1  # one refusal taught the offset; it never happened again
        assert keeper.last_call.withheld >= server.hidden
        first = keeper.transcript.entries()[0]
        assert first.attempts == 2


@pytest.mark.parametrize(
    "dialect", ["vllm", "vllm-validate", "vllm-legacy", "llamacpp", "llamacpp-legacy", "ollama-error", "openai"]
)
def test_server_limit_learned_from_each_dialect(dialect: str, tokenizer: Any) -> None:
    with ChatServer(tokenizer_dir("qwen2"), max_model_len=512, dialect=dialect, tokenizer=tokenizer) as server:
        keeper = keeper_for(tokenizer, context=4096)  # configured larger than the server really is
        client = keeper.wrap(client_for(server))
        chat_loop(client, keeper, 20)
        assert server.accepted == 20
        assert 1 <= server.rejected <= 3  # learned from the refusal, not re-learned every turn
        assert all(r.accepted for r in server.requests[-10:])


def test_refusals_exhaust_into_context_length_exceeded(tokenizer: Any) -> None:
    with ChatServer(tokenizer_dir("qwen2"), max_model_len=256, tokenizer=tokenizer) as server:
        keeper = keeper_for(tokenizer, context=4096)
        client = keeper.wrap(client_for(server), attempts=1)
        messages = [{"role": "user", "content": user_text(0, 400)}]  # the request alone is too long for 256
        with pytest.raises(ck.ContextLengthExceeded) as caught:
            client.chat.completions.create(model="m", messages=messages, max_tokens=32)
        assert caught.value.limit == 256
        assert caught.value.report is not None
        assert caught.value.report.tokens > 256
        assert "max_model_len" in str(caught.value)
        assert keeper.transcript.last().error is not None  # the failure is recorded too


@pytest.mark.parametrize("kind", ["500", "503", "429", "malformed", "disconnect", "timeout"])
def test_transport_failures_are_retried(kind: str, server: ChatServer, tokenizer: Any) -> None:
    keeper = keeper_for(tokenizer)
    client = keeper.wrap(client_for(server, timeout=0.5), backoff=0.01)
    server.fail_next(kind, times=2, delay=2.0, retry_after=0)
    reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    assert reply.choices[0].message.content
    assert keeper.last_call.attempts == 3
    assert len(keeper.last_call.recoveries) == 2


def test_transport_failures_exhaust(server: ChatServer, tokenizer: Any) -> None:
    keeper = keeper_for(tokenizer)
    client = keeper.wrap(client_for(server), backoff=0.01, attempts=3)
    server.fail_next("500", times=5)
    with pytest.raises(ck.TransportError) as caught:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    assert caught.value.attempts == 3
    assert isinstance(caught.value.__cause__, openai.InternalServerError)


def test_other_errors_pass_unchanged(server: ChatServer, tokenizer: Any) -> None:
    client = keeper_for(tokenizer).wrap(client_for(server))
    with pytest.raises(TypeError):
        client.chat.completions.create(model="m", max_tokens=8)  # no messages: the SDK's own shape


def test_stream_passes_chunks_and_records(server: ChatServer, tokenizer: Any) -> None:
    keeper = keeper_for(tokenizer)
    client = keeper.wrap(client_for(server))
    server.replies.append("Streaming works one chunk at a time.")
    stream = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "stream please"}],
        max_tokens=32,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Streaming works one chunk at a time."
    assert len(chunks) > 3
    entry = keeper.transcript.last()
    assert entry.received is not None
    assert entry.received["content"] == text
    assert entry.usage is not None
    assert entry.usage["prompt_tokens"] == server.requests[-1].prompt_tokens
    assert keeper.last_call.drift == 0


def test_async_concurrent_calls_respect_the_ledger(server: ChatServer, tokenizer: Any) -> None:
    capacity = 1500  # room for about two 600-token calls at once
    keeper = keeper_for(tokenizer, kv_capacity=capacity)
    raw = openai.AsyncOpenAI(base_url=server.base_url, api_key="test", max_retries=0)
    client = keeper.wrap(raw)

    async def one(i: int) -> str:
        messages = [{"role": "user", "content": user_text(i, 300)}]
        if i % 2:
            stream = await client.chat.completions.create(
                model="m", messages=messages, max_tokens=64, stream=True, stream_options={"include_usage": True}
            )
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        reply = await client.chat.completions.create(model="m", messages=messages, max_tokens=64)
        return str(reply.choices[0].message.content)

    async def main() -> list[str]:
        return await asyncio.gather(*(one(i) for i in range(16)))

    texts = asyncio.run(main())
    assert all(texts)
    ledger = keeper.ledger
    assert ledger.peak <= capacity
    assert ledger.active == 0  # every ticket was released, streams included
    assert ledger.waits > 0  # some calls had to wait their turn
    assert server.accepted == 16
    assert len(keeper.transcript.entries()) == 16


def test_transcript_survives_restart(server: ChatServer, tokenizer: Any, tmp_path: Any) -> None:
    path = tmp_path / "chat.sqlite"
    with keeper_for(tokenizer, context=512, transcript=path) as keeper:
        history = chat_loop(keeper.wrap(client_for(server)), keeper, 12)
        dropped = keeper.transcript.last().dropped
        assert dropped  # a 512-token context cannot hold 12 turns
    with keeper_for(tokenizer, context=512, transcript=path) as again:
        entries = again.transcript.entries()
        assert len(entries) == 12
        last = entries[-1]
        recovered = again.transcript.recover(last.call)
        assert recovered == [history[i] for i in last.removed]
        assert again.transcript.history()[: len(history) - 1] == history[:-1]


def test_a_server_that_truncates_silently_is_noticed(tokenizer: Any) -> None:
    # Ollama cuts an over-long prompt instead of refusing it; its usage then reports fewer tokens than were sent.
    with ChatServer(tokenizer_dir("qwen2"), max_model_len=256, dialect="ollama", tokenizer=tokenizer) as server:
        keeper = keeper_for(tokenizer, context=4096)
        client = keeper.wrap(client_for(server))
        messages = [{"role": "user", "content": user_text(0, 300)}]
        with pytest.warns(DriftWarning, match="cut the prompt"):
            client.chat.completions.create(model="m", messages=messages, max_tokens=16)
        assert keeper.last_call.drift is not None
        assert keeper.last_call.drift < 0
