"""Configs of tiny random-weight models the diagnostics tests build on CPU (no torch needed to import)."""

from __future__ import annotations

from typing import Any

# Llama layout, 2 layers × 2 KV heads × head_dim 16 in float32: 2 × 2 × 2 × 16 × 4 = 512 bytes per token.
TINY_LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
}
# Mistral with a sliding window on every layer: prefill keeps the whole prompt, decoding the window.
TINY_MISTRAL: dict[str, Any] = {**TINY_LLAMA, "model_type": "mistral", "sliding_window": 8}
