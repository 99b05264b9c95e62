"""The token-counting protocol and the measurement a counter reports."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = ["Measurement", "MessagesLike", "TokenCounter", "ToolsLike"]

MessagesLike = Sequence[Any]
"""OpenAI-format message dicts, HF-style dicts, ``Message`` objects or a ``Conversation``."""

ToolsLike = Sequence[Mapping[str, Any]] | None
"""OpenAI tool schemas (``{"type": "function", "function": {...}}``)."""


@runtime_checkable
class TokenCounter(Protocol):
    """Counts the tokens a model sees for a whole prompt.

    Only a list-level count is exact once a chat template is applied (templates add headers, move tools
    into messages, drop reasoning from earlier turns), so there is deliberately no per-message method.
    """

    def count(self, messages: MessagesLike, *, tools: ToolsLike = None, add_generation_prompt: bool = True) -> int:
        """The number of prompt tokens for ``messages`` and ``tools``."""
        ...


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """One count, with what it is made of.

    ``tokens`` is exact unless ``estimated`` is set; then ``media_tokens`` (the per-part costs of images,
    audio and other non-text parts) is the estimated share and ``notes`` says which rule priced them.
    """

    tokens: int
    text_tokens: int
    media_tokens: int = 0
    media_parts: int = 0
    estimated: bool = False
    notes: tuple[str, ...] = field(default=())
