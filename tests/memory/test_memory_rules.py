"""Runtime KV rules on hand-checkable cases: each expected figure is worked out in the comment beside it from
the runtimes' sizing rules (docs/memory.md), not from our code."""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

import contextkeeper as ck
from contextkeeper.memory import ModelSpec, find_gpu, plan
from contextkeeper.memory.runtimes import runtime_profile

LLAMA_8B: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192},
    "torch_dtype": "bfloat16",
}
GIB = 2**30


@pytest.mark.parametrize("runtime", ["transformers", "vllm", "sglang", "llama.cpp"])
def test_seed_example_is_two_gib_on_every_runtime(runtime: str) -> None:
    # 2 × 32 layers × 8 KV heads × 128 dims × 16,384 tokens × 2 bytes
    assert ModelSpec.from_config(LLAMA_8B).kv_bytes(16384, runtime=runtime) == 2_147_483_648


def test_vllm_rounds_each_sequence_up_to_16_token_blocks() -> None:
    model = ModelSpec.from_config(LLAMA_8B)
    per_token = 2 * 32 * 8 * 128 * 2  # 131,072 B
    assert model.kv_bytes(16380, runtime="vllm") == 16384 * per_token
    assert model.kv_bytes(1, 3, runtime="vllm") == 3 * 16 * per_token
    assert model.kv_bytes(1, runtime="transformers") == per_token
    assert model.kv_bytes(16380, runtime="vllm", block_size=32) == 16384 * per_token


def test_vllm_concurrency_log_example() -> None:
    # kv_memory.md §2.1.5: 60 GiB of KV for Llama-3.1-8B at max_model_len 131,072 -> "3.75x" concurrency.
    per_request = ModelSpec.from_config(LLAMA_8B).kv_bytes(131072, runtime="vllm")
    assert per_request == 16 * GIB
    assert 60 * GIB / per_request == 3.75


def test_fp8_halves_and_q8_0_is_34_bytes_per_32_values() -> None:
    model = ModelSpec.from_config(LLAMA_8B)
    assert model.kv_bytes(16384, runtime="vllm", kv_dtype="fp8") == GIB
    # K row of 8 × 128 = 1,024 values -> 32 blocks × 34 B = 1,088 B; × 2 (K, V) × 32 layers × 16,384 tokens
    assert model.kv_bytes(16384, runtime="llama.cpp", kv_dtype="q8_0") == 1088 * 2 * 32 * 16384 == 1_140_850_688
    assert model.kv_bytes(16384, runtime="llama.cpp", kv_dtype="q4_0") == 576 * 2 * 32 * 16384  # 18 B / 32


def test_llama_cpp_pads_the_context_to_256_cells() -> None:
    model = ModelSpec.from_config(LLAMA_8B)
    assert model.kv_bytes(1000, runtime="llama.cpp") == 1024 * 131072
    assert model.kv_bytes(1000, 4, runtime="llama.cpp") == 4 * 1024 * 131072  # -np 4: one stream each
    # --kv-unified: one pool of 4,000 cells, padded to 4,096
    assert model.kv_bytes(1000, 4, runtime="llama.cpp", kv_unified=True) == 4096 * 131072


def test_tensor_parallel_splits_kv_heads_until_one_per_gpu() -> None:
    model = ModelSpec.from_config(LLAMA_8B)
    whole = model.kv_bytes(4096, runtime="vllm")
    assert model.kv_bytes(4096, runtime="vllm", tp=2) == whole // 2
    assert model.kv_bytes(4096, runtime="vllm", tp=8) == whole // 8
    assert model.kv_bytes(4096, runtime="vllm", tp=16) == whole // 8  # 8 heads: replicated beyond tp=8
    with pytest.raises(ck.ConfigurationError, match="cannot be split"):
        model.kv_bytes(4096, runtime="vllm", tp=3)


DEEPSEEK_V3: dict[str, Any] = {
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "vocab_size": 129280,
    "intermediate_size": 18432,
    "max_position_embeddings": 163840,
    "torch_dtype": "bfloat16",
}


