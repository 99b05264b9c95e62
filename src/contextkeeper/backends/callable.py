"""Plain callables: ``fn(messages, **kwargs)``, sync or async, returning text, a message dict or an
OpenAI-shaped response.

``keeper.wrap(fn)`` returns a callable with the same shape: ``wrapped(messages, **kwargs)`` (awaitable when
``fn`` is async) calls ``fn`` with the fitted messages and the caller's other arguments unchanged.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from ..calls.base import Reply, Request, reply_from
from ..calls.loop import Call, call_async, call_sync, options
from .registry import register_wrapper

if TYPE_CHECKING:
    from ..keeper import ContextKeeper

__all__ = ["CallableBackend"]


class CallableBackend:
    """Calls ``fn(fitted_messages, **kwargs)``."""

    def __init__(self, fn: Callable[..., Any], server: str | None = None) -> None:
        self.fn = fn
        self.server = server or getattr(fn, "__qualname__", None) or type(fn).__name__

    def complete(self, request: Request) -> Reply | Awaitable[Reply]:
        params = {k: v for k, v in request.params.items() if k != "messages"}
        result = self.fn(request.messages, **params)
        if inspect.isawaitable(result):
            return self._later(result)
        return reply_from(result)

    @staticmethod
    async def _later(result: Awaitable[Any]) -> Reply:
        return reply_from(await result)


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def wrap_callable(keeper: ContextKeeper, fn: Callable[..., Any], *, server: str | None = None, **given: Any) -> Any:
    """``fn`` with its own shape, fitted first; awaitable when ``fn`` is async."""
    backend = CallableBackend(fn, server)
    settings = options(**given)
    calls = keeper.calls

    def wrapped(messages: Any, **kwargs: Any) -> Any:
        return call_sync(Call(calls, backend, settings, messages, kwargs.get("tools"), kwargs))

    async def wrapped_async(messages: Any, **kwargs: Any) -> Any:
        return await call_async(Call(calls, backend, settings, messages, kwargs.get("tools"), kwargs))

    return functools.wraps(fn)(wrapped_async if _is_async(fn) else wrapped)


def _is_callable(client: Any) -> bool:
    return callable(client) and not hasattr(client, "generate") and not hasattr(client, "model")


register_wrapper(_is_callable)(wrap_callable)
