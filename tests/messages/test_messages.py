"""Tests for contextkeeper.messages: round trips, units, typed errors and the server/raw views."""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from contextkeeper._exceptions import InvalidMessage, MessageError, MissingToolResult, OrphanToolResult
from contextkeeper.messages import (
    ContentPart,
    Conversation,
    FunctionCall,
    ImageURLPart,
    MediaPart,
    Message,
    TextPart,
    ToolCall,
    Unit,
    raw_view,
    server_view,
    server_view_message,
)
from contextkeeper.messages.views import _server_view_message_reference

# ------------------------------------------------------------------------------------------------ fixtures


def openai_call(call_id: str, name: str = "get_weather", arguments: str = '{"city": "Paris"}') -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def hf_call(name: str = "get_weather", arguments: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments or {"city": "Paris"}}}


def tool(content: str, call_id: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "tool", "content": content}
    if call_id is not None:
        out["tool_call_id"] = call_id
    return out


USER = {"role": "user", "content": "hi"}
SYSTEM = {"role": "system", "content": "be brief"}

VALID_MESSAGES: list[dict[str, Any]] = [
    {"role": "user", "content": "Hello"},
    {"role": "user", "content": ""},
    {"role": "system", "content": "You are helpful."},
    {"role": "developer", "content": "Answer in French."},
    {"role": "user", "content": "héllo wörld 你好 🌍 \u200b\n\t"},
    {"role": "user", "content": [{"type": "text", "text": "What is this?"}]},
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "Describe"},
            {"type": "image_url", "image_url": {"url": "https://x/y.png", "detail": "high"}},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        ],
    },
    {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "UklGR", "format": "wav"}}]},
    {"role": "user", "content": [{"type": "file", "file": {"file_id": "file-abc"}}]},
    {
        "role": "user",
        "content": [{"type": "image", "url": "https://x/y.png"}, {"type": "video", "path": "a.mp4"}],
    },
    {"role": "user", "content": [{"type": "audio"}]},
    {"role": "user", "content": [{"type": "my_custom", "payload": {"a": [1, 2]}}]},
    {"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}]},
    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u", "detail": None}}]},
    {"role": "user", "content": "hi", "name": "alice"},
    {"role": "user", "content": None},
    {"role": "user"},
    {"role": "assistant", "content": "Sure."},
    {"role": "assistant", "content": None, "tool_calls": [openai_call("call_1")]},
    {"role": "assistant", "content": "", "tool_calls": [openai_call("c1", arguments="not json at all")]},
    {"role": "assistant", "tool_calls": [hf_call(arguments={"nested": {"deep": [1, {"x": None}]}})]},
    {"role": "assistant", "tool_calls": [{"name": "lookup", "arguments": {"q": "x"}}]},
    {"role": "assistant", "tool_calls": [{"name": "lookup", "arguments": {"q": "x"}, "id": "abc", "z": 1}]},
    {"role": "assistant", "tool_calls": [{"id": None, "function": {"name": "f", "arguments": {}}}]},
    {"role": "assistant", "tool_calls": []},
    {"role": "assistant", "tool_calls": None, "content": "x"},
    {"role": "assistant", "content": "42", "reasoning_content": "6 times 7"},
    {"role": "assistant", "content": "42", "thinking": "6 times 7"},
    {"role": "assistant", "content": "42", "reasoning": "6 times 7", "refusal": None, "audio": None},
    {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    {"role": "tool", "content": [{"type": "text", "text": "sunny"}], "tool_call_id": "call_1", "name": "w"},
    {"role": "user", "content": "x", "metadata": {"k": [1, 2.5, True, None]}, "weight": 0},
]


# ------------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("data", VALID_MESSAGES)
def test_message_round_trip(data: dict[str, Any]) -> None:
    before = copy.deepcopy(data)
    message = Message.from_dict(data)
    assert message.to_dict() == data
    # Values are byte-identical, not merely equal.
    assert json.dumps(message.to_dict(), sort_keys=True) == json.dumps(data, sort_keys=True)
    assert data == before


@pytest.mark.parametrize("data", VALID_MESSAGES)
def test_to_dict_is_the_serializer_s_dict_with_its_key_order(data: dict[str, Any]) -> None:
    # to_dict skips the serializer for messages of strings and None only; the dict must be the same.
    message = Message.from_dict(data)
    out = message.to_dict()
    assert list(out.items()) == list(message.model_dump(exclude_unset=True).items())
    out["content"] = "changed"
    assert message.to_dict() == data


def test_round_trip_does_not_add_defaults() -> None:
    assert Message.from_dict({"role": "user"}).to_dict() == {"role": "user"}
    call = {"function": {"name": "f", "arguments": {}}}
    out = Message.from_dict({"role": "assistant", "tool_calls": [call]}).to_dict()
    assert out["tool_calls"][0] == call  # no "type": "function", no "id": None


def test_explicit_none_is_kept() -> None:
    out = Message.from_dict({"role": "assistant", "content": None, "name": None}).to_dict()
    assert out == {"role": "assistant", "content": None, "name": None}


def test_flat_hf_call_reads_as_function_and_writes_back_flat() -> None:
    message = Message.from_dict({"role": "assistant", "tool_calls": [{"name": "f", "arguments": {"a": 1}}]})
    assert message.tool_calls is not None
    call = message.tool_calls[0]
    assert call.function.name == "f"
    assert call.name == "f"
    assert call.function.arguments == {"a": 1}
    assert message.to_dict()["tool_calls"] == [{"name": "f", "arguments": {"a": 1}}]


def test_parts_get_their_typed_classes() -> None:
    message = Message.from_dict(VALID_MESSAGES[6])
    assert isinstance(message.content, list)
    assert isinstance(message.content[0], TextPart)
    assert isinstance(message.content[1], ImageURLPart)
    assert message.content[1].image_url.detail == "high"
    hf = Message.from_dict({"role": "user", "content": [{"type": "image", "image": "x"}, {"type": "zzz"}]})
    assert isinstance(hf.content, list)
    assert isinstance(hf.content[0], MediaPart)
    assert type(hf.content[1]) is ContentPart


def test_messages_are_frozen() -> None:
    message = Message.from_dict({"role": "user", "content": "x"})
    with pytest.raises(ValidationError):
        message.content = "y"


def test_message_objects_pass_through() -> None:
    message = Message(role="user", content="x")
    assert Message.from_dict(message) is message
    conversation = Conversation.from_messages([message])
    assert conversation.to_caller_format()[0] is message
    assert conversation.to_dicts() == [{"role": "user", "content": "x"}]


class _SdkFunction(BaseModel):
    name: str
    arguments: str


class _SdkToolCall(BaseModel):
    id: str
    type: str = "function"
    function: _SdkFunction


class _SdkMessage(BaseModel):
    """Shaped like the openai SDK's ChatCompletionMessage."""

    content: str | None = None
    refusal: str | None = None
    role: str = "assistant"
    tool_calls: list[_SdkToolCall] | None = None


def test_objects_with_model_dump() -> None:
    sdk = _SdkMessage(tool_calls=[_SdkToolCall(id="c1", function=_SdkFunction(name="f", arguments="{}"))])
    messages: list[Any] = [USER, sdk, tool("ok", "c1")]
    conversation = Conversation.from_messages(messages)
    assert conversation.to_dicts()[1] == sdk.model_dump()
    caller = conversation.to_caller_format()
    assert caller[0] == USER
    assert caller[0] is not USER
    assert caller[1] is sdk
    assert caller[2] == tool("ok", "c1")


def test_dataclass_messages() -> None:
    @dataclasses.dataclass
    class Msg:
        role: str
        content: str

    conversation = Conversation.from_messages([Msg("user", "x")])
    assert conversation.to_dicts() == [{"role": "user", "content": "x"}]


def test_caller_input_is_never_shared() -> None:
    args: dict[str, Any] = {"city": "Paris", "opts": {"units": ["C"]}}
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "x"}], "meta": {"k": [1]}},
        {"role": "assistant", "tool_calls": [hf_call(arguments=args)]},
        tool("ok"),
    ]
    before = copy.deepcopy(messages)
    conversation = Conversation.from_messages(messages)
    # Changing the caller's objects after validation does not reach the conversation.
    messages[0]["meta"]["k"].append(2)
    args["opts"]["units"].append("F")
    assert conversation.to_dicts() == before
    # Changing what we hand out does not reach it either.
    out = conversation.to_dicts()
    out[0]["content"][0]["text"] = "changed"
    out[1]["tool_calls"][0]["function"]["arguments"]["opts"]["units"].clear()
    assert conversation.to_dicts() == before


