"""The caller's messages read as they came, before validation: role, text and tool calls as the fit's horizon
measures them, and the fingerprint a window state names them by. Shared by the engine and the session."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

__all__ = ["fingerprint", "role_of", "texts_of"]


def role_of(message: Any) -> str:
    role = message.get("role") if isinstance(message, dict) else getattr(message, "role", None)
    return str(role) if role is not None else ""


def texts_of(message: Any) -> tuple[str, str]:
    """A message's text as the horizon measures it: its content, and its tool calls (names and arguments).
    Read before the message is validated, so only strings are taken as they are: a part or an argument that
    is not a string stands for a fixed size (written out, a caller's data could be any size: a structure that
    holds one list in many places would be written out once per path)."""
    content = message.get("content") if isinstance(message, dict) else getattr(message, "content", None)
    if isinstance(content, str):
        text = content
    elif isinstance(content, (list, tuple)):
        text = "".join(_part_text(part) for part in content[:_PARTS])
    else:
        text = ""
    calls = message.get("tool_calls") if isinstance(message, dict) else getattr(message, "tool_calls", None)
    if not isinstance(calls, (list, tuple)) or not calls:
        return text, ""
    return text, "".join(_call_text(call) for call in calls[:_PARTS])


_PARTS = 256  # content parts or tool calls measured per message (the rest are validated, then counted)
_OPAQUE = " " * 16  # what a part or an argument that is not a string stands for


def _part_text(part: Any) -> str:
    value = part.get("text") if isinstance(part, dict) else part if isinstance(part, str) else None
    return value if isinstance(value, str) else _OPAQUE


def _call_text(call: Any) -> str:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return _OPAQUE
    name, arguments = function.get("name"), function.get("arguments")
    # Written as templates write a call (most as JSON), so it is measured and weighed as that text.
    name = name if isinstance(name, str) else ""
    arguments = arguments if isinstance(arguments, str) else _OPAQUE * 4
    return '{"name": "' + name + '", "arguments": ' + arguments + "}\n"


def fingerprint(messages: Sequence[Any], start: int, length: int) -> str:
    """A hash of the caller's messages at ``start`` and ``length - 1`` (role, text, tool calls), as a window state
    names them (see :class:`~contextkeeper.fit.session.WindowState`)."""
    digest = hashlib.sha256(b"contextkeeper.window/1\n")
    for index in (start, length - 1):
        message = messages[index]
        text, calls = texts_of(message)
        digest.update(f"{index}\x1e{role_of(message)}\x1e{text}\x1e{calls}\x1f".encode("utf-8", "surrogatepass"))
    return digest.hexdigest()
