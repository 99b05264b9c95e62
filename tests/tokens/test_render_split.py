"""The split's refusal checks, one by one: each refuses the template shape it is there for, says which check it
is and where, and the vendored templates are split or refused exactly as ``split_template`` says."""

from __future__ import annotations

import jinja2
import pytest
from jinja2 import Template

from assets import ASSETS, template
from contextkeeper.tokens._sandbox import compile_template
from contextkeeper.tokens.render import CHECKS, Refusal, SplitTemplate, split_template, try_split

# One template per check, refused by that check (and passing every check before it).
REFUSED = {
    "one_message_loop": "{% for m in messages %}{{ m.content }}{% endfor %}{% for m in messages %}.{% endfor %}",
    "plain_loop": "{% for m in messages if m.role != 'system' %}{{ loop.index }}{% endfor %}",
    "neighbours_only": "{% for m in messages %}{{ messages[-1].content }}{% endfor %}",
    "no_nested_message_loop": (
        "{% for m in messages %}{% for p in [1] %}{{ messages[loop.index0].content }}{% endfor %}{% endfor %}"
    ),
    "no_macros_or_jumps": "{% for m in messages %}{% if m.role == 'tool' %}{% continue %}{% endif %}x{% endfor %}",
    "no_imports": "{% for m in messages %}{% include 'other.jinja' %}{% endfor %}",
    "carried_namespaces_only": (
        "{% if messages %}{% set ns = namespace(n=0) %}{% endif %}"
        "{% for m in messages %}{% set ns.n = ns.n + 1 %}{{ ns.n }}{% endfor %}"
    ),
    "no_impure_calls": "{% for m in messages %}{{ strftime_now('%d') }}{{ m.content }}{% endfor %}",
    "loop_position_only": "{% for m in messages %}{{ loop.length }}{{ m.content }}{% endfor %}",
    "no_side_effects": "{% set seen = [] %}{% for m in messages %}{% do seen.append(m) %}{% endfor %}{{ seen }}",
    "no_macro_reads_messages": (
        "{% macro last() %}{{ messages[-1].content }}{% endmacro %}"
        "{% for m in messages %}{{ m.content }}{{ last() }}{% endfor %}"
    ),
}


def _compiled(source: str) -> Template:
    if "{% do" in source:  # the sandbox has no ``do`` tag; an environment with the extension still reaches here
        return jinja2.Environment(extensions=["jinja2.ext.do"]).from_string(source)
    return compile_template(source)


def _refusal(source: str) -> Refusal:
    found = try_split(_compiled(source), source)
    assert isinstance(found, Refusal), source
    assert split_template(_compiled(source), source) is None
    return found


def test_every_check_has_a_template_it_refuses() -> None:
    assert set(REFUSED) == set(CHECKS)


@pytest.mark.parametrize("check", sorted(REFUSED))
def test_a_refused_template_names_the_check_that_refused_it(check: str) -> None:
    refusal = _refusal(REFUSED[check])
    assert refusal.check == check
    assert refusal.reason


def test_reasons_say_what_was_found_and_where() -> None:
    assert _refusal(REFUSED["loop_position_only"]).reason == (
        "the body reads loop.length (line 1); only loop.first, loop.index, loop.index0, loop.last are per message"
    )
    assert _refusal(REFUSED["one_message_loop"]).reason.startswith("2 top-level loops over `messages`")
    inside_if = "{% if messages %}{% for m in messages %}{{ m.content }}{% endfor %}{% endif %}"
    assert _refusal(inside_if).reason.startswith("no top-level `{% for ... in messages %}` loop")
    multiline = "{% for m in messages %}\n{{ m.content }}\n{% set ns.n = 1 %}{% endfor %}"
    assert _refusal(multiline).reason.endswith("(line 3)")


def test_a_template_whose_source_does_not_parse_is_refused_as_such() -> None:
    found = try_split(compile_template("{{ messages }}"), "{% for m in messages %}")
    assert isinstance(found, Refusal)
    assert found.check == "parses"


def test_a_template_that_passes_every_check_is_cut() -> None:
    source = "<s>{% for m in messages %}[{{ m.role }}:{{ messages[loop.index0 - 1].content }}]{% endfor %}</s>"
    split = try_split(compile_template(source), source)
    assert isinstance(split, SplitTemplate)
    assert split.reach == 1
    assert not split.positional
    assert split.reads == frozenset({"m", "loop", "messages"})  # the body on its own: its loop names are free


VENDORED = sorted(p.stem for p in (ASSETS / "templates").glob("*.jinja")) if ASSETS.exists() else []


def test_vendored_templates_are_split_or_refused_with_a_named_check() -> None:
    assert VENDORED
    checks: dict[str, str] = {}
    for name in VENDORED:
        source = template(name)
        found = try_split(compile_template(source), source)
        assert (split_template(compile_template(source), source) is None) == isinstance(found, Refusal)
        if isinstance(found, Refusal):
            assert found.check in CHECKS, (name, found)
            checks[name] = found.check
    # Llama, Qwen 2.5 and Qwen3 are cut; these are refused for the reason their templates give.
    assert {"meta-llama-Llama-3.3-70B-Instruct", "Qwen-Qwen2.5-7B-Instruct", "Qwen-Qwen3-0.6B"}.isdisjoint(checks)
    assert "deepseek-ai-DeepSeek-V3.1" not in checks  # a quiet scan of the system prompts, then state carried
    assert "ibm-granite-granite-4.0" not in checks  # its namespace is made in the body, new for every message
    assert checks["Qwen3.5-4B"] == "loop_position_only"  # loop.previtem
    assert checks["openbmb-MiniCPM5-1B"] == "no_impure_calls"
    # Their macros each make a namespace for themselves (Gemma 4's also scans for the previous message that is
    # not a tool result, and writes the results that follow a call: both are taken out as scans).
    assert {"GigaChat3-10B-A1.8B", "google-gemma-4-31B-it"}.isdisjoint(checks)
