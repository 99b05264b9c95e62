"""Predicted KV bytes == the bytes transformers' cache really holds, on CPU with tiny random-weight models built
from configs (tests/memory_real.py walks every tensor of the returned cache and sums their storage).

Families: dense GQA (Llama, Qwen3), MQA (Falcon), Falcon's new decoder, MHA (GPT-2, Phi-3, MPT), sliding windows
(Mistral, Phi-3 with a window, Qwen2 with and without), Gemma 2 / Gemma 3 / Cohere2 patterns, gpt-oss, MLA
(DeepSeek V3), Llama 4 chunked, and the hybrids Qwen3-Next (Gated DeltaNet) and Jamba (Mamba), and Gemma 3n's
KV-shared layers. Lengths below, at and past the window; batch 1 and 3; float32 and bfloat16; a forward
(prefill) and generate (decoding).
"""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from contextkeeper.memory import ModelSpec
from memory_real import TINY, measure

WINDOW = 8  # every windowed TINY config uses W = C = 8
NEW_TOKENS = 3
GRID = [
    (tokens, batch, dtype)
    for (tokens, batch), dtype in zip(
        itertools.product((1, WINDOW - 1, WINDOW + 1, 3 * WINDOW + 5), (1, 3)), itertools.cycle(["float32", "bfloat16"])
    )
]
KV_DTYPE = {"float32": "fp32", "bfloat16": "bf16"}


@pytest.mark.parametrize("family", sorted(TINY))
def test_prefill_resident_bytes_match_the_real_cache(family: str) -> None:
    model = ModelSpec.from_config(TINY[family])
    for tokens, batch, dtype in GRID:
        real = measure(TINY[family], tokens=tokens, batch=batch, dtype=dtype, mode="forward")
        predicted = model.kv_bytes(tokens, batch, runtime="transformers", kv_dtype=KV_DTYPE[dtype])
        assert predicted == real.storage_bytes, (family, tokens, batch, dtype)


@pytest.mark.parametrize("family", sorted(TINY))
def test_decoding_resident_bytes_match_the_real_cache(family: str) -> None:
    model = ModelSpec.from_config(TINY[family])
    for tokens, batch, dtype in GRID:
        real = measure(TINY[family], tokens=tokens, batch=batch, dtype=dtype, mode="generate", new_tokens=NEW_TOKENS)
        cached = tokens + NEW_TOKENS - 1  # the last sampled token is never fed back
        predicted = model.kv_bytes(cached, batch, runtime="transformers", kv_dtype=KV_DTYPE[dtype], phase="steady")
        assert predicted == real.storage_bytes, (family, tokens, batch, dtype)


def test_layer_kinds_match_the_cache_layers() -> None:
    names = {
        "full": "full",
        "mla": "full",
        "sliding": "sliding",
        "chunked": "sliding",
        "recurrent": "linear",
        "none": "dummy",
    }
    for family, config in TINY.items():
        real = measure(config, tokens=2, mode="forward")
        kinds = [layer.kind for layer in real.layers if layer.index >= 0]
        assert [names[layer.kind] for layer in ModelSpec.from_config(config).layers] == kinds, family
