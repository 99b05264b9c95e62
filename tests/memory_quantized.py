"""Measure the bytes transformers' quantized KV cache (``QuantizedCache``) really holds, for a tiny random Llama.

Test-support module (not collected by pytest). ``measure_quantized`` runs a short greedy ``generate`` (or one
forward) on CPU with ``cache_implementation="quantized"`` and walks the returned cache generically: every tensor
reachable from a cache layer is counted, and a tensor subclass (optimum-quanto's ``WeightQBitsTensor`` and the
``PackedTensor`` inside it) is opened through ``__tensor_flatten__`` down to the plain tensors that own storage.
Storages are counted once each, at their full size.

``expected_quantized_bytes`` is the closed form those measurements follow for the quanto backend (see the module
``__main__``, which prints measured against expected over a grid):
``python tests/memory_quantized.py`` (``--quick`` for a smaller grid, ``--hqq`` for the hqq backend).

The quanto backend needs ``optimum-quanto`` (>= 0.2.5); without it, the functions that run a model raise an
``ImportError`` that says so (tests should ``pytest.importorskip("optimum.quanto")``). On first use quanto JIT-builds
a small C++ extension (``quanto_cpp``, for unpacking on CPU) into its own package directory, which takes about a
minute and needs a C++ compiler and ``ninja``.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
from dataclasses import dataclass
from typing import Any

__all__ = [
    "TINY_LLAMA",
    "QuantizedMeasure",
    "QuantizedRecord",
    "expected_quantized_bytes",
    "measure_quantized",
    "quantized_cache",
    "split_tokens",
    "walk_quantized_cache",
]

TINY_LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 128,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 512,
}


@dataclass(frozen=True)
class QuantizedRecord:
    """One plain tensor found in the cache: ``layer`` -1 is outside ``cache.layers``; ``path`` is its attribute path
    (``_quantized_keys._data._data`` is the packed uint8 payload of the keys). ``nbytes`` is its storage's size, or 0
    when that storage was already counted."""

    layer: int
    path: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int


@dataclass(frozen=True)
class QuantizedMeasure:
    """Everything the cache holds after the run, plus where its tokens sit (from layer 0)."""

    total_bytes: int
    records: tuple[QuantizedRecord, ...]
    cache_class: str
    layer_class: str
    seq_length: int
    residual_tokens: int

    def part_bytes(self, layer: int, prefix: str) -> int:
        """Bytes of layer ``layer`` under attribute path ``prefix`` (e.g. ``"_quantized_keys._scale"``, ``"keys"``)."""
        return sum(
            r.nbytes for r in self.records if r.layer == layer and (r.path == prefix or r.path.startswith(prefix + "."))
        )


def _require_backend(backend: str) -> None:
    """Raise a clear ``ImportError`` when the package behind ``backend`` is missing."""
    package = {"quanto": "optimum.quanto", "hqq": "hqq"}.get(backend)
    if package is None:
        return
    try:
        found = importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a parent package is missing, or a stubbed-out module
        found = False
    if not found:
        pip = {"quanto": "optimum-quanto", "hqq": "hqq"}[backend]
        raise ImportError(
            f"memory_quantized needs {pip} for the {backend} backend of QuantizedCache: pip install {pip}"
        )


@functools.lru_cache(maxsize=4)
def _build(config_json: str, dtype: str) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = json.loads(config_json)
    model_type = fields.pop("model_type")
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(0)
    auto: Any = AutoModelForCausalLM
    return auto.from_config(config, dtype=getattr(torch, dtype)).eval()


def _is_wrapper(t: Any) -> bool:
    """A tensor subclass whose data lives in inner tensors (quanto's QTensor / PackedTensor)."""
    import torch

    return type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__")


def _collect(obj: Any, path: str, out: list[tuple[str, Any]], seen: set[int]) -> None:
    """Append every plain tensor reachable from ``obj`` to ``out``, opening tensor subclasses into inner tensors."""
    import torch

    if isinstance(obj, torch.Tensor):
        if _is_wrapper(obj):
            if id(obj) in seen:
                return
            seen.add(id(obj))
            inner, _meta = getattr(obj, "__tensor_flatten__")()  # noqa: B009 - not typed on torch.Tensor
            for name in inner:
                _collect(getattr(obj, name), f"{path}.{name}", out, seen)
        else:
            out.append((path, obj))
        return
    if obj is None or isinstance(obj, (str, bytes, int, float, bool, type)) or id(obj) in seen:
        return
    seen.add(id(obj))
    sep = "." if path else ""
    if isinstance(obj, dict):
        for key, value in obj.items():
            _collect(value, f"{path}[{key!r}]", out, seen)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            _collect(value, f"{path}[{i}]", out, seen)
    elif (
        type(obj).__module__.startswith(("transformers", "optimum", "hqq"))
        and hasattr(obj, "__dict__")
        and not isinstance(obj, torch.nn.Module)
        and not hasattr(obj, "to_json_string")  # a config, not cache state
    ):
        for key, value in vars(obj).items():
            _collect(value, f"{path}{sep}{key}", out, seen)


def walk_quantized_cache(cache: Any) -> QuantizedMeasure:
    """Account for every storage reachable from ``cache`` (each storage once, at its full size)."""
    groups: list[tuple[int, list[tuple[str, Any]]]] = []
    seen: set[int] = {id(cache)}
    layers = getattr(cache, "layers", None)
    if isinstance(layers, list):
        seen.add(id(layers))
        for i, layer in enumerate(layers):
            found: list[tuple[str, Any]] = []
            _collect(layer, "", found, seen)
            groups.append((i, found))
    rest: list[tuple[str, Any]] = []
    for key, value in vars(cache).items():
        if value is not layers:
            _collect(value, key, rest, seen)
    groups.append((-1, rest))

    counted: set[tuple[str, int]] = set()
    records: list[QuantizedRecord] = []
    for index, found in groups:
        for name, t in found:
            storage = t.untyped_storage()
            key = (str(t.device), storage.data_ptr())
            nbytes = 0
            if storage.nbytes() > 0 and key not in counted:
                counted.add(key)
                nbytes = storage.nbytes()
            records.append(QuantizedRecord(index, name, tuple(t.shape), str(t.dtype).removeprefix("torch."), nbytes))

    first = layers[0] if isinstance(layers, list) and layers else None
    residual = 0
    if first is not None and getattr(first, "keys", None) is not None and first.keys.dim() == 4:
        residual = int(first.keys.shape[-2])
    return QuantizedMeasure(
        total_bytes=sum(r.nbytes for r in records),
        records=tuple(records),
        cache_class=type(cache).__name__,
        layer_class=type(first).__name__,
        seq_length=int(first.get_seq_length()) if first is not None else 0,
        residual_tokens=residual,
    )


def quantized_cache(
    config: dict[str, Any],
    *,
    tokens: int,
    batch: int = 1,
    dtype: str = "float32",
    nbits: int = 4,
    q_group_size: int = 64,
    residual_length: int = 128,
    backend: str = "quanto",
    mode: str = "generate",
    new_tokens: int = 3,
    axis_key: int | None = None,
    axis_value: int | None = None,
) -> Any:
    """Run the tiny model for ``config`` with a quantized cache and return that cache.

    ``mode="generate"``: greedy ``generate(..., cache_implementation="quantized", cache_config=...)`` of exactly
    ``new_tokens`` tokens after a ``tokens``-token prompt; the cache then covers ``tokens + new_tokens - 1``
    positions (the last sampled token is never fed back), the prompt in one update and the rest one per step.
    ``mode="forward"``: one forward of the ``tokens``-token prompt into a ``QuantizedCache`` built by hand.
    ``axis_key`` / ``axis_value`` left ``None`` keep transformers' defaults (0).
    """
    _require_backend(backend)
    if mode not in ("forward", "generate"):
        raise ValueError(f"unknown mode {mode!r}")
    import torch
    from transformers import QuantizedCache

    model = _build(json.dumps(config, sort_keys=True), dtype)
    options: dict[str, Any] = {"nbits": nbits, "q_group_size": q_group_size, "residual_length": residual_length}
    if axis_key is not None:
        options["axis_key"] = axis_key
    if axis_value is not None:
        options["axis_value"] = axis_value
    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    generator = torch.Generator().manual_seed(1234)
    ids = torch.randint(3, vocab, (batch, tokens), generator=generator)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        if mode == "forward":
            cache = QuantizedCache(backend=backend, config=model.config, **options)
            out = model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
        else:
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                use_cache=True,
                return_dict_in_generate=True,
                pad_token_id=0,
                cache_implementation="quantized",
                cache_config={"backend": backend, **options},
            )
    found: Any = getattr(out, "cache", None)
    if found is None:
        found = getattr(out, "past_key_values", None)
    if found is None:
        raise RuntimeError(f"{type(model).__name__} returned no cache")
    return found


