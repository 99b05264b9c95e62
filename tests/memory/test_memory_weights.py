"""Weights: the parameter count from a config equals the parameters transformers really builds for it (on the
meta device: no memory), for every catalog model; safetensors metadata is read without loading weights."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from contextkeeper.memory import ModelSpec, param_count, weights_report  # noqa: E402
from contextkeeper.memory import catalog as model_catalog  # noqa: E402
from contextkeeper.memory.config import text_config  # noqa: E402


def _meta_params(config: dict[str, Any]) -> int:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    built = transformers.AutoConfig.for_model(**text_config(config))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(built)
    return int(sum(p.numel() for p in model.parameters()))


@pytest.mark.parametrize("entry", model_catalog.models(), ids=lambda e: e.name)
def test_param_count_equals_transformers_model(entry: model_catalog.CatalogModel) -> None:
    assert param_count(ModelSpec.from_config(entry.config)).total == _meta_params(entry.config)


def test_moe_active_parameters() -> None:
    # Mixtral 8x7B: ~12.9B of its 46.7B parameters are used per token (2 of 8 experts).
    counts = param_count(ModelSpec.from_config("mixtral-8x7b"))
    assert counts.total == 46_702_792_704
    assert 12.8e9 < counts.active < 13.0e9
    assert counts.experts == 32 * 8 * 3 * 4096 * 14336


def test_weights_dtype_choices() -> None:
    model = ModelSpec.from_config("llama-3.1-8b")
    counts = param_count(model)
    bf16 = weights_report(model)
    assert (bf16.bytes, bf16.source, bf16.dtype) == (2 * counts.total, "config", "bf16")
    fp8 = weights_report(model, "fp8")
    assert fp8.bytes == counts.linear + 2 * (counts.total - counts.linear)  # embeddings stay 16-bit
    int4 = weights_report(model, "int4")
    groups = counts.linear // 256
    assert int4.bytes == 133 * groups + 2 * (counts.total - counts.linear)  # 4.16 bits per quantised weight
    q4 = weights_report(model, "q4_0")
    assert q4.bytes == counts.linear // 32 * 18 + 2 * (counts.total - counts.linear)


def test_released_quantisation_is_the_default() -> None:
    gpt_oss = ModelSpec.from_config("gpt-oss-20b")
    report = weights_report(gpt_oss)
    counts = param_count(gpt_oss)
    assert report.dtype == "bf16+mxfp4"
    assert report.bytes == counts.experts // 32 * 17 + 2 * (counts.total - counts.experts)
    assert 12.5 * 2**30 < report.bytes < 13.5 * 2**30  # the released checkpoint is about 13 GB


def test_vision_tower_parameters_come_from_the_catalog() -> None:
    gemma = ModelSpec.from_config("gemma-3-27b")
    report = weights_report(gemma)
    text_only = param_count(gemma).total
    assert gemma.published_params is not None
    assert gemma.published_params > text_only
    assert report.params == gemma.published_params
    assert report.bytes == 2 * gemma.published_params
    assert any("vision" in note for note in report.notes)


def test_weights_from_safetensors_metadata(tmp_path: Path) -> None:
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=256
    )
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    held = sum(t.numel() * t.element_size() for t in model.state_dict().values() if t.data_ptr())
    single = tmp_path / "single"
    model.save_pretrained(single)
    spec = ModelSpec.from_config(single)
    report = weights_report(spec, folder=single)
    assert report.source == "safetensors headers"
    unique = sum(p.numel() * p.element_size() for p in model.parameters())
    assert report.bytes == unique <= held
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    from_index = weights_report(ModelSpec.from_config(sharded), folder=sharded)
    assert from_index.source == "safetensors index"
    assert from_index.bytes == unique
    assert param_count(spec).total == sum(p.numel() for p in model.parameters())


def _header(text: bytes) -> bytes:
    return len(text).to_bytes(8, "little") + text


@pytest.mark.parametrize(
    "content",
    [
        (10**15).to_bytes(8, "little") + b"{}",  # a header size no safetensors file has: nothing is read for it
        _header(b'{"w": [1, 2]}'),  # a tensor entry without data_offsets
        _header(b'{"w": {"data_offsets": [0, "x"]}}'),
        _header(b"[1]"),
    ],
)
def test_a_bad_safetensors_header_is_a_model_config_error(tmp_path: Path, content: bytes) -> None:
    import contextkeeper as ck

    (tmp_path / "model.safetensors").write_bytes(content)
    spec = ModelSpec.from_config({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64})
    with pytest.raises(ck.ModelConfigError, match="safetensors"):
        weights_report(spec, folder=tmp_path)
