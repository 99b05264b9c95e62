"""Measure the KV cache that the installed transformers really builds, for tiny random-weight models.

Test-support module (not collected by pytest): ``TINY`` holds small but structurally faithful configs, one per
family, and ``measure`` runs a forward pass (or a short greedy ``generate``) on CPU and walks the returned cache
object generically, reporting every tensor it can reach, layer by layer.
``python tests/memory_real.py [FAMILY...]`` prints the measurement grid as a markdown table.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

__all__ = ["TINY", "LayerMeasure", "Measured", "TensorRecord", "build_model", "measure", "walk_cache"]

# (name, shape, dtype, nbytes) — nbytes is numel * element_size of that tensor (a view counts its own elements).
TensorRecord = tuple[str, tuple[int, ...], str, int]

_VOCAB = 128

TINY: dict[str, dict[str, Any]] = {
    "llama": {
        "model_type": "llama",
        "vocab_size": _VOCAB,
        "hidden_size": 128,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 512,
    },
    "qwen3": {
        "model_type": "qwen3",
        "vocab_size": _VOCAB,
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 512,
    },
    "falcon_mqa": {
        "model_type": "falcon",
        "vocab_size": _VOCAB,
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "multi_query": True,
        "new_decoder_architecture": False,
        "max_position_embeddings": 512,
    },
    "falcon_new": {
        "model_type": "falcon",
        "vocab_size": _VOCAB,
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 8,
        "num_kv_heads": 2,
        "new_decoder_architecture": True,
        "max_position_embeddings": 512,
    },
    "gpt2": {
        "model_type": "gpt2",
        "vocab_size": _VOCAB,
        "n_embd": 64,
        "n_layer": 3,
        "n_head": 4,
        "n_positions": 512,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "phi3": {
        "model_type": "phi3",
        "vocab_size": _VOCAB,
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 512,
        "original_max_position_embeddings": 512,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "sliding_window": None,
    },
    "phi3_sliding": {
        "model_type": "phi3",
        "vocab_size": _VOCAB,
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 512,
        "original_max_position_embeddings": 512,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "sliding_window": 8,
    },
    "mistral": {
        "model_type": "mistral",
        "vocab_size": _VOCAB,
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "sliding_window": 8,
        "max_position_embeddings": 512,
    },
    "qwen2_nosliding": {
        "model_type": "qwen2",
        "vocab_size": _VOCAB,
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "sliding_window": 8,
        "use_sliding_window": False,
        "max_window_layers": 1,
        "max_position_embeddings": 512,
    },
    "qwen2_sliding": {
        "model_type": "qwen2",
        "vocab_size": _VOCAB,
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "sliding_window": 8,
        "use_sliding_window": True,
        "max_window_layers": 1,
        "max_position_embeddings": 512,
    },
    "gemma2": {
        "model_type": "gemma2",
        "vocab_size": _VOCAB,
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": 8,
        "max_position_embeddings": 512,
    },
    "gemma3_text": {
        "model_type": "gemma3_text",
        "vocab_size": _VOCAB,
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": 8,
        "sliding_window_pattern": 6,
        "max_position_embeddings": 512,
    },
    "cohere2": {
        "model_type": "cohere2",
        "vocab_size": _VOCAB,
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "sliding_window": 8,
        "max_position_embeddings": 512,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "gpt_oss": {
        "model_type": "gpt_oss",
        "vocab_size": _VOCAB,
        "hidden_size": 64,
        "intermediate_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "sliding_window": 8,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 131072,
    },
    "deepseek_v3": {
        "model_type": "deepseek_v3",
        "vocab_size": _VOCAB,
        "hidden_size": 64,
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_shared_experts": 1,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "kv_lora_rank": 32,
        "q_lora_rank": 48,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 12,
        "max_position_embeddings": 512,
    },
    "llama4_text": {
        "model_type": "llama4_text",
        "vocab_size": _VOCAB,
        "hidden_size": 64,
        "intermediate_size": 32,
        "intermediate_size_mlp": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_local_experts": 2,
        "num_experts_per_tok": 1,
        "attention_chunk_size": 8,
        "no_rope_layer_interval": 4,
        "max_position_embeddings": 512,
    },
    "qwen3_next": {
        "model_type": "qwen3_next",
        "vocab_size": _VOCAB,
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 12,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 512,
    },
    "jamba": {
        "model_type": "jamba",
        "vocab_size": _VOCAB,
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "attn_layer_period": 4,
        "attn_layer_offset": 2,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
        "num_experts": 2,
        "num_experts_per_tok": 1,
        "mamba_d_state": 8,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "use_mamba_kernels": False,
        "max_position_embeddings": 512,
    },
    "gemma3n_text": {
        "model_type": "gemma3n_text",
        "vocab_size": _VOCAB,
        "vocab_size_per_layer_input": _VOCAB,
        "hidden_size": 64,
        "hidden_size_per_layer_input": 8,
        "intermediate_size": 64,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "sliding_window": 8,
        "layer_types": [
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "full_attention",
        ],
        "num_kv_shared_layers": 2,
        "laurel_rank": 4,
        "altup_num_inputs": 2,
        "activation_sparsity_pattern": [0.0] * 6,
        "max_position_embeddings": 512,
    },
    "mpt": {
        "model_type": "mpt",
        "vocab_size": _VOCAB,
        "d_model": 64,
        "n_heads": 4,
        "n_layers": 3,
        "expansion_ratio": 2,
        "max_seq_len": 512,
    },
}


@dataclass(frozen=True)
class LayerMeasure:
    """What one cache layer (``cache.layers[index]``) holds; ``index`` -1 collects tensors outside ``layers``.

    ``kind`` is a short name for the layer class (``full``, ``sliding``, ``linear``, ``hybrid``, ``dummy``...).
    ``nbytes`` counts only tensors not already counted by an earlier layer, so the layers sum to the total.
    """

    index: int
    kind: str
    tensors: tuple[TensorRecord, ...]
    nbytes: int


@dataclass(frozen=True)
class Measured:
    """Bytes held by the cache object returned by the model.

    ``total_bytes`` sums ``numel * element_size`` over distinct tensors (shared tensors once).
    ``storage_bytes`` sums the distinct underlying storages instead: a sliced view (as a sliding layer keeps)
    pins its whole base storage, so this is what the process actually keeps alive.
    """

    total_bytes: int
    layers: tuple[LayerMeasure, ...]
    cache_class: str
    storage_bytes: int = 0

    def kinds(self) -> dict[str, int]:
        """Number of layers per kind."""
        out: dict[str, int] = {}
        for layer in self.layers:
            if layer.index >= 0:
                out[layer.kind] = out.get(layer.kind, 0) + 1
        return out


_KINDS = {
    "DynamicLayer": "full",
    "DynamicSlidingWindowLayer": "sliding",
    "DynamicIndexedLayer": "indexed",
    "StaticLayer": "static",
    "StaticSlidingWindowLayer": "static_sliding",
    "LinearAttentionLayer": "linear",
    "LinearAttentionAndFullAttentionLayer": "hybrid",
    "LinearAttentionAndSlidingWindowAttentionLayer": "hybrid_sliding",
    "DummyLayer": "dummy",
}


def _kind(obj: object) -> str:
    name = type(obj).__name__
    return _KINDS.get(name, name)


def _collect(obj: object, path: str, out: list[tuple[str, Any]], seen: set[int]) -> None:
    """Append every tensor reachable from ``obj`` (through containers and transformers objects) to ``out``."""
    import torch

    if isinstance(obj, torch.Tensor):
        out.append((path, obj))
        return
    if obj is None or isinstance(obj, (str, bytes, int, float, bool, type)) or id(obj) in seen:
        return
    seen.add(id(obj))
    sep = "." if path else ""
    if isinstance(obj, dict):
        for key, value in obj.items():
            _collect(value, f"{path}[{key!r}]", out, seen)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            _collect(value, f"{path}[{i}]", out, seen)
    elif (
        type(obj).__module__.startswith("transformers")
        and hasattr(obj, "__dict__")
        and not isinstance(obj, torch.nn.Module)
        and not hasattr(obj, "to_json_string")  # a config, not cache state
    ):
        for key, value in vars(obj).items():
            _collect(value, f"{path}{sep}{key}", out, seen)


def walk_cache(cache: object) -> Measured:
    """Walk a cache object generically and account for every distinct tensor in it."""
    groups: list[tuple[int, str, list[tuple[str, Any]]]] = []
    seen: set[int] = {id(cache)}
    layers = getattr(cache, "layers", None)
    if isinstance(layers, list):
        seen.add(id(layers))
        for i, layer in enumerate(layers):
            found: list[tuple[str, Any]] = []
            _collect(layer, "", found, seen)
            groups.append((i, _kind(layer), found))
    rest: list[tuple[str, Any]] = []
    if hasattr(cache, "__dict__"):
        for key, value in vars(cache).items():
            if value is not layers:
                _collect(value, key, rest, seen)
    if rest:
        groups.append((-1, "cache", rest))

    counted: dict[tuple[Any, ...], str] = {}
    storages: dict[int, int] = {}
    measures: list[LayerMeasure] = []
    for index, kind, found in groups:
        records: list[TensorRecord] = []
        layer_bytes = 0
        for name, t in found:
            nbytes = t.numel() * t.element_size()
            label = name
            if t.numel() > 0:
                ident = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
                if ident in counted:
                    label = f"{name}=dup:{counted[ident]}"
                else:
                    counted[ident] = f"{index}.{name}"
                    layer_bytes += nbytes
                storage = t.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            records.append((label, tuple(t.shape), str(t.dtype).removeprefix("torch."), nbytes))
        measures.append(LayerMeasure(index, kind, tuple(records), layer_bytes))
    return Measured(
        total_bytes=sum(m.nbytes for m in measures),
        layers=tuple(measures),
        cache_class=type(cache).__name__,
        storage_bytes=sum(storages.values()),
    )


@functools.lru_cache(maxsize=8)
def _build(config_json: str, dtype: str) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = json.loads(config_json)
    model_type = fields.pop("model_type")
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(0)
    auto: Any = AutoModelForCausalLM
    model = auto.from_config(config, dtype=getattr(torch, dtype))
    return model.eval()


def build_model(config: dict[str, Any], dtype: str = "float32") -> Any:
    """The (memoised) random-weight causal LM for ``config``, in eval mode."""
    return _build(json.dumps(config, sort_keys=True), dtype)


def measure(
    config: dict[str, Any],
    *,
    tokens: int,
    batch: int = 1,
    dtype: str = "float32",
    mode: str = "forward",
    new_tokens: int = 3,
) -> Measured:
    """Build the model for ``config`` and measure the cache after ``tokens`` prompt tokens per row.

    ``mode="forward"``: one forward with ``use_cache=True``; the cache then covers ``tokens`` positions.
    ``mode="generate"``: greedy ``generate`` of exactly ``new_tokens`` tokens; the cache then covers
    ``tokens + new_tokens - 1`` positions (the last sampled token is never fed back).
    """
    import torch

    if mode not in ("forward", "generate"):
        raise ValueError(f"unknown mode {mode!r}")
    model = build_model(config, dtype)
    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    generator = torch.Generator().manual_seed(1234)
    ids = torch.randint(3, vocab, (batch, tokens), generator=generator)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        if mode == "forward":
            out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        else:
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                use_cache=True,  # MPT's config defaults to use_cache=False, which would generate with no cache
                return_dict_in_generate=True,
                pad_token_id=0,
            )
    cache = getattr(out, "cache", None)
    if cache is None:
        cache = getattr(out, "past_key_values", None)
    if cache is None:
        raise RuntimeError(f"{type(model).__name__} returned no cache")
    return walk_cache(cache)


def _table(families: list[str]) -> None:
    """Print measured bytes over the standard grid as markdown (window 8, so S in 1, 7, 8, 9, 29).

    A cell is ``total_bytes``, or ``total_bytes / storage_bytes`` when views pin larger storages.
    """
    sizes = (1, 7, 8, 9, 29)
    print("| family | mode | dtype | B | layer kinds | " + " | ".join(f"S={n}" for n in sizes) + " |")
    print("|---|---|---|---|---|" + "---|" * len(sizes))
    for family in families:
        for mode in ("forward", "generate"):
            for dtype in ("float32", "bfloat16"):
                for batch in (1, 3):
                    cells = []
                    kinds = ""
                    for tokens in sizes:
                        m = measure(TINY[family], tokens=tokens, batch=batch, dtype=dtype, mode=mode)
                        kinds = " ".join(f"{k}:{n}" for k, n in m.kinds().items())
                        same = m.total_bytes == m.storage_bytes
                        cells.append(str(m.total_bytes) if same else f"{m.total_bytes} / {m.storage_bytes}")
                    print(f"| {family} | {mode} | {dtype} | {batch} | {kinds} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    import sys

    _table(sys.argv[1:] or list(TINY))
