"""Per-layer KV specs: one frozen dataclass per layer kind, each with ``bytes_for(tokens)``.

A model is the tuple of its layers. The specs built from a config describe the architecture with plain storage
(every token kept, no blocks, the model's dtype); a runtime profile (``runtimes.py``) turns them into the specs
that runtime really allocates by replacing fields (block size, tokens a window holds, MLA storage, state dtypes,
heads per GPU). ``bytes_for`` is for one sequence; sequences multiply.

Every class names its own ``kind`` ("full", "sliding", ...). Runtimes look their rules up by that exact kind,
so a subclass (``SlidingAttention`` shares ``FullAttention``'s rows) is never sized by its parent's rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .dtypes import DType

__all__ = [
    "ChunkedAttention",
    "FullAttention",
    "LayerSpec",
    "MLAttention",
    "NoCache",
    "RecurrentState",
    "SlidingAttention",
]


def _blocks(tokens: int, block: int) -> int:
    return -(-tokens // block)


@dataclass(frozen=True, kw_only=True)
class LayerSpec:
    """Base of the layer kinds."""

    kind: ClassVar[str] = "layer"

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        # The runtimes' registries are keyed by kind: an inherited one would size the new layer as its parent.
        own = cls.__dict__.get("kind")
        if not isinstance(own, str) or not own:
            raise TypeError(
                f'{cls.__name__} must declare its own layer kind (kind: ClassVar[str] = "..."); it would '
                f"inherit {cls.kind!r} and be sized by the runtimes' rules for {cls.kind!r} layers"
            )

    def bytes_for(self, tokens: int) -> int:
        """KV bytes this layer holds for one sequence of ``tokens`` tokens."""
        raise NotImplementedError

    def bookkeeping_bytes(self, tokens: int) -> int:
        """Bytes this layer holds once, whatever the number of sequences (small index tensors)."""
        return 0

    @property
    def bytes_per_token(self) -> int:
        """Bytes each further token adds once the sequence is long (0 for fixed-size kinds)."""
        return 0

    @property
    def row_values(self) -> tuple[int, ...]:
        """Values in each row the KV dtype stores per token (K, then V); block types must divide them. Empty
        for kinds whose storage is not in the KV dtype."""
        return ()


@dataclass(frozen=True, kw_only=True)
class FullAttention(LayerSpec):
    """K and V rows for every token: ``kv_heads × (head_dim + v_head_dim)`` values per token."""

    kind: ClassVar[str] = "full"
    kv_heads: int
    head_dim: int
    v_head_dim: int
    dtype: DType
    block: int = 1  # tokens per allocation block (vLLM 16, llama.cpp pads the context to 256)

    @property
    def token_bytes(self) -> int:
        # One row of K and one of V per token, each rounded to whole quantisation blocks (ggml_row_size).
        return self.dtype.bytes_for(self.kv_heads * self.head_dim) + self.dtype.bytes_for(
            self.kv_heads * self.v_head_dim
        )

    def held(self, tokens: int) -> int:
        """Token slots allocated for a sequence of ``tokens`` tokens."""
        return _blocks(tokens, self.block) * self.block

    def bytes_for(self, tokens: int) -> int:
        return self.held(tokens) * self.token_bytes

    @property
    def bytes_per_token(self) -> int:
        return self.token_bytes

    @property
    def row_values(self) -> tuple[int, ...]:
        return (self.kv_heads * self.head_dim, self.kv_heads * self.v_head_dim)


@dataclass(frozen=True, kw_only=True)
class SlidingAttention(FullAttention):
    """Attention over the last ``window`` tokens. ``keep`` is how many tokens the runtime holds at most (None:
    all, as when a runtime allocates sliding layers in full, or while transformers' prefill keeps the whole
    prompt alive); ``spare_blocks`` are blocks held on top (vLLM holds one more because a window need not start
    on a block boundary)."""

    kind: ClassVar[str] = "sliding"
    window: int
    keep: int | None = None
    spare_blocks: int = 0
    extra_bytes: int = 0  # per-layer bookkeeping tensors (transformers: the window as an int64 scalar)

    def held(self, tokens: int) -> int:
        if tokens <= 0:
            return 0
        kept = tokens if self.keep is None else min(tokens, self.keep)
        return (_blocks(kept, self.block) + self.spare_blocks) * self.block

    def bookkeeping_bytes(self, tokens: int) -> int:
        return self.extra_bytes if tokens > 0 else 0

    @property
    def bytes_per_token(self) -> int:
        return self.token_bytes if self.keep is None else 0


@dataclass(frozen=True, kw_only=True)
class ChunkedAttention(SlidingAttention):
    """Chunked local attention (Llama 4): attends within chunks of ``window`` tokens."""

    kind: ClassVar[str] = "chunked"


@dataclass(frozen=True, kw_only=True)
class MLAttention(LayerSpec):
    """Multi-head latent attention (DeepSeek V2/V3, Kimi K2).

    Stored as the latent: ``kv_lora_rank + rope_dim`` values per token (vLLM, SGLang, llama.cpp), plus
    ``v_dim`` values when a runtime also keeps a V row (llama.cpp builds before the V-less cache: 512), or a
    fixed ``token_bytes_override`` for packed formats (vLLM's fp8_ds_mla: 656 bytes). A runtime that
    decompresses (transformers) uses :class:`FullAttention` with the per-head sizes instead.
    """

    kind: ClassVar[str] = "mla"
    kv_lora_rank: int
    rope_dim: int
    num_heads: int
    nope_dim: int
    v_head_dim: int
    dtype: DType
    v_dim: int = 0
    block: int = 1
    token_bytes_override: int | None = None

    @property
    def token_bytes(self) -> int:
        if self.token_bytes_override is not None:
            return self.token_bytes_override
        return self.dtype.bytes_for(self.kv_lora_rank + self.rope_dim) + self.dtype.bytes_for(self.v_dim)

    def bytes_for(self, tokens: int) -> int:
        return _blocks(tokens, self.block) * self.block * self.token_bytes

    @property
    def bytes_per_token(self) -> int:
        return self.token_bytes

    @property
    def row_values(self) -> tuple[int, ...]:
        return (self.kv_lora_rank + self.rope_dim, self.v_dim) if self.v_dim else (self.kv_lora_rank + self.rope_dim,)


@dataclass(frozen=True, kw_only=True)
class RecurrentState(LayerSpec):
    """A fixed-size state per sequence (Gated DeltaNet, Mamba): a convolution window and an SSM state.

    ``conv_channels × conv_width`` values of ``conv_dtype`` plus ``ssm_values`` of ``ssm_dtype``, whatever the
    length. ``conv_kernel`` is the architecture's kernel; runtimes keep ``kernel − 1`` columns (vLLM,
    llama.cpp) or the whole kernel (transformers). ``copies``: states held per sequence (vLLM keeps 2 with
    prefix caching); ``page_bytes``: the page one copy is padded to (vLLM's hybrid allocator).
    """

    kind: ClassVar[str] = "recurrent"
    family: str  # "gated_deltanet" | "mamba" | "mamba2"
    conv_channels: int
    conv_kernel: int
    conv_width: int
    ssm_values: int
    conv_dtype: DType
    ssm_dtype: DType
    copies: int = 1
    page_bytes: int | None = None
    extra_bytes: int = 0  # per-layer bookkeeping tensors (transformers 5.25+: the length seen, an int64 scalar)

    def bookkeeping_bytes(self, tokens: int) -> int:
        return self.extra_bytes if tokens > 0 else 0

    @property
    def state_bytes(self) -> int:
        return self.conv_dtype.bytes_for(self.conv_channels * self.conv_width) + self.ssm_dtype.bytes_for(
            self.ssm_values
        )

    def bytes_for(self, tokens: int) -> int:
        if tokens <= 0:
            return 0
        one = self.state_bytes if self.page_bytes is None else max(self.page_bytes, self.state_bytes)
        return self.copies * one


@dataclass(frozen=True, kw_only=True)
class NoCache(LayerSpec):
    """A layer that keeps nothing per token: it reuses another layer's KV (Gemma 3n) or has no attention."""

    kind: ClassVar[str] = "none"
    reason: str = ""

    def bytes_for(self, tokens: int) -> int:
        return 0
