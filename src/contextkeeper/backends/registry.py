"""The registry that picks the wrapper for a client. The built-in facades register themselves when
:mod:`contextkeeper.backends` loads them; other packages may add their own."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._exceptions import ConfigurationError

if TYPE_CHECKING:
    from ..keeper import ContextKeeper

__all__ = ["register_wrapper", "wrap"]


# (accepts(client), build(keeper, client, options) -> wrapped client), tried in registration order.
_WRAPPERS: list[tuple[Callable[[Any], bool], Callable[..., Any]]] = []


def register_wrapper(accepts: Callable[[Any], bool]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a wrapper factory for the clients ``accepts`` recognises."""

    def decorate(build: Callable[..., Any]) -> Callable[..., Any]:
        _WRAPPERS.append((accepts, build))
        return build

    return decorate


def wrap(keeper: ContextKeeper, client: Any, **options: Any) -> Any:
    """``client`` with its own call shape, every call fitted by ``keeper`` (see :meth:`ContextKeeper.wrap`)."""
    for accepts, build in _WRAPPERS:
        if accepts(client):
            return build(keeper, client, **options)
    raise ConfigurationError(
        f"cannot wrap this {type(client).__module__}.{type(client).__name__}: pass an openai.OpenAI or AsyncOpenAI "
        "client, a transformers model (with tokenizer=...) or text-generation pipeline, or a callable taking "
        "(messages, **kwargs)"
    )