def test_mla_latent_on_servers_and_decompressed_in_transformers() -> None:
    model = ModelSpec.from_config(DEEPSEEK_V3)
    # vLLM / SGLang: (512 + 64) × 2 B × 61 layers = 70,272 B per token; vLLM MLA blocks are 64 tokens
    assert model.kv(1024, runtime="vllm").bytes_per_token == 70_272
    assert model.kv_bytes(1000, runtime="vllm") == 1024 * 70_272
    assert model.kv_bytes(1000, runtime="sglang") == 1000 * 70_272
    # The latent is replicated on every GPU: tensor parallelism does not shrink it.
    assert model.kv_bytes(4096, runtime="vllm", tp=8) == model.kv_bytes(4096, runtime="vllm")
    # fp8: 576 B per layer; the packed fp8_ds_mla format: 656 B per layer
    assert model.kv(64, runtime="vllm", kv_dtype="fp8").bytes_per_token == 576 * 61
    assert model.kv(64, runtime="vllm", kv_dtype="fp8_ds_mla").bytes_per_token == 656 * 61
    # transformers 5 caches the latent too (4.x cached 128 heads × (192 + 128) × 2 B = 81,920 B per layer)
    assert model.kv(10, runtime="transformers").bytes_per_token == 70_272
    # llama.cpp since the V-less cache: K of 576 f16 values only; before it, V of 512 too.
    assert model.kv(256, runtime="llama.cpp").bytes_per_token == 576 * 2 * 61
    assert model.kv(256, runtime="llama.cpp", mla_cache="kv").bytes_per_token == (576 + 512) * 2 * 61


GEMMA3_27B: dict[str, Any] = {
    "model_type": "gemma3_text",
    "hidden_size": 5376,
    "intermediate_size": 21504,
    "num_hidden_layers": 62,
    "num_attention_heads": 32,
    "num_key_value_heads": 16,
    "head_dim": 128,
    "sliding_window": 1024,
    "vocab_size": 262208,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}


def test_gemma3_pattern_and_vllm_hybrid_padding_layers() -> None:
    model = ModelSpec.from_config(GEMMA3_27B)
    assert model.kinds() == {"sliding": 52, "full": 10}  # every 6th layer is global
    page_token = 2 * 16 * 128 * 2  # 8,192 B per layer and token
    tokens = 32768
    full = 10 * tokens * page_token
    # plan phase: cdiv(1024 - 1 + 8192, 16) + 1 = 577 blocks of 16 tokens; 52 sliding layers padded to 60
    sliding = 60 * 577 * 16 * page_token
    assert model.kv_bytes(tokens, runtime="vllm") == full + sliding
    # steady decoding: cdiv(1024, 16) + 1 = 65 blocks
    assert model.kv_bytes(tokens, runtime="vllm", phase="steady") == full + 60 * 65 * 16 * page_token
    # hybrid manager off: everything in full, no padding layers
    assert model.kv_bytes(tokens, runtime="vllm", hybrid_manager=False) == 62 * tokens * page_token
    # transformers: after a prefill the whole prompt stays resident in sliding layers (the window is a view);
    # while decoding, `window` rows; plus an 8-byte int64 window tensor per sliding layer
    assert model.kv_bytes(tokens, runtime="transformers") == 62 * tokens * page_token + 52 * 8
    assert model.kv_bytes(tokens, runtime="transformers", phase="steady") == full + 52 * (1024 * page_token + 8)
    # llama.cpp: SWA cache of pad256(1024 + 512) = 1,536 cells
    assert model.kv_bytes(tokens, runtime="llama.cpp") == full + 52 * 1536 * page_token
    assert model.kv_bytes(tokens, runtime="llama.cpp", swa_full=True) == 62 * tokens * page_token


def test_gpt_oss_alternates_and_needs_no_padding() -> None:
    config = {
        "model_type": "gpt_oss",
        "hidden_size": 2880,
        "num_hidden_layers": 24,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "sliding_window": 128,
        "vocab_size": 201088,
        "torch_dtype": "bfloat16",
    }
    model = ModelSpec.from_config(config)
    assert model.kinds() == {"sliding": 12, "full": 12}
    page_token = 2 * 8 * 64 * 2  # 2,048 B
    # transformers while decoding: 12 full layers × S + 12 sliding × 128 rows (+ 8 B each)
    assert model.kv_bytes(4096, runtime="transformers", phase="steady") == (12 * 4096 + 12 * 128) * page_token + 96
    # vLLM steady: cdiv(128, 16) + 1 = 9 blocks for sliding layers; 12 + 12 needs no padding
    assert model.kv_bytes(4096, runtime="vllm", phase="steady") == (12 * 4096 + 12 * 9 * 16) * page_token


