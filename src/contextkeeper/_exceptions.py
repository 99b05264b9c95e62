"""The contextkeeper error tree.

Every error says what went wrong, by how much where a number applies, and which setting fixes it.

```
ContextKeeperError
├── ConfigurationError
│   ├── TokenizerNotFound          the tokenizer spec names nothing we can load
│   ├── ModelConfigError           a model config that is malformed, incomplete or has an unknown layer kind
│   ├── UnknownModel               a model name that is no file, folder, cached hub id or catalog entry
│   └── UnknownGPU                 a GPU name not in the catalog (.matches: the closest names)
├── MessageError                   .index: the offending message's position (None: the list itself)
│   ├── InvalidMessage             unknown role, bad content type, missing id, malformed tool call
│   ├── OrphanToolResult           a tool result whose call id no earlier assistant message made
│   └── MissingToolResult          an assistant's tool calls without results before the next turn
└── CountingError
    ├── ChatTemplateError          no template, or the template raised (its own message is kept)
    └── UnsupportedContent         a content part we cannot count and no per-part cost was set
```
"""

from __future__ import annotations

__all__ = [
    "ChatTemplateError",
    "ConfigurationError",
    "ContextKeeperError",
    "CountingError",
    "InvalidMessage",
    "MessageError",
    "MissingToolResult",
    "ModelConfigError",
    "OrphanToolResult",
    "TokenizerNotFound",
    "UnknownGPU",
    "UnknownModel",
    "UnsupportedContent",
]


class ContextKeeperError(Exception):
    """Base of every error contextkeeper raises."""


class ConfigurationError(ContextKeeperError):
    """A setting is missing, contradictory or names something that does not exist."""


class TokenizerNotFound(ConfigurationError):
    """The tokenizer spec (folder, .gguf file, hub id or ``mistral:<name>``) could not be loaded."""


class ModelConfigError(ConfigurationError, ValueError):
    """A model config we cannot use: malformed JSON, a missing or non-positive size, an unknown layer kind."""


class _WithMatches(ConfigurationError, LookupError):
    """A name that matched nothing; ``matches`` holds the closest known names (possibly empty)."""

    def __init__(self, message: str, *, matches: tuple[str, ...] = ()) -> None:
        self.matches = tuple(matches)
        if self.matches:
            message = f"{message.rstrip('.')}. Did you mean: {', '.join(self.matches)}?"
        super().__init__(message)


class UnknownModel(_WithMatches):
    """A model name that is no config file or folder, no reachable or cached hub id and no catalog entry."""


class UnknownGPU(_WithMatches):
    """A GPU name that is not in the catalog."""


class MessageError(ContextKeeperError, ValueError):
    """A message list that is not a valid chat. ``index`` is the offending message's position."""

    def __init__(self, message: str, *, index: int | None = None, fix: str | None = None) -> None:
        self.index = index
        self.fix = fix
        where = f"message {index}: " if index is not None else ""
        text = f"{where}{message}"
        if fix:
            text = f"{text.rstrip('.')}. Fix: {fix}"
        super().__init__(text)


class InvalidMessage(MessageError):
    """A single message is malformed (role, content, tool call shape, ids)."""


class OrphanToolResult(MessageError):
    """A tool result refers to a call that no earlier assistant message made."""


class MissingToolResult(MessageError):
    """An assistant's tool calls lack results before the conversation moves on."""


class CountingError(ContextKeeperError):
    """Tokens could not be counted."""


class ChatTemplateError(CountingError):
    """The tokenizer has no chat template, or the template raised while rendering.

    ``template_message`` is the template's own error text, unchanged.
    """

    def __init__(self, message: str, *, template_message: str | None = None) -> None:
        self.template_message = template_message
        super().__init__(message)


class UnsupportedContent(CountingError):
    """A content part whose token cost is unknown for this model and was not configured."""
