"""Settled scans: loops compiled to stop once their remaining iterations provably do nothing render exactly what
the loops as written render (the text, or the error's type and message), for every vendored template over
generated agent conversations, and for small templates of each shape, including the ones that must be left
as they are. The reference is the same sandbox compiled without the transform (``compile_template(s, False)``)."""

from __future__ import annotations

import contextlib
import copy
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jinja2 import Template
from jinja2.exceptions import UndefinedError

import contextkeeper as ck
from assets import ASSETS, template
from contextkeeper.tokens import _sandbox
from contextkeeper.tokens._sandbox import TemplateLimits, bounded, compile_template
from contextkeeper.tokens.render import IncrementalRenderer, SplitTemplate, try_split
from contextkeeper.tokens.render.settle import NO_PLAN, Settled, settle, settled_loops
from conversations import TOOLS

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from agent_conversation import TOOLS as AGENT_TOOLS
from agent_conversation import build, build_script

ALL_TEMPLATES = sorted(p.stem for p in (ASSETS / "templates").glob("*.jinja")) if ASSETS.exists() else []
_FIXED = {"derandomize": True, "deadline": None, "database": None}


def _found(source: str) -> tuple[Settled, ...]:
    env = compile_template(source).environment
    return settled_loops(env.parse(source), env.tests)


def _outcome(compiled: Template, context: dict[str, Any], limits: TemplateLimits | None = None) -> Any:
    """The rendered text, or the type and message of the error the render raised."""
    try:
        with bounded(limits or _sandbox.DEFAULT_LIMITS):
            return compiled.render(context)
    except Exception as exc:
        return type(exc), str(exc)


def _both(source: str, limits: TemplateLimits | None = None, **context: Any) -> tuple[Any, Any]:
    """(settled, reference) outcomes of rendering ``source`` with ``context``."""
    return (
        _outcome(compile_template(source), context, limits),
        _outcome(compile_template(source, False), context, limits),
    )


# ----------------------------------------------------------------------------------------- the two shapes

GUARD = (
    "{% set ns = namespace(found=false) %}{% for i in range(50000) %}{% if not ns.found %}{{ i }}"
    "{% if i == 2 %}{% set ns.found = true %}{% endif %}{% endif %}{% endfor %}done"
)
EMPTY_GUARD = (
    "{% set scan = namespace(stopped=false) %}{% for m in messages %}{% if scan.stopped %}"
    "{% elif m.role != 'tool' %}{% set scan.stopped = true %}{% else %}[{{ m.content }}]{% endif %}{% endfor %}"
)
FLAG = (
    "{% set ns = namespace(found=false) %}{% for m in messages %}"
    "{% if m.role == 'assistant' and 'tool_calls' not in m %}{% set ns.found = true %}{% endif %}"
    "{% endfor %}{{ ns.found }}"
)
TOOL_MESSAGES = [{"role": "tool", "content": "a"}, {"role": "tool", "content": "b"}, {"role": "user", "content": "c"}]


def test_a_settled_guard_stops_its_loop_and_renders_the_same() -> None:
    assert _found(GUARD) == (Settled(line=1, shape="guard", flag="ns.found", items="any"),)
    # 50,000 iterations as written: past a 10,000-step bound. Settled, the loop stops at its fourth.
    settled, reference = _both(GUARD, TemplateLimits(steps=10_000))
    assert settled == "012done"
    assert reference[0] is ck.TemplateLimitExceeded
    assert _both(GUARD) == ("012done", "012done")


def test_an_empty_first_branch_settles_with_its_elif_and_else() -> None:
    assert [(s.shape, s.flag) for s in _found(EMPTY_GUARD)] == [("guard", "scan.stopped")]
    messages = TOOL_MESSAGES * 3000  # the scan stops at the first user message
    settled, reference = _both(EMPTY_GUARD, TemplateLimits(steps=5_000), messages=messages)
    assert settled == "[a][b]"
    assert reference[0] is ck.TemplateLimitExceeded
    assert _both(EMPTY_GUARD, messages=messages[:30]) == ("[a][b]", "[a][b]")


def test_an_idempotent_flag_stops_after_its_write() -> None:
    assert [(s.shape, s.items) for s in _found(FLAG)] == [("flag", "text or containers")]
    messages = [{"role": "assistant", "content": "x"}] * 20_000
    settled, reference = _both(FLAG, TemplateLimits(steps=5_000), messages=messages)
    assert settled == "True"
    assert reference[0] is ck.TemplateLimitExceeded
    for messages in ([], [{"role": "user"}], [{"role": "assistant", "tool_calls": []}, {"role": "assistant"}]):
        settled, reference = _both(FLAG, messages=messages)
        assert settled == reference


