"""profile runs its test sequence as steps: the baseline, then one step per prompt length, generation length and
batch, each reported to ``progress`` as it ends (the calls the single-function profile made, issue 35)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from contextkeeper.diagnose import profile
from tiny_models import TINY_LLAMA


def test_progress_reports_the_baseline_then_each_step_in_order() -> None:
    calls: list[tuple[int, int, str]] = []
    report = profile(
        TINY_LLAMA,
        device="cpu",
        lengths=(8, 16),
        new_tokens=(2,),
        batches=(2,),
        progress=lambda done, total, label: calls.append((done, total, label)),
    )
    assert calls == [
        (0, 5, "warm-up and baseline"),
        (1, 5, "baseline"),
        (2, 5, "prompt 1 × 8"),
        (3, 5, "prompt 1 × 16"),
        (4, 5, "generate 1 × 8 + 2"),
        (5, 5, "concurrency 2 × 8"),
    ]
    assert [(r.phase, r.batch, r.prompt_tokens, r.new_tokens, r.tokens) for r in report.rows] == [
        ("prompt", 1, 8, 0, 8),
        ("prompt", 1, 16, 0, 16),
        ("generate", 1, 8, 2, 9),
        ("concurrency", 2, 8, 0, 8),
    ]