# ---------------------------------------------------------------------------------------- hypothesis


_json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=6),
)
_json = st.recursive(
    _json_leaf,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
_text = st.text(max_size=12)
_extras = st.dictionaries(st.sampled_from(["meta", "x_trace", "cache_control", "weight"]), _json, max_size=2)


@st.composite
def _part(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(["text", "image_url", "input_audio", "image", "custom"]))
    part: dict[str, Any]
    if kind == "text":
        part = {"type": "text", "text": draw(_text)}
    elif kind == "image_url":
        image_url: dict[str, Any] = {"url": draw(_text)}
        if draw(st.booleans()):
            image_url["detail"] = draw(st.sampled_from(["low", "high", "auto", None]))
        part = {"type": "image_url", "image_url": image_url}
    elif kind == "input_audio":
        part = {"type": "input_audio", "input_audio": {"data": draw(_text), "format": "wav"}}
    elif kind == "image":
        part = {"type": "image", "url": draw(_text)}
    else:
        part = {"type": "x_custom", "value": draw(_json)}
    return {**part, **draw(_extras)}


_content = st.one_of(_text, st.none(), st.lists(_part(), max_size=3))


@st.composite
def _plain_message(draw: st.DrawFn, role: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": role}
    if draw(st.integers(0, 5)):
        message["content"] = draw(_content)
    if draw(st.integers(0, 4)) == 0:
        message["name"] = draw(_text)
    return {**message, **draw(_extras)}


@st.composite
def _assistant_unit(draw: st.DrawFn, unit_index: int, last: bool) -> list[dict[str, Any]]:
    message = draw(_plain_message("assistant"))
    for key in ("reasoning_content", "thinking"):
        if draw(st.integers(0, 4)) == 0:
            message[key] = draw(_text)
    n_calls = draw(st.integers(0, 3))
    if n_calls == 0:
        if draw(st.booleans()):
            message["tool_calls"] = draw(st.sampled_from([[], None]))
        return [message]
    style = draw(st.sampled_from(["openai", "hf", "flat"]))
    calls: list[dict[str, Any]] = []
    ids: list[str | None] = []
    for k in range(n_calls):
        name = draw(st.sampled_from(["search", "get_weather", "book"]))
        args = draw(st.dictionaries(st.text(max_size=5), _json, max_size=3))
        if style == "openai":
            call_id = f"call_{unit_index}_{k}"
            text_args = json.dumps(args) if draw(st.integers(0, 5)) else draw(_text)
            calls.append(openai_call(call_id, name, text_args))
            ids.append(call_id)
        elif style == "hf":
            calls.append({"type": "function", "function": {"name": name, "arguments": args}})
            ids.append(None)
        else:
            calls.append({"name": name, "arguments": args})
            ids.append(None)
    message["tool_calls"] = calls
    answered = n_calls
    if last:
        # Pending calls are fine at the very end; id-less calls are answered in order, so only a prefix.
        answered = draw(st.integers(0, n_calls))
    # Results of calls with ids may come in any order.
    order = draw(st.permutations(range(n_calls)))[:answered] if style == "openai" else list(range(answered))
    results = []
    for k in order:
        result: dict[str, Any] = {
            "role": "tool",
            "content": draw(st.one_of(_text, st.lists(_part(), max_size=2))),
        }
        if ids[k] is not None:
            result["tool_call_id"] = ids[k]
        results.append({**result, **draw(_extras)})
    return [message, *results]


@st.composite
def conversations(draw: st.DrawFn) -> list[dict[str, Any]]:
    kinds = draw(st.lists(st.sampled_from(["system", "developer", "user", "assistant"]), max_size=7))
    messages: list[dict[str, Any]] = []
    for index, kind in enumerate(kinds):
        if kind == "assistant":
            messages.extend(draw(_assistant_unit(index, last=index == len(kinds) - 1)))
        else:
            messages.append(draw(_plain_message(kind)))
    return messages


_FAST = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_FAST
@given(conversations())
def test_generated_conversations_round_trip_and_group(messages: list[dict[str, Any]]) -> None:
    before = copy.deepcopy(messages)
    conversation = Conversation.from_messages(messages)
    assert conversation.to_dicts() == messages
    assert conversation.to_caller_format() == messages
    assert json.dumps(conversation.to_dicts(), sort_keys=True) == json.dumps(before, sort_keys=True)
    assert messages == before
    # Message objects in, the same objects out.
    again = Conversation.from_messages(list(conversation))
    assert all(a is b for a, b in zip(again.to_caller_format(), conversation, strict=True))
    # The units cover every message once, in order, and tool results sit in their assistant's unit.
    units = conversation.units()
    covered = [index for unit in units for index in unit.indices]
    assert covered == list(range(len(messages)))
    for unit in units:
        roles = [message.role for message in unit.messages]
        assert len(roles) == unit.stop - unit.start
        if unit.kind == "assistant":
            assert roles[0] == "assistant"
            assert all(role == "tool" for role in roles[1:])
        else:
            assert len(roles) == 1
            assert roles[0] != "tool"


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversations(), st.sampled_from(["string", "openai"]))
def test_generated_server_view_is_consistent(messages: list[dict[str, Any]], content_format: str) -> None:
    before = copy.deepcopy(messages)
    view, removed = server_view(messages, content_format=content_format)  # type: ignore[arg-type]
    assert messages == before
    assert len(view) == len(messages)
    media = [part for message in Conversation.from_messages(messages) for part in message.media_parts()]
    assert [part for _, part in removed] == media
    for message in view:
        assert None not in message.values()
        assert isinstance(message["content"], (str, list))
        for call in message.get("tool_calls", ()):
            holder = call.get("function", call)
            assert not isinstance(holder["arguments"], str)
    # The fast path for plain messages builds the general path's dicts, key order included.
    for message in Conversation.from_messages(messages):
        fast = server_view_message(message, content_format=content_format)  # type: ignore[arg-type]
        assert _ordered(fast) == _ordered(_server_view_message_reference(message, content_format=content_format))  # type: ignore[arg-type]


def _ordered(value: Any) -> Any:
    """A value with every dict turned into its list of items, so comparisons see key order."""
    if isinstance(value, dict):
        return [(key, _ordered(item)) for key, item in value.items()]
    if isinstance(value, (list, tuple)):
        return [_ordered(item) for item in value]
    return value


@pytest.mark.parametrize(
    "message",
    [
        {"role": "assistant", "content": None, "tool_calls": [openai_call("c1")]},
        {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}]},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "not json"}}],
        },
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"a": [1]}}}]},
        {"role": "assistant", "tool_calls": [{"name": "f", "arguments": {"a": 1}}]},
        {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}, "index": 0}]},
        {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}", "x": 1}}]},
        {"role": "assistant", "content": "Hi", "tool_calls": [], "reasoning_content": "think", "name": "bot"},
        {
            "role": "tool",
            "tool_call_id": "c1",
            "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
        },
        {"role": "user", "content": "hello", "extra_key": 1},
        {"role": "system", "content": None},
    ],
)
@pytest.mark.parametrize("content_format", ["string", "openai"])
def test_the_server_view_fast_path_agrees_with_the_general_one(message: dict[str, Any], content_format: str) -> None:
    parsed = Message.from_dict(message)
    fast = server_view_message(parsed, content_format=content_format)  # type: ignore[arg-type]
    assert _ordered(fast) == _ordered(_server_view_message_reference(parsed, content_format=content_format))  # type: ignore[arg-type]


