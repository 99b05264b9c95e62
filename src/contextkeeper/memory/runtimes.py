"""Runtime profiles: how transformers, vLLM, SGLang and llama.cpp store a model's KV cache.

A profile turns the architecture's layers into the layers that runtime allocates (``layers``), and sums them
for a number of sequences (``kv_bytes``). The rules, with the runtime sources they were read from, are in
docs/memory.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Literal

from .._exceptions import ConfigurationError
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
from .limits import check_choice, check_fields, check_numbers
from .model import ModelSpec

__all__ = ["RUNTIMES", "KVReport", "Runtime", "RuntimeSettings", "kv_report", "runtime_profile"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, kw_only=True)
class RuntimeSettings:
    """Runtime options that change how much KV is held. Each applies to the runtimes named in its comment."""

    tp: int = 1  # tensor parallel GPUs (vllm, sglang): KV heads per GPU = max(1, heads // tp)
    block_size: int | None = None  # vllm: tokens per block (16; MLA 64)
    max_num_batched_tokens: int | None = None  # vllm: prefill chunk; sliding layers plan W - 1 + this (8192)
    phase: Literal["plan", "steady"] = "plan"  # vllm: what a sliding layer holds while admitting vs decoding
    hybrid_manager: bool = True  # vllm: off allocates sliding and chunked layers in full
    mamba_cache_mode: Literal["none", "align", "all"] = "align"  # vllm: state copies per sequence
    n_ubatch: int = 512  # llama.cpp: micro-batch; the SWA cache holds window + n_ubatch
    swa_full: bool = False  # llama.cpp --swa-full: sliding layers in full
    kv_unified: bool = False  # llama.cpp --kv-unified: one pool for all slots
    mla_cache: Literal["k", "kv"] = "k"  # llama.cpp: V-less MLA cache (since Jan 2026) or K 576 + V 512
    q_group_size: int = 64  # transformers QuantizedCache: values per scale/shift group
    residual_length: int = 128  # transformers QuantizedCache: recent tokens kept unquantised before a flush
    decode_steps: int | None = None  # transformers QuantizedCache while decoding: steps since the prompt

    def __post_init__(self) -> None:
        check_fields(self)  # every number against its registered range (limits.py)
        check_choice("phase", self.phase, ("plan", "steady"))
        check_choice("mamba_cache_mode", self.mamba_cache_mode, ("none", "align", "all"))
        check_choice("mla_cache", self.mla_cache, ("k", "kv"))
        for name in ("hybrid_manager", "swa_full", "kv_unified"):
            check_choice(name, getattr(self, name), (True, False))


@dataclass(frozen=True, kw_only=True)
class KVReport:
    """The KV cache for ``sequences`` sequences of ``tokens`` tokens, per GPU."""

    model: str
    runtime: str
    kv_dtype: str
    tokens: int
    sequences: int
    tp: int
    bytes: int
    bytes_per_token: int  # each further token of one sequence, once past every window
    fixed_bytes: int  # per sequence at this length: windows and states that do not grow
    by_kind: dict[str, int] = field(default_factory=dict)  # bytes per layer kind (all sequences)
    layers: dict[str, int] = field(default_factory=dict)  # layer count per kind, as allocated
    notes: tuple[str, ...] = ()

    @property
    def gib(self) -> float:
        return self.bytes / 2**30

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["notes"] = list(self.notes)
        data["gib"] = round(self.gib, 4)
        return data


class Runtime:
    """A runtime profile. ``layers`` is the extension point; ``kv_bytes`` sums them (runtimes that group or
    pool layers override it)."""

    name: ClassVar[str]
    kv_dtypes: ClassVar[tuple[str, ...]]

    def auto_dtype(self, model: ModelSpec) -> tuple[DType, str | None]:
        """The cache dtype for ``--kv-dtype auto`` and a note when it differs from the checkpoint's."""
        return model.dtype, None

    def layers(self, model: ModelSpec, kv: DType, settings: RuntimeSettings) -> tuple[list[LayerSpec], list[str]]:
        """The layers as this runtime allocates them for one sequence on one GPU, and notes."""
        raise NotImplementedError

    def kv_bytes(self, layers: list[LayerSpec], tokens: int, sequences: int, settings: RuntimeSettings) -> int:
        return sequences * sum(layer.bytes_for(tokens) for layer in layers) + sum(
            layer.bookkeeping_bytes(tokens) for layer in layers
        )


