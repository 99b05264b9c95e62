"""Runtime profiles: how transformers, vLLM, SGLang and llama.cpp store a model's KV cache.

A profile turns the architecture's layers into the layers that runtime allocates (``layers``), and sums them
for a number of sequences (``kv_bytes``). Each profile holds one rule per layer kind (``KVRules``, keyed by the
layer's exact ``kind``); a kind without a rule is a ``ConfigurationError``, never a fall-through to a look-alike.
The rules, with the runtime sources they were read from, are in docs/memory.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Literal, TypeAlias, TypeVar

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

if TYPE_CHECKING:  # (the model reaches its runtimes through ModelSpec.kv: a type-only import back)
    from .model import ModelSpec

__all__ = [
    "RUNTIMES",
    "KVReport",
    "KVRules",
    "KindTable",
    "Runtime",
    "RuntimeSettings",
    "Unsupported",
    "kv_report",
    "runtime_profile",
    "unchanged",
]


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


V = TypeVar("V")
C = TypeVar("C")

# A runtime's rule for one layer kind: the architecture's layer -> the layer it allocates (one sequence, one GPU).
# ``context`` is what the runtime works out once per model (the model itself, or its installed version's quirks).
Rule: TypeAlias = Callable[[Any, DType, RuntimeSettings, C], LayerSpec]


def unchanged(layer: LayerSpec, kv: DType, settings: RuntimeSettings, context: object) -> LayerSpec:
    """The rule for a kind a runtime keeps as the architecture describes it (``NoCache``: nothing to hold)."""
    return layer


@dataclass(frozen=True, kw_only=True)
class Unsupported:
    """Declares a layer kind a runtime cannot hold: sizing a model with one raises ``ConfigurationError`` saying
    ``why``, with ``fix``."""

    why: str
    fix: str


class KindTable(Generic[V]):
    """Entries keyed by exact layer kind. A layer whose kind has no entry (or whose class is not the one the
    entry was declared for) is a ``ConfigurationError`` naming ``owner``, the kind and the model."""

    def __init__(self, owner: str, entries: Mapping[type[LayerSpec], V]) -> None:
        self.owner = owner
        self._specs: dict[str, type[LayerSpec]] = {}
        self._entries: dict[str, V] = {}
        for spec, entry in entries.items():
            if spec.kind in self._specs:
                raise TypeError(
                    f"{owner}: {spec.__name__} and {self._specs[spec.kind].__name__} share kind {spec.kind!r}"
                )
            self._specs[spec.kind] = spec
            self._entries[spec.kind] = entry

    @property
    def kinds(self) -> frozenset[str]:
        """The kinds this table has an entry for."""
        return frozenset(self._entries)

    def covers(self, spec: type[LayerSpec]) -> bool:
        """Whether this table has an entry declared for exactly ``spec``."""
        return self._specs.get(spec.kind) is spec

    def entry(self, spec: type[LayerSpec]) -> V:
        """The entry declared for ``spec`` (KeyError when there is none)."""
        if not self.covers(spec):
            raise KeyError(spec.kind)
        return self._entries[spec.kind]

    def lookup(self, layer: LayerSpec, model: str | None = None) -> V:
        """The entry for ``layer``'s exact kind and class (``model``: the model's name, for the error)."""
        if not self.covers(type(layer)):
            raise _no_rule(self.owner, layer, model)
        return self._entries[layer.kind]


class KVRules(KindTable[Rule[C] | Unsupported], Generic[C]):
    """One runtime's rules: for each layer kind, how that runtime allocates it (or why it cannot)."""

    @property
    def passed(self) -> frozenset[str]:
        """Kinds the runtime keeps as they are, declared with :func:`unchanged`."""
        return frozenset(kind for kind, rule in self._entries.items() if rule is unchanged)

    @property
    def unsupported(self) -> frozenset[str]:
        """Kinds declared :class:`Unsupported`."""
        return frozenset(kind for kind, rule in self._entries.items() if isinstance(rule, Unsupported))

    def rules_for(self, model: ModelSpec) -> dict[type[LayerSpec], Rule[C]]:
        """The rule for each class of layer in ``model``; raises before any layer is sized when one has none."""
        found: dict[type[LayerSpec], Rule[C]] = {}
        for layer in model.layers:
            if type(layer) in found:
                continue
            rule = self.lookup(layer, model.name)
            if isinstance(rule, Unsupported):
                count = sum(type(other) is type(layer) for other in model.layers)
                raise ConfigurationError(
                    f"{self.owner} cannot hold {layer.kind!r} layers (model {model.name}: {count} of "
                    f"{len(model.layers)} layers): {rule.why}. Fix: {rule.fix}"
                )
            found[type(layer)] = rule
        return found

    def apply(self, model: ModelSpec, kv: DType, settings: RuntimeSettings, context: C) -> list[LayerSpec]:
        """``model``'s layers through the rule for each one's kind, in order."""
        rules = self.rules_for(model)
        return [rules[type(layer)](layer, kv, settings, context) for layer in model.layers]


