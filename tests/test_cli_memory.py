"""The ``contextkeeper kv``, ``plan`` and ``recommend`` commands (DESIGN.md §4 contracts)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import contextkeeper as ck
from contextkeeper.cli import main


def _json(capsys: pytest.CaptureFixture[str], argv: list[str], code: int = 0) -> dict[str, object]:
    assert main(argv) == code
    out: dict[str, object] = json.loads(capsys.readouterr().out)
    return out


def test_kv_json_contract(capsys: pytest.CaptureFixture[str]) -> None:
    out = _json(capsys, ["kv", "--model", "llama-3.1-8b", "--tokens", "16384", "--runtime", "vllm", "--json"])
    assert out["bytes"] == 2_147_483_648
    assert out["bytes_per_token"] == 131_072
    assert out["runtime"] == "vllm"
    assert out["kv_dtype"] == "bf16"
    assert out["max_context"] == 131072


def test_kv_options_reach_the_runtime(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(ck.ModelSpec.from_config("deepseek-v3").config), encoding="utf-8")
    argv = ["kv", "--model", str(config), "--tokens", "1000", "--sequences", "2", "--runtime", "vllm"]
    out = _json(capsys, [*argv, "--kv-dtype", "fp8", "--tp", "8", "--json"])
    assert out["bytes"] == 2 * 1024 * 576 * 61  # latent replicated on each GPU, 64-token MLA blocks
    out = _json(capsys, ["kv", "--model", "llama-3.1-8b", "--tokens", "1000", "--runtime", "llama.cpp", "--json"])
    assert out["bytes"] == 1024 * 131_072


def test_kv_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["kv", "--model", "gemma-3-27b", "--tokens", "32768", "--runtime", "vllm"]) == 0
    text = capsys.readouterr().out
    assert "52 sliding, 10 full" in text
    assert "allocator padding" in text


def test_plan_json_contract(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "llama-3.1-8b", "--gpu", "H100", "--context", "32768", "--concurrency", "8"]
    out = _json(capsys, [*argv, "--json"])
    assert set(out) >= {"fits", "breakdown", "max_context", "max_concurrency", "advice"}
    breakdown = out["breakdown"]
    assert isinstance(breakdown, dict)
    assert set(breakdown) == {"weights", "kv_cache", "overhead", "prefill_peak", "total", "capacity"}
    assert out["fits"] is True
    assert breakdown["kv_cache"] == 8 * 4 * 2**30


def test_plan_that_does_not_fit_exits_1_with_ranked_fixes(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "llama-3.1-8b", "--gpu", "4090", "--context", "32768", "--concurrency", "4"]
    assert main(argv) == 1
    text = capsys.readouterr().out
    assert "NO (short by" in text
    assert text.index("[none]") < text.index("[model]") < text.index("[hardware]")
    assert "--kv-dtype fp8" in text


def test_plan_plot_is_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "plan.png"
    argv = ["plan", "--model", "qwen2.5-7b", "--gpu", "RTX 4090", "--context", "16384", "--concurrency", "2"]
    main([*argv, "--plot", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000
    assert "plot written" in capsys.readouterr().out


def test_recommend_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["recommend", "--model", "qwen2.5-7b", "--context", "32768", "--concurrency", "4", "--json"]
    out = _json(capsys, [*argv, "--kind", "consumer"])
    options = out["options"]
    assert isinstance(options, list)
    assert options
    assert all(o["kind"] == "consumer" for o in options)
    memories = [o["total_memory"] for o in options]
    assert memories == sorted(memories)


def test_errors_are_typed_and_say_what_to_pass(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["kv", "--model", "llama-3.1-8c", "--tokens", "10"]) == 2
    err = capsys.readouterr().err
    assert "UnknownModel" in err
    assert "meta-llama/Llama-3.1-8B-Instruct" in err
    assert main(["plan", "--model", "llama-3.1-8b", "--gpu", "RTX 4099", "--context", "10"]) == 2
    assert "UnknownGPU" in capsys.readouterr().err
    assert main(["kv", "--model", "llama-3.1-8b", "--tokens", "10", "--kv-dtype", "q9_0"]) == 2
    assert "--kv-dtype takes auto or one of" in capsys.readouterr().err


def test_console_script() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "contextkeeper", "kv", "--model", "gpt-oss-20b", "--tokens", "8192", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    out = json.loads(done.stdout)
    assert out["layers"] == {"sliding": 12, "full": 12}
