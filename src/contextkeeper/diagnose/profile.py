"""``profile``: the VRAM test sequence on a real transformers model, measured, next to our prediction.

Steps: the baseline after load; prompts of growing length (one prefill each) with the peak per step; generation
of N new tokens; concurrency 1..N (a batch). Each step records the cache's real bytes (the distinct storages of
every tensor the returned cache object holds), the peak above the step's start (``torch.cuda.max_memory_allocated``
after ``reset_peak_memory_stats`` on GPU; the resident set's high-water mark on CPU) and the memory model's
prediction for the transformers runtime. A least-squares fit of cache bytes over tokens gives the measured KV
bytes per token, compared with the prediction; steps whose peak rises far faster than the series' own rate
are flagged as jumps (quadratic attention, prefill workspaces, batching thresholds).
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import itertools
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from .._exceptions import ConfigurationError, ModelConfigError
from ..memory.limits import check_fields
from ..memory.render import human, needs_matplotlib
from .monitor import rss_bytes

if TYPE_CHECKING:  # (the memory model is imported where it is used)
    from ..memory import ModelSpec

__all__ = [
    "METERS",
    "Jump",
    "LoadedModel",
    "ProfileReport",
    "ProfileRow",
    "ProfileSettings",
    "cache_bytes",
    "find_jumps",
    "fit_slope",
    "load_model",
    "plot_profile",
    "profile",
    "stderr_progress",
]

Progress = Callable[[int, int, str], None]

_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


@dataclass(frozen=True, kw_only=True)
class ProfileSettings:
    """The test sequence. ``lengths``: prompt lengths (batch 1). ``new_tokens``: generation lengths after a
    prompt of ``generate_prompt`` tokens (default: the first length). ``batches``: concurrency steps, each a
    batch of ``batch_tokens``-token prompts (default: the first length)."""

    lengths: tuple[int, ...] = (128, 256, 512, 1024, 2048)
    new_tokens: tuple[int, ...] = (16, 64, 128)
    batches: tuple[int, ...] = (1, 2, 4, 8)
    generate_prompt: int | None = None
    batch_tokens: int | None = None
    jump_factor: float = 2.0  # a step is a jump when its peak rises this many times faster than its average so far
    jump_floor: int = 2**20  # ... and by at least this many bytes more than that rate predicts
    seed: int = 0

    def __post_init__(self) -> None:
        check_fields(self)  # every number against its registered range (memory/limits.py)
        if not self.lengths:
            raise ConfigurationError("profile needs at least one prompt length. Fix: lengths=(128, 256) (--lengths)")


# ---------------------------------------------------------------------------------------------- loading


@dataclass(frozen=True, kw_only=True)
class LoadedModel:
    """A model ready to profile: the module, its config as a dict, where it came from."""

    model: Any
    config: dict[str, Any]
    name: str
    origin: str
    random_weights: bool
    device: str
    dtype: str  # fp32 | fp16 | bf16


def _torch_dtype(name: str) -> Any:
    import torch

    table = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    key = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "half": "fp16"}.get(name, name)
    if key not in table:
        raise ConfigurationError(f"profile dtype {name!r}: use auto, fp32, fp16 or bf16")
    return table[key]


def _check_device(torch: Any, device: str) -> None:
    """Refuse a device torch does not know, cannot use here, or we cannot measure, before loading anything."""
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError, ValueError):
        raise ConfigurationError(
            f"profile device {device!r} is not a device torch knows. Fix: --device cpu, cuda or cuda:N"
        ) from None
    if kind not in METERS:
        raise ConfigurationError(f"profile measures cuda and cpu devices, not {device!r}. Fix: --device cpu or cuda")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigurationError(f"profile device {device!r}: no CUDA GPU is available here. Fix: --device cpu")


def _has_weights(folder: Path) -> bool:
    return any(folder.glob("*.safetensors")) or any(folder.glob("pytorch_model*.bin"))


def _hub_folder(repo_id: str) -> Path | None:
    """The cached snapshot of a hub id (no network)."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:
        return None