_junk_value = st.one_of(
    _json,
    st.sampled_from(["system", "user", "assistant", "tool", "bot", ""]),
    st.lists(st.dictionaries(st.sampled_from(["type", "text", "id", "function", "name"]), _json), max_size=2),
)
_junk_message = st.dictionaries(
    st.sampled_from(["role", "content", "tool_calls", "tool_call_id", "name"]), _junk_value, max_size=4
)


@settings(max_examples=80, deadline=None)
@given(st.one_of(st.lists(st.one_of(_junk_message, _json), max_size=4), _json))
def test_junk_raises_only_message_errors(messages: Any) -> None:
    error: MessageError | None = None
    try:
        Conversation.from_messages(messages)
    except MessageError as exc:
        error = exc
    if error is not None:
        assert not isinstance(error, ValidationError)
        assert error.index is None or 0 <= error.index < len(messages)
        assert str(error)


# ------------------------------------------------------------------------------------------------- units


def _spans(messages: list[Any]) -> list[tuple[str, int, int]]:
    return [(u.kind, u.start, u.stop) for u in Conversation.from_messages(messages).units()]


def test_units_basic() -> None:
    messages = [
        SYSTEM,
        {"role": "developer", "content": "d"},
        USER,
        {"role": "assistant", "content": "hello"},
        USER,
    ]
    assert _spans(messages) == [
        ("system", 0, 1),
        ("system", 1, 2),
        ("user", 2, 3),
        ("assistant", 3, 4),
        ("user", 4, 5),
    ]


