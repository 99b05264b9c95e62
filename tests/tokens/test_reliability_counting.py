"""Counting under hostile input, against the real tokenizers and templates: lone surrogates, chat templates that
never stop or fill memory, data nested without end, caches that would grow without bound, and cache keys that
ignore the order a template renders keys in.

Each section starts from the reproduction that failed before (a raw TypeError, a hang, a RecursionError, an
unbounded cache, a stale count); the newer APIs (``TemplateLimits``, the memo module) are imported inside the tests
that use them, so this file runs against the older code and shows exactly which reproductions fail there."""

from __future__ import annotations

import copy
import gc
import json
import os
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import contextkeeper as ck
from assets import ASSETS, template, tokenizer_dir
from conftest import hf_tokenizer
from conversations import TOOLS

QWEN3 = "Qwen-Qwen3-0.6B"
USER = {"role": "user", "content": "What is the weather in Paris?"}


def qwen3(**kwargs: Any) -> ck.HFChatTemplateCounter:
    return ck.HFChatTemplateCounter(hf_tokenizer("qwen2"), chat_template=template(QWEN3), name=QWEN3, **kwargs)


def with_template(source: str, **kwargs: Any) -> ck.HFChatTemplateCounter:
    return ck.HFChatTemplateCounter(hf_tokenizer("qwen2"), chat_template=source, name="hostile", **kwargs)


def nested(depth: int, leaf: Any = "x", key: str = "x") -> Any:
    """``{"x": {"x": ... leaf}}`` with ``depth`` dicts (built without recursion)."""
    value = leaf
    for _ in range(depth):
        value = {key: value}
    return value


def nested_list(depth: int) -> Any:
    value: Any = []
    for _ in range(depth - 1):
        value = [value]
    return value


# ------------------------------------------------------------------------------------ 1. lone surrogates


def test_lone_surrogate_in_content_is_refused_with_its_index_and_position() -> None:
    keeper = ck.ContextKeeper(str(tokenizer_dir("qwen2")), context_window=4096, chat_template=template(QWEN3))
    with pytest.raises(ck.InvalidMessage) as info:
        keeper.fit([{"role": "user", "content": "x\ud800"}], max_tokens=64)
    assert info.value.index == 0
    assert "content" in str(info.value)
    assert "character 1" in str(info.value)
    fix = info.value.fix_text()
    assert fix is not None
    assert "errors='replace'" in fix


def _assistant_call(arguments: Any, name: str = "get_weather") -> dict[str, Any]:
    return {
        "role": "assistant",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments}}],
    }


@pytest.mark.parametrize(
    ("messages", "index", "where", "position"),
    [
        ([{"role": "user", "content": "ok \udc80 then"}], 0, "content", 3),
        (
            [{"role": "user", "content": [{"type": "text", "text": "fine"}, {"type": "text", "text": "\ud800"}]}],
            0,
            "content[1].text",
            0,
        ),
        ([USER, _assistant_call('{"city": "Pa\udfffris"}')], 1, "tool_calls[0].function.arguments", 12),
        ([USER, _assistant_call({"city": "Par\ud801"})], 1, "tool_calls[0].function.arguments.city", 3),
        ([USER, _assistant_call({"ci\ud802ty": "Paris"})], 1, "tool_calls[0].function.arguments.'ci\\ud802ty'", 2),
        ([USER, _assistant_call("{}", name="get_\ud803weather")], 1, "tool_calls[0].function.name", 4),
        ([{"role": "user", "content": "hi", "name": "an\udbffa"}], 0, "name", 2),
        ([{"role": "user", "content": "hi", "metadata": {"trace": ["ok", "\ud800"]}}], 0, "metadata.trace[1]", 0),
    ],
    ids=[
        "content",
        "content-part",
        "json-arguments",
        "object-arguments",
        "argument-key",
        "call-name",
        "name",
        "metadata",
    ],
)
def test_lone_surrogates_are_refused_wherever_text_enters(
    messages: list[dict[str, Any]], index: int, where: str, position: int
) -> None:
    counter = qwen3()
    before = copy.deepcopy(messages)
    with pytest.raises(ck.InvalidMessage) as info:
        counter.count(messages, tools=TOOLS)
    assert info.value.index == index
    assert where in str(info.value)
    assert f"at character {position}" in str(info.value)
    assert messages == before


