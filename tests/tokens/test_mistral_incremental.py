"""The incremental Mistral count (each message converted, normalised and encoded by mistral-common once per
position) against mistral-common's ``encode_chat_completion`` of the whole request: counts and refusals, for
every tokenizer file mistral-common ships, on generated conversations of every shape its normaliser joins or
splits."""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import contextkeeper as ck
from contextkeeper.tokens.mistral import MistralCounter, _resolve

NAMES = ["tekken", "nemo", "v1", "v2", "v3", "v7", "mistral_instruct_tokenizer_241114.model.v7m1"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "look",
            "description": "Look something up.",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}, "n": {"type": "number"}}},
        },
    }
]
TEXTS = st.sampled_from(
    [
        "Find the open orders.",
        "Заказы за март, пожалуйста.",
        "请把三月的订单列出来。",
        "ابحث عن الطلبات المفتوحة",
        "खुले ऑर्डर दिखाओ",
        "SELECT count(*) FROM orders WHERE status = 'open';",
        '{"rows": [1, 2.0, 3], "ok": true}',
        "",
        "  spaced  \n\n",
    ]
)


@functools.cache
def _mistral(name: str, training: bool) -> Any:
    from mistral_common.protocol.instruct.validator import ValidationMode
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    mode = ValidationMode.finetuning if training else ValidationMode.test
    return MistralTokenizer.from_file(str(_resolve(name)), mode=mode)


def _reference(name: str, messages: list[dict[str, Any]], tools: Any) -> int | str:
    """mistral-common's own count of the request vLLM would send, or the message of its refusal."""
    from mistral_common.protocol.instruct.request import ChatCompletionRequest

    plain, _ = ck.server_view(messages)
    tokenizer = _mistral(name, bool(plain) and plain[-1]["role"] == "assistant")
    try:
        request = ChatCompletionRequest.from_openai(plain, tools=tools)
        return len(tokenizer.encode_chat_completion(request).tokens)
    except Exception as exc:
        return str(exc)


def _ours(counter: MistralCounter, messages: list[dict[str, Any]], tools: Any) -> int | str:
    try:
        return counter.count(messages, tools=tools)
    except ck.ChatTemplateError as exc:
        return exc.template_message or str(exc)
    except ck.ContextKeeperError as exc:  # refused before mistral-common sees it: the test says so
        raise AssertionError(f"contextkeeper refused the generated chat: {exc}") from exc


@st.composite
def conversations(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Chats of any order of roles: consecutive users or assistants (joined by the normaliser), system messages
    anywhere, parallel tool calls with their results in any order, finished or waiting for the answer."""
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(TEXTS) or "Be brief."})
    serial = 0
    for _ in range(draw(st.integers(1, 9))):
        kind = draw(st.sampled_from(["user", "user", "assistant", "calls", "system"]))
        if kind == "calls":
            calls = []
            for _ in range(draw(st.integers(1, 3))):
                serial += 1
                arguments = {"q": draw(TEXTS), "n": draw(st.sampled_from([1, 1.0, 2.5]))}
                calls.append(
                    {
                        "id": f"c{serial:08d}",
                        "type": "function",
                        "function": {"name": "look", "arguments": json.dumps(arguments, ensure_ascii=False)},
                    }
                )
            messages.append({"role": "assistant", "content": "", "tool_calls": calls})
            for call in draw(st.permutations(calls)):  # in any order (v13+ sorts them by their calls)
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": draw(TEXTS)})
        else:
            messages.append({"role": kind, "content": draw(TEXTS)})
    return messages


@pytest.fixture(scope="module")
def counters() -> dict[str, MistralCounter]:
    return {name: MistralCounter(name) for name in NAMES}


def test_every_shipped_tokenizer_counts_incrementally(counters: dict[str, MistralCounter]) -> None:
    # The probe agreed for each: none fell back to whole requests (which would leave the tests below vacuous).
    assert all(counter.incremental for counter in counters.values())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=conversations(), name=st.sampled_from(NAMES), with_tools=st.booleans())
def test_the_incremental_count_is_mistral_commons_count(
    counters: dict[str, MistralCounter], messages: list[dict[str, Any]], name: str, with_tools: bool
) -> None:
    tools = TOOLS if with_tools else None
    counter = counters[name]
    expected = _reference(name, messages, tools)
    # Every prefix too, counted in turn by the same counter: later counts reuse what earlier ones made.
    for end in range(1, len(messages)):
        assert _ours(counter, messages[:end], tools) == _reference(name, messages[:end], tools), (name, end)
    assert _ours(counter, messages, tools) == expected


@pytest.mark.parametrize("name", ["tekken", "v3", "v7"])
def test_a_growing_agent_chat_counts_as_the_whole_request(name: str) -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from agent_conversation import TOOLS as AGENT_TOOLS
    from agent_conversation import build_script, mistral_call_ids

    incremental, whole = MistralCounter(name), MistralCounter(name, incremental=False)
    assert incremental.incremental
    assert not whole.incremental
    messages = mistral_call_ids(build_script("mixed", 120, seed=3))
    starts = [k for k, m in enumerate(messages) if m["role"] == "user"]
    for end in range(20, len(messages), 7):
        # The window moves as a keeper's does: whole old turns leave.
        window = messages[max(k for k in starts if k <= end // 3) : end]
        assert _ours(incremental, window, AGENT_TOOLS) == _ours(whole, window, AGENT_TOOLS), end


def test_a_disagreeing_encoder_switches_the_incremental_count_off(monkeypatch: pytest.MonkeyPatch) -> None:
    whole = MistralCounter._whole

    def off_by_one(self: MistralCounter, conversation: Any, tools: Any) -> tuple[int, list[Any]]:
        tokens, media = whole(self, conversation, tools)
        return tokens + 1, media

    monkeypatch.setattr(MistralCounter, "_whole", off_by_one)
    counter = MistralCounter("tekken")
    assert not counter.incremental
    messages = [{"role": "user", "content": "Hello"}]
    assert counter.count(messages) == off_by_one(counter, ck.Conversation.from_messages(messages), None)[0]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=200) | TEXTS, name=st.sampled_from(["tekken", "nemo", "v3"]))
def test_snippet_counts_are_mistral_commons(counters: dict[str, MistralCounter], text: str, name: str) -> None:
    counter = counters[name]
    assert (counter._bpe is not None) == name.startswith(("tekken", "nemo"))
    assert counter.text_tokens(text) == counter.text_tokens_reference(text)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=200) | TEXTS, bos=st.booleans(), eos=st.booleans())
def test_the_counting_twins_tekken_encode_gives_mistral_commons_ids(
    counters: dict[str, MistralCounter], text: str, bos: bool, eos: bool
) -> None:
    counter = counters["tekken"]
    library = counter.tokenizer.instruct_tokenizer
    assert counter._instruct is not library  # the twin is in use for Tekken ...
    assert counters["v3"]._instruct is counters["v3"].tokenizer.instruct_tokenizer  # ... and only there
    assert counter._instruct.tokenizer.encode(text, bos=bos, eos=eos) == library.tokenizer.encode(
        text, bos=bos, eos=eos
    )
