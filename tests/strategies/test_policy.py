"""Policy files: each built-in file loads and keeps a sample conversation within budget with its model family's
real template; bad files fail with errors naming the file and the key; the files ship in the wheel."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

import contextkeeper as ck
from assets import template, tokenizer_dir
from contextkeeper.cli import main
from contextkeeper.keeper import ContextKeeper
from contextkeeper.strategies.policy import policy_files, resolve_policy
from conversations import TOOLS
from strategy_state import agent_chat, check_invariants, plain_chat

ROOT = Path(__file__).resolve().parents[2]

# Each built-in policy with a tokenizer + template of its family (real assets).
FAMILY: dict[str, tuple[str, str | None]] = {
    "default": ("qwen2", "Qwen-Qwen2.5-7B-Instruct"),
    "agent": ("qwen2", "Qwen-Qwen2.5-7B-Instruct"),
    "llama3": ("llama-bpe", "meta-llama-Llama-3.3-70B-Instruct"),
    "qwen3": ("qwen2", "Qwen-Qwen3-0.6B"),
    "gpt-oss": ("harmony-on-qwen2", "openai-gpt-oss-120b"),
    "deepseek": ("deepseek-v4", "deepseek-ai-DeepSeek-V3.1"),
    "mistral": ("mistral:tekken", None),
    "gemma": ("gemma-4", "google-gemma-2-2b-it"),
}


def test_every_policy_file_is_covered() -> None:
    assert sorted(p.stem for p in policy_files()) == sorted(FAMILY)


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_policy_keeps_a_long_conversation_within_budget(name: str) -> None:
    vocab, chat_template = FAMILY[name]
    tokenizer = vocab if vocab.startswith("mistral:") else str(tokenizer_dir(vocab))
    policy = resolve_policy(name)
    keeper = ContextKeeper(
        tokenizer, chat_template=template(chat_template) if chat_template else None, context_window=8192, policy=policy
    )
    # Gemma 2's template accepts only alternating user/assistant turns: no system, no tools.
    messages = plain_chat(60) if name == "gemma" else agent_chat(40)
    tools = None if name == "gemma" else TOOLS
    fit = keeper.fit(messages, tools=tools, max_tokens=1024)
    assert fit.tokens + 1024 <= 8192
    if hasattr(keeper.counter, "reference_count"):
        check_invariants(keeper, messages, fit, tools, 1024)
    assert fit.report.policy == name
    assert fit.report.actions  # something had to give


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "policy.toml"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('name = "x"\ncolour = "red"\n', r"colour = 'red': unknown key; the keys are name, description"),
        (
            'name = "x"\n[[steps]]\nstrategy = "compress_harder"\n',
            r"steps\[0\]\.strategy = 'compress_harder': unknown strategy",
        ),
        ('name = "x"\n[[steps]]\nstrategy = "truncate"\nmax_tokenz = 5\n', r"steps\[0\] \(truncate\).*max_tokenz"),
        ('name = "x"\n[[steps]]\nstrategy = "dedupe"\nwhen = "sometimes"\n', r"unknown trigger 'sometimes'"),
        ('name = "x"\nanswer_tokens = -1\n', r"answer_tokens"),
        ('name = "x\n', r"not valid TOML"),
    ],
)
def test_bad_policy_files_name_the_file_and_key(tmp_path: Path, text: str, message: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ck.PolicyError, match=message) as error:
        ck.load_policy(path)
    assert str(path) in str(error.value)


def test_triggers_compose(tmp_path: Path) -> None:
    path = _write(tmp_path, 'name = "x"\n[[steps]]\nstrategy = "dedupe"\nwhen = "over:0.5 & every:2 | always"\n')
    assert ck.load_policy(path).pipeline().steps


def test_auto_picks_the_family_policy() -> None:
    assert resolve_policy("auto", "meta-llama/Llama-3.1-8B-Instruct").name == "llama3"
    assert resolve_policy("auto", "Qwen/Qwen3-32B").name == "qwen3"
    assert resolve_policy("auto", "openai/gpt-oss-20b").name == "gpt-oss"
    assert resolve_policy("auto", "some/unknown-model").name == "default"
    with pytest.raises(ck.PolicyError, match="built-in policies"):
        resolve_policy("no-such-policy")


def test_policy_validate_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = str(ROOT / "strategies" / "default.toml")
    bad = _write(tmp_path, 'name = "x"\nbogus = 1\n')
    assert main(["policy", "validate", good]) == 0
    assert "ok:" in capsys.readouterr().out
    assert main(["policy", "validate", good, str(bad)]) == 1
    assert "bogus" in capsys.readouterr().err


def test_policies_ship_in_the_wheel(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
    )
    wheel = next(tmp_path.glob("contextkeeper-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for stem in FAMILY:
        assert f"contextkeeper/_policies/{stem}.toml" in names


def test_fit_command_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    messages = tmp_path / "messages.json"
    tools = tmp_path / "tools.json"
    chat_template = tmp_path / "template.jinja"
    conversation = agent_chat(30)
    messages.write_text(json.dumps(conversation))
    tools.write_text(json.dumps(TOOLS))
    chat_template.write_text(template("Qwen-Qwen2.5-7B-Instruct"))
    argv: list[Any] = ["fit", "--tokenizer", str(tokenizer_dir("qwen2")), "--chat-template", str(chat_template)]
    argv += ["--messages", str(messages), "--tools", str(tools), "--context", "4096", "--max-tokens", "512", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"messages", "tokens", "report"}
    assert out["tokens"] + 512 <= 4096
    counter = ck.load_counter(str(tokenizer_dir("qwen2")), chat_template=template("Qwen-Qwen2.5-7B-Instruct"))
    assert out["tokens"] == counter.count(out["messages"], tools=TOOLS)
    assert out["report"]["slots"]["answer"] == 512
    assert main(argv[:-1]) == 0
    assert "fit —" in capsys.readouterr().out
