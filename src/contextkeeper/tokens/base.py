"""The token-counting protocol and the measurement a counter reports."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "BatchTextCounting",
    "Forking",
    "Measurement",
    "Measuring",
    "MessagesLike",
    "PromptBounding",
    "TextBounding",
    "TextCounting",
    "TokenCounter",
    "ToolFreezing",
    "ToolsLike",
]

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


# Optional abilities. A counter needs only ``count``; one that also has any of these gets the keeper's fast paths
# for it (each is checked with isinstance, so a custom counter opts in by defining the method).


@runtime_checkable
class Measuring(Protocol):
    """Says what a count is made of (text and media tokens, notes): ``breakdown`` and the CLI report it."""

    def measure(
        self, messages: MessagesLike, *, tools: ToolsLike = None, add_generation_prompt: bool = True
    ) -> Measurement: ...


@runtime_checkable
class Forking(Protocol):
    """Makes a counter with the same tokenizer and settings and incremental state of its own: the keeper gives
    each conversation one, and counts small side parts on another, so no count disturbs another's reuse."""

    def fork(self) -> TokenCounter: ...


@runtime_checkable
class Forgetting(Protocol):
    """Drops the incremental state that holds the last prompt counted (its render, its messages), so a prompt that
    was refused is not kept alive until the next count; the next count starts from scratch (slower, not
    different)."""

    def forget(self) -> None: ...


@runtime_checkable
class TextCounting(Protocol):
    """Tokens of a snippet on its own (no template): strategies estimate what a cut or a summary leaves. Without
    it a snippet costs two prompt counts (the text in a user message, less the empty message)."""

    def text_tokens(self, text: str) -> int: ...


@runtime_checkable
class BatchTextCounting(Protocol):
    """:meth:`TextCounting.text_tokens` of many snippets, tokenized in one batch."""

    def text_tokens_many(self, texts: Sequence[str]) -> list[int]: ...


@runtime_checkable
class TextBounding(Protocol):
    """An upper bound on a snippet's tokens found without tokenizing (None: no bound known)."""

    def text_tokens_bound(self, text: str) -> int | None: ...


@runtime_checkable
class PromptBounding(Protocol):
    """An upper bound on :meth:`TokenCounter.count` found by rendering alone (None: no bound known): the keeper
    skips counting the never-trimmed parts when the bound shows they fit."""

    def bound(
        self, messages: MessagesLike, *, tools: ToolsLike = None, add_generation_prompt: bool = True
    ) -> int | None: ...


@runtime_checkable
class ToolFreezing(Protocol):
    """The counter's own copy of the tool schemas, compared with the caller's once per fit rather than once per
    count."""

    def freeze_tools(self, tools: ToolsLike) -> list[dict[str, Any]] | None: ...


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
