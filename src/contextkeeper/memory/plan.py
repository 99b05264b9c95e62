"""Does this model, at this context and concurrency, fit this GPU? And which GPUs would?

``plan`` adds weights, KV cache, runtime overhead and the prefill peak, compares them with what the runtime
may use of the GPU, finds the longest context per sequence and the most sequences that fit, and ranks the
fixes the way a practitioner should try them: settings that cost nothing first, then model changes, then
hardware. ``recommend`` runs the plan over the GPU catalog. Overhead and prefill figures are estimates from
the runtimes' own sizing rules (docs/memory.md); KV and weights are exact where the report says so.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from .._exceptions import ConfigurationError
from .config import first
from .dtypes import dtype
from .gpus import GPU, find_gpu, gpu_catalog
from .layers import FullAttention, MLAttention
from .limits import check_choice, check_fields, check_numbers
from .model import ModelSpec
from .runtimes import KVReport, kv_report, runtime_profile
from .weights import WeightsReport, param_count, weights_report

__all__ = ["Advice", "Breakdown", "Plan", "PlanSettings", "Recommendation", "plan", "recommend"]

GIB = 2**30
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")


@dataclass(frozen=True, kw_only=True)
class PlanSettings:
    """Serving settings that change memory besides the KV cache (each names the runtimes it applies to)."""

    gpu_memory_utilization: float = 0.9  # vllm: share of total GPU memory the instance may use
    mem_fraction_static: float = 0.88  # sglang: share for weights + KV pool
    max_num_batched_tokens: int | None = None  # vllm/sglang: tokens per prefill step (default 8192)
    max_num_seqs: int | None = None  # vllm: sampler rows in the profile run (256 below 70 GiB, else 1024)
    cuda_graphs: bool = True  # vllm/sglang: CUDA graphs on (enforce_eager=False)
    attn_implementation: str = "sdpa"  # transformers: sdpa | eager | flash_attention_2
    flash_attn: bool = True  # llama.cpp: -fa
    n_ubatch: int = 512  # llama.cpp

    def __post_init__(self) -> None:
        check_fields(self)  # every number against its registered range (limits.py): 1.5, -0.5 and nan are refused
        check_choice("attn_implementation", self.attn_implementation, ATTN_IMPLEMENTATIONS)
        check_choice("cuda_graphs", self.cuda_graphs, (True, False))
        check_choice("flash_attn", self.flash_attn, (True, False))


@dataclass(frozen=True, kw_only=True)
class Breakdown:
    """Bytes per GPU."""

    weights: int
    kv_cache: int
    overhead: int
    prefill_peak: int
    total: int
    capacity: int

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True)
class Advice:
    """One fix and what it does to this workload."""

    action: str
    setting: str
    cost: str  # "none" (a setting), "model" (another checkpoint or dtype), "hardware"
    fits: bool
    max_context: int
    max_concurrency: int
    effect: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Whether the workload fits, its breakdown, its limits and the ranked fixes."""

    model: str
    gpu: str
    gpus: int
    runtime: str
    context: int
    concurrency: int
    kv_dtype: str
    weights_dtype: str
    fits: bool
    breakdown: Breakdown
    max_context: int  # longest context per sequence that fits at this concurrency (0: none)
    max_concurrency: int  # most sequences of this context that fit (0: none)
    advice: tuple[Advice, ...]
    kv: KVReport
    weights: WeightsReport
    notes: tuple[str, ...] = ()
    no_context: str | None = None  # why not even one token per sequence fits (None when some context does)

    def context_limit(self) -> int:
        """:attr:`max_context`, or a :class:`ConfigurationError` that says why no context fits at all: the
        weights (with overhead) alone, or this many sequences, and which setting fixes it."""
        if self.max_context > 0:
            return self.max_context
        raise ConfigurationError(self.no_context or f"no context fits {self.model} on {self.gpu}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "gpu": self.gpu,
            "gpus": self.gpus,
            "runtime": self.runtime,
            "context": self.context,
            "concurrency": self.concurrency,
            "kv_dtype": self.kv_dtype,
            "weights_dtype": self.weights_dtype,
            "fits": self.fits,
            "breakdown": self.breakdown.to_dict(),
            "max_context": self.max_context,
            "max_concurrency": self.max_concurrency,
            "advice": [a.to_dict() for a in self.advice],
            "kv": self.kv.to_dict(),
            "weights": dataclasses.asdict(self.weights),
            "notes": list(self.notes),
            "no_context": self.no_context,
        }