def _no_rule(owner: str, layer: LayerSpec, model: str | None) -> ConfigurationError:
    of = f"{type(layer).__name__}, model {model}" if model else type(layer).__name__
    return ConfigurationError(
        f"{owner} has no KV rule for {layer.kind!r} layers ({of}); contextkeeper does not guess what a runtime "
        f"holds for a layer kind it has no rule for. Fix: add an entry for {type(layer).__name__} to the {owner} "
        "rules in contextkeeper.memory.runtimes (one per layer kind)"
    )


class Runtime:
    """A runtime profile. ``rules`` holds its rule for each layer kind; ``layers`` maps a model's layers through
    them (with the checks and page alignment a runtime needs around that); ``kv_bytes`` sums them (runtimes
    that group or pool layers override it)."""

    name: ClassVar[str]
    kv_dtypes: ClassVar[tuple[str, ...]]
    rules: ClassVar[KVRules[Any]]

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


_WINDOWED = frozenset({SlidingAttention.kind, ChunkedAttention.kind})  # kinds whose notes speak of "sliding layers"


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


@dataclass(frozen=True, kw_only=True)
class _HFContext:
    latent_mla: bool  # transformers 5 caches MLA as the latent; 4.x decompressed it
    heads: int | None  # the heads this family's implementation really caches (None: the config's KV heads)
    state_length: bool = False  # 5.25+: each linear (recurrent) cache layer keeps the length seen, an int64 scalar


def _hf_full(layer: FullAttention, kv: DType, settings: RuntimeSettings, ctx: _HFContext) -> LayerSpec:
    return replace(layer, dtype=kv, kv_heads=ctx.heads or layer.kv_heads)


def _hf_window(layer: SlidingAttention, kv: DType, settings: RuntimeSettings, ctx: _HFContext) -> LayerSpec:
    # DynamicSlidingWindowLayer shows the last window - 1 tokens, but as a view of the concatenated states:
    # after a prefill the whole prompt stays resident, while decoding `window` rows do. Chunked layers alike.
    steady = settings.phase == "steady"
    return replace(layer, dtype=kv, keep=layer.window if steady else None, extra_bytes=8)


def _hf_mla(layer: MLAttention, kv: DType, settings: RuntimeSettings, ctx: _HFContext) -> LayerSpec:
    if ctx.latent_mla:  # transformers 5 caches the latent (keys) and the rope key (values)
        return replace(layer, dtype=kv, v_dim=0)
    # 4.x expanded the latent into per-head K (nope + rope) and V before caching
    return FullAttention(
        kv_heads=layer.num_heads, head_dim=layer.nope_dim + layer.rope_dim, v_head_dim=layer.v_head_dim, dtype=kv
    )


def _hf_state(layer: RecurrentState, kv: DType, settings: RuntimeSettings, ctx: _HFContext) -> LayerSpec:
    # The whole conv kernel in the model dtype; the SSM / recurrent state in float32.
    extra = 8 if ctx.state_length else 0
    return replace(layer, conv_width=layer.conv_kernel, conv_dtype=kv, ssm_dtype=dtype("fp32"), extra_bytes=extra)


