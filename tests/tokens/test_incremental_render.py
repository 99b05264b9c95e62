"""Message-by-message rendering: for every vendored template it accepts, the text equals a whole render, over
many conversation shapes and edit sequences; templates it cannot prove safe are refused."""

from __future__ import annotations

from typing import Any

import pytest

import contextkeeper as ck
from assets import ASSETS, template
from conftest import hf_tokenizer
from contextkeeper.tokens._sandbox import compile_template
from contextkeeper.tokens.render import split_template
from conversations import CONVERSATIONS, TOOLS, call

ALL_TEMPLATES = sorted(p.stem for p in (ASSETS / "templates").glob("*.jinja")) if ASSETS.exists() else []
SPLITTABLE = [name for name in ALL_TEMPLATES if split_template(compile_template(template(name)), template(name))]


def _edits(base: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """A chat as it grows, shrinks and changes: appended turns, dropped oldest turns, a rewritten tool result."""
    steps = [base]
    grown = [*base, {"role": "assistant", "content": "Noted."}, {"role": "user", "content": "Next question?"}]
    steps.append(grown)
    tool_turn = [
        *grown,
        {"role": "assistant", "content": None, "tool_calls": [call("z9y8x7w6v", "run_sql", sql="SELECT 1")]},
        {"role": "tool", "tool_call_id": "z9y8x7w6v", "content": "1"},
    ]
    steps.append(tool_turn)
    steps.append([*tool_turn, {"role": "assistant", "content": "One."}, {"role": "user", "content": "Thanks!"}])
    first_user = next(i for i, m in enumerate(steps[-1]) if m["role"] == "user")
    later_user = [i for i, m in enumerate(steps[-1]) if m["role"] == "user" and i > first_user]
    if later_user:  # drop the oldest turn, keep the system prompt
        steps.append(steps[-1][:first_user] + steps[-1][later_user[0] :])
    rewritten = [dict(m) for m in steps[-1]]
    for m in rewritten:
        if m["role"] == "tool":
            m["content"] = "[cleared]"
    steps.append(rewritten)
    return steps


def test_the_popular_templates_are_split() -> None:
    for name in ("Qwen-Qwen2.5-7B-Instruct", "Qwen-Qwen3-0.6B", "meta-llama-Llama-3.3-70B-Instruct"):
        assert name in SPLITTABLE, name


def test_templates_with_cross_message_state_are_refused() -> None:
    made_in_an_if = (
        "{% if messages %}{% set ns = namespace(n=0) %}{% endif %}"
        "{% for m in messages %}{% set ns.n = ns.n + 1 %}{{ ns.n }}{% endfor %}"
    )
    rebound = (
        "{% set ns = namespace(n=0) %}{% set ns = namespace(n=1) %}"
        "{% for m in messages %}{% set ns.n = ns.n + 1 %}{{ ns.n }}{% endfor %}"
    )
    macro_reads = (
        "{% macro n() %}{{ ns.n }}{% endmacro %}{% set ns = namespace(n=0) %}"
        "{% for m in messages %}{% set ns.n = ns.n + 1 %}{{ n() }}{% endfor %}"
    )
    uses_length = "{% for m in messages %}{{ loop.length }}{{ m.content }}{% endfor %}"
    far_reads = "{% for m in messages %}{{ messages[-1].content }}{% endfor %}"
    filtered = "{% for m in messages if m.role != 'system' %}{{ loop.index }}{% endfor %}"
    via_macro = (
        "{% macro last() %}{{ messages[-1].content }}{% endmacro %}"
        "{% for m in messages %}{{ m.content }}{{ last() }}{% endfor %}"
    )
    for source in (made_in_an_if, rebound, macro_reads, uses_length, far_reads, filtered, via_macro):
        assert split_template(compile_template(source), source) is None, source


_CARRIED = {
    "counter": "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{{ ns.n }}{% endfor %}",
    "block": (
        "{% set ns = namespace(t='') %}{% for m in messages %}{% set ns.t %}{{ m.content }}{% endset %}"
        "{{ ns.t }}{% endfor %}"
    ),
    "flags": (  # the shape of DeepSeek's: a flag set by one role and read by the next message
        "{% set ns = namespace(user=false, tool=false) %}{% for m in messages %}"
        "{% if m.role == 'user' %}{% set ns.user = true %}{% set ns.tool = false %}<U>{{ m.content }}"
        "{% elif m.role == 'tool' %}{% set ns.tool = true %}<T>{{ m.content }}"
        "{% else %}{% if ns.user %}<A>{% endif %}{% set ns.user = false %}{{ m.content }}{% endif %}"
        "{% endfor %}{% if ns.user and not ns.tool %}<A>{% endif %}"
    ),
    "list": (  # a value a snapshot cannot hold: rendered whole
        "{% set ns = namespace(seen=[]) %}{% for m in messages %}{% set ns.seen = ns.seen + [m.role] %}"
        "{{ ns.seen | length }}{% endfor %}"
    ),
}


@pytest.mark.parametrize("name", sorted(_CARRIED))
def test_namespace_state_carried_from_message_to_message_is_threaded_through_the_bodies(name: str) -> None:
    """A body that writes a namespace the head made is cut like any other: the state before each body is part of
    its key and its state after is kept with its output, so the render equals a whole one as the chat grows,
    loses its oldest turns and changes in place."""
    source = _CARRIED[name]
    split = split_template(compile_template(source), source)
    assert split is not None
    assert split.carried == ("ns",)
    tokenizer = hf_tokenizer("qwen2")
    fast = ck.HFChatTemplateCounter(tokenizer, chat_template=source, name=name)
    whole = ck.HFChatTemplateCounter(tokenizer, chat_template=source, name=name, incremental=False)
    for shape in CONVERSATIONS.values():
        for messages in _edits(shape()):
            assert fast.render(messages) == whole.render(messages)


def _counters(name: str) -> tuple[ck.HFChatTemplateCounter, ck.HFChatTemplateCounter]:
    """Counters for one template: message by message, and whole (the reference)."""
    tokenizer = hf_tokenizer("qwen2")
    source = template(name)
    fast = ck.HFChatTemplateCounter(tokenizer, chat_template=source, name=name)
    return fast, ck.HFChatTemplateCounter(tokenizer, chat_template=source, name=name, incremental=False)


@pytest.mark.parametrize("name", SPLITTABLE)
def test_incremental_render_equals_whole_render(name: str) -> None:
    fast, whole = _counters(name)
    compared = 0
    for shape in CONVERSATIONS.values():
        for messages in _edits(shape()):
            for tools in (None, TOOLS):
                try:
                    expected = whole.render(messages, tools=tools)
                except ck.ChatTemplateError:
                    with pytest.raises(ck.ChatTemplateError):
                        fast.render(messages, tools=tools)
                    continue
                assert fast.render(messages, tools=tools) == expected, (name, len(messages), tools is not None)
                compared += 1
    if not compared:  # both raised alike on every shape (checked above); there is no text to compare
        pytest.skip(f"{name} renders none of the conversation shapes")
    renderer = next(r for r in fast._renderers.values() if r is not None)
    assert renderer.reused > 0  # outputs were really taken from the memo, not rendered again


@pytest.mark.parametrize("name", SPLITTABLE)
def test_runs_shared_at_either_end_are_reused_and_counts_stay_exact(name: str) -> None:
    # A sliding window's candidates (the same newest messages behind a moving start), and a chat whose middle
    # changed (a tool result rewritten): bodies are taken whole from the previous render at both ends.
    fast, whole = _counters(name)
    shape = [m for m in CONVERSATIONS["tool_round"]() if m["role"] != "system"]
    chat: list[dict[str, Any]] = []
    for turn in range(6):
        chat += [{**m, "content": f"{m.get('content') or ''} {turn}"} if m["role"] == "user" else m for m in shape]
    system = [{"role": "system", "content": "Be brief."}]
    starts = [i for i, m in enumerate(chat) if m["role"] == "user"]
    variants = [system + chat[start:] for start in (*starts, *reversed(starts))]
    middle = len(chat) // 2
    variants.append(system + chat[:middle] + [{**m} for m in chat[middle : middle + 3]] + chat[middle + 3 :])
    compared = 0
    previous: list[dict[str, Any]] = []
    shortest = len(system) + len(chat) - starts[-1]
    reuses: list[int] = []  # bodies reused by each render that should reuse some
    for messages in variants:
        try:
            expected = whole.render(messages)
        except ck.ChatTemplateError:
            continue
        before = next((r.reused for r in fast._renderers.values() if r is not None), 0)
        assert fast.render(messages) == expected, (name, len(messages))
        assert fast.count(messages) == whole.count(messages) == whole.reference_count(messages)
        after = next(r.reused for r in fast._renderers.values() if r is not None)
        compared += 1
        if compared > 1 and messages != previous and len(messages) != shortest:
            reuses.append(after - before)
        previous = messages
    # Every render but the first reuses bodies, except the shortest window (system, one user turn and its tool
    # round: nothing there was rendered in that place before) and the same messages again where the starts turn
    # back (the counter's last render: nothing renders at all). The other templates must reuse somewhere (Gemma
    # 4's interleaved one reuses only while the window grows back).
    assert (
        all(reuses) if name in ("Qwen-Qwen3-0.6B", "meta-llama-Llama-3.3-70B-Instruct") else any(reuses) or not reuses
    )
    assert compared > 1 or name not in ("Qwen-Qwen3-0.6B", "meta-llama-Llama-3.3-70B-Instruct")


def test_a_first_message_that_reads_the_wrapped_around_neighbour() -> None:
    # messages[loop.index0 - 1] at index 0 is messages[-1], the list's last message, which changes as the
    # chat grows: the first body must not be reused when only the end of the list changed.
    source = "{% for m in messages %}[{{ m.content }}<{{ messages[loop.index0 - 1].content }}]{% endfor %}"
    tokenizer = hf_tokenizer("qwen2")
    fast = ck.HFChatTemplateCounter(tokenizer, chat_template=source)
    whole = ck.HFChatTemplateCounter(tokenizer, chat_template=source, incremental=False)
    chat: list[dict[str, Any]] = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    for step in range(4):
        chat = [*chat, {"role": "user", "content": f"u{step}"}]
        assert fast.render(chat) == whole.render(chat)
        chat = [*chat, {"role": "assistant", "content": f"r{step}"}]
        assert fast.render(chat) == whole.render(chat)
    assert split_template(compile_template(source), source) is not None


def test_equal_but_different_messages_are_not_taken_for_the_same() -> None:
    # Python says {"n": 1} == {"n": True}; a template writes 1 and true. Views and outputs are reused only
    # for the very same message objects.
    counter = ck.HFChatTemplateCounter(hf_tokenizer("qwen2"), chat_template=template("Qwen-Qwen2.5-7B-Instruct"))

    def chat(value: Any) -> ck.Conversation:
        call_args = {"id": "a1b2c3d4e", "type": "function", "function": {"name": "f", "arguments": {"n": value}}}
        return ck.Conversation.from_messages(
            [
                {"role": "user", "content": "go"},
                {"role": "assistant", "content": None, "tool_calls": [call_args]},
                {"role": "tool", "tool_call_id": "a1b2c3d4e", "content": "ok"},
            ]
        )

    assert chat(1) == chat(True)
    assert '"n": 1' in counter.render(chat(1))
    assert '"n": true' in counter.render(chat(True))


GUARDED = (
    "{% set ns = namespace(last=-1) %}{% for m in messages[0:] %}{% if m.role == 'user' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% if loop.index0 > ns.last %}<new>{% else %}<old>{% endif %}{{ m.content }}"
    "{% endfor %}"
)
# The same with a nested loop whose own ``loop.index0`` is compared: that comparison stays in the body.
NESTED = GUARDED.replace(
    "{{ m.content }}", "{{ m.content }}{% for part in [1, 2] %}{% if loop.index0 == 1 %}.{% endif %}{% endfor %}"
)


def test_a_comparison_of_the_position_with_a_loop_wide_value_is_taken_out_of_the_body() -> None:
    # Qwen3 strips reasoning from turns before the last user query: ``loop.index0 > ns.last_query_index``. The
    # comparison becomes a per-message boolean in the memo key, so bodies are reused when the list shifts or
    # grows, except where the comparison's result changed.
    split = split_template(compile_template(GUARDED), GUARDED)
    assert split is not None
    assert not split.positional
    assert len(split.guards) == 1
    nested = split_template(compile_template(NESTED), NESTED)
    assert nested is not None
    assert len(nested.guards) == 1
    qwen3 = split_template(compile_template(template("Qwen-Qwen3-0.6B")), template("Qwen-Qwen3-0.6B"))
    assert qwen3 is not None
    assert qwen3.guards
    assert not qwen3.positional
    tokenizer = hf_tokenizer("qwen2")
    for source in (GUARDED, NESTED):
        fast = ck.HFChatTemplateCounter(tokenizer, chat_template=source)
        whole = ck.HFChatTemplateCounter(tokenizer, chat_template=source, incremental=False)
        chat: list[dict[str, Any]] = [{"role": "user", "content": "u0"}]
        for step in range(6):
            chat = [*chat, {"role": "assistant", "content": f"a{step}"}]
            assert fast.render(chat) == whole.render(chat)
            chat = [*chat, {"role": "user", "content": f"u{step + 1}"}]
            assert fast.render(chat) == whole.render(chat)
            if step % 2:
                chat = chat[2:]  # the oldest turn dropped: every position shifts
                assert fast.render(chat) == whole.render(chat)
        renderer = next(r for r in fast._renderers.values() if r is not None)
        assert renderer.reused > 0


def test_a_guard_the_template_cannot_evaluate_renders_whole() -> None:
    source = "{% for m in messages %}{% if loop.index0 > limit %}!{% endif %}{{ m.content }}{% endfor %}"
    tokenizer = hf_tokenizer("qwen2")
    fast = ck.HFChatTemplateCounter(tokenizer, chat_template=source)
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    with pytest.raises(ck.ChatTemplateError):  # ``limit`` is undefined: the template itself fails, clearly
        fast.render(chat)
    fast = ck.HFChatTemplateCounter(tokenizer, chat_template=source, template_kwargs={"limit": 0})
    whole = ck.HFChatTemplateCounter(tokenizer, chat_template=source, template_kwargs={"limit": 0}, incremental=False)
    assert fast.render(chat) == whole.render(chat) == "a!b"


SCAN = (
    "{%- set ns = namespace(open=true, last=messages|length - 1) %}"
    "{%- for m in messages[::-1] %}{%- set i = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.open and m.role == 'user' and not m.content.startswith('<r>') %}"
    "{%- set ns.open = false %}{%- set ns.last = i %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}{{ m.role }}{% if loop.index0 > ns.last %}*{% endif %}:{{ m.content }};{% endfor %}"
    "[{{ ns.last }}|{{ ns.open }}]"
)


def test_a_backward_scan_stops_once_its_flag_is_down() -> None:
    # Qwen3 finds the last real user query by scanning every message backwards; once found, the rest of the scan
    # does nothing. The head stops there (a ``break`` after the flag write) and renders the same text.
    from jinja2 import nodes

    from contextkeeper.tokens.render.scan import stop_scans

    env = compile_template(SCAN).environment
    body = env.parse(SCAN).body
    stopped = stop_scans(body[:2])
    assert any(isinstance(n, nodes.Break) for n in stopped[1].find_all(nodes.Break))
    qwen3 = template("Qwen-Qwen3-0.6B")
    qwen3_head = stop_scans(env.parse(qwen3).body)
    assert any(True for node in qwen3_head for _ in node.find_all(nodes.Break))
    tokenizer = hf_tokenizer("qwen2")
    fast = ck.HFChatTemplateCounter(tokenizer, chat_template=SCAN)
    whole = ck.HFChatTemplateCounter(tokenizer, chat_template=SCAN, incremental=False)
    chats: list[list[dict[str, Any]]] = [
        [{"role": "assistant", "content": "no user at all"}],
        [{"role": "user", "content": "<r>only tool-like users</r>"}, {"role": "assistant", "content": "a"}],
    ]
    chat: list[dict[str, Any]] = []
    for step in range(8):
        chat = [*chat, {"role": "user", "content": f"u{step}" if step % 3 else "<r>x</r>"}]
        chat = [*chat, {"role": "assistant", "content": f"a{step}"}]
        chats.append(chat)
    for messages in chats:
        assert fast.render(messages) == whole.render(messages)


def test_scans_of_other_shapes_run_to_the_end() -> None:
    from jinja2 import nodes

    from contextkeeper.tokens.render.scan import stop_scans

    shapes = [
        # the flag is raised again inside the loop
        "{% set ns = namespace(f=true) %}{% for m in messages %}{% if ns.f and m.x %}{% set ns.f = false %}"
        "{% endif %}{% set ns.f = true %}{% endfor %}",
        # the flag is not the first operand: later items are still tested
        "{% set ns = namespace(f=true) %}{% for m in messages %}{% if m.x and ns.f %}{% set ns.f = false %}"
        "{% endif %}{% endfor %}",
        # the loop writes output besides the flag
        "{% set ns = namespace(f=true) %}{% for m in messages %}{{ m.content }}{% if ns.f %}{% set ns.f = false %}"
        "{% endif %}{% endfor %}",
        # a loop variable set from an expression that may fail on a later item
        "{% set ns = namespace(f=true) %}{% for m in messages %}{% set n = m.content + 1 %}{% if ns.f %}"
        "{% set ns.f = false %}{% endif %}{% endfor %}",
    ]
    for source in shapes:
        env = compile_template(source).environment
        body = stop_scans(env.parse(source).body)
        assert not any(True for node in body for _ in node.find_all(nodes.Break)), source
