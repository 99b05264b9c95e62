"""``doctor``: from a symptom to the memory pool that runs out, its likely causes and the fixes, ranked.

The decision tree is data (``data/symptoms.toml``): each symptom lists causes, each cause its pool, why it
happens and fixes in cost order (settings that cost nothing, then model changes, then hardware). Given
facts (model, GPU, context, concurrency, runtime; or live detection) a registry of quantifiers puts numbers on
each cause with :func:`contextkeeper.memory.plan`, marks the pool that actually overflows, and ranks it first.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from .._exceptions import ConfigurationError, UnknownSymptom
from ..memory.limits import check_fields
from ..memory.render import human

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = [
    "COSTS",
    "JUDGES",
    "QUANTIFIERS",
    "Cause",
    "Diagnosis",
    "Evidence",
    "Facts",
    "Fix",
    "Symptom",
    "UnknownSymptom",
    "diagnose",
    "symptoms",
]

COSTS = ("none", "model", "hardware")  # cost order: free settings, then the model, then hardware
RUNTIMES = ("transformers", "vllm", "sglang", "llama.cpp")


# ---------------------------------------------------------------------------------------------- the tree


@dataclass(frozen=True, kw_only=True)
class Fix:
    """One fix. ``setting`` is for the runtime at hand (all runtimes' spellings when it is unknown);
    ``effect`` is what :func:`plan` computes it does to this workload (facts only)."""

    action: str
    setting: str
    cost: str
    effect: str | None = None
    fits: bool | None = None  # does this fix alone make the workload fit (None: the facts cannot tell)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True)
class _FixRule:
    action: str
    cost: str
    setting: str | dict[str, str]
    plan: str | None = None
    judge: str | None = None

    def for_runtime(self, runtime: str | None) -> str | None:
        """The setting for ``runtime`` (None: this fix does not apply to it)."""
        if isinstance(self.setting, str):
            return self.setting
        if runtime is None:  # every runtime's spelling; "any" covers the runtimes the table leaves out
            named = [(name, text) for name, text in self.setting.items() if name != "any"]
            if "any" in self.setting and len(named) < len(RUNTIMES):
                named.append(("other runtimes", self.setting["any"]))
            return " · ".join(f"{name}: {text}" for name, text in named)
        return self.setting.get(runtime, self.setting.get("any"))


@dataclass(frozen=True, kw_only=True)
class _CauseRule:
    key: str
    title: str
    pool: str
    why: str
    fixes: tuple[_FixRule, ...]
    quantify: str | None = None
    runtimes: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Symptom:
    """A symptom of the decision tree: the pool it points at and its causes, most likely first."""

    name: str
    title: str
    pool: str
    summary: str
    causes: tuple[str, ...]


@dataclass(frozen=True)
class _Tree:
    symptoms: dict[str, Symptom]
    causes: dict[str, _CauseRule]


def _load_tree(text: str) -> _Tree:
    """Parse and check the decision tree (every cause known, fixes in cost order, quantifiers registered)."""
    data = tomllib.loads(text)
    causes: dict[str, _CauseRule] = {}
    for key, raw in data["causes"].items():
        fixes = tuple(
            _FixRule(action=f["action"], cost=f["cost"], setting=f["setting"], plan=f.get("plan"), judge=f.get("judge"))
            for f in raw["fixes"]
        )
        order = [COSTS.index(f.cost) for f in fixes]  # ValueError on an unknown cost
        if order != sorted(order):
            raise ValueError(f"cause {key!r}: fixes must go from no-cost settings to model to hardware")
        quantify = raw.get("quantify")
        if quantify is not None and quantify not in QUANTIFIERS:
            raise ValueError(f"cause {key!r}: unknown quantifier {quantify!r}")
        unjudged = [f.judge for f in fixes if f.judge is not None and f.judge not in JUDGES]
        if unjudged:
            raise ValueError(f"cause {key!r}: unknown judge(s) {unjudged}")
        causes[key] = _CauseRule(
            key=key,
            title=raw["title"],
            pool=raw["pool"],
            why=raw["why"],
            fixes=fixes,
            quantify=quantify,
            runtimes=tuple(raw.get("runtimes", ())),
        )
    found: dict[str, Symptom] = {}
    for name, raw in data["symptoms"].items():
        missing = [c for c in raw["causes"] if c not in causes]
        if missing:
            raise ValueError(f"symptom {name!r} names unknown causes {missing}")
        found[name] = Symptom(
            name=name, title=raw["title"], pool=raw["pool"], summary=raw["summary"], causes=tuple(raw["causes"])
        )
    return _Tree(symptoms=found, causes=causes)


@functools.cache
def _tree() -> _Tree:
    text = resources.files("contextkeeper.diagnose").joinpath("data/symptoms.toml").read_text(encoding="utf-8")
    return _load_tree(text)


def symptoms() -> dict[str, Symptom]:
    """The symptoms ``doctor`` knows, by name, in the decision tree's order."""
    return dict(_tree().symptoms)


def _symptom(name: str) -> Symptom:
    known = _tree().symptoms
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    if key in known:
        return known[key]
    import difflib

    matches = tuple(difflib.get_close_matches(key, list(known), n=3, cutoff=0.5))
    raise UnknownSymptom(
        f"unknown symptom {name!r}: --symptom takes one of {', '.join(known)}",
        matches=matches,
        fix=f"pass --symptom {matches[0] if matches else next(iter(known))} (or another of the names above)",
    )


# ---------------------------------------------------------------------------------------------- facts


@dataclass(frozen=True, kw_only=True)
class Facts:
    """What we know about the deployment. ``context`` None means the model's own limit (vLLM's default
    max_model_len). ``detect``: read this machine's GPU, free memory, RAM and container limit."""

    model: Any = None
    gpu: Any = None
    gpus: int = 1
    context: int | None = None
    concurrency: int = 1
    runtime: str | None = None
    kv_dtype: str = "auto"
    weights_dtype: str = "auto"
    attn_implementation: str | None = None
    gpu_memory_utilization: float | None = None
    detect: bool = False

    def __post_init__(self) -> None:
        check_fields(self)  # gpus, context, concurrency, gpu_memory_utilization: the ranges plan() uses

    def has_numbers(self) -> bool:
        return self.model is not None and (self.gpu is not None or self.detect)


@dataclass(frozen=True, kw_only=True)
class Evidence:
    """Numbers for one cause. ``over``: this cause's pool is the one that overflows (True), fits (False), or
    cannot be told from the facts (None)."""

    text: str
    over: bool | None = None
    specific: bool = False  # names the one setting at fault (eager attention): ranked above general causes


@dataclass
class _Context:
    """Facts resolved once per diagnosis: the model, the card, the plan, live readings."""

    facts: Facts
    runtime: str
    model: Any = None  # ModelSpec
    gpu: Any = None  # GPU
    plan: Any = None  # Plan at the facts' context and concurrency
    single: Any = None  # Plan at one sequence
    free_bytes: int | None = None
    host: Any = None  # HostMemory
    notes: list[str] = field(default_factory=list)

    @functools.cached_property
    def params(self) -> int:
        from ..memory import param_count

        return int(param_count(self.model).total)


def _crossing(ctx: _Context, result: Any) -> str:
    """Which pool pushes the total past capacity, adding weights + overhead, then KV, then the prefill peak."""
    b = result.breakdown
    fixed = b.weights + b.overhead
    if fixed > b.capacity:
        return "weights"
    if fixed + b.kv_cache > b.capacity:
        return "kv"
    if b.total > b.capacity:
        return "prefill"
    return "fits"


def _card(ctx: _Context) -> str:
    capacity = human(ctx.plan.breakdown.capacity)
    return f"the {ctx.gpu.name} ({human(ctx.gpu.memory_bytes)}; {ctx.runtime} may use {capacity})"


def _q_weights(ctx: _Context) -> Evidence:
    b = ctx.plan.breakdown
    return Evidence(
        text=f"the weights take {human(b.weights)} ({ctx.plan.weights_dtype}) of {_card(ctx)}",
        over=_crossing(ctx, ctx.plan) == "weights",
    )


def _fp32_bytes(ctx: _Context) -> tuple[int, int]:
    return 4 * ctx.params, 2 * ctx.params


def _q_fp32_gpu(ctx: _Context) -> Evidence:
    fp32, half = _fp32_bytes(ctx)
    cap = ctx.plan.breakdown.capacity
    if not ctx.params:
        return Evidence(text="the parameter count is unknown for this config")
    return Evidence(
        text=f"{ctx.params / 1e9:.2f} B parameters take {human(fp32)} in float32 and {human(half)} in bf16; "
        f"{ctx.runtime} may use {human(cap)} of the card",
        over=(fp32 + ctx.plan.breakdown.overhead > cap) and ctx.model.dtype.name == "fp32",
    )


def _q_fp32_host(ctx: _Context) -> Evidence:
    fp32, half = _fp32_bytes(ctx)
    if not ctx.params:
        return Evidence(text="the parameter count is unknown for this config")
    ram = _ram_text(ctx)
    limit = _ram_limit(ctx)
    return Evidence(
        text=f"{ctx.params / 1e9:.2f} B parameters take {human(fp32)} in float32 and {human(half)} in bf16{ram}",
        over=None if limit is None else fp32 > limit >= half,
    )


def _ram_limit(ctx: _Context) -> int | None:
    host = ctx.host
    if host is None:
        return None
    limits = [v for v in (host.available_bytes, host.cgroup_limit_bytes) if v]
    return min(limits) if limits else host.total_bytes or None


def _ram_text(ctx: _Context) -> str:
    host = ctx.host
    if host is None:
        return ""
    parts = [f"this machine has {human(host.total_bytes)} of RAM"]
    if host.available_bytes is not None:
        parts.append(f"{human(host.available_bytes)} available")
    if host.cgroup_limit_bytes is not None:
        parts.append(f"the container allows {human(host.cgroup_limit_bytes)}")
    return "; " + ", ".join(parts)


def _q_free_memory(ctx: _Context) -> Evidence | None:
    if ctx.free_bytes is None:
        return None
    total = ctx.gpu.memory_bytes
    asked = ctx.plan.breakdown.capacity
    used = total - ctx.free_bytes
    return Evidence(
        text=f"{human(ctx.free_bytes)} of the card's {human(total)} is free now ({human(used)} held by other "
        f"processes); {ctx.runtime} asks for {human(asked)} at start",
        over=ctx.free_bytes < asked,
    )


def _kv_text(result: Any) -> str:
    b = result.breakdown
    left = b.capacity - b.weights - b.overhead - b.prefill_peak
    return (
        f"your KV for {result.concurrency} × {result.context:,} tokens is {human(b.kv_cache)} ({result.kv_dtype}); "
        f"{result.runtime} may use {human(b.capacity)} of the {result.gpu}, the weights take {human(b.weights)} "
        f"and overhead + prefill peak {human(b.overhead + b.prefill_peak)}, leaving {human(max(left, 0))} for KV"
    )


def _q_kv_single(ctx: _Context) -> Evidence:
    result = ctx.single
    limit = f"; at most {result.max_context:,} tokens fit per sequence" if result.max_context else ""
    return Evidence(text=_kv_text(result) + limit, over=_crossing(ctx, result) == "kv")


def _q_kv_concurrency(ctx: _Context) -> Evidence:
    result = ctx.plan
    if result.max_concurrency:
        most = f"; at most {result.max_concurrency:,} sequences of {result.context:,} tokens fit"
    else:
        most = f"; not even one sequence of {result.context:,} tokens fits"
    return Evidence(text=_kv_text(result) + most, over=_crossing(ctx, result) == "kv")


def _q_prefill(ctx: _Context) -> Evidence:
    b = ctx.plan.breakdown
    return Evidence(
        text=f"the prefill peak is about {human(b.prefill_peak)} (estimate) on top of weights {human(b.weights)} "
        f"and KV {human(b.kv_cache)}: {human(b.total)} of {human(b.capacity)}",
        over=_crossing(ctx, ctx.plan) == "prefill",
    )


def _q_eager(ctx: _Context) -> Evidence | None:
    if ctx.runtime != "transformers":
        return None
    from ..memory import PlanSettings, plan

    facts = ctx.facts
    common: dict[str, Any] = {
        "gpu": ctx.gpu,
        "gpus": facts.gpus,
        "runtime": ctx.runtime,
        "context": ctx.plan.context,
        "concurrency": facts.concurrency,
        "kv_dtype": facts.kv_dtype,
        "weights_dtype": facts.weights_dtype,
        "advise": False,
    }
    eager = plan(ctx.model, settings=PlanSettings(attn_implementation="eager"), **common)
    sdpa = plan(ctx.model, settings=PlanSettings(attn_implementation="sdpa"), **common)
    using_eager = facts.attn_implementation == "eager"
    return Evidence(
        text=f"the prefill peak is about {human(eager.breakdown.prefill_peak)} with eager attention and "
        f"{human(sdpa.breakdown.prefill_peak)} with SDPA at {ctx.plan.context:,} tokens",
        over=(not eager.fits and sdpa.fits) if using_eager else None if facts.attn_implementation is None else False,
        specific=True,
    )


def _q_leak(ctx: _Context) -> Evidence | None:
    return None  # a leak shows only over time: MemoryMonitor measures it (see the fixes)


def _q_fragmentation(ctx: _Context) -> Evidence | None:
    return None  # likewise: MemoryMonitor compares reserved with allocated across requests


def _q_host_ram(ctx: _Context) -> Evidence | None:
    limit = _ram_limit(ctx)
    weights = ctx.plan.weights.bytes
    if ctx.host is None:
        return Evidence(text=f"a full copy of the weights in RAM is {human(weights)}")
    return Evidence(
        text=f"a full copy of the weights in RAM is {human(weights)}{_ram_text(ctx)}",
        over=None if limit is None else weights > limit,
    )


def _q_offload(ctx: _Context) -> Evidence:
    b = ctx.plan.breakdown
    if ctx.gpu.vendor == "cpu":
        return Evidence(text="no GPU: the weights and the cache are all in RAM")
    spill = max(0, b.weights + b.overhead - b.capacity)
    if not spill:
        return Evidence(text=f"the weights ({human(b.weights)}) fit the GPU; nothing needs offloading", over=False)
    limit = _ram_limit(ctx)
    return Evidence(
        text=f"about {human(spill)} of the weights do not fit the GPU and would be offloaded to RAM{_ram_text(ctx)}",
        over=None if limit is None else spill > limit,
    )


def _q_cgroup(ctx: _Context) -> Evidence | None:
    host = ctx.host
    if host is None:
        return None
    if host.cgroup_limit_bytes is None:
        return Evidence(text="this process runs under no container memory limit", over=False)
    text = (
        f"this process's container may use {human(host.cgroup_limit_bytes)} (the machine has {human(host.total_bytes)})"
    )
    if ctx.plan is None:
        return Evidence(text=text, over=host.cgroup_limit_bytes < host.total_bytes or None)
    weights = ctx.plan.weights.bytes
    return Evidence(text=f"{text}; a copy of the weights is {human(weights)}", over=weights > host.cgroup_limit_bytes)


Quantifier = Callable[[_Context], Evidence | None]


def _with_plan(quantify: Quantifier) -> Quantifier:
    """Numbers that need the plan: none without a model and a GPU."""

    def run(ctx: _Context) -> Evidence | None:
        return quantify(ctx) if ctx.plan is not None else None

    return run


# name (as data/symptoms.toml's `quantify`) -> the function that puts numbers on that cause
QUANTIFIERS: dict[str, Quantifier] = {
    "weights": _with_plan(_q_weights),
    "fp32_gpu": _with_plan(_q_fp32_gpu),
    "fp32_host": _with_plan(_q_fp32_host),
    "free_memory": _with_plan(_q_free_memory),
    "kv_single": _with_plan(_q_kv_single),
    "kv_concurrency": _with_plan(_q_kv_concurrency),
    "prefill": _with_plan(_q_prefill),
    "eager": _with_plan(_q_eager),
    "leak": _q_leak,
    "fragmentation": _q_fragmentation,
    "host_ram": _with_plan(_q_host_ram),
    "offload": _with_plan(_q_offload),
    "cgroup": _q_cgroup,
}


def _judge_free_gpu(ctx: _Context) -> tuple[bool | None, str | None]:
    """Stopping other processes helps only when they hold what the plan needs: the plan already counts the card
    as empty, so a plan that does not fit is not fixed by freeing it."""
    if ctx.plan is None:
        return None, None
    b = ctx.plan.breakdown
    if not ctx.plan.fits:
        return False, (
            f"not enough alone: the numbers already count the whole card as free, and the workload needs "
            f"{human(b.total)} of the {human(b.capacity)} {ctx.runtime} may use"
        )
    if ctx.free_bytes is not None and ctx.free_bytes < b.capacity:
        return True, f"fits once {human(b.capacity - ctx.free_bytes)} held by other processes is freed"
    return None, None


Judge = Callable[[_Context], tuple[bool | None, str | None]]

# name (as data/symptoms.toml's `judge`) -> whether a fix without a plan() effect is enough alone, and why
JUDGES: dict[str, Judge] = {"free_gpu": _judge_free_gpu}


def _resolve(facts: Facts) -> _Context:
    from ..memory import GPU, ModelSpec, PlanSettings, detect_gpus, find_gpu, plan
    from ..memory.runtimes import runtime_profile
    from .monitor import host_memory

    runtime = runtime_profile(facts.runtime).name if facts.runtime else "vllm"
    ctx = _Context(facts=facts, runtime=runtime)
    if facts.runtime is None and facts.has_numbers():
        ctx.notes.append("no --runtime given: numbers assume vLLM")
    if facts.detect:
        ctx.host = host_memory()
    if not facts.has_numbers():
        return ctx
    ctx.model = facts.model if isinstance(facts.model, ModelSpec) else ModelSpec.from_config(facts.model)
    if facts.gpu is not None:
        ctx.gpu = facts.gpu if isinstance(facts.gpu, GPU) else find_gpu(facts.gpu)  # refuses gpu=48 (not a name)
    else:
        found = detect_gpus()
        if not found:
            raise ConfigurationError("no GPU was detected on this machine; pass --gpu NAME")
        ctx.gpu = found[0].as_gpu()
        ctx.free_bytes = found[0].free_bytes
        ctx.notes.append(f"detected {found[0].name} ({human(found[0].total_bytes)}) via {found[0].source}")
    context = facts.context if facts.context is not None else ctx.model.max_context  # 0 is refused by plan()
    if context is None:
        raise ConfigurationError(f"{ctx.model.name} names no maximum context; pass --context N")
    if facts.context is None:
        ctx.notes.append(
            f"no --context given: using the model's limit, {context:,} tokens (vLLM's default max_model_len)"
        )
    settings: dict[str, Any] = {}
    if facts.gpu_memory_utilization is not None:
        settings["gpu_memory_utilization"] = facts.gpu_memory_utilization
    if facts.attn_implementation is not None:
        settings["attn_implementation"] = facts.attn_implementation
    common: dict[str, Any] = {
        "gpu": ctx.gpu,
        "gpus": facts.gpus,
        "runtime": runtime,
        "kv_dtype": facts.kv_dtype,
        "weights_dtype": facts.weights_dtype,
        "settings": PlanSettings(**settings),
    }
    ctx.plan = plan(ctx.model, context=context, concurrency=facts.concurrency, **common)
    ctx.single = ctx.plan if facts.concurrency == 1 else plan(ctx.model, context=context, concurrency=1, **common)
    return ctx


# ---------------------------------------------------------------------------------------------- the answer


@dataclass(frozen=True, kw_only=True)
class Cause:
    """One ranked cause: what it is, why it happens, the numbers (facts only) and the fixes, cheapest first."""

    key: str
    cause: str
    pool: str
    why: str
    fixes: tuple[Fix, ...]
    evidence: str | None = None
    over: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "cause": self.cause,
            "key": self.key,
            "pool": self.pool,
            "why": self.why,
            "evidence": self.evidence,
            "over": self.over,
            "fixes": [f.to_dict() for f in self.fixes],
        }


