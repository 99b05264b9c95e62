"""Data that holds one list or dict in many places (a "reference bomb"): refused in bounded time, with a typed
error, before any copy, comparison or template follows its paths; modest sharing is still taken and counted
exactly.

``a = [a, a]`` forty times over is 41 lists, but 2**40 paths: every walker that follows paths (a copy, the
surrogate check, ``data_size``, a template's ``tojson``) would run for days. JSON never shares, a Python app
can. The reproductions below hung before the fix."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import pytest
from pydantic import ValidationError

import contextkeeper as ck
from assets import template
from conftest import hf_tokenizer
from contextkeeper.messages import MAX_REPEATED, check_tools
from contextkeeper.messages.guard import _clean, _clean_reference, _measure, find_problem
from contextkeeper.messages.models import _copy, _copy_reference

BOUND_SECONDS = 2.0
USER = {"role": "user", "content": "What is the weather in Paris?"}


def bomb(levels: int = 40) -> Any:
    """``a = [a, a]`` ``levels`` times: ``levels + 1`` lists, ``2**levels`` paths."""
    value: Any = "x"
    for _ in range(levels):
        value = [value, value]
    return value


@functools.cache
def qwen3() -> ck.HFChatTemplateCounter:
    return ck.HFChatTemplateCounter(hf_tokenizer("qwen2"), chat_template=template("Qwen-Qwen3-0.6B"), name="qwen3")


@contextmanager
def bounded(what: str) -> Iterator[None]:
    started = time.perf_counter()
    yield
    took = time.perf_counter() - started
    assert took < BOUND_SECONDS, f"{what} took {took:.2f} s"


def tool(parameters: Any, name: str = "lookup") -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": "Look it up.", "parameters": parameters}}


def call_message(arguments: Any) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": arguments}}],
    }


# ------------------------------------------------------------------------------- the bomb, in every place


def _places(shared: Any) -> dict[str, tuple[list[dict[str, Any]], int, str]]:
    """Messages holding ``shared`` somewhere, the index of that message, and the place the error must name."""
    return {
        "metadata": ([USER, {"role": "user", "content": "hi", "metadata": shared}], 1, "metadata"),
        "object-arguments": ([USER, call_message({"city": shared})], 1, "tool_calls[0].function.arguments.city"),
        "flat-call": (
            [USER, {"role": "assistant", "tool_calls": [{"name": "lookup", "arguments": {"q": shared}}]}],
            1,
            "tool_calls[0].function.arguments.q",
        ),
        "content-part-key": (
            [{"role": "user", "content": [{"type": "text", "text": "hi", "extra": shared}]}],
            0,
            "content[0].extra",
        ),
        "media-part": (
            [{"role": "user", "content": [{"type": "image", "image": {"pixels": shared}}]}],
            0,
            "content[0].image.pixels",
        ),
    }


@pytest.mark.parametrize("place", list(_places(None)))
@pytest.mark.parametrize("entry", ["conversation", "count", "fit"])
def test_a_reference_bomb_in_a_message_is_refused_quickly(place: str, entry: str) -> None:
    """Was a hang: ``_copy`` (then the surrogate check, ``data_size``, ``tojson``) followed all 2**40 paths."""
    shared = bomb()
    messages, index, where = _places(shared)[place]
    counter = qwen3()  # loaded before the clock starts
    keeper = ck.ContextKeeper(counter, context_window=4096)
    calls: dict[str, Callable[[], Any]] = {
        "conversation": lambda: ck.Conversation.from_messages(messages),
        "count": lambda: counter.count(messages),
        "fit": lambda: keeper.fit(messages, max_tokens=64),
    }
    with bounded(f"{entry} of a bomb in {place}"), pytest.raises(ck.InvalidMessage) as info:
        calls[entry]()
    error = info.value
    assert error.index == index
    text = str(error)
    assert text.startswith(f"message {index}: {where}: holds lists or dicts in more than one place")
    assert "they add 3,298,534,883,283 characters" in text  # 2**40 leaves of 'x' (2 each) and 2**41 - 2 lists
    assert f"at most {MAX_REPEATED:,} are allowed" in text
    assert "hold each list or dict in one place" in (error.fix_text() or "")
    assert messages[index] is not None
    assert shared[0] is shared[1]


def test_a_reference_bomb_in_a_tool_schema_is_refused_naming_the_tool() -> None:
    """Was a hang in the schema's surrogate check, then in its copy and in the template's ``tojson``."""
    shared = bomb()
    tools = [tool({"type": "object", "properties": {"x": {"type": "string"}}}, "ok"), tool({"enum": shared})]
    expected = r"tools\[1\] \('lookup'\) function\.parameters\.enum: holds lists or dicts in more than one place"
    counter, mistral = qwen3(), ck.load_counter("mistral:tekken")  # loaded before the clock starts
    keeper = ck.ContextKeeper(counter, context_window=4096)
    for call in (
        lambda: check_tools(tools),
        lambda: counter.count([USER], tools=tools),
        lambda: keeper.fit([USER], tools=tools, max_tokens=64),
        lambda: mistral.count([USER], tools=tools),
    ):
        with bounded("a bomb in a tool schema"), pytest.raises(ck.MessageError, match=expected) as info:
            call()
        assert "MAX_REPEATED" in str(info.value)
        assert info.value.fix_text()


def test_a_reference_bomb_in_other_message_shapes_is_refused_quickly() -> None:
    """Messages that are not plain dicts: a Mapping, a dataclass, and a ``ck.Message`` built directly."""

    class Frozen(Mapping[str, Any]):
        def __init__(self, data: dict[str, Any]) -> None:
            self._data = data

        def __getitem__(self, key: str) -> Any:
            return self._data[key]

        def __iter__(self) -> Iterator[str]:
            return iter(self._data)

        def __len__(self) -> int:
            return len(self._data)

    @dataclasses.dataclass
    class Note:
        role: str
        content: str
        metadata: Any

    shared = bomb()
    for given in (Frozen({"role": "user", "content": "hi", "metadata": shared}), Note("user", "hi", shared)):
        with bounded(type(given).__name__), pytest.raises(ck.InvalidMessage, match=r"message 0: metadata: holds"):
            ck.Conversation.from_messages([given])
    # Built directly, a Message raises pydantic's error, as for every other problem; printing it stays quick.
    with bounded("ck.Message(...)"), pytest.raises(ValidationError) as info:
        ck.Message(role="user", content="hi", metadata=shared)
    assert "holds lists or dicts in more than one place" in str(info.value)


def test_a_field_of_the_wrong_type_holding_a_bomb_is_described_quickly() -> None:
    """The error words quote the bad value; quoting it in full would follow every path."""
    with bounded("a bomb as the name"), pytest.raises(ck.InvalidMessage, match=r"message 0: name: .*got \[\[") as e:
        ck.Conversation.from_messages([{"role": "user", "content": "hi", "name": bomb()}])
    assert len(str(e.value)) < 400


def test_data_that_contains_itself_twice_over_is_refused_quickly() -> None:
    """``l = [l, l]``: the careful pass for a Message built directly followed 2**100 paths to the depth bound."""
    loop: list[Any] = []
    loop.extend([loop, loop])
    with bounded("a doubled cycle"), pytest.raises(ValidationError, match="contains itself"):
        ck.Message(role="user", content="hi", metadata=loop)
    with bounded("a doubled cycle"), pytest.raises(ck.InvalidMessage, match="message 0: metadata: data that"):
        ck.Conversation.from_messages([{"role": "user", "content": "hi", "metadata": loop}])


# ------------------------------------------------------------------------------ the bound, and on each side


def _wide(copies: int) -> dict[str, Any]:
    """A message whose metadata holds one list of a 999,998-character string ``copies`` times: held, the list
    is 1 + (1 + 999,998) characters, so each extra copy adds exactly 1,000,000."""
    once = ["y" * 999_998]
    return {"role": "user", "content": "hi", "metadata": [once] * copies}


def test_the_bound_is_exact_in_characters() -> None:
    shape = _measure(_wide(33))
    assert shape.repeated == 32 * 1_000_000 == MAX_REPEATED
    with bounded("data at the bound"):
        conversation = ck.Conversation.from_messages([_wide(33)])  # exactly at the bound: taken
    assert conversation.to_dicts() == [_wide(33)]
    with bounded("data past the bound"), pytest.raises(ck.InvalidMessage) as info:
        ck.Conversation.from_messages([_wide(34)])
    assert str(info.value).startswith(
        "message 0: metadata: holds lists or dicts in more than one place, and written out once per place (as "
        "copies and a template's tojson write them) they add 33,000,000 characters; at most "
        "32,000,000 are allowed (MAX_REPEATED). Fix: hold each list or dict in one place"
    )


def test_unshared_data_adds_nothing_whatever_its_size() -> None:
    big = {"role": "user", "content": "hi", "metadata": [["z" * 1_000_000] for _ in range(40)]}
    assert _measure(big).repeated == 0
    assert len(ck.Conversation.from_messages([big])) == 1


def _unshared(data: Any) -> Any:
    return json.loads(json.dumps(data))  # JSON never shares: every place gets its own object


def test_modest_sharing_is_taken_and_counted_exactly() -> None:
    """A point used twice in arguments, one property schema used by several tools: rendered by the template."""
    point = {"lat": 48.85, "lon": 2.35}
    arguments = {"from": point, "to": point, "stops": [point, point, point]}
    prop = {"type": "string", "description": "A city name."}
    parameters = {"type": "object", "properties": {"city": prop, "near": prop}, "required": ["city"]}
    tools = [tool(parameters, "weather"), tool(parameters, "traffic")]
    messages = [USER, call_message(arguments), {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    before = copy.deepcopy(messages)  # deepcopy keeps the sharing
    counter = qwen3()
    tokens = counter.count(messages, tools=tools)
    assert tokens == counter.reference_count(messages, tools=tools)
    fresh = ck.HFChatTemplateCounter(hf_tokenizer("qwen2"), chat_template=template("Qwen-Qwen3-0.6B"), name="q")
    assert tokens == fresh.count(_unshared(messages), tools=_unshared(tools))
    fit = ck.ContextKeeper(counter, context_window=4096).fit(messages, tools=tools, max_tokens=64)
    assert fit.tokens == tokens
    assert fit.messages == _unshared(messages)
    assert messages == before
    assert messages[1]["tool_calls"][0]["function"]["arguments"]["to"] is point


# ---------------------------------------------------------------------------- the walkers, against references


def test_the_fast_walkers_agree_with_their_references_on_shared_data() -> None:
    point = {"a": [1, 2]}
    samples: list[Any] = [
        {"x": point, "y": point},
        [point, [point]],
        {"deep": [[point]] * 3},
        {"k": ("t", point), "j": point},
        bomb(12),
    ]
    for value in samples:
        assert _clean(value, 100) is _clean_reference(value, 100) is False  # shared: the careful pass decides
        assert find_problem(value, 100) is None  # modest: nothing to refuse
        fast, reference = _copy(value), _copy_reference(value)
        assert fast == reference == value
    # The copy of shared data shares as the input does (one object per object), instead of one per path.
    shared = bomb(40)
    copied = _copy(shared)
    assert copied is not shared
    assert copied[0] is copied[1]


def test_a_wrapped_call_with_a_reference_bomb_is_refused_before_it_is_recorded() -> None:
    # The transcript writes the caller's messages ahead of the fit: that write must not follow 2**40 paths.
    bomb: Any = "x"
    for _ in range(40):
        bomb = [bomb, bomb]
    keeper = ck.ContextKeeper("mistral:tekken", context_window=400)
    sent: list[Any] = []
    chat = keeper.wrap(lambda messages, max_tokens=10: sent.append(messages) or "ok")
    started = time.monotonic()
    with pytest.raises(ck.MessageError, match="cannot record this call: metadata"):
        chat([{"role": "user", "content": "hi", "metadata": bomb}], max_tokens=10)
    assert time.monotonic() - started < 2.0
    assert not sent  # nothing reached the model
    assert chat([{"role": "user", "content": "hi"}], max_tokens=10) == "ok"
    assert len(keeper.transcript.entries()) == 1
