"""``MemoryMonitor``: sample memory across requests and flag leaks, fragmentation and other processes.

Sources (a registry, ``SOURCES``): ``torch`` reads the CUDA caching allocator (allocated and reserved bytes),
``nvml`` the driver's view of the device (used bytes, and the processes holding memory), ``cpu`` the process's
resident set (RSS) or a byte probe the caller supplies. ``request_done()`` is one cheap reading per completed
request; ``report()`` turns the readings into findings with their advice.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

from .._exceptions import ConfigurationError
from ..memory.render import human

__all__ = [
    "SOURCES",
    "Finding",
    "HostMemory",
    "MemoryMonitor",
    "MonitorReport",
    "ProcessUse",
    "Reading",
    "Sample",
    "host_memory",
    "rss_bytes",
]

MiB = 2**20
GiB = 2**30


# ---------------------------------------------------------------------------------------------- host memory


@dataclass(frozen=True, kw_only=True)
class HostMemory:
    """System RAM: total, available (None when unknown), the cgroup (container) limit, this process's RSS."""

    total_bytes: int
    available_bytes: int | None
    cgroup_limit_bytes: int | None
    rss_bytes: int | None


def rss_bytes() -> int | None:
    """This process's resident set size (Linux ``/proc/self/statm``; ``resource`` elsewhere gives the peak)."""
    try:
        with open("/proc/self/statm", "rb") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak) if os.uname().sysname == "Darwin" else int(peak) * 1024
    except Exception:
        return None


def _cgroup_limit() -> int | None:
    """The memory limit of this process's cgroup (v2 ``memory.max``, v1 ``memory.limit_in_bytes``), if any."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # v1 reports "no limit" as a huge number
            return int(text)
        return None
    return None


def host_memory() -> HostMemory:
    """This machine's RAM as the OOM killer sees it (``MemAvailable`` from /proc/meminfo where present)."""
    from ..memory.gpus import _ram

    total, free = _ram()
    available = free
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return HostMemory(
        total_bytes=total, available_bytes=available, cgroup_limit_bytes=_cgroup_limit(), rss_bytes=rss_bytes()
    )


# ---------------------------------------------------------------------------------------------- sources


@dataclass(frozen=True, kw_only=True)
class Reading:
    """One reading: ``allocated`` live bytes, ``reserved`` what the allocator holds (None when the source
    cannot tell them apart)."""

    allocated: int
    reserved: int | None = None


@dataclass(frozen=True, kw_only=True)
class ProcessUse:
    """Another process holding device memory (NVML)."""

    pid: int
    used_bytes: int | None


class Source(Protocol):
    """Where readings come from: ``read`` is called once per sample and must be cheap."""

    name: str

    def read(self) -> Reading: ...

    def others(self) -> tuple[ProcessUse, ...]: ...


class _TorchSource:
    name = "torch"

    def __init__(self, device: int = 0) -> None:
        import torch

        if not torch.cuda.is_available():
            raise ConfigurationError("source='torch' needs CUDA; use source='cpu' (RSS) or 'nvml'")
        self._cuda = torch.cuda
        self._device = device
        self._nvml = _NvmlSource(device) if _has_nvml() else None

    def read(self) -> Reading:
        # Both are counters the allocator keeps: no synchronisation, no driver call.
        return Reading(
            allocated=int(self._cuda.memory_allocated(self._device)),
            reserved=int(self._cuda.memory_reserved(self._device)),
        )

    def others(self) -> tuple[ProcessUse, ...]:
        return self._nvml.others() if self._nvml is not None else ()


def _has_nvml() -> bool:
    try:
        import pynvml  # noqa: F401
    except Exception:
        return False
    return True


class _NvmlSource:
    name = "nvml"

    def __init__(self, device: int = 0) -> None:
        try:
            import pynvml
        except ImportError as exc:
            raise ConfigurationError("source='nvml' needs nvidia-ml-py: pip install 'contextkeeper[nvml]'") from exc
        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(device)

    def read(self) -> Reading:
        info = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        return Reading(allocated=int(info.used))

    def others(self) -> tuple[ProcessUse, ...]:
        try:
            running = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)
        except Exception:
            return ()
        me = os.getpid()
        return tuple(
            ProcessUse(pid=int(p.pid), used_bytes=int(p.usedGpuMemory) if p.usedGpuMemory is not None else None)
            for p in running
            if int(p.pid) != me
        )


