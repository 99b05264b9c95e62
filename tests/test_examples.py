"""The runnable examples run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_count_conversation_example() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "count_conversation.py")], capture_output=True, text=True, check=True
    )
    assert "prompt tokens for 11 messages" in done.stdout
    assert "after one more turn" in done.stdout


def test_plan_gpu_example() -> None:
    done = subprocess.run([sys.executable, str(EXAMPLES / "plan_gpu.py")], capture_output=True, text=True, check=True)
    assert "vllm" in done.stdout
    assert "RTX 4090, 4 × 32K on vLLM: does not fit" in done.stdout
    assert "cheapest GPU options" in done.stdout
