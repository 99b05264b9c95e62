"""GPU catalog and live GPU detection.

``find_gpu`` turns a forgiving name ("4090", "rtx4090", "H100-SXM", "a100-80g", "M2 Ultra 192GB", "48GB") into a
:class:`GPU` from ``data/gpus.json``. ``detect_gpus`` reports the devices of this machine: torch CUDA/ROCm, then
NVML, then Apple MPS, then system RAM as one ``"cpu"`` device. Neither imports torch at module import time.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, replace
from importlib import resources
from typing import Any

from .._exceptions import ConfigurationError, UnknownGPU
from .limits import type_name

__all__ = [
    "GPU",
    "DetectedGPU",
    "apple_default_wired_fraction",
    "detect_gpus",
    "find_gpu",
    "gpu_catalog",
    "normalize_gpu_name",
]

GiB = 2**30
MiB = 2**20
MAX_CUSTOM_GB = 65_536  # a generic "<N>GB" device: far above any single accelerator

# macOS lets Metal wire about 2/3 of RAM on machines with at most 36 GiB and about 3/4 above that by default
# (``sysctl iogpu.wired_limit_mb`` changes it). Measured values sit at or above this: 10.67 GB of a 16 GB M4,
# 17.76 GiB of 24 GB, 107.52 GiB of 128 GiB. Detection reads the real limit (torch.mps.recommended_max_memory()).
_APPLE_SMALL_RAM_LIMIT = 36 * GiB


def apple_default_wired_fraction(ram_bytes: int) -> float:
    """The share of unified memory macOS lets the GPU wire by default: 2/3 up to 36 GiB of RAM, 3/4 above."""
    return 2 / 3 if ram_bytes <= _APPLE_SMALL_RAM_LIMIT else 3 / 4


@dataclass(frozen=True, kw_only=True)
class GPU:
    """One device: its canonical name, vendor, kind and usable memory.

    ``memory_bytes`` is what CUDA reports as the device total (``torch.cuda.get_device_properties(i).total_memory``)
    where a public log showed it (``memory_source="reported"``), else the nominal size in GiB x 2**30
    (``"nominal"``). ``unified``: Apple unified memory or CPU RAM, shared with the OS. ``wired_limit_bytes``: the
    most the OS lets the GPU use, where known (Apple: Metal's recommended working set).
    """

    name: str
    vendor: str
    kind: str
    memory_bytes: int
    memory_source: str
    aliases: tuple[str, ...]
    bandwidth_gb_s: float | None = None
    unified: bool = False
    wired_limit_bytes: int | None = None

    @property
    def memory_gib(self) -> float:
        """``memory_bytes`` in GiB."""
        return self.memory_bytes / GiB

    @property
    def usable_bytes(self) -> int:
        """Memory the GPU may actually use: ``wired_limit_bytes`` where known; for Apple unified memory without
        it, the macOS default share (:func:`apple_default_wired_fraction`); otherwise ``memory_bytes``."""
        if self.wired_limit_bytes is not None:
            return min(self.wired_limit_bytes, self.memory_bytes)
        if self.unified and self.vendor == "apple":
            return int(self.memory_bytes * apple_default_wired_fraction(self.memory_bytes))
        return self.memory_bytes


@dataclass(frozen=True, kw_only=True)
class DetectedGPU:
    """A device found on this machine. ``source``: ``"torch"``, ``"nvml"``, ``"mps"`` or ``"cpu"``.

    ``free_bytes`` is None where the source cannot tell. For ``"mps"``, ``total_bytes`` is the machine's RAM and
    ``wired_limit_bytes`` Metal's recommended maximum working set.
    """

    index: int
    name: str
    total_bytes: int
    free_bytes: int | None
    source: str
    wired_limit_bytes: int | None = None

    def as_gpu(self) -> GPU:
        """This device as a :class:`GPU`: the catalog entry it matches (vendor, kind, bandwidth), with the
        measured total as ``memory_bytes``; an uncatalogued device keeps its own name with kind ``"custom"``."""
        if self.source == "cpu":
            return GPU(
                name=self.name,
                vendor="cpu",
                kind="cpu",
                memory_bytes=self.total_bytes,
                memory_source="reported",
                aliases=(),
                unified=True,
            )
        query = self.name
        if self.source == "mps":
            query = f"{self.name} {round(self.total_bytes / GiB)}GB"
        try:
            base: GPU | None = _closest_variant(find_gpu(query), self.total_bytes)
        except UnknownGPU:
            base = None
        if base is None:
            base = GPU(
                name=self.name,
                vendor="apple" if self.source == "mps" else _guess_vendor(self.name),
                kind="apple" if self.source == "mps" else "custom",
                memory_bytes=self.total_bytes,
                memory_source="reported",
                aliases=(),
                unified=self.source == "mps",
            )
        return replace(
            base,
            memory_bytes=self.total_bytes,
            memory_source="reported",
            wired_limit_bytes=self.wired_limit_bytes,
        )


# ---------------------------------------------------------------------------------------------------- catalog

_NOISE_WORDS = frozenset(
    {"nvidia", "geforce", "rtx", "tesla", "amd", "instinct", "apple", "intel", "arc", "radeon", "graphics", "r", "tm"}
    | {"hbm2", "hbm2e", "hbm3", "hbm3e"}
)
_GLUED_PREFIXES = ("nvidia", "geforce", "rtx", "tesla")
_SIZE_WORD = re.compile(r"^(\d+(?:\.\d+)?)(?:g|gb|gib)$")
_NUMBER = re.compile(r"^\d+(?:\.\d+)?$")
_CUSTOM = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:g|gb|gib)\s*$", re.IGNORECASE)


def _size_text(number: str) -> str:
    value = float(number)
    return f"{int(value)}" if value.is_integer() else f"{value:g}"


def _words(name: str) -> list[str]:
    """Lowercased words of a GPU name with vendor words dropped and sizes written ``<N>gb``."""
    out: list[str] = []
    for raw in re.split(r"[^0-9a-z.]+", name.lower()):
        word = raw.strip(".")
        if not word or word in _NOISE_WORDS:
            continue
        if word in {"g", "gb", "gib"} and out and _NUMBER.match(out[-1]):
            out[-1] = f"{_size_text(out[-1])}gb"
            continue
        size = _SIZE_WORD.match(word)
        if size:
            out.append(f"{_size_text(size.group(1))}gb")
            continue
        for prefix in _GLUED_PREFIXES:
            if word.startswith(prefix) and len(word) > len(prefix):
                word = word[len(prefix) :]
                break
        out.append(re.sub(r"^sxm\d$", "sxm", word))
    return out


def normalize_gpu_name(name: str) -> str:
    """The lookup key of a GPU name: lowercase, no punctuation or spaces, vendor words ("NVIDIA", "GeForce",
    "RTX", "Tesla", "AMD", "Instinct", "Apple", "Intel", "Arc") dropped, "80G"/"80 GiB" written "80gb"."""
    return "".join(_words(name))


@dataclass(frozen=True)
class _Index:
    by_key: dict[str, GPU]
    by_family: dict[str, tuple[GPU, ...]]
    default: dict[str, GPU]
    by_form: dict[str, tuple[GPU, ...]]
    family_of: dict[str, str]
    nominal_gb: dict[str, float]


def _entry_to_gpu(entry: dict[str, Any]) -> GPU:
    if "reported_bytes" in entry:
        memory, source = int(entry["reported_bytes"]), "reported"
    elif "reported_mib" in entry:
        memory, source = int(entry["reported_mib"]) * MiB, "reported"
    else:
        memory, source = int(float(entry["nominal_gb"]) * GiB), "nominal"
    bandwidth = entry.get("bandwidth_gb_s")
    return GPU(
        name=str(entry["name"]),
        vendor=str(entry["vendor"]),
        kind=str(entry["kind"]),
        memory_bytes=memory,
        memory_source=source,
        aliases=tuple(str(a) for a in entry.get("aliases", ())),
        bandwidth_gb_s=None if bandwidth is None else float(bandwidth),
        unified=bool(entry.get("unified", False)),
    )


@functools.cache
def _load() -> tuple[tuple[GPU, ...], _Index]:
    text = resources.files("contextkeeper.memory").joinpath("data/gpus.json").read_text(encoding="utf-8")
    entries: list[dict[str, Any]] = json.loads(text)["gpus"]
    gpus: list[GPU] = []
    by_key: dict[str, GPU] = {}
    by_family: dict[str, list[GPU]] = {}
    default: dict[str, GPU] = {}
    by_form: dict[str, list[GPU]] = {}
    family_of: dict[str, str] = {}
    nominal_gb: dict[str, float] = {}
    for entry in entries:
        gpu = _entry_to_gpu(entry)
        gpus.append(gpu)
        family = normalize_gpu_name(str(entry["family"]))
        family_of[gpu.name] = family
        nominal_gb[gpu.name] = float(entry["nominal_gb"])
        by_family.setdefault(family, []).append(gpu)
        if entry.get("default"):
            default[family] = gpu
        for alias in (gpu.name, *gpu.aliases):
            words = _words(alias)
            by_key.setdefault("".join(words), gpu)
            form = "".join(word for word in words if not _SIZE_WORD.match(word))
            if gpu not in by_form.setdefault(form, []):
                by_form[form].append(gpu)
    index = _Index(
        by_key=by_key,
        by_family={k: tuple(v) for k, v in by_family.items()},
        default=default,
        by_form={k: tuple(v) for k, v in by_form.items()},
        family_of=family_of,
        nominal_gb=nominal_gb,
    )
    return tuple(gpus), index


def gpu_catalog() -> tuple[GPU, ...]:
    """Every catalogued GPU, in file order (loaded once from ``data/gpus.json``)."""
    return _load()[0]


def _custom(size: float) -> GPU:
    text = _size_text(str(size))
    return GPU(
        name=f"Custom {text}GB",
        vendor="custom",
        kind="custom",
        memory_bytes=int(size * GiB),
        memory_source="nominal",
        aliases=(),
    )


def _close_names(key: str, index: _Index) -> tuple[str, ...]:
    pool: dict[str, tuple[GPU, ...]] = {k: (gpu,) for k, gpu in index.by_key.items()}
    for lookup in (index.by_form, index.by_family):
        for k, gpus in lookup.items():
            pool.setdefault(k, gpus)
    names: list[str] = []
    for match in difflib.get_close_matches(key, list(pool), n=12, cutoff=0.6):
        names.extend(gpu.name for gpu in pool[match] if gpu.name not in names)
    return tuple(names[:5])


def _unknown(name: str, index: _Index, matches: tuple[str, ...] | None = None, why: str = "") -> UnknownGPU:
    key = normalize_gpu_name(name)
    if matches is None:
        matches = _close_names(key, index) if key else ()
    detail = f" {why}" if why else ""
    return UnknownGPU(
        f"Unknown GPU {name!r}.{detail}",
        matches=matches,
        fix="pass a catalog name (docs/memory.md lists them) or a size for a generic device, e.g. --gpu 48GB",
    )


def find_gpu(name: str) -> GPU:
    """Look a GPU up by a forgiving name.

    Case, spaces, dashes and the words "NVIDIA", "GeForce", "RTX", "Tesla", "AMD", "Instinct", "Apple", "Intel"
    and "Arc" do not matter, nor "80G" vs "80GB" vs "80 GiB". A family name with several variants ("A100", "H100",
    "3080", "4060 Ti", "V100", "GH200") means the larger variant (for equal sizes, the SXM form); add the size or
    form to pick another ("A100 40GB", "H100 PCIe"). An Apple chip with a size ("M3 Max 64GB") is that chip with
    that much unified memory. ``"<N>GB"`` / ``"<N>GiB"`` alone is a generic ``kind="custom"`` device of N GiB.

    Raises :class:`~contextkeeper.UnknownGPU` (``.matches``: the closest catalog names) for anything else, and
    :class:`~contextkeeper.ConfigurationError` for a value that is not a string (``gpu=48``: write ``"48GB"``).
    """
    if not isinstance(name, str):
        example = f"'{name}GB'" if isinstance(name, (int, float)) and not isinstance(name, bool) else "'48GB'"
        error = ConfigurationError(
            f"gpu must be a GPU name such as 'H100' or a size such as '48GB', got {name!r} "
            f"({type_name(name)}). Fix: gpu={example} (or --gpu on the command line)"
        )
        error.fix = f"gpu={example}"
        raise error
    custom = _CUSTOM.match(name)
    if custom:
        custom_gb = float(custom.group(1))
        if not 0 < custom_gb <= MAX_CUSTOM_GB:
            raise _unknown(name, _load()[1], (), f"A size must be more than 0 and at most {MAX_CUSTOM_GB:,}GB.")
        return _custom(custom_gb)
    index = _load()[1]
    words = _words(name)
    key = "".join(words)
    if not key:
        raise _unknown(name, index, ())
    if key in index.by_key:
        return index.by_key[key]
    sizes = [i for i, word in enumerate(words) if _SIZE_WORD.match(word)]
    size: float | None = None
    rest = key
    if sizes:
        position = sizes[-1]
        size = float(words[position][:-2])
        rest = "".join(words[:position] + words[position + 1 :])
    candidates = index.by_family.get(rest) or index.by_form.get(rest)
    if not candidates:
        raise _unknown(name, index)
    if size is None:
        return _pick(candidates, index)
    sized = tuple(gpu for gpu in candidates if index.nominal_gb[gpu.name] == size)
    if sized:
        return _pick(sized, index)
    chip = candidates[0]
    if chip.vendor == "apple" and len(candidates) == 1:
        most = index.nominal_gb[chip.name]
        if size > most:
            raise _unknown(name, index, (chip.name,), f"{_chip(chip)} comes with at most {_size_text(str(most))}GB.")
        return GPU(
            name=f"{_chip(chip)} {_size_text(str(size))}GB",
            vendor="apple",
            kind="apple",
            memory_bytes=int(size * GiB),
            memory_source="nominal",
            aliases=(),
            bandwidth_gb_s=None,
            unified=True,
        )
    offered = sorted({index.nominal_gb[gpu.name] for gpu in candidates})
    listed = ", ".join(f"{_size_text(str(gb))}GB" for gb in offered)
    raise _unknown(name, index, tuple(gpu.name for gpu in candidates), f"It comes with {listed}.")


def _pick(candidates: tuple[GPU, ...], index: _Index) -> GPU:
    """The family default where it is among ``candidates``, else the one with the most memory."""
    for gpu in candidates:
        if index.default.get(index.family_of[gpu.name]) is gpu:
            return gpu
    return max(candidates, key=lambda gpu: gpu.memory_bytes)


def _chip(gpu: GPU) -> str:
    """``"Apple M3 Max"`` from ``"Apple M3 Max 128GB"``."""
    return gpu.name.rsplit(" ", 1)[0]


def _closest_variant(gpu: GPU, total_bytes: int) -> GPU:
    """Among the catalog entries of ``gpu``'s family, the one whose memory is closest to a measured total."""
    _, index = _load()
    family = index.family_of.get(gpu.name)
    if family is None:
        return gpu
    return min(index.by_family[family], key=lambda g: abs(g.memory_bytes - total_bytes))


def _guess_vendor(name: str) -> str:
    lowered = name.lower()
    if any(word in lowered for word in ("amd", "instinct", "radeon")):
        return "amd"
    if "intel" in lowered or "arc" in lowered:
        return "intel"
    if "apple" in lowered:
        return "apple"
    return "nvidia"


# -------------------------------------------------------------------------------------------------- detection


def _import(name: str) -> Any:
    """The module, or None when it is missing or fails to import."""
    try:
        return importlib.import_module(name)
    except Exception:
        return None


def _detect_torch_cuda() -> tuple[DetectedGPU, ...]:
    torch = _import("torch")
    if torch is None or not torch.cuda.is_available():
        return ()
    found: list[DetectedGPU] = []
    for i in range(int(torch.cuda.device_count())):
        props = torch.cuda.get_device_properties(i)
        free: int | None
        try:
            free = int(torch.cuda.mem_get_info(i)[0])
        except Exception:
            free = None
        found.append(
            DetectedGPU(
                index=i, name=str(props.name), total_bytes=int(props.total_memory), free_bytes=free, source="torch"
            )
        )
    return tuple(found)


def _detect_nvml() -> tuple[DetectedGPU, ...]:
    pynvml = _import("pynvml")
    if pynvml is None:
        return ()
    pynvml.nvmlInit()
    try:
        found: list[DetectedGPU] = []
        for i in range(int(pynvml.nvmlDeviceGetCount())):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            found.append(
                DetectedGPU(
                    index=i,
                    name=name.decode() if isinstance(name, bytes) else str(name),
                    total_bytes=int(memory.total),
                    free_bytes=int(memory.free),
                    source="nvml",
                )
            )
        return tuple(found)
    finally:
        pynvml.nvmlShutdown()


def _sysctl(key: str) -> str | None:
    try:
        done = subprocess.run(["sysctl", "-n", key], capture_output=True, text=True, timeout=5, check=True)
    except Exception:
        return None
    return done.stdout.strip() or None


def _detect_mps() -> tuple[DetectedGPU, ...]:
    torch = _import("torch")
    mps_backend = getattr(getattr(torch, "backends", None), "mps", None)
    if mps_backend is None or not mps_backend.is_available():
        return ()
    recommended = int(torch.mps.recommended_max_memory())
    try:
        allocated = int(torch.mps.driver_allocated_memory())
    except Exception:
        allocated = 0
    memsize = _sysctl("hw.memsize")
    total = int(memsize) if memsize and memsize.isdigit() else _ram()[0]
    name = _sysctl("machdep.cpu.brand_string") or "Apple GPU (MPS)"
    return (
        DetectedGPU(
            index=0,
            name=name,
            total_bytes=total,
            free_bytes=max(recommended - allocated, 0),
            source="mps",
            wired_limit_bytes=recommended,
        ),
    )


def _sysconf(name: str) -> int | None:
    try:
        value = os.sysconf(name)
    except (AttributeError, ValueError, OSError):
        return None
    return value if value > 0 else None


def _ram() -> tuple[int, int | None]:
    """(total, free) bytes of system RAM; total 0 when it cannot be read."""
    page = _sysconf("SC_PAGE_SIZE")
    pages = _sysconf("SC_PHYS_PAGES")
    if page and pages:
        available = _sysconf("SC_AVPHYS_PAGES")
        return page * pages, page * available if available else None
    if sys.platform == "win32":
        return _windows_ram()
    return 0, None


def _windows_ram() -> tuple[int, int | None]:
    import ctypes

    class _MemoryStatus(ctypes.Structure):
        _fields_ = [
            ("dwLength", ctypes.c_ulong),
            ("dwMemoryLoad", ctypes.c_ulong),
            ("ullTotalPhys", ctypes.c_ulonglong),
            ("ullAvailPhys", ctypes.c_ulonglong),
            ("ullTotalPageFile", ctypes.c_ulonglong),
            ("ullAvailPageFile", ctypes.c_ulonglong),
            ("ullTotalVirtual", ctypes.c_ulonglong),
            ("ullAvailVirtual", ctypes.c_ulonglong),
            ("ullAvailExtendedVirtual", ctypes.c_ulonglong),
        ]

    status = _MemoryStatus()
    status.dwLength = ctypes.sizeof(_MemoryStatus)
    kernel32: Any = getattr(ctypes, "windll").kernel32  # noqa: B009 - windll exists on Windows only
    if not kernel32.GlobalMemoryStatusEx(ctypes.byref(status)):
        return 0, None
    return int(status.ullTotalPhys), int(status.ullAvailPhys)


def _detect_cpu() -> tuple[DetectedGPU, ...]:
    total, free = _ram()
    if total <= 0:
        return ()
    return (DetectedGPU(index=0, name="CPU (system RAM)", total_bytes=total, free_bytes=free, source="cpu"),)


def detect_gpus() -> tuple[DetectedGPU, ...]:
    """The accelerators of this machine, from the first source that finds any.

    Order: torch CUDA/ROCm (``get_device_properties`` total, ``mem_get_info`` free) when torch imports and
    ``torch.cuda.is_available()``; NVML through ``pynvml`` (nvidia-ml-py); Apple MPS (RAM from ``sysctl
    hw.memsize``, ``torch.mps.recommended_max_memory()`` as the wired limit); else system RAM as one ``"cpu"``
    device (``os.sysconf``: SC_PAGE_SIZE x SC_PHYS_PAGES, free from SC_AVPHYS_PAGES). A missing or failing
    library only skips its source; this never raises.
    """
    for probe in (_detect_torch_cuda, _detect_nvml, _detect_mps, _detect_cpu):
        try:
            found = probe()
        except Exception:
            continue
        if found:
            return found
    return ()
