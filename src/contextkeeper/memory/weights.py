"""Weight memory: from local safetensors metadata when present, else the parameter count from the config.

The count covers embeddings and the LM head (tied or not), attention (GQA, MLA with its low-rank projections,
Gated DeltaNet, Mamba), dense MLPs (gated or not), and MoE layers (routed experts, shared experts, router,
dense first layers). Quantised weights apply to the linear layers of the decoder (where AWQ, GPTQ, fp8 and
GGUF quantise); embeddings, norms and the router stay in 16 bits.

A count is the Llama layout unless the model's family says otherwise: each family's departures (ungated MLPs,
LayerNorm, biases, extra norms) are a :class:`Family` in ``FAMILIES``, keyed by ``model_type``, and each layer
kind picks its attention or mixer from ``_MIXERS``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .._exceptions import ModelConfigError
from .config import first
from .dtypes import DType, dtype
from .layers import LayerSpec, MLAttention, RecurrentState
from .model import ModelSpec

__all__ = ["FAMILIES", "Family", "ParamCount", "WeightsReport", "param_count", "weights_report"]

_MAX_HEADER = 100_000_000


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


@dataclass(frozen=True, kw_only=True)
class _Sizes:
    """The sizes a count reads from the config, after the family's adjustments."""

    hidden: int
    heads: int
    inter: int  # a dense MLP
    moe_inter: int  # one routed expert
    shared_inter: int  # the shared experts together (0: none)
    experts: int  # routed experts per MoE layer
    top_k: int  # routed experts per token
    q_rank: int  # MLA's low-rank query (0: a full q projection)
    norm: int  # parameters of one norm
    norms: int  # norms per decoder layer
    qkv_bias: bool
    qk_norm: bool


def _no_extra(sizes: _Sizes) -> int:
    return 0


def _no_attention_extra(sizes: _Sizes, head_dim: int, kv_heads: int) -> int:
    return 0


def _same(config: Mapping[str, Any], sizes: _Sizes) -> _Sizes:
    return sizes


@dataclass(frozen=True, kw_only=True)
class Family:
    """How a model family departs from the Llama layout (gated MLP, RMSNorm, no biases, an untied LM head).

    The hooks return extra parameters in ``other`` (biases, sinks); ``sizes`` adjusts the config's sizes where
    the family reads them differently."""

    gated: bool = True  # gate, up, down; False: up -> activation -> down
    layer_norm: bool = False  # LayerNorm (weight and bias), not RMSNorm (weight)
    norms: int = 2  # per decoder layer
    tied: bool = False  # the LM head is the input embedding when the config does not say
    positions: bool = False  # learned position embeddings (n_positions × hidden)
    qkv_bias: bool = False  # whatever the config's attention_bias says
    qk_norm: bool = False  # whatever the config's qk_norm says
    gated_output: bool = False  # q_proj doubled: half of it gates the attention output
    shared_gate: bool = False  # a sigmoid gate on the shared expert
    mixer_mlp: bool = True  # recurrent mixer layers have an MLP too
    ssm_norms: bool = False  # RMS norms on the SSM's dt, B and C
    attention_extra: Callable[[_Sizes, int, int], int] = _no_attention_extra  # (sizes, head_dim, kv_heads)
    mlp_extra: Callable[[_Sizes], int] = _no_extra  # per dense MLP
    moe_extra: Callable[[_Sizes], int] = _no_extra  # per MoE layer
    sizes: Callable[[Mapping[str, Any], _Sizes], _Sizes] = _same


def _gpt2_attention(sizes: _Sizes, head_dim: int, kv_heads: int) -> int:
    return 4 * sizes.hidden  # c_attn and c_proj biases


def _gpt2_mlp(sizes: _Sizes) -> int:
    return sizes.inter + sizes.hidden  # c_fc and c_proj biases


def _gpt_oss_attention(sizes: _Sizes, head_dim: int, kv_heads: int) -> int:
    return head_dim * (sizes.heads + 2 * kv_heads) + sizes.hidden + sizes.heads  # q, k, v, o biases; sinks


def _gpt_oss_experts(sizes: _Sizes) -> int:
    return sizes.experts * (2 * sizes.moe_inter + sizes.hidden) + sizes.experts  # expert and router biases