class Transformers(Runtime):
    """transformers' DynamicCache as the installed version builds it (``DynamicCache(config=...)``), counted
    as resident memory: the tensors' storage, not just the visible rows. The ``quanto-int4``/``-int2`` and
    ``hqq-int4``/``-int2`` dtypes are its QuantizedCache (``cache_implementation="quantized"``)."""

    name = "transformers"
    kv_dtypes = ("fp32", "fp16", "bf16", "quanto-int4", "quanto-int2", "hqq-int4", "hqq-int2")
    quantized: ClassVar[frozenset[str]] = frozenset({"quanto-int4", "quanto-int2", "hqq-int4", "hqq-int2"})
    rules: ClassVar[KVRules[_HFContext]] = KVRules(
        "transformers",
        {
            FullAttention: _hf_full,
            SlidingAttention: _hf_window,
            ChunkedAttention: _hf_window,
            MLAttention: _hf_mla,
            RecurrentState: _hf_state,
            NoCache: unchanged,
        },
    )

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
        kinds = model.kinds()
        self._quant = kv if kv.name in self.quantized else None
        if self._quant is not None:
            if set(kinds) != {FullAttention.kind}:
                raise ConfigurationError(
                    f"{kv.name}: QuantizedCache sizing covers full-attention models only; {model.name} has "
                    f"{', '.join(sorted(kinds))} layers"
                )
            kv = model.dtype  # scales, shifts and the residual are kept in the model's dtype
        version = _installed("transformers")
        newest = version is None or version >= (5, 25)  # (absent: the rules of the newest release measured)
        context = _HFContext(
            latent_mla=version is None or version >= (5,),
            heads=_transformers_heads(model, newest),
            state_length=newest,
        )
        out = self.rules.apply(model, kv, settings, context)
        notes: list[str] = []
        if _WINDOWED & kinds.keys():
            if settings.phase == "steady":
                notes.append("sliding layers while decoding: `window` rows resident (window - 1 visible)")
            else:
                notes.append(
                    "sliding layers right after a prefill keep the whole prompt resident (the window is a view); "
                    "while decoding they hold `window` rows (phase='steady')"
                )
        if MLAttention.kind in kinds:
            notes.append(
                "MLA cached as the latent (transformers 5)"
                if context.latent_mla
                else "MLA cached decompressed (transformers 4)"
            )
        if context.heads:
            notes.append(f"{model.model_type}: transformers caches all {context.heads} heads (KV expanded first)")
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


def _transformers_heads(model: ModelSpec, newest: bool) -> int | None:
    """Families whose transformers implementation caches more heads than the config's KV heads (``newest``:
    transformers 5.25 or later)."""
    config = model.config
    if model.model_type == "falcon" and config.get("new_decoder_architecture") and not newest:
        # Before 5.25, K and V were broadcast to every query head before the cache update; since, the KV heads are.
        return model.num_attention_heads
    if model.model_type == "mpt":
        return model.num_attention_heads  # attn_config's multi-query settings are not used
    return None


def _vllm_block(settings: RuntimeSettings) -> int:
    return settings.block_size or 16


def _vllm_chunk(settings: RuntimeSettings) -> int:
    return settings.max_num_batched_tokens or 8192


def _vllm_windowed(
    layer: SlidingAttention, kv: DType, settings: RuntimeSettings, model: ModelSpec, keep: int, spare: int
) -> LayerSpec:
    heads = _per_gpu_heads(layer.kv_heads, settings.tp, model)
    block = _vllm_block(settings)
    if not settings.hybrid_manager:  # without the hybrid allocator every layer gets the full-attention pages
        return FullAttention(
            kv_heads=heads, head_dim=layer.head_dim, v_head_dim=layer.v_head_dim, dtype=kv, block=block
        )
    return replace(layer, kv_heads=heads, dtype=kv, block=block, keep=keep, spare_blocks=spare)


def _vllm_sliding(layer: SlidingAttention, kv: DType, settings: RuntimeSettings, model: ModelSpec) -> LayerSpec:
    # A window need not start on a block boundary: one spare block. While admitting, a prefill chunk is held on
    # top of the window - 1 tokens the next token attends to.
    chunk = _vllm_chunk(settings)
    keep = layer.window - 1 + chunk if settings.phase == "plan" else layer.window
    return _vllm_windowed(layer, kv, settings, model, keep, 1)