def test_allowed_tests_each_settle() -> None:
    allowed = [
        "m.role == 'user'",
        "'user' != m['role']",
        "m.role in ['user', 'system']",
        "m.role not in ('tool',)",
        "m.name is defined and m.name is not none",
        "not m.content is string or m.content == ''",
        "m.tool_calls",
        "'content' in m",
    ]
    for test in allowed:
        source = (
            "{% set ns = namespace(hit=false) %}{% for m in messages %}"
            f"{{% if {test} %}}{{% set ns.hit = true %}}{{% endif %}}{{% endfor %}}{{{{ ns.hit }}}}"
        )
        assert [s.shape for s in _found(source)] == ["flag"], test
        for messages in ([{"role": "user", "content": "", "name": "x"}], [{"role": "tool"}, "text", 3, None]):
            settled, reference = _both(source, messages=messages)
            assert settled == reference, (test, messages)


# -------------------------------------------------------------------------------- left as they are written

NOT_SETTLED = {
    # ``<`` between a string and a number raises: a later item could fail.
    "a test that can raise": (
        "{% set ns = namespace(f=false) %}{% for m in messages %}{% if m.n < 3 %}{% set ns.f = true %}{% endif %}"
        "{% endfor %}{{ ns.f }}"
    ),
    "a membership test that can raise": (
        "{% set ns = namespace(f=false) %}{% for m in messages %}{% if 'x' in m.content %}{% set ns.f = true %}"
        "{% endif %}{% endfor %}{{ ns.f }}"
    ),
    "a test that calls": (
        "{% set ns = namespace(f=false) %}{% for m in messages %}{% if m.content.startswith('a') %}"
        "{% set ns.f = true %}{% endif %}{% endfor %}{{ ns.f }}"
    ),
    "a test that reads the namespace": (
        "{% set ns = namespace(f=false) %}{% for m in messages %}{% if not ns.f and m.role %}{% set ns.f = true %}"
        "{% endif %}{% endfor %}{{ ns.f }}"
    ),
    "a value that is not a literal": (
        "{% set ns = namespace(i=-1) %}{% for m in messages %}{% if m.role == 'user' %}{% set ns.i = loop.index0 %}"
        "{% endif %}{% endfor %}{{ ns.i }}"
    ),
    "a name rebound to a non-namespace": (
        "{% set ns = namespace(f=false) %}{% for m in messages %}{% if not ns.f %}{% set ns.f = m.role == 'user' %}"
        "{{ m.role }}{% endif %}{% endfor %}{% set ns = 3 %}"
    ),
    "a name that is also a loop variable": (
        "{% set ns = namespace(f=false) %}{% for ns in messages %}{% if not ns.f %}x{% endif %}{% endfor %}"
    ),
    "a name that is also a macro argument": (
        "{% macro m(ns) %}{% endmacro %}{% set ns = namespace(f=false) %}{% for m in messages %}{% if not ns.f %}"
        "{% set ns.f = true %}x{% endif %}{% endfor %}"
    ),
    "a name also set as a block": (
        "{% set ns = namespace(f=false) %}{% for m in messages %}{% if not ns.f %}{% set ns.f = true %}x{% endif %}"
        "{% endfor %}{% set ns %}text{% endset %}"
    ),
    "namespace itself rebound": (
        "{% set namespace = dict %}{% set ns = namespace(f=false) %}{% for m in messages %}{% if not ns.f %}x"
        "{% endif %}{% endfor %}"
    ),
    "a loop with an else": (
        "{% set ns = namespace(f=false) %}{% for m in messages %}{% if not ns.f %}{% set ns.f = true %}x{% endif %}"
        "{% else %}empty{% endfor %}"
    ),
    "a recursive loop": (
        "{% set ns = namespace(f=false) %}{% for m in messages recursive %}{% if not ns.f %}{% set ns.f = true %}"
        "{{ loop(m.children or []) }}{% endif %}{% endfor %}"
    ),
    "a filtered loop": (
        "{% set ns = namespace(f=false) %}{% for m in messages if m.role %}{% if not ns.f %}{% set ns.f = true %}x"
        "{% endif %}{% endfor %}"
    ),
    "an unpacking loop": (
        "{% set ns = namespace(f=false) %}{% for a, b in messages %}{% if not ns.f %}{% set ns.f = true %}x"
        "{% endif %}{% endfor %}"
    ),
    "a body with more than the if": (
        "{% set ns = namespace(f=false) %}{% for m in messages %}.{% if not ns.f %}{% set ns.f = true %}{% endif %}"
        "{% endfor %}"
    ),
    "a guard with an else": (
        "{% set ns = namespace(f=false) %}{% for m in messages %}{% if not ns.f %}{% set ns.f = true %}{% else %}y"
        "{% endif %}{% endfor %}"
    ),
    "a flag with an else": (
        "{% set ns = namespace(f=false) %}{% for m in messages %}{% if m.role == 'user' %}{% set ns.f = true %}"
        "{% else %}{% set ns.f = false %}{% endif %}{% endfor %}{{ ns.f }}"
    ),
}
NOT_SETTLED_MESSAGES: list[Any] = [
    {"role": "user", "content": "abc", "n": 1},
    {"role": "assistant", "content": "x", "n": "two", "children": [{"role": "user"}]},
    ("a", "b"),
    {"role": "user", "content": None, "n": 5},
]