def _falcon(config: Mapping[str, Any], sizes: _Sizes) -> _Sizes:
    # Falcon-7B's parallel block has one norm; the new decoder architecture (40B, 180B) has two.
    return sizes if config.get("new_decoder_architecture") else replace(sizes, norms=1)


def _llama4(config: Mapping[str, Any], sizes: _Sizes) -> _Sizes:
    # One shared expert of intermediate_size; the dense layers use intermediate_size_mlp.
    return replace(sizes, shared_inter=sizes.inter, inter=first(config, "intermediate_size_mlp") or sizes.inter)


_LLAMA = Family()
_LAYER_NORM_MLP = Family(gated=False, layer_norm=True)  # up -> activation -> down, LayerNorm with a bias
_QK_NORM = Family(qk_norm=True)
_GEMMA = Family(norms=4)  # a norm before and after both blocks
_LLAMA4 = Family(sizes=_llama4)

# model_type -> how its parameters depart from the Llama layout; unlisted families count as Llama.
FAMILIES: dict[str, Family] = {
    "gpt2": replace(_LAYER_NORM_MLP, tied=True, positions=True, attention_extra=_gpt2_attention, mlp_extra=_gpt2_mlp),
    "falcon": replace(_LAYER_NORM_MLP, sizes=_falcon),
    **dict.fromkeys(("gpt_neox", "mpt", "phi", "gpt_bigcode", "opt", "bloom", "starcoder2"), _LAYER_NORM_MLP),
    "qwen2": Family(qkv_bias=True),
    "qwen2_moe": Family(qkv_bias=True, shared_gate=True),
    **dict.fromkeys(("qwen3", "qwen3_moe", "olmo2"), _QK_NORM),
    "qwen3_next": Family(qk_norm=True, gated_output=True, shared_gate=True),
    "gemma2": _GEMMA,
    **dict.fromkeys(("gemma3", "gemma3_text"), replace(_GEMMA, qk_norm=True)),
    "llama4": _LLAMA4,
    "llama4_text": _LLAMA4,
    "gpt_oss": Family(attention_extra=_gpt_oss_attention, moe_extra=_gpt_oss_experts),
    "mamba": Family(mixer_mlp=False),
    "jamba": Family(ssm_norms=True),
}


def _sizes(model: ModelSpec, family: Family) -> _Sizes:
    c = model.config
    hidden = model.hidden_size
    inter = first(c, "intermediate_size", "n_inner", "ffn_hidden_size") or 4 * hidden
    moe_inter = first(c, "moe_intermediate_size", "expert_intermediate_size") or inter
    sizes = _Sizes(
        hidden=hidden,
        heads=model.num_attention_heads,
        inter=inter,
        moe_inter=moe_inter,
        shared_inter=first(c, "shared_expert_intermediate_size") or (first(c, "n_shared_experts") or 0) * moe_inter,
        experts=first(c, "n_routed_experts", "num_local_experts", "num_experts") or 0,
        top_k=first(c, "num_experts_per_tok", "num_experts_per_token") or 0,
        q_rank=first(c, "q_lora_rank") or 0,
        norm=2 * hidden if family.layer_norm else hidden,
        norms=family.norms,
        qkv_bias=bool(c.get("attention_bias")) or family.qkv_bias,
        qk_norm=bool(c.get("qk_norm")) or family.qk_norm,
    )
    return family.sizes(c, sizes)


@dataclass(frozen=True, kw_only=True)
class _Part:
    """Parameters of one block: ``active`` is the part of ``linear`` used per token."""

    linear: int = 0
    other: int = 0
    experts: int = 0
    active: int = 0

    def __add__(self, more: _Part) -> _Part:
        return _Part(
            linear=self.linear + more.linear,
            other=self.other + more.other,
            experts=self.experts + more.experts,
            active=self.active + more.active,
        )


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