def _vllm_chunked(layer: ChunkedAttention, kv: DType, settings: RuntimeSettings, model: ModelSpec) -> LayerSpec:
    # ChunkedLocalAttentionSpec plans the chunk plus a prefill chunk, without the sliding spec's spare block.
    chunk = _vllm_chunk(settings)
    keep, spare = (layer.window + chunk, 0) if settings.phase == "plan" else (layer.window, 1)
    return _vllm_windowed(layer, kv, settings, model, keep, spare)


def _vllm_full(layer: FullAttention, kv: DType, settings: RuntimeSettings, model: ModelSpec) -> LayerSpec:
    heads = _per_gpu_heads(layer.kv_heads, settings.tp, model)
    return replace(layer, kv_heads=heads, dtype=kv, block=_vllm_block(settings))


def _vllm_mla(layer: MLAttention, kv: DType, settings: RuntimeSettings, model: ModelSpec) -> LayerSpec:
    # One latent "head", replicated on every GPU; MLA kernels want larger blocks (FlashMLA: 64).
    packed = 656 if kv.name == "fp8_ds_mla" else None
    return replace(layer, dtype=kv, v_dim=0, block=settings.block_size or 64, token_bytes_override=packed)


def _vllm_state(layer: RecurrentState, kv: DType, settings: RuntimeSettings, model: ModelSpec) -> LayerSpec:
    copies = {"none": 1, "align": 2, "all": 1}[settings.mamba_cache_mode]
    return replace(_server_state(layer, model, settings.tp), copies=copies)


class VLLM(Runtime):
    """vLLM's v1 engine: paged blocks, the hybrid allocator, MLA latents, tensor parallelism."""

    name = "vllm"
    kv_dtypes = ("fp32", "fp16", "bf16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_ds_mla")
    rules: ClassVar[KVRules[ModelSpec]] = KVRules(
        "vllm",
        {
            FullAttention: _vllm_full,
            SlidingAttention: _vllm_sliding,
            ChunkedAttention: _vllm_chunked,
            MLAttention: _vllm_mla,
            RecurrentState: _vllm_state,
            NoCache: unchanged,
        },
    )

    def auto_dtype(self, model: ModelSpec) -> tuple[DType, str | None]:
        if model.dtype.name == "fp32":
            return dtype("fp16"), "vLLM serves float32 checkpoints in float16 (the KV cache follows)"
        return model.dtype, None

    def layers(self, model: ModelSpec, kv: DType, settings: RuntimeSettings) -> tuple[list[LayerSpec], list[str]]:
        kinds = model.kinds()
        if kv.name == "fp8_ds_mla" and MLAttention.kind not in kinds:
            raise ConfigurationError(f"fp8_ds_mla is vLLM's MLA cache format; {model.name} has no MLA layers")
        out = _align_hybrid_pages(self.rules.apply(model, kv, settings, model), _vllm_block(settings))
        notes: list[str] = []
        if _WINDOWED & kinds.keys():
            if not settings.hybrid_manager:
                notes.append("hybrid KV cache manager off: sliding and chunked layers are allocated in full")
            elif settings.phase == "plan":
                chunk = _vllm_chunk(settings)
                notes.append(
                    f"sliding layers counted as vLLM plans them: window - 1 + max_num_batched_tokens ({chunk}) "
                    "+ 1 block; in steady decoding they hold about window + 1 block (phase='steady')"
                )
        if MLAttention.kind in kinds:
            notes.append("MLA stored as the latent (kv_lora_rank + rope dims), one copy on every GPU")
        return out, notes

    def kv_bytes(self, layers: list[LayerSpec], tokens: int, sequences: int, settings: RuntimeSettings) -> int:
        if not settings.hybrid_manager:
            return super().kv_bytes(layers, tokens, sequences, settings)
        # Hybrid allocator: layers of one type form groups of group_size; a type whose count is not a multiple
        # of group_size gets padding layers that cost real memory (Gemma-3-27B: 52 sliding -> 60).
        types: dict[LayerSpec, int] = {}
        for layer in layers:
            if layer.kind != NoCache.kind:  # shared-KV layers get no pages
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
            if layer.kind == RecurrentState.kind and settings.mamba_cache_mode == "all":  # a state per block
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


