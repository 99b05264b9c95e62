"""The strategies a policy may name: the built-in ones, loaded on first use (importing the package stays cheap),
and those registered with :func:`~.base.register`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._exceptions import ConfigurationError
from .base import _SETTINGS, STRATEGIES, Strategy
from .settings import Settings

__all__ = ["build_strategy", "load_builtin", "settings_model"]


def load_builtin() -> None:
    """Import the built-in strategies, each of which registers itself (once; later calls are free)."""
    from . import dedupe, prune_tool_results, retrieval, sliding_window, summarize, truncate  # noqa: F401


def settings_model(name: str) -> type[Settings]:
    """The settings model of the registered strategy ``name`` (its fields: the keys a policy step may set)."""
    load_builtin()
    if name not in _SETTINGS:
        raise ConfigurationError(
            f"unknown strategy {name!r}; registered strategies: {', '.join(sorted(STRATEGIES))}. "
            "Fix: use one of those names, or register your strategy (contextkeeper.strategies.register) first"
        )
    return _SETTINGS[name]


def build_strategy(
    name: str,
    settings: Mapping[str, Any] | None = None,
    *,
    where: str | None = None,
    error: type[ConfigurationError] | None = None,
) -> Strategy:
    """The registered strategy ``name`` configured with ``settings`` (checked against its settings model).

    A bad setting raises ``error`` (ConfigurationError) whose message starts with ``where`` (default
    ``strategy 'name'``) and names the key, the value and what is allowed."""
    model = settings_model(name)
    checked = model.checked(settings or {}, where=where or model.subject, error=error)
    cls = STRATEGIES[name]
    if cls is model:
        strategy: Strategy = checked  # type: ignore[assignment]
        return strategy
    try:
        strategy = cls(**{key: getattr(checked, key) for key in checked.model_fields_set})
    except (TypeError, ValueError) as exc:
        raise (error or ConfigurationError)(f"{where or model.subject}: {exc}") from None
    return strategy