def test_unit_holds_its_messages() -> None:
    messages = [USER, {"role": "assistant", "tool_calls": [openai_call("a")]}, tool("r", "a")]
    conversation = Conversation.from_messages(messages)
    unit = conversation.units()[1]
    assert isinstance(unit, Unit)
    assert unit.messages == conversation[1:3]
    assert list(unit.indices) == [1, 2]
    with pytest.raises(dataclasses.FrozenInstanceError):
        unit.start = 0  # type: ignore[misc]


def test_parallel_tool_calls_form_one_unit_in_any_result_order() -> None:
    messages = [
        USER,
        {"role": "assistant", "tool_calls": [openai_call("a"), openai_call("b"), openai_call("c")]},
        tool("rb", "b"),
        tool("rc", "c"),
        tool("ra", "a"),
        {"role": "assistant", "content": "done"},
        USER,
    ]
    assert _spans(messages) == [("user", 0, 1), ("assistant", 1, 5), ("assistant", 5, 6), ("user", 6, 7)]


def test_pending_calls_at_the_end_are_allowed() -> None:
    calls = [openai_call("a"), openai_call("b")]
    none_answered = [USER, {"role": "assistant", "tool_calls": calls}]
    assert _spans(none_answered) == [("user", 0, 1), ("assistant", 1, 2)]
    one_answered = [*none_answered, tool("ra", "a")]
    assert _spans(one_answered) == [("user", 0, 1), ("assistant", 1, 3)]


