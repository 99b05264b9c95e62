"""Every fast path of contextkeeper.messages against its slow reference, and the parse memo's guarantees.

Each fast path in ``messages.py`` keeps a plain reference with the same signature beside it (``to_dict`` /
``_to_dict_reference``, ``server_view_message`` / ``_server_view_message_reference``, ``_copy`` /
``_copy_reference``, ``_free_form`` / ``_free_form_reference``, ``_clean`` / ``_clean_reference``,
``_parse_message`` (the memo) / ``_parse_message_reference``, and ``Conversation(previous=...)`` / a fresh
``Conversation``). The properties below hold them equal, type- and key-order-true, on generated messages of
every role and shape. The default run is a fixed set of examples (derandomised, so CI is repeatable);
``pytest -m slow`` runs fresh random ones.

The parse memo (``messages.parsed``) is checked for what a shared, process-wide cache must guarantee: right
answers from many threads at once, a byte bound it keeps, and no stale answer for a dict changed in place.
"""

from __future__ import annotations

import copy
import json
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contextkeeper import _memo
from contextkeeper._exceptions import InvalidMessage, MessageError
from contextkeeper._memo import IdentityMemo, cache_usage, same_values, set_cache_bytes
from contextkeeper.messages import MAX_DEPTH, Conversation, Message, check_tools, server_view_message
from contextkeeper.messages.guard import _ENDLESS, _clean, _clean_reference, _depth
from contextkeeper.messages.models import (
    _PARSED,
    _copy,
    _copy_reference,
    _free_form,
    _free_form_reference,
    _parse_message,
    _parse_message_reference,
    _TooDeep,
    _Uncopyable,
)
from contextkeeper.messages.views import _server_view_message_reference

_FIXED = {"derandomize": True, "deadline": None, "database": None}
_CHECKS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]


def _settings(examples: int) -> Callable[[Any], Any]:
    return settings(max_examples=examples, suppress_health_check=_CHECKS, **_FIXED)


def _random(examples: int) -> Callable[[Any], Any]:
    return settings(max_examples=examples, deadline=None, suppress_health_check=_CHECKS)


# ---------------------------------------------------------------------------------------------- generators

_SAMPLES = [
    "",
    " ",
    "hello",
    "你好，世界",
    "日本語のテキスト",
    "مرحبا بالعالم",
    "שלום",
    "🌍🎉 👩‍👩‍👧‍👦 🏳️‍🌈",
    "naïve café",
    "a\nb\tc\r\n",
    '{"json": [1, 2]}',
    "\u200b\u00a0",
    "{{ not a template }}",
]
text = st.one_of(st.sampled_from(_SAMPLES), st.text(st.characters(exclude_categories=("Cs",)), max_size=16))
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), text)
json_value = st.recursive(
    json_leaf, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3), max_leaves=8
)
_EXTRA_KEYS = ["metadata", "x_trace", "cache_control", "weight", "reasoning", "prefix", "日本", "🔑"]
extras = st.dictionaries(st.sampled_from(_EXTRA_KEYS), json_value, max_size=2)


@st.composite
def parts(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(
        st.sampled_from(["text", "input_text", "refusal", "image_url", "input_audio", "file", "image", "unknown"])
    )
    part: dict[str, Any]
    if kind in ("text", "input_text"):
        part = {"type": kind, "text": draw(text)}
    elif kind == "refusal":
        part = {"type": "refusal", "refusal": draw(text)} if draw(st.booleans()) else {"type": "refusal"}
    elif kind == "image_url":
        image_url: dict[str, Any] = {"url": draw(text)}
        if draw(st.booleans()):
            image_url["detail"] = draw(st.sampled_from(["low", "high", "auto", None]))
        part = {"type": "image_url", "image_url": image_url}
    elif kind == "input_audio":
        part = {
            "type": "input_audio",
            "input_audio": {"data": draw(text), "format": draw(st.sampled_from(["wav", "mp3"]))},
        }
    elif kind == "file":
        part = {
            "type": "file",
            "file": draw(st.sampled_from([{"file_id": "file-1"}, {"file_data": "AA", "filename": "a"}])),
        }
    elif kind == "image":
        part = {"type": "image", "url": draw(text)}
    else:
        part = {"type": draw(st.sampled_from(["x_custom", "thinking", "video"])), "payload": draw(json_value)}
    if draw(st.integers(0, 3)) == 0:
        part.update(draw(extras))
    return part


content = st.one_of(text, st.none(), st.lists(parts(), max_size=4))


@st.composite
def tool_calls(draw: st.DrawFn, prefix: str) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []
    for k in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from(["search", "get_weather", "天気", "book"]))
        arguments = draw(st.dictionaries(text, json_value, max_size=3))
        shape = draw(st.sampled_from(["openai", "openai-bare", "hf", "flat"]))
        call: dict[str, Any]
        if shape.startswith("openai"):
            # Mostly JSON; also text that is not JSON and "", which servers take (and render as {}).
            given = draw(st.sampled_from([json.dumps(arguments, ensure_ascii=False), json.dumps(arguments), "{no", ""]))
            call = {"id": f"{prefix}{k}", "type": "function", "function": {"name": name, "arguments": given}}
            if shape == "openai-bare":
                del call["type"]
        elif shape == "hf":
            call = {"type": "function", "function": {"name": name, "arguments": arguments}}
        else:
            call = {"name": name, "arguments": arguments}
        if draw(st.integers(0, 4)) == 0:
            call["index"] = k  # an unknown key, as streaming clients send
        calls.append(call)
    return calls


