"""The VRAM test sequence on a GPU: random-weight models built from real architectures' configs.

For each model: the baseline after load, then one prefill per prompt length and batch size, recording the KV
cache's real tensor bytes, the memory still allocated afterwards and the peak (``torch.cuda.max_memory_allocated``)
above the baseline, next to the textbook prediction ``2 x layers x kv_heads x head_dim x tokens x batch x bytes``.
Writes JSON for the memory model to be checked against (CI has no GPU; this is ground truth from a real one).
Then runs the same sequence through ``contextkeeper.diagnose.profile`` (under "profiles" in the JSON).

    python benchmarks/gpu/vram_sequence.py OUT.json
"""

from __future__ import annotations

import json
import platform
import sys
import time
from typing import Any

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

# Architecture facts of real checkpoints (config.json values), so shapes and layer kinds are the real ones.
MODELS: dict[str, dict[str, Any]] = {
    "Qwen2.5-0.5B": {
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
        "use_sliding_window": False,
    },
    "Llama-3.2-1B": {
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "rope_theta": 500000.0,
    },
    "Qwen3-0.6B": {
        "model_type": "qwen3",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
    },
    "Gemma-2-2B": {
        "model_type": "gemma2",
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "vocab_size": 256000,
        "max_position_embeddings": 8192,
        "sliding_window": 4096,
        "query_pre_attn_scalar": 256,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    },
}
LENGTHS = (512, 2048, 8192, 16384)
BATCHES = (1, 4)


def cache_tensor_bytes(cache: Any) -> tuple[int, list[int]]:
    """Bytes of every tensor the cache object holds, found by walking its attributes (any cache class)."""
    seen: set[int] = set()
    per_layer: list[int] = []

    def walk(obj: Any, depth: int) -> int:
        if isinstance(obj, torch.Tensor):
            if obj.data_ptr() in seen or obj.device.type != "cuda":
                return 0
            seen.add(obj.data_ptr())
            return obj.numel() * obj.element_size()
        if depth > 4:
            return 0
        if isinstance(obj, (list, tuple)):
            return sum(walk(x, depth + 1) for x in obj)
        if isinstance(obj, dict):
            return sum(walk(x, depth + 1) for x in obj.values())
        if hasattr(obj, "__dict__"):
            return sum(walk(x, depth + 1) for x in vars(obj).values())
        return 0

    layers = getattr(cache, "layers", None)
    if layers is not None:
        per_layer = [walk(layer, 0) for layer in layers]
        return sum(per_layer), per_layer
    return walk(cache, 0), per_layer


def run_model(name: str, facts: dict[str, Any], attn: str) -> dict[str, Any]:
    config = AutoConfig.for_model(**facts)
    config._attn_implementation = attn
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before_load = torch.cuda.memory_allocated()
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.eval()
    weights = torch.cuda.memory_allocated() - before_load
    params = sum(p.numel() for p in model.parameters())
    text = config.get_text_config()
    layers = text.num_hidden_layers
    kv_heads = text.num_key_value_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    rows = []
    for batch in BATCHES:
        for tokens in LENGTHS:
            if attn == "eager" and tokens > 8192:
                continue
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            baseline = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            ids = torch.randint(0, text.vocab_size, (batch, tokens), device="cuda")
            started = time.perf_counter()
            try:
                with torch.inference_mode():
                    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
                torch.cuda.synchronize()
            except torch.cuda.OutOfMemoryError as exc:
                rows.append({"batch": batch, "tokens": tokens, "oom": str(exc)[:200]})
                continue
            cache = out.past_key_values
            kv_bytes, per_layer = cache_tensor_bytes(cache)
            row = {
                "batch": batch,
                "tokens": tokens,
                "cache_class": type(cache).__name__,
                "kv_cache_bytes": kv_bytes,
                "kv_bytes_per_layer_distinct": sorted(set(per_layer)),
                "allocated_after_bytes": torch.cuda.memory_allocated() - baseline,
                "peak_above_baseline_bytes": torch.cuda.max_memory_allocated() - baseline,
                "reserved_bytes": torch.cuda.memory_reserved(),
                "naive_kv_prediction_bytes": 2 * layers * kv_heads * head_dim * tokens * batch * 2,
                "prefill_s": round(time.perf_counter() - started, 4),
            }
            rows.append(row)
            del out, cache, ids
    del model
    torch.cuda.empty_cache()
    return {
        "model": name,
        "attn_implementation": attn,
        "config": facts,
        "layer_types": list(getattr(text, "layer_types", None) or []),
        "parameters": params,
        "weights_allocated_bytes": weights,
        "layers": layers,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "rows": rows,
    }


def main() -> int:
    out_path = sys.argv[1] if len(sys.argv) > 1 else "vram_sequence.json"
    results: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(0),
        "total_memory_bytes": torch.cuda.get_device_properties(0).total_memory,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "runs": [],
    }
    for name, facts in MODELS.items():
        for attn in ("sdpa", "eager"):
            started = time.perf_counter()
            try:
                run = run_model(name, facts, attn)
            except Exception as exc:  # one architecture failing must not lose the others' measurements
                run = {"model": name, "attn_implementation": attn, "error": f"{type(exc).__name__}: {exc}"[:500]}
            run["wall_s"] = round(time.perf_counter() - started, 1)
            results["runs"].append(run)
            print(json.dumps({k: v for k, v in run.items() if k != "config"})[:1500], flush=True)
            with open(out_path, "w") as handle:
                json.dump(results, handle, indent=1)
    # The same sequence through contextkeeper's own profiler (cache storage vs prediction, allocator peaks,
    # jumps), so the library's GPU path is checked on real hardware; a failure here keeps the runs above.
    results["profiles"] = []
    for name, facts in MODELS.items():
        started = time.perf_counter()
        try:
            from contextkeeper.diagnose import profile

            report = profile(
                {**facts, "torch_dtype": "bfloat16"},
                device="cuda",
                lengths=LENGTHS,
                new_tokens=(32, 128),
                batches=(1, 2, 4, 8),
                batch_tokens=2048,
            )
            entry: dict[str, Any] = {"model": name, **report.to_dict()}
            print(report.table(), flush=True)
        except Exception as exc:
            entry = {"model": name, "error": f"{type(exc).__name__}: {exc}"[:500]}
        entry["wall_s"] = round(time.perf_counter() - started, 1)
        results["profiles"].append(entry)
        with open(out_path, "w") as handle:
            json.dump(results, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
