"""Diagnostics on CPU: measure a tiny model's KV cache, ask the doctor about a GPU, and catch a planted leak.

    python examples/diagnose_profile.py

Runs offline in a few seconds: the model is built with random weights from examples/tiny_llama/config.json
(the memory of a model depends on its shapes and dtype, not on its weights).
"""

from __future__ import annotations

from pathlib import Path

import torch

from contextkeeper.diagnose import MemoryMonitor, diagnose, profile

CONFIG = Path(__file__).resolve().parent / "tiny_llama"

# 1. The VRAM test sequence, on CPU: cache bytes are the cache tensors' own storage, next to the prediction.
report = profile(CONFIG, device="cpu", lengths=(64, 128), new_tokens=(4,), batches=(1, 2))
print(report.table())
print(f"measured / predicted KV bytes per token: {report.ratio:.4f}; every step exact: {report.exact}\n")

# 2. The doctor, with facts: which pool overflows for 4 × 32K tokens of Llama 3.1 8B on a 24 GB card?
result = diagnose("concurrent", model="llama-3.1-8b", gpu="RTX 4090", context=32768, concurrency=4, runtime="vllm")
top = result.causes[0]
print(f"doctor: {top.cause}\n  {top.evidence}\n  first fix: {top.fixes[0].action} ({top.fixes[0].setting})\n")

# 3. The monitor: a "request" that keeps its output alive is a leak.
kept = []
with MemoryMonitor(source="cpu", probe=lambda: sum(t.nbytes for t in kept)) as monitor:
    for _ in range(5):
        kept.append(torch.ones(1 << 20))  # 4 MiB kept per request
        monitor.request_done()
for finding in monitor.report().findings:
    print(f"monitor: [{finding.kind}] {finding.message}")
