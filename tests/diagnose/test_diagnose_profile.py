"""profile: the VRAM test sequence on tiny random-weight models; the cache bytes are the real tensors' storage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from contextkeeper.diagnose import ProfileReport, cache_bytes, load_model, plot_profile, profile  # noqa: E402
from contextkeeper.diagnose.profile import find_jumps, fit_slope  # noqa: E402
from contextkeeper.memory import ModelSpec  # noqa: E402
from tiny_models import TINY_LLAMA, TINY_MISTRAL  # noqa: E402

LENGTHS = (16, 32, 64)


@pytest.fixture(scope="module")
def report() -> ProfileReport:
    return profile(TINY_LLAMA, device="cpu", lengths=LENGTHS, new_tokens=(2, 4), batches=(1, 2))


def _hand_count(tokens: int, batch: int) -> int:
    layers, kv_heads, head_dim, fp32 = 2, 2, 16, 4
    return 2 * layers * kv_heads * head_dim * tokens * batch * fp32


def test_the_sequence_has_every_step(report: ProfileReport) -> None:
    phases = [(r.phase, r.batch, r.prompt_tokens, r.new_tokens) for r in report.rows]
    assert phases == [
        *(("prompt", 1, n, 0) for n in LENGTHS),
        ("generate", 1, 16, 2),
        ("generate", 1, 16, 4),
        ("concurrency", 1, 16, 0),
        ("concurrency", 2, 16, 0),
    ]
    assert report.device == "cpu"
    assert report.dtype == "fp32"
    assert report.random_weights
    assert report.weights_bytes > 0
    assert report.baseline_bytes is not None


def test_cache_bytes_are_the_real_tensors_and_match_the_prediction(report: ProfileReport) -> None:
    for row in report.rows:
        # the hand count of the textbook formula, and the memory model's prediction, both equal the real storage
        assert row.cache_bytes == _hand_count(row.tokens, row.batch), row
        assert row.exact, row
    assert report.exact


def test_the_series_are_monotone_and_the_slope_matches(report: ProfileReport) -> None:
    for phase in ("prompt", "generate", "concurrency"):
        sizes = [r.cache_bytes for r in report.rows if r.phase == phase]
        assert sizes == sorted(sizes)
        assert len(set(sizes)) == len(sizes)
    assert report.slope == pytest.approx(512.0)
    assert report.predicted_per_token == 512
    assert report.ratio == pytest.approx(1.0)
    assert report.intercept == pytest.approx(0.0, abs=1e-6)


def test_generation_caches_prompt_plus_new_minus_one(report: ProfileReport) -> None:
    generated = [r for r in report.rows if r.phase == "generate"]
    # the last sampled token is not in the cache yet
    assert [r.tokens for r in generated] == [16 + 2 - 1, 16 + 4 - 1]


def test_peaks_are_measured_on_linux(report: ProfileReport) -> None:
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("the resident set's high-water mark cannot be reset here")
    prompt = [r for r in report.rows if r.phase == "prompt"]
    assert all(r.peak_bytes is not None for r in prompt)
    assert report.peak_per_token is not None


def test_json_table_and_plot(report: ProfileReport, tmp_path: Path) -> None:
    data = json.loads(json.dumps(report.to_dict()))
    assert data["kv_bytes_per_token"]["predicted"] == 512
    assert data["exact"] is True
    assert len(data["rows"]) == len(report.rows)
    assert {"cache_bytes", "predicted_bytes", "peak_bytes", "workspace_bytes"} <= set(data["rows"][0])
    text = report.table()
    assert "KV bytes per token: measured 512.0" in text
    assert "ratio 1.0000" in text
    png = plot_profile(report, tmp_path / "profile.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sliding_window_model_is_exact_too() -> None:
    result = profile(TINY_MISTRAL, device="cpu", lengths=(8, 24), new_tokens=(12,), batches=(2,))
    assert result.exact, [r for r in result.rows if not r.exact]
    decoded = next(r for r in result.rows if r.phase == "generate")
    # after decoding, each sliding layer keeps `window` rows, not the 8 + 12 - 1 tokens seen (+ an int64 counter)
    assert decoded.cache_bytes == 2 * (2 * 2 * 16 * 8 * 4 + 8)


def test_cache_bytes_counts_the_storage_a_view_pins() -> None:
    base = torch.zeros(4, 100)
    holder = {"layers": [base[:, :10], base[:, 10:20]], "other": [torch.ones(3, dtype=torch.float16)]}
    # two views of one 1,600-byte storage count once, in full; the fp16 tensor adds 6 bytes
    assert cache_bytes(holder) == 1600 + 6


def test_loading_a_folder_without_weights_builds_random_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**TINY_LLAMA, "torch_dtype": "bfloat16"}))
    loaded = load_model(tmp_path, device="cpu")
    assert loaded.random_weights
    assert loaded.dtype == "bf16"
    assert next(loaded.model.parameters()).dtype == torch.bfloat16
    assert ModelSpec.from_config(loaded.config).dtype.name == "bf16"


def test_jumps_flag_a_step_far_above_the_rate() -> None:
    linear = [(f"{n}", float(n), 5_000_000 + 1000 * n) for n in (100, 200, 300, 400)]  # a fixed part + per token
    assert find_jumps("prompt", linear, floor=1) == []
    jumped = [*linear, ("800", 800.0, 5_400_000 + 50_000_000)]
    (jump,) = find_jumps("prompt", jumped, floor=1)
    assert (jump.before, jump.after) == ("400", "800")
    assert jump.expected == 5_400_000  # the average so far (13.5 kB per token) over 400 more tokens
    assert "attention" in jump.hint
    quadratic = [(f"{n}", float(n), 100 * n * n) for n in (256, 512, 1024, 2048)]
    assert len(find_jumps("prompt", quadratic, factor=2.0, floor=1)) == 3  # each doubling costs 3× the average


def test_fit_slope() -> None:
    assert fit_slope([1, 2, 3], [5, 7, 9]) == pytest.approx((2.0, 3.0))
    assert fit_slope([4], [9]) == (0.0, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_profile_on_cuda_measures_allocator_peaks() -> None:
    result = profile({**TINY_LLAMA, "torch_dtype": "bfloat16"}, device="cuda", lengths=(64, 128, 256), batches=(1, 4))
    assert result.device == "cuda"
    assert result.exact
    assert result.ratio == pytest.approx(1.0)
    for row in result.rows:
        assert row.peak_bytes is not None
        assert row.peak_bytes >= row.cache_bytes
        assert row.reserved_peak is not None