@pytest.mark.parametrize("case", sorted(NOT_SETTLED))
def test_loops_that_might_do_something_later_are_left_as_written(case: str) -> None:
    source = NOT_SETTLED[case]
    assert _found(source) == (), case
    parsed = compile_template(source).environment.parse(source)
    assert settle(parsed, compile_template(source).environment.tests) == (parsed, NO_PLAN)
    for messages in (NOT_SETTLED_MESSAGES, NOT_SETTLED_MESSAGES[:2], []):
        settled, reference = _both(source, messages=messages)
        assert settled == reference, (case, messages)


# ------------------------------------------------------------------------ what only the render can check

LAZY = (
    "{% set ns = namespace(f=false) %}{% for x in items|selectattr('a', 'gt', 1) %}{% if x.a == 2 %}"
    "{% set ns.f = true %}{% endif %}{% endfor %}{{ ns.f }}"
)
UNDEFINED_ITEM = (
    "{% set ns = namespace(f=false) %}{% for x in [{'a': 2}, nope] %}{% if x.a == 2 %}{% set ns.f = true %}"
    "{% endif %}{% endfor %}{{ ns.f }}"
)
CALLER_VALUE = (
    "{% if false %}{% set ns = namespace(a=false) %}{% endif %}{% for i in range(4) %}{% if not ns.a %}{{ i }}"
    "{% endif %}{% endfor %}"
)


class _Blinking:
    """A caller's object whose attribute changes each time it is read."""

    def __init__(self) -> None:
        self.reads = 0

    @property
    def a(self) -> bool:
        self.reads += 1
        return self.reads % 2 == 1


def test_a_lazy_iterable_runs_to_its_end() -> None:
    # The last item makes ``selectattr``'s ``>`` raise (a string against a number): the break would skip it
    # (the sandbox draws a lazy iterable's items a few dozen at a time, so it comes well after the first).
    assert [s.shape for s in _found(LAZY)] == ["flag"]
    items = [{"a": 2}, *[{"a": 3}] * 200, {"a": "x"}]
    settled, reference = _both(LAZY, items=items)
    assert reference[0] is TypeError
    assert settled == reference
    assert _both(LAZY, items=items[:-1]) == ("True", "True")


def test_an_item_the_test_could_fail_on_keeps_the_loop_running() -> None:
    assert [s.shape for s in _found(UNDEFINED_ITEM)] == ["flag"]
    settled, reference = _both(UNDEFINED_ITEM)
    assert reference == (UndefinedError, "'nope' is undefined")
    assert settled == reference


def test_a_caller_value_under_the_namespace_name_is_not_trusted() -> None:
    assert [s.shape for s in _found(CALLER_VALUE)] == ["guard"]
    settled, reference = _both(CALLER_VALUE, ns=_Blinking())
    assert reference == "13"  # a break at the first read would render nothing
    assert settled == reference


def test_bounds_still_stop_a_loop_that_never_settles() -> None:
    never = (
        "{% set ns = namespace(found=false) %}{% for i in range(50000) %}{% if not ns.found %}x{% endif %}{% endfor %}"
    )
    for limits in (TemplateLimits(steps=10_000), TemplateLimits(output_chars=1_000)):
        settled, reference = _both(never, limits)
        assert settled[0] is ck.TemplateLimitExceeded
        assert settled == reference


# --------------------------------------------------------------------------------------- real templates


def test_the_quadratic_scans_of_gemma_4_and_gpt_oss_are_settled() -> None:
    gemma = _found(template("google-gemma-4-31B-it"))
    assert [(s.shape, s.flag) for s in gemma] == [("guard", "prev_nt.found"), ("guard", "ns_tool_scan.stopped")]
    gpt_oss = _found(template("openai-gpt-oss-120b"))
    assert [(s.shape, s.flag) for s in gpt_oss] == [("flag", "future_final_message.found")]