def measure_quantized(
    config: dict[str, Any],
    *,
    tokens: int,
    batch: int = 1,
    dtype: str = "float32",
    nbits: int = 4,
    q_group_size: int = 64,
    residual_length: int = 128,
    backend: str = "quanto",
    mode: str = "generate",
    new_tokens: int = 3,
) -> int:
    """Resident bytes of every storage the quantized cache holds after the run (see ``quantized_cache``)."""
    cache = quantized_cache(
        config,
        tokens=tokens,
        batch=batch,
        dtype=dtype,
        nbits=nbits,
        q_group_size=q_group_size,
        residual_length=residual_length,
        backend=backend,
        mode=mode,
        new_tokens=new_tokens,
    )
    return walk_quantized_cache(cache).total_bytes


def split_tokens(prompt: int, decode_steps: int, residual_length: int) -> tuple[int, int]:
    """(quantized, residual) tokens per layer after a ``prompt``-token prefill and ``decode_steps`` one-token steps.

    The first update (the whole prompt) is always quantized, whatever its length; each later update is appended to
    the full-precision residual unless ``residual + new >= residual_length``, in which case everything (old
    quantized states dequantized, residual, new) is re-quantized and the residual emptied.
    """
    if prompt <= 0:
        return 0, 0
    residual = decode_steps % residual_length
    return prompt + decode_steps - residual, residual


