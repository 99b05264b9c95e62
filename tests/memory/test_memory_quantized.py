"""transformers' QuantizedCache (optimum-quanto backend): predicted bytes == the bytes the real cache holds
after a prefill and while decoding (tests/memory_quantized.py walks the packed data, scales, shifts and the
full-precision residual of every layer)."""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("optimum.quanto")
pytest.importorskip("transformers")

from contextkeeper.memory import ModelSpec
from memory_quantized import TINY_LLAMA, measure_quantized

GROUP, RESIDUAL, NEW = 16, 8, 3


@pytest.mark.parametrize(("nbits", "dtype"), list(itertools.product((4, 2), ("float32", "bfloat16"))))
def test_quanto_cache_bytes(nbits: int, dtype: str) -> None:
    model = ModelSpec.from_config({**TINY_LLAMA, "torch_dtype": dtype})
    settings = {"kv_dtype": f"quanto-int{nbits}", "q_group_size": GROUP, "residual_length": RESIDUAL}
    for batch, prompt in itertools.product((1, 2), (1, 5, 12)):
        common = {"batch": batch, "dtype": dtype, "nbits": nbits, "q_group_size": GROUP, "residual_length": RESIDUAL}
        prefill = measure_quantized(TINY_LLAMA, tokens=prompt, mode="forward", **common)
        assert model.kv_bytes(prompt, batch, runtime="transformers", phase="plan", **settings) == prefill
        decoding = measure_quantized(TINY_LLAMA, tokens=prompt, mode="generate", new_tokens=NEW, **common)
        steps = NEW - 1  # the last sampled token is never fed back
        predicted = model.kv_bytes(
            prompt + steps, batch, runtime="transformers", phase="steady", decode_steps=steps, **settings
        )
        assert predicted == decoding, (batch, prompt)


def test_quantized_cache_is_for_full_attention_models() -> None:
    import contextkeeper as ck

    with pytest.raises(ck.ConfigurationError, match="full-attention models only"):
        ModelSpec.from_config("gemma-3-27b").kv_bytes(100, kv_dtype="quanto-int4")