class _CpuSource:
    name = "cpu"

    def __init__(self, probe: Callable[[], int] | None = None) -> None:
        self._probe = probe

    def read(self) -> Reading:
        rss = rss_bytes() or 0
        if self._probe is not None:  # the caller's live bytes; RSS is then what the process holds
            return Reading(allocated=int(self._probe()), reserved=rss)
        return Reading(allocated=rss)

    def others(self) -> tuple[ProcessUse, ...]:
        return ()


def _auto(device: int, probe: Callable[[], int] | None) -> Source:
    if probe is None:
        try:
            return _TorchSource(device)
        except Exception:
            pass
        if _has_nvml():
            try:
                return _NvmlSource(device)
            except Exception:
                pass
    return _CpuSource(probe)


SOURCES: dict[str, Callable[[int, Callable[[], int] | None], Source]] = {
    "auto": _auto,
    "torch": lambda device, probe: _TorchSource(device),
    "nvml": lambda device, probe: _NvmlSource(device),
    "cpu": lambda device, probe: _CpuSource(probe),
}


# ---------------------------------------------------------------------------------------------- report


@dataclass(frozen=True, kw_only=True)
class Sample:
    """One reading. ``kind``: ``start``, ``request`` (after a completed request), ``sample`` or ``end``."""

    t: float
    label: str
    kind: str
    allocated: int
    reserved: int | None


@dataclass(frozen=True, kw_only=True)
class Finding:
    """Something the samples show. ``kind``: ``leak``, ``fragmentation`` or ``other-processes``."""

    kind: str
    message: str
    advice: tuple[str, ...]
    bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["advice"] = list(self.advice)
        return data


@dataclass(frozen=True, kw_only=True)
class MonitorReport:
    """The samples, the slope of allocated memory across completed requests, and the findings."""

    source: str
    samples: tuple[Sample, ...]
    requests: int
    growth_per_request: float  # least-squares slope of allocated bytes over the counted requests
    findings: tuple[Finding, ...]
    others: tuple[ProcessUse, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.findings

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "requests": self.requests,
            "growth_per_request": self.growth_per_request,
            "findings": [f.to_dict() for f in self.findings],
            "samples": [dataclasses.asdict(s) for s in self.samples],
            "others": [dataclasses.asdict(p) for p in self.others],
        }

    def table(self) -> str:
        lines = [f"memory monitor ({self.source}): {len(self.samples)} samples, {self.requests} requests"]
        lines.append(f"allocated growth per request: {human(self.growth_per_request)}")
        if not self.findings:
            lines.append("no findings")
        for finding in self.findings:
            lines.append(f"[{finding.kind}] {finding.message}")
            lines += [f"  - {a}" for a in finding.advice]
        return "\n".join(lines)


def _slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (0 with fewer than two points)."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0


_LEAK_ADVICE = (
    "run inference under torch.inference_mode() so no autograd graph is kept",
    "drop outputs, logits and caches after each request (keep text or token ids, not tensors)",
    "do not reuse a past_key_values / cache object across unrelated requests",
)
_FRAGMENTATION_ADVICE = (
    "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before the process starts",
    "keep shapes stable: pad prompts to length buckets, or generate(..., cache_implementation='static')",
    "torch.cuda.empty_cache() between phases returns cached blocks (costs speed)",
)
_OTHERS_ADVICE = (
    "stop or move the other processes (nvidia-smi --query-compute-apps=pid,used_memory --format=csv)",
    "or lower what this process asks for (vLLM --gpu-memory-utilization, SGLang --mem-fraction-static)",
)


