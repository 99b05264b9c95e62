"""The allowed range of every number the memory API takes, checked in one place.

``SETTINGS`` is the registry: one :class:`Limit` per numeric input of ``plan``, ``recommend``, ``kv_report``,
``kv_pool_tokens``, :class:`~contextkeeper.memory.PlanSettings`, :class:`~contextkeeper.memory.RuntimeSettings`,
``profile`` and ``doctor``'s facts. The functions check their arguments with :func:`check_numbers` and the
settings classes their fields with :func:`check_fields`, both through this registry, so the command line and the
Python API refuse the same values with the same message. ``CONFIG_SIZES`` bounds the size fields of a model
config before anything is built from them (a config with 10¹² layers is refused, not allocated).

Integers must be ``int`` (not ``bool``, not ``8192.0``); floats may be ``int`` or ``float`` but never NaN or
infinite.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._exceptions import ConfigurationError, ModelConfigError

__all__ = [
    "CONFIG_FACTORS",
    "CONFIG_SIZES",
    "SETTINGS",
    "Limit",
    "check_choice",
    "check_config_sizes",
    "check_fields",
    "type_name",
]

MAX_TOKENS = 2**30  # tokens per sequence: 1,073,741,824, far above any model's context
MAX_SEQUENCES = 2**20  # sequences held at once
MAX_GPUS = 1024


@dataclass(frozen=True, kw_only=True)
class Limit:
    """One numeric setting: its type, its range (``low`` excluded when ``low_open``) and what it means."""

    name: str  # the Python keyword
    flag: str | None  # the command-line option, where there is one
    integer: bool
    low: float
    high: float
    what: str
    low_open: bool = False

    def allowed(self) -> str:
        """The range in words: "an integer from 1 to 1,024", "a number in (0, 1]"."""
        if self.integer:
            return f"an integer from {self.low:,.0f} to {self.high:,.0f}"
        return f"a number in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"

    def setting(self) -> str:
        return f"{self.name}= ({self.flag})" if self.flag else f"{self.name}="

    def check(self, value: Any) -> Any:
        """``value`` as this setting's type, or a :class:`ConfigurationError` naming the value, the range and
        the setting."""
        problem = _problem(value, integer=self.integer, low=self.low, high=self.high, low_open=self.low_open)
        if problem is None:
            return int(value) if self.integer else float(value)
        error = ConfigurationError(
            f"{self.name} must be {self.allowed()} ({self.what}), got {value!r}{problem}. "
            f"Fix: set {self.setting()} to {self.allowed()}"
        )
        error.fix = f"set {self.setting()} to {self.allowed()}"
        raise error


def type_name(value: Any) -> str:
    """ "an int", "a str": the type of ``value`` for a message."""
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _problem(value: Any, *, integer: bool, low: float, high: float, low_open: bool) -> str | None:
    """Why ``value`` is not allowed (a suffix for the message), or None when it is."""
    if value is None:
        return ": required"
    if isinstance(value, bool):
        return ": a bool"
    if integer and isinstance(value, float):
        return ": a float; pass a whole number"
    if not isinstance(value, int if integer else (int, float)):
        return f": {type_name(value)}"
    if isinstance(value, float) and not math.isfinite(value):
        return ": not a finite number"
    if value < low or (low_open and value == low):
        return ": too small"
    if value > high:
        return ": too large"
    return None


def _limits(*items: Limit) -> dict[str, Limit]:
    return {item.name: item for item in items}


SETTINGS: dict[str, Limit] = _limits(
    Limit(name="context", flag="--context", integer=True, low=1, high=MAX_TOKENS, what="tokens per sequence"),
    Limit(name="tokens", flag="--tokens", integer=True, low=0, high=MAX_TOKENS, what="tokens per sequence"),
    Limit(name="concurrency", flag="--concurrency", integer=True, low=1, high=MAX_SEQUENCES, what="sequences at once"),
    Limit(name="sequences", flag="--sequences", integer=True, low=1, high=MAX_SEQUENCES, what="sequences at once"),
    Limit(name="gpus", flag="--gpus", integer=True, low=1, high=MAX_GPUS, what="GPU count"),
    Limit(name="max_gpus", flag="--max-gpus", integer=True, low=1, high=MAX_GPUS, what="most cards per option"),
    Limit(name="tp", flag="--tp", integer=True, low=1, high=MAX_GPUS, what="tensor-parallel GPUs"),
    Limit(
        name="gpu_memory_utilization",
        flag="--gpu-memory-utilization",
        integer=False,
        low=0,
        high=1,
        low_open=True,
        what="vLLM's share of GPU memory",
    ),
    Limit(
        name="mem_fraction_static",
        flag=None,
        integer=False,
        low=0,
        high=1,
        low_open=True,
        what="SGLang's share of GPU memory for weights and KV",
    ),
    Limit(
        name="max_num_batched_tokens",
        flag="--max-num-batched-tokens",
        integer=True,
        low=1,
        high=MAX_TOKENS,
        what="tokens per prefill step",
    ),
    Limit(name="max_num_seqs", flag=None, integer=True, low=1, high=MAX_SEQUENCES, what="vLLM sampler rows"),
    Limit(name="block_size", flag="--block-size", integer=True, low=1, high=2**16, what="tokens per KV block"),
    Limit(name="n_ubatch", flag="--n-ubatch", integer=True, low=1, high=2**20, what="llama.cpp micro-batch"),
    Limit(name="q_group_size", flag=None, integer=True, low=1, high=2**20, what="QuantizedCache group size"),
    Limit(name="residual_length", flag=None, integer=True, low=1, high=2**20, what="QuantizedCache residual"),
    Limit(name="decode_steps", flag=None, integer=True, low=0, high=MAX_TOKENS, what="decoding steps"),
    Limit(name="lengths", flag="--lengths", integer=True, low=1, high=2**20, what="profile prompt lengths"),
    Limit(name="new_tokens", flag="--new-tokens", integer=True, low=1, high=2**20, what="profile generation lengths"),
    Limit(name="batches", flag="--batches", integer=True, low=1, high=2**16, what="profile concurrency steps"),
    Limit(name="generate_prompt", flag="--generate-prompt", integer=True, low=1, high=2**20, what="profile prompt"),
    Limit(name="batch_tokens", flag="--batch-tokens", integer=True, low=1, high=2**20, what="profile batch prompt"),
    Limit(name="jump_factor", flag=None, integer=False, low=1, high=1e6, what="profile jump threshold"),
    Limit(name="jump_floor", flag=None, integer=True, low=0, high=2**50, what="profile jump floor in bytes"),
    Limit(name="seed", flag=None, integer=True, low=0, high=2**32 - 1, what="random seed"),
)


def check_numbers(**values: Any) -> dict[str, Any]:
    """Each keyword's value checked against its registered range (None is refused: these are required), as a
    dict of the normalised values. ``plan(context=..., concurrency=...)`` and the rest call this first."""
    return {name: SETTINGS[name].check(value) for name, value in values.items()}


def check_choice(name: str, value: Any, choices: tuple[Any, ...]) -> None:
    """A :class:`ConfigurationError` unless ``value`` is one of ``choices`` (bools only match bools)."""
    if not any(value == choice and isinstance(value, bool) == isinstance(choice, bool) for choice in choices):
        listed = ", ".join(repr(choice) for choice in choices)
        error = ConfigurationError(f"{name} must be one of {listed}, got {value!r}. Fix: set {name}= to one of them")
        error.fix = f"set {name}= to one of {listed}"
        raise error


def check_fields(obj: Any) -> None:
    """Check (and normalise: ``1`` becomes ``1.0`` for a float setting) every field of a frozen dataclass that the
    registry knows; None passes only where it is the field's default ("not set"); fields whose default is a tuple
    take a tuple or list, checked element by element and stored as a tuple."""
    for item in dataclasses.fields(obj):
        limit = SETTINGS.get(item.name)
        value = getattr(obj, item.name)
        if limit is None or (value is None and item.default is None):
            continue
        if isinstance(item.default, tuple) and isinstance(value, (tuple, list)):  # a list field: each element
            checked: Any = tuple(limit.check(v) for v in value)
        else:
            checked = limit.check(value)
        object.__setattr__(obj, item.name, checked)


# ------------------------------------------------------------------------------------------ model configs

_LAYERS = 10_000  # the largest published models have under 200 decoder layers
_HEADS = 2**16
_WIDTH = 2**20  # hidden sizes, MLP widths, head dims, latent ranks, state sizes
_VOCAB = 2**24  # the largest vocabularies have about 2**18 entries
_EXPERTS = 2**16
_KERNEL = 4096
_POSITIONS = 2**40

CONFIG_SIZES: dict[str, int] = {
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers"), _LAYERS),
    **dict.fromkeys(
        (
            "num_attention_heads",
            "n_head",
            "n_heads",
            "num_heads",
            "num_key_value_heads",
            "num_kv_heads",
            "n_head_kv",
            "multi_query_group_num",
            "linear_num_key_heads",
            "linear_num_value_heads",
        ),
        _HEADS,
    ),
    **dict.fromkeys(
        (
            "hidden_size",
            "n_embd",
            "d_model",
            "intermediate_size",
            "n_inner",
            "ffn_hidden_size",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "expert_intermediate_size",
            "intermediate_size_mlp",
            "head_dim",
            "hidden_size_per_head",
            "v_head_dim",
            "qk_rope_head_dim",
            "qk_nope_head_dim",
            "kv_lora_rank",
            "q_lora_rank",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "mamba_d_inner",
            "mamba_d_state",
            "state_size",
            "ssm_state_size",
        ),
        _WIDTH,
    ),
    **dict.fromkeys(("vocab_size", "padded_vocab_size"), _VOCAB),
    **dict.fromkeys(
        (
            "n_routed_experts",
            "num_local_experts",
            "num_experts",
            "num_experts_per_tok",
            "num_experts_per_token",
            "n_shared_experts",
            "mamba_n_groups",
            "n_groups",
        ),
        _EXPERTS,
    ),
    **dict.fromkeys(("mamba_d_conv", "conv_kernel", "linear_conv_kernel_dim"), _KERNEL),
    **dict.fromkeys(
        (
            "sliding_window_pattern",
            "full_attention_interval",
            "attn_layer_period",
            "attn_layer_offset",
            "expert_layer_period",
            "expert_layer_offset",
            "no_rope_layer_interval",
            "first_k_dense_replace",
            "decoder_sparse_step",
            "interleave_moe_layer_step",
            "max_window_layers",
            "num_kv_shared_layers",
            "moe_layer_freq",
        ),
        _LAYERS,
    ),
    **dict.fromkeys(
        (
            "sliding_window",
            "attention_chunk_size",
            "max_position_embeddings",
            "n_positions",
            "seq_length",
            "max_sequence_length",
            "n_ctx",
        ),
        _POSITIONS,
    ),
}
# Factors read as floats: Mamba's inner width is expand × hidden_size.
CONFIG_FACTORS: dict[str, float] = {"mamba_expand": 1024.0, "expand": 1024.0}
# ``sliding_window: false`` (and null) is how some configs say "no window".
_BOOL_MEANS_UNSET = frozenset({"sliding_window"})


def check_config_sizes(config: Mapping[str, Any], source: str) -> None:
    """Refuse a config whose size fields are not whole numbers in range (before anything is sized from them).
    Raises :class:`ModelConfigError` naming the field, the value and the allowed range."""
    for name, high in CONFIG_SIZES.items():
        value = config.get(name)
        if value is None or (name in _BOOL_MEANS_UNSET and isinstance(value, bool)):
            continue
        problem = _problem(value, integer=True, low=0, high=high, low_open=False)
        if problem is not None:
            raise ModelConfigError(
                f"{source}: {name} must be an integer from 0 to {high:,}, got {value!r}{problem}. "
                f"Fix: correct {name} in the model's config.json"
            )
    for name, top in CONFIG_FACTORS.items():
        value = config.get(name)
        if value is not None and _problem(value, integer=False, low=0, high=top, low_open=True) is not None:
            raise ModelConfigError(
                f"{source}: {name} must be a number in (0, {top:g}], got {value!r}. "
                f"Fix: correct {name} in the model's config.json"
            )
    scaling = config.get("rope_scaling") or config.get("rope_parameters")
    if isinstance(scaling, Mapping) and isinstance(scaling.get("full_attention"), Mapping):
        scaling = scaling["full_attention"]  # per-layer-kind parameters (Gemma 3 in transformers 5)
    if isinstance(scaling, Mapping):
        factor = scaling.get("factor")
        if factor is not None and _problem(factor, integer=False, low=0, high=1e6, low_open=True) is not None:
            raise ModelConfigError(
                f"{source}: rope_scaling factor must be a number in (0, 1e+06], got {factor!r}. "
                "Fix: correct rope_scaling.factor in the model's config.json"
            )