def expected_quantized_bytes(
    *,
    quantized_tokens: int,
    residual_tokens: int,
    batch: int,
    kv_heads: int,
    head_dim: int,
    nbits: int,
    q_group_size: int,
    dtype_bytes: int,
    layers: int = 1,
    axis: int = 0,
    backend: str = "quanto",
) -> int:
    """Bytes held for keys plus values (they are laid out identically) over ``layers`` layers.

    For one of keys/values in one layer, with ``N = batch * kv_heads * quantized_tokens * head_dim`` quantized
    elements, ``G = q_group_size``, ``g = N // G`` groups and ``p = 8 // nbits`` values per byte:

    - quanto, axis 0 (default; ``G`` must divide ``N // batch``): uint8 payload ``ceil(g / p) * G`` (packed along the
      group-count axis, so an odd ``g`` at 4 bits pads a whole row of ``G`` bytes); scale and shift ``(g, 1)`` each in
      the model dtype, except ``(1, G)`` when ``g == 1`` (quanto then reduces along the other axis);
    - quanto, axis -1 (``G`` must divide ``N // head_dim``): payload ``ceil(G / p) * g``; scale and shift ``(1, g)``;
    - hqq (nbits 2 or 4, axis 0): payload ``ceil(G / p) * g``; scale and zero ``(1, g)`` in the model dtype;
    - residual (every backend): ``batch * kv_heads * residual_tokens * head_dim * dtype_bytes``.
    """
    if nbits not in (2, 4):
        raise ValueError(f"only nbits 2 and 4 are modelled, not {nbits}")
    per = 8 // nbits
    total = batch * kv_heads * residual_tokens * head_dim * dtype_bytes
    if quantized_tokens > 0:
        g = batch * kv_heads * quantized_tokens * head_dim // q_group_size
        if backend == "quanto" and axis == 0:
            total += math.ceil(g / per) * q_group_size + 2 * (q_group_size if g == 1 else g) * dtype_bytes
        elif backend in ("quanto", "hqq"):
            total += math.ceil(q_group_size / per) * g + 2 * g * dtype_bytes
        else:
            raise ValueError(f"unknown backend {backend!r}")
    return 2 * layers * total


def _table(quick: bool, backend: str) -> None:
    """Print measured against expected bytes over a grid, as markdown; exit non-zero on any mismatch.

    Each cell is ``bytes (qQ+rR)``: Q tokens quantized and R in the full-precision residual per layer; the cache
    covers T tokens after a ``prompt``-token prefill and ``T - prompt`` one-token decode steps (residual_length 8).
    """
    import sys

    import torch

    cfg = TINY_LLAMA
    kv, hd, nl = cfg["num_key_value_heads"], cfg["head_dim"], cfg["num_hidden_layers"]
    r = 8
    cache_tokens = (1, 7, 8, 9, 17, 30)
    prompts = (1, 5) if quick else (1, 5, 8, 12)
    dtypes = ("float32",) if quick else ("float32", "bfloat16")
    groups = (64,) if quick else (16, 32, 64)
    bad = 0
    print(f"backend {backend}, residual_length {r}\n")
    print("| dtype | nbits | G | B | prompt | " + " | ".join(f"T={t}" for t in cache_tokens) + " |")
    print("|---|---|---|---|---|" + "---|" * len(cache_tokens))
    for dtype in dtypes:
        size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        for nbits in (4, 2):
            for group in groups:
                for batch in (1, 2):
                    for prompt in prompts:
                        cells = []
                        for t in cache_tokens:
                            if t < prompt:
                                cells.append("-")
                                continue
                            steps = t - prompt
                            cache = quantized_cache(
                                cfg,
                                tokens=prompt,
                                batch=batch,
                                dtype=dtype,
                                nbits=nbits,
                                q_group_size=group,
                                residual_length=r,
                                backend=backend,
                                mode="generate",
                                new_tokens=steps + 1,
                            )
                            m = walk_quantized_cache(cache)
                            q, res = split_tokens(prompt, steps, r)
                            want = expected_quantized_bytes(
                                quantized_tokens=q,
                                residual_tokens=res,
                                batch=batch,
                                kv_heads=kv,
                                head_dim=hd,
                                nbits=nbits,
                                q_group_size=group,
                                dtype_bytes=size,
                                layers=nl,
                                backend=backend,
                            )
                            ok = m.total_bytes == want and m.seq_length == t and m.residual_tokens == res
                            bad += not ok
                            mark = "" if ok else f" != {want} (T {m.seq_length}, res {m.residual_tokens})"
                            cells.append(f"{m.total_bytes} (q{q}+r{res}){mark}")
                        print(f"| {dtype} | {nbits} | {group} | {batch} | {prompt} | " + " | ".join(cells) + " |")
    print(f"\n{bad} mismatch(es)")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    import sys

    _args = sys.argv[1:]
    _table("--quick" in _args, "hqq" if "--hqq" in _args else "quanto")
