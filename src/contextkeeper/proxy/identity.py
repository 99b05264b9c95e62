"""Which conversation a request belongs to: each conversation has its own session in the keeper, so a turn costs
what it costs alone, and the debug endpoint shows its latest fit.

In order: the ``X-Conversation-Id`` header, the request's ``user``, its ``prompt_cache_key``, else a hash of the
conversation's opening (every message up to and including the first user message: the system prompt and the
first question), which stays the same as the chat grows turn by turn.

Every id belongs to a tenant (see :mod:`.access`): the keeper's session and the transcript are keyed by
``<tenant>/<id>``, so two tenants that send the same id, or chats that open the same way, never share a
conversation. A derived id hashes the tenant and the ``user`` with the opening.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from .._exceptions import InvalidConversation

__all__ = ["HEADER", "MAX_LENGTH", "Identity", "InvalidConversation", "identify"]

HEADER = "x-conversation-id"
MAX_LENGTH = 256  # characters of a conversation id given by the client


@dataclass(frozen=True)
class Identity:
    """A conversation id and where it came from: ``header``, ``user``, ``prompt_cache_key`` or ``derived``;
    ``tenant``: whose it is. ``key`` is what the keeper and the transcript know it by."""

    id: str
    source: str
    tenant: str = "anonymous"

    @property
    def key(self) -> str:
        return f"{self.tenant}/{self.id}"

    @property
    def header_value(self) -> str:
        """The id as an HTTP header value (printable ASCII; anything else percent-encoded)."""
        return quote(self.id, safe="".join(chr(c) for c in range(0x21, 0x7F) if chr(c) != "%"))


def _given(value: Any, what: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidConversation(f"{what} must be a string naming the conversation, got {type(value).__name__}")
    text = value.strip()
    if not text:
        return None
    if len(text) > MAX_LENGTH:
        raise InvalidConversation(
            f"{what} is {len(text):,} characters long; a conversation id is at most {MAX_LENGTH}. Fix: send a "
            "shorter id (a UUID, a hash)"
        )
    return text


def identify(headers: Mapping[str, str], body: Mapping[str, Any], tenant: str = "anonymous") -> Identity:
    """The conversation of a chat request of ``tenant`` (see the module docstring)."""
    for source, value, what in (
        ("header", headers.get(HEADER), "the X-Conversation-Id header"),
        ("user", body.get("user"), "the request's user"),
        ("prompt_cache_key", body.get("prompt_cache_key"), "the request's prompt_cache_key"),
    ):
        given = _given(value, what)
        if given is not None:
            return Identity(given, source, tenant)
    user = body.get("user")
    return Identity(derived(body.get("messages"), tenant=tenant, user=user), "derived", tenant)


def derived(messages: Any, *, tenant: str = "anonymous", user: Any = None) -> str:
    """A stable id from the conversation's opening (the messages up to and including the first user message),
    its tenant and its ``user``."""
    opening: list[Any] = []
    for message in messages if isinstance(messages, list) else ():
        opening.append(message)
        if isinstance(message, Mapping) and message.get("role") == "user":
            break
    text = json.dumps([tenant, user, opening], sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)
    # surrogatepass: a caller that did not check its input still gets an id (the proxy refuses such bodies first)
    return "conv-" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:24]