def load_model(
    source: Any,
    *,
    device: str = "auto",
    dtype: str = "auto",
    random_weights: bool = False,
    attn_implementation: str | None = None,
    seed: int = 0,
) -> LoadedModel:
    """Load ``source`` for profiling: a folder with weights (or a cached hub id) loads them; a config (file,
    folder without weights, dict, catalog name, hub id with only its config cached) builds random weights —
    same shapes, same dtype, so the same memory. Nothing is downloaded."""
    import torch
    import transformers

    from ..memory.config import load_config

    auto: Any = transformers.AutoModelForCausalLM  # untyped in transformers

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    _check_device(torch, device)
    folder: Path | None = None
    if isinstance(source, (str, Path)):
        path = Path(source).expanduser()
        if path.is_dir():
            folder = path
        elif isinstance(source, str) and source.count("/") == 1 and not path.exists():
            folder = _hub_folder(source)
    raw, name, origin = load_config(source if folder is None else folder)
    config_dtype = raw.get("torch_dtype") or raw.get("dtype") or "float32"
    chosen = _torch_dtype(str(config_dtype).replace("torch.", "") if dtype == "auto" else dtype)
    extra: dict[str, Any] = {}
    if attn_implementation is not None:
        extra["attn_implementation"] = attn_implementation
    torch.manual_seed(seed)
    if folder is not None and _has_weights(folder) and not random_weights:
        model: Any = auto.from_pretrained(folder, dtype=chosen, device_map=device, local_files_only=True, **extra)
        random = False
    else:
        fields = {k: v for k, v in raw.items() if k not in ("torch_dtype", "dtype", "transformers_version")}
        try:
            config = transformers.AutoConfig.for_model(**fields)
        except (ValueError, KeyError) as exc:  # an unknown model_type: transformers' own words, typed
            raise ModelConfigError(
                f"{name}: transformers cannot build this config: {exc}. Fix: a config whose model_type the "
                f"installed transformers {transformers.__version__} knows"
            ) from None
        with torch.device(device):
            model = auto.from_config(config, dtype=chosen, **extra)
        random = True
    model.eval()
    long_name = str(chosen).replace("torch.", "")
    config_dict = model.config.to_dict()
    config_dict["torch_dtype"] = config_dict["dtype"] = long_name  # what the memory model reads the dtype from
    dtype_name = _DTYPES[long_name]
    return LoadedModel(
        model=model,
        config=config_dict,
        name=name,
        origin=origin,
        random_weights=random,
        device=str(device),
        dtype=dtype_name,
    )


# ---------------------------------------------------------------------------------------------- measuring


def cache_bytes(cache: Any) -> int:
    """Bytes the cache object keeps alive: the distinct storages of every tensor reachable from it.

    Storages, not visible elements: a sliced view (a sliding layer's window) pins its whole base storage.
    Walks any cache class (layers, lists, dicts, attributes) without knowing its layout.
    """
    import torch

    seen_objects: set[int] = set()
    storages: dict[tuple[str, int], int] = {}

    def walk(obj: Any, depth: int) -> None:
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.nbytes():
                storages[(str(obj.device), storage.data_ptr())] = storage.nbytes()
            return
        if depth > 6 or obj is None or isinstance(obj, (str, bytes, int, float, bool, type)) or id(obj) in seen_objects:
            return
        seen_objects.add(id(obj))
        if isinstance(obj, torch.nn.Module) or hasattr(obj, "to_json_string"):
            return  # a model or a config, not cache state
        if isinstance(obj, dict):
            for value in obj.values():
                walk(value, depth + 1)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                walk(value, depth + 1)
        elif hasattr(obj, "__dict__"):
            for value in vars(obj).values():
                walk(value, depth + 1)

    walk(cache, 0)
    return sum(storages.values())