def _per_gpu_heads(kv_heads: int, tp: int, model: ModelSpec) -> int:
    if tp == 1:
        return kv_heads
    if model.num_attention_heads % tp:
        raise ConfigurationError(
            f"{model.name}: {model.num_attention_heads} attention heads cannot be split over tp={tp} GPUs; "
            "choose --tp (or --gpus) among the divisors of the head count"
        )
    if kv_heads % tp and tp % kv_heads:
        raise ConfigurationError(
            f"{model.name}: {kv_heads} KV heads cannot be split over tp={tp} GPUs (one must divide the other); "
            "choose --tp from the divisors or multiples of the KV head count"
        )
    return max(1, kv_heads // tp)  # replicated once tp exceeds the heads


def _installed(package: str) -> tuple[int, ...] | None:
    """The installed version of ``package`` as numbers, without importing it (None when absent)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        text = version(package)
    except PackageNotFoundError:
        return None
    numbers: list[int] = []
    for part in text.split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        numbers.append(int(digits))
    return tuple(numbers)


class Transformers(Runtime):
    """transformers' DynamicCache as the installed version builds it (``DynamicCache(config=...)``), counted
    as resident memory: the tensors' storage, not just the visible rows. The ``quanto-int4``/``-int2`` and
    ``hqq-int4``/``-int2`` dtypes are its QuantizedCache (``cache_implementation="quantized"``)."""

    name = "transformers"
    kv_dtypes = ("fp32", "fp16", "bf16", "quanto-int4", "quanto-int2", "hqq-int4", "hqq-int2")
    quantized: ClassVar[frozenset[str]] = frozenset({"quanto-int4", "quanto-int2", "hqq-int4", "hqq-int2"})

    def __init__(self) -> None:
        self._quant: DType | None = None

    def kv_bytes(self, layers: list[LayerSpec], tokens: int, sequences: int, settings: RuntimeSettings) -> int:
        quant = self._quant
        if quant is None:
            return super().kv_bytes(layers, tokens, sequences, settings)
        return sum(
            _quantized_layer(layer, quant, tokens, sequences, settings)
            for layer in layers
            if isinstance(layer, FullAttention)
        )

    def layers(self, model: ModelSpec, kv: DType, settings: RuntimeSettings) -> tuple[list[LayerSpec], list[str]]:
        if settings.tp != 1:
            raise ConfigurationError("transformers' cache is not split by tensor parallelism here; use tp=1")
        self._quant = kv if kv.name in self.quantized else None
        if self._quant is not None:
            if any(
                not isinstance(layer, FullAttention) or isinstance(layer, SlidingAttention) for layer in model.layers
            ):
                raise ConfigurationError(
                    f"{kv.name}: QuantizedCache sizing covers full-attention models only; {model.name} has "
                    f"{', '.join(sorted(model.kinds()))} layers"
                )
            kv = model.dtype  # scales, shifts and the residual are kept in the model's dtype
        version = _installed("transformers")
        latent_mla = version is None or version >= (5,)
        steady = settings.phase == "steady"
        out: list[LayerSpec] = []
        notes: list[str] = []
        fp32 = dtype("fp32")
        heads_override = _transformers_heads(model)
        for layer in model.layers:
            if isinstance(layer, SlidingAttention):
                # DynamicSlidingWindowLayer shows the last window - 1 tokens, but as a view of the concatenated
                # states: after a prefill the whole prompt stays resident, while decoding `window` rows do.
                out.append(replace(layer, dtype=kv, keep=layer.window if steady else None, extra_bytes=8))
            elif isinstance(layer, FullAttention):
                out.append(replace(layer, dtype=kv, kv_heads=heads_override or layer.kv_heads))
            elif isinstance(layer, MLAttention):
                if latent_mla:  # transformers 5 caches the latent (keys) and the rope key (values)
                    out.append(replace(layer, dtype=kv, v_dim=0))
                else:  # 4.x expanded the latent into per-head K (nope + rope) and V before caching
                    out.append(
                        FullAttention(
                            kv_heads=layer.num_heads,
                            head_dim=layer.nope_dim + layer.rope_dim,
                            v_head_dim=layer.v_head_dim,
                            dtype=kv,
                        )
                    )
            elif isinstance(layer, RecurrentState):
                # The whole conv kernel in the model dtype; the SSM / recurrent state in float32.
                out.append(replace(layer, conv_width=layer.conv_kernel, conv_dtype=kv, ssm_dtype=fp32))
            else:
                out.append(layer)
        if any(isinstance(layer, SlidingAttention) for layer in model.layers):
            if steady:
                notes.append("sliding layers while decoding: `window` rows resident (window - 1 visible)")
            else:
                notes.append(
                    "sliding layers right after a prefill keep the whole prompt resident (the window is a view); "
                    "while decoding they hold `window` rows (phase='steady')"
                )
        if any(isinstance(layer, MLAttention) for layer in model.layers):
            notes.append(
                "MLA cached as the latent (transformers 5)"
                if latent_mla
                else "MLA cached decompressed (transformers 4)"
            )
        if heads_override:
            notes.append(f"{model.model_type}: transformers caches all {heads_override} heads (KV expanded first)")
        return out, notes


def _quantized_layer(layer: FullAttention, quant: DType, tokens: int, sequences: int, settings: RuntimeSettings) -> int:
    """Bytes of one QuantizedCache layer (measured rule, see docs/memory.md): the prompt is quantised at once;
    decoded tokens collect in a full-precision residual that is flushed (everything re-quantised) when it reaches
    ``residual_length``. Groups of ``q_group_size`` consecutive values span the whole batch tensor."""
    if tokens <= 0:
        return 0
    backend, _, bits = quant.name.partition("-int")
    per_byte = 8 // int(bits)
    group = settings.q_group_size
    element = layer.dtype.block_bytes  # the model's dtype
    if settings.phase == "plan":
        residual = 0  # right after the prompt: all quantised
    elif settings.decode_steps is not None:
        residual = settings.decode_steps % settings.residual_length
    else:
        residual = min(settings.residual_length - 1, tokens - 1)  # the worst point of the cycle
    quantised = tokens - residual
    total = 0
    for width in (layer.head_dim, layer.v_head_dim):
        values = sequences * layer.kv_heads * quantised * width
        if values % group:
            raise ConfigurationError(
                f"QuantizedCache needs q_group_size ({group}) to divide the {values} values of a layer's keys; "
                "choose a q_group_size that divides kv_heads × head_dim"
            )
        groups = values // group
        if backend == "quanto":
            data = -(-groups // per_byte) * group
            scales = 2 * element * (groups if groups > 1 else group)
        else:  # hqq
            data = -(-group // per_byte) * groups
            scales = 2 * groups * element
        total += data + scales + sequences * layer.kv_heads * residual * width * element
    return total


def _transformers_heads(model: ModelSpec) -> int | None:
    """Families whose transformers implementation caches more heads than the config's KV heads."""
    config = model.config
    if model.model_type == "falcon" and config.get("new_decoder_architecture"):
        return model.num_attention_heads  # K and V are broadcast to every query head before the cache update
    if model.model_type == "mpt":
        return model.num_attention_heads  # attn_config's multi-query settings are not used
    return None


class VLLM(Runtime):
    """vLLM's v1 engine: paged blocks, the hybrid allocator, MLA latents, tensor parallelism."""

    name = "vllm"
    kv_dtypes = ("fp32", "fp16", "bf16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_ds_mla")

    def auto_dtype(self, model: ModelSpec) -> tuple[DType, str | None]:
        if model.dtype.name == "fp32":
            return dtype("fp16"), "vLLM serves float32 checkpoints in float16 (the KV cache follows)"
        return model.dtype, None

    def layers(self, model: ModelSpec, kv: DType, settings: RuntimeSettings) -> tuple[list[LayerSpec], list[str]]:
        block = settings.block_size or 16
        chunk = settings.max_num_batched_tokens or 8192
        plan = settings.phase == "plan"
        notes: list[str] = []
        out: list[LayerSpec] = []
        if kv.name == "fp8_ds_mla" and not any(isinstance(layer, MLAttention) for layer in model.layers):
            raise ConfigurationError(f"fp8_ds_mla is vLLM's MLA cache format; {model.name} has no MLA layers")
        for layer in model.layers:
            if isinstance(layer, SlidingAttention):
                heads = _per_gpu_heads(layer.kv_heads, settings.tp, model)
                if not settings.hybrid_manager:
                    out.append(
                        FullAttention(
                            kv_heads=heads, head_dim=layer.head_dim, v_head_dim=layer.v_head_dim, dtype=kv, block=block
                        )
                    )
                    continue
                if isinstance(layer, ChunkedAttention):
                    keep, spare = (layer.window + chunk, 0) if plan else (layer.window, 1)
                else:
                    keep, spare = (layer.window - 1 + chunk, 1) if plan else (layer.window, 1)
                out.append(replace(layer, kv_heads=heads, dtype=kv, block=block, keep=keep, spare_blocks=spare))
            elif isinstance(layer, FullAttention):
                heads = _per_gpu_heads(layer.kv_heads, settings.tp, model)
                out.append(replace(layer, kv_heads=heads, dtype=kv, block=block))
            elif isinstance(layer, MLAttention):
                # One latent "head", replicated on every GPU; MLA kernels want larger blocks (FlashMLA: 64).
                packed = 656 if kv.name == "fp8_ds_mla" else None
                out.append(
                    replace(layer, dtype=kv, v_dim=0, block=settings.block_size or 64, token_bytes_override=packed)
                )
            elif isinstance(layer, RecurrentState):
                copies = {"none": 1, "align": 2, "all": 1}[settings.mamba_cache_mode]
                out.append(replace(_server_state(layer, model, settings.tp), copies=copies))
            else:
                out.append(layer)
        if any(isinstance(layer, SlidingAttention) for layer in model.layers):
            if not settings.hybrid_manager:
                notes.append("hybrid KV cache manager off: sliding and chunked layers are allocated in full")
            elif plan:
                notes.append(
                    f"sliding layers counted as vLLM plans them: window - 1 + max_num_batched_tokens ({chunk}) "
                    "+ 1 block; in steady decoding they hold about window + 1 block (phase='steady')"
                )
        if any(isinstance(layer, MLAttention) for layer in model.layers):
            notes.append("MLA stored as the latent (kv_lora_rank + rope dims), one copy on every GPU")
        out = _align_hybrid_pages(out, block)
        return out, notes

    def kv_bytes(self, layers: list[LayerSpec], tokens: int, sequences: int, settings: RuntimeSettings) -> int:
        if not settings.hybrid_manager:
            return super().kv_bytes(layers, tokens, sequences, settings)
        # Hybrid allocator: layers of one type form groups of group_size; a type whose count is not a multiple
        # of group_size gets padding layers that cost real memory (Gemma-3-27B: 52 sliding -> 60).
        types: dict[LayerSpec, int] = {}
        for layer in layers:
            if not isinstance(layer, NoCache):
                types[layer] = types.get(layer, 0) + 1
        if len(types) <= 1:
            return super().kv_bytes(layers, tokens, sequences, settings)
        counts = list(types.values())
        group = min(counts)
        if max(counts) < 1.5 * group:
            group = max(counts)
        total = 0
        for layer, count in types.items():
            padded = _cdiv(count, group) * group
            per = layer.bytes_for(tokens)
            if isinstance(layer, RecurrentState) and settings.mamba_cache_mode == "all":
                per = per * max(1, _cdiv(tokens, _attention_block(layers) or 16))
            total += padded * per
        return sequences * total


def _server_state(layer: RecurrentState, model: ModelSpec, tp: int) -> RecurrentState:
    """A state as vLLM and SGLang keep it: ``kernel - 1`` conv columns, split over ``tp`` GPUs, in the model's
    dtype (the SSM state in ``mamba_ssm_dtype`` when the config names one)."""
    return replace(
        layer,
        conv_width=layer.conv_kernel - 1,
        conv_channels=layer.conv_channels // tp,
        ssm_values=layer.ssm_values // tp,
        conv_dtype=model.dtype,
        ssm_dtype=_state_dtype(model) or model.dtype,
    )


def _state_dtype(model: ModelSpec) -> DType | None:
    name = model.config.get("mamba_ssm_dtype")
    return dtype(str(name).replace("torch.", "")) if name else None


def _attention_block(layers: list[LayerSpec]) -> int | None:
    for layer in layers:
        if isinstance(layer, FullAttention):
            return layer.block
    return None


def _align_hybrid_pages(layers: list[LayerSpec], block: int) -> list[LayerSpec]:
    """vLLM's hybrid attention + state models: the attention block grows until one attention page holds a
    state page, and the state page is padded to the attention page."""
    states = [layer for layer in layers if isinstance(layer, RecurrentState)]
    attention = [layer for layer in layers if isinstance(layer, FullAttention)]
    if not states or not attention:
        return layers
    per_token = max(layer.token_bytes for layer in attention)
    state_page = max(layer.state_bytes for layer in states)
    align = max(16, block)
    attn_block = align * _cdiv(state_page, align * per_token)
    page = attn_block * per_token
    return [
        replace(layer, block=attn_block)
        if isinstance(layer, FullAttention)
        else replace(layer, page_bytes=page)
        if isinstance(layer, RecurrentState)
        else layer
        for layer in layers
    ]


class SGLang(Runtime):
    """SGLang's token pools: one slot per token (page size 1), MLA latents, KV heads split by attention TP."""

    name = "sglang"
    kv_dtypes = ("fp32", "fp16", "bf16", "fp8", "fp8_e4m3", "fp8_e5m2")

    def auto_dtype(self, model: ModelSpec) -> tuple[DType, str | None]:
        return VLLM().auto_dtype(model)

    def layers(self, model: ModelSpec, kv: DType, settings: RuntimeSettings) -> tuple[list[LayerSpec], list[str]]:
        out: list[LayerSpec] = []
        notes: list[str] = []
        for layer in model.layers:
            if isinstance(layer, SlidingAttention):
                heads = _per_gpu_heads(layer.kv_heads, settings.tp, model)
                out.append(replace(layer, kv_heads=heads, dtype=kv, keep=layer.window))
            elif isinstance(layer, FullAttention):
                out.append(replace(layer, kv_heads=_per_gpu_heads(layer.kv_heads, settings.tp, model), dtype=kv))
            elif isinstance(layer, MLAttention):
                out.append(replace(layer, dtype=kv, v_dim=0))
            elif isinstance(layer, RecurrentState):
                out.append(_server_state(layer, model, settings.tp))
            else:
                out.append(layer)
        if any(isinstance(layer, SlidingAttention) for layer in model.layers):
            notes.append(
                "SGLang sizes its sliding-window pool by --swa-full-tokens-ratio; per request a sliding layer "
                "holds at most the window"
            )
        return out, notes


# llama.cpp honours sliding windows for these families only (Mistral v0.1's window is not implemented).
_LLAMA_CPP_SWA = frozenset({"gemma2", "gemma3", "gemma3_text", "gemma3n", "gemma3n_text", "cohere2", "gpt_oss"})
_LLAMA_CPP_CHUNKED = frozenset({"llama4", "llama4_text"})


class LlamaCpp(Runtime):
    """llama.cpp's KV cache: the context padded to 256 cells, an SWA cache of window + n_ubatch, V-less MLA,
    F32 recurrent states, ``-np`` slots."""

    name = "llama.cpp"
    kv_dtypes = ("fp32", "fp16", "bf16", "q8_0", "q5_0", "q5_1", "q4_0", "q4_1", "iq4_nl")

    def auto_dtype(self, model: ModelSpec) -> tuple[DType, str | None]:
        return dtype("fp16"), None  # -ctk/-ctv default to f16 whatever the weights are

    def layers(self, model: ModelSpec, kv: DType, settings: RuntimeSettings) -> tuple[list[LayerSpec], list[str]]:
        if settings.tp != 1:
            raise ConfigurationError(
                "llama.cpp splits layers across GPUs (--split-mode layer), not KV heads; use tp=1 and divide by "
                "the GPU count"
            )
        notes: list[str] = []
        out: list[LayerSpec] = []
        f32 = dtype("fp32")
        honoured = _LLAMA_CPP_SWA | _LLAMA_CPP_CHUNKED
        for layer in model.layers:
            if isinstance(layer, SlidingAttention):
                if settings.swa_full or model.model_type not in honoured:
                    out.append(
                        FullAttention(
                            kv_heads=layer.kv_heads,
                            head_dim=layer.head_dim,
                            v_head_dim=layer.v_head_dim,
                            dtype=kv,
                            block=256,
                        )
                    )
                    continue
                out.append(replace(layer, dtype=kv, block=256, keep=layer.window + settings.n_ubatch))
            elif isinstance(layer, FullAttention):
                out.append(replace(layer, dtype=kv, block=256))
            elif isinstance(layer, MLAttention):
                v_dim = layer.kv_lora_rank if settings.mla_cache == "kv" else 0
                out.append(replace(layer, dtype=kv, block=256, v_dim=v_dim))
            elif isinstance(layer, RecurrentState):
                out.append(replace(layer, conv_width=layer.conv_kernel - 1, conv_dtype=f32, ssm_dtype=f32))
            else:
                out.append(layer)
        for layer in out:
            rows = _row_lengths(layer)
            if kv.block_values > 1 and any(n % kv.block_values for n in rows):
                raise ConfigurationError(
                    f"llama.cpp cannot store {model.name}'s KV rows of {sorted(set(rows))} values as {kv.name} "
                    f"(rows must be multiples of {kv.block_values}); use --kv-dtype fp16 or q8_0 on another model"
                )
        sliding = [layer for layer in model.layers if isinstance(layer, SlidingAttention)]
        if sliding and (settings.swa_full or model.model_type not in honoured):
            why = "--swa-full" if settings.swa_full else f"llama.cpp does not implement {model.model_type}'s window"
            notes.append(f"sliding layers allocated in full ({why})")
        elif sliding:
            notes.append(f"the SWA cache holds window + n_ubatch ({settings.n_ubatch}) cells, padded to 256")
        notes.append("the context is padded to a multiple of 256 cells")
        return out, notes

    def kv_bytes(self, layers: list[LayerSpec], tokens: int, sequences: int, settings: RuntimeSettings) -> int:
        if not settings.kv_unified or sequences == 1:
            return super().kv_bytes(layers, tokens, sequences, settings)
        # One pool of tokens × sequences cells; the SWA pool holds window × sequences + n_ubatch.
        cells = tokens * sequences
        total = 0
        for layer in layers:
            if isinstance(layer, SlidingAttention) and layer.keep is not None:
                swa = replace(layer, keep=layer.window * sequences + settings.n_ubatch)
                total += swa.bytes_for(cells)
            elif isinstance(layer, RecurrentState):
                total += sequences * layer.bytes_for(tokens)
            else:
                total += layer.bytes_for(cells)
        return total


def _row_lengths(layer: LayerSpec) -> list[int]:
    if isinstance(layer, FullAttention):
        return [layer.kv_heads * layer.head_dim, layer.kv_heads * layer.v_head_dim]
    if isinstance(layer, MLAttention):
        return [layer.kv_lora_rank + layer.rope_dim] + ([layer.v_dim] if layer.v_dim else [])
    return []


RUNTIMES: dict[str, Callable[[], Runtime]] = {
    "transformers": Transformers,
    "vllm": VLLM,
    "sglang": SGLang,
    "llama.cpp": LlamaCpp,
}
_RUNTIME_ALIASES = {"llamacpp": "llama.cpp", "llama-cpp": "llama.cpp", "hf": "transformers", "ollama": "llama.cpp"}


def runtime_profile(name: str) -> Runtime:
    """The profile called ``name`` (transformers, vllm, sglang, llama.cpp; ollama counts as llama.cpp)."""
    key = name.strip().lower() if isinstance(name, str) else ""
    key = _RUNTIME_ALIASES.get(key, key)
    if key not in RUNTIMES:
        raise ConfigurationError(f"unknown runtime {name!r}: --runtime takes one of {', '.join(RUNTIMES)}")
    return RUNTIMES[key]()


def kv_report(
    model: ModelSpec,
    tokens: int,
    sequences: int = 1,
    *,
    runtime: str = "transformers",
    kv_dtype: str = "auto",
    tp: int = 1,
    **settings: Any,
) -> KVReport:
    """The KV cache ``runtime`` holds for ``sequences`` sequences of ``tokens`` tokens (per GPU)."""
    check_numbers(tokens=tokens, sequences=sequences, tp=tp)
    profile = runtime_profile(runtime)
    try:
        options = RuntimeSettings(tp=tp, **settings)
    except TypeError as exc:
        known = ", ".join(f.name for f in dataclasses.fields(RuntimeSettings))
        raise ConfigurationError(f"{exc}; runtime settings are: {known}") from None
    notes: list[str] = []
    if kv_dtype == "auto":
        kv, note = profile.auto_dtype(model)
        if note:
            notes.append(note)
    else:
        kv = dtype(kv_dtype)
        if kv.name not in profile.kv_dtypes:
            raise ConfigurationError(
                f"{profile.name} cannot hold its KV cache as {kv.name}; --kv-dtype takes auto or one of "
                f"{', '.join(profile.kv_dtypes)} for this runtime"
            )
    layers, layer_notes = profile.layers(model, kv, options)
    notes.extend(layer_notes)
    total = profile.kv_bytes(layers, tokens, sequences, options)
    by_kind: dict[str, int] = {}
    counts: dict[str, int] = {}
    for layer in layers:
        held = sequences * layer.bytes_for(tokens) + layer.bookkeeping_bytes(tokens)
        by_kind[layer.kind] = by_kind.get(layer.kind, 0) + held
        counts[layer.kind] = counts.get(layer.kind, 0) + 1
    per_token = sum(layer.bytes_per_token for layer in layers)
    fixed = sum(layer.bytes_for(tokens) for layer in layers if layer.bytes_per_token == 0)
    if total != sum(by_kind.values()):
        notes.append(f"{total - sum(by_kind.values()):,} bytes of allocator padding or pooling (layer groups, slots)")
    return KVReport(
        model=model.name,
        runtime=profile.name,
        kv_dtype=kv.name,
        tokens=tokens,
        sequences=sequences,
        tp=options.tp,
        bytes=total,
        bytes_per_token=per_token,
        fixed_bytes=fixed,
        by_kind=by_kind,
        layers=counts,
        notes=tuple(notes),
    )
