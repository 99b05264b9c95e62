"""Budget settings from three places, closest first: factory arguments, the marker, ``[tool.contextkeeper]``.

Only the standard library here: the plugin reads settings before anything heavy is needed.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._exceptions import SettingsError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["KEYS", "BudgetSettings", "SettingsError", "merge_settings", "read_pyproject"]

# Every setting, with the types a marker or pyproject.toml may give it (factory arguments may also pass objects:
# a transformers tokenizer or TokenCounter, a Policy, a ModelSpec, a GPU).
KEYS: dict[str, tuple[type, ...]] = {
    "tokenizer": (str,),
    "context_window": (int,),
    "max_tokens": (int,),
    "chat_template": (str,),
    "policy": (str,),
    "model": (str,),
    "gpu": (str,),
    "concurrency": (int,),
    "runtime": (str,),
    "kv_dtype": (str,),
}

ARGUMENT = "argument"
MARKER = "@pytest.mark.contextkeeper"
PYPROJECT = "[tool.contextkeeper]"
DEFAULT = "default"


@dataclass(frozen=True)
class BudgetSettings:
    """The merged settings and where each came from (``argument``, the marker, ``[tool.contextkeeper]``)."""

    values: Mapping[str, Any]
    sources: Mapping[str, str]

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def source(self, key: str) -> str:
        return self.sources.get(key, DEFAULT)

    def describe(self) -> str:
        """``tokenizer='mistral:tekken' (argument), context_window=2048 (@pytest.mark.contextkeeper), ...``"""
        parts = []
        for key in KEYS:
            if key in self.values:
                value = self.values[key]
                shown = repr(value) if isinstance(value, (str, int)) else type(value).__name__
                if key == "chat_template" and isinstance(value, str) and len(value) > 40:
                    shown = f"<{len(value)} characters of Jinja>"
                parts.append(f"{key}={shown} ({self.sources[key]})")
        return ", ".join(parts)

    def key(self) -> tuple[Any, ...]:
        """A hashable key for caching keepers: scalars by value, objects by identity (the key holds them)."""
        return tuple(
            (k, v if isinstance(v, (str, int, float, type(None))) else _Same(v)) for k, v in self.values.items()
        )


class _Same:
    """An object as part of a key: equal only to the very same object, and holding it, so that while the key is
    kept (a cached keeper's) no other object can take its id and be mistaken for it."""

    __slots__ = ("obj",)

    def __init__(self, obj: object) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


def check_values(values: Mapping[str, Any], where: str, *, strict_types: bool) -> None:
    unknown = sorted(set(values) - set(KEYS))
    if unknown:
        raise SettingsError(f"{where}: unknown setting(s) {', '.join(map(repr, unknown))}; known: {', '.join(KEYS)}")
    if not strict_types:
        return
    for key, value in values.items():
        types = KEYS[key]
        if isinstance(value, bool) or not isinstance(value, types):
            wanted = " or ".join(t.__name__ for t in types)
            raise SettingsError(f"{where}: {key} must be a {wanted}, got {value!r}")


def read_pyproject(rootpath: Path) -> dict[str, Any]:
    """``[tool.contextkeeper]`` of ``rootpath / "pyproject.toml"`` (empty when there is none).

    Sub-tables (``[tool.contextkeeper.something]``) are left to other tools. Relative paths (a tokenizer folder,
    a policy file, a model config, a chat template file) are relative to the project root.
    """
    file = rootpath / "pyproject.toml"
    if not file.is_file():
        return {}
    try:
        data = tomllib.loads(file.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"{file}: not valid TOML: {exc}") from None
    table = data.get("tool", {}).get("contextkeeper", {})
    if not isinstance(table, dict):
        raise SettingsError(f"{file}: [tool.contextkeeper] must be a table")
    values = {k: v for k, v in table.items() if not isinstance(v, dict)}
    check_values(values, f"{file} {PYPROJECT}", strict_types=True)
    for key in ("tokenizer", "policy", "model"):
        value = values.get(key)
        if isinstance(value, str) and not value.startswith("mistral:") and (rootpath / value).exists():
            values[key] = str((rootpath / value).resolve())
    template = values.get("chat_template")
    if isinstance(template, str) and "{" not in template and (rootpath / template).is_file():
        values["chat_template"] = (rootpath / template).read_text(encoding="utf-8")
    return values


def merge_settings(
    arguments: Mapping[str, Any], markers: list[Mapping[str, Any]], pyproject: Mapping[str, Any]
) -> BudgetSettings:
    """Closest wins: factory arguments (``None`` means unset), then markers (closest first), then pyproject."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    layers: list[tuple[str, Mapping[str, Any]]] = [(PYPROJECT, pyproject)]
    layers += [(MARKER, marker) for marker in reversed(markers)]
    layers.append((ARGUMENT, {k: v for k, v in arguments.items() if v is not None}))
    for where, layer in layers:
        for key, value in layer.items():
            values[key] = value
            sources[key] = where
    return BudgetSettings(values={k: values[k] for k in KEYS if k in values}, sources=sources)
