"""Scans of the neighbouring messages up to the first that passes a test (Gemma 4's search for the previous
message that is not a tool result, and its writing of the results that follow a call) taken out of the loop
body: cut, and rendered exactly as the whole template renders, as chats grow, lose old turns and get results."""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import contextkeeper as ck
from assets import template
from conftest import hf_tokenizer
from contextkeeper.tokens._sandbox import compile_template
from contextkeeper.tokens.render import Refusal, split_template, try_split
from contextkeeper.tokens.render.ahead import Check
from contextkeeper.tokens.render.scans import FARTHEST

# Both of Gemma 4's scans, small: a model turn right after another is continued, and a call is followed by the
# results written in its own turn.
GEMMA_LIKE = (
    "{%- set ns = namespace(kind=none) -%}"
    "{%- for message in messages -%}"
    "{%- if message.role != 'tool' -%}"
    "{%- set prev = namespace(role=none, found=false) -%}"
    "{%- if loop.index0 > 0 -%}"
    "{%- for j in range(loop.index0 - 1, -1, -1) -%}"
    "{%- if not prev.found -%}{%- if messages[j].role != 'tool' -%}"
    "{%- set prev.role = messages[j].role -%}{%- set prev.found = true -%}"
    "{%- endif -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- if not (message.role == 'assistant' and prev.role == 'assistant') -%}<{{ message.role }}>{%- endif -%}"
    "{%- if message.tool_calls -%}"
    "{%- for call in message.tool_calls -%}[call {{ call.function.name }}]{%- endfor -%}"
    "{%- set scan = namespace(stopped=false) -%}"
    "{%- for k in range(loop.index0 + 1, messages | length) -%}"
    "{%- if scan.stopped -%}"
    "{%- elif messages[k].role != 'tool' -%}{%- set scan.stopped = true -%}"
    "{%- else -%}[result {{ messages[k].tool_call_id }}: {{ messages[k].content }}]{%- set ns.kind = 'result' -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- else -%}{%- set ns.kind = 'text' -%}{%- endif -%}"
    "{{ message.content or '' }}|"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt and ns.kind != 'result' -%}<assistant>{%- endif -%}"
)


def _split(source: str) -> Any:
    return split_template(compile_template(source), source)


def test_both_scans_are_taken_out_of_the_body() -> None:
    split = _split(GEMMA_LIKE)
    assert split is not None
    assert [scan.step for scan in split.scans] == [-1, 1]
    assert split.carried == ("ns",)
    real = _split(template("google-gemma-4-31B-it"))
    assert real is not None
    assert [scan.step for scan in real.scans] == [-1, 1]


@pytest.mark.parametrize(
    ("change", "check"),
    [
        # The flag is written twice: the test alone no longer says where the scan stops having an effect.
        ("{%- set prev.found = true -%}", "{%- set prev.found = true -%}{%- set prev.found = false -%}"),
        # The scan reads its own loop, whose length changes with the list it runs over.
        ("{%- set prev.role = messages[j].role -%}", "{%- set prev.role = messages[j].role ~ loop.length -%}"),
        # The index picks from another list than the one the loop runs over.
        ("{%- if messages[j].role != 'tool' -%}", "{%- if tools[j] is defined and messages[j].role != 'tool' -%}"),
    ],
)
def test_a_scan_of_another_shape_stays_in_the_body_and_the_template_is_refused(change: str, check: str) -> None:
    source = GEMMA_LIKE.replace(change, check)
    assert source != GEMMA_LIKE
    found = try_split(compile_template(source), source)
    assert isinstance(found, Refusal)


def test_a_macro_that_uses_the_carried_namespace_without_making_its_own_is_refused() -> None:
    end = "{{ message.content or '' }}|"
    source = "{%- macro note() -%}{{ ns.kind }}{%- endmacro -%}" + GEMMA_LIKE.replace(end, "{{ note() }}" + end)
    found = try_split(compile_template(source), source)
    assert isinstance(found, Refusal)
    own = "{%- macro note() -%}{%- set ns = namespace(kind=1) -%}{{ ns.kind }}{%- endmacro -%}"
    assert _split(own + GEMMA_LIKE.replace(end, "{{ note() }}" + end)) is not None