@dataclass(frozen=True, kw_only=True)
class Diagnosis:
    """``doctor``'s answer for one symptom: causes ranked (the pool that overflows first when facts say so)."""

    symptom: str
    title: str
    pool: str
    summary: str
    causes: tuple[Cause, ...]
    facts: dict[str, Any] | None = None
    breakdown: dict[str, int] | None = None
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "symptom": self.symptom,
            "title": self.title,
            "pool": self.pool,
            "summary": self.summary,
            "causes": [c.to_dict() for c in self.causes],
            "facts": self.facts,
            "breakdown": self.breakdown,
            "notes": list(self.notes),
        }

    def table(self) -> str:
        """A readable form: the ranked causes with their numbers and fixes."""
        lines = [f"doctor — {self.title} (pool: {self.pool})", self.summary]
        if self.facts:
            f = self.facts
            lines.append(
                f"facts: {f['model']} on {f['gpus']} × {f['gpu']} with {f['runtime']}, "
                f"{f['concurrency']} × {f['context']:,} tokens"
            )
        for i, cause in enumerate(self.causes, 1):
            flag = {True: "  <- this pool overflows", False: "", None: ""}[cause.over]
            lines += ["", f"{i}. {cause.cause} [{cause.pool}]{flag}", f"   why: {cause.why}"]
            if cause.evidence:
                lines.append(f"   numbers: {cause.evidence}")
            for fix in cause.fixes:
                lines.append(f"   - [{fix.cost}] {fix.action}: {fix.setting}")
                if fix.effect:
                    lines.append(f"       {fix.effect}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _fixes(rule: _CauseRule, ctx: _Context, advice: Mapping[str, list[Any]]) -> tuple[Fix, ...]:
    out: list[Fix] = []
    runtime = ctx.runtime if (ctx.facts.runtime or ctx.plan is not None) else None
    for fix in rule.fixes:
        setting = fix.for_runtime(runtime)
        if setting is None:
            continue
        effects = advice.get(fix.plan, []) if fix.plan else []
        number = next((a.setting.rsplit(" ", 1)[-1] for a in effects if a.setting.rsplit(" ", 1)[-1].isdigit()), None)
        if number is not None:  # "--max-num-seqs N" with the number plan() found
            setting = re.sub(r"\bN\b", number, setting)
        effect = "; ".join(f"{a.action}: {a.effect}" for a in effects) or None
        fits: bool | None = any(a.fits for a in effects) if effects else None
        if fix.plan == "--concurrency" and ctx.plan is not None and ctx.plan.max_concurrency == 0:
            fits, effect = False, f"not enough alone: not even one sequence of {ctx.plan.context:,} tokens fits"
        if fix.judge is not None and fits is None:
            fits, judged = JUDGES[fix.judge](ctx)
            effect = judged or effect
        out.append(Fix(action=fix.action, setting=setting, cost=fix.cost, effect=effect, fits=fits))
    # What alone makes it fit first, then what the facts cannot rule out, then what they call not enough; by cost
    # within each (the sort is stable: the tree's order breaks ties).
    rank = {True: 0, None: 1, False: 2}
    return tuple(sorted(out, key=lambda f: (rank[f.fits], COSTS.index(f.cost))))


def _advice_by_prefix(ctx: _Context) -> dict[str, list[Any]]:
    if ctx.plan is None:
        return {}
    found: dict[str, list[Any]] = {}
    prefixes = {f.plan for c in _tree().causes.values() for f in c.fixes if f.plan}
    for advice in ctx.plan.advice:
        for prefix in prefixes:
            if advice.setting.startswith(prefix):
                found.setdefault(prefix, []).append(advice)
    return found


def diagnose(symptom: str, facts: Facts | None = None, **fact_fields: Any) -> Diagnosis:
    """The ranked causes of ``symptom`` (one of :func:`symptoms`), with numbers when ``facts`` (or the same
    fields as keywords) name a model and a GPU (or ``detect=True``). Raises :class:`UnknownSymptom`."""
    chosen = _symptom(symptom)
    facts = dataclasses.replace(facts or Facts(), **fact_fields) if fact_fields else facts or Facts()
    ctx = _resolve(facts)
    advice = _advice_by_prefix(ctx)
    tree = _tree()
    known_runtime = facts.runtime is not None
    causes: list[Cause] = []
    specific: dict[str, bool] = {}
    for key in chosen.causes:
        rule = tree.causes[key]
        if known_runtime and rule.runtimes and ctx.runtime not in rule.runtimes:
            continue
        evidence = QUANTIFIERS[rule.quantify](ctx) if rule.quantify is not None else None
        causes.append(
            Cause(
                key=key,
                cause=rule.title,
                pool=rule.pool,
                why=rule.why,
                fixes=_fixes(rule, ctx, advice),
                evidence=evidence.text if evidence else None,
                over=evidence.over if evidence else None,
            )
        )
        specific[key] = bool(evidence and evidence.specific)
    # The overflowing pool first (a cause that names the one setting at fault before general ones), then causes
    # the facts cannot rule out, then those they rule out; the tree's order (most likely first) within each.
    rank = {True: 0, None: 1, False: 2}
    causes.sort(key=lambda c: (rank[c.over], not specific[c.key]))
    fact_dict = None
    breakdown = None
    if ctx.plan is not None:
        fact_dict = {
            "model": ctx.model.name,
            "gpu": ctx.gpu.name,
            "gpus": facts.gpus,
            "runtime": ctx.runtime,
            "context": ctx.plan.context,
            "concurrency": facts.concurrency,
            "kv_dtype": ctx.plan.kv_dtype,
            "weights_dtype": ctx.plan.weights_dtype,
            "fits": ctx.plan.fits,
        }
        breakdown = ctx.plan.breakdown.to_dict()
    return Diagnosis(
        symptom=chosen.name,
        title=chosen.title,
        pool=chosen.pool,
        summary=chosen.summary,
        causes=tuple(causes),
        facts=fact_dict,
        breakdown=breakdown,
        notes=tuple(ctx.notes),
    )
