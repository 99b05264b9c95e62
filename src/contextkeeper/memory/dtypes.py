"""Element types of KV caches and weights, as bytes per block of values.

A block type stores ``block_values`` values in ``block_bytes`` bytes (llama.cpp's q8_0: 32 int8 values plus one
fp16 scale = 34 bytes). Plain types are blocks of one value. Sizes of quantized rows round up to whole blocks,
as ``ggml_row_size`` does for rows whose length is a multiple of the block (the only rows llama.cpp accepts).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from fractions import Fraction

from .._exceptions import ConfigurationError

__all__ = ["DType", "dtype", "kv_dtype_names", "weights_dtype_names"]


@dataclass(frozen=True, kw_only=True)
class DType:
    """One element type: ``block_bytes`` bytes hold ``block_values`` values."""

    name: str
    block_bytes: int
    block_values: int = 1
    note: str = ""

    def bytes_for(self, values: int) -> int:
        """Bytes of ``values`` values, rounded up to whole blocks."""
        return -(-values // self.block_values) * self.block_bytes

    @property
    def bytes_per_value(self) -> Fraction:
        return Fraction(self.block_bytes, self.block_values)

    @property
    def bits(self) -> float:
        return float(self.bytes_per_value * 8)


_TYPES: dict[str, DType] = {}
_ALIASES: dict[str, str] = {}
_KV: list[str] = []
_WEIGHTS: list[str] = []


def _add(kind: str, dt: DType, *aliases: str) -> None:
    _TYPES[dt.name] = dt
    for alias in (dt.name, *aliases):
        _ALIASES[alias.lower()] = dt.name
    if "kv" in kind:
        _KV.append(dt.name)
    if "w" in kind:
        _WEIGHTS.append(dt.name)


_add("kv,w", DType(name="fp32", block_bytes=4), "float32", "f32", "float")
_add("kv,w", DType(name="fp16", block_bytes=2), "float16", "f16", "half")
_add("kv,w", DType(name="bf16", block_bytes=2), "bfloat16")
_add("kv,w", DType(name="fp8", block_bytes=1, note="e4m3 or e5m2; per-tensor scales cost no cache bytes"), "float8")
_add("kv", DType(name="fp8_e4m3", block_bytes=1), "float8_e4m3fn", "fp8e4m3")
_add("kv", DType(name="fp8_e5m2", block_bytes=1), "float8_e5m2", "fp8e5m2")
# vLLM's packed sparse-MLA format: 656 bytes per token and layer (512 fp8 latent, 4 fp32 scales, 64 bf16 rope).
_add("kv", DType(name="fp8_ds_mla", block_bytes=1, note="vLLM MLA only: 656 B per token and layer"))
# transformers' QuantizedCache (optimum-quanto or hqq backends): packed nbits values with a scale and a shift per
# group; the exact bytes depend on the group layout, so the transformers profile sizes these itself.
_add("kv", DType(name="quanto-int4", block_bytes=1, block_values=2, note="transformers QuantizedCache, quanto"))
_add("kv", DType(name="quanto-int2", block_bytes=1, block_values=4, note="transformers QuantizedCache, quanto"))
_add("kv", DType(name="hqq-int4", block_bytes=1, block_values=2, note="transformers QuantizedCache, hqq"))
_add("kv", DType(name="hqq-int2", block_bytes=1, block_values=4, note="transformers QuantizedCache, hqq"))
# llama.cpp cache and weight blocks (ggml-common.h): data plus fp16 scale (and min) per 32 values.
_add("kv,w", DType(name="q8_0", block_bytes=34, block_values=32))
_add("kv,w", DType(name="q5_0", block_bytes=22, block_values=32))
_add("kv,w", DType(name="q5_1", block_bytes=24, block_values=32))
_add("kv,w", DType(name="q4_0", block_bytes=18, block_values=32))
_add("kv,w", DType(name="q4_1", block_bytes=20, block_values=32))
_add("kv,w", DType(name="iq4_nl", block_bytes=18, block_values=32))
# Weights only.
_add("w", DType(name="int8", block_bytes=1, note="plain int8 (scales per channel: negligible)"), "w8a8", "w8a16")
# AWQ/GPTQ 4-bit with group size 128: per group 64 bytes of int4 values, an fp16 scale and a packed 4-bit zero
# (two groups per block so the half-byte zero is whole).
_add("w", DType(name="int4", block_bytes=2 * (64 + 2) + 1, block_values=256, note="AWQ/GPTQ, group 128"), "awq", "gptq")
# MXFP4 (gpt-oss experts): 32 fp4 values + one e8m0 scale byte.
_add("w", DType(name="mxfp4", block_bytes=17, block_values=32))
# GGUF k-quants: 256-value super-blocks (ggml-common.h block_q*_K sizes).
_add("w", DType(name="q2_k", block_bytes=84, block_values=256))
_add("w", DType(name="q3_k", block_bytes=110, block_values=256))
_add("w", DType(name="q4_k", block_bytes=144, block_values=256), "q4_k_s")
_add("w", DType(name="q5_k", block_bytes=176, block_values=256), "q5_k_s")
_add("w", DType(name="q6_k", block_bytes=210, block_values=256))
# The _M mixes keep some tensors (attention V, FFN down) one type higher; their average, an estimate.
_add("w", DType(name="q4_k_m", block_bytes=155, block_values=256, note="mix of q4_k and q6_k: average, estimate"))
_add("w", DType(name="q5_k_m", block_bytes=182, block_values=256, note="mix of q5_k and q6_k: average, estimate"))
_add("w", DType(name="q3_k_m", block_bytes=125, block_values=256, note="mix of q3_k to q5_k: average, estimate"))


def dtype(name: str, *, purpose: str = "kv") -> DType:
    """The element type called ``name`` (``bf16``, ``float16``, ``q8_0``, ...).

    ``purpose`` is ``"kv"`` or ``"weights"``; a type the purpose cannot use raises :class:`ConfigurationError`
    listing the valid names.
    """
    text = name.strip().lower() if isinstance(name, str) else ""
    key = _ALIASES.get(text)
    allowed = _KV if purpose == "kv" else _WEIGHTS
    if key is None or key not in allowed:
        setting = "--kv-dtype" if purpose == "kv" else "--weights-dtype"
        close = difflib.get_close_matches(text, allowed, n=3, cutoff=0.5)
        hint = f" Did you mean: {', '.join(close)}?" if close else ""
        raise ConfigurationError(
            f"unknown {purpose} dtype {name!r}: {setting} takes auto or one of {', '.join(allowed)}.{hint}"
        )
    return _TYPES[key]


def kv_dtype_names() -> tuple[str, ...]:
    return ("auto", *_KV)


def weights_dtype_names() -> tuple[str, ...]:
    return ("auto", *_WEIGHTS)
