"""What the proxy answers when a chat request fails, in OpenAI's error shape
(``{"error": {"message", "type", "param", "code"}}``), looked up by exception class along the MRO.

A request the keeper cannot fit (too large on its own, malformed messages, a template that raises) is a 400 with
the keeper's message. An upstream error that the keeper passes back unchanged (a 401, a 404, a 400 that is no
refusal for length) keeps its status and its body. What the keeper gave up on after its retries keeps the
upstream's status (a 503 stays a 503; a timeout is a 504, a connection that failed a 502) with the keeper's
message, which says what was tried. An upstream's ``Retry-After`` (a 429's, a 503's) is passed on. What fails on our
side of the proxy (the KV ledger's Redis, the shared state's Redis, the transcript's Postgres) is a 503 with its own
code, never blamed on the upstream.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._exceptions import (
    ConfigurationError,
    ContextLengthExceeded,
    CountingError,
    InvariantViolation,
    MessageError,
    OutOfMemory,
    RequestRejected,
    RequestTooLarge,
    TranscriptUnavailable,
    TransportError,
)
from ..calls.ledger import AdmissionTimeout, ExceedsCapacity
from ..calls.redis_ledger import LedgerUnavailable
from ..calls.shared import SharedUnavailable

__all__ = ["ErrorReply", "error_body", "error_reply"]

log = logging.getLogger("contextkeeper.proxy")


@dataclass(frozen=True)
class ErrorReply:
    """A failed request's answer: status, JSON body, extra headers."""

    status: int
    body: bytes
    headers: Mapping[str, str]
    code: str  # for observers: what kind of failure ("request_too_large", "upstream", ...)


@dataclass(frozen=True)
class _Kind:
    status: int  # when the upstream gave none
    type: str
    code: str
    param: str | None = None
    upstream_status: bool = False  # keep the status of the upstream error that caused it, when there is one
    retry_after: str | None = None


# Our errors, by class (the first along the MRO wins).
_KINDS: dict[type[BaseException], _Kind] = {
    RequestTooLarge: _Kind(400, "invalid_request_error", "request_too_large", "messages"),
    MessageError: _Kind(400, "invalid_request_error", "invalid_messages", "messages"),
    CountingError: _Kind(400, "invalid_request_error", "cannot_count", "messages"),
    ConfigurationError: _Kind(400, "invalid_request_error", "invalid_request"),
    ExceedsCapacity: _Kind(400, "invalid_request_error", "exceeds_kv_capacity", "max_tokens"),
    AdmissionTimeout: _Kind(503, "server_error", "kv_capacity_busy", retry_after="1"),
    ContextLengthExceeded: _Kind(400, "invalid_request_error", "context_length_exceeded", "messages", True),
    OutOfMemory: _Kind(503, "server_error", "out_of_memory"),
    # Ours, not the upstream's: the proxy's own stores (checked before TransportError, their base, along the MRO).
    LedgerUnavailable: _Kind(503, "server_error", "ledger_unavailable", retry_after="1"),
    SharedUnavailable: _Kind(503, "server_error", "shared_state_unavailable", retry_after="1"),
    TranscriptUnavailable: _Kind(503, "server_error", "transcript_unavailable", retry_after="1"),
    TransportError: _Kind(502, "server_error", "upstream_unavailable", upstream_status=True),
    InvariantViolation: _Kind(500, "server_error", "invariant_violation"),
}

# Upstream failures without a status of their own, by SDK class name (no SDK import needed).
_TRANSPORT_STATUS = {"APITimeoutError": 504, "TimeoutException": 504, "TimeoutError": 504}


def error_body(message: str, *, type: str, code: str | None, param: str | None = None) -> bytes:
    """OpenAI's error shape."""
    return json.dumps({"error": {"message": message, "type": type, "param": param, "code": code}}).encode()


def _upstream_status(exc: BaseException) -> int | None:
    """The HTTP status of the upstream error behind ``exc`` (walking its causes), if it had one."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        status = getattr(cause, "status_code", None)
        if isinstance(status, int) and status >= 400:
            return status
        for klass in type(cause).__mro__:
            if klass.__name__ in _TRANSPORT_STATUS:
                return _TRANSPORT_STATUS[klass.__name__]
        cause = cause.__cause__ or getattr(cause, "cause", None)
    return None


def _retry_after(exc: BaseException) -> str | None:
    """The upstream's ``Retry-After`` behind ``exc`` (walking its causes), as it sent it."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        response: Any = getattr(cause, "response", None)
        headers = getattr(response, "headers", None)
        value = headers.get("retry-after") if headers is not None else None
        if isinstance(value, str) and value.strip() and len(value) < 64 and value.isprintable():
            return value.strip()
        cause = cause.__cause__ or getattr(cause, "cause", None)
    return None


def _passed_back(exc: BaseException) -> ErrorReply | None:
    """An upstream HTTP error the keeper does not act on (openai's APIStatusError): its status and body as sent."""
    status = getattr(exc, "status_code", None)
    response: Any = getattr(exc, "response", None)
    if not isinstance(status, int) or response is None:
        return None
    content = getattr(response, "content", b"") or b""
    headers = {"content-type": response.headers.get("content-type", "application/json")}
    retry = _retry_after(exc)
    if retry is not None:
        headers["retry-after"] = retry
    if not content:
        content = error_body(str(exc), type="upstream_error", code=str(status))
        headers["content-type"] = "application/json"
    return ErrorReply(status=status, body=bytes(content), headers=headers, code="upstream")


def error_reply(exc: BaseException) -> ErrorReply:
    """The answer to a chat request that raised ``exc``."""
    if isinstance(exc, RequestRejected):
        return ErrorReply(
            status=exc.status,
            body=error_body(str(exc), type="invalid_request_error", code=exc.code, param=exc.param),
            headers={},
            code=exc.code,
        )
    for klass in type(exc).__mro__:
        kind = _KINDS.get(klass)
        if kind is None:
            continue
        status = kind.status
        if kind.upstream_status:
            status = _upstream_status(exc) or status
        headers = {"retry-after": kind.retry_after} if kind.retry_after else {}
        if kind.upstream_status:
            retry = _retry_after(exc)
            if retry is not None:
                headers["retry-after"] = retry
        message = " ".join(str(exc).split()) or type(exc).__name__
        return ErrorReply(
            status=status,
            body=error_body(message, type=kind.type, code=kind.code, param=kind.param),
            headers=headers,
            code=kind.code,
        )
    passed = _passed_back(exc)
    if passed is not None:
        return passed
    log.error("chat request failed in the proxy", exc_info=exc)
    message = f"the proxy failed: {type(exc).__name__}: {' '.join(str(exc).split())[:500]}"
    return ErrorReply(
        status=500, body=error_body(message, type="server_error", code="proxy_error"), headers={}, code="proxy_error"
    )