@st.composite
def chats(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Agent chats of any shape: model turns after model turns, calls answered by one or several results (the
    last perhaps still waiting for some), runs of results longer than a body's usual window."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}] if draw(st.booleans()) else []
    serial = 0
    for _ in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["user", "assistant", "calls", "calls"]))
        if kind != "calls":
            messages.append({"role": kind, "content": draw(st.sampled_from(["Hi.", "Mais oui.", "好的。", ""]))})
            continue
        calls = []
        for _ in range(draw(st.integers(1, 5))):
            serial += 1
            arguments = json.dumps({"q": f"item {serial}"})
            calls.append(
                {"id": f"c{serial:08d}", "type": "function", "function": {"name": "look", "arguments": arguments}}
            )
        messages.append({"role": "assistant", "content": "", "tool_calls": calls})
        for call in calls:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"found {call['id']}"})
    return messages


@pytest.fixture(scope="module")
def counters() -> dict[str, tuple[ck.HFChatTemplateCounter, ck.HFChatTemplateCounter]]:
    out = {}
    for name, source, vocab in (
        ("gemma-like", GEMMA_LIKE, "qwen2"),
        ("gemma-4", template("google-gemma-4-31B-it"), "gemma-4"),
    ):
        tokenizer = hf_tokenizer(vocab)
        fast = ck.HFChatTemplateCounter(tokenizer, chat_template=source, name=name)
        whole = ck.HFChatTemplateCounter(tokenizer, chat_template=source, name=name, incremental=False)
        out[name] = (fast, whole)
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=chats(), name=st.sampled_from(["gemma-like", "gemma-4"]), drop=st.integers(0, 6))
def test_the_scans_taken_out_render_as_the_template_does(
    counters: dict[str, tuple[ck.HFChatTemplateCounter, ck.HFChatTemplateCounter]],
    messages: list[dict[str, Any]],
    name: str,
    drop: int,
) -> None:
    fast, whole = counters[name]
    # The chat as it grows one message at a time (results arriving one by one after their call), then with its
    # oldest messages gone, each rendered by the same counter: later renders reuse what earlier ones made.
    for end in range(1, len(messages) + 1):
        assert fast.render(messages[:end]) == whole.render(messages[:end]), (name, end)
    start = next((i for i in range(drop, len(messages)) if messages[i]["role"] != "tool"), 0)
    assert fast.render(messages[start:]) == whole.render(messages[start:])
    assert fast.count(messages, tools=None) == whole.count(messages, tools=None)


def test_a_run_of_results_beyond_the_farthest_reach_is_rendered_whole(
    counters: dict[str, tuple[ck.HFChatTemplateCounter, ck.HFChatTemplateCounter]],
) -> None:
    fast, whole = counters["gemma-like"]
    calls = [
        {"id": f"c{i:08d}", "type": "function", "function": {"name": "look", "arguments": "{}"}}
        for i in range(FARTHEST + 2)
    ]
    messages = [
        {"role": "user", "content": "Look everywhere."},
        {"role": "assistant", "content": "", "tool_calls": calls},
        *({"role": "tool", "tool_call_id": c["id"], "content": "x"} for c in calls),
        {"role": "assistant", "content": "Done."},
    ]
    assert fast.render(messages) == whole.render(messages)


@functools.cache
def _checks() -> list[Check]:
    from test_render_ahead import HARMONY_LIKE

    sources = (GEMMA_LIKE, template("google-gemma-4-31B-it"), HARMONY_LIKE, template("openai-gpt-oss-120b"))
    return [part.test for source in sources for part in (*_split(source).scans, *_split(source).aheads)]


@settings(max_examples=60, deadline=None)
@given(
    messages=chats(),
    extra=st.lists(st.sampled_from([{}, {"role": None}, {"role": "tool"}, {"role": "assistant", "content": None}])),
)
def test_a_scan_tests_every_message_in_one_render_as_one_render_each(
    messages: list[dict[str, Any]], extra: list[dict[str, Any]]
) -> None:
    # Check.many (one render over the messages) against Check.passes (one render per message, the reference),
    # for every test the real templates' scans and look-aheads take out, on messages of any shape.
    checks = _checks()
    assert len(checks) == 6
    every = [*messages, *extra]
    for check in checks:
        assert check.many(every) == [check.passes(message) for message in every]
