"""History strategies: one module each, registered by name, composed by policies (cheapest first)."""

from __future__ import annotations

import importlib

from ._embeddings import get_embedder
from .base import (
    STRATEGIES,
    Action,
    Always,
    FitState,
    Foresight,
    Item,
    LLMCall,
    OverBudget,
    Pipeline,
    Step,
    Strategy,
    StrategySettings,
    Trigger,
    TurnCount,
    build_strategy,
    register,
    run_async,
    run_sync,
    settings_model,
)

__all__ = [
    "STRATEGIES",
    "Action",
    "Always",
    "FitState",
    "Foresight",
    "Item",
    "LLMCall",
    "OverBudget",
    "Pipeline",
    "Step",
    "Strategy",
    "StrategySettings",
    "Trigger",
    "TurnCount",
    "build_strategy",
    "get_embedder",
    "register",
    "run_async",
    "run_sync",
    "settings_model",
]

# Each built-in strategy registers itself when its module is imported.
_BUILTIN = ("dedupe", "prune_tool_results", "truncate", "retrieval", "summarize", "sliding_window")


def _load_builtin() -> None:
    for name in _BUILTIN:
        try:
            importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