def _steps(compiled: Template, context: dict[str, Any]) -> int:
    with bounded():
        compiled.render(context)
        budget = _sandbox._CURRENT.get()
        assert budget is not None
        return budget.steps


@pytest.mark.parametrize("name", ["google-gemma-4-31B-it", "openai-gpt-oss-120b"])
def test_an_agent_chat_twice_as_long_costs_about_twice_as_much(name: str) -> None:
    # As written, each message scans the chat: twice the messages, about four times the loop steps.
    source = template(name)
    grown = []
    for messages in (200, 400):
        plain, _ = ck.server_view(build(messages))
        context = {"messages": plain, "tools": AGENT_TOOLS, "add_generation_prompt": True, "bos_token": "<bos>"}
        settled, reference = compile_template(source), compile_template(source, False)
        assert _outcome(settled, context) == _outcome(reference, context)
        grown.append((_steps(settled, context), _steps(reference, context)))
    (settled_200, reference_200), (settled_400, reference_400) = grown
    assert reference_400 / reference_200 > 3.0  # the reproduction: quadratic as written
    assert settled_400 / settled_200 < 2.5


@pytest.mark.parametrize("name", ["google-gemma-4-31B-it", "openai-gpt-oss-120b"])
@pytest.mark.parametrize("script", ["latin", "mixed"])
def test_long_chats_in_other_scripts_render_the_same(name: str, script: str) -> None:
    plain, _ = ck.server_view(build_script(script, 300))
    context = {"messages": plain, "tools": AGENT_TOOLS, "add_generation_prompt": True, "bos_token": "<bos>"}
    settled = _outcome(compile_template(template(name)), context)
    assert isinstance(settled, str)
    assert settled == _outcome(compile_template(template(name), False), context)


texts = st.sampled_from(
    ["", " ", "Hello there.", "Ça marche 🙂", "<think>plan</think>answer", "two\nlines", '{"a": 1}', "42"]
)
reasoning_fields = st.sampled_from(["reasoning_content", "thinking", "reasoning"])


@st.composite
def agent_chats(draw: st.DrawFn) -> list[dict[str, Any]]:
    """An agent conversation: a system prompt or not, turns of user text, assistant text (with reasoning or
    not), assistant tool calls followed by some or all of their results, stray tool results and late system
    messages; ending on a user, a tool or an assistant message."""
    out: list[dict[str, Any]] = []
    if draw(st.booleans()):
        out.append({"role": "system", "content": draw(texts)})
    calls = 0
    kinds = st.sampled_from(["user", "assistant", "calls", "calls", "tool", "system"])
    for kind in draw(st.lists(kinds, max_size=12)):
        if kind in ("user", "system"):
            out.append({"role": kind, "content": draw(texts)})
        elif kind == "tool":
            out.append({"role": "tool", "tool_call_id": "stray0000", "content": draw(texts)})
        else:
            message: dict[str, Any] = {"role": "assistant", "content": draw(texts)}
            if draw(st.booleans()):
                message[draw(reasoning_fields)] = draw(texts)
            ids = []
            if kind == "calls":
                message["content"] = draw(st.none() | texts)
                message["tool_calls"] = []
                for _ in range(draw(st.integers(1, 2))):
                    calls += 1
                    ids.append(f"call{calls:05d}")
                    name = draw(st.sampled_from(["get_weather", "run_sql"]))
                    arguments = json.dumps({"city": draw(texts)} if name == "get_weather" else {"sql": "SELECT 1"})
                    message["tool_calls"].append(
                        {"id": ids[-1], "type": "function", "function": {"name": name, "arguments": arguments}}
                    )
            out.append(message)
            for call_id in ids[: draw(st.integers(0, len(ids)))]:
                out.append({"role": "tool", "tool_call_id": call_id, "content": draw(texts)})
    return out


@st.composite
def render_contexts(draw: st.DrawFn) -> dict[str, Any]:
    messages = draw(agent_chats())
    if draw(st.booleans()):  # what the counters render: the server's preprocessing (arguments parsed)
        with contextlib.suppress(ck.ContextKeeperError):  # a stray tool result: the messages as they are
            messages, _ = ck.server_view(messages)
    extra = draw(st.sampled_from([{}, {"enable_thinking": False}, {"reasoning_effort": "high"}, {"thinking": True}]))
    return {
        "bos_token": "<s>",
        "eos_token": "</s>",
        **extra,
        "messages": messages,
        "tools": draw(st.sampled_from([None, TOOLS])),
        "documents": None,
        "add_generation_prompt": draw(st.booleans()),
    }