def _sglang_full(layer: FullAttention, kv: DType, settings: RuntimeSettings, model: ModelSpec) -> LayerSpec:
    return replace(layer, kv_heads=_per_gpu_heads(layer.kv_heads, settings.tp, model), dtype=kv)


def _sglang_window(layer: SlidingAttention, kv: DType, settings: RuntimeSettings, model: ModelSpec) -> LayerSpec:
    heads = _per_gpu_heads(layer.kv_heads, settings.tp, model)
    return replace(layer, kv_heads=heads, dtype=kv, keep=layer.window)


def _sglang_mla(layer: MLAttention, kv: DType, settings: RuntimeSettings, model: ModelSpec) -> LayerSpec:
    return replace(layer, dtype=kv, v_dim=0)


def _sglang_state(layer: RecurrentState, kv: DType, settings: RuntimeSettings, model: ModelSpec) -> LayerSpec:
    return _server_state(layer, model, settings.tp)


class SGLang(Runtime):
    """SGLang's token pools: one slot per token (page size 1), MLA latents, KV heads split by attention TP."""

    name = "sglang"
    kv_dtypes = ("fp32", "fp16", "bf16", "fp8", "fp8_e4m3", "fp8_e5m2")
    rules: ClassVar[KVRules[ModelSpec]] = KVRules(
        "sglang",
        {
            FullAttention: _sglang_full,
            SlidingAttention: _sglang_window,
            ChunkedAttention: _sglang_window,
            MLAttention: _sglang_mla,
            RecurrentState: _sglang_state,
            NoCache: unchanged,
        },
    )

    def auto_dtype(self, model: ModelSpec) -> tuple[DType, str | None]:
        return VLLM().auto_dtype(model)

    def layers(self, model: ModelSpec, kv: DType, settings: RuntimeSettings) -> tuple[list[LayerSpec], list[str]]:
        out = self.rules.apply(model, kv, settings, model)
        notes: list[str] = []
        if _WINDOWED & model.kinds().keys():
            notes.append(
                "SGLang sizes its sliding-window pool by --swa-full-tokens-ratio; per request a sliding layer "
                "holds at most the window"
            )
        return out, notes


# llama.cpp honours sliding windows for these families only (Mistral v0.1's window is not implemented).
_LLAMA_CPP_SWA = frozenset({"gemma2", "gemma3", "gemma3_text", "gemma3n", "gemma3n_text", "cohere2", "gpt_oss"})
_LLAMA_CPP_CHUNKED = frozenset({"llama4", "llama4_text"})
_LLAMA_CPP_WINDOWS = _LLAMA_CPP_SWA | _LLAMA_CPP_CHUNKED


def _llama_cpp_windows_in_full(model: ModelSpec, settings: RuntimeSettings) -> bool:
    return settings.swa_full or model.model_type not in _LLAMA_CPP_WINDOWS


def _llama_cpp_full(layer: FullAttention, kv: DType, settings: RuntimeSettings, model: ModelSpec) -> LayerSpec:
    return replace(layer, dtype=kv, block=256)


def _llama_cpp_window(layer: SlidingAttention, kv: DType, settings: RuntimeSettings, model: ModelSpec) -> LayerSpec:
    if _llama_cpp_windows_in_full(model, settings):
        return FullAttention(
            kv_heads=layer.kv_heads, head_dim=layer.head_dim, v_head_dim=layer.v_head_dim, dtype=kv, block=256
        )
    return replace(layer, dtype=kv, block=256, keep=layer.window + settings.n_ubatch)


def _llama_cpp_mla(layer: MLAttention, kv: DType, settings: RuntimeSettings, model: ModelSpec) -> LayerSpec:
    v_dim = layer.kv_lora_rank if settings.mla_cache == "kv" else 0
    return replace(layer, dtype=kv, block=256, v_dim=v_dim)


