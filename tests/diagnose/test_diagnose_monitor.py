"""MemoryMonitor: a planted leak is found, a steady workload is not; fragmentation and other processes."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from contextkeeper._exceptions import ConfigurationError
from contextkeeper.diagnose import MemoryMonitor, ProcessUse, Reading, host_memory
from contextkeeper.diagnose.monitor import rss_bytes

MiB = 2**20
GiB = 2**30


@dataclass
class FakeSource:
    """A scripted allocator: each read returns the next reading (the last one repeats)."""

    readings: list[Reading]
    processes: tuple[ProcessUse, ...] = ()
    name: str = "torch"
    reads: int = field(default=0)

    def read(self) -> Reading:
        reading = self.readings[min(self.reads, len(self.readings) - 1)]
        self.reads += 1
        return reading

    def others(self) -> tuple[ProcessUse, ...]:
        return self.processes


def test_a_planted_leak_is_detected_with_a_probe() -> None:
    kept: list[bytes] = []
    with MemoryMonitor(source="cpu", probe=lambda: sum(len(b) for b in kept)) as mon:
        for i in range(6):
            kept.append(bytes(4 * MiB))  # the "request" keeps its output around
            mon.request_done(f"request {i}")
    report = mon.report()
    (leak,) = report.findings
    assert leak.kind == "leak"
    assert leak.bytes == 16 * MiB  # 5 counted requests after one warm-up: 4 steps of 4 MiB
    assert report.growth_per_request == pytest.approx(4 * MiB)
    assert "torch.inference_mode()" in leak.advice[0]
    assert report.requests == 6
    assert [s.kind for s in report.samples] == ["start", *["request"] * 6, "end"]
    json.dumps(report.to_dict())


def test_a_planted_tensor_leak_shows_in_the_resident_set() -> None:
    pytest.importorskip("torch")
    if rss_bytes() is None:
        pytest.skip("no resident-set reading on this platform")
    # In a fresh process: after a long test session the allocator may hand back pages that are already resident,
    # and the resident set would then not show the leak it is meant to show.
    script = """
import torch
from contextkeeper.diagnose import MemoryMonitor
MiB = 1 << 20
kept = []
with MemoryMonitor(source="cpu") as mon:
    for _ in range(5):
        scratch = torch.ones(10 * MiB)  # 40 MiB used and freed: steady
        kept.append(scratch[: 9 * MiB].clone())  # 36 MiB kept per request: the leak (mmapped, so in RSS)
        del scratch
        mon.request_done()
print([f.kind for f in mon.report().findings])
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "['leak']"


def test_a_steady_workload_is_not_flagged() -> None:
    torch = pytest.importorskip("torch")
    with MemoryMonitor(source="cpu") as mon:
        for _ in range(6):
            x = torch.ones(10 * MiB)
            y = (x * 2).sum()
            del x, y
            mon.request_done()
    report = mon.report()
    assert report.findings == ()
    assert report.ok
    assert "no findings" in report.table()


def test_growth_that_stops_is_not_a_leak() -> None:
    # a cache filling during the first requests, then flat
    values = [0, 10, 50, 90, 100, 100, 100, 100]
    with MemoryMonitor(source=FakeSource([Reading(allocated=v * MiB) for v in values])) as mon:
        for _ in range(len(values) - 2):
            mon.request_done()
    assert mon.report().findings == ()


def test_small_growth_below_the_threshold_is_not_a_leak() -> None:
    source = FakeSource([Reading(allocated=GiB + i * 4096) for i in range(10)])
    with MemoryMonitor(source=source) as mon:
        for _ in range(8):
            mon.request_done()
    assert mon.report().findings == ()


def test_fragmentation_reserved_far_above_allocated() -> None:
    source = FakeSource([Reading(allocated=2 * GiB, reserved=6 * GiB)])
    with MemoryMonitor(source=source) as mon:
        mon.request_done()
        mon.sample("after the long prompt")
    (finding,) = mon.report().findings
    assert finding.kind == "fragmentation"
    assert finding.bytes == 4 * GiB
    assert "3.0× allocated" in finding.message
    assert any("expandable_segments:True" in advice for advice in finding.advice)


def test_reserved_close_to_allocated_is_fine() -> None:
    source = FakeSource([Reading(allocated=20 * GiB, reserved=21 * GiB)])
    with MemoryMonitor(source=source) as mon:
        mon.request_done()
    assert mon.report().findings == ()


def test_other_processes_holding_the_gpu() -> None:
    source = FakeSource(
        [Reading(allocated=GiB, reserved=GiB)],
        processes=(ProcessUse(pid=4242, used_bytes=3 * GiB), ProcessUse(pid=77, used_bytes=None)),
    )
    with MemoryMonitor(source=source) as mon:
        mon.request_done()
    (finding,) = mon.report().findings
    assert finding.kind == "other-processes"
    assert "4242 (3.00 GiB)" in finding.message
    assert finding.bytes == 3 * GiB


def test_request_done_is_cheap_and_bounded() -> None:
    source = FakeSource([Reading(allocated=1)])
    mon = MemoryMonitor(source=source, max_samples=50)
    with mon:
        for _ in range(500):
            mon.request_done()
    assert len(mon.samples) == 50
    assert mon.samples[0].kind == "start"  # the baseline is kept
    assert mon.report().requests == 500


def test_unknown_source() -> None:
    with pytest.raises(ConfigurationError, match="unknown monitor source"):
        MemoryMonitor(source="tpu")


def test_host_memory_reads_this_machine() -> None:
    host = host_memory()
    assert host.total_bytes > 0
    if host.available_bytes is not None:
        assert 0 < host.available_bytes <= host.total_bytes


@pytest.mark.gpu
def test_a_planted_leak_on_cuda() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    kept = []
    with MemoryMonitor(source="torch") as mon:
        for _ in range(5):
            kept.append(torch.ones(4 * MiB, device="cuda"))
            mon.request_done()
    assert [f.kind for f in mon.report().findings if f.kind == "leak"] == ["leak"]
    del kept
    torch.cuda.empty_cache()
    with MemoryMonitor(source="torch") as mon:
        for _ in range(5):
            x = torch.ones(4 * MiB, device="cuda")
            del x
            mon.request_done()
    assert [f.kind for f in mon.report().findings if f.kind == "leak"] == []