@st.composite
def messages(draw: st.DrawFn, role: str | None = None, prefix: str = "call_") -> dict[str, Any]:
    """One valid message of any role and shape, keys in a random order."""
    role = role or draw(st.sampled_from(["system", "developer", "user", "assistant", "tool"]))
    message: dict[str, Any] = {"role": role}
    if draw(st.integers(0, 5)):
        message["content"] = draw(content)
    if draw(st.integers(0, 4)) == 0:
        message["name"] = draw(st.one_of(text, st.none()))
    if role == "tool" and draw(st.integers(0, 3)):
        message["tool_call_id"] = draw(st.one_of(st.just(f"{prefix}0"), st.none()))
    if role == "assistant":
        for key in ("reasoning_content", "thinking"):
            if draw(st.integers(0, 3)) == 0:
                message[key] = draw(st.one_of(text, st.none()))
        how = draw(st.integers(0, 5))
        if how == 1:
            message["tool_calls"] = draw(st.sampled_from([[], None]))
        elif how >= 3:
            message["tool_calls"] = draw(tool_calls(prefix))
    message.update(draw(extras))
    if draw(st.booleans()):
        message = dict(reversed(list(message.items())))
    return message


# ------------------------------------------------------------------------------- fast paths vs references


def _check_to_dict(data: dict[str, Any]) -> None:
    message = Message.from_dict(data)
    fast = message.to_dict()
    assert same_values(fast, message._to_dict_reference())  # types and key order too
    assert fast == data


def _check_server_view(data: dict[str, Any]) -> None:
    message = Message.from_dict(data)
    for content_format in ("string", "openai"):
        fast = server_view_message(message, content_format=content_format)  # type: ignore[arg-type]
        reference = _server_view_message_reference(message, content_format=content_format)  # type: ignore[arg-type]
        assert same_values(fast, reference), content_format


def _check_free_form(data: dict[str, Any]) -> None:
    message = Message.from_dict(data)
    assert _free_form(message) is _free_form_reference(message)
    for part in message.content if isinstance(message.content, list) else ():
        assert _free_form(part) is _free_form_reference(part)
    for call in message.tool_calls or ():
        assert _free_form(call) is _free_form_reference(call)


def _check_parse(data: dict[str, Any]) -> None:
    first = _parse_message(data, 0)
    again = _parse_message(data, 0)  # from the memo
    reference = _parse_message_reference(copy.deepcopy(data), 0)
    for got in (first, again):
        _same_parse(got, reference)
    assert again[0] is first[0]


def _same_parse(got: tuple[Message, str, object], reference: tuple[Message, str, object]) -> None:
    assert same_values(got[0]._to_dict_reference(), reference[0]._to_dict_reference())
    assert got[1] == reference[1]
    assert type(got[2]) is type(reference[2])
    assert got[2] == reference[2]


def _check_message(data: dict[str, Any]) -> None:
    before = copy.deepcopy(data)
    _check_to_dict(data)
    _check_server_view(data)
    _check_free_form(data)
    _check_parse(data)
    assert same_values(data, before)  # nothing the caller gave is changed


@_settings(400)
@given(messages())
def test_to_dict_fast_path_equals_its_reference(data: dict[str, Any]) -> None:
    _check_to_dict(data)


@_settings(400)
@given(messages())
def test_server_view_fast_path_equals_its_reference(data: dict[str, Any]) -> None:
    _check_server_view(data)


