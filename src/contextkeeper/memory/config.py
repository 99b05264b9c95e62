"""Reading model configs: where a config comes from, and what its fields mean for memory.

Sources, first match wins: a dict or a transformers config object; a ``config.json`` file or a folder holding
one; a name or alias from the built-in catalog (offline); a hub id, from the local Hugging Face cache or, when
reachable, the hub. Multimodal wrappers are read through their text config.

Layer kinds come from ``layer_types`` when the config lists them, otherwise from the family's rule (registered
in ``LAYER_RULES``). A kind we do not know is an error, never silently "full".
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .._exceptions import ModelConfigError, UnknownModel
from . import catalog

__all__ = ["LAYER_RULES", "layer_kinds", "load_config", "max_context", "text_config"]


def load_config(source: Any) -> tuple[dict[str, Any], str, str]:
    """``(config dict, display name, where it came from)`` for a dict, a config object, a path, a catalog
    name or a hub id."""
    if isinstance(source, Mapping):
        data = dict(source)
        return data, str(data.get("_name_or_path") or data.get("model_type") or "config"), "dict"
    if hasattr(source, "to_dict") and not isinstance(source, (str, Path)):
        data = source.to_dict()
        return data, str(data.get("_name_or_path") or data.get("model_type") or "config"), "transformers config"
    if not isinstance(source, (str, Path)):
        raise ModelConfigError(
            f"a model must be a config.json path, a folder, a hub id, a catalog name, a dict or a transformers "
            f"config; got {type(source).__name__}"
        )
    text = str(source)
    path = Path(text).expanduser()
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ModelConfigError(f"folder {source} has no config.json; pass the folder of a Hugging Face model")
    if path.is_file():
        return _read_json(path), path.parent.name if path.name == "config.json" else path.stem, str(path)
    entry = catalog.find(text)
    if entry is not None:
        return dict(entry.config), entry.name, "catalog"
    if text.count("/") == 1 and not text.startswith((".", "/")):
        found = _from_hub(text)
        if found is not None:
            return found, text, "hub"
    raise UnknownModel(
        f"model {text!r} is not a config.json file or folder, not in the built-in catalog, and not a hub id in "
        "the local Hugging Face cache (the hub is not reachable from here)",
        matches=catalog.close_matches(text),
        fix="pass a config.json path or its folder, or one of the catalog names (see docs/memory.md)",
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ModelConfigError(
            f"{path} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}"
        ) from None
    except UnicodeDecodeError as exc:
        raise ModelConfigError(
            f"{path} is not UTF-8 text (byte {exc.start}); a model config is a JSON file. Fix: pass the model's "
            "config.json"
        ) from None
    except OSError as exc:
        raise ModelConfigError(
            f"{path} cannot be read: {exc.strerror or exc}. Fix: pass a readable config.json"
        ) from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path} holds a JSON {type(data).__name__}, not an object of config fields")
    return data


def _from_hub(repo_id: str) -> dict[str, Any] | None:
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        return None
    for local_only in (True, False):
        try:
            path = hf_hub_download(repo_id, "config.json", local_files_only=local_only)
        except Exception:
            continue
        return _read_json(Path(path))
    return None


def text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The decoder's config: ``text_config`` of a multimodal wrapper (inheriting the wrapper's dtype and
    quantization), or the config itself."""
    inner = config.get("text_config")
    if not isinstance(inner, Mapping):
        return dict(config)
    merged = dict(inner)
    for key in ("torch_dtype", "dtype", "quantization_config", "tie_word_embeddings"):
        if merged.get(key) is None and config.get(key) is not None:
            merged[key] = config[key]
    merged.setdefault("model_type", config.get("model_type"))
    return merged


# ------------------------------------------------------------------------------------------- fields


def first(config: Mapping[str, Any], *names: str) -> Any:
    """The first of ``names`` present in ``config`` with a non-None value."""
    for name in names:
        value = config.get(name)
        if value is not None:
            return value
    return None


def positive(config: Mapping[str, Any], *names: str, what: str, source: str) -> int:
    """A required positive integer field (any of ``names``), or a ModelConfigError naming it."""
    value = first(config, *names)
    if value is None:
        raise ModelConfigError(f"{source}: the config has no {what} (looked for {', '.join(names)})")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelConfigError(f"{source}: {what} must be a positive integer, got {value!r}")
    return value