def test_an_escaped_lone_surrogate_in_json_arguments_is_refused_too() -> None:
    """Servers parse JSON-string arguments before templating: ``"\\ud800"`` there becomes a lone surrogate."""
    arguments = json.dumps({"city": "Paris\ud800"})  # ASCII text: the surrogate is an escape
    assert arguments.isascii()
    with pytest.raises(ck.InvalidMessage) as info:
        qwen3().count([USER, _assistant_call(arguments)])
    assert info.value.index == 1
    assert "\\\\ud800" in str(info.value)
    # A valid escaped pair (an emoji) is fine and counted exactly.
    emoji = json.dumps({"city": "Paris 🙂"})
    counter = qwen3()
    messages = [USER, _assistant_call(emoji), {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    assert counter.count(messages) == counter.reference_count(messages)


def test_lone_surrogate_in_a_tool_schema_names_the_tool() -> None:
    tools = copy.deepcopy(TOOLS)
    tools[1]["function"]["description"] = "Run a \ud800 query."
    with pytest.raises(ck.MessageError) as info:
        qwen3().count([USER], tools=tools)
    assert "tools[1] ('run_sql')" in str(info.value)
    assert "function.description" in str(info.value)
    keeper = ck.ContextKeeper(qwen3(), context_window=4096)
    with pytest.raises(ck.MessageError, match="run_sql"):
        keeper.fit([USER], tools=tools, max_tokens=64)


def test_the_mistral_counter_refuses_them_too() -> None:
    counter = ck.load_counter("mistral:tekken")
    with pytest.raises(ck.InvalidMessage, match="character 1"):
        counter.count([{"role": "user", "content": "x\ud800"}])
    tools = copy.deepcopy(TOOLS)
    tools[0]["function"]["name"] = "get_\udc00weather"
    with pytest.raises(ck.MessageError, match=r"tools\[0\] function\.name"):
        counter.count([USER], tools=tools)
    with pytest.raises(ck.MessageError):
        counter.text_tokens("bad \udfff")  # type: ignore[union-attr]


def test_text_counted_directly_is_checked_too() -> None:
    counter = qwen3()
    for count in (counter.count_text, counter.text_tokens):
        with pytest.raises(ck.MessageError, match="character 2"):
            count("ab\ud800")
    with pytest.raises(ck.MessageError):
        counter.text_tokens_many(["fine", "bad\udfff"])
    assert counter.text_tokens("fine 🙂") == len(hf_tokenizer("qwen2").encode("fine 🙂", add_special_tokens=False))


def test_a_template_that_writes_a_lone_surrogate_is_a_template_error() -> None:
    counter = with_template("{% for m in messages %}{{ m.content }}{% endfor %}{{ '\\ud800' }}")
    with pytest.raises(ck.ChatTemplateError, match="lone surrogate"):
        counter.count([USER])


# ------------------------------------------------------------------------------------ 2. bounded templates

# Each refused within about 2 s and without allocating the value it asks for.
HOSTILE = {
    "nested-loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "string-times-1e9": "{{ 'x' * 10**9 }}",
    "recursive-macro": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "doubling-concat": "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s~ns.s %}{% endfor %}",
    "doubling-plus": "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "list-doubling": "{% set ns = namespace(l=[1]) %}{% for i in range(40) %}{% set ns.l = ns.l + ns.l %}{% endfor %}",
    "list-times": "{{ (range(100000)|list) * 100000 }}",
    "50mb-output": "{% for i in range(50000) %}{{ 'x' * 1000 }}{% endfor %}",
    "big-pieces": "{% for i in range(1000) %}{{ 'x' * 30000000 }}{% endfor %}",
    "big-pieces-in-macro": "{% macro m() %}{% for i in range(999) %}{{ 'x' * 30000000 }}{% endfor %}{% endmacro %}"
    "{{ m() }}",
    "center-filter": "{{ 'x'|center(10**9) }}",
    "center-method": "{{ 'x'.center(10**9) }}",
    "format-width": "{{ '{:>999999999}'.format(1) }}",
    "percent-width": "{{ '%999999999d' % 1 }}",
    "huge-power": "{{ 2 ** 100000000 }}",
    "join-huge": "{{ range(100000)|map('string')|join('x' * 10000) }}",
    "replace-expand": "{{ ('x' * 1000000)|replace('x', 'y' * 100) }}",
    "lipsum": "{{ lipsum(10**6) }}",
    "slice-lazy": "{{ [1, 2, 3]|slice(10**9)|list|length }}",
    "batch-fill": "{% for row in [1]|batch(10**9, 0) %}{% endfor %}",
    "tojson-indent": "{{ {'a': [1, 2, 3]}|tojson(indent=10**8) }}",
    "split-many": "{{ ('a ' * 10000000).split()|length }}",
    "exponential-macro": "{% macro m(n) %}{% if n %}{{ m(n - 1) }}{{ m(n - 1) }}{% endif %}{% endmacro %}{{ m(40) }}",
    "wordwrap-quadratic": "{{ ('x' * 1000000)|wordwrap(1) }}",
    "sort-in-loop": "{% for i in range(100000) %}{% set x = range(100000)|list|sort %}{% endfor %}",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_templates_are_refused_quickly(name: str) -> None:
    counter = with_template(HOSTILE[name])
    tracemalloc.start()
    started, cpu = time.monotonic(), time.thread_time()
    try:
        with pytest.raises(ck.ChatTemplateError) as info:
            counter.count([USER])
        elapsed, used = time.monotonic() - started, time.thread_time() - cpu
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # The time bound is 2 s of the rendering thread's CPU (tracing slows Python down); a busy machine stretches the
    # wall time, not the CPU time.
    assert used < 6.0, f"{name} used {used:.1f} s of CPU"
    assert elapsed < 60.0, f"{name} took {elapsed:.1f} s"
    assert peak < 256 * 1024 * 1024, f"{name} held {peak / 2**20:.0f} MiB"
    exceeded = info.value
    if name == "huge-power":  # no bound to raise: Python cannot print such an integer, on the server either
        assert "4,300 digits" in str(exceeded)
        return
    assert getattr(exceeded, "bound", None) in ("steps", "output", "size", "nesting", "time"), str(exceeded)
    assert "Fix: raise template_limits." in str(exceeded)
    assert exceeded.fix_text() == exceeded.fix  # type: ignore[attr-defined]


def test_the_bound_says_which_setting_raises_it() -> None:

    with pytest.raises(ck.TemplateLimitExceeded) as info:
        with_template(HOSTILE["recursive-macro"]).count([USER])
    assert (info.value.bound, info.value.limit, info.value.setting) == ("nesting", 64, "template_limits.nesting")
    assert (
        info.value.fix == "raise template_limits.nesting (now 64) if this template is trusted, or use another template"
    )


def test_the_time_bound_counts_the_templates_own_work_not_the_wait_or_the_collector() -> None:
    """Under load an honest render can take seconds of wall time (other threads holding the GIL, a full garbage
    collection of a large heap in the middle of it): the bound is the thread's CPU time less its collections."""
    from contextkeeper.tokens import TemplateLimits

    heap = [(i, str(i)) for i in range(1_500_000)]  # a collection has a large heap to walk
    spent: list[float] = []

    def pause() -> str:
        started = time.monotonic()
        time.sleep(0.3)  # waiting: no CPU
        gc.collect()  # a full collection: CPU, but the collector's
        spent.append(time.monotonic() - started)
        return ""

    # The clock is read every few hundred steps and writes: enough messages after the pause that it is.
    source = "{% for m in messages %}{% if loop.first %}{{ pause() }}{% endif %}{{ m.content }}{% endfor %}"
    limits = TemplateLimits(seconds=0.25)
    counter = with_template(source, template_kwargs={"pause": pause}, template_limits=limits, incremental=False)
    assert counter.count([USER, *[{"role": "assistant", "content": "ok"}, USER] * 600]) > 0
    assert sum(spent) > limits.seconds  # the render took longer than its bound in wall time, and passed
    del heap
    busy = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    with pytest.raises(ck.TemplateLimitExceeded) as info:  # its own work is still bounded
        with_template(busy, template_limits=TemplateLimits(seconds=0.25, steps=10**9)).count([USER])
    assert info.value.bound == "time"


def test_limits_are_settings_on_the_counter_and_load_counter() -> None:
    from contextkeeper.tokens import TemplateLimits

    loop = "{% for i in range(5000) %}{{ i }} {% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(ck.TemplateLimitExceeded) as info:
        with_template(loop, template_limits=TemplateLimits(steps=1000)).count([USER])
    assert info.value.bound == "steps"
    assert info.value.setting == "template_limits.steps"
    assert with_template(loop).count([USER]) > 5000  # the defaults let it through
    tight = ck.load_counter(
        str(tokenizer_dir("qwen2")), chat_template=loop, template_limits=TemplateLimits(output_chars=4000)
    )
    with pytest.raises(ck.TemplateLimitExceeded, match=r"template_limits\.output_chars"):
        tight.count([USER])
    assert tight.fork().template_limits == TemplateLimits(output_chars=4000)
    for bad in ({"steps": 0}, {"seconds": -1.0}, {"nesting": True}, {"output_chars": 1.5}):
        with pytest.raises(ck.ConfigurationError, match="TemplateLimits"):
            TemplateLimits(**bad)
    with pytest.raises(ck.ConfigurationError, match="template_limits must be a TemplateLimits"):
        with_template(loop, template_limits={"steps": 10})  # type: ignore[arg-type]


def test_the_keeper_takes_template_limits_and_refuses_them_for_a_ready_counter() -> None:
    loop = "{% for i in range(5000) %}{{ i }} {% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    tight = ck.TemplateLimits(steps=1000)
    for tokenizer in (str(tokenizer_dir("qwen2")), hf_tokenizer("qwen2")):
        keeper = ck.ContextKeeper(tokenizer, context_window=4096, chat_template=loop, template_limits=tight)
        with pytest.raises(ck.TemplateLimitExceeded, match=r"template_limits\.steps"):
            keeper.fit([USER], max_tokens=16)
    with pytest.raises(ck.ConfigurationError, match="ready counter"):
        ck.ContextKeeper(qwen3(), context_window=4096, template_limits=tight)


@pytest.mark.parametrize("incremental", [True, False], ids=["message-by-message", "whole"])
def test_bounds_hold_on_every_render_path(incremental: bool) -> None:
    """A message loop the counter renders message by message (its body outputs remembered), and the same template
    rendered whole: a body that blows up only for one message is stopped either way, also after many counts."""
    source = (
        "{% for message in messages %}<|im_start|>{{ message.role }}\n"
        "{% if message.content == 'boom' %}{{ message.content * 10**9 }}{% endif %}"
        "{{ message.content }}<|im_end|>\n{% endfor %}"
    )
    counter = with_template(source, incremental=incremental)
    chat: list[dict[str, Any]] = []
    for turn in range(30):
        chat.append({"role": "user" if turn % 2 == 0 else "assistant", "content": f"turn {turn}"})
        assert counter.count(chat) == counter.reference_count(chat)
    if incremental:
        renderer = counter._renderers[source]
        assert renderer is not None
        assert renderer.reused > 0  # bodies remembered from earlier counts were reused
    with pytest.raises(ck.TemplateLimitExceeded) as info:
        counter.count([*chat, {"role": "user", "content": "boom"}])
    assert info.value.bound == "size"
    assert counter.count(chat) == counter.reference_count(chat)  # the counter still works after a refusal


def test_template_that_does_not_compile_is_refused_when_the_counter_is_built() -> None:
    with pytest.raises(ck.ChatTemplateError) as info:
        with_template("{% for m in messages %}")
    assert "does not compile: line 1" in str(info.value)
    assert info.value.template_message is not None
    assert "endfor" in info.value.template_message
    with pytest.raises(ck.ChatTemplateError, match="does not compile"):
        ck.ContextKeeper(str(tokenizer_dir("qwen2")), context_window=4096, chat_template="{{ messages[ }}")


@pytest.mark.parametrize("given", ["tok/qwen3", None, 42])
def test_a_counter_given_a_path_instead_of_a_tokenizer_says_how_to_load_one(given: Any) -> None:
    with pytest.raises(ck.ConfigurationError, match="needs a loaded Hugging Face tokenizer") as info:
        ck.HFChatTemplateCounter(given, chat_template=template(QWEN3))
    assert "load_counter(path)" in str(info.value)


def test_range_past_the_sandbox_limit_is_a_template_error() -> None:
    with pytest.raises(ck.ChatTemplateError) as info:
        with_template("{% for i in range(10**9) %}{% endfor %}").count([USER])
    assert "MAX_RANGE" in str(info.value)


def test_str_format_goes_through_the_sandbox() -> None:
    """``str.format`` may not read attributes past the sandbox (as in transformers, which refuses this)."""
    with pytest.raises(ck.ChatTemplateError):
        with_template("{{ '{0.__class__.__mro__}'.format(messages) }}").count([USER])


def test_every_vendored_template_renders_a_long_chat_well_inside_the_default_bounds() -> None:
    """All the templates llama.cpp vendors, over a 300-message agent chat with tools (about 90,000 tokens) or a
    plain chat where a template refuses that shape: each uses under a tenth of each bound (time: under half)."""
    sys.path.insert(0, str(ASSETS.parents[1] / "benchmarks"))
    from agent_conversation import TOOLS as AGENT_TOOLS
    from agent_conversation import build

    from contextkeeper.messages import Conversation, server_view
    from contextkeeper.tokens import _sandbox
    from contextkeeper.tokens.hf import _template_message, detect_content_format

    agent = build(300)
    plain_chat = [{"role": "system", "content": "Be brief."}] + [
        {"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 100 + str(i)} for i in range(300)
    ]
    chats = [(agent, AGENT_TOOLS), (agent, None), (plain_chat, None), (plain_chat[1:], None)]
    views: dict[tuple[int, str], list[dict[str, Any]]] = {}
    limits = _sandbox.DEFAULT_LIMITS
    worst: dict[str, float] = {"steps": 0.0, "output": 0.0, "time": 0.0, "nesting": 0.0}
    rendered = 0
    for path in sorted((ASSETS / "templates").glob("*.jinja")):
        source = path.read_text(encoding="utf-8")
        compiled = _sandbox.compile_template(source)
        fmt = detect_content_format(source)
        for number, (messages, tools) in enumerate(chats):
            if (number, fmt) not in views:
                shaped = server_view(Conversation.from_messages(messages), content_format=fmt)[0]
                views[number, fmt] = [_template_message(m) for m in shaped]
            plain = views[number, fmt]
            budget = _sandbox._Budget(limits)
            token = _sandbox._CURRENT.set(budget)
            started = time.monotonic()
            try:
                compiled.render(
                    messages=plain, tools=tools, add_generation_prompt=True, bos_token="<s>", eos_token="</s>"
                )
            except ck.TemplateLimitExceeded:
                raise
            except Exception:  # this template refuses this conversation shape: try the next
                continue
            finally:
                _sandbox._CURRENT.reset(token)
            elapsed = time.monotonic() - started
            worst["steps"] = max(worst["steps"], budget.steps / limits.steps)
            worst["output"] = max(worst["output"], budget.written / limits.output_chars)
            worst["time"] = max(worst["time"], elapsed / limits.seconds)
            worst["nesting"] = max(worst["nesting"], budget.deepest / limits.nesting)
            rendered += 1
            break
    assert rendered >= 65
    assert worst["steps"] < 0.1, worst
    assert worst["output"] < 0.1, worst
    assert worst["nesting"] < 0.25, worst
    assert worst["time"] < 0.5, worst


# ---------------------------------------------------------------------------------------- 11. deep nesting


def test_metadata_nested_500_deep_is_a_message_error_with_the_depth() -> None:
    keeper = ck.ContextKeeper(qwen3(), context_window=4096)
    messages = [USER, {"role": "user", "content": "x", "metadata": nested(500)}]
    with pytest.raises(ck.InvalidMessage) as info:
        keeper.fit(messages, max_tokens=64)
    assert info.value.index == 1
    assert "metadata" in str(info.value)
    assert "nested 501 levels deep; at most 100 are allowed" in str(info.value)


def test_content_lists_2000_deep_are_a_message_error() -> None:
    with pytest.raises(ck.InvalidMessage) as info:
        qwen3().count([{"role": "user", "content": nested_list(2000)}])
    assert info.value.index == 0
    assert "content: data nested 2001 levels deep" in str(info.value)


@pytest.mark.parametrize(
    "message",
    [
        _assistant_call(nested(300)),
        {"role": "user", "content": [{"type": "text", "text": "x", "cache_control": nested(300)}]},
        {"role": "user", "content": "x", "extra": [nested_list(300)]},
    ],
    ids=["object-arguments", "part-extra", "list-extra"],
)
def test_deep_data_anywhere_in_a_message_is_refused(message: dict[str, Any]) -> None:
    for shape in (message, _Mapping(message)):  # a plain dict, and another Mapping (copied differently)
        with pytest.raises(ck.InvalidMessage, match="levels deep; at most 100"):
            qwen3().count([USER, shape] if message["role"] == "assistant" else [shape])
    with pytest.raises(ck.InvalidMessage, match="levels deep"):
        ck.Message.from_dict(message)


def test_nesting_up_to_the_limit_is_accepted_and_counted_exactly() -> None:
    from contextkeeper.messages import MAX_DEPTH

    # The message, its tool_calls list, the call and its function: 4 levels above the arguments' own.
    arguments = nested(MAX_DEPTH - 4, leaf="deep")
    messages = [USER, _assistant_call(arguments), {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    counter = qwen3()
    assert counter.count(messages) == counter.reference_count(messages)
    with pytest.raises(ck.InvalidMessage, match="101 levels deep"):
        counter.count([USER, _assistant_call(nested(MAX_DEPTH - 3, leaf="deep"))])


def test_deep_tool_schemas_name_the_tool() -> None:
    tools = copy.deepcopy(TOOLS)
    tools[0]["function"]["parameters"]["properties"]["city"]["items"] = nested(400)
    with pytest.raises(ck.MessageError) as info:
        qwen3().count([USER], tools=tools)
    assert "tools[0] ('get_weather')" in str(info.value)
    assert "levels deep; at most 100" in str(info.value)


class _Mapping(dict):  # type: ignore[type-arg]
    """A Mapping that is not a plain dict (the other input path)."""


# ------------------------------------------------------------------------------- 13. caches bounded in bytes


@pytest.fixture
def small_cache() -> Iterator[int]:
    """A small shared cache budget for one test (restored after)."""
    from contextkeeper import _memo

    limit = 1024 * 1024
    _memo.set_cache_bytes(limit)
    try:
        yield limit
    finally:
        _memo.set_cache_bytes(None)


_FILLER = "the upstream service returned an error after the timeout was reached and the retry budget ran out. "


def _distinct_chat(seed: int, turns: int = 12, size: int = 2000) -> list[dict[str, Any]]:
    """A chat whose every message is text no other chat has (its words mostly shared, so tokenizing is quick)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": f"Assistant number {seed}."}]
    for turn in range(turns):
        text = f"chat {seed} turn {turn}: " + _FILLER * (size // len(_FILLER))
        messages.append({"role": "user" if turn % 2 == 0 else "assistant", "content": text})
    return messages


def fresh(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """New dicts with the same content (nothing any cache has seen), for an independent reference count."""
    return json.loads(json.dumps(messages))  # type: ignore[no-any-return]


def test_counting_far_more_text_than_the_budget_holds_stays_within_it(small_cache: int) -> None:
    """About 8 MB of distinct text through one counter with a 1 MiB budget: the caches' own accounting never
    passes the budget, the memory they hold (tracemalloc) stays within it plus a margin, and counts stay exact."""
    from contextkeeper import _memo

    counter = qwen3()
    counter.count(_distinct_chat(-1))  # warm: the tokenizer's own buffers are not caches
    gc.collect()
    tracemalloc.start()
    base, _ = tracemalloc.get_traced_memory()
    fed = 0
    try:
        for seed in range(320):
            chat = _distinct_chat(seed)
            fed += sum(len(m["content"]) for m in chat)
            count = counter.count(chat)
            if seed % 60 == 0:
                assert count == counter.reference_count(fresh(chat))
            usage = _memo.cache_usage()
            assert usage.held <= small_cache, usage
            del chat
        gc.collect()
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert fed > 7 * small_cache
    assert held - base < 1.5 * small_cache, f"{(held - base) / 2**20:.2f} MiB held for a 1 MiB budget"
    assert _memo.cache_usage().held > small_cache / 4  # the caches are in use, not emptied


def test_a_keeper_fitting_many_distinct_chats_stays_within_the_budget(small_cache: int) -> None:
    from contextkeeper import _memo

    keeper = ck.ContextKeeper(qwen3(), context_window=2048)
    for seed in range(40):
        chat = _distinct_chat(seed, turns=16, size=600)
        fit = keeper.fit(chat, max_tokens=256)
        assert fit.tokens == keeper.counter.reference_count(fit.messages)  # type: ignore[attr-defined]
        assert _memo.cache_usage().held <= small_cache


def test_memo_matches_the_reference_lru() -> None:
    """The fast memo against the obvious byte-bounded LRU (see the next test for random runs): with room for
    everything they hold the same entries; a hit returns what was put."""
    from contextkeeper._memo import Memo, ReferenceLRU

    memo: Memo[str, int] = Memo("test.memo")
    reference: ReferenceLRU[str, int] = ReferenceLRU(1 << 30)
    for i in range(500):
        memo.put(f"key {i}", i)
        reference.put(f"key {i}", i)
    assert {k for k, _ in memo.items()} == set(reference.keys())
    assert memo.nbytes == reference.nbytes
    assert all(memo.get(f"key {i}") == reference.get(f"key {i}") == i for i in range(500))


_KEYS = st.text(alphabet="abcdef", min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["put", "get", "pop", "put_many"]), _KEYS, st.integers(min_value=0, max_value=10**6)),
        max_size=300,
    ),
    st.integers(min_value=2_000, max_value=40_000),
    st.booleans(),
)
def test_memo_is_a_correct_cache_within_its_budget(ops: list[tuple[str, str, int]], limit: int, keyed: bool) -> None:
    from contextkeeper import _memo

    sizer = _memo.text_key_size if keyed else _memo.text_entry_size  # the first is inlined in put_many
    _memo.set_cache_bytes(limit)
    try:
        memo: _memo.Memo[str, int] = _memo.Memo("test.random", sizer=sizer)
        reference: _memo.ReferenceLRU[str, int] = _memo.ReferenceLRU(limit, sizer=sizer)
        truth: dict[str, int] = {}
        for op, key, value in ops:
            if op == "put":
                memo.put(key, value)
                reference.put(key, value)
                truth[key] = value
            elif op == "put_many":  # a batch, with a key repeated in it
                batch = [(key, value), (key + "z", value + 1), (key, value + 2)]
                memo.put_many(batch)
                for batch_key, batch_value in batch:
                    reference.put(batch_key, batch_value)
                    truth[batch_key] = batch_value
            elif op == "pop":
                memo.pop(key)
                reference.pop(key)
                truth.pop(key, None)
            else:
                got, expected = memo.get(key), reference.get(key)
                assert got is None or got == truth[key]  # never a stale or wrong value
                assert expected is None or expected == truth[key]
            held = _memo.cache_usage().held
            assert held <= limit
            assert memo.nbytes == sum(sizer(k, v) + _memo.ENTRY_OVERHEAD for k, v in memo.items())
            assert all(truth[k] == v for k, v in memo.items())
            assert reference.nbytes <= limit
    finally:
        _memo.set_cache_bytes(None)


def test_memo_under_threads_keeps_its_accounting() -> None:
    from contextkeeper import _memo

    _memo.set_cache_bytes(256 * 1024)
    try:
        memo: _memo.Memo[str, int] = _memo.Memo("test.threads")
        errors: list[BaseException] = []

        def work(worker: int) -> None:
            try:
                for i in range(3000):
                    key = f"{worker}:{i % 700}:" + "x" * (i % 50)
                    memo.put(key, i)
                    found = memo.get(key)
                    assert found is None or found == i  # only this thread writes its keys
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors
        assert memo.nbytes == sum(_memo.text_entry_size(k, v) + _memo.ENTRY_OVERHEAD for k, v in memo.items())
        assert _memo.cache_usage().held <= 256 * 1024
    finally:
        _memo.set_cache_bytes(None)


def test_an_identity_memo_measures_each_entry_once_and_accounts_for_it_exactly() -> None:
    from contextkeeper import _memo

    _memo.set_cache_bytes(64 * 1024)  # generations of 16 KiB: reading old entries moves them to the newest
    try:
        measured: list[int] = []

        def sizer(obj: list[int], value: str) -> int:
            measured.append(len(obj))
            return 8 * len(obj) + len(value)

        memo: _memo.IdentityMemo[list[int], str] = _memo.IdentityMemo("test.identity", sizer=sizer)
        objs = [[i] * (1 + i % 5) for i in range(300)]
        memo.put_many((obj, "v" * len(obj)) for obj in objs[:150])
        for obj in objs[150:]:
            memo.put(obj, "v" * len(obj))
        assert len(measured) == 300
        for _ in range(3):  # many conversations read in turn: old entries move forward
            found = [memo.get(obj) for obj in objs]
            assert all(f is None or f == "v" * len(o) for f, o in zip(found, objs, strict=True))
        assert len(measured) == 300  # a move is charged what the put measured, not measured again
        kept = [(obj, memo.get(obj)) for obj in objs]
        assert memo.nbytes == sum(sizer(o, v) + _memo.ENTRY_OVERHEAD for o, v in kept if v is not None)
        assert _memo.cache_usage().held <= 64 * 1024
    finally:
        _memo.set_cache_bytes(None)


def test_memoize_remembers_results_within_the_budget_none_included() -> None:
    from contextkeeper import _memo

    calls: list[str] = []

    @_memo.memoize("test.memoize", sizer=_memo.text_entry_size)
    def looked_up(name: str) -> str | None:
        calls.append(name)
        return None if name == "missing" else name.upper()

    assert [looked_up("a"), looked_up("a"), looked_up("missing"), looked_up("missing")] == ["A", "A", None, None]
    assert calls == ["a", "missing"]  # a None result is remembered too (a memo's None is a miss)
    assert looked_up.memo.nbytes > 0  # type: ignore[attr-defined]


def test_a_collected_memo_gives_its_bytes_back() -> None:
    from contextkeeper import _memo

    before = _memo.cache_usage().held
    memo: _memo.Memo[str, int] = _memo.Memo("test.dropped")
    for i in range(1000):
        memo.put(f"entry {i}", i)
    assert _memo.cache_usage().held >= before + memo.nbytes
    del memo
    gc.collect()
    assert _memo.cache_usage().held <= before


def test_data_size_is_an_upper_bound_of_what_the_data_holds() -> None:
    """The fast sizer (no bookkeeping of what it counted) never says less than the careful walk, and for
    validated messages it is within a margin of what tracemalloc sees them take."""
    from contextkeeper._memo import approx_size, data_size

    chat = _distinct_chat(7, turns=6, size=300)
    conversation = ck.Conversation.from_messages(chat)
    for value in (chat, conversation.messages, {"k": [1, 2.5, None, True, "text"]}, ("a", ["b", {"c": "d"}])):
        assert data_size(value) >= approx_size(value)
    texts = [f"message {i} " * 20 for i in range(1000)]
    gc.collect()
    tracemalloc.start()
    messages = [ck.Message.model_validate({"role": "user", "content": text}) for text in texts]
    taken, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    accounted = sum(data_size(message) - sys.getsizeof(text) for message, text in zip(messages, texts, strict=True))
    assert 0.8 * taken <= accounted <= 1.5 * taken, (taken, accounted)


def test_the_budget_is_one_setting() -> None:
    from contextkeeper import _memo

    assert _memo.cache_bytes() == 256 * 1024 * 1024
    assert _memo.set_cache_bytes("64MiB") == 64 * 1024 * 1024
    assert _memo.set_cache_bytes(None) == 256 * 1024 * 1024
    with pytest.raises(ck.ConfigurationError, match="CONTEXTKEEPER_CACHE_BYTES"):
        _memo.set_cache_bytes("lots")
    with pytest.raises(ck.ConfigurationError):
        _memo.set_cache_bytes(-1)
    env = {**os.environ, "CONTEXTKEEPER_CACHE_BYTES": "32 MiB"}
    shown = subprocess.run(
        [sys.executable, "-c", "from contextkeeper import _memo; print(_memo.cache_bytes())"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert shown.stdout.strip() == str(32 * 1024 * 1024)


# ------------------------------------------------------------------------------ 18. order-true cache keys


def _reordered(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same schemas with every object's keys in reverse order (equal to the originals under ``==``)."""

    def flip(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: flip(value[key]) for key in reversed(list(value))}
        if isinstance(value, list):
            return [flip(item) for item in value]
        return value

    return [flip(tool) for tool in tools]


def test_tools_in_another_key_order_are_counted_as_rendered() -> None:
    # A dialect that hands the template the schemas as sent (vLLM's dumps each function in its own key order).
    counter = qwen3(server="transformers")
    messages = [USER]
    reordered = _reordered(TOOLS)
    assert reordered == TOOLS  # equal for Python ...
    first = counter.count(messages, tools=TOOLS)
    second = counter.count(messages, tools=reordered)
    assert first == counter.reference_count(messages, tools=TOOLS)
    assert second == counter.reference_count(messages, tools=reordered)  # ... rendered (and counted) apart
    assert "Current weather" in counter.render(messages, tools=reordered).split('"name"')[0]
    keeper = ck.ContextKeeper(qwen3(server="transformers"), context_window=4096)
    assert keeper.fit(messages, tools=TOOLS, max_tokens=64).tokens == first
    assert keeper.fit(messages, tools=reordered, max_tokens=64).tokens == second


def test_object_arguments_reordered_in_place_are_counted_again() -> None:
    """A caller that edits its message dicts in place (object arguments given the other key order, or 1 for
    True) gets the count of what the template renders now, not of what it rendered before."""
    counter = qwen3()
    call = _assistant_call({"city": "Paris", "unit": "celsius", "days": 1})
    messages = [USER, call, {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    first = counter.count(messages)
    assert first == counter.reference_count(fresh(messages))
    arguments = call["tool_calls"][0]["function"]["arguments"]
    call["tool_calls"][0]["function"]["arguments"] = {key: arguments[key] for key in reversed(list(arguments))}
    assert counter.count(messages) == counter.reference_count(fresh(messages))
    assert counter.render(messages).index('"days"') < counter.render(messages).index('"city"')
    call["tool_calls"][0]["function"]["arguments"]["days"] = True  # 1 == True in Python, not in the prompt
    assert counter.count(messages) == counter.reference_count(fresh(messages))
    assert '"days": true' in counter.render(messages)


def test_equal_message_objects_with_reordered_arguments_are_not_confused() -> None:
    counter = qwen3()
    make = lambda arguments: [  # noqa: E731
        ck.Message.from_dict(USER),
        ck.Message.from_dict(_assistant_call(arguments)),
        ck.Message.from_dict({"role": "tool", "tool_call_id": "c1", "content": "sunny"}),
    ]
    forward, backward = make({"a": "first", "b": "second"}), make({"b": "second", "a": "first"})
    assert forward == backward
    assert counter.count(forward) == counter.reference_count(forward)
    assert counter.count(backward) == counter.reference_count(backward)
    assert counter.render(backward).index('"b"') < counter.render(backward).index('"a"')


def test_metadata_reordered_in_place_reaches_a_template_that_renders_it() -> None:
    """Unknown keys reach the template in the raw view; one that writes each message whole sees their order."""
    source = "{% for m in messages %}<|im_start|>{{ m|tojson }}<|im_end|>{% endfor %}"
    counter = with_template(source, view="raw")
    message = {"role": "user", "content": "hi", "metadata": {"alpha": 1, "beta": [1, 2]}}
    messages = [message]
    before = counter.render(messages)
    message["metadata"] = {"beta": [1, 2], "alpha": 1}
    after = counter.render(messages)
    assert after != before
    assert after.index("beta") < after.index("alpha")
    assert counter.count(messages) == counter.count_text(after)
