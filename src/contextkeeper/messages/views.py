"""Views of a conversation: the caller's own format (``raw_view``) and what an OpenAI-compatible server renders
(``server_view``: arguments as objects, empty tool-call lists dropped)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from .base import ContentFormat
from .conversation import Conversation
from .models import ContentPart, Message, MessageLike, ToolCall

__all__ = ["raw_view", "server_view", "server_view_message"]


def _as_conversation(conversation: Conversation | Sequence[MessageLike]) -> Conversation:
    return Conversation.from_messages(conversation)


def _without_none(data: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in data.items() if value is not None}


def raw_view(conversation: Conversation | Sequence[MessageLike]) -> list[dict[str, Any]]:
    """New plain dicts with top-level None values dropped and nothing else changed.

    This is what transformers' ``apply_chat_template`` hands to the template.
    """
    return [_without_none(message.to_dict()) for message in _as_conversation(conversation)]


def _parse_arguments(arguments: Any) -> Any:
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        # vLLM renders arguments that are not valid JSON (and "") as an empty object.
        return {}


# Keys an OpenAI-compatible server passes to the template besides role and content. Reasoning is kept under
# every name clients use for it (vLLM reads ``reasoning``; DeepSeek-style clients send ``reasoning_content``).
_SERVER_KEYS = frozenset({"name", "tool_calls", "tool_call_id", "reasoning", "reasoning_content", "thinking"})

# Those among Message's fields, in their order.
_SERVER_FIELDS = tuple(key for key in Message.model_fields if key in _SERVER_KEYS)


def server_view(
    conversation: Conversation | Sequence[MessageLike], *, content_format: ContentFormat = "string"
) -> tuple[list[dict[str, Any]], list[tuple[int, ContentPart]]]:
    """The messages as an OpenAI-compatible server (vLLM) hands them to the chat template.

    Returns new plain dicts and, for each non-text part taken out of them, ``(message index, part)``; the
    caller counts those separately. Following vLLM's ``parse_chat_messages``:

    * tool-call ``arguments`` JSON strings become objects (``{}`` when the string is not valid JSON);
    * an empty ``tool_calls`` list is dropped, as are top-level keys whose value is None and keys the server
      does not read (anything but name, tool_calls, tool_call_id and the reasoning fields);
    * ``"string"``: the text of the content (text-like parts joined with ``"\\n"``) as one string;
      missing or None content becomes ``""``;
    * ``"openai"``: content as a list of ``{"type": "text", "text": ...}`` parts (a string becomes one part,
      missing or None content ``[]``); a tool result without media parts becomes one string.
    """
    if content_format not in ("string", "openai"):
        raise ValueError(f"content_format must be 'string' or 'openai', got {content_format!r}")
    view: list[dict[str, Any]] = []
    removed: list[tuple[int, ContentPart]] = []
    for index, message in enumerate(_as_conversation(conversation)):
        data, media = server_view_message(message, content_format=content_format)
        view.append(data)
        removed.extend((index, part) for part in media)
    return view, removed


def _server_calls(calls: list[ToolCall] | None) -> list[dict[str, Any]] | None:
    """The server's dicts of tool calls in the OpenAI shape with JSON-string arguments and nothing else (``[]``
    for none), or None for any other call, which the general path handles."""
    if not calls:
        return []
    out: list[dict[str, Any]] = []
    for call in calls:
        function = call.function
        if call._flat or call.__pydantic_extra__ or function.__pydantic_extra__ or type(function.arguments) is not str:
            return None
        given = call.model_fields_set  # as model_dump(exclude_unset=True): unset keys are left out
        item: dict[str, Any] = {}
        if "id" in given:
            item["id"] = call.id
        if "type" in given:
            item["type"] = call.type
        item["function"] = {"name": function.name, "arguments": _parse_arguments(function.arguments)}
        out.append(item)
    return out


def server_view_message(
    message: Message, *, content_format: ContentFormat = "string"
) -> tuple[dict[str, Any], list[ContentPart]]:
    """One message of :func:`server_view`: its new plain dict and the non-text parts taken out of it."""
    given = message.content
    if (
        (type(given) is str or given is None)
        and not message.__pydantic_extra__
        and (calls := _server_calls(message.tool_calls)) is not None
    ):
        # Strings, None and OpenAI-shaped calls (most messages): the dict the reference builds, key order
        # included.
        content: str | list[dict[str, str]]
        if content_format == "string" or message.role == "tool":
            content = given or ""
        else:
            content = [] if given is None else [{"type": "text", "text": given}]
        data: dict[str, Any] = {"role": message.role, "content": content}
        for key in _SERVER_FIELDS:
            if key == "tool_calls":
                if calls:
                    data[key] = calls
            elif (value := getattr(message, key)) is not None:
                data[key] = value
        return data, []
    return _server_view_message_reference(message, content_format=content_format)


def _server_view_message_reference(
    message: Message, *, content_format: ContentFormat = "string"
) -> tuple[dict[str, Any], list[ContentPart]]:
    """:func:`server_view_message` for every message, from pydantic's dump of it."""
    data = _without_none(message._to_dict_reference())
    data.pop("content", None)
    texts: list[str] = []
    media: list[ContentPart] = []
    if isinstance(message.content, str):
        texts.append(message.content)
    elif message.content is not None:
        for part in message.content:
            if not part.is_text:
                media.append(part)
            elif (text := part.as_text()) is not None:
                # A text-like part without its text is skipped, as vLLM does.
                texts.append(text)
    content: str | list[dict[str, str]]
    # Recent vLLM also flattens a tool result to one string unless it holds media.
    if content_format == "string" or (message.role == "tool" and not media):
        content = "\n".join(texts)
    else:
        content = [{"type": "text", "text": text} for text in texts]
    # vLLM builds each message as role, content, then the keys it knows; anything else is not sent on.
    data = {"role": data.pop("role"), "content": content, **{k: v for k, v in data.items() if k in _SERVER_KEYS}}
    if "tool_calls" in data:
        if not data["tool_calls"]:
            del data["tool_calls"]
        else:
            for call in data["tool_calls"]:
                holder = call["function"] if isinstance(call.get("function"), dict) else call
                holder["arguments"] = _parse_arguments(holder.get("arguments"))
    return data, media
