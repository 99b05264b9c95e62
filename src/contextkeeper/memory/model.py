"""ModelSpec: a model's layers and sizes, read from its config, with the KV bytes per runtime."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .._exceptions import ModelConfigError
from . import catalog
from .config import first, layer_kinds, load_config, max_context, positive, text_config
from .dtypes import DType, dtype
from .layers import (
    ChunkedAttention,
    FullAttention,
    LayerSpec,
    MLAttention,
    NoCache,
    RecurrentState,
    SlidingAttention,
)
from .limits import check_config_sizes

__all__ = ["ModelSpec"]


@dataclass(frozen=True, kw_only=True)
class _Geometry:
    source: str
    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    dtype: DType


def _kv_heads(config: Mapping[str, Any], heads: int, source: str) -> int:
    """KV heads the way vLLM reads them: Falcon's multi_query first, then the field zoo, MHA by default."""
    falcon = config.get("model_type") in ("falcon", "RefinedWeb", "RefinedWebModel")
    if falcon and config.get("multi_query") and not config.get("new_decoder_architecture"):
        return 1
    attn = config.get("attn_config")
    if isinstance(attn, Mapping) and attn.get("kv_n_heads"):
        return positive(attn, "kv_n_heads", what="attn_config.kv_n_heads", source=source)
    if config.get("model_type") == "chatglm" and not config.get("multi_query_attention"):
        return heads
    value = first(config, "n_head_kv", "num_kv_heads", "num_key_value_heads", "multi_query_group_num")
    if value is None:
        return heads
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelConfigError(f"{source}: the number of KV heads must be a positive integer, got {value!r}")
    if heads % value:
        raise ModelConfigError(f"{source}: {heads} attention heads do not split into {value} KV head groups")
    return value


def _dtype_of(config: Mapping[str, Any]) -> tuple[DType, str]:
    name = first(config, "torch_dtype", "dtype")
    if name is None:
        return dtype("fp32"), "float32 (the config names no dtype; transformers loads such checkpoints in float32)"
    return dtype(str(name).replace("torch.", "")), str(name).replace("torch.", "")


# One builder per layer kind: the config's kind name -> the layer spec with plain storage.
_Builder = Callable[[Mapping[str, Any], _Geometry], LayerSpec]


def _attention(config: Mapping[str, Any], g: _Geometry) -> LayerSpec:
    if first(config, "kv_lora_rank") is not None:
        return MLAttention(
            kv_lora_rank=positive(config, "kv_lora_rank", what="kv_lora_rank", source=g.source),
            rope_dim=positive(config, "qk_rope_head_dim", what="qk_rope_head_dim", source=g.source),
            num_heads=g.heads,
            nope_dim=positive(config, "qk_nope_head_dim", what="qk_nope_head_dim", source=g.source),
            v_head_dim=positive(config, "v_head_dim", what="v_head_dim", source=g.source),
            dtype=g.dtype,
        )
    return FullAttention(kv_heads=g.kv_heads, head_dim=g.head_dim, v_head_dim=g.v_head_dim, dtype=g.dtype)


def _sliding(config: Mapping[str, Any], g: _Geometry) -> LayerSpec:
    window = positive(config, "sliding_window", what="sliding_window for its sliding layers", source=g.source)
    return SlidingAttention(
        kv_heads=g.kv_heads, head_dim=g.head_dim, v_head_dim=g.v_head_dim, dtype=g.dtype, window=window
    )


def _chunked(config: Mapping[str, Any], g: _Geometry) -> LayerSpec:
    chunk = positive(
        config, "attention_chunk_size", what="attention_chunk_size for its chunked layers", source=g.source
    )
    return ChunkedAttention(
        kv_heads=g.kv_heads, head_dim=g.head_dim, v_head_dim=g.v_head_dim, dtype=g.dtype, window=chunk
    )


def _linear(config: Mapping[str, Any], g: _Geometry) -> LayerSpec:
    # Gated DeltaNet (Qwen3-Next, Qwen3.5): conv over q, k and v channels; state nv × dk × dv.
    nk = positive(config, "linear_num_key_heads", what="linear_num_key_heads", source=g.source)
    nv = positive(config, "linear_num_value_heads", what="linear_num_value_heads", source=g.source)
    dk = positive(config, "linear_key_head_dim", what="linear_key_head_dim", source=g.source)
    dv = positive(config, "linear_value_head_dim", what="linear_value_head_dim", source=g.source)
    kernel = positive(config, "linear_conv_kernel_dim", what="linear_conv_kernel_dim", source=g.source)
    return RecurrentState(
        family="gated_deltanet",
        conv_channels=2 * nk * dk + nv * dv,
        conv_kernel=kernel,
        conv_width=kernel,
        ssm_values=nv * dk * dv,
        conv_dtype=g.dtype,
        ssm_dtype=g.dtype,
    )