@_settings(300)
@given(messages())
def test_free_form_fast_path_equals_its_reference(data: dict[str, Any]) -> None:
    _check_free_form(data)


@_settings(300)
@given(messages())
def test_parse_memo_equals_a_fresh_parse(data: dict[str, Any]) -> None:
    _check_parse(data)


# -------------------------------------------------------------------------------- copies, depth and text


class _Str(str):
    """A str subclass: not one of the scalars the fast copy passes through."""


_odd_leaf = st.one_of(
    json_leaf,
    st.binary(max_size=4),
    st.frozensets(st.integers(0, 3), max_size=2),
    text.map(_Str),
    st.just(threading.Lock),  # the class: copied as itself
)
wild = st.recursive(
    _odd_leaf,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(text, inner, max_size=3)
        | st.dictionaries(st.integers(0, 5), inner, max_size=2)
        | st.lists(inner, max_size=2).map(tuple)
    ),
    max_leaves=10,
)


@st.composite
def deep_specs(draw: st.DrawFn) -> tuple[list[str], Any, str]:
    """A chain of containers around a leaf, near the depth bound: built in the test, so that Hypothesis never
    prints hundreds of levels. The third item says whether to add a lone surrogate or an uncopyable value."""
    kinds = draw(st.lists(st.sampled_from(["list", "dict", "tuple", "intdict"]), min_size=1, max_size=4))
    levels = draw(st.integers(MAX_DEPTH - 3, MAX_DEPTH + 3))
    return [kinds[i % len(kinds)] for i in range(levels)], draw(_odd_leaf), draw(st.sampled_from(["", "lone", "lock"]))


def _build(spec: tuple[list[str], Any, str]) -> Any:
    kinds, value, extra = spec
    if extra == "lone":
        value = ["ok", "bad \ud800 text"]
    elif extra == "lock":
        value = threading.Lock()
    for kind in reversed(kinds):
        if kind == "list":
            value = [value]
        elif kind == "tuple":
            value = (value,)
        elif kind == "dict":
            value = {"k": value}
        else:
            value = {0: value}
    return value


def _outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "value", call()
    except (_TooDeep, _Uncopyable) as exc:
        return type(exc).__name__, None


def _containers(value: Any) -> Iterator[Any]:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, (dict, list)):
            yield item
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


def _check_copy(value: Any, depth: int) -> None:
    fast, reference = _outcome(lambda: _copy(value, depth)), _outcome(lambda: _copy_reference(value, depth))
    assert fast[0] == reference[0]
    if fast[0] == "value":
        assert same_values(fast[1], reference[1])
        assert same_values(fast[1], value)
        # A copy: no dict or list of the input is shared with it.
        assert not {id(c) for c in _containers(fast[1])} & {id(c) for c in _containers(value)}


@_settings(400)
@given(wild, st.integers(0, 3))
def test_copy_fast_path_equals_its_reference(value: Any, depth: int) -> None:
    _check_copy(value, depth)


@_settings(200)
@given(deep_specs(), st.integers(0, 2))
def test_copy_fast_path_equals_its_reference_at_the_depth_bound(spec: Any, depth: int) -> None:
    value = _build(spec)
    if spec[2] != "lone":  # a lone surrogate is text: the copy takes it, validation refuses it
        _check_copy(value, depth)


def _with_lone(value: Any, where: int) -> Any:
    """``value`` with a lone surrogate put into its ``where``-th string or key (if it has that many)."""
    seen = 0

    def walk(item: Any) -> Any:
        nonlocal seen
        if type(item) is str:
            seen += 1
            return item + "\udc80" if seen == where else item
        if type(item) is dict:
            out = {}
            for key, child in item.items():
                if type(key) is str:
                    seen += 1
                    key = "\ud83d" + key if seen == where else key
                out[key] = walk(child)
            return out
        if type(item) in (list, tuple):
            return type(item)(walk(child) for child in item)
        return item

    return walk(value)


@_settings(400)
@given(wild, st.integers(0, 6), st.integers(1, 6))
def test_clean_fast_path_equals_its_reference(value: Any, where: int, limit: int) -> None:
    value = _with_lone(value, where)
    assert _clean(value, limit) is _clean_reference(value, limit)


@_settings(100)
@given(deep_specs())
def test_clean_fast_path_equals_its_reference_at_the_depth_bound(spec: Any) -> None:
    value = _build(spec)
    assert _clean(value, MAX_DEPTH) is _clean_reference(value, MAX_DEPTH)


