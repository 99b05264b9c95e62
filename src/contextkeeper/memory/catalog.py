"""The built-in catalog of popular models' config facts (``data/models.json``), for offline use."""

from __future__ import annotations

import difflib
import functools
import json
import re
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

__all__ = ["CatalogModel", "close_matches", "find", "models"]


@dataclass(frozen=True, kw_only=True)
class CatalogModel:
    """One catalog entry: the hub id, short aliases, the published parameter count and the config facts."""

    name: str
    aliases: tuple[str, ...]
    params: int | None
    config: dict[str, Any] = field(compare=False, repr=False)


def _key(text: str) -> str:
    return re.sub(r"[\s_\-.]+", "", text.strip().lower())


@functools.cache
def models() -> tuple[CatalogModel, ...]:
    """Every catalog entry, in file order."""
    raw = json.loads(resources.files("contextkeeper.memory").joinpath("data/models.json").read_text("utf-8"))
    return tuple(
        CatalogModel(
            name=item["name"],
            aliases=tuple(item.get("aliases", ())),
            params=item.get("params"),
            config=item["config"],
        )
        for item in raw["models"]
    )


@functools.cache
def _index() -> dict[str, CatalogModel]:
    index: dict[str, CatalogModel] = {}
    for model in models():
        for name in (model.name, model.name.split("/")[-1], *model.aliases):
            index.setdefault(_key(name), model)
    return index


def find(name: str) -> CatalogModel | None:
    """The entry whose hub id, repo name or alias matches ``name`` (case, spaces, dashes and dots ignored)."""
    return _index().get(_key(name))


def close_matches(name: str, n: int = 5) -> tuple[str, ...]:
    """Catalog names closest to ``name``."""
    keys = _index()
    found = difflib.get_close_matches(_key(name), list(keys), n=n * 3, cutoff=0.6)
    names: list[str] = []
    for key in found:
        model = keys[key]
        if model.name not in names:
            names.append(model.name)
    return tuple(names[:n])