QWEN3_NEXT: dict[str, Any] = {
    "model_type": "qwen3_next",
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "full_attention_interval": 4,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "vocab_size": 151936,
    "torch_dtype": "bfloat16",
}


def test_qwen3_next_hybrid_block_and_state_page_on_vllm() -> None:
    model = ModelSpec.from_config(QWEN3_NEXT)
    assert model.kinds() == {"recurrent": 36, "full": 12}
    profile = runtime_profile("vllm")
    layers, _ = profile.layers(model, model.dtype, ck.memory.RuntimeSettings())
    full = next(layer for layer in layers if layer.kind == "full")
    state = next(layer for layer in layers if layer.kind == "recurrent")
    # state: conv 3 × (2·16·128 + 32·128) × 2 B + 32 × 128 × 128 × 2 B = 49,152 + 1,048,576 = 1,097,728 B
    assert state.state_bytes == 1_097_728  # type: ignore[attr-defined]
    # attention page per token: 2 × 2 heads × 256 × 2 B = 2,048 B; block = 16 × cdiv(1,097,728, 16 × 2,048) = 544
    assert full.block == 544  # type: ignore[attr-defined]
    assert state.page_bytes == 544 * 2048 == 1_114_112  # type: ignore[attr-defined]
    # One request of 1,000 tokens: 12 full layers × 2 blocks of 544 + 36 states × 2 copies (align) × a page.
    assert model.kv_bytes(1000, runtime="vllm") == 12 * 1088 * 2048 + 36 * 2 * 1_114_112
    assert model.kv_bytes(1000, runtime="vllm", mamba_cache_mode="none") == 12 * 1088 * 2048 + 36 * 1_114_112


def test_qwen3_next_states_on_llama_cpp_are_f32() -> None:
    model = ModelSpec.from_config(QWEN3_NEXT)
    # (4 − 1) × 8,192 conv + 32 × 128 × 128 state, all F32: 98,304 + 2,097,152 B per layer and sequence
    state = 3 * 8192 * 4 + 32 * 128 * 128 * 4
    assert model.kv_bytes(256, 2, runtime="llama.cpp") == 2 * (12 * 256 * 2048 + 36 * state)


def test_window_rules_by_family() -> None:
    mistral = {**LLAMA_8B, "model_type": "mistral", "sliding_window": 4096}
    assert ModelSpec.from_config(mistral).kinds() == {"sliding": 32}
    # llama.cpp never implemented Mistral v0.1's window: the cache is full.
    assert ModelSpec.from_config(mistral).kv_bytes(8192, runtime="llama.cpp") == 8192 * 131072
    qwen2 = {**LLAMA_8B, "model_type": "qwen2", "sliding_window": 131072, "use_sliding_window": False}
    assert ModelSpec.from_config(qwen2).kinds() == {"full": 32}


def _transformers_before(*release: int) -> bool:
    """Whether the installed transformers predates ``release`` (absent: the newest rules apply)."""
    try:
        installed = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return False
    return tuple(int(part) for part in installed.split(".")[: len(release)]) < release


