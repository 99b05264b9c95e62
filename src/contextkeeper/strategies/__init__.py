"""History strategies: one module each, registered by name, composed by policies (cheapest first)."""

from __future__ import annotations

from ._embeddings import get_embedder
from .base import (
    STRATEGIES,
    Action,
    Always,
    Closing,
    FitState,
    Foresight,
    Item,
    LLMCall,
    Memory,
    NeedsBackend,
    OverBudget,
    Pipeline,
    ReadsBeyond,
    Reapplying,
    Step,
    Strategy,
    StrategySettings,
    Trigger,
    TurnCount,
    register,
    run_async,
    run_sync,
)
from .registry import build_strategy, settings_model

__all__ = [
    "STRATEGIES",
    "Action",
    "Always",
    "Closing",
    "FitState",
    "Foresight",
    "Item",
    "LLMCall",
    "Memory",
    "NeedsBackend",
    "OverBudget",
    "Pipeline",
    "ReadsBeyond",
    "Reapplying",
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