class Meter(Protocol):
    """Measures one step: ``start`` before it, ``stop`` after it."""

    def start(self) -> None: ...

    def stop(self) -> tuple[int | None, int | None, int | None]:
        """(peak above the start, peak reserved, retained above the start), None where unknown."""
        ...

    def baseline(self) -> tuple[int | None, int | None]:
        """(allocated or resident bytes now, reserved bytes now)."""
        ...


class _CudaMeter:
    """torch's caching allocator: exact peaks of allocated and reserved memory."""

    def __init__(self) -> None:
        import torch

        self._cuda = torch.cuda
        self._start = 0

    def start(self) -> None:
        gc.collect()
        self._cuda.synchronize()
        self._cuda.empty_cache()
        self._cuda.reset_peak_memory_stats()
        self._start = int(self._cuda.memory_allocated())

    def stop(self) -> tuple[int | None, int | None, int | None]:
        self._cuda.synchronize()
        return (
            int(self._cuda.max_memory_allocated()) - self._start,
            int(self._cuda.max_memory_reserved()),
            int(self._cuda.memory_allocated()) - self._start,
        )

    def baseline(self) -> tuple[int | None, int | None]:
        self._cuda.synchronize()
        return int(self._cuda.memory_allocated()), int(self._cuda.memory_reserved())


def _vm_hwm() -> int | None:
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class _CpuMeter:
    """The process's resident set: the high-water mark (Linux, reset through /proc/self/clear_refs) above the
    step's start. Approximate: the C allocator may keep freed memory and reuse it without a new peak."""

    def __init__(self) -> None:
        self._start = 0
        self._resettable = True
        try:
            self._trim: Any = ctypes.CDLL("libc.so.6").malloc_trim
        except OSError:
            self._trim = None

    def start(self) -> None:
        gc.collect()
        if self._trim is not None:
            self._trim(0)  # hand freed heap back so the next step's peak shows up in the RSS
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")  # resets VmHWM to the current RSS
        except OSError:
            self._resettable = False
        self._start = rss_bytes() or 0

    def stop(self) -> tuple[int | None, int | None, int | None]:
        now = rss_bytes()
        hwm = _vm_hwm() if self._resettable else None
        return (
            None if hwm is None else max(hwm - self._start, 0),
            None,
            None if now is None else now - self._start,
        )

    def baseline(self) -> tuple[int | None, int | None]:
        return rss_bytes(), None


METERS: dict[str, Callable[[], Meter]] = {"cuda": _CudaMeter, "cpu": _CpuMeter}


# ---------------------------------------------------------------------------------------------- the report


@dataclass(frozen=True, kw_only=True)
class ProfileRow:
    """One measured step. ``tokens``: cached tokens per sequence. Bytes above the step's start except
    ``reserved_peak`` (absolute) and the cache (its own tensors)."""

    phase: str  # prompt | generate | concurrency
    batch: int
    prompt_tokens: int
    new_tokens: int
    tokens: int
    cache_bytes: int
    predicted_bytes: int
    peak_bytes: int | None
    retained_bytes: int | None
    reserved_peak: int | None
    seconds: float

    @property
    def workspace_bytes(self) -> int | None:
        """The step's transient memory: its peak minus the cache it leaves (prefill activations, logits)."""
        return None if self.peak_bytes is None else self.peak_bytes - self.cache_bytes

    @property
    def exact(self) -> bool:
        return self.cache_bytes == self.predicted_bytes

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["workspace_bytes"] = self.workspace_bytes
        data["exact"] = self.exact
        return data


@dataclass(frozen=True, kw_only=True)
class Jump:
    """A step whose peak rose far faster than its series' usual rate."""

    phase: str
    before: str
    after: str
    increase: int
    expected: int
    hint: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True)
