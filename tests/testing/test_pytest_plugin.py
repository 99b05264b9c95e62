"""The pytest plugin (issue 6): prompt_budget, the marker and [tool.contextkeeper], failure reports, snapshots.

Each test runs a small test suite through ``pytester`` with the offline tokenizer ``mistral:tekken``; the numbers
the plugin reports are checked against counts and fits made here.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import contextkeeper as ck
from contextkeeper.demo import load_sample
from contextkeeper.tokens.breakdown import split_slots

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[2]
# Inner runs skip the cache and hypothesis's plugin (its summary imports all of hypothesis, every run).
QUIET = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest")
HEAVY = ("transformers", "torch", "tokenizers", "mistral_common", "sentence_transformers")
HEADER = """
import pytest
import contextkeeper as ck
from contextkeeper.demo import load_sample

MESSAGES, TOOLS = load_sample()
"""


def module(body: str) -> str:
    return HEADER + textwrap.dedent(body)


@pytest.fixture(scope="module")
def sample() -> dict[str, Any]:
    messages, tools = load_sample()
    counter = ck.load_counter("mistral:tekken")
    return {
        "messages": messages,
        "tools": tools,
        "counter": counter,
        "parts": ck.breakdown(counter, messages, tools=tools),
    }


def n(value: int) -> str:
    return f"{value:,}"


# ------------------------------------------------------------------------------------------------ budgets


def test_passing_and_failing_budgets(pytester: pytest.Pytester, sample: dict[str, Any]) -> None:
    tokens = sample["parts"].tokens
    pytester.makepyfile(
        test_budgets=module(f"""
        def test_fits(prompt_budget):
            budget = prompt_budget(tokenizer="mistral:tekken", context_window=8192, max_tokens=1024)
            check = budget.assert_fits(MESSAGES, TOOLS)
            assert check.tokens == budget.count(MESSAGES, TOOLS) == {tokens}
            assert check.headroom == 8192 - {tokens} - 1024
            assert (budget.limit, budget.limit_source, budget.max_tokens) == (8192, "context_window", 1024)

        def test_fit_is_the_keepers_and_independent_of_earlier_fits(prompt_budget):
            budget = prompt_budget(tokenizer="mistral:tekken", context_window=2048, max_tokens=256)
            first = budget.fit(MESSAGES, TOOLS)
            assert isinstance(first, ck.Fit)
            assert first.tokens + 256 <= 2048 and first.messages[-1] == MESSAGES[-1]
            assert first.tokens == budget.count(first.messages, TOOLS)
            again = budget.fit(list(MESSAGES), TOOLS)  # a fresh keeper each time: the same answer
            assert (again.tokens, again.messages) == (first.tokens, first.messages)

        def test_default_answer_reserve_is_the_policys(prompt_budget):
            budget = prompt_budget(tokenizer="mistral:tekken", context_window=8192)
            assert budget.max_tokens == 1024

        def test_overflows(prompt_budget):
            prompt_budget(tokenizer="mistral:tekken", context_window=2048, max_tokens=256).assert_fits(MESSAGES, TOOLS)
        """)
    )
    result = pytester.runpytest(*QUIET)
    result.assert_outcomes(passed=3, failed=1)
    out = result.stdout.str()
    assert "prompt does not fit" in out
    assert "explain_overflow" not in out
    assert "def assert_fits" not in out


def run_failure(pytester: pytest.Pytester, body: str) -> str:
    pytester.makepyfile(test_failure=module(body))
    result = pytester.runpytest(*QUIET)
    result.assert_outcomes(failed=1)
    # The message as the developer sees it, without pytest's "E   " prefixes.
    return "\n".join(line[4:] if line.startswith("E   ") else line for line in result.stdout.lines)


def test_failure_text_slot_table_overflow_and_checked_fixes(pytester: pytest.Pytester, sample: dict[str, Any]) -> None:
    messages, tools, counter, parts = sample["messages"], sample["tools"], sample["counter"], sample["parts"]
    out = run_failure(
        pytester,
        """
        @pytest.mark.contextkeeper(tokenizer="mistral:tekken", context_window=2048, max_tokens=256)
        def test_overflows(prompt_budget):
            prompt_budget().assert_fits(MESSAGES, TOOLS)
        """,
    )
    need = parts.tokens + 256
    over = need - 2048
    assert (
        f"prompt does not fit: {n(parts.tokens)} prompt tokens + 256 reserved for the answer = {n(need)}, over the "
        f"limit of 2,048 by {n(over)} tokens"
    ) in out
    # The slot table: every slot, the answer reserve, the window and the overflow.
    for label, value in [
        ("system", parts.system),
        ("tools", parts.tools),
        ("history", parts.history),
        ("request", parts.request),
        ("template overhead", parts.template_overhead),
        ("answer reserve", 256),
        ("total", need),
        ("context window", 2048),
        ("over by", over),
    ]:
        assert re.search(rf"^\s+{label}\s+{re.escape(n(value))}\b", out, re.M), (label, value, out)
    assert "max_tokens (@pytest.mark.contextkeeper)" in out
    # Fixes, each verified here.
    assert f"raise context_window to >= {n(need)}" in out
    assert f"max_tokens alone cannot fix it: the prompt by itself ({n(parts.tokens)})" in out
    assert (
        f"the tools alone cost {n(parts.tools)} tokens: without them the prompt is {n(parts.tokens - parts.tools)} "
        "(would fit)"
    ) in out
    assert "largest: search_flights" in out
    dropped = re.search(r"drop the (\d+) oldest of (\d+) history unit\(s\).*the prompt becomes ([\d,]+) tokens", out)
    assert dropped, out
    k, total_units, becomes = int(dropped[1]), int(dropped[2]), int(dropped[3].replace(",", ""))
    conversation = ck.Conversation.from_messages(messages)
    end_system, start_request = split_slots(conversation)
    units = [u for u in conversation.units() if end_system <= u.start and u.stop <= start_request]
    assert total_units == len(units)

    def without(k: int) -> int:
        kept = [messages[i] for unit in units[k:] for i in unit.indices]
        return counter.count([*messages[:end_system], *kept, *messages[start_request:]], tools=tools)

    assert without(k) == becomes
    assert becomes + 256 <= 2048 < without(k - 1) + 256
    policy = re.search(r"policy 'default' \(budget.fit / keeper.fit\) would fit it in ([\d,]+) tokens", out)
    assert policy, out
    fit = ck.ContextKeeper("mistral:tekken", context_window=2048).fit(messages, tools=tools, max_tokens=256)
    assert int(policy[1].replace(",", "")) == fit.tokens
    assert "tokenizer mistral:tekken; settings: tokenizer='mistral:tekken' (@pytest.mark.contextkeeper)" in out


def test_failure_text_max_tokens_and_gpu_fixes(pytester: pytest.Pytester, sample: dict[str, Any]) -> None:
    parts = sample["parts"]
    out = run_failure(
        pytester,
        """
        def test_answer_too_big(prompt_budget):
            prompt_budget(tokenizer="mistral:tekken", context_window=2300, max_tokens=512).assert_fits(MESSAGES, TOOLS)
        """,
    )
    over = parts.tokens + 512 - 2300
    assert f"lower max_tokens by {n(over)} (to {n(512 - over)})" in out
    assert "max_tokens (argument)" in out

    gpu = {"model": "qwen2.5-7b", "gpu": "RTX 4090", "concurrency": 64}
    keeper = ck.ContextKeeper("mistral:tekken", context_window=32768, **gpu)  # type: ignore[arg-type]
    need = parts.tokens + 1024
    assert keeper.limit < need
    out = run_failure(
        pytester,
        f"""
        def test_gpu(prompt_budget):
            budget = prompt_budget(tokenizer="mistral:tekken", context_window=32768, max_tokens=1024, **{gpu!r})
            budget.assert_fits(MESSAGES, TOOLS)
        """,
    )
    assert re.search(rf"context window\s+{n(keeper.limit)}\s+the GPU \(NVIDIA GeForce RTX 4090", out), out
    most = ck.plan("qwen2.5-7b", "RTX 4090", context=need, concurrency=1).max_concurrency
    assert f"at concurrency=64: concurrency <= {most} leaves room for {n(need)}" in out


def test_configuration_errors_say_where_to_set_things(pytester: pytest.Pytester) -> None:
    # Not test_errors.py: a module of this suite has that name, and pytester runs in this process.
    pytester.makepyfile(
        test_bad_settings=module("""
        def test_no_window(prompt_budget):
            prompt_budget(tokenizer="mistral:tekken")

        @pytest.mark.contextkeeper(context_windw=10)
        def test_typo_in_marker(prompt_budget):
            prompt_budget(tokenizer="mistral:tekken")

        def test_bad_answer(prompt_budget):
            prompt_budget(tokenizer="mistral:tekken", context_window=100, max_tokens=0)
        """)
    )
    result = pytester.runpytest(*QUIET)
    result.assert_outcomes(failed=3)
    out = result.stdout.str()
    assert "set context_window=N" in out
    assert "[tool.contextkeeper] of pyproject.toml" in out
    assert "@pytest.mark.contextkeeper: unknown setting(s) 'context_windw'" in out
    assert "max_tokens must be a positive integer, got 0" in out


# ------------------------------------------------------------------------------------------------ defaults


def test_marker_and_pyproject_defaults_closest_wins(pytester: pytest.Pytester) -> None:
    pytester.makefile(
        ".toml",
        tiny='name = "tiny"\nanswer_tokens = 64\n\n[[steps]]\nstrategy = "dedupe"\n',
    )
    pytester.makepyprojecttoml(
        """
        [tool.contextkeeper]
        tokenizer = "mistral:tekken"
        context_window = 1000
        max_tokens = 100
        policy = "tiny.toml"

        [tool.contextkeeper.unrelated]
        left = "to other tools"
        """
    )
    pytester.makepyfile(
        test_defaults=module("""
        PYPROJECT, MARKER, ARGUMENT = "[tool.contextkeeper]", "@pytest.mark.contextkeeper", "argument"

        def test_pyproject(prompt_budget):
            budget = prompt_budget()
            assert (budget.tokenizer, budget.limit, budget.max_tokens, budget.policy) == (
                "mistral:tekken", 1000, 100, "tiny")
            assert dict(budget.settings.sources) == {
                "tokenizer": PYPROJECT, "context_window": PYPROJECT, "max_tokens": PYPROJECT, "policy": PYPROJECT}

        @pytest.mark.contextkeeper(context_window=3000, max_tokens=300)
        class TestMarked:
            def test_class_marker(self, prompt_budget):
                budget = prompt_budget()
                assert (budget.limit, budget.max_tokens, budget.policy) == (3000, 300, "tiny")
                assert budget.settings.source("context_window") == MARKER
                assert budget.settings.source("tokenizer") == PYPROJECT

            @pytest.mark.contextkeeper(max_tokens=400, policy="default")
            def test_closest_marker_wins(self, prompt_budget):
                budget = prompt_budget()
                assert (budget.limit, budget.max_tokens, budget.policy) == (3000, 400, "default")

            @pytest.mark.contextkeeper(max_tokens=400)
            def test_arguments_win(self, prompt_budget):
                budget = prompt_budget(context_window=4000, max_tokens=500)
                assert (budget.limit, budget.max_tokens) == (4000, 500)
                assert budget.settings.source("max_tokens") == ARGUMENT
                assert budget.settings.source("policy") == PYPROJECT
        """)
    )
    result = pytester.runpytest(*QUIET, "--strict-markers")  # the marker is registered
    result.assert_outcomes(passed=4)
    markers = pytester.runpytest(*QUIET, "--markers")
    markers.stdout.fnmatch_lines(["@pytest.mark.contextkeeper(tokenizer=*): defaults for the prompt_budget fixture*"])


def test_pyproject_unknown_key_is_reported(pytester: pytest.Pytester) -> None:
    pytester.makepyprojecttoml('[tool.contextkeeper]\ntokenizer = "mistral:tekken"\ncontext_windw = 1000\n')
    pytester.makepyfile(test_typo="def test_it(prompt_budget):\n    prompt_budget(context_window=10)\n")
    result = pytester.runpytest(*QUIET)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*pyproject.toml [[]tool.contextkeeper[]]: unknown setting(s) 'context_windw'*"])


# ------------------------------------------------------------------------------------------------ snapshots


def test_snapshot_create_compare_update(pytester: pytest.Pytester, sample: dict[str, Any]) -> None:
    messages, tools = sample["messages"], sample["tools"]
    window = pytester.path / "window.txt"
    window.write_text("2048")
    pytester.makepyfile(
        test_snap=module("""
        from pathlib import Path

        WINDOW = int(Path(__file__).with_name("window.txt").read_text())

        @pytest.mark.contextkeeper(tokenizer="mistral:tekken", max_tokens=256)
        def test_golden(prompt_budget):
            prompt_budget(context_window=WINDOW).snapshot(MESSAGES, TOOLS)

        def test_direct(prompt_snapshot):
            keeper = ck.ContextKeeper("mistral:tekken", context_window=4096)
            prompt_snapshot(keeper.fit(MESSAGES, tools=TOOLS, max_tokens=256), name="whole conversation")
        """)
    )
    folder = pytester.path / "__snapshots__" / "test_snap"
    golden, whole = folder / "test_golden.json", folder / "whole_conversation.json"

    first = pytester.runpytest(*QUIET)  # no snapshot yet: written, and the test fails once
    first.assert_outcomes(failed=2)
    first.stdout.fnmatch_lines(["*prompt snapshot *test_golden.json did not exist: it has been written*"])
    first.stdout.fnmatch_lines(["*contextkeeper prompt snapshots*", "wrote *test_golden.json"])
    fit = ck.ContextKeeper("mistral:tekken", context_window=2048).fit(messages, tools=tools, max_tokens=256)
    assert json.loads(golden.read_text()) == {"tokens": fit.tokens, "messages": fit.messages}
    assert json.loads(whole.read_text()) == {"tokens": sample["parts"].tokens, "messages": messages}

    pytester.runpytest(*QUIET).assert_outcomes(passed=2)  # unchanged: passes

    window.write_text("4096")  # the whole conversation now fits: the pinned prompt changes
    changed = pytester.runpytest(*QUIET)
    changed.assert_outcomes(passed=1, failed=1)
    out = changed.stdout.str()
    assert f"the fitted prompt changed from its snapshot {golden}" in out
    assert (
        f"tokens:   {n(fit.tokens)} -> {n(sample['parts'].tokens)} (+{n(sample['parts'].tokens - fit.tokens)})" in out
    )
    assert f"messages: {len(fit.messages)} -> {len(messages)}" in out
    assert "added: message(s) 1-4 of this run (user, assistant, tool, assistant)" in out
    assert "--- snapshot" in out
    assert "+++ this run" in out
    assert '+  "tokens": ' in out
    assert "accept it: pytest --update-prompt-snapshots" in out
    assert json.loads(golden.read_text())["tokens"] == fit.tokens  # not rewritten without the flag

    update = pytester.runpytest(*QUIET, "--update-prompt-snapshots")
    update.assert_outcomes(passed=2)
    update.stdout.fnmatch_lines(["updated *test_golden.json"])
    assert json.loads(golden.read_text()) == {"tokens": sample["parts"].tokens, "messages": messages}
    pytester.runpytest(*QUIET).assert_outcomes(passed=2)


# ------------------------------------------------------------------------------------------------ harmless


def test_importing_the_plugin_is_light() -> None:
    code = (
        "import sys, json, pytest, contextkeeper; import contextkeeper.testing.plugin; "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        f"{HEAVY!r} or m.startswith('contextkeeper.testing.'))))"
    )
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(done.stdout) == ["contextkeeper.testing.plugin"]
    cost = next(
        int(line.split("|")[1])
        for line in done.stderr.splitlines()
        if line.rstrip().endswith("contextkeeper.testing.plugin")
    )
    assert cost < 100_000, f"importing the plugin took {cost} µs"


def test_an_unrelated_suite_runs_unaffected(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_plain=f"""
        import sys

        def test_trivial(request):
            assert request.config.pluginmanager.hasplugin("contextkeeper")  # loaded from the entry point
            loaded = [m for m in sys.modules if m.split(".")[0] in {HEAVY!r}]
            assert not loaded, loaded
            assert "contextkeeper.testing.budget" not in sys.modules
            assert 1 + 1 == 2
        """
    )
    result = pytester.runpytest_subprocess(*QUIET)
    result.assert_outcomes(passed=1)
    assert "contextkeeper prompt snapshots" not in result.stdout.str()


def test_example_module_passes() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "examples/test_my_prompts.py", "-p", "no:cacheprovider", "-q"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "wrote" not in done.stdout  # its snapshot is committed next to it