def max_context(config: Mapping[str, Any]) -> int | None:
    """The longest context the model accepts: ``max_position_embeddings``, extended by YaRN-style RoPE scaling
    to ``original_max_position_embeddings × factor`` when that is longer (llama3, longrope and linear-scaled
    configs already list the extended length)."""
    base = first(config, "max_position_embeddings", "n_positions", "seq_length", "max_sequence_length", "n_ctx")
    if not isinstance(base, int) or base <= 0:
        return None
    scaling = first(config, "rope_scaling", "rope_parameters")
    if isinstance(scaling, Mapping) and isinstance(scaling.get("full_attention"), Mapping):
        scaling = scaling["full_attention"]  # per-layer-kind parameters (Gemma 3 in transformers 5)
    if not isinstance(scaling, Mapping):
        return base
    kind = scaling.get("rope_type") or scaling.get("type")
    factor = scaling.get("factor")
    if kind in (None, "default", "llama3", "longrope", "su", "mrope") or not isinstance(factor, (int, float)):
        return base
    original = scaling.get("original_max_position_embeddings")
    if isinstance(original, int) and original > 0:
        return max(base, int(original * factor))
    # Linear or dynamic scaling without the original length: configs such as Gemma 3's already list the
    # scaled length, so the base is kept (multiplying would promise 8× the trained context).
    return base


# ------------------------------------------------------------------------------------------- layer kinds

KNOWN_KINDS = frozenset(
    {"full_attention", "sliding_attention", "chunked_attention", "linear_attention", "mamba", "attention"}
)


def _alternating(config: Mapping[str, Any], count: int) -> list[str]:
    # Gemma 2, gpt-oss: even-index layers slide.
    return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(count)]


def _pattern(default: int) -> Callable[[Mapping[str, Any], int], list[str]]:
    def rule(config: Mapping[str, Any], count: int) -> list[str]:
        # Gemma 3 (6), Cohere2 (4): every pattern-th layer is global.
        every = first(config, "sliding_window_pattern") or default
        return ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(count)]

    return rule


def _llama4(config: Mapping[str, Any], count: int) -> list[str]:
    # RoPE layers attend within chunks; every no_rope_layer_interval-th layer (NoPE) attends globally.
    if not first(config, "attention_chunk_size"):
        return ["full_attention"] * count
    no_rope = config.get("no_rope_layers")
    if isinstance(no_rope, list) and len(no_rope) == count:
        return ["chunked_attention" if flag else "full_attention" for flag in no_rope]
    every = first(config, "no_rope_layer_interval") or 4
    return ["full_attention" if (i + 1) % every == 0 else "chunked_attention" for i in range(count)]


def _every_nth_full(config: Mapping[str, Any], count: int) -> list[str]:
    # Qwen3-Next: one full-attention layer per full_attention_interval, Gated DeltaNet otherwise.
    every = first(config, "full_attention_interval") or 4
    return ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(count)]


def _jamba(config: Mapping[str, Any], count: int) -> list[str]:
    period = first(config, "attn_layer_period") or 8
    offset = first(config, "attn_layer_offset") or 4
    return ["full_attention" if i % period == offset else "mamba" for i in range(count)]


def _windowed(config: Mapping[str, Any], count: int) -> list[str]:
    """Mistral, Mixtral, Phi-3, Qwen2 and the rest: every layer slides when a window is set and enabled."""
    window = config.get("sliding_window")
    if not window or config.get("use_sliding_window") is False:
        return ["full_attention"] * count
    if config.get("use_sliding_window") and isinstance(config.get("max_window_layers"), int):
        # Qwen2 with the window on: layers from max_window_layers on slide.
        start = config["max_window_layers"]
        return ["sliding_attention" if i >= start else "full_attention" for i in range(count)]
    return ["sliding_attention"] * count


LAYER_RULES: dict[str, Callable[[Mapping[str, Any], int], list[str]]] = {
    "gemma2": _alternating,
    "gpt_oss": _alternating,
    "gemma3": _pattern(6),
    "gemma3_text": _pattern(6),
    "cohere2": _pattern(4),
    "llama4": _llama4,
    "llama4_text": _llama4,
    "qwen3_next": _every_nth_full,
    "jamba": _jamba,
}


def layer_kinds(config: Mapping[str, Any], count: int, source: str) -> list[str]:
    """The kind of each of ``count`` layers: ``layer_types``, ``layers_block_type`` or the family rule."""
    listed = first(config, "layer_types", "layers_block_type")
    if listed is not None:
        if not isinstance(listed, list) or len(listed) != count:
            raise ModelConfigError(
                f"{source}: layer_types lists {len(listed) if isinstance(listed, list) else listed!r} entries "
                f"for {count} layers"
            )
        unknown = sorted({str(kind) for kind in listed} - KNOWN_KINDS)
        if unknown:
            raise ModelConfigError(
                f"{source}: unknown layer kind(s) {', '.join(unknown)} in layer_types; known kinds are "
                f"{', '.join(sorted(KNOWN_KINDS))}. contextkeeper does not guess the memory of a layer it "
                "does not know"
            )
        return ["full_attention" if kind == "attention" else str(kind) for kind in listed]
    rule = LAYER_RULES.get(str(config.get("model_type")), _windowed)
    return rule(config, count)
