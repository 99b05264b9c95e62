"""The GPU catalog, forgiving name lookup, and live detection (offline, no GPU needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib import resources

import pytest

from contextkeeper._exceptions import ConfigurationError, UnknownGPU
from contextkeeper.memory.gpus import (
    GPU,
    DetectedGPU,
    apple_default_wired_fraction,
    detect_gpus,
    find_gpu,
    gpu_catalog,
    normalize_gpu_name,
)

GiB = 2**30
MiB = 2**20


@pytest.mark.parametrize(
    ("query", "canonical"),
    [
        ("RTX 4090", "NVIDIA GeForce RTX 4090 24GB"),
        ("4090", "NVIDIA GeForce RTX 4090 24GB"),
        ("rtx4090", "NVIDIA GeForce RTX 4090 24GB"),
        ("NVIDIA GeForce RTX 4090", "NVIDIA GeForce RTX 4090 24GB"),
        ("geforce-rtx-4090 24gb", "NVIDIA GeForce RTX 4090 24GB"),
        ("H100 80GB", "NVIDIA H100 SXM 80GB"),
        ("H100-SXM", "NVIDIA H100 SXM 80GB"),
        ("h100", "NVIDIA H100 SXM 80GB"),
        ("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM 80GB"),
        ("H100 PCIe", "NVIDIA H100 PCIe 80GB"),
        ("H100 NVL", "NVIDIA H100 NVL 94GB"),
        ("H200", "NVIDIA H200 141GB"),
        ("A100 40GB", "NVIDIA A100 SXM 40GB"),
        ("a100-80g", "NVIDIA A100 SXM 80GB"),
        ("A100 80 GiB", "NVIDIA A100 SXM 80GB"),
        ("NVIDIA A100-PCIE-40GB", "NVIDIA A100 PCIe 40GB"),
        ("NVIDIA A100 80GB PCIe", "NVIDIA A100 PCIe 80GB"),
        ("M2 Ultra 192GB", "Apple M2 Ultra 192GB"),
        ("m3-ultra", "Apple M3 Ultra 512GB"),
        ("M4 Max 128GB", "Apple M4 Max 128GB"),
        ("MI300X", "AMD Instinct MI300X 192GB"),
        ("AMD Instinct MI250X/MI250", "AMD Instinct MI250X 64GB per GCD"),
        ("L40S", "NVIDIA L40S 48GB"),
        ("A10G", "NVIDIA A10G 24GB"),
        ("A10", "NVIDIA A10 24GB"),
        ("T4", "NVIDIA T4 16GB"),
        ("Tesla T4", "NVIDIA T4 16GB"),
        ("3090", "NVIDIA GeForce RTX 3090 24GB"),
        ("3090 Ti", "NVIDIA GeForce RTX 3090 Ti 24GB"),
        ("RTX 6000 Ada", "NVIDIA RTX 6000 Ada 48GB"),
        ("NVIDIA RTX 6000 Ada Generation", "NVIDIA RTX 6000 Ada 48GB"),
        ("RTX A6000", "NVIDIA RTX A6000 48GB"),
        ("rtx pro 6000", "NVIDIA RTX PRO 6000 Blackwell 96GB"),
        ("Tesla V100-SXM2-16GB", "NVIDIA V100 16GB"),
        ("3080 10GB", "NVIDIA GeForce RTX 3080 10GB"),
        ("4060 Ti 8GB", "NVIDIA GeForce RTX 4060 Ti 8GB"),
        ("4070 Ti Super", "NVIDIA GeForce RTX 4070 Ti SUPER 16GB"),
        ("NVIDIA GH200 480GB", "NVIDIA GH200 96GB"),
        ("Intel(R) Arc(TM) A770 Graphics", "Intel Arc A770 16GB"),
    ],
)
def test_forgiving_names(query: str, canonical: str) -> None:
    assert find_gpu(query).name == canonical


@pytest.mark.parametrize(
    ("family", "default"),
    [
        ("A100", "NVIDIA A100 SXM 80GB"),
        ("H100", "NVIDIA H100 SXM 80GB"),
        ("V100", "NVIDIA V100 32GB"),
        ("3080", "NVIDIA GeForce RTX 3080 12GB"),
        ("4060 Ti", "NVIDIA GeForce RTX 4060 Ti 16GB"),
        ("GH200", "NVIDIA GH200 144GB"),
        ("A100 PCIe", "NVIDIA A100 PCIe 80GB"),
        ("M3 Max", "Apple M3 Max 128GB"),
    ],
)
def test_ambiguous_names_take_the_larger_variant(family: str, default: str) -> None:
    assert find_gpu(family).name == default


def test_reported_memory_is_what_cuda_reports() -> None:
    h100 = find_gpu("H100")
    assert h100.memory_source == "reported"
    assert h100.memory_bytes == 85017755648  # deviceQuery: 81079 MBytes
    assert round(h100.memory_gib, 1) == 79.2
    assert find_gpu("H200").memory_bytes == 143156 * MiB
    nominal = find_gpu("5080")
    assert (nominal.memory_source, nominal.memory_bytes) == ("nominal", 16 * GiB)


@pytest.mark.parametrize(("query", "gib"), [("48GB", 48), ("48 GiB", 48), ("24g", 24), ("23.5GB", 23.5)])
def test_a_bare_size_is_a_custom_device(query: str, gib: float) -> None:
    gpu = find_gpu(query)
    assert gpu.kind == "custom"
    assert gpu.memory_source == "nominal"
    assert gpu.memory_bytes == int(gib * GiB)


def test_apple_chip_with_a_smaller_ram_size() -> None:
    gpu = find_gpu("M3 Max 64GB")
    assert (gpu.name, gpu.kind, gpu.vendor, gpu.unified) == ("Apple M3 Max 64GB", "apple", "apple", True)
    assert gpu.memory_bytes == 64 * GiB
    with pytest.raises(UnknownGPU, match="at most 192GB"):
        find_gpu("M2 Ultra 256GB")


def test_unknown_names_suggest_the_closest() -> None:
    with pytest.raises(UnknownGPU) as caught:
        find_gpu("RTX 4095")
    error = caught.value
    assert isinstance(error, ConfigurationError)
    assert "NVIDIA GeForce RTX 4090 24GB" in error.matches
    text = str(error)
    assert "'RTX 4095'" in text
    assert "--gpu 48GB" in text
    for name in error.matches:
        assert name in text

    with pytest.raises(UnknownGPU) as caught:
        find_gpu("H101")
    assert "NVIDIA H100 SXM 80GB" in caught.value.matches


def test_a_size_a_family_lacks_lists_the_family() -> None:
    with pytest.raises(UnknownGPU) as caught:
        find_gpu("H100 40GB")
    assert set(caught.value.matches) == {"NVIDIA H100 SXM 80GB", "NVIDIA H100 PCIe 80GB"}
    assert "80GB" in str(caught.value)


@pytest.mark.parametrize("query", ["banana", "", "0GB", "   "])
def test_nonsense_raises(query: str) -> None:
    with pytest.raises(UnknownGPU):
        find_gpu(query)


def test_catalog_invariants() -> None:
    catalog = gpu_catalog()
    assert catalog is gpu_catalog()  # loaded once
    assert len(catalog) >= 50
    names = [gpu.name for gpu in catalog]
    assert len(names) == len(set(names))
    owner: dict[str, str] = {}
    for gpu in catalog:
        assert gpu.vendor in {"nvidia", "amd", "apple", "intel"}
        assert gpu.kind in {"consumer", "workstation", "datacenter", "apple"}
        assert gpu.memory_source in {"reported", "nominal"}
        assert gpu.memory_bytes > 0
        assert gpu.bandwidth_gb_s is None or gpu.bandwidth_gb_s > 0
        assert gpu.unified == (gpu.vendor == "apple")
        assert find_gpu(gpu.name) is gpu
        for alias in (gpu.name, *gpu.aliases):
            key = normalize_gpu_name(alias)
            assert owner.setdefault(key, gpu.name) == gpu.name, f"{alias!r} also names {owner[key]!r}"
            assert find_gpu(alias) is gpu
    entries = json.loads(resources.files("contextkeeper.memory").joinpath("data/gpus.json").read_text("utf-8"))
    for entry, gpu in zip(entries["gpus"], catalog, strict=True):
        nominal = entry["nominal_gb"] * GiB
        if gpu.memory_source == "nominal":
            assert gpu.memory_bytes == nominal
        else:  # CUDA reports a little less than the nominal size, never more, and not much less
            assert 0.9 * nominal < gpu.memory_bytes < nominal, gpu.name
            assert entry["evidence"]


def test_usable_bytes() -> None:
    h100 = find_gpu("H100")
    assert h100.usable_bytes == h100.memory_bytes
    m2 = find_gpu("M2 Ultra")
    assert m2.usable_bytes == int(192 * GiB * 3 / 4)
    small = find_gpu("M1 16GB")
    assert small.usable_bytes == int(16 * GiB * 2 / 3)
    assert apple_default_wired_fraction(36 * GiB) == 2 / 3
    capped = GPU(
        name="x", vendor="apple", kind="apple", memory_bytes=64 * GiB, memory_source="reported", aliases=(),
        unified=True, wired_limit_bytes=48 * GiB,
    )  # fmt: skip
    assert capped.usable_bytes == 48 * GiB


def _sysconf_ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_detect_finds_at_least_one_device() -> None:
    found = detect_gpus()
    assert found
    assert [d.index for d in found] == list(range(len(found)))
    for device in found:
        assert device.source in {"torch", "nvml", "mps", "cpu"}
        assert device.total_bytes > 0
        assert device.free_bytes is None or 0 <= device.free_bytes <= device.total_bytes
        assert device.as_gpu().memory_bytes == device.total_bytes
    if found[0].source == "cpu":
        assert found[0].total_bytes == _sysconf_ram()


def test_detect_without_torch_or_nvml_reports_system_ram(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now raises ImportError
    monkeypatch.setitem(sys.modules, "pynvml", None)
    (cpu,) = detect_gpus()
    assert (cpu.source, cpu.index) == ("cpu", 0)
    assert cpu.total_bytes == _sysconf_ram()
    assert cpu.free_bytes is not None
    assert 0 < cpu.free_bytes <= cpu.total_bytes
    gpu = cpu.as_gpu()
    assert (gpu.kind, gpu.vendor, gpu.unified, gpu.memory_bytes) == ("cpu", "cpu", True, cpu.total_bytes)


def test_import_and_detection_need_no_torch() -> None:
    script = textwrap.dedent(
        """
        import json, sys
        sys.modules["torch"] = None
        sys.modules["pynvml"] = None
        import contextkeeper
        from contextkeeper.memory.gpus import detect_gpus
        found = detect_gpus()
        print(json.dumps([[d.source, d.total_bytes] for d in found]))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60)
    assert json.loads(done.stdout) == [["cpu", _sysconf_ram()]]

    lazy = "import sys, contextkeeper.memory.gpus; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", lazy], capture_output=True, text=True, check=True, timeout=60)
    assert done.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("name", "total", "canonical"),
    [
        ("NVIDIA GeForce RTX 4060 Ti", 7_900 * MiB, "NVIDIA GeForce RTX 4060 Ti 8GB"),
        ("NVIDIA GeForce RTX 4060 Ti", 15_948 * MiB, "NVIDIA GeForce RTX 4060 Ti 16GB"),
        ("NVIDIA A100-SXM4-80GB", 81_158 * MiB, "NVIDIA A100 SXM 80GB"),
    ],
)
def test_detected_device_maps_to_its_catalog_variant(name: str, total: int, canonical: str) -> None:
    device = DetectedGPU(index=0, name=name, total_bytes=total, free_bytes=None, source="torch")
    gpu = device.as_gpu()
    assert gpu.name == canonical
    assert (gpu.memory_bytes, gpu.memory_source) == (total, "reported")


def test_uncatalogued_detected_device_keeps_its_name() -> None:
    device = DetectedGPU(index=1, name="AMD Radeon Pro W7900", total_bytes=48 * GiB, free_bytes=None, source="torch")
    gpu = device.as_gpu()
    assert (gpu.name, gpu.vendor, gpu.kind, gpu.memory_bytes) == ("AMD Radeon Pro W7900", "amd", "custom", 48 * GiB)


def test_mps_device_uses_the_wired_limit() -> None:
    device = DetectedGPU(
        index=0, name="Apple M2 Max", total_bytes=64 * GiB, free_bytes=None, source="mps", wired_limit_bytes=48 * GiB
    )
    gpu = device.as_gpu()
    assert (gpu.name, gpu.kind, gpu.unified) == ("Apple M2 Max 64GB", "apple", True)
    assert gpu.usable_bytes == 48 * GiB