class ProfileReport:
    """The test sequence's measurements, the fitted KV slope against the prediction, and the jumps."""

    model: str
    origin: str
    random_weights: bool
    device: str
    device_name: str
    dtype: str
    attn_implementation: str
    weights_bytes: int
    baseline_bytes: int | None
    baseline_reserved: int | None
    rows: tuple[ProfileRow, ...]
    slope: float | None  # measured KV bytes per token (least squares over the prompt steps; None: one length)
    intercept: float | None
    predicted_per_token: int
    peak_per_token: float | None  # least-squares slope of the prompt steps' peaks (KV + activations)
    jumps: tuple[Jump, ...]
    versions: dict[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    @property
    def ratio(self) -> float | None:
        """Measured over predicted KV bytes per token (1.0: the memory model is right); None without a slope."""
        if self.slope is None or not self.predicted_per_token:
            return None
        return self.slope / self.predicted_per_token

    def _single(self) -> ProfileRow | None:
        """The one prompt step when there is no slope to fit (a single prompt length)."""
        prompts = [row for row in self.rows if row.phase == "prompt"]
        return prompts[0] if self.slope is None and prompts else None

    @property
    def exact(self) -> bool:
        """Every step's cache bytes equal the prediction, byte for byte."""
        return all(row.exact for row in self.rows)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "origin": self.origin,
            "random_weights": self.random_weights,
            "device": self.device,
            "device_name": self.device_name,
            "dtype": self.dtype,
            "attn_implementation": self.attn_implementation,
            "weights_bytes": self.weights_bytes,
            "baseline_bytes": self.baseline_bytes,
            "baseline_reserved": self.baseline_reserved,
            "kv_bytes_per_token": {
                "measured": self.slope,
                "predicted": self.predicted_per_token,
                "ratio": self.ratio,
                "intercept": self.intercept,
                "method": "least squares over the prompt steps" if self.slope is not None else "one prompt length",
            },
            "peak_bytes_per_token": self.peak_per_token,
            "exact": self.exact,
            "rows": [row.to_dict() for row in self.rows],
            "jumps": [j.to_dict() for j in self.jumps],
            "versions": dict(self.versions),
            "notes": list(self.notes),
        }

    def table(self) -> str:
        """The measurements as a readable table."""
        peak_what = "peak above step start" if self.device == "cuda" else "RSS high-water above step start"
        head = (
            f"profile — {self.model} ({'random weights, ' if self.random_weights else ''}{self.dtype}, "
            f"{self.attn_implementation}) on {self.device_name}"
        )
        lines = [head, f"weights {human(self.weights_bytes)}; baseline after load {_h(self.baseline_bytes)}"]
        header = f"{'phase':<12}{'batch':>6}{'tokens':>8}{'cache (measured)':>18}{'predicted':>14}{'':>2}"
        header += f"{'peak':>12}{'workspace':>12}{'s':>7}"
        lines += ["", header, "-" * len(header)]
        for r in self.rows:
            mark = "=" if r.exact else "≠"
            lines.append(
                f"{r.phase:<12}{r.batch:>6}{r.tokens:>8}{r.cache_bytes:>18,}{r.predicted_bytes:>14,}{mark:>2}"
                f"{_h(r.peak_bytes):>12}{_h(r.workspace_bytes):>12}{r.seconds:>7.2f}"
            )
        single = self._single()
        if single is None:
            slope = (
                f"KV bytes per token: measured {self.slope or 0:,.1f} (least squares over the prompt steps), "
                f"predicted {self.predicted_per_token:,} (transformers runtime), ratio {self.ratio or 0:.4f}"
            )
        else:  # one length: no slope to fit; say what the one step measured
            slope = (
                f"KV bytes per token: one prompt length ({single.tokens:,} tokens), so no slope: its cache is "
                f"{single.cache_bytes:,} B ({single.cache_bytes / max(single.tokens, 1):,.1f} B per token on "
                f"average), predicted {single.predicted_bytes:,} B; pass two or more --lengths for "
                "the per-token slope"
            )
        lines += [
            "",
            slope,
            f"cache bytes equal the prediction in {sum(r.exact for r in self.rows)} of {len(self.rows)} steps"
            + (" (exact)" if self.exact else ""),
        ]
        if self.peak_per_token is not None:
            lines.append(f"peak per prompt token ({peak_what}): {self.peak_per_token:,.0f} B (KV + activations)")
        for jump in self.jumps:
            lines.append(
                f"jump: {jump.phase} {jump.before} -> {jump.after}: +{human(jump.increase)} where the series' rate "
                f"predicts +{human(jump.expected)} — {jump.hint}"
            )
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _h(n: int | None) -> str:
    return "—" if n is None else human(n)


