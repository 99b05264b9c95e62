"""The data every layer speaks: validated OpenAI-format chat messages.

The package in parts: :mod:`.guard` (hostile input), :mod:`.models` (parts, tool calls, ``Message``),
:mod:`.conversation` (``Conversation`` and its units), :mod:`.views` (the caller's and the server's views),
:mod:`.wording` (error wording) over :mod:`.base`.

Every input shape we accept round-trips unchanged: ``Message.from_dict(d).to_dict() == d``. Fields the caller
did not give are never added, explicit ``None`` values are kept, and unknown keys survive (``extra="allow"``).
Key order follows the model's field order, then unknown keys in input order.

Tool calls come in two shapes:

* OpenAI: ``{"id": ..., "type": "function", "function": {"name": ..., "arguments": "<JSON string>"}}``;
* Hugging Face: ``{"type": "function", "function": {"name": ..., "arguments": {...}}}`` or the flat
  ``{"name": ..., "arguments": {...}}``, often without ids.

``arguments`` given as a string is not required to be valid JSON: servers accept such requests, so rejecting
them here would make us stricter than the thing we model. :meth:`ToolCall.arguments_as_object` returns such a
string unchanged; :func:`server_view` turns it into ``{}`` as vLLM does.
"""

from __future__ import annotations

from .base import VALID_ROLES, ContentFormat, Role, UnitKind
from .conversation import Conversation, Unit
from .guard import MAX_DEPTH, MAX_REPEATED, check_text, check_tools, surrogate_at
from .models import (
    ContentPart,
    FilePart,
    FileRef,
    FunctionCall,
    ImageURL,
    ImageURLPart,
    InputAudio,
    InputAudioPart,
    MediaPart,
    Message,
    MessageLike,
    TextPart,
    ToolCall,
)
from .views import raw_view, server_view, server_view_message

__all__ = [
    "MAX_DEPTH",
    "MAX_REPEATED",
    "VALID_ROLES",
    "ContentFormat",
    "ContentPart",
    "Conversation",
    "FilePart",
    "FileRef",
    "FunctionCall",
    "ImageURL",
    "ImageURLPart",
    "InputAudio",
    "InputAudioPart",
    "MediaPart",
    "Message",
    "MessageLike",
    "Role",
    "TextPart",
    "ToolCall",
    "Unit",
    "UnitKind",
    "check_text",
    "check_tools",
    "raw_view",
    "server_view",
    "server_view_message",
    "surrogate_at",
]