def _mamba(config: Mapping[str, Any], g: _Geometry) -> LayerSpec:
    hidden = positive(config, "hidden_size", "d_model", what="hidden_size", source=g.source)
    expand = first(config, "mamba_expand", "expand") or 2
    d_inner = int(first(config, "mamba_d_inner") or expand * hidden)
    d_state = positive(config, "mamba_d_state", "state_size", "ssm_state_size", what="mamba_d_state", source=g.source)
    kernel = positive(config, "mamba_d_conv", "conv_kernel", what="mamba_d_conv", source=g.source)
    groups = first(config, "mamba_n_groups", "n_groups")
    if groups:  # Mamba2: B and C are convolved too, and the state is per head
        return RecurrentState(
            family="mamba2",
            conv_channels=d_inner + 2 * int(groups) * d_state,
            conv_kernel=kernel,
            conv_width=kernel,
            ssm_values=d_inner * d_state,
            conv_dtype=g.dtype,
            ssm_dtype=g.dtype,
        )
    return RecurrentState(
        family="mamba",
        conv_channels=d_inner,
        conv_kernel=kernel,
        conv_width=kernel,
        ssm_values=d_inner * d_state,
        conv_dtype=g.dtype,
        ssm_dtype=g.dtype,
    )


LAYER_BUILDERS: dict[str, _Builder] = {
    "full_attention": _attention,
    "sliding_attention": _sliding,
    "chunked_attention": _chunked,
    "linear_attention": _linear,
    "mamba": _mamba,
}


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """What memory planning needs to know about a model, read from its config.

    ``layers`` describe the architecture with plain storage (every token kept, the model's dtype); runtimes
    adapt them (see :meth:`kv`).
    """

    name: str
    model_type: str
    source: str
    layers: tuple[LayerSpec, ...]
    dtype: DType
    dtype_note: str
    num_attention_heads: int
    hidden_size: int
    vocab_size: int | None
    max_context: int | None
    config: dict[str, Any] = field(compare=False, repr=False)
    published_params: int | None = None  # the catalog's parameter count (includes vision towers of VLMs)

    @classmethod
    def from_config(cls, source: Any, *, name: str | None = None) -> ModelSpec:
        """Read a config.json path or folder, a hub id (cached or reachable), a catalog name, a dict or a
        transformers config. Raises :class:`ModelConfigError` for configs we cannot use and
        :class:`UnknownModel` for names that match nothing (with the closest catalog names)."""
        raw, display, origin = load_config(source)
        config = text_config(raw)
        label = name or display
        where = f"{label} ({origin})"
        count = positive(
            config, "num_hidden_layers", "n_layer", "num_layers", "n_layers", what="layer count", source=where
        )
        heads = positive(
            config, "num_attention_heads", "n_head", "n_heads", "num_heads", what="attention heads", source=where
        )
        hidden = positive(config, "hidden_size", "n_embd", "d_model", what="hidden_size", source=where)
        check_config_sizes(config, where)  # every size field in range before any list is sized from them
        explicit = first(config, "head_dim", "hidden_size_per_head")
        if explicit is not None and (isinstance(explicit, bool) or not isinstance(explicit, int) or explicit <= 0):
            raise ModelConfigError(f"{where}: head_dim must be a positive integer, got {explicit!r}")
        head_dim = explicit or hidden // heads
        if not explicit and hidden % heads:
            raise ModelConfigError(f"{where}: hidden_size {hidden} is not a multiple of {heads} heads; set head_dim")
        model_dtype, dtype_note = _dtype_of(config)
        geometry = _Geometry(
            source=where,
            heads=heads,
            kv_heads=_kv_heads(config, heads, where),
            head_dim=head_dim,
            v_head_dim=head_dim,
            dtype=model_dtype,
        )
        kinds = layer_kinds(config, count, where)
        layers = [LAYER_BUILDERS[kind](config, geometry) for kind in kinds]
        shared = first(config, "num_kv_shared_layers") or 0
        if shared:  # Gemma 3n: the last layers reuse earlier layers' KV
            layers[count - shared :] = [NoCache(reason="reuses an earlier layer's KV")] * shared
        vocab = first(config, "vocab_size", "padded_vocab_size")  # checked above: an int in range, or absent
        entry = catalog.find(display) if origin == "catalog" else None
        return cls(
            name=label,
            model_type=str(config.get("model_type") or "unknown"),
            source=origin,
            layers=tuple(layers),
            dtype=model_dtype,
            dtype_note=dtype_note,
            num_attention_heads=heads,
            hidden_size=hidden,
            vocab_size=vocab if isinstance(vocab, int) else None,
            max_context=max_context(config),
            config=config,
            published_params=entry.params if entry is not None else None,
        )

    def kinds(self) -> dict[str, int]:
        """Layers per kind."""
        counts: dict[str, int] = {}
        for layer in self.layers:
            counts[layer.kind] = counts.get(layer.kind, 0) + 1
        return counts

    def kv(
        self,
        tokens: int,
        sequences: int = 1,
        *,
        runtime: str = "transformers",
        kv_dtype: str = "auto",
        tp: int = 1,
        **settings: Any,
    ) -> Any:
        """The KV cache report for ``sequences`` sequences of ``tokens`` tokens on ``runtime`` (per GPU under
        tensor parallelism ``tp``); ``settings`` are the runtime's (see ``RuntimeSettings``)."""
        from .runtimes import kv_report

        return kv_report(self, tokens, sequences, runtime=runtime, kv_dtype=kv_dtype, tp=tp, **settings)

    def kv_bytes(
        self,
        tokens: int,
        sequences: int = 1,
        *,
        runtime: str = "transformers",
        kv_dtype: str = "auto",
        tp: int = 1,
        **settings: Any,
    ) -> int:
        """Bytes of KV cache (per GPU) for ``sequences`` sequences of ``tokens`` tokens on ``runtime``."""
        return int(self.kv(tokens, sequences, runtime=runtime, kv_dtype=kv_dtype, tp=tp, **settings).bytes)
