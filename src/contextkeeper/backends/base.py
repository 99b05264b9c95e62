"""What a backend is: one method, ``complete(request) -> Reply`` (or an awaitable of one), plus the registry that
picks the wrapper for a client.

The keeper holds policy (fitting, admission, recovery, the transcript); a backend holds I/O: it sends an already
fitted prompt and reports what came back. A wrapper gives the caller the client's own call shape around that.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..keeper import ContextKeeper

__all__ = ["Backend", "Reply", "Request", "register_wrapper", "wrap"]


@dataclass(frozen=True, kw_only=True)
class Reply:
    """What a backend got back. ``result`` goes to the caller unchanged; the rest feeds the report."""

    result: Any
    message: dict[str, Any] | None = None  # the assistant's message, for the transcript
    prompt_tokens: int | None = None  # the server's own count of the prompt (usage.prompt_tokens)
    completion_tokens: int | None = None
    cache_bytes: int | None = None  # local backends: the bytes the KV cache really held after the call
    pending: bool = False  # a stream: message and usage arrive later, through Request.finish


@dataclass(frozen=True, kw_only=True)
class Request:
    """One attempt of a wrapped call: the fitted prompt and the caller's other arguments."""

    messages: list[Any]  # the fitted prompt, in the caller's format
    tools: list[Any] | None
    max_tokens: int | None  # the caller's answer budget (None: the caller set none)
    params: dict[str, Any]  # every other argument of the call, as the caller gave it
    stream: bool = False
    finish: Callable[[Reply], None] = field(default=lambda reply: None, repr=False)  # streams call it at the end


class Backend(Protocol):
    """Sends a fitted prompt. ``server`` names where it goes: offsets and drift are learned per server."""

    server: str

    def complete(self, request: Request) -> Reply | Awaitable[Reply]: ...


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
    from .._exceptions import ConfigurationError
    from . import callable as _callable  # noqa: F401  (each module registers its wrapper on import)
    from . import openai as _openai  # noqa: F401
    from . import transformers as _transformers  # noqa: F401

    for accepts, build in _WRAPPERS:
        if accepts(client):
            return build(keeper, client, **options)
    raise ConfigurationError(
        f"cannot wrap a {type(client).__module__}.{type(client).__name__}: pass an openai.OpenAI or AsyncOpenAI "
        "client, a transformers model (with tokenizer=...) or text-generation pipeline, or a callable taking "
        "(messages, **kwargs)"
    )