def test_kv_heads_field_zoo() -> None:
    falcon = {"model_type": "falcon", "hidden_size": 4544, "num_hidden_layers": 32, "num_attention_heads": 71}
    # multi_query without the new decoder architecture: one KV head of 4,544 / 71 = 64 dims
    mqa = ModelSpec.from_config({**falcon, "multi_query": True, "new_decoder_architecture": False})
    assert mqa.kv(1, runtime="transformers", kv_dtype="bf16").bytes_per_token == 2 * 32 * 1 * 64 * 2
    gqa = ModelSpec.from_config(
        {**falcon, "num_attention_heads": 64, "new_decoder_architecture": True, "num_kv_heads": 8}
    )
    head = 4544 // 64
    assert gqa.kv(1, runtime="vllm", kv_dtype="bf16").bytes_per_token == 2 * 32 * 8 * head * 2
    # transformers before 5.25 broadcast K and V to all 64 query heads before caching them; 5.25 caches the 8
    cached = 64 if _transformers_before(5, 25) else 8
    assert gqa.kv(1, kv_dtype="bf16").bytes_per_token == 2 * 32 * cached * head * 2
    gpt2 = ModelSpec.from_config(
        {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024}
    )
    assert gpt2.kv(1).bytes_per_token == 2 * 12 * 12 * 64 * 4  # no dtype in the config: float32
    assert gpt2.kv(1, runtime="vllm").kv_dtype == "fp16"  # vLLM serves float32 checkpoints in fp16
    assert gpt2.max_context == 1024
    mpt = {"model_type": "mpt", "d_model": 4096, "n_layers": 32, "n_heads": 32, "attn_config": {"kv_n_heads": 8}}
    assert ModelSpec.from_config(mpt).kv(1, runtime="vllm", kv_dtype="bf16").bytes_per_token == 131072
    assert ModelSpec.from_config(mpt).kv(1, kv_dtype="bf16").bytes_per_token == 4 * 131072  # transformers: all heads
    glm = {
        "model_type": "chatglm",
        "hidden_size": 4096,
        "num_layers": 28,
        "num_attention_heads": 32,
        "multi_query_attention": True,
        "multi_query_group_num": 2,
        "torch_dtype": "bfloat16",
    }
    assert ModelSpec.from_config(glm).kv(1).bytes_per_token == 2 * 28 * 2 * 128 * 2


def test_explicit_head_dim_wins_over_hidden_over_heads() -> None:
    nemo = {**LLAMA_8B, "hidden_size": 5120, "num_hidden_layers": 40, "head_dim": 128}  # 5120 / 32 would be 160
    assert ModelSpec.from_config(nemo).kv(1).bytes_per_token == 2 * 40 * 8 * 128 * 2


def test_max_context_follows_rope_scaling() -> None:
    assert ModelSpec.from_config(LLAMA_8B).max_context == 131072
    yarn = {
        **LLAMA_8B,
        "max_position_embeddings": 32768,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    }
    assert ModelSpec.from_config(yarn).max_context == 131072


def test_multimodal_wrapper_is_read_through_its_text_config() -> None:
    wrapper = {"model_type": "gemma3", "torch_dtype": "bfloat16", "text_config": dict(GEMMA3_27B, torch_dtype=None)}
    model = ModelSpec.from_config(wrapper)
    assert model.kinds() == {"sliding": 52, "full": 10}
    assert model.dtype.name == "bf16"


def test_catalog_names_resolve_offline() -> None:
    for name in ("llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", "Llama-3.1-8B-Instruct", "LLAMA 3.1 8B"):
        model = ModelSpec.from_config(name)
        assert model.name == "meta-llama/Llama-3.1-8B-Instruct"
        assert model.source == "catalog"
        assert model.kv_bytes(16384, runtime="vllm") == 2_147_483_648


# -------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_hidden_layers": None}, "no layer count"),
        ({"num_hidden_layers": 0}, "must be a positive integer"),
        ({"num_attention_heads": -4}, "must be a positive integer"),
        ({"num_key_value_heads": 5}, "do not split"),
        ({"head_dim": 0}, "head_dim must be a positive integer"),
        ({"layer_types": ["full_attention"] * 31 + ["quantum_attention"]}, "unknown layer kind.*quantum_attention"),
        ({"layer_types": ["full_attention"] * 3}, "lists 3 entries for 32 layers"),
        ({"layer_types": ["sliding_attention"] * 32}, "sliding_window"),
        ({"torch_dtype": "float7"}, "unknown kv dtype 'float7'"),
    ],
)
def test_bad_configs_raise_typed_errors(change: dict[str, Any], message: str) -> None:
    config = {k: v for k, v in {**LLAMA_8B, **change}.items() if v is not None}
    with pytest.raises(ck.ConfigurationError, match=message):
        ModelSpec.from_config(config)


