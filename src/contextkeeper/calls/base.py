"""What a backend is: one method, ``complete(request) -> Reply`` (or an awaitable of one).

The keeper holds policy (fitting, admission, recovery, the transcript); a backend holds I/O: it sends an already
fitted prompt and reports what came back. A wrapper gives the caller the client's own call shape around that.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..servers.kinds import kind_of_reply

if TYPE_CHECKING:
    pass

__all__ = ["Backend", "Reply", "Request", "reply_from", "usage_of"]


@dataclass(frozen=True, kw_only=True)
class Reply:
    """What a backend got back. ``result`` goes to the caller unchanged; the rest feeds the report."""

    result: Any
    message: dict[str, Any] | None = None  # the assistant's message, for the transcript
    prompt_tokens: int | None = None  # the server's own count of the prompt (usage.prompt_tokens)
    completion_tokens: int | None = None
    cache_bytes: int | None = None  # local backends: the bytes the KV cache really held after the call
    pending: bool = False  # a stream: message and usage arrive later, through Request.finish
    server_kind: str | None = None  # the server software, when the response tells (see .servers)
    # A stream that did not end normally: why (the exception that broke it, or a note such as "closed by the
    # caller"), with ``message`` holding what had arrived and ``chunks`` how many chunks reached the caller.
    error: BaseException | str | None = None
    chunks: int = 0


@dataclass(frozen=True, kw_only=True)
class Request:
    """One attempt of a wrapped call: the fitted prompt and the caller's other arguments."""

    messages: list[Any]  # the fitted prompt, in the caller's format
    tools: list[Any] | None
    max_tokens: int | None  # the caller's answer budget (None: the caller set none)
    params: dict[str, Any]  # every other argument of the call, as the caller gave it
    stream: bool = False
    # Streams call ``finish`` at their end (it returns the error to raise when the reply carries one) and ``renew``
    # with every chunk (the call's admission stays held while the stream is alive).
    finish: Callable[[Reply], BaseException | None] = field(default=lambda reply: None, repr=False)
    renew: Callable[[], None] = field(default=lambda: None, repr=False)


def _get(obj: Any, name: str) -> Any:
    """A field of an SDK object or of its plain-dict form."""
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


def usage_of(obj: Any) -> tuple[int | None, int | None]:
    """``(prompt_tokens, completion_tokens)`` from a response's or stream chunk's ``usage`` (None where absent)."""
    usage = _get(obj, "usage")
    if usage is None:
        return None, None
    prompt, completion = _get(usage, "prompt_tokens"), _get(usage, "completion_tokens")
    return (int(prompt) if prompt is not None else None, int(completion) if completion is not None else None)


def reply_from(result: Any) -> Reply:
    """A :class:`Reply` from text, a message dict, or an OpenAI-shaped response (SDK object or dict)."""
    if isinstance(result, str):
        return Reply(result=result, message={"role": "assistant", "content": result})
    if isinstance(result, dict) and "role" in result:
        return Reply(result=result, message=dict(result))
    choices = _get(result, "choices")
    message = None
    if choices:
        raw = _get(choices[0], "message")
        dump = getattr(raw, "model_dump", None)
        message = dict(dump(exclude_none=True)) if callable(dump) else dict(raw) if raw is not None else None
    prompt, completion = usage_of(result)
    return Reply(
        result=result,
        message=message,
        prompt_tokens=prompt,
        completion_tokens=completion,
        server_kind=kind_of_reply(result),
    )


class Backend(Protocol):
    """Sends a fitted prompt. ``server`` names where it goes: offsets and drift are learned per server. A backend
    may also have ``kind``: the server software its address suggests (see :mod:`.servers`)."""

    server: str

    def complete(self, request: Request) -> Reply | Awaitable[Reply]: ...
