"""The strategies a policy may name: the built-in ones, loaded on first use (importing the package stays cheap),
and those registered with :func:`~.base.register`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._exceptions import ConfigurationError
from .base import _SETTINGS, STRATEGIES, Closing, Pipeline, Strategy, Trigger
from .settings import Settings

__all__ = ["build_strategy", "closed", "load_builtin", "settings_model"]


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


def closed(pipeline: Pipeline) -> tuple[tuple[tuple[Strategy, Trigger], ...], Closing]:
    """The steps a fit runs and the window that closes them: the pipeline's ``closing``, else the settings of its
    last :class:`Closing` step (not run twice when it is the last step), else the plain sliding window."""
    steps = pipeline.steps
    if pipeline.closing is not None:
        return steps, pipeline.closing
    windows = [strategy for strategy, _ in steps if isinstance(strategy, Closing)]
    if not windows:
        from .sliding_window import PLAIN_WINDOW

        plain: Closing = PLAIN_WINDOW
        return steps, plain
    if steps and steps[-1][0] is windows[-1]:
        steps = steps[:-1]
    return steps, windows[-1]