def _llama_cpp_state(layer: RecurrentState, kv: DType, settings: RuntimeSettings, model: ModelSpec) -> LayerSpec:
    f32 = dtype("fp32")
    return replace(layer, conv_width=layer.conv_kernel - 1, conv_dtype=f32, ssm_dtype=f32)


# --kv-unified: what each kind holds in the one pool of tokens × sequences cells shared by all slots.
_PoolRule: TypeAlias = Callable[[Any, int, int, RuntimeSettings], int]


def _pool_cells(layer: LayerSpec, tokens: int, sequences: int, settings: RuntimeSettings) -> int:
    return layer.bytes_for(tokens * sequences)


def _pool_window(layer: SlidingAttention, tokens: int, sequences: int, settings: RuntimeSettings) -> int:
    if layer.keep is None:  # a window allocated in full is one more pool of cells
        return layer.bytes_for(tokens * sequences)
    # The SWA pool holds window × sequences + n_ubatch cells.
    return replace(layer, keep=layer.window * sequences + settings.n_ubatch).bytes_for(tokens * sequences)


def _pool_state(layer: RecurrentState, tokens: int, sequences: int, settings: RuntimeSettings) -> int:
    return sequences * layer.bytes_for(tokens)  # one state per slot, unified or not


class LlamaCpp(Runtime):
    """llama.cpp's KV cache: the context padded to 256 cells, an SWA cache of window + n_ubatch, V-less MLA,
    F32 recurrent states, ``-np`` slots."""

    name = "llama.cpp"
    kv_dtypes = ("fp32", "fp16", "bf16", "q8_0", "q5_0", "q5_1", "q4_0", "q4_1", "iq4_nl")
    rules: ClassVar[KVRules[ModelSpec]] = KVRules(
        "llama.cpp",
        {
            FullAttention: _llama_cpp_full,
            SlidingAttention: _llama_cpp_window,
            ChunkedAttention: _llama_cpp_window,
            MLAttention: _llama_cpp_mla,
            RecurrentState: _llama_cpp_state,
            NoCache: unchanged,
        },
    )
    unified_pool: ClassVar[KindTable[_PoolRule]] = KindTable(
        "llama.cpp --kv-unified",
        {
            FullAttention: _pool_cells,
            SlidingAttention: _pool_window,
            ChunkedAttention: _pool_window,
            MLAttention: _pool_cells,
            RecurrentState: _pool_state,
            NoCache: _pool_cells,
        },
    )

    def auto_dtype(self, model: ModelSpec) -> tuple[DType, str | None]:
        return dtype("fp16"), None  # -ctk/-ctv default to f16 whatever the weights are

    def layers(self, model: ModelSpec, kv: DType, settings: RuntimeSettings) -> tuple[list[LayerSpec], list[str]]:
        if settings.tp != 1:
            raise ConfigurationError(
                "llama.cpp splits layers across GPUs (--split-mode layer), not KV heads; use tp=1 and divide by "
                "the GPU count"
            )
        out = self.rules.apply(model, kv, settings, model)
        for layer in out:
            rows = layer.row_values
            if kv.block_values > 1 and any(n % kv.block_values for n in rows):
                raise ConfigurationError(
                    f"llama.cpp cannot store {model.name}'s KV rows of {sorted(set(rows))} values as {kv.name} "
                    f"(rows must be multiples of {kv.block_values}); use --kv-dtype fp16 or q8_0 on another model"
                )
        notes: list[str] = []
        if _WINDOWED & model.kinds().keys():
            if _llama_cpp_windows_in_full(model, settings):
                why = "--swa-full" if settings.swa_full else f"llama.cpp does not implement {model.model_type}'s window"
                notes.append(f"sliding layers allocated in full ({why})")
            else:
                notes.append(f"the SWA cache holds window + n_ubatch ({settings.n_ubatch}) cells, padded to 256")
        notes.append("the context is padded to a multiple of 256 cells")
        return out, notes

    def kv_bytes(self, layers: list[LayerSpec], tokens: int, sequences: int, settings: RuntimeSettings) -> int:
        if not settings.kv_unified or sequences == 1:
            return super().kv_bytes(layers, tokens, sequences, settings)
        return sum(self.unified_pool.lookup(layer)(layer, tokens, sequences, settings) for layer in layers)


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