# ---------------------------------------------------------------------------------------- overhead


@dataclass(frozen=True, kw_only=True)
class _Costs:
    capacity: int  # what the runtime lets this instance use on one GPU
    overhead: int
    prefill: int
    notes: tuple[str, ...] = ()


def _dims(model: ModelSpec) -> tuple[int, int, int, int, int]:
    """(hidden, intermediate, query width, kv width, vocab) for activation estimates."""
    c = model.config
    hidden = model.hidden_size
    inter = int(first(c, "intermediate_size", "n_inner") or 4 * hidden)
    attention = next((layer for layer in model.layers if isinstance(layer, FullAttention)), None)
    if attention is not None:
        q_width = model.num_attention_heads * attention.head_dim
        kv_width = attention.kv_heads * (attention.head_dim + attention.v_head_dim)
    else:
        mla = next((layer for layer in model.layers if isinstance(layer, MLAttention)), None)
        heads = model.num_attention_heads
        q_width = heads * (mla.nope_dim + mla.rope_dim) if mla else hidden
        kv_width = heads * (mla.nope_dim + mla.rope_dim + mla.v_head_dim) if mla else hidden
    return hidden, inter, q_width, kv_width, model.vocab_size or 0


def _moe_act(model: ModelSpec, tokens: int, e: int) -> int:
    c = model.config
    top_k = first(c, "num_experts_per_tok") or 0
    moe_inter = first(c, "moe_intermediate_size") or 0
    return tokens * top_k * (3 * moe_inter + model.hidden_size) * e if top_k and moe_inter else 0


class _Overhead:
    """Per-runtime capacity, fixed overhead and prefill peak. One method: ``costs``."""

    runtime: ClassVar[str]

    def costs(
        self, model: ModelSpec, gpu_bytes: int, tp: int, context: int, concurrency: int, s: PlanSettings
    ) -> _Costs:
        raise NotImplementedError


