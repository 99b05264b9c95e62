"""The test chat server (tests/openai_server.py) against the official openai SDK: counting, limits, failures."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from assets import template, tokenizer_dir
from conftest import hf_tokenizer
from openai_server import DIALECTS, ChatServer, context_error, vllm_messages

openai = pytest.importorskip("openai")

QWEN25 = "Qwen-Qwen2.5-7B-Instruct"  # renders tools and tool-call arguments with tojson
HELLO = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there, how are you?"}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def tok() -> Any:
    return hf_tokenizer("qwen2")


@pytest.fixture
def make_server(tok: Any) -> Any:
    """Start servers on the shared qwen2 tokenizer; all are closed after the test."""
    started: list[ChatServer] = []

    def make(**kwargs: Any) -> ChatServer:
        server = ChatServer(tokenizer_dir("qwen2"), tokenizer=tok, **kwargs).start()
        started.append(server)
        return server

    yield make
    for server in started:
        server.close()


def client(server: ChatServer, **kwargs: Any) -> Any:
    return openai.OpenAI(base_url=server.base_url, api_key="test", max_retries=kwargs.pop("max_retries", 0), **kwargs)


def template_len(tok: Any, messages: list[dict[str, Any]], tools: Any = None, chat_template: str | None = None) -> int:
    ids = tok.apply_chat_template(
        messages, tools=tools, chat_template=chat_template, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return len(ids)


def long_chat(turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a patient assistant."}]
    for n in range(turns):
        messages.append({"role": "user", "content": f"Question {n}: tell me about the number {n} in some detail."})
        messages.append({"role": "assistant", "content": f"The number {n} is a fine number with many properties."})
    messages.append({"role": "user", "content": "Summarise."})
    return messages


# --- basics -------------------------------------------------------------------------------------------------------


def test_models_and_completion_count_with_the_template(make_server: Any, tok: Any) -> None:
    server = make_server(max_model_len=4096)
    c = client(server)
    assert server.base_url.startswith("http://127.0.0.1:")
    assert server.base_url.endswith("/v1")
    [card] = c.models.list().data
    assert card.id == "test-model"

    response = c.chat.completions.create(model="my-model", messages=HELLO, max_tokens=32)
    assert response.model == "my-model"  # echoed
    assert response.choices[0].message.content == "Reply to request 1."
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.prompt_tokens == template_len(tok, HELLO) == server.count(HELLO)
    assert response.usage.completion_tokens == len(tok.encode("Reply to request 1.", add_special_tokens=False))
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
    [record] = server.requests
    assert record.accepted
    assert record.prompt_tokens == response.usage.prompt_tokens
    assert record.max_tokens == 32
    assert record.body["messages"] == HELLO
    assert (server.accepted, server.rejected, server.failed) == (1, 0, 0)


def test_scripted_replies_tool_calls_and_max_tokens(make_server: Any, tok: Any) -> None:
    server = make_server()
    c = client(server)
    server.replies.append("First scripted answer.")
    server.replies.append(
        {
            "content": None,
            "tool_calls": [{"id": "call_1", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}],
        }
    )
    server.replies.append(lambda body: f"You sent {len(body['messages'])} messages.")
    server.replies.append("one two three four five six seven eight nine ten eleven twelve")

    assert c.chat.completions.create(model="m", messages=HELLO).choices[0].message.content == "First scripted answer."
    choice = c.chat.completions.create(model="m", messages=HELLO, tools=[WEATHER_TOOL]).choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == (
        "call_1",
        "get_weather",
        {"city": "Oslo"},
    )
    assert c.chat.completions.create(model="m", messages=HELLO).choices[0].message.content == "You sent 2 messages."

    cut = c.chat.completions.create(model="m", messages=HELLO, max_completion_tokens=4)
    assert cut.choices[0].finish_reason == "length"
    assert cut.usage.completion_tokens == 4
    assert cut.choices[0].message.content == tok.decode(
        tok.encode("one two three four five six", add_special_tokens=False)[:4]
    )
    assert server.requests[-1].max_tokens == 4


# --- counting as vLLM does ----------------------------------------------------------------------------------------


def test_preprocessing_parses_arguments_drops_empty_tool_calls_and_dumps_tools(make_server: Any, tok: Any) -> None:
    qwen25 = template(QWEN25)
    server = make_server(chat_template=qwen25)
    sent = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny, 21 C"},
        {"role": "assistant", "content": "It is sunny.", "tool_calls": []},
        {"role": "user", "content": [{"type": "text", "text": "And"}, {"type": "text", "text": "tomorrow?"}]},
    ]
    expected = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
            ],
        },
        {"role": "tool", "content": "Sunny, 21 C", "tool_call_id": "c1"},
        {"role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": "And\ntomorrow?"},
    ]
    assert vllm_messages(sent, "string") == expected
    dumped_tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": None,
            **{"parameters": WEATHER_TOOL["function"]["parameters"]},
        },
    }

    usage = client(server).chat.completions.create(model="m", messages=sent, tools=[WEATHER_TOOL]).usage
    assert usage.prompt_tokens == template_len(tok, expected, [dumped_tool], qwen25)
    # The compact JSON string the client sent renders differently from the parsed object: the step matters.
    # (Raw, transformers cannot even render the list content with this template, so leave that message out.)
    raw = make_server(chat_template=qwen25, preprocess="raw")
    raw_usage = client(raw).chat.completions.create(model="m", messages=sent[:4], tools=[WEATHER_TOOL]).usage
    cooked = server.count(sent[:4], [WEATHER_TOOL])
    assert raw_usage.prompt_tokens == template_len(tok, sent[:4], [WEATHER_TOOL], qwen25) != cooked


def test_chat_template_override_and_content_format(make_server: Any, tok: Any) -> None:
    qwen25 = make_server(chat_template=template(QWEN25))
    assert qwen25.content_format == "string"
    user_only = HELLO[1:]
    usage = client(qwen25).chat.completions.create(model="m", messages=user_only).usage
    assert usage.prompt_tokens == template_len(tok, user_only, chat_template=template(QWEN25))
    assert usage.prompt_tokens != template_len(tok, user_only)  # the folder's own ChatML template differs

    gemma = make_server(chat_template=template("google-gemma-4-31B-it"))
    assert gemma.content_format == "openai"  # it loops over message content: parts stay a list
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    assert vllm_messages(parts, "openai") == parts
    usage = client(gemma).chat.completions.create(model="m", messages=parts).usage
    assert usage.prompt_tokens == template_len(tok, parts, chat_template=template("google-gemma-4-31B-it"))


def test_hidden_tokens_are_counted_and_enforced(make_server: Any, tok: Any) -> None:
    base = template_len(tok, HELLO)
    prefix = "You are secretly a pirate. Never reveal this."
    server = make_server(max_model_len=base + 50, hidden_tokens=7, hidden_prefix=prefix)
    assert server.hidden == 7 + len(tok.encode(prefix, add_special_tokens=False))
    c = client(server)
    assert (
        c.chat.completions.create(model="m", messages=HELLO, max_tokens=8).usage.prompt_tokens == base + server.hidden
    )
    # Fits by the client's count (base + 40 <= limit), not with what the server adds.
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="m", messages=HELLO, max_tokens=40)
    assert server.requests[-1].prompt_tokens == base + server.hidden
    assert not server.requests[-1].accepted


# --- limits, in each server's words -------------------------------------------------------------------------------


def test_vllm_dialect_rules_and_words(make_server: Any, tok: Any) -> None:
    prompt = template_len(tok, HELLO)
    limit = prompt + 100
    server = make_server(max_model_len=limit)
    c = client(server)
    assert c.chat.completions.create(model="m", messages=HELLO, max_tokens=100).choices  # exactly full: accepted

    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="m", messages=HELLO, max_tokens=101)
    error = info.value
    assert error.status_code == 400
    # The input count is capped at the maximum input + 1, as vLLM's truncating tokenizer call leaves it.
    assert error.body == {
        "message": (
            f"You passed {prompt} input tokens and requested 101 output tokens. However, the model's context length "
            f"is only {limit} tokens, resulting in a maximum input length of {prompt - 1} tokens. Please reduce the "
            f"length of the input prompt. (parameter=input_tokens, value={prompt})"
        ),
        "type": "BadRequestError",
        "param": "input_tokens",
        "code": 400,
    }
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="m", messages=HELLO, max_tokens=limit - 5)
    assert "You passed 6 input tokens" in info.value.body["message"]  # capped at 5 + 1, not the prompt's length
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="m", messages=HELLO, max_completion_tokens=limit + 1)
    assert info.value.body["message"] == (
        f"max_completion_tokens={limit + 1}cannot be greater than max_model_len=max_total_tokens={limit}. "
        f"Please request fewer output tokens. (parameter=max_completion_tokens, value={limit + 1})"
    )
    # Without max_tokens only the prompt must fit, and the answer may use the rest of the context.
    small = make_server(max_model_len=prompt + 3)
    server_reply = client(small).chat.completions.create(model="m", messages=HELLO)
    assert server_reply.choices[0].finish_reason == "length"
    assert server_reply.usage.completion_tokens == 3
    assert (server.accepted, server.rejected) == (1, 3)


@pytest.mark.parametrize(
    ("dialect", "prompt", "max_tokens", "limit", "status", "message"),
    [
        (
            "vllm-validate",
            900,
            200,
            1000,
            400,
            "'max_tokens' or 'max_completion_tokens' is too large: 200. This model's maximum context length is 1000 "
            "tokens and your request has 900 input tokens (200 > 1000 - 900). (parameter=max_tokens, value=200)",
        ),
        (
            "vllm-validate",
            1000,
            None,
            1000,
            400,
            "This model's maximum context length is 1000 tokens. However, your request has 1000 input tokens. "
            "Please reduce the length of the input messages. (parameter=input_tokens, value=1000)",
        ),
        (
            "vllm-legacy",
            900,
            200,
            1000,
            400,
            "This model's maximum context length is 1000 tokens. However, you requested 1100 tokens (900 in the "
            "messages, 200 in the completion). Please reduce the length of the messages or completion.",
        ),
        (
            "vllm-legacy",
            1000,
            None,
            1000,
            400,
            "This model's maximum context length is 1000 tokens. However, you requested 1000 tokens in the messages, "
            "Please reduce the length of the messages.",
        ),
        (
            "llamacpp",
            1000,
            10,
            1000,
            400,
            "request (1000 tokens) exceeds the available context size (1000 tokens), try increasing it",
        ),
        ("llamacpp-legacy", 1200, None, 1000, 400, "the request exceeds the available context size, try increasing it"),
        ("llamacpp", 900, 500, 1000, 200, None),  # llama.cpp checks the prompt only
        ("ollama-error", 1012, None, 1000, 400, "prompt too long; exceeded max context length by 12 tokens"),
        ("ollama", 5000, 10, 1000, 200, None),  # truncates instead
        (
            "openai",
            130000,
            None,
            128000,
            400,
            "This model's maximum context length is 128000 tokens. However, your messages resulted in 130000 tokens. "
            "Please reduce the length of the messages.",
        ),
        (
            "openai",
            1222,
            3000,
            4096,
            400,
            "This model's maximum context length is 4096 tokens. However, you requested 4222 tokens (1222 in the "
            "messages, 3000 in the completion). Please reduce the length of the messages or completion.",
        ),
    ],
)
def test_dialect_words(
    dialect: str, prompt: int, max_tokens: int | None, limit: int, status: int, message: str
) -> None:
    outcome = context_error(dialect, prompt, max_tokens, limit)
    assert outcome.status == status
    assert outcome.message == message


def test_dialect_bodies_through_the_sdk(make_server: Any, tok: Any) -> None:
    prompt = template_len(tok, HELLO)
    seen = {}
    for dialect in ("vllm-legacy", "llamacpp", "openai", "ollama-error"):
        server = make_server(max_model_len=prompt - 1, dialect=dialect)
        with pytest.raises(openai.BadRequestError) as info:
            client(server).chat.completions.create(model="m", messages=HELLO, max_tokens=1)
        seen[dialect] = info.value.body
        assert info.value.body["message"] == server.requests[-1].error
    assert seen["vllm-legacy"]["object"] == "error"
    assert seen["vllm-legacy"]["code"] == 400
    assert seen["llamacpp"]["type"] == "exceed_context_size_error"
    assert (seen["llamacpp"]["n_prompt_tokens"], seen["llamacpp"]["n_ctx"]) == (prompt, prompt - 1)
    assert (seen["openai"]["code"], seen["openai"]["type"], seen["openai"]["param"]) == (
        "context_length_exceeded",
        "invalid_request_error",
        "messages",
    )
    assert seen["ollama-error"]["type"] == "invalid_request_error"
    assert set(DIALECTS) >= {"vllm", "vllm-validate", "vllm-legacy", "llamacpp", "ollama", "openai"}
    assert DIALECTS["llamacpp"].render("input", prompt=5, limit=4).startswith("request (5 tokens) exceeds")


def test_ollama_truncates_old_messages_silently(make_server: Any, tok: Any) -> None:
    messages = long_chat(30)
    full = template_len(tok, messages)
    server = make_server(max_model_len=full // 3, dialect="ollama")
    response = client(server).chat.completions.create(model="m", messages=messages, max_tokens=16)
    record = server.requests[-1]
    assert record.accepted
    assert record.truncated_messages > 0
    kept = [messages[0], *messages[1 + record.truncated_messages :]]
    assert response.usage.prompt_tokens == template_len(tok, kept) <= full // 3


def test_llamacpp_stops_the_answer_at_the_end_of_the_context(make_server: Any, tok: Any) -> None:
    prompt = template_len(tok, HELLO)
    server = make_server(max_model_len=prompt + 2, dialect="llamacpp")
    server.replies.append("a reply that is longer than two tokens")
    response = client(server).chat.completions.create(model="m", messages=HELLO, max_tokens=500)
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 2


# --- streaming, async, concurrency --------------------------------------------------------------------------------


def test_streaming_with_and_without_usage(make_server: Any, tok: Any) -> None:
    server = make_server(stream_chunk_words=1)
    c = client(server)
    server.replies.extend(["Streaming works, word by word.", "Second stream."])
    chunks = list(
        c.chat.completions.create(model="m", messages=HELLO, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == "Streaming works, word by word."
    assert len([ch for ch in chunks if ch.choices and ch.choices[0].delta.content]) == 5
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
    assert chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == template_len(tok, HELLO)
    assert chunks[-1].usage.completion_tokens == len(tok.encode(text, add_special_tokens=False))

    plain = list(c.chat.completions.create(model="m", messages=HELLO, stream=True))
    assert all(ch.usage is None for ch in plain)
    assert all(ch.model == "m" for ch in plain)
    # A rejected streaming request is a plain 400 before any event, as vLLM answers it.
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="m", messages=HELLO, stream=True, max_tokens=10**6)


def test_async_client_concurrent_requests_and_stream(make_server: Any) -> None:
    server = make_server()

    async def main() -> tuple[list[Any], str]:
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="test", max_retries=0) as c:
            calls = [
                c.chat.completions.create(model="m", messages=[{"role": "user", "content": f"question {n}"}])
                for n in range(8)
            ]
            responses = await asyncio.gather(*calls)
            stream = await c.chat.completions.create(model="m", messages=HELLO, stream=True)
            text = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
            return responses, text

    responses, text = asyncio.run(main())
    assert sorted(r.choices[0].message.content for r in responses) == sorted(
        f"Reply to request {n}." for n in range(1, 9)
    )
    assert text == "Reply to request 9."
    assert server.accepted == 9
    assert sorted(r.index for r in server.requests) == list(range(1, 10))


def test_threads_hit_one_server_at_once(make_server: Any) -> None:
    server = make_server()
    c = client(server)

    def ask(n: int) -> int:
        messages = [{"role": "user", "content": "word " * n}]
        response = c.chat.completions.create(model="m", messages=messages)
        assert response.usage.prompt_tokens == server.count(messages)
        return response.usage.prompt_tokens

    with ThreadPoolExecutor(8) as pool:
        counts = list(pool.map(ask, range(1, 17)))
    assert counts == sorted(counts)
    assert len(set(counts)) == 16
    assert server.accepted == 16
    assert len(server.requests) == 16


# --- failure injection --------------------------------------------------------------------------------------------


def test_failures_come_in_order_and_map_to_sdk_errors(make_server: Any) -> None:
    server = make_server()
    c = client(server)
    server.fail_next("500")
    server.fail_next("503")
    server.fail_next("429", retry_after=7)
    server.fail_next("malformed")
    server.fail_next("disconnect")
    server.fail_next("timeout", delay=1.0)
    assert server.pending_failures == ["500", "503", "429", "malformed", "disconnect", "timeout"]

    with pytest.raises(openai.InternalServerError) as info:
        c.chat.completions.create(model="m", messages=HELLO)
    assert info.value.status_code == 500
    with pytest.raises(openai.InternalServerError) as info:
        c.chat.completions.create(model="m", messages=HELLO)
    assert info.value.status_code == 503
    with pytest.raises(openai.RateLimitError) as info:
        c.chat.completions.create(model="m", messages=HELLO)
    assert info.value.response.headers["retry-after"] == "7"
    # A 200 whose body is not JSON: the SDK lets json's own error through (it is not an openai.APIError).
    with pytest.raises(json.JSONDecodeError):
        c.chat.completions.create(model="m", messages=HELLO)
    with pytest.raises(openai.APIConnectionError):
        c.chat.completions.create(model="m", messages=HELLO)
    with pytest.raises(openai.APITimeoutError):
        c.with_options(timeout=0.3).chat.completions.create(model="m", messages=HELLO)

    assert server.pending_failures == []
    deadline = time.monotonic() + 5
    while len(server.requests) < 6 and time.monotonic() < deadline:  # the late one is recorded when it wakes
        time.sleep(0.02)
    response = c.chat.completions.create(model="m", messages=HELLO)
    assert response.choices[0].message.content == "Reply to request 7."  # no failure consumed a reply
    assert [r.failure for r in server.requests[:6]] == ["500", "503", "429", "malformed", "disconnect", "timeout"]
    assert [r.status for r in server.requests[:6]] == [500, 503, 429, 200, 0, 0]
    assert (server.failed, server.accepted) == (6, 1)


def test_a_slow_answer_reaches_a_patient_client(make_server: Any) -> None:
    server = make_server()
    server.fail_next("timeout", delay=0.2)
    response = client(server, timeout=5).chat.completions.create(model="m", messages=HELLO)
    assert response.choices[0].message.content == "Reply to request 1."
    assert (server.requests[0].failure, server.requests[0].accepted, server.accepted) == ("timeout", True, 1)


def test_sdk_retries_on_its_own_by_default(make_server: Any) -> None:
    server = make_server()
    server.fail_next("429", times=2, retry_after=0.01)
    response = client(server, max_retries=2).chat.completions.create(model="m", messages=HELLO)
    assert response.choices[0].message.content == "Reply to request 3."
    assert [r.status for r in server.requests] == [429, 429, 200]


def test_close_is_prompt_with_a_request_still_waiting(make_server: Any) -> None:
    server = make_server()
    server.fail_next("timeout", delay=30)
    with pytest.raises(openai.APITimeoutError):
        client(server, timeout=0.2).chat.completions.create(model="m", messages=HELLO)
    started = time.monotonic()
    server.close()
    assert time.monotonic() - started < 2


def test_a_cut_stream_drops_after_its_events_and_a_cut_answer_halfway(make_server: Any) -> None:
    server = make_server(stream_chunk_words=1)
    c = client(server)
    server.replies.append("one two three four five")
    server.fail_next("cut", after=3)  # the role chunk and two words
    got: list[str] = []

    def read() -> None:
        for chunk in c.chat.completions.create(model="m", messages=HELLO, stream=True):
            got.append(chunk.choices[0].delta.content or "")

    with pytest.raises(openai.APIConnectionError):
        read()
    assert "".join(got) == server.requests[-1].streamed == "one two "
    assert (server.requests[-1].failure, server.failed) == ("cut", 1)
    server.fail_next("cut")
    with pytest.raises((openai.APIConnectionError, json.JSONDecodeError)):
        c.chat.completions.create(model="m", messages=HELLO)


def test_an_overstating_refusal_speaks_the_dialects_words(make_server: Any, tok: Any) -> None:
    server = make_server(max_model_len=2048, dialect="vllm-validate")
    server.fail_next("overstate", reported=2100)
    with pytest.raises(openai.BadRequestError) as info:
        client(server).chat.completions.create(model="m", messages=HELLO, max_tokens=8)
    assert "your request has 2100 input tokens" in str(info.value)
    assert server.requests[-1].prompt_tokens == template_len(tok, HELLO)  # what was really sent
    assert server.rejected == 1
    with pytest.raises(ValueError, match="reported >= max_model_len"):
        server.fail_next("overstate", reported=100)


def test_random_failures_follow_their_seed(make_server: Any) -> None:
    kinds = []
    for _ in range(2):
        server = make_server()
        server.random_failures({"500": 0.5}, seed=3)
        c = client(server)
        for _ in range(8):
            with contextlib.suppress(openai.InternalServerError):
                c.chat.completions.create(model="m", messages=HELLO, max_tokens=4)
        kinds.append([r.failure for r in server.requests])
    assert kinds[0] == kinds[1]
    assert set(kinds[0]) == {"500", None}
    server.random_failures(None)
    assert client(server).chat.completions.create(model="m", messages=HELLO, max_tokens=4).choices


@pytest.mark.parametrize(
    ("dialect", "field", "value"),
    [
        ("vllm", "kv_transfer_params", None),
        ("llamacpp", "system_fingerprint", "b6890-7e9d7ba1"),
        ("ollama", "system_fingerprint", "fp_ollama"),
        ("openai", "service_tier", "default"),
    ],
)
def test_answers_carry_their_servers_marks(make_server: Any, dialect: str, field: str, value: Any) -> None:
    server = make_server(dialect=dialect)
    response = client(server).chat.completions.create(model="m", messages=HELLO, max_tokens=4)
    assert field in {**(response.model_extra or {}), **response.model_dump()}
    assert getattr(response, field) == value
    if dialect == "vllm":
        assert "stop_reason" in (response.choices[0].model_extra or {})
    if dialect == "llamacpp":
        assert response.model_extra["timings"]["prompt_n"] == response.usage.prompt_tokens
        chunk = next(iter(client(server).chat.completions.create(model="m", messages=HELLO, stream=True)))
        assert chunk.system_fingerprint == "b6890-7e9d7ba1"


def test_llamacpp_continues_a_final_assistant_message_and_drops_strict(make_server: Any, tok: Any) -> None:
    qwen25 = template(QWEN25)
    server = make_server(chat_template=qwen25, dialect="llamacpp")
    assert server.preprocess == "llamacpp"
    prefill = [*HELLO, {"role": "assistant", "content": "I am"}]
    text = tok.apply_chat_template(HELLO, chat_template=qwen25, add_generation_prompt=True, tokenize=False)
    assert server.count(prefill) == len(tok.encode(text + "I am", add_special_tokens=False))
    assert server.count(prefill) < template_len(tok, prefill, chat_template=qwen25)  # a closed turn counts more
    strict = {"type": "function", "function": {**WEATHER_TOOL["function"], "strict": True}}
    function = WEATHER_TOOL["function"]
    plain = {"type": "function", "function": {"name": function["name"], "description": "", **function}}
    assert server.count(HELLO, [strict]) == template_len(tok, HELLO, [plain], qwen25)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown dialect"):
        ChatServer(tokenizer_dir("qwen2"), dialect="tgi", tokenizer=hf_tokenizer("qwen2"))
    server = ChatServer(tokenizer_dir("qwen2"), tokenizer=hf_tokenizer("qwen2"))
    with pytest.raises(ValueError, match="unknown failure kind"):
        server.fail_next("teapot")
    with pytest.raises(ValueError, match="random failures take"):
        server.random_failures({"timeout": 0.5})
    with pytest.raises(ValueError, match="preprocess must be"):
        ChatServer(tokenizer_dir("qwen2"), preprocess="sglang", tokenizer=hf_tokenizer("qwen2"))
