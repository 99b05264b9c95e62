"""Will this model, at this context and concurrency, fit this GPU? Offline, from the built-in catalogs.

python examples/plan_gpu.py
"""

from __future__ import annotations

import contextkeeper as ck

model = ck.ModelSpec.from_config("llama-3.1-8b")  # or a config.json path / folder, a hub id, a dict
print(f"{model.name}: {model.kinds()}, up to {model.max_context:,} tokens")

# The textbook KV formula, and what each runtime really holds for 4 sequences of 30,000 tokens.
for runtime in ("transformers", "vllm", "sglang", "llama.cpp"):
    report = model.kv(30_000, 4, runtime=runtime)
    print(f"  {runtime:<12} {report.bytes / 2**30:6.2f} GiB of KV ({report.kv_dtype})")
print(f"  vllm fp8     {model.kv_bytes(30_000, 4, runtime='vllm', kv_dtype='fp8') / 2**30:6.2f} GiB")

result = ck.plan(model, "RTX 4090", context=32_768, concurrency=4, runtime="vllm")
b = result.breakdown
print(
    f"\nRTX 4090, 4 × 32K on vLLM: {'fits' if result.fits else 'does not fit'} "
    f"({b.total / 2**30:.1f} of {b.capacity / 2**30:.1f} GiB); at most {result.max_context:,} tokens each"
)
for advice in result.advice[:3]:
    print(f"  [{advice.cost}] {advice.setting}: {advice.effect}")

cheapest = ck.recommend(model, context=32_768, concurrency=4, runtime="vllm")[:3]
print("\ncheapest GPU options for 4 × 32K:")
for option in cheapest:
    print(f"  {option.count} × {option.gpu} ({option.total_memory / 2**30:.0f} GiB)")