def test_hf_calls_without_ids_match_by_position() -> None:
    messages = [
        USER,
        {"role": "assistant", "tool_calls": [hf_call("f"), {"name": "g", "arguments": {}}]},
        tool("rf"),
        tool("rg", "whatever-id"),  # an id on the result is fine when the call has none
        USER,
    ]
    assert _spans(messages) == [("user", 0, 1), ("assistant", 1, 4), ("user", 4, 5)]


# ------------------------------------------------------------------------------------------------ errors


def _raises(messages: Any, error: type[MessageError], index: int | None, *words: str) -> MessageError:
    with pytest.raises(error) as info:
        Conversation.from_messages(messages)
    assert type(info.value) is error
    assert info.value.index == index
    text = str(info.value).lower()
    for word in words:
        assert word.lower() in text
    if index is not None:
        assert text.startswith(f"message {index}: ")
    assert not isinstance(info.value.__cause__, ValidationError)
    return info.value


def test_unknown_role_lists_valid_roles() -> None:
    error = _raises([USER, {"role": "bot", "content": "x"}], InvalidMessage, 1, "unknown role", "'bot'")
    for role in ("system", "developer", "user", "assistant", "tool"):
        assert role in str(error)
    assert error.fix


def test_missing_role() -> None:
    _raises([{"content": "x"}], InvalidMessage, 0, "no role")


@pytest.mark.parametrize("content", [5, 1.5, {"type": "text", "text": "x"}, b"bytes", ("a",)])
def test_bad_content_type(content: Any) -> None:
    _raises([USER, USER, {"role": "user", "content": content}], InvalidMessage, 2, "content", "string")


def test_content_part_without_type() -> None:
    _raises([{"role": "user", "content": [{"type": "text", "text": "a"}, {"text": "x"}]}], InvalidMessage, 0,
            "content[1]", "type")  # fmt: skip


def test_content_part_that_is_not_an_object() -> None:
    _raises([{"role": "user", "content": ["plain"]}], InvalidMessage, 0, "content[0]")


def test_malformed_known_part() -> None:
    _raises([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], InvalidMessage, 0,
            "content[0].image_url.url", "missing")  # fmt: skip
    _raises([{"role": "user", "content": [{"type": "text"}]}], InvalidMessage, 0, "content[0].text")


def test_openai_call_without_id() -> None:
    call = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    _raises([USER, {"role": "assistant", "tool_calls": [call]}], InvalidMessage, 1, "missing id")


def test_tool_result_without_id_when_the_call_has_one() -> None:
    messages = [USER, {"role": "assistant", "tool_calls": [openai_call("a")]}, tool("r")]
    error = _raises(messages, InvalidMessage, 2, "tool_call_id", "missing id")
    assert error.fix is not None
    assert "'a'" in error.fix


def test_function_name_missing() -> None:
    call = {"id": "a", "type": "function", "function": {"arguments": "{}"}}
    _raises([{"role": "assistant", "tool_calls": [call]}], InvalidMessage, 0, "function.name")
    _raises([{"role": "assistant", "tool_calls": [{"arguments": {}}]}], InvalidMessage, 0, "function.name")


def test_malformed_tool_calls() -> None:
    assistant = {"role": "assistant"}
    _raises([{**assistant, "tool_calls": [{"id": "a"}]}], InvalidMessage, 0, "function")
    _raises([{**assistant, "tool_calls": "x"}], InvalidMessage, 0, "tool_calls")
    bad_args = {"id": "a", "function": {"name": "f", "arguments": 3}}
    _raises([{**assistant, "tool_calls": [bad_args]}], InvalidMessage, 0, "arguments")
    _raises([{"role": "user", "tool_calls": [hf_call()]}], InvalidMessage, 0, "assistant")


