"""A tiny random-weight llama-architecture GGUF model around one of llama.cpp's vocabulary files.

llama-server needs weights to start; its prompt counts depend only on the vocabulary (tokenizer.* keys, copied
unchanged from the ggml-vocab-*.gguf file llama.cpp ships) and the chat template it is given. One layer of
width 64 keeps each file at a few tens of MB.

    python scripts/tiny_gguf.py .cache/assets/gguf/ggml-vocab-qwen2.gguf .cache/llama.cpp/models/qwen2.gguf
"""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np

WIDTH, HEADS, FFN, LAYERS = 64, 4, 128, 1


def tiny_model(vocab_file: Path, out: Path, *, seed: int = 0) -> Path:
    reader = gguf.GGUFReader(str(vocab_file))
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    writer = gguf.GGUFWriter(str(out), "llama")
    # A neutral name: llama.cpp sets token attributes by model name (phi-3: rstrip on every special token).
    writer.add_name("tiny random model")
    writer.add_context_length(32768)
    writer.add_embedding_length(WIDTH)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(HEADS)
    writer.add_rope_dimension_count(WIDTH // HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
        elif kind == gguf.GGUFValueType.STRING:
            writer.add_string(key, value)
        else:
            writer.add_key_value(key, value, kind)
    rng = np.random.default_rng(seed)

    def tensor(name: str, *shape: int) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))

    tensor("token_embd.weight", len(tokens), WIDTH)
    writer.add_tensor("output_norm.weight", np.ones(WIDTH, dtype=np.float32))
    for layer in range(LAYERS):
        block = f"blk.{layer}"
        writer.add_tensor(f"{block}.attn_norm.weight", np.ones(WIDTH, dtype=np.float32))
        writer.add_tensor(f"{block}.ffn_norm.weight", np.ones(WIDTH, dtype=np.float32))
        for part in ("attn_q", "attn_k", "attn_v", "attn_output"):
            tensor(f"{block}.{part}.weight", WIDTH, WIDTH)
        tensor(f"{block}.ffn_gate.weight", FFN, WIDTH)
        tensor(f"{block}.ffn_up.weight", FFN, WIDTH)
        tensor(f"{block}.ffn_down.weight", WIDTH, FFN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


if __name__ == "__main__":
    tiny_model(Path(sys.argv[1]), Path(sys.argv[2]))