class MemoryMonitor:
    """Sample memory across requests; ``report()`` flags leaks, fragmentation and other processes.

    ``with MemoryMonitor() as mon: ...; mon.request_done(label)`` after each completed request.
    ``source``: ``auto`` (torch CUDA, then NVML, then CPU), ``torch``, ``nvml``, ``cpu``, or a :class:`Source`.
    ``probe``: a function returning the live bytes to watch on CPU (RSS otherwise).
    A leak is flagged when allocated memory grows over at least ``min_requests`` consecutive completed
    requests (after ``warmup`` requests, which may fill caches once) by ``leak_bytes`` or more in total.
    Fragmentation: reserved above ``fragmentation_ratio`` × allocated and ``fragmentation_bytes`` apart.
    """

    def __init__(
        self,
        source: str | Source = "auto",
        *,
        probe: Callable[[], int] | None = None,
        device: int = 0,
        warmup: int = 1,
        min_requests: int = 3,
        leak_bytes: int = 8 * MiB,
        fragmentation_ratio: float = 1.5,
        fragmentation_bytes: int = GiB,
        max_samples: int = 100_000,
    ) -> None:
        if isinstance(source, str):
            if source not in SOURCES:
                raise ConfigurationError(f"unknown monitor source {source!r}: use one of {', '.join(SOURCES)}")
            self._source: Source = SOURCES[source](device, probe)
        else:
            self._source = source
        self.warmup = warmup
        self.min_requests = max(2, min_requests)
        self.leak_bytes = leak_bytes
        self.fragmentation_ratio = fragmentation_ratio
        self.fragmentation_bytes = fragmentation_bytes
        self.max_samples = max_samples
        self._samples: list[Sample] = []
        self._requests = 0

    @property
    def source(self) -> str:
        return self._source.name

    @property
    def samples(self) -> tuple[Sample, ...]:
        return tuple(self._samples)

    def __enter__(self) -> MemoryMonitor:
        self._take("start", "start")
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._take("end", "end")

    def _take(self, label: str, kind: str) -> Sample:
        reading = self._source.read()
        sample = Sample(
            t=time.monotonic(), label=label, kind=kind, allocated=reading.allocated, reserved=reading.reserved
        )
        if len(self._samples) >= self.max_samples:  # keep the first (baseline) and the most recent ones
            del self._samples[1]
        self._samples.append(sample)
        return sample

    def sample(self, label: str = "") -> Sample:
        """Take one reading now."""
        return self._take(label, "sample")

    def request_done(self, label: str = "") -> Sample:
        """One reading at the end of a completed request (cheap: allocator counters or /proc/self/statm)."""
        self._requests += 1
        return self._take(label or f"request {self._requests}", "request")

    def report(self) -> MonitorReport:
        """The findings so far."""
        findings: list[Finding] = []
        requests = [s for s in self._samples if s.kind == "request"][self.warmup :]
        values = [s.allocated for s in requests]
        slope = _slope([float(i) for i in range(len(values))], [float(v) for v in values])
        leak = self._leak(requests, slope)
        if leak is not None:
            findings.append(leak)
        fragmentation = self._fragmentation()
        if fragmentation is not None:
            findings.append(fragmentation)
        others = self._source.others()
        held = sum(p.used_bytes or 0 for p in others)
        if others:
            pids = ", ".join(
                f"{p.pid} ({human(p.used_bytes)})" if p.used_bytes is not None else str(p.pid) for p in others
            )
            findings.append(
                Finding(
                    kind="other-processes",
                    message=f"{len(others)} other process(es) hold {human(held)} on this GPU: {pids}",
                    advice=_OTHERS_ADVICE,
                    bytes=held,
                )
            )
        return MonitorReport(
            source=self._source.name,
            samples=tuple(self._samples),
            requests=self._requests,
            growth_per_request=slope,
            findings=tuple(findings),
            others=others,
        )

    def _leak(self, requests: list[Sample], slope: float) -> Finding | None:
        values = [s.allocated for s in requests]
        # the longest run of consecutive growth ending at the latest request: a leak keeps growing
        run = 0
        for before, after in zip(values[-2::-1], values[:0:-1], strict=False):
            if after > before:
                run += 1
            else:
                break
        grown = values[-1] - values[-1 - run] if run else 0
        if run < self.min_requests - 1 or grown < self.leak_bytes or slope <= 0:
            return None
        return Finding(
            kind="leak",
            message=f"allocated memory grew over the last {run + 1} completed requests by {human(grown)} "
            f"({human(slope)} per request; {human(values[0])} -> {human(values[-1])}): tensors stay referenced",
            advice=_LEAK_ADVICE,
            bytes=grown,
        )

    def _fragmentation(self) -> Finding | None:
        latest = next((s for s in reversed(self._samples) if s.reserved is not None), None)
        if latest is None or self._source.name == "cpu" or latest.reserved is None:
            return None  # RSS is not an allocator's reserve: nothing to compare on CPU
        gap = latest.reserved - latest.allocated
        if gap < self.fragmentation_bytes or latest.reserved < self.fragmentation_ratio * max(latest.allocated, 1):
            return None
        return Finding(
            kind="fragmentation",
            message=f"reserved {human(latest.reserved)} is {latest.reserved / max(latest.allocated, 1):.1f}× "
            f"allocated {human(latest.allocated)}: {human(gap)} cached but not in use",
            advice=_FRAGMENTATION_ADVICE,
            bytes=gap,
        )