def test_malformed_json_and_missing_files(tmp_path: Path) -> None:
    broken = tmp_path / "config.json"
    broken.write_text('{"model_type": "llama", "hidden_size": 4096,', encoding="utf-8")
    with pytest.raises(ck.ModelConfigError, match=r"not valid JSON.*line 1"):
        ModelSpec.from_config(broken)
    with pytest.raises(ck.ModelConfigError, match=r"no config\.json"):
        ModelSpec.from_config(tmp_path / "..")
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(ck.ModelConfigError, match="not an object"):
        ModelSpec.from_config(listed)
    good = tmp_path / "model"
    good.mkdir()
    (good / "config.json").write_text(json.dumps(LLAMA_8B), encoding="utf-8")
    assert ModelSpec.from_config(good).kv_bytes(16384) == 2_147_483_648


def test_unknown_model_and_gpu_list_close_matches() -> None:
    with pytest.raises(ck.UnknownModel) as model_error:
        ModelSpec.from_config("llama-3.1-8c")
    assert "meta-llama/Llama-3.1-8B-Instruct" in model_error.value.matches
    assert "Did you mean" in str(model_error.value)
    with pytest.raises(ck.UnknownGPU) as gpu_error:
        find_gpu("RTX 4099")
    assert gpu_error.value.matches


def test_bad_runtime_inputs_say_which_setting_fixes_them() -> None:
    model = ModelSpec.from_config(LLAMA_8B)
    with pytest.raises(ck.ConfigurationError, match="--runtime takes one of"):
        model.kv_bytes(10, runtime="tensorrt")
    with pytest.raises(ck.ConfigurationError, match="cannot hold its KV cache as q8_0"):
        model.kv_bytes(10, runtime="vllm", kv_dtype="q8_0")
    with pytest.raises(ck.ConfigurationError, match="runtime settings are"):
        model.kv_bytes(10, runtime="vllm", blocksize=32)
    with pytest.raises(ck.ConfigurationError, match="tokens must be an integer"):
        model.kv_bytes(-1)
    with pytest.raises(ck.ConfigurationError, match="does not run on"):
        plan(model, "M2 Ultra 192GB", context=4096, runtime="vllm")


# -------------------------------------------------------------------------------------------- plan


def test_plan_breakdown_adds_up_and_limits_are_tight() -> None:
    result = plan(LLAMA_8B, "H100 80GB", context=32768, concurrency=8, runtime="vllm")
    b = result.breakdown
    assert b.total == b.weights + b.kv_cache + b.overhead + b.prefill_peak
    assert b.kv_cache == 8 * 4 * GIB
    assert result.fits == (b.total <= b.capacity)
    # max_concurrency is the largest count that fits: one more does not.
    more = plan(LLAMA_8B, "H100 80GB", context=32768, concurrency=result.max_concurrency + 1, advise=False)
    same = plan(LLAMA_8B, "H100 80GB", context=32768, concurrency=result.max_concurrency, advise=False)
    assert same.fits
    assert not more.fits


def test_plan_advice_is_cheapest_first_and_computed() -> None:
    result = plan(LLAMA_8B, "RTX 4090", context=32768, concurrency=4, runtime="vllm")
    assert not result.fits
    costs = [a.cost for a in result.advice]
    assert costs == sorted(costs, key=["none", "model", "hardware"].index)
    fp8 = next(a for a in result.advice if a.setting == "--kv-dtype fp8")
    check = plan(LLAMA_8B, "RTX 4090", context=32768, concurrency=4, runtime="vllm", kv_dtype="fp8", advise=False)
    assert (fp8.max_concurrency, fp8.max_context, fp8.fits) == (
        check.max_concurrency,
        check.max_context,
        check.fits,
    )


def test_recommend_lists_fitting_options_cheapest_first() -> None:
    options = ck.memory.recommend(LLAMA_8B, context=32768, concurrency=8, runtime="vllm")
    assert options
    memories = [o.total_memory for o in options]
    assert memories == sorted(memories)
    for option in options[:5]:
        assert plan(LLAMA_8B, option.gpu, gpus=option.count, context=32768, concurrency=8, advise=False).fits
        if option.count > 1:
            smaller = plan(LLAMA_8B, option.gpu, gpus=option.count // 2, context=32768, concurrency=8, advise=False)
            assert not smaller.fits