def _attention(layer: Any, s: _Sizes, family: Family, config: Mapping[str, Any]) -> _Part:
    """Multi-head attention with grouped KV heads (a layer without them: plain multi-head)."""
    head_dim = getattr(layer, "head_dim", s.hidden // s.heads)
    kv_heads = getattr(layer, "kv_heads", s.heads)
    q_heads = 2 * s.heads if family.gated_output else s.heads
    attn = s.hidden * head_dim * (q_heads + 2 * kv_heads) + s.heads * head_dim * s.hidden
    other = family.attention_extra(s, head_dim, kv_heads)
    if s.qkv_bias:
        other += head_dim * (s.heads + 2 * kv_heads)
    if s.qk_norm:
        other += 2 * head_dim
    return _Part(linear=attn, other=other, active=attn)


def _latent_attention(layer: MLAttention, s: _Sizes, family: Family, config: Mapping[str, Any]) -> _Part:
    """MLA: low-rank query (when ``q_lora_rank``) and the compressed KV with its decoupled RoPE key."""
    q_out = s.heads * (layer.nope_dim + layer.rope_dim)
    attn = (s.hidden * s.q_rank + s.q_rank * q_out) if s.q_rank else s.hidden * q_out
    attn += s.hidden * (layer.kv_lora_rank + layer.rope_dim)
    attn += layer.kv_lora_rank * s.heads * (layer.nope_dim + layer.v_head_dim)
    attn += s.heads * layer.v_head_dim * s.hidden
    return _Part(linear=attn, other=s.q_rank + layer.kv_lora_rank, active=attn)


def _recurrent(layer: RecurrentState, s: _Sizes, family: Family, config: Mapping[str, Any]) -> _Part:
    attn, other = _mixer(config, layer, s.hidden, family.ssm_norms)
    return _Part(linear=attn, other=other, active=attn)


_Mixer = Callable[[Any, _Sizes, Family, Mapping[str, Any]], _Part]

# Layer kind -> its attention or mixer. Every other kind is multi-head attention: full, sliding and chunked
# layers, and NoCache (Gemma 3n's layers that reuse another layer's KV still have their own projections).
_MIXERS: dict[str, _Mixer] = {MLAttention.kind: _latent_attention, RecurrentState.kind: _recurrent}


def _moe(s: _Sizes, family: Family) -> _Part:
    per_expert = _mlp(s.hidden, s.moe_inter, True)
    routed = s.experts * per_expert
    shared = _mlp(s.hidden, s.shared_inter, True) if s.shared_inter else 0
    other = s.hidden * s.experts + family.moe_extra(s)  # the router, and the family's expert biases
    if s.shared_inter and family.shared_gate:
        other += s.hidden
    return _Part(linear=routed + shared, other=other, experts=routed, active=s.top_k * per_expert + shared)


def _dense(s: _Sizes, family: Family) -> _Part:
    mlp = _mlp(s.hidden, s.inter, family.gated)
    return _Part(linear=mlp, other=family.mlp_extra(s), active=mlp)


def _layer(layer: LayerSpec, moe: bool, s: _Sizes, family: Family, config: Mapping[str, Any]) -> _Part:
    """One decoder layer: its norms, its attention or mixer, its MLP (Mamba's mixer layers have none)."""
    part = _Part(other=s.norms * s.norm) + _MIXERS.get(layer.kind, _attention)(layer, s, family, config)
    if moe:
        return part + _moe(s, family)
    if layer.kind == RecurrentState.kind and not family.mixer_mlp:
        return part
    return part + _dense(s, family)


def param_count(model: ModelSpec) -> ParamCount:
    """Parameters computed from the config (no weights read)."""
    c = model.config
    family = FAMILIES.get(model.model_type, _LLAMA)
    s = _sizes(model, family)
    tied = bool(c.get("tie_word_embeddings", family.tied))
    embedding = (model.vocab_size or 0) * s.hidden * (1 if tied else 2)
    if family.positions:
        embedding += (first(c, "n_positions", "max_position_embeddings") or 0) * s.hidden
    moe = _moe_layers(c, len(model.layers))
    total = _Part(other=s.norm)  # the final norm
    for layer, sparse in zip(model.layers, moe, strict=True):
        total += _layer(layer, sparse, s, family, c)
    return ParamCount(
        embedding=embedding,
        linear=total.linear,
        other=total.other,
        experts=total.experts,
        active=embedding + total.active + total.other,
    )


def _mixer(c: Mapping[str, Any], layer: RecurrentState, hidden: int, ssm_norms: bool) -> tuple[int, int]:
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
    if ssm_norms:
        other += dt_rank + 2 * d_state
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
