"""The ``contextkeeper count`` and ``demo`` commands."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

import contextkeeper as ck
from assets import template, tokenizer_dir
from contextkeeper.cli import main
from conversations import TOOLS, tool_round


def _files(tmp_path: Path) -> tuple[Path, Path, Path]:
    messages = tmp_path / "messages.json"
    tools = tmp_path / "tools.json"
    chat_template = tmp_path / "template.jinja"
    messages.write_text(json.dumps(tool_round()))
    tools.write_text(json.dumps(TOOLS))
    chat_template.write_text(template("Qwen-Qwen2.5-7B-Instruct"))
    return messages, tools, chat_template


def test_count_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    messages, tools, chat_template = _files(tmp_path)
    argv = ["count", "--tokenizer", str(tokenizer_dir("qwen2")), "--chat-template", str(chat_template)]
    assert main([*argv, "--messages", str(messages), "--tools", str(tools), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    counter = ck.load_counter(str(tokenizer_dir("qwen2")), chat_template=template("Qwen-Qwen2.5-7B-Instruct"))
    assert out["tokens"] == counter.count(tool_round(), tools=TOOLS)
    slots = ("system", "tools", "history", "request", "template_overhead")
    assert sum(out[s] for s in slots) == out["tokens"]
    assert out["piece_counting"] is True
    assert out["estimated"] is False


def test_count_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    messages, tools, chat_template = _files(tmp_path)
    argv = ["count", "--tokenizer", str(tokenizer_dir("qwen2")), "--chat-template", str(chat_template)]
    assert main([*argv, "--messages", str(messages), "--tools", str(tools)]) == 0
    table = capsys.readouterr().out
    for label in ("system", "tools", "history", "request", "template_overhead", "total"):
        assert label in table


def test_count_with_a_bad_messages_file_names_the_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    messages = tmp_path / "m.json"
    messages.write_text(json.dumps([{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}]))
    assert main(["count", "--tokenizer", "mistral:tekken", "--messages", str(messages)]) == 2
    err = capsys.readouterr().err
    assert "InvalidMessage" in err
    assert "message 1" in err


def test_count_console_script_with_mistral(tmp_path: Path) -> None:
    messages, tools, _ = _files(tmp_path)
    command = [sys.executable, "-m", "contextkeeper", "count", "--tokenizer", "mistral:tekken"]
    done = subprocess.run(
        [*command, "--messages", str(messages), "--tools", str(tools), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    out = json.loads(done.stdout)
    assert out["tokens"] == ck.load_counter("mistral:tekken").count(tool_round(), tools=TOOLS)


def test_count_demo_runs_offline(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--count", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    turns = out["turns"]
    assert [t["last"] for t in turns] == ["user", "tool", "user", "tool", "user"]
    assert all(t["tokens"] > 0 for t in turns)
    assert all(b["tokens"] > a["tokens"] for a, b in itertools.pairwise(turns))


def test_chat_demo_fits_every_call_under_the_gpu_limit(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "GPU" in out["limit_source"]
    assert out["limit"] < 32768
    for turn in out["turns"]:
        assert turn["tokens"] + turn["answer"] <= out["limit"]
        assert turn["kv_bytes"] > 0
        assert 0 < turn["gpu_share"] < 1
    assert any(turn["actions"] for turn in out["turns"])  # the chat outgrew the limit and was fitted
    assert out["removed_from_prompts"] > 0
    last = out["turns"][-1]
    assert sum(last[k] for k in ("system", "tools", "history", "request")) <= last["tokens"]
