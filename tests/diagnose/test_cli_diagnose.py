"""`contextkeeper doctor` and `contextkeeper profile`: one JSON object with --json, a table without."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contextkeeper.cli import main
from tiny_models import TINY_LLAMA as TINY

SYMPTOMS = ["load", "long-prompt", "generation", "concurrent", "grows-over-time", "process-killed"]


@pytest.mark.parametrize("symptom", SYMPTOMS)
def test_doctor_json_for_every_symptom(symptom: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--symptom", symptom, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["symptom"] == symptom
    for cause in data["causes"]:
        assert {"cause", "why", "fixes"} <= set(cause)
        assert all({"action", "setting", "cost"} <= set(fix) for fix in cause["fixes"])


def test_doctor_with_facts(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["doctor", "--symptom", "concurrent", "--model", "llama-3.1-8b", "--gpu", "RTX 4090"]
    argv += ["--context", "32768", "--concurrency", "4", "--runtime", "vllm"]
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    first = data["causes"][0]
    assert first["key"] == "kv-concurrency"
    assert first["over"] is True
    assert "16.00 GiB" in first["evidence"]
    assert data["facts"]["concurrency"] == 4
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert text.startswith("doctor — out of memory with concurrent requests")
    assert "<- this pool overflows" in text
    assert "numbers: your KV for 4 × 32,768 tokens is 16.00 GiB" in text


def test_doctor_unknown_symptom(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--symptom", "slow", "--json"]) == 2
    captured = capsys.readouterr()
    error = json.loads(captured.out)["error"]  # with --json the error is on stdout too, as one JSON object
    assert error["type"] == "UnknownSymptom"
    assert "load, long-prompt" in error["message"]
    assert captured.err.count("\n") == 1
    assert "UnknownSymptom" in captured.err
    assert "load, long-prompt, generation, concurrent, grows-over-time, process-killed" in captured.err


@pytest.fixture
def tiny_folder(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    return tmp_path


def test_profile_json_and_plot(tiny_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    png = tmp_path / "profile.png"
    argv = ["profile", "--model", str(tiny_folder), "--device", "cpu", "--lengths", "16,48", "--new-tokens", "2"]
    argv += ["--batches", "1,2", "--plot", str(png), "--json"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)  # one JSON object, nothing else on stdout
    assert captured.err.count("[") == 0  # no progress bar under --json
    assert data["exact"] is True
    assert data["kv_bytes_per_token"]["measured"] == pytest.approx(512.0)
    assert data["kv_bytes_per_token"]["predicted"] == 512
    assert [r["phase"] for r in data["rows"]] == ["prompt", "prompt", "generate", "concurrency", "concurrency"]
    assert data["plot"] == str(png)
    assert png.stat().st_size > 1000


def test_profile_table_with_progress(tiny_folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    argv = ["profile", "--model", str(tiny_folder), "--device", "cpu", "--lengths", "16,32", "--new-tokens", "2"]
    assert main([*argv, "--batches", "1"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("profile — ")
    assert "KV bytes per token: measured 512.0" in captured.out
    assert "5/5" in captured.err  # the progress bar reached the end


def test_profile_rejects_bad_lengths(tiny_folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "--model", str(tiny_folder), "--lengths", "16,abc"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("contextkeeper: ConfigurationError: --lengths expects comma-separated integers")
    assert err.count("\n") == 1
    assert main(["profile", "--model", str(tiny_folder), "--lengths", "16,0"]) == 2
    assert "lengths must be an integer from 1 to" in capsys.readouterr().err


def test_profile_with_one_length_reports_what_it_measured(
    tiny_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One prompt length has no slope: the report says so and gives the step's own bytes, not "0.0, ratio 0"."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    argv = ["profile", "--model", str(tiny_folder), "--device", "cpu", "--lengths", "16", "--new-tokens", "2"]
    assert main([*argv, "--batches", "1", "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "measured 0.0" not in text
    assert "ratio 0.0000" not in text
    assert "one prompt length (16 tokens), so no slope: its cache is 8,192 B (512.0 B per token on average)" in text
    assert "predicted 8,192 B" in text
    assert main([*argv, "--batches", "1", "--json"]) == 0
    per_token = json.loads(capsys.readouterr().out)["kv_bytes_per_token"]
    assert per_token["measured"] is None
    assert per_token["ratio"] is None
    assert per_token["predicted"] == 512
    assert per_token["method"] == "one prompt length"
