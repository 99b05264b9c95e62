"""Weight memory: from local safetensors metadata when present, else the parameter count from the config.

The count covers embeddings and the LM head (tied or not), attention (GQA, MLA with its low-rank projections,
Gated DeltaNet, Mamba), dense MLPs (gated or not), and MoE layers (routed experts, shared experts, router,
dense first layers). Quantised weights apply to the linear layers of the decoder (where AWQ, GPTQ, fp8 and
GGUF quantise); embeddings, norms and the router stay in 16 bits.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._exceptions import ModelConfigError
from .config import first
from .dtypes import DType, dtype
from .layers import MLAttention, RecurrentState
from .model import ModelSpec

__all__ = ["ParamCount", "WeightsReport", "param_count", "weights_report"]

_MAX_HEADER = 100_000_000

# Families whose MLP is up -> activation -> down (two matrices), not gated (three).
_UNGATED = frozenset({"gpt2", "falcon", "gpt_neox", "mpt", "phi", "gpt_bigcode", "opt", "bloom", "starcoder2"})


@dataclass(frozen=True, kw_only=True)
class ParamCount:
    """Parameters by where they sit. ``linear`` is what weight quantisation compresses."""

    embedding: int  # input embeddings plus an untied LM head
    linear: int  # attention and MLP matrices of the decoder layers (experts included)
    other: int  # norms, biases, routers, conv kernels, SSM parameters
    experts: int  # part of ``linear`` in routed experts
    active: int  # parameters used per token (MoE: top-k routed experts + shared)

    @property
    def total(self) -> int:
        return self.embedding + self.linear + self.other


def _mlp(hidden: int, inter: int, gated: bool) -> int:
    return (3 if gated else 2) * hidden * inter


def _moe_layers(config: Mapping[str, Any], count: int) -> list[bool]:
    """Which decoder layers are MoE."""
    experts = first(config, "n_routed_experts", "num_local_experts", "num_experts")
    if not experts:
        return [False] * count
    period = first(config, "expert_layer_period")
    if period:  # Jamba: every period-th layer from the offset
        offset = first(config, "expert_layer_offset") or 0
        return [i % period == offset for i in range(count)]
    dense_first = first(config, "first_k_dense_replace") or 0
    step = first(config, "decoder_sparse_step", "moe_layer_freq", "interleave_moe_layer_step") or 1
    only_dense = set(first(config, "mlp_only_layers") or [])
    return [i >= dense_first and (i + 1) % step == 0 and i not in only_dense for i in range(count)]


def param_count(model: ModelSpec) -> ParamCount:
    """Parameters computed from the config (no weights read)."""
    c = model.config
    hidden = model.hidden_size
    heads = model.num_attention_heads
    vocab = model.vocab_size or 0
    gated = model.model_type not in _UNGATED
    inter = first(c, "intermediate_size", "n_inner", "ffn_hidden_size") or 4 * hidden
    tied = bool(c.get("tie_word_embeddings", model.model_type in ("gpt2",)))
    embedding = vocab * hidden * (1 if tied else 2)
    if model.model_type == "gpt2":
        embedding += (first(c, "n_positions", "max_position_embeddings") or 0) * hidden
    linear = other = experts_linear = active_linear = 0
    moe = _moe_layers(c, len(model.layers))
    n_experts = first(c, "n_routed_experts", "num_local_experts", "num_experts") or 0
    top_k = first(c, "num_experts_per_tok", "num_experts_per_token") or 0
    moe_inter = first(c, "moe_intermediate_size", "expert_intermediate_size") or inter
    shared_inter = first(c, "shared_expert_intermediate_size") or (first(c, "n_shared_experts") or 0) * moe_inter
    kind = model.model_type
    bias = c.get("attention_bias") or kind in ("qwen2", "qwen2_moe")
    norm = 2 * hidden if kind in _UNGATED else hidden  # LayerNorm has a bias, RMSNorm does not
    # Gemma 2/3 normalise before and after both blocks; Falcon-7B's parallel block has one norm.
    norms = 4 if kind in ("gemma2", "gemma3", "gemma3_text") else 2
    if kind == "falcon" and not c.get("new_decoder_architecture"):
        norms = 1
    if kind == "llama4" or kind == "llama4_text":
        shared_inter = inter  # one shared expert of intermediate_size; dense layers use intermediate_size_mlp
        inter = first(c, "intermediate_size_mlp") or inter
    for index, layer in enumerate(model.layers):
        other += norms * norm
        # Attention or mixer.
        if isinstance(layer, MLAttention):
            q_rank = first(c, "q_lora_rank")
            q_out = heads * (layer.nope_dim + layer.rope_dim)
            attn = (hidden * q_rank + q_rank * q_out) if q_rank else hidden * q_out
            attn += hidden * (layer.kv_lora_rank + layer.rope_dim)
            attn += layer.kv_lora_rank * heads * (layer.nope_dim + layer.v_head_dim)
            attn += heads * layer.v_head_dim * hidden
            other += (q_rank or 0) + layer.kv_lora_rank
        elif isinstance(layer, RecurrentState):
            attn, extra = _mixer(c, layer, hidden)
            other += extra
        else:
            head_dim = getattr(layer, "head_dim", hidden // heads)
            kv_heads = getattr(layer, "kv_heads", heads)
            q_heads = 2 * heads if kind == "qwen3_next" else heads  # Qwen3-Next gates the output: q_proj is doubled
            attn = hidden * head_dim * (q_heads + 2 * kv_heads) + heads * head_dim * hidden
            if bias:
                other += head_dim * (heads + 2 * kv_heads)
            if kind == "gpt_oss":
                other += head_dim * (heads + 2 * kv_heads) + hidden + heads  # q, k, v, o biases; sinks
            if model.model_type == "gpt2":
                other += 4 * hidden  # c_attn and c_proj biases
            if c.get("qk_norm") or kind in ("qwen3", "qwen3_moe", "qwen3_next", "gemma3_text", "gemma3", "olmo2"):
                other += 2 * head_dim
        linear += attn
        active_linear += attn
        # MLP.
        if moe[index]:
            per_expert = _mlp(hidden, moe_inter, True)
            routed = n_experts * per_expert
            shared = _mlp(hidden, shared_inter, True) if shared_inter else 0
            linear += routed + shared
            experts_linear += routed
            active_linear += top_k * per_expert + shared
            other += hidden * n_experts  # router
            if kind == "gpt_oss":
                other += n_experts * (2 * moe_inter + hidden) + n_experts  # expert and router biases
            if shared_inter and model.model_type in ("qwen2_moe", "qwen3_next"):
                other += hidden  # shared expert gate
        elif not isinstance(layer, RecurrentState) or model.model_type != "mamba":
            mlp = _mlp(hidden, inter, gated)
            linear += mlp
            active_linear += mlp
            if model.model_type == "gpt2":
                other += inter + hidden
    other += norm  # final norm
    active = embedding + active_linear + other
    return ParamCount(embedding=embedding, linear=linear, other=other, experts=experts_linear, active=active)


def _mixer(c: Mapping[str, Any], layer: RecurrentState, hidden: int) -> tuple[int, int]:
    """(linear, other) parameters of a Gated DeltaNet or Mamba mixer."""
    if layer.family == "gated_deltanet":
        nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
        dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
        linear = hidden * (2 * nk * dk + 2 * nv * dv) + hidden * 2 * nv + nv * dv * hidden
        other = layer.conv_channels * layer.conv_kernel + 2 * nv + dv
        return linear, other
    d_inner = layer.conv_channels if layer.family == "mamba" else layer.ssm_values // max(1, _d_state(c))
    d_state = _d_state(c)
    dt_rank = first(c, "mamba_dt_rank", "time_step_rank") or -(-hidden // 16)
    linear = hidden * 2 * d_inner + d_inner * (dt_rank + 2 * d_state) + dt_rank * d_inner + d_inner * hidden
    other = d_inner * layer.conv_kernel + d_inner + d_inner * d_state + d_inner + d_inner
    if c.get("model_type") == "jamba":
        other += dt_rank + 2 * d_state  # RMS norms on dt, B and C
    return linear, other


def _d_state(c: Mapping[str, Any]) -> int:
    return int(first(c, "mamba_d_state", "state_size", "ssm_state_size") or 16)


@dataclass(frozen=True, kw_only=True)
class WeightsReport:
    """Weight bytes and where the figure came from."""

    bytes: int
    params: int
    dtype: str
    source: str  # "safetensors index", "safetensors headers" or "config"
    notes: tuple[str, ...] = ()


def _checkpoint_dtype(model: ModelSpec) -> tuple[DType, DType | None, str]:
    """(dtype of unquantised weights, dtype of quantised linears or None, note) for ``--weights-dtype auto``."""
    quant = model.config.get("quantization_config")
    base = model.dtype if model.dtype.name != "fp32" else dtype("fp32")
    if isinstance(quant, Mapping):
        method = str(quant.get("quant_method", "")).lower()
        if method == "mxfp4":
            return base, dtype("mxfp4", purpose="weights"), "MoE experts in MXFP4 (as released)"
        if method in ("fp8", "fbgemm_fp8", "compressed-tensors"):
            return base, dtype("fp8", purpose="weights"), "linear layers in fp8 (as released)"
        if method in ("awq", "gptq") and quant.get("bits") == 4:
            return base, dtype("int4", purpose="weights"), f"{method.upper()} 4-bit linear layers"
    return base, None, ""


def weights_report(model: ModelSpec, weights_dtype: str = "auto", *, folder: str | Path | None = None) -> WeightsReport:
    """Weight bytes: the safetensors metadata in ``folder`` when present (no weights are read), else the
    parameter count × ``weights_dtype`` (``auto``: as released, including released quantisation)."""
    if folder is not None and weights_dtype == "auto":
        found = _safetensors_bytes(Path(folder))
        if found is not None:
            size, how = found
            return WeightsReport(bytes=size, params=param_count(model).total, dtype="as stored", source=how)
    counts = param_count(model)
    notes: list[str] = []
    # Parameters outside the text decoder (a VLM's vision tower) that the catalog knows of: loaded in 16 bits.
    extra = max(0, (model.published_params or 0) - counts.total)
    if extra:
        notes.append(f"{extra:,} parameters outside the text decoder (vision encoder), from the catalog")
    if weights_dtype == "auto":
        base, quant, note = _checkpoint_dtype(model)
        if note:
            notes.append(note)
        name = base.name if quant is None else f"{base.name}+{quant.name}"
    else:
        base = dtype(weights_dtype, purpose="weights")
        quant = base if base.block_values > 1 or base.block_bytes < 2 else None
        base = dtype("bf16") if quant is not None else base
        name = weights_dtype
    if quant is not None and quant.name == "mxfp4":
        quantised = counts.experts
    else:
        quantised = counts.linear if quant is not None else 0
    size = quant.bytes_for(quantised) if quant is not None else 0
    size += base.bytes_for(counts.total - quantised + extra)
    return WeightsReport(bytes=size, params=counts.total + extra, dtype=name, source="config", notes=tuple(notes))


def _safetensors_bytes(folder: Path) -> tuple[int, str] | None:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            total = json.loads(index.read_text(encoding="utf-8"))["metadata"]["total_size"]
        except (KeyError, ValueError, TypeError):
            total = None
        if isinstance(total, int) and total > 0:
            return total, "safetensors index"
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for path in files:
        with path.open("rb") as handle:
            raw = handle.read(8)
            if len(raw) != 8:
                raise ModelConfigError(f"{path} is not a safetensors file (shorter than its 8-byte header size)")
            (length,) = struct.unpack("<Q", raw)
            if length > _MAX_HEADER:  # safetensors itself refuses headers over 100 MB
                raise ModelConfigError(
                    f"{path} claims a {length:,}-byte safetensors header; it is not a safetensors file"
                )
            try:
                header = json.loads(handle.read(length))
                ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
            except (ValueError, KeyError, TypeError, IndexError, AttributeError):
                raise ModelConfigError(f"{path} has a malformed safetensors header") from None
        if not all(isinstance(end, int) and not isinstance(end, bool) and end >= 0 for end in ends):
            raise ModelConfigError(f"{path} has a malformed safetensors header (tensor offsets are not byte counts)")
        total += max(ends, default=0)
    return total, "safetensors headers"
