"""Looks ahead of the loop position and loops over an alias of the messages: cut, and rendered exactly."""

from __future__ import annotations

import pytest
from test_incremental_render import _edits

import contextkeeper as ck
from conftest import hf_tokenizer
from contextkeeper.tokens._sandbox import compile_template
from contextkeeper.tokens.render import Refusal, split_template, try_split
from conversations import CONVERSATIONS

# The shape of gpt-oss's: the loop runs over ``loop_messages`` (the messages after a system prompt), a tool call's
# analysis is dropped when a final answer follows it (a scan of the later messages), and the tool's name is
# carried to its result in a namespace.
HARMONY_LIKE = (
    "{%- if messages[0].role == 'system' %}{% set loop_messages = messages[1:] %}<S>{{ messages[0].content }}"
    "{%- else %}{% set loop_messages = messages %}{% endif %}"
    "{%- set last = namespace(name=none) %}"
    "{%- for message in loop_messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{%- set future = namespace(found=false) %}"
    "{%- for later in loop_messages[loop.index:] %}"
    "{%- if later.role == 'assistant' and 'tool_calls' not in later %}{% set future.found = true %}{% endif %}"
    "{%- endfor %}"
    "{%- if message.content and not future.found %}<think>{{ message.content }}</think>{% endif %}"
    "<call {{ message.tool_calls[0].function.name }}>"
    "{%- set last.name = message.tool_calls[0].function.name %}"
    "{%- elif message.role == 'tool' %}<result {{ last.name }}>{{ message.content }}"
    "{%- else %}<{{ message.role }}>{{ message.content }}{% endif %}"
    "{%- endfor %}<assistant>"
)


def test_a_scan_of_the_later_messages_is_taken_out_of_the_body() -> None:
    split = split_template(compile_template(HARMONY_LIKE), HARMONY_LIKE)
    assert split is not None
    assert split.sequence == "loop_messages"
    assert split.carried == ("last",)
    assert len(split.aheads) == 1
    assert not split.positional  # loop.index served only the scan


def test_the_scan_taken_out_renders_as_the_template_does() -> None:
    tokenizer = hf_tokenizer("qwen2")
    fast = ck.HFChatTemplateCounter(tokenizer, chat_template=HARMONY_LIKE, name="harmony-like")
    whole = ck.HFChatTemplateCounter(tokenizer, chat_template=HARMONY_LIKE, name="harmony-like", incremental=False)
    compared = 0
    for shape in CONVERSATIONS.values():
        for messages in _edits(shape()):
            assert fast.render(messages) == whole.render(messages)
            compared += 1
    assert compared > 10


def test_a_final_answer_after_a_tool_call_changes_that_call_only() -> None:
    """The look-ahead flips for the calls before a new final answer: those bodies are rendered again."""
    tokenizer = hf_tokenizer("qwen2")
    fast = ck.HFChatTemplateCounter(tokenizer, chat_template=HARMONY_LIKE, name="harmony-like")
    whole = ck.HFChatTemplateCounter(tokenizer, chat_template=HARMONY_LIKE, name="harmony-like", incremental=False)
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    chat = [
        {"role": "user", "content": "find it"},
        {"role": "assistant", "content": "I should look it up.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    before = fast.render(chat)
    assert "<think>I should look it up.</think>" in before
    answered = [*chat, {"role": "assistant", "content": "It is 42."}, {"role": "user", "content": "thanks"}]
    after = fast.render(answered)
    assert after == whole.render(answered)
    assert "<think>" not in after


@pytest.mark.parametrize(
    "source",
    [
        # the scan's test reads something besides the later message: it stays, and the body reads far
        "{% set n = namespace(x=1) %}{% for m in messages %}{% set f = namespace(found=false) %}"
        "{% for later in messages[loop.index:] %}{% if later.role == n.x %}{% set f.found = true %}{% endif %}"
        "{% endfor %}{{ f.found }}{% endfor %}",
        # a scan that writes something other than true
        "{% for m in messages %}{% set f = namespace(found=0) %}"
        "{% for later in messages[loop.index:] %}{% if later.role == 'user' %}{% set f.found = f.found + 1 %}"
        "{% endif %}{% endfor %}{{ f.found }}{% endfor %}",
        # a list bound to something that is not the messages
        "{% set loop_messages = messages | reverse | list %}{% for m in loop_messages %}{{ m.content }}{% endfor %}",
        # a namespace the body makes under a name the template binds outside the loop too
        "{% set f = namespace(found=false) %}{% for m in messages %}{% set f = namespace(found=false) %}"
        "{% set f.found = true %}{{ m.content }}{% endfor %}",
    ],
)
def test_other_shapes_are_not_taken_out(source: str) -> None:
    assert isinstance(try_split(compile_template(source), source), Refusal)