class _VLLMOverhead(_Overhead):
    runtime = "vllm"

    def costs(
        self, model: ModelSpec, gpu_bytes: int, tp: int, context: int, concurrency: int, s: PlanSettings
    ) -> _Costs:
        # determine_available_memory: util × total, minus weights, the profile run's peak and non-torch memory
        # (and, since v0.21, the CUDA graph estimate).
        e = 2
        hidden, inter, q_width, kv_width, vocab = _dims(model)
        big = gpu_bytes >= 70 * GIB
        chunk = s.max_num_batched_tokens or 8192
        rows = min(s.max_num_seqs or (1024 if big else 256), chunk)
        act = chunk * e * (4 * hidden + (q_width + kv_width) // tp + q_width // tp + 3 * inter // tp)
        act += _moe_act(model, chunk, e) // tp
        sampler = rows * (vocab // tp) * e + rows * vocab * (4 + 12)
        non_torch = GIB // 4 + (GIB // 4 if tp > 1 else 0)
        graphs = GIB // 2 if s.cuda_graphs else 0
        return _Costs(
            capacity=int(gpu_bytes * s.gpu_memory_utilization),
            overhead=non_torch + graphs,
            prefill=act + sampler,
            notes=(
                f"vLLM may use gpu_memory_utilization={s.gpu_memory_utilization} of the GPU; the CUDA context "
                "(a few hundred MiB) comes on top",
                f"prefill peak: one {chunk}-token step of the profile run plus {rows} sampler rows (estimate)",
                "overhead: non-torch memory and CUDA graphs (estimates: 0.25 GiB, 0.5 GiB)",
            ),
        )


class _SGLangOverhead(_Overhead):
    runtime = "sglang"

    def costs(
        self, model: ModelSpec, gpu_bytes: int, tp: int, context: int, concurrency: int, s: PlanSettings
    ) -> _Costs:
        # Weights and the KV pool live in mem_fraction_static of the GPU; activations and graphs use the rest.
        static = int(gpu_bytes * s.mem_fraction_static)
        e = 2
        hidden, inter, q_width, kv_width, _ = _dims(model)
        chunk = s.max_num_batched_tokens or 8192
        act = chunk * e * (4 * hidden + (2 * q_width + kv_width + 3 * inter) // tp) + _moe_act(model, chunk, e) // tp
        rest = gpu_bytes - static
        notes = [f"SGLang keeps weights and KV in mem_fraction_static={s.mem_fraction_static} of the GPU"]
        if act > rest:
            notes.append(
                f"the prefill step needs ~{act / GIB:.1f} GiB but only {rest / GIB:.1f} GiB is left outside the "
                "static pool: lower --chunked-prefill-size or --mem-fraction-static"
            )
        # The prefill runs outside the static pool: it only counts when it does not fit there.
        return _Costs(capacity=static, overhead=0, prefill=max(0, act - rest), notes=tuple(notes))


class _TransformersOverhead(_Overhead):
    runtime = "transformers"

    def costs(
        self, model: ModelSpec, gpu_bytes: int, tp: int, context: int, concurrency: int, s: PlanSettings
    ) -> _Costs:
        e = model.dtype.block_bytes
        hidden, inter, q_width, kv_width, vocab = _dims(model)
        b, n = concurrency, context
        act = 4 * b * n * hidden * e + 3 * b * n * inter * e
        heads = model.num_attention_heads
        if s.attn_implementation == "eager":
            attn = b * heads * n * n * (2 * e + 4) + b * n * n * e  # scores, fp32 softmax, cast back; mask
        else:
            attn = b * n * (2 * q_width + kv_width) * e + b * n * 2 * q_width * e  # q, k, v, out; repeat_kv copies
        logits = b * vocab * (e + 4)  # generate() keeps the last position's logits (logits_to_keep=1)
        return _Costs(
            capacity=gpu_bytes,
            overhead=GIB // 2,
            prefill=act + attn + logits,
            notes=(
                f"prefill peak: one forward of {n} tokens × {b} sequences with {s.attn_implementation} attention "
                "(estimate); overhead: CUDA context and allocator slack (0.5 GiB, estimate)",
            ),
        )


class _LlamaCppOverhead(_Overhead):
    runtime = "llama.cpp"

    def costs(
        self, model: ModelSpec, gpu_bytes: int, tp: int, context: int, concurrency: int, s: PlanSettings
    ) -> _Costs:
        # The compute buffer is sized once for an n_ubatch graph at the full context.
        hidden, inter, q_width, kv_width, vocab = _dims(model)
        u = s.n_ubatch
        buffer = u * (4 * hidden + q_width + kv_width + 3 * inter) * 4 + vocab * 4 * concurrency
        if not s.flash_attn:
            buffer += context * concurrency * u * model.num_attention_heads * 4  # f32 KQ of one layer
        return _Costs(
            capacity=gpu_bytes,
            overhead=GIB // 2,
            prefill=buffer,
            notes=(
                f"compute buffer for a {u}-token micro-batch, flash attention {'on' if s.flash_attn else 'off'} "
                "(estimate); overhead: CUDA context (0.5 GiB, estimate)",
            ),
        )


_OVERHEADS: dict[str, Callable[[], _Overhead]] = {
    "vllm": _VLLMOverhead,
    "sglang": _SGLangOverhead,
    "transformers": _TransformersOverhead,
    "llama.cpp": _LlamaCppOverhead,
}

# ---------------------------------------------------------------------------------------- plan


@dataclass(frozen=True, kw_only=True)
class _Workload:
    model: ModelSpec
    gpu: GPU
    gpus: int
    runtime: str
    kv_dtype: str
    weights_dtype: str
    settings: PlanSettings
    runtime_settings: dict[str, Any] = field(default_factory=dict)

    @property
    def tp(self) -> int:
        return self.gpus if self.runtime in ("vllm", "sglang") else 1

    @functools.cached_property
    def _weights(self) -> WeightsReport:
        return weights_report(self.model, self.weights_dtype)

    def weights(self) -> WeightsReport:
        return self._weights

    def evaluate(self, context: int, concurrency: int) -> tuple[bool, Breakdown, KVReport, _Costs]:
        kv = kv_report(
            self.model,
            context,
            concurrency,
            runtime=self.runtime,
            kv_dtype=self.kv_dtype,
            tp=self.tp,
            **self.runtime_settings,
        )
        weights = self.weights().bytes
        if self.runtime in ("vllm", "sglang"):
            weights //= self.tp
            kv_bytes = kv.bytes
        else:  # transformers / llama.cpp split layers over the GPUs: weights and KV divide
            weights //= self.gpus
            kv_bytes = -(-kv.bytes // self.gpus)
        costs = _OVERHEADS[self.runtime]().costs(
            self.model, self.gpu.usable_bytes, self.tp, context, concurrency, self.settings
        )
        total = weights + kv_bytes + costs.overhead + costs.prefill
        breakdown = Breakdown(
            weights=weights,
            kv_cache=kv_bytes,
            overhead=costs.overhead,
            prefill_peak=costs.prefill,
            total=total,
            capacity=costs.capacity,
        )
        return total <= costs.capacity, breakdown, kv, costs

    def fits(self, context: int, concurrency: int) -> bool:
        return self.evaluate(context, concurrency)[0]

    def max_context(self, concurrency: int) -> int:
        limit = self.model.max_context or 1 << 20
        return _largest(lambda n: self.fits(n, concurrency), 1, limit)

    def max_concurrency(self, context: int) -> int:
        return _largest(lambda n: self.fits(context, n), 1, 1 << 16)


def _largest(ok: Callable[[int], bool], low: int, high: int) -> int:
    """The largest n in [low, high] with ok(n) (ok is monotone: true then false), or 0 when none."""
    if not ok(low):
        return 0
    while low < high:
        middle = (low + high + 1) // 2
        if ok(middle):
            low = middle
        else:
            high = middle - 1
    return low


def _resolve_model(model: ModelSpec | Any) -> ModelSpec:
    return model if isinstance(model, ModelSpec) else ModelSpec.from_config(model)


def _resolve_gpu(gpu: GPU | str) -> GPU:
    return gpu if isinstance(gpu, GPU) else find_gpu(gpu)  # find_gpu refuses what is not a name or a size


def _settings(settings: PlanSettings | None) -> PlanSettings:
    if settings is not None and not isinstance(settings, PlanSettings):
        raise ConfigurationError(
            f"settings must be a PlanSettings, got {type(settings).__name__}. Fix: settings=PlanSettings(...)"
        )
    return settings or PlanSettings()


_VENDORS = {"vllm": ("nvidia", "amd", "custom"), "sglang": ("nvidia", "amd", "custom")}


def _check_device(card: GPU, gpus: int, runtime: str) -> None:
    vendors = _VENDORS.get(runtime)
    if vendors is not None and card.vendor not in vendors:
        raise ConfigurationError(
            f"{runtime} does not run on {card.name} ({card.vendor}); use --runtime llama.cpp or transformers"
        )
    if card.unified and gpus > 1:
        raise ConfigurationError(f"{card.name} shares memory with its host: plan one device (--gpus 1)")


def _workload(
    model: ModelSpec | Any,
    gpu: GPU | str,
    gpus: int,
    runtime: str,
    kv_dtype: str,
    weights_dtype: str,
    settings: PlanSettings | None,
    runtime_settings: dict[str, Any],
) -> _Workload:
    """The workload every planning question is asked of: arguments resolved and checked once."""
    gpus = check_numbers(gpus=gpus)["gpus"]
    spec = _resolve_model(model)
    card = _resolve_gpu(gpu)
    name = runtime_profile(runtime).name
    _check_device(card, gpus, name)
    options = _settings(settings)
    if options.max_num_batched_tokens and "max_num_batched_tokens" not in runtime_settings and name == "vllm":
        runtime_settings["max_num_batched_tokens"] = options.max_num_batched_tokens
    return _Workload(
        model=spec,
        gpu=card,
        gpus=gpus,
        runtime=name,
        kv_dtype=kv_dtype,
        weights_dtype=weights_dtype,
        settings=options,
        runtime_settings=runtime_settings,
    )


def kv_pool_tokens(
    model: ModelSpec | Any,
    gpu: GPU | str,
    *,
    concurrency: int = 1,
    gpus: int = 1,
    runtime: str = "vllm",
    kv_dtype: str = "auto",
    weights_dtype: str = "auto",
    settings: PlanSettings | None = None,
    **runtime_settings: Any,
) -> int:
    """The KV tokens ``gpus`` × ``gpu`` hold for ``model`` on ``runtime`` after weights, overhead and the
    prefill peak: the most tokens ``concurrency`` equal sequences hold together (windows, states and block
    rounding included). Unlike :attr:`Plan.max_context` it is not capped at the model's own maximum context: a
    server's KV pool is shared by all calls, however long each may be. 0 when no KV cache fits at all."""
    check_numbers(concurrency=concurrency, gpus=gpus)
    work = _workload(model, gpu, gpus, runtime, kv_dtype, weights_dtype, settings, runtime_settings)
    return max(0, _largest(lambda n: work.fits(n, concurrency), 1, 1 << 26)) * concurrency


def plan(
    model: ModelSpec | Any,
    gpu: GPU | str,
    *,
    context: int,
    concurrency: int = 1,
    gpus: int = 1,
    runtime: str = "vllm",
    kv_dtype: str = "auto",
    weights_dtype: str = "auto",
    settings: PlanSettings | None = None,
    advise: bool = True,
    **runtime_settings: Any,
) -> Plan:
    """Plan ``concurrency`` sequences of ``context`` tokens of ``model`` on ``gpus`` × ``gpu`` with ``runtime``."""
    check_numbers(context=context, concurrency=concurrency, gpus=gpus)
    work = _workload(model, gpu, gpus, runtime, kv_dtype, weights_dtype, settings, runtime_settings)
    spec, card, name = work.model, work.gpu, work.runtime
    fits, breakdown, kv, costs = work.evaluate(context, concurrency)
    notes = list(costs.notes) + list(kv.notes)
    if spec.max_context and context > spec.max_context:
        fits = False
        notes.insert(0, f"{spec.name} accepts at most {spec.max_context:,} tokens; {context:,} were asked for")
    weights = work.weights()
    longest = work.max_context(concurrency)
    no_context = _why_no_context(work, concurrency) if longest == 0 else None
    if no_context:
        notes.insert(0, no_context)
    return Plan(
        model=spec.name,
        gpu=card.name,
        gpus=gpus,
        runtime=name,
        context=context,
        concurrency=concurrency,
        kv_dtype=kv.kv_dtype,
        weights_dtype=weights.dtype,
        fits=fits,
        breakdown=breakdown,
        max_context=longest,
        max_concurrency=work.max_concurrency(context) if not (spec.max_context and context > spec.max_context) else 0,
        advice=tuple(_advise(work, context, concurrency, kv.kv_dtype)) if advise else (),
        kv=kv,
        weights=weights,
        notes=tuple(notes),
        no_context=no_context,
    )


def _why_no_context(work: _Workload, concurrency: int) -> str:
    """Why not one token per sequence fits: the weights and overhead alone, the prefill peak on top, or the
    number of sequences (named only when one sequence would fit), with the setting that fixes it."""
    _, b, _, _ = work.evaluate(1, 1)
    where = f"{work.model.name} on {work.gpus} × {work.gpu.name} ({work.runtime}, may use {b.capacity / GIB:.2f} GiB)"
    fixed = b.weights + b.overhead
    if fixed > b.capacity:
        return (
            f"no context fits {where}: the weights alone take {b.weights / GIB:.2f} GiB "
            f"({work.weights().dtype}) and overhead {b.overhead / GIB:.2f} GiB, {(fixed - b.capacity) / GIB:.2f} GiB "
            "more than the GPU holds. Fix: a quantised checkpoint (weights_dtype='fp8' or 'int4'), more GPUs "
            "(gpus=) or a GPU with more memory"
        )
    if b.total > b.capacity:
        return (
            f"no context fits {where}: weights {b.weights / GIB:.2f} GiB, overhead {b.overhead / GIB:.2f} GiB and "
            f"the prefill peak {b.prefill_peak / GIB:.2f} GiB leave no room for a KV cache. Fix: smaller prefill "
            "steps (max_num_batched_tokens), a quantised checkpoint (weights_dtype='fp8' or 'int4'), more GPUs "
            "(gpus=) or a GPU with more memory"
        )
    single = work.max_context(1)
    most = work.max_concurrency(1)
    return (
        f"no context fits {where} for {concurrency:,} sequences at once: one sequence holds up to {single:,} "
        f"tokens, and at most {most:,} sequences of 1 token fit. Fix: lower concurrency (at most {most:,})"
    )


def _advise(work: _Workload, context: int, concurrency: int, current_kv: str) -> list[Advice]:
    """The fixes, cheapest first: settings, then model changes, then hardware."""
    out: list[Advice] = []

    def consider(
        action: str, setting: str, cost: str, changed: _Workload, *, at: tuple[int, int] | None = None
    ) -> None:
        n_context, n_seqs = at or (context, concurrency)
        try:
            ok = changed.fits(n_context, n_seqs)
            longest = changed.max_context(n_seqs)
            most = changed.max_concurrency(n_context)
        except ConfigurationError:
            return
        cap = " (the model's limit)" if longest and longest == changed.model.max_context else ""
        seqs = f"{most} sequence{'' if most == 1 else 's'} of {n_context:,} tokens"
        each = f"{longest:,} tokens each{cap} for {n_seqs}"
        effect = f"fits: {seqs}, or {each}" if ok else f"still short: {seqs} fit, or {each}"
        out.append(
            Advice(
                action=action,
                setting=setting,
                cost=cost,
                fits=ok,
                max_context=longest,
                max_concurrency=most,
                effect=effect,
            )
        )

    runtime = work.runtime
    quant_kv = {"vllm": "fp8", "sglang": "fp8", "llama.cpp": "q8_0"}.get(runtime)
    if quant_kv and dtype(current_kv).block_bytes >= 2 and dtype(current_kv).block_values == 1:
        consider(
            f"store the KV cache as {quant_kv}",
            f"--kv-dtype {quant_kv}",
            "none",
            replace(work, kv_dtype=quant_kv),
        )
    longest = work.max_context(concurrency)
    most = work.max_concurrency(context)
    if 0 < longest < context:
        consider(
            f"shorten the context to {longest:,} tokens",
            f"--context {longest}",
            "none",
            work,
            at=(longest, concurrency),
        )
    if 0 < most < concurrency:
        consider(f"serve {most} sequences at a time", f"--concurrency {most}", "none", work, at=(context, most))
    if runtime == "vllm":
        if work.settings.gpu_memory_utilization < 0.95:
            consider(
                "let vLLM use 95% of the GPU",
                "--gpu-memory-utilization 0.95",
                "none",
                replace(work, settings=replace(work.settings, gpu_memory_utilization=0.95)),
            )
        if (work.settings.max_num_batched_tokens or 8192) > 2048:
            consider(
                "prefill in smaller steps",
                "--max-num-batched-tokens 2048",
                "none",
                replace(
                    work,
                    settings=replace(work.settings, max_num_batched_tokens=2048),
                    runtime_settings={**work.runtime_settings, "max_num_batched_tokens": 2048},
                ),
            )
    if runtime == "transformers" and work.settings.attn_implementation == "eager":
        consider(
            "use SDPA attention (linear memory instead of quadratic)",
            "attn_implementation='sdpa'",
            "none",
            replace(work, settings=replace(work.settings, attn_implementation="sdpa")),
        )
    if runtime == "llama.cpp" and not work.settings.flash_attn:
        consider(
            "turn flash attention on", "-fa on", "none", replace(work, settings=replace(work.settings, flash_attn=True))
        )
    for weights in ("fp8", "int4"):
        if weights != work.weights_dtype and param_count(work.model).total > 0:
            consider(
                f"serve a {weights} quantised checkpoint of the model",
                f"--weights-dtype {weights}",
                "model",
                replace(work, weights_dtype=weights),
            )
    if runtime in ("vllm", "sglang"):
        for more in (2 * work.gpus, 4 * work.gpus):
            if more <= 8:
                consider(
                    f"split the model over {more} GPUs (tensor parallel)",
                    f"--gpus {more}",
                    "hardware",
                    replace(work, gpus=more),
                )
    # What costs nothing first, then model changes, then hardware; within each, what fits.
    return sorted(out, key=lambda a: ({"none": 0, "model": 1, "hardware": 2}[a.cost], not a.fits))


# ---------------------------------------------------------------------------------------- recommend


@dataclass(frozen=True, kw_only=True)
class Recommendation:
    """A GPU option that fits, with the plan for it."""

    gpu: str
    count: int
    kind: str
    total_memory: int
    max_context: int
    max_concurrency: int
    headroom: int  # capacity minus total, bytes per GPU

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def recommend(
    model: ModelSpec | Any,
    *,
    context: int,
    concurrency: int = 1,
    runtime: str = "vllm",
    kv_dtype: str = "auto",
    weights_dtype: str = "auto",
    max_gpus: int = 8,
    kinds: tuple[str, ...] | None = None,
    settings: PlanSettings | None = None,
    **runtime_settings: Any,
) -> tuple[Recommendation, ...]:
    """The catalog GPUs that fit the workload, each with the fewest cards that do (1, 2, 4, 8), cheapest first
    by total memory. ``kinds``: only these catalog kinds (consumer, workstation, datacenter, apple)."""
    check_numbers(context=context, concurrency=concurrency, max_gpus=max_gpus)  # refused here, not as "no GPU fits"
    known = sorted({card.kind for card in gpu_catalog()})
    if kinds is not None:
        if isinstance(kinds, str):
            kinds = (kinds,)
        unknown = [kind for kind in kinds if kind not in known]
        if unknown:
            raise ConfigurationError(
                f"unknown GPU kind(s) {', '.join(map(repr, unknown))}: kinds (--kind) takes {', '.join(known)}. "
                f"Fix: choose among {', '.join(known)}"
            )
    spec = _resolve_model(model)
    # Settings the runtime refuses are the caller's error, not "no GPU fits": ask once, outside the catalog loop
    # (which only skips cards that cannot run the workload, e.g. a head count tp does not divide).
    kv_report(spec, 1, 1, runtime=runtime, kv_dtype=kv_dtype, **runtime_settings)
    weights_report(spec, weights_dtype)
    _settings(settings)
    options: list[Recommendation] = []
    for card in gpu_catalog():
        if kinds and card.kind not in kinds:
            continue
        count = 1
        while count <= (1 if card.unified else max_gpus):
            try:
                result = plan(
                    spec,
                    card,
                    context=context,
                    concurrency=concurrency,
                    gpus=count,
                    runtime=runtime,
                    kv_dtype=kv_dtype,
                    weights_dtype=weights_dtype,
                    settings=settings,
                    advise=False,
                    **runtime_settings,
                )
            except ConfigurationError:
                break
            if result.fits:
                options.append(
                    Recommendation(
                        gpu=card.name,
                        count=count,
                        kind=card.kind,
                        total_memory=count * card.memory_bytes,
                        max_context=result.max_context,
                        max_concurrency=result.max_concurrency,
                        headroom=result.breakdown.capacity - result.breakdown.total,
                    )
                )
                break
            count *= 2
    return tuple(sorted(options, key=lambda r: (r.total_memory, r.count, r.gpu)))