def _levels(value: Any) -> int:
    """The obvious recursive definition of nesting, for data that is small and has no cycles."""
    if isinstance(value, dict):
        return 1 + max(map(_levels, value.values()), default=0)
    if isinstance(value, (list, tuple)):
        return 1 + max(map(_levels, value), default=0)
    return 0


@_settings(300)
@given(wild)
def test_depth_is_the_plain_recursive_nesting(value: Any) -> None:
    depth, top = _depth(value)
    assert depth == _levels(value)
    children = (
        value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    )
    deepest = [key for key, child in children if _levels(child) and _levels(child) == depth - 1]
    assert top == (deepest[-1] if deepest else None)  # the last of the deepest, if any container is inside


def test_depth_of_shared_and_self_containing_data_is_quick() -> None:
    shared: Any = ["leaf"]
    for _ in range(80):  # 2**80 paths, 81 containers
        shared = [shared, shared]
    started = time.perf_counter()
    assert _depth(shared) == (81, 1)
    cycle: dict[str, Any] = {"a": 1}
    cycle["b"] = [cycle]
    assert _depth(cycle) == (_ENDLESS, "b")
    assert time.perf_counter() - started < 1.0


# ------------------------------------------------------------------ defects: data that no copy can take


def test_a_message_that_contains_itself_is_refused_not_looped_on() -> None:
    """Was an endless loop: the depth of a dict holding itself was measured for ever."""
    data: dict[str, Any] = {"role": "user", "content": "hi"}
    data["self"] = data
    inner: list[Any] = []
    inner.append((inner,))  # through a tuple, so the fast copy hands it to the reference
    for messages in ([data], [{"role": "user", "content": "hi", "meta": inner}]):
        with pytest.raises(InvalidMessage, match="contains itself, so it nests without end") as info:
            Conversation.from_messages(messages)
        assert info.value.index == 0
        assert "Fix: flatten the data" in str(info.value)
    schema: dict[str, Any] = {"type": "object"}
    schema["properties"] = {"next": schema}
    with pytest.raises(MessageError, match=r"tools\[0\] \('f'\) function: data that contains itself"):
        check_tools([{"type": "function", "function": {"name": "f", "parameters": schema}}])


def test_a_value_that_cannot_be_copied_is_a_typed_error() -> None:
    """Was a bare TypeError from copy.deepcopy ("cannot pickle '_thread.lock' object")."""
    lock = threading.Lock()
    data = {"role": "user", "content": "hi", "handle": lock}
    with pytest.raises(InvalidMessage, match=r"message 1: handle: holds a value that cannot be copied") as info:
        Conversation.from_messages([{"role": "system", "content": "s"}, data])
    assert info.value.index == 1
    assert "JSON-like data" in (info.value.fix_text() or "")
    assert data["handle"] is lock


def test_a_message_exactly_at_the_depth_bound_is_taken_whatever_its_leaves() -> None:
    """Was refused as "data nested 100 levels deep; at most 100 are allowed": the fast copy counted a leaf that
    is not a plain str or number (bytes, a str subclass) as one more level."""
    for leaf in (b"raw", _Str("text"), "plain"):
        value: Any = leaf
        for _ in range(MAX_DEPTH - 1):  # the message itself is the first level
            value = [value]
        assert len(Conversation([{"role": "user", "content": "x", "meta": value}])) == 1
        with pytest.raises(InvalidMessage, match="meta: data nested 101 levels deep; at most 100 are allowed"):
            Conversation([{"role": "user", "content": "x", "meta": [value]}])


# ------------------------------------------------------------------------------------- the parse memo


