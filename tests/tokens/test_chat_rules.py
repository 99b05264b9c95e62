"""Our chat-template environment (tokens/_chat_rules.py) is the one the installed transformers builds for
``apply_chat_template``: the same settings and names, and the same output (or the same refusal) for every fetched
template and conversation, and for the edges of each global and filter."""

from __future__ import annotations

from typing import Any

import pytest

from assets import ASSETS, template
from contextkeeper.tokens._sandbox import compile_template
from conversations import CONVERSATIONS, TOOLS

chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")


def theirs(source: str) -> Any:
    return chat_template_utils._compile_jinja_template(source)


def outcome(render: Any, **values: Any) -> str:
    try:
        return str(render(**values))
    except Exception as exc:  # both must refuse the same way
        return f"{type(exc).__name__}: {exc}"


def test_the_environment_has_transformers_settings_and_names() -> None:
    ours, reference = compile_template("{{ '' }}").environment, theirs("{{ '' }}").environment
    assert (ours.trim_blocks, ours.lstrip_blocks) == (reference.trim_blocks, reference.lstrip_blocks)
    assert ours.keep_trailing_newline == reference.keep_trailing_newline
    assert ours.autoescape == reference.autoescape

    def tags(env: Any) -> set[str]:
        return {tag for ext in env.extensions.values() for tag in ext.tags}

    assert tags(ours) == tags(reference)
    assert set(ours.filters) == set(reference.filters)
    assert set(ours.globals) == set(reference.globals)
    assert set(ours.tests) == set(reference.tests)


EDGES = [
    "{{ {'b': 'é<&>', 'a': [1, 2.5, None, true]} | tojson }}",
    "{{ {'b': 1, 'a': {'c': 'ü'}} | tojson(indent=2, sort_keys=true) }}",
    "{{ [1, 2] | tojson(separators=(',', ':')) }}",
    "{{ 'x' | tojson(ensure_ascii=true) }}{{ 'ü' | tojson(ensure_ascii=true) }}",
    "{{ raise_exception('no system role') }}",
    "{% set d = dict(a=1, b=2) %}{{ d.a }}{{ dict.fromkeys(['x', 'y'], 0) }}{{ dict([('k', 'v')]) }}",
    "{{ dict.items }}{{ dict.__class__ }}",
    "{% set ns = namespace(found=false, count=0) %}{% set ns.count = ns.count + 2 %}{{ ns.count }}{{ ns.found }}",
    "{% set ns = namespace(_hidden=1) %}{{ ns._hidden }}",
    "{% set ns = namespace() %}{% set ns._x = 1 %}{{ 'set' }}",
    "{% set ns = namespace({'a': 1}, b=2) %}{{ ns.a }}{{ ns.b }}",
    "{% set ns = namespace([('a', 1)] | map('list') | map('first') | list | length) %}",
    "{% set ns = namespace(self=3) %}{{ ns.self }}",
    "{{ strftime_now('%Y') | length }}",
    "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}",
    "{% for m in messages %}{% if m.role == 'user' %}{% continue %}{% endif %}{{ m.role }}{% endfor %}",
    "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}",
    "  {% if true %}\n  kept\n  {% endif %}\nend\n",
    "{{ ''.__class__ }}{{ messages.__len__ }}",
]


@pytest.mark.parametrize("source", EDGES)
def test_globals_filters_and_tags_render_as_transformers_renders_them(source: str) -> None:
    messages = [{"role": "system", "content": "a"}, {"role": "user", "content": "b"}]
    reference = outcome(theirs(source).render, messages=messages)
    assert outcome(compile_template(source).render, messages=messages) == reference
    assert outcome(compile_template(source, False).render, messages=messages) == reference


def _templates() -> list[str]:
    folder = ASSETS / "templates"
    return sorted(path.stem for path in folder.glob("*.jinja")) if folder.is_dir() else []


@pytest.mark.parametrize("name", _templates())
def test_every_fetched_template_renders_as_transformers_renders_it(name: str) -> None:
    source = template(name)
    reference, ours = theirs(source), compile_template(source)
    values = {"bos_token": "<s>", "eos_token": "</s>", "add_generation_prompt": True}
    for shape, make in CONVERSATIONS.items():
        for tools in (None, TOOLS):
            messages = make()
            expected = outcome(reference.render, messages=messages, tools=tools, **values)
            assert outcome(ours.render, messages=messages, tools=tools, **values) == expected, (shape, tools is None)