SETTLED_TEMPLATES = [name for name in ALL_TEMPLATES if _found(template(name))]


@pytest.mark.parametrize("name", ALL_TEMPLATES)
def test_every_vendored_template_renders_the_same_settled(name: str) -> None:
    source = template(name)
    settled, reference = compile_template(source), compile_template(source, False)
    if name not in SETTLED_TEMPLATES:  # nothing to settle: the very tree as written is compiled
        env = settled.environment
        parsed = env.parse(source)
        assert settle(parsed, env.tests) == (parsed, NO_PLAN)
    examples = 60 if name in SETTLED_TEMPLATES else 6

    @settings(max_examples=examples, suppress_health_check=[HealthCheck.too_slow], **_FIXED)
    @given(context=render_contexts())
    def renders_the_same(context: dict[str, Any]) -> None:
        before = copy.deepcopy(context)
        assert _outcome(settled, context) == _outcome(reference, context)
        assert context == before

    renders_the_same()


def test_the_settled_templates_include_the_ones_that_scan() -> None:
    assert {"google-gemma-4-31B-it", "openai-gpt-oss-120b"} <= set(SETTLED_TEMPLATES)


# ------------------------------------------------------------------------------------ the template splitter


@pytest.mark.parametrize("name", ALL_TEMPLATES)
def test_the_splitter_decides_on_the_template_as_written(name: str) -> None:
    source = template(name)
    settled, reference = try_split(compile_template(source), source), try_split(compile_template(source, False), source)
    assert type(settled) is type(reference)
    if not isinstance(settled, SplitTemplate):
        assert settled == reference


SPLIT_WITH_SCAN = (
    "{% set ns = namespace(builtin=false) %}{% for t in tools or [] %}{% if t.type == 'builtin' %}"
    "{% set ns.builtin = true %}{% endif %}{% endfor %}{% if ns.builtin %}[builtin]{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
)


def test_a_split_template_with_a_settled_head_renders_the_same() -> None:
    assert [s.shape for s in _found(SPLIT_WITH_SCAN)] == ["flag"]
    split = try_split(compile_template(SPLIT_WITH_SCAN), SPLIT_WITH_SCAN)
    assert isinstance(split, SplitTemplate)
    renderer = IncrementalRenderer(split)
    reference = compile_template(SPLIT_WITH_SCAN, False)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    for tools in (None, [{"type": "function"}] * 100, [{"type": "builtin"}, {"type": "function"}] * 50):
        context = {"messages": messages, "tools": tools, "add_generation_prompt": True}
        with bounded():
            assert renderer.render(context) == reference.render(context)


_NAMES = st.sampled_from(["found", "last_index", "s", "_private", "__class__", "items"])
_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.text(max_size=3), st.lists(st.integers(), max_size=2)
)


@settings(max_examples=80, deadline=None)
@given(
    fields=st.dictionaries(_NAMES, _VALUES, max_size=3),
    positional=st.booleans(),
    in_loop=st.booleans(),
    stop=st.sampled_from(["3", "-2", "'x'", "2.5", "10 ** 9"]),
)
def test_namespace_and_range_called_directly_are_what_the_sandbox_calls(
    fields: dict[str, object], positional: bool, in_loop: bool, stop: str
) -> None:
    # ``namespace(...)`` and ``range(...)`` skip the sandbox's probing of the call (``call_directly``); the
    # reference takes the sandbox's own way. Both must render the same, or fail the same way (transformers'
    # namespace refuses names that start with an underscore; range refuses a string and a range too long).
    given = f"{fields!r}" if positional else ", ".join(f"{k}={v!r}" for k, v in fields.items())
    body = (
        f"{{% set ns = namespace({given}) %}}{{{{ ns.found }}}}|{{{{ ns.items }}}}|{{% set ns.s = 'x' %}}{{{{ ns.s }}}}"
        f"{{% for i in range({stop}, -1, -1) %}}{{{{ i }}}}{{% endfor %}}{{{{ range({stop}) | list | length }}}}"
    )
    source = f"{{% for m in messages %}}{body}{{% endfor %}}" if in_loop else body

    def render(direct: bool) -> str:
        template = compile_template(source)  # remembered per source: the setting is put back after
        template.environment.call_directly = direct
        try:
            return template.render(messages=[1, 2])
        except Exception as exc:  # refused the same way, or not at all
            return f"{type(exc).__name__}: {exc}"
        finally:
            template.environment.call_directly = True

    assert render(True) == render(False)