def test_invalid_json_arguments_are_accepted() -> None:
    messages = [{"role": "assistant", "tool_calls": [openai_call("a", arguments="{broken")]}, tool("r", "a")]
    assert Conversation.from_messages(messages).to_dicts() == messages


def test_orphan_tool_result_with_unknown_id() -> None:
    messages = [
        USER,
        {"role": "assistant", "tool_calls": [openai_call("a")]},
        tool("r", "a"),
        tool("s", "zzz"),
    ]
    _raises(messages, OrphanToolResult, 3, "'zzz'", "'a'")


def test_orphan_tool_result_without_assistant() -> None:
    _raises([tool("r", "a")], OrphanToolResult, 0)
    _raises([SYSTEM, USER, tool("r", "a")], OrphanToolResult, 2)
    _raises([USER, {"role": "assistant", "content": "x"}, tool("r", "a")], OrphanToolResult, 2, "no tool calls")


def test_orphan_tool_result_after_the_next_turn() -> None:
    messages = [{"role": "assistant", "tool_calls": [openai_call("a")]}, tool("r", "a"), USER, tool("s", "a")]
    _raises(messages, OrphanToolResult, 3)


def test_more_hf_results_than_calls() -> None:
    messages = [USER, {"role": "assistant", "tool_calls": [hf_call()]}, tool("r"), tool("s")]
    _raises(messages, OrphanToolResult, 3, "1 call")


def test_missing_tool_result_before_next_turn() -> None:
    messages = [
        USER,
        {"role": "assistant", "tool_calls": [openai_call("a", "f"), openai_call("b", "g")]},
        tool("r", "a"),
        USER,
    ]
    error = _raises(messages, MissingToolResult, 1, "'g'", "'b'", "message 3")
    assert "'a'" not in str(error).split("Fix:")[0]


def test_missing_tool_result_before_next_assistant() -> None:
    messages = [{"role": "assistant", "tool_calls": [hf_call()]}, {"role": "assistant", "content": "x"}]
    _raises(messages, MissingToolResult, 0)


def test_duplicate_call_ids() -> None:
    calls = [openai_call("a"), openai_call("b"), openai_call("a")]
    _raises([USER, {"role": "assistant", "tool_calls": calls}], InvalidMessage, 1, "duplicate", "'a'")


def test_second_result_for_one_call() -> None:
    calls = [openai_call("a"), openai_call("b")]
    messages = [{"role": "assistant", "tool_calls": calls}, tool("r", "a"), tool("r", "a")]
    _raises(messages, InvalidMessage, 2, "second")


def test_pydantic_errors_are_wrapped() -> None:
    error = _raises([USER, {"role": "user", "content": "x", "name": 5}], InvalidMessage, 1, "name", "string")
    assert "validation error" not in str(error).lower()


@pytest.mark.parametrize("value", [{"role": "user", "content": "x"}, "hello", 3, None, Message(role="user")])
def test_non_list_input(value: Any) -> None:
    error = _raises(value, MessageError, None, "list")
    assert error.fix


def test_non_message_items() -> None:
    _raises([USER, 42], InvalidMessage, 1, "int")
    _raises([USER, "hello"], InvalidMessage, 1, "str")


def test_from_dict_errors_have_no_index() -> None:
    with pytest.raises(InvalidMessage) as info:
        Message.from_dict({"role": "nobody"})
    assert info.value.index is None


# ----------------------------------------------------------------------------------------------- helpers


def test_text_and_media_parts() -> None:
    message = Message.from_dict(
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "a"},
                {"type": "image_url", "image_url": {"url": "u"}},
                {"type": "refusal", "refusal": "no"},
                {"type": "image"},
                {"type": "text", "text": "b"},
            ],
        }
    )
    assert message.text_parts() == ["a", "no", "b"]
    assert [part.type for part in message.media_parts()] == ["image_url", "image"]
    assert Message.from_dict({"role": "user", "content": "s"}).text_parts() == ["s"]
    assert Message.from_dict({"role": "user"}).text_parts() == []
    assert Message.from_dict({"role": "user", "content": "s"}).media_parts() == []


