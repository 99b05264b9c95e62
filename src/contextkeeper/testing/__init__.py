"""pytest support for prompt budgets (the plugin registers itself through the ``pytest11`` entry point).

The fixtures ``prompt_budget`` and ``prompt_snapshot`` and the marker ``@pytest.mark.contextkeeper`` come with
the plugin (:mod:`contextkeeper.testing.plugin`); the classes below are what they hand out. They are imported on
first access, so that loading the plugin stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .budget import BudgetCheck, PromptBudget, explain_overflow
    from .settings import BudgetSettings
    from .snapshot import SnapshotStore, dump_fit

__all__ = ["BudgetCheck", "BudgetSettings", "PromptBudget", "SnapshotStore", "dump_fit", "explain_overflow"]

_WHERE = {
    "BudgetCheck": "budget",
    "PromptBudget": "budget",
    "explain_overflow": "budget",
    "BudgetSettings": "settings",
    "SnapshotStore": "snapshot",
    "dump_fit": "snapshot",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'contextkeeper.testing' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