def fit_slope(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``(slope, intercept)`` of ys over xs (slope 0 with fewer than two distinct xs)."""
    n = len(xs)
    if n == 0:
        return 0.0, 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    if not var:
        return 0.0, my
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
    return slope, my - slope * mx


_HINTS = {
    "prompt": "the prefill workspace grows faster than the prompt (eager attention is quadratic; an allocator "
    "or kernel threshold); check attn_implementation and the prefill chunk size",
    "concurrency": "a batching threshold: the batch's workspace grows faster than its sequences (padding, "
    "a kernel switching algorithms, the allocator rounding a larger block)",
    "generate": "generation's memory grows faster than its cache (the cache copying on growth, sampling buffers)",
}


def find_jumps(
    phase: str, points: Sequence[tuple[str, float, int]], *, factor: float = 2.0, floor: int = 2**20
) -> list[Jump]:
    """Steps whose peak rose more than ``factor`` times faster than the average so far (the previous step's
    peak per unit of size) and by ``floor`` bytes more than that rate predicts. Linear growth, with or without
    a fixed part, never rises faster than its average; quadratic attention does (3× per doubling).
    ``points``: (label, size, peak) in order, size in tokens × sequences."""
    out: list[Jump] = []
    for a, b in itertools.pairwise(points):
        if b[1] <= a[1] or a[1] <= 0:
            continue
        increase = b[2] - a[2]
        expected = max(a[2], 0) / a[1] * (b[1] - a[1])
        if increase > factor * expected and increase - expected >= floor:
            out.append(
                Jump(
                    phase=phase,
                    before=a[0],
                    after=b[0],
                    increase=int(increase),
                    expected=int(expected),
                    hint=_HINTS.get(phase, ""),
                )
            )
    return out


# ---------------------------------------------------------------------------------------------- running


def stderr_progress(width: int = 28) -> Progress:
    """A one-line progress bar on stderr."""

    def show(done: int, total: int, label: str) -> None:
        filled = int(width * done / max(total, 1))
        end = "\n" if done >= total else ""
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:<32}{end}")
        sys.stderr.flush()

    return show


def _output_cache(out: Any) -> Any:
    for name in ("cache", "past_key_values"):  # transformers 5 renamed past_key_values to cache
        value = out.get(name) if hasattr(out, "get") else getattr(out, name, None)
        if value is not None:
            return value
    raise ConfigurationError(f"{type(out).__name__} returned no cache: the model does not use a KV cache")


def _forward(model: Any, ids: Any) -> Any:
    import torch

    with torch.inference_mode():
        try:
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)  # as generate() does: last logits only
        except TypeError:
            out = model(input_ids=ids, use_cache=True)
    return _output_cache(out)


def _generate(model: Any, ids: Any, new: int) -> tuple[Any, int]:
    import torch

    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    # The last generated token is sampled from the logits but not yet written to the cache.
    return _output_cache(out), int(out.sequences.shape[1]) - 1


def _param_bytes(model: Any) -> int:
    storages: dict[int, int] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


# The test sequence as steps: the baseline after load, then one measured step per prompt length, per generation
# length and per batch, each a _Step of a _Phase. ``profile`` prepares the bench and runs them in order.


def _prefill(model: Any, ids: Any, step: _Step) -> tuple[Any, int]:
    return _forward(model, ids), step.prompt


def _decode(model: Any, ids: Any, step: _Step) -> tuple[Any, int]:
    return _generate(model, ids, step.new)


@dataclass(frozen=True, kw_only=True)
class _Phase:
    """A kind of step: what it runs (the cache it returns and the tokens that cache holds) and the runtime
    phase that predicts it (``plan``: a prefill keeps the whole prompt; ``steady``: decoding keeps windows)."""

    name: str  # prompt | generate | concurrency
    run: Callable[[Any, Any, _Step], tuple[Any, int]]
    kv_phase: str


_PROMPT = _Phase(name="prompt", run=_prefill, kv_phase="plan")
_GENERATE = _Phase(name="generate", run=_decode, kv_phase="steady")
_CONCURRENCY = _Phase(name="concurrency", run=_prefill, kv_phase="plan")
_PHASES = (_PROMPT, _GENERATE, _CONCURRENCY)  # in the sequence's order


@dataclass(frozen=True, kw_only=True)
class _Bench:
    """What every step uses: the loaded model, its memory model, the meter and the prompts' generator."""

    loaded: LoadedModel
    spec: ModelSpec
    device_type: str
    meter: Meter
    generator: Any  # torch.Generator, seeded: the same prompts on every run

    def ids(self, batch: int, tokens: int) -> Any:
        import torch

        # token 0 is left out: it often is the pad token
        vocab = int(self.spec.vocab_size or 2)
        return torch.randint(1, vocab, (batch, tokens), generator=self.generator).to(self.loaded.device)

    def predict(self, tokens: int, batch: int, phase: str) -> int:
        from ..memory import kv_report

        report = kv_report(self.spec, tokens, batch, runtime="transformers", kv_dtype=self.loaded.dtype, phase=phase)
        return int(report.bytes)


@dataclass(frozen=True, kw_only=True)
class _Step:
    """One measured step: ``batch`` prompts of ``prompt`` tokens, then ``new`` generated tokens."""

    phase: _Phase
    batch: int
    prompt: int
    new: int = 0

    @property
    def label(self) -> str:
        return f"{self.phase.name} {self.batch} × {self.prompt}" + (f" + {self.new}" if self.new else "")

    def measure(self, bench: _Bench) -> ProfileRow:
        """Run the step between the meter's start and stop; the cache and the prompt go when this returns."""
        ids = bench.ids(self.batch, self.prompt)
        bench.meter.start()
        started = time.perf_counter()
        cache, cached = self.phase.run(bench.loaded.model, ids, self)
        seconds = time.perf_counter() - started
        peak, reserved, retained = bench.meter.stop()
        return ProfileRow(
            phase=self.phase.name,
            batch=self.batch,
            prompt_tokens=self.prompt,
            new_tokens=self.new,
            tokens=cached,
            cache_bytes=cache_bytes(cache),
            predicted_bytes=bench.predict(cached, self.batch, self.phase.kv_phase),
            peak_bytes=peak,
            retained_bytes=retained,
            reserved_peak=reserved,
            seconds=round(seconds, 4),
        )


def _sequence(options: ProfileSettings) -> tuple[_Step, ...]:
    """The measured steps in order: prompts of growing length, generation lengths, concurrency."""
    gen_prompt = options.generate_prompt or options.lengths[0]
    batch_tokens = options.batch_tokens or options.lengths[0]
    return (
        *(_Step(phase=_PROMPT, batch=1, prompt=n) for n in options.lengths),
        *(_Step(phase=_GENERATE, batch=1, prompt=gen_prompt, new=n) for n in options.new_tokens),
        *(_Step(phase=_CONCURRENCY, batch=b, prompt=batch_tokens) for b in options.batches),
    )


def _prepare(loaded: LoadedModel, options: ProfileSettings) -> _Bench:
    """The bench for ``loaded``: a meter for its device and its memory model, refusing a sequence longer than
    the model accepts before any step runs."""
    import torch

    from ..memory import ModelSpec

    device_type = torch.device(loaded.device).type
    if device_type not in METERS:
        raise ConfigurationError(f"profile measures cuda and cpu devices, not {loaded.device!r}")
    meter = METERS[device_type]()
    spec = ModelSpec.from_config(loaded.config, name=loaded.name)
    limit = spec.max_context
    longest = max(
        [*options.lengths, (options.generate_prompt or options.lengths[0]) + max(options.new_tokens, default=0)]
    )
    if limit is not None and longest > limit:
        raise ConfigurationError(
            f"{loaded.name} accepts at most {limit:,} tokens; the sequence asks for {longest:,}: "
            "lower --lengths / --new-tokens"
        )
    generator = torch.Generator().manual_seed(options.seed)
    return _Bench(loaded=loaded, spec=spec, device_type=device_type, meter=meter, generator=generator)


def _baseline(bench: _Bench, progress: Progress, total: int) -> tuple[int | None, int | None]:
    """The memory held after load: (allocated or resident, reserved)."""
    progress(0, total, "warm-up and baseline")
    _forward(bench.loaded.model, bench.ids(1, 8))  # first call initialises lazy state (kernels, thread pools)
    gc.collect()
    baseline = bench.meter.baseline()
    progress(1, total, "baseline")
    return baseline


def _silent(done: int, total: int, label: str) -> None:
    """No progress shown."""


def _kv_fit(rows: Sequence[ProfileRow]) -> tuple[float | None, float | None]:
    """(slope, intercept) of the prompt steps' cache bytes over tokens; one length has no slope: reported as
    measured, not as 0."""
    prompts = [r for r in rows if r.phase == _PROMPT.name]
    if len({r.tokens for r in prompts}) < 2:
        return None, None
    return fit_slope([r.tokens for r in prompts], [r.cache_bytes for r in prompts])


def _peak_fit(rows: Sequence[ProfileRow]) -> float | None:
    """The prompt steps' peak bytes per token (KV + activations); None without two measured lengths."""
    peaks = [r for r in rows if r.phase == _PROMPT.name and r.peak_bytes is not None]
    if len({r.tokens for r in peaks}) < 2:
        return None
    return fit_slope([r.tokens for r in peaks], [r.peak_bytes or 0 for r in peaks])[0]


def _jumps(rows: Sequence[ProfileRow], options: ProfileSettings) -> list[Jump]:
    jumps: list[Jump] = []
    for phase in _PHASES:
        series = [
            (f"{r.batch}×{r.tokens}", float(r.batch * r.tokens), int(r.peak_bytes or 0))
            for r in rows
            if r.phase == phase.name and r.peak_bytes is not None
        ]
        jumps += find_jumps(phase.name, series, factor=options.jump_factor, floor=options.jump_floor)
    return jumps


def _notes(bench: _Bench, kv_notes: Sequence[str]) -> tuple[str, ...]:
    notes: list[str] = []
    if bench.loaded.random_weights:
        notes.append("random weights built from the config: the same shapes and dtype, so the same memory")
    if bench.device_type == "cpu":
        notes.append(
            "CPU: peaks are the resident set's high-water mark above each step's start (approximate: the C "
            "allocator may reuse freed memory); cache bytes are the cache tensors' own storage (exact)"
        )
    return (*notes, *kv_notes)


def _report(
    bench: _Bench, options: ProfileSettings, baseline: tuple[int | None, int | None], rows: Sequence[ProfileRow]
) -> ProfileReport:
    """The measurements with the KV slope against the prediction, the jumps and where they were taken."""
    import torch
    import transformers

    from ..memory import kv_report

    loaded, net = bench.loaded, bench.loaded.model
    slope, intercept = _kv_fit(rows)
    per_token = kv_report(bench.spec, max(options.lengths), 1, runtime="transformers", kv_dtype=loaded.dtype)
    cuda = bench.device_type == "cuda"
    name = torch.cuda.get_device_name(loaded.device) if cuda else platform.processor() or "CPU"
    return ProfileReport(
        model=loaded.name,
        origin=loaded.origin,
        random_weights=loaded.random_weights,
        device=bench.device_type,
        device_name=name or "CPU",
        dtype=loaded.dtype,
        attn_implementation=str(getattr(net.config, "_attn_implementation", None) or "default"),
        weights_bytes=_param_bytes(net),
        baseline_bytes=baseline[0],
        baseline_reserved=baseline[1],
        rows=tuple(rows),
        slope=slope,
        intercept=intercept,
        predicted_per_token=per_token.bytes_per_token,
        peak_per_token=_peak_fit(rows),
        jumps=tuple(_jumps(rows, options)),
        versions={
            "torch": str(torch.__version__),
            "transformers": str(transformers.__version__),
            "python": platform.python_version(),
        },
        notes=_notes(bench, per_token.notes),
    )


def profile(
    model: Any,
    *,
    settings: ProfileSettings | None = None,
    device: str = "auto",
    dtype: str = "auto",
    random_weights: bool = False,
    attn_implementation: str | None = None,
    progress: Progress | None = None,
    **setting_fields: Any,
) -> ProfileReport:
    """Run the test sequence on ``model`` (anything :func:`load_model` takes, or a :class:`LoadedModel`).

    ``setting_fields`` override :class:`ProfileSettings` fields (``lengths=(...)``, ``batches=(...)``...)."""
    options = dataclasses.replace(settings or ProfileSettings(), **setting_fields)
    loaded = (
        model
        if isinstance(model, LoadedModel)
        else load_model(
            model,
            device=device,
            dtype=dtype,
            random_weights=random_weights,
            attn_implementation=attn_implementation,
            seed=options.seed,
        )
    )
    bench = _prepare(loaded, options)
    steps = _sequence(options)
    tell = progress or _silent
    total = len(steps) + 1  # the baseline, then each measured step
    baseline = _baseline(bench, tell, total)
    rows: list[ProfileRow] = []
    for done, step in enumerate(steps, start=2):
        rows.append(step.measure(bench))
        tell(done, total, step.label)
    return _report(bench, options, baseline, rows)


# ---------------------------------------------------------------------------------------------- plot


def plot_profile(report: ProfileReport, path: str | Path) -> Path:
    """A PNG: cache bytes (measured and predicted) and peaks per step, for each series."""
    matplotlib = needs_matplotlib()
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [(phase, [r for r in report.rows if r.phase == phase]) for phase in ("prompt", "generate", "concurrency")]
    series = [(phase, rows) for phase, rows in series if rows]
    fig, axes = plt.subplots(1, len(series), figsize=(5.2 * len(series), 4.2), squeeze=False)
    mib = 2**20
    xlabel = {"prompt": "prompt tokens", "generate": "cached tokens (prompt + generated)", "concurrency": "sequences"}
    for ax, (phase, rows) in zip(axes[0], series, strict=True):
        xs = [r.batch if phase == "concurrency" else r.tokens for r in rows]
        ax.plot(xs, [r.predicted_bytes / mib for r in rows], "-", color="tab:gray", label="predicted KV")
        ax.plot(xs, [r.cache_bytes / mib for r in rows], "o", color="tab:blue", label="measured KV (cache tensors)")
        peaks = [(x, r.peak_bytes / mib) for x, r in zip(xs, rows, strict=True) if r.peak_bytes is not None]
        if peaks:
            ax.plot(*zip(*peaks, strict=True), "s--", color="tab:red", label="peak above step start")
        if phase == "prompt" and report.slope is not None and report.intercept is not None:
            fit = [(report.intercept + report.slope * x) / mib for x in xs]
            ax.plot(xs, fit, ":", color="tab:blue", label=f"fit: {report.slope:,.0f} B/token")
        ax.set_title(f"{phase}")
        ax.set_xlabel(xlabel[phase])
        ax.set_ylabel("MiB")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    measured = f"measured {report.slope:,.0f} B" if report.slope is not None else "one length, no slope"
    fig.suptitle(
        f"{report.model} — {report.dtype}, {report.attn_implementation}, {report.device_name}; "
        f"KV/token {measured} vs predicted {report.predicted_per_token:,} B",
        fontsize=10,
    )
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