def _paths(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every container in ``value``, as the keys leading to it."""
    if isinstance(value, (dict, list)):
        yield path
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, child in items:
            yield from _paths(child, (*path, key))


def _at(value: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        value = value[key]
    return value


def _refusal_or(call: Callable[[], Any]) -> Any:
    """``call()``'s value, or the MessageError it raised."""
    try:
        return call()
    except MessageError as exc:
        return exc


@st.composite
def mutations(draw: st.DrawFn, data: dict[str, Any]) -> None:
    """Change ``data`` in place somewhere: a value set, a key removed, keys reordered, a number's type changed
    (1, 1.0 and True are equal in Python, not in a template), a list grown."""
    target = _at(data, draw(st.sampled_from(list(_paths(data)))))
    if isinstance(target, list):
        how = draw(st.sampled_from(["append", "set", "retype"] if target else ["append"]))
        if how == "append":
            target.append(draw(json_value))
            return
        index = draw(st.integers(0, len(target) - 1))
    else:
        if not target:
            target[draw(text)] = draw(json_value)
            return
        how = draw(st.sampled_from(["set", "delete", "reorder", "retype"]))
        index = draw(st.sampled_from(list(target)))
        if how == "delete":
            del target[index]
            return
        if how == "reorder":
            target[index] = target.pop(index)  # the key moves to the end, its value unchanged
            return
    if how == "retype" and type(target[index]) in (int, bool, float) and math.isfinite(target[index]):
        old = target[index]
        target[index] = draw(
            st.sampled_from([v for v in (int(old), float(old), bool(old)) if type(v) is not type(old)])
        )
        return
    target[index] = draw(st.one_of(json_value, text))


@_settings(400)
@given(messages(), st.data())
def test_a_dict_changed_in_place_is_parsed_again(data: dict[str, Any], draw: st.DataObject) -> None:
    """The memo answers for the very same dict object only while it equals the copy it was parsed from."""
    _parse_message(data, 0)
    draw.draw(mutations(data))
    reference = _refusal_or(lambda: _parse_message_reference(copy.deepcopy(data), 0))
    if isinstance(reference, MessageError):
        with pytest.raises(InvalidMessage) as info:
            _parse_message(data, 0)
        assert str(info.value) == str(reference)
        return
    _same_parse(_parse_message(data, 0), reference)


def test_a_dict_changed_in_place_is_parsed_again_examples() -> None:
    text_message = {"role": "user", "content": [{"type": "text", "text": "first"}]}
    arguments: dict[str, Any] = {"a": 1, "b": 2}
    call = {
        "role": "assistant",
        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": arguments}}],
    }
    chat = [text_message, call]
    assert Conversation(chat).to_dicts() == chat
    text_message["content"][0]["text"] = "second"  # type: ignore[index]
    assert Conversation(chat).to_dicts()[0]["content"][0]["text"] == "second"

    def rendered() -> Any:
        return Conversation(chat).to_dicts()[1]["tool_calls"][0]["function"]["arguments"]

    arguments["a"] = True  # equal to 1 in Python, but a template writes "true"
    assert type(rendered()["a"]) is bool
    arguments["a"] = 1.0  # and "1.0"
    assert type(rendered()["a"]) is float
    arguments["a"] = arguments.pop("a")  # the same items, another order: a template writes them in this one
    assert list(rendered()) == ["b", "a"]


def test_the_parse_memo_is_an_identity_memo_reported_by_cache_usage() -> None:
    assert isinstance(_PARSED, IdentityMemo)
    assert _PARSED.name == "messages.parsed"
    data = {"role": "user", "content": "counted " * 50}
    Conversation([data])
    assert _PARSED.get(data) is not None
    assert cache_usage().by_name.get("messages.parsed", 0) >= len(data["content"])


@pytest.fixture
def small_cache() -> Iterator[int]:
    limit = 256 * 1024
    set_cache_bytes(limit)
    try:
        yield limit
    finally:
        set_cache_bytes(None)


def _chat(seed: int, turns: int = 3) -> list[dict[str, Any]]:
    chat: list[dict[str, Any]] = [{"role": "system", "content": f"assistant {seed}"}]
    for turn in range(turns):
        chat.append({"role": "user", "content": f"question {seed}.{turn} " + "words " * 40, "metadata": {"n": turn}})
        chat.append({"role": "assistant", "content": f"answer {seed}.{turn} 你好 🌍"})
    return chat


def test_the_parse_memo_stays_inside_its_bound_under_many_conversations(small_cache: int) -> None:
    parsed = 0
    for seed in range(1500):
        chat = _chat(seed)
        assert Conversation(chat).to_dicts() == chat
        parsed += len(chat)
        usage = cache_usage()
        assert usage.held <= small_cache
        assert usage.by_name.get("messages.parsed", 0) <= small_cache
    assert 0 < len(_PARSED) < parsed  # used, and old conversations' entries were dropped to stay inside
    assert _PARSED.nbytes == cache_usage().by_name["messages.parsed"]


def test_threads_parse_shared_and_distinct_dicts_at_once(small_cache: int) -> None:
    """Four threads parse one shared chat and chats of their own (changed in place between parses), within a
    budget small enough that entries are dropped while they run; every parse is right."""
    shared = _chat(-1, turns=6)
    expected_shared = copy.deepcopy(shared)
    start = threading.Barrier(4)
    errors: list[BaseException] = []

    def work(worker: int) -> None:
        try:
            start.wait()
            own = _chat(worker * 10_000)
            for round_ in range(150):
                own[-1]["content"] = f"answer {worker} round {round_}"  # changed in place: parsed again
                own.append({"role": "user", "content": f"w{worker} r{round_} " + "pad " * (round_ % 30)})
                got = Conversation([*shared, *own]).to_dicts()
                assert got[: len(shared)] == expected_shared
                assert got[len(shared) :] == own
                assert got[-2]["content"] == f"answer {worker} round {round_}"
                own.pop()
                assert Conversation(own).to_dicts() == own
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[0]
    assert shared == expected_shared
    assert cache_usage().held <= small_cache


def test_identity_memo_answers_only_the_same_fresh_object(small_cache: int) -> None:
    memo: IdentityMemo[list[int], tuple[int, ...]] = IdentityMemo(
        "test.identity", sizer=lambda obj, value: 64 * len(value), fresh=lambda obj, value: tuple(obj) == value
    )
    a, b = [1, 2], [1, 2]
    memo.put(a, tuple(a))
    assert memo.get(a) == (1, 2)
    assert memo.get(b) is None  # equal, but not the same object
    a.append(3)
    assert memo.get(a) is None  # changed since: not fresh
    memo.put(a, tuple(a))
    assert memo.get(a) == (1, 2, 3)
    assert cache_usage().by_name["test.identity"] == memo.nbytes == 64 * 3 + _memo.ENTRY_OVERHEAD
    assert memo.pop(b) is None
    assert memo.pop(a) == (1, 2, 3)
    assert len(memo) == 0


# ------------------------------------------------------------------------------ conversations, grown


@st.composite
def chats(draw: st.DrawFn) -> list[dict[str, Any]]:
    """A valid conversation: system and user turns, assistant turns with their tool results."""
    chat: list[dict[str, Any]] = []
    kinds = draw(st.lists(st.sampled_from(["system", "developer", "user", "assistant"]), max_size=8))
    for turn, kind in enumerate(kinds):
        message = draw(messages(kind, prefix=f"call_{turn}_"))
        chat.append(message)
        calls = message.get("tool_calls") or []
        last = turn == len(kinds) - 1
        answered = draw(st.integers(0, len(calls))) if last else len(calls)
        for call in calls[:answered]:
            result = draw(messages("tool"))
            if "id" in call:
                result["tool_call_id"] = call["id"]
            else:
                result.pop("tool_call_id", None)
            chat.append(result)
    return chat


def _check_grown(chat: list[dict[str, Any]], cut: int, change: bool) -> None:
    cut = min(cut, len(chat))
    try:
        previous = Conversation(chat[:cut])
    except MessageError:
        return  # a cut inside a unit whose calls are unanswered: nothing to grow from
    if change and cut:
        chat[cut - 1]["x_changed"] = [1]  # changed in place since `previous` was built from it
    reference = _refusal_or(lambda: Conversation([copy.deepcopy(m) for m in chat]))
    if isinstance(reference, MessageError):
        with pytest.raises(MessageError) as info:
            Conversation(chat, previous=previous)
        assert (str(info.value), info.value.index) == (str(reference), reference.index)
        return
    grown = Conversation(chat, previous=previous)
    assert same_values(grown.to_dicts(), reference.to_dicts())
    assert grown.to_caller_format() == reference.to_caller_format() == chat
    assert [(u.kind, u.start, u.stop) for u in grown.units()] == [(u.kind, u.start, u.stop) for u in reference.units()]


@_settings(300)
@given(chats(), st.integers(0, 30), st.booleans())
def test_a_grown_conversation_equals_one_built_fresh(chat: list[dict[str, Any]], cut: int, change: bool) -> None:
    _check_grown(chat, cut, change)


# ------------------------------------------------------------------------------------------ fresh runs


@pytest.mark.slow
@_random(5_000)
@given(messages(), wild, st.integers(0, 3))
def test_messages_fast_paths_random_run(data: dict[str, Any], value: Any, depth: int) -> None:
    _check_message(data)
    _check_copy(value, depth)


@pytest.mark.slow
@_random(2_000)
@given(chats(), st.integers(0, 30), st.booleans())
def test_grown_conversations_random_run(chat: list[dict[str, Any]], cut: int, change: bool) -> None:
    _check_grown(chat, cut, change)
