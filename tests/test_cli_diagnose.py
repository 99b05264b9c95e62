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
    assert captured.out == ""
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


def test_profile_rejects_bad_lengths(tiny_folder: Path) -> None:
    with pytest.raises(SystemExit, match="comma-separated integers"):
        main(["profile", "--model", str(tiny_folder), "--lengths", "16,abc"])