def test_arguments_as_object() -> None:
    call = ToolCall(id="a", function=FunctionCall(name="f", arguments='{"x": [1, 2]}'))
    assert call.arguments_as_object() == {"x": [1, 2]}
    broken = ToolCall(id="a", function=FunctionCall(name="f", arguments="{oops"))
    assert broken.arguments_as_object() == "{oops"
    args = {"x": {"y": 1}}
    hf = ToolCall(function=FunctionCall(name="f", arguments=args))
    parsed = hf.arguments_as_object()
    assert parsed == args
    parsed["x"]["y"] = 2
    assert hf.function.arguments == {"x": {"y": 1}}


# ------------------------------------------------------------------------------------------ conversation


def test_conversation_is_an_immutable_sequence() -> None:
    messages = [SYSTEM, USER]
    conversation = Conversation.from_messages(messages)
    assert len(conversation) == 2
    assert conversation[0].role == "system"
    assert conversation[-1].content == "hi"
    assert isinstance(conversation[0:1], tuple)
    assert [m.role for m in conversation] == ["system", "user"]
    assert conversation.messages == tuple(conversation)
    assert Conversation.from_messages(conversation) is conversation
    assert conversation == Conversation.from_messages([SYSTEM, USER])
    with pytest.raises(AttributeError):
        conversation._messages = ()
    assert Conversation.from_messages([]).units() == ()
    assert copy.deepcopy(conversation) is conversation
    restored = pickle.loads(pickle.dumps(conversation))
    assert restored == conversation
    assert restored.to_caller_format() == messages
    assert restored.units() == conversation.units()


def test_select_keeps_formats_and_revalidates() -> None:
    message = Message(role="user", content="m")
    messages: list[Any] = [
        SYSTEM,
        message,
        {"role": "assistant", "tool_calls": [openai_call("a")]},
        tool("r", "a"),
        USER,
    ]
    conversation = Conversation.from_messages(messages)
    kept = conversation.select([0, 1, 4])
    assert kept.to_caller_format() == [SYSTEM, message, USER]
    assert kept.to_caller_format()[1] is message
    with pytest.raises(OrphanToolResult):
        conversation.select([0, 3])
    with pytest.raises(MissingToolResult):
        conversation.select([2, 4])
    with pytest.raises(IndexError):
        conversation.select([9])


# ------------------------------------------------------------------------------------------------- views


def test_server_view_string_format() -> None:
    messages = [
        {"role": "system", "content": "s", "name": None},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look"},
                {"type": "image_url", "image_url": {"url": "u"}},
                {"type": "text", "text": "here"},
            ],
        },
        {"role": "assistant", "content": None, "tool_calls": [openai_call("a", "f", '{"x": 1}')]},
        tool("r", "a"),
        {"role": "assistant", "content": "ok", "tool_calls": []},
    ]
    before = copy.deepcopy(messages)
    view, removed = server_view(messages)
    assert view == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "look\nhere"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}],
        },
        {"role": "tool", "content": "r", "tool_call_id": "a"},
        {"role": "assistant", "content": "ok"},
    ]
    assert len(removed) == 1
    index, part = removed[0]
    assert index == 1
    assert isinstance(part, ImageURLPart)
    assert part.image_url.url == "u"
    assert messages == before


def test_server_view_openai_format() -> None:
    messages = [
        {"role": "user", "content": "plain"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": "b"}],
        },
        {"role": "assistant", "tool_calls": [hf_call("f", {"q": 1})]},
        {"role": "tool", "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}]},
        {"role": "assistant"},
    ]
    view, removed = server_view(messages, content_format="openai")
    assert view[0]["content"] == [{"type": "text", "text": "plain"}]
    assert view[1]["content"] == [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert view[2]["content"] == []
    assert view[2]["tool_calls"][0]["function"]["arguments"] == {"q": 1}
    assert view[3]["content"] == "r1\nr2"  # vLLM flattens text-only tool results
    assert view[4] == {"role": "assistant", "content": []}
    assert [(i, p.type) for i, p in removed] == [(1, "image")]


def test_server_view_parses_arguments_of_every_shape() -> None:
    messages = [
        {
            "role": "assistant",
            "tool_calls": [
                openai_call("a", "f", '{"x": [1]}'),
                openai_call("b", "g", "not json"),
                openai_call("c", "h", ""),
                {"name": "flat", "arguments": {"y": 2}},
                {"id": "d", "name": "flat2", "arguments": '{"z": 3}'},
            ],
        }
    ]
    view, _ = server_view(messages)
    calls = view[0]["tool_calls"]
    assert calls[0]["function"]["arguments"] == {"x": [1]}
    assert calls[1]["function"]["arguments"] == {}
    assert calls[2]["function"]["arguments"] == {}
    assert calls[3] == {"name": "flat", "arguments": {"y": 2}}
    assert calls[4] == {"id": "d", "name": "flat2", "arguments": {"z": 3}}


def test_server_view_drops_keys_the_server_does_not_read_and_makes_new_objects() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "x", "name": "ann", "meta": {"k": [1]}},
        {"role": "assistant", "content": "y", "reasoning_content": "r", "refusal": None},
        {
            "role": "assistant",
            "content": "z",
            "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": {"q": [1]}}}],
        },
        {"role": "tool", "tool_call_id": "a", "content": "ok", "extra": 1},
    ]
    snapshot = copy.deepcopy(messages)
    conversation = Conversation.from_messages(messages)
    view, _ = server_view(conversation)
    assert view[0] == {"role": "user", "content": "x", "name": "ann"}
    assert view[1] == {"role": "assistant", "content": "y", "reasoning_content": "r"}
    assert view[3] == {"role": "tool", "content": "ok", "tool_call_id": "a"}
    assert list(view[0]) == ["role", "content", "name"]
    view[2]["tool_calls"][0]["function"]["arguments"]["q"].append(2)
    assert messages == snapshot
    assert conversation.to_dicts() == messages


def test_server_view_rejects_unknown_format() -> None:
    with pytest.raises(ValueError, match="content_format"):
        server_view([USER], content_format="markdown")  # type: ignore[arg-type]


def test_server_view_validates_raw_lists() -> None:
    with pytest.raises(OrphanToolResult):
        server_view([tool("r", "a")])


def test_raw_view_only_drops_top_level_none() -> None:
    messages = [
        {"role": "assistant", "content": None, "tool_calls": [openai_call("a")], "refusal": None},
        {"role": "tool", "content": [{"type": "text", "text": "r"}], "tool_call_id": "a"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u", "detail": None}}]},
    ]
    before = copy.deepcopy(messages)
    view = raw_view(messages)
    assert view == [
        {"role": "assistant", "tool_calls": [openai_call("a")]},
        {"role": "tool", "content": [{"type": "text", "text": "r"}], "tool_call_id": "a"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u", "detail": None}}]},
    ]
    assert messages == before
    view[1]["content"][0]["text"] = "changed"
    assert messages == before


# -------------------------------------------------------------------------------- validating a grown chat


def test_previous_conversation_is_extended_not_revalidated() -> None:
    history: list[dict[str, Any]] = [SYSTEM, USER, {"role": "assistant", "content": "hello"}]
    first = Conversation.from_messages(history)
    grown = [*history, {"role": "user", "content": "again"}]
    second = Conversation.from_messages(grown, previous=first)
    assert second.messages[:3] == first.messages
    assert all(a is b for a, b in zip(second.messages, first.messages, strict=False))  # the same objects
    assert second.units() == Conversation.from_messages(grown).units()


def test_previous_pending_calls_are_regrouped_with_their_new_results() -> None:
    pending = [USER, {"role": "assistant", "content": None, "tool_calls": [openai_call("c1"), openai_call("c2")]}]
    first = Conversation.from_messages(pending)
    answered = [*pending, tool("18C", "c1"), tool("4C", "c2"), {"role": "user", "content": "thanks"}]
    second = Conversation.from_messages(answered, previous=first)
    assert [(u.kind, u.start, u.stop) for u in second.units()] == [("user", 0, 1), ("assistant", 1, 4), ("user", 4, 5)]
    with pytest.raises(MissingToolResult) as info:  # one result missing before the next turn
        Conversation.from_messages([*pending, tool("18C", "c1"), {"role": "user", "content": "x"}], previous=first)
    assert info.value.index == 1


def test_previous_is_not_trusted_when_a_message_was_edited_in_place() -> None:
    history: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "hi"}]
    first = Conversation.from_messages(history)
    history[1]["content"] = 42  # now invalid: must be noticed, not reused
    with pytest.raises(InvalidMessage) as info:
        Conversation.from_messages(history, previous=first)
    assert info.value.index == 1
    history[1]["content"] = "changed"
    again = Conversation.from_messages(history, previous=first)
    assert again[1].content == "changed"


def test_new_messages_errors_carry_absolute_indices() -> None:
    history: list[dict[str, Any]] = [SYSTEM, USER, {"role": "assistant", "content": "a"}]
    first = Conversation.from_messages(history)
    with pytest.raises(OrphanToolResult) as info:
        Conversation.from_messages([*history, tool("x", "nope")], previous=first)
    assert info.value.index == 3
