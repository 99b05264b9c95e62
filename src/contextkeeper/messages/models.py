"""Validated OpenAI-format messages: content parts, tool calls and ``Message``, and the parse memo that validates each
caller's dict once."""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Mapping
from typing import Any, Literal, TypeAlias

from pydantic import (
    ModelWrapValidatorHandler,
    PrivateAttr,
    SerializeAsAny,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from contextkeeper._exceptions import InvalidMessage
from contextkeeper._memo import IdentityMemo, data_size, same_values

from .base import _MODEL_BYTES, _SCALARS, _TEXT_FIELDS, VALID_ROLES, Role, _fail, _Model
from .guard import (
    _DEPTH_FIX,
    _ESCAPED_LONE,
    _SURROGATE_FIX,
    MAX_DEPTH,
    _children,
    _depth,
    _nesting,
    _shape_problem,
    _where,
    find_problem,
)
from .wording import _describe

__all__ = [
    "ContentPart",
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
    "TextPart",
    "ToolCall",
]


class ImageURL(_Model):
    """``image_url`` of an ``image_url`` part: a URL or a ``data:`` URL, and the optional ``detail``."""

    url: str
    detail: str | None = None


class InputAudio(_Model):
    """``input_audio`` of an ``input_audio`` part: base64 ``data`` and its ``format`` (``wav``, ``mp3``)."""

    data: str
    format: str


class FileRef(_Model):
    """``file`` of a ``file`` part: an uploaded ``file_id`` or inline ``file_data`` with its ``filename``."""

    file_id: str | None = None
    file_data: str | None = None
    filename: str | None = None


class ContentPart(_Model):
    """One element of a content list. ``type`` picks the shape; parts of unknown types keep all their keys."""

    type: str

    @property
    def is_text(self) -> bool:
        """Whether a server renders this part as text (``text``, ``input_text``, ``refusal``, ...)."""
        return self.type in _TEXT_FIELDS

    def as_text(self) -> str | None:
        """The text of a text-like part, or None for media and other parts."""
        field = _TEXT_FIELDS.get(self.type)
        if field is None:
            return None
        value = getattr(self, field, None)
        return value if isinstance(value, str) else None


class TextPart(ContentPart):
    """``{"type": "text", "text": ...}``."""

    type: Literal["text"]
    text: str


class ImageURLPart(ContentPart):
    """OpenAI image: ``{"type": "image_url", "image_url": {"url": ..., "detail"?: ...}}``."""

    type: Literal["image_url"]
    image_url: ImageURL


class InputAudioPart(ContentPart):
    """OpenAI audio: ``{"type": "input_audio", "input_audio": {"data": ..., "format": ...}}``."""

    type: Literal["input_audio"]
    input_audio: InputAudio


class FilePart(ContentPart):
    """OpenAI file: ``{"type": "file", "file": {"file_id" | "file_data", "filename"?}}``."""

    type: Literal["file"]
    file: FileRef


class MediaPart(ContentPart):
    """Hugging Face media: ``{"type": "image" | "audio" | "video", ...}``; the payload keys are free-form."""

    type: Literal["image", "audio", "video"]


_PART_CLASSES: dict[str, type[ContentPart]] = {
    "text": TextPart,
    "image_url": ImageURLPart,
    "input_audio": InputAudioPart,
    "file": FilePart,
    "image": MediaPart,
    "audio": MediaPart,
    "video": MediaPart,
}

_PART_FIX = (
    'give each part a "type", e.g. {"type": "text", "text": "..."} or '
    '{"type": "image_url", "image_url": {"url": "..."}}'
)


def _validate_part(part: Any, position: int) -> ContentPart:
    where = f"content[{position}]"
    if isinstance(part, ContentPart):
        return part
    if not isinstance(part, dict):
        raise _fail(f"a content part must be an object, got {type(part).__name__}", _PART_FIX, where)
    part_type = part.get("type")
    if part_type is None:
        raise _fail("content part has no 'type'", _PART_FIX, where)
    if not isinstance(part_type, str):
        raise _fail(f"content part 'type' must be a string, got {type(part_type).__name__}", _PART_FIX, where)
    cls = _PART_CLASSES.get(part_type, ContentPart)
    try:
        return cls.model_validate(part)
    except ValidationError as exc:
        text, fix = _describe(exc, prefix=where)
        # The location is already part of ``text``.
        raise _fail(f"{text} (in a {part_type!r} part)", fix or "", where="") from None


class FunctionCall(_Model):
    """The called function: ``name`` and ``arguments`` (a JSON string, OpenAI; or an object, Hugging Face).

    A string that is not valid JSON is accepted: servers take it too.
    """

    name: str
    arguments: str | dict[str, Any]

    @model_validator(mode="before")
    @classmethod
    def _check_shape(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if "name" not in data or data["name"] is None:
            raise _fail(
                "tool call has no function name (function.name missing)",
                "set function.name to the name of the called tool",
            )
        if "arguments" not in data:
            raise _fail(
                "tool call has no arguments",
                'add "arguments": a JSON string such as "{}" (OpenAI) or an object (Hugging Face)',
            )
        arguments = data["arguments"]
        if not isinstance(arguments, (str, dict)):
            raise _fail(
                f"tool call arguments must be a JSON string or an object, got {type(arguments).__name__}",
                "pass arguments as json.dumps(...) or as a dict",
            )
        return data


class ToolCall(_Model):
    """One tool call of an assistant message.

    The flat Hugging Face shape ``{"name": ..., "arguments": ...}`` is read into ``function`` and written back
    flat by :meth:`Message.to_dict`.
    """

    id: str | None = None
    type: str = "function"
    function: FunctionCall

    # True when the input had no "function" wrapper: dumping restores that shape.
    _flat: bool = PrivateAttr(default=False)

    @model_validator(mode="wrap")
    @classmethod
    def _accept_shapes(cls, data: Any, handler: ModelWrapValidatorHandler[ToolCall]) -> ToolCall:
        flat = False
        if isinstance(data, dict) and "function" not in data:
            if "name" not in data and "arguments" not in data:
                raise _fail(
                    "tool call has neither a 'function' object nor 'name'/'arguments' keys",
                    'use {"id": ..., "type": "function", "function": {"name": ..., "arguments": ...}}',
                )
            flat = True
            function = {key: data[key] for key in ("name", "arguments") if key in data}
            data = {key: value for key, value in data.items() if key not in function}
            data["function"] = function
        call = handler(data)
        if flat:
            call._flat = True
        if isinstance(call.function.arguments, str) and call.id is None:
            raise _fail(
                "tool call with JSON-string arguments (OpenAI format) is missing id",
                'give the call an "id" (e.g. "call_1") and answer it with a tool message carrying that '
                "tool_call_id, or pass arguments as a dict for id-less Hugging Face calls",
            )
        return call

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> Any:
        out = handler(self)
        if not self._flat or not isinstance(out, dict) or not isinstance(out.get("function"), dict):
            return out
        flat: dict[str, Any] = {}
        for key, value in out.items():
            if key == "function":
                flat.update(value)
            else:
                flat[key] = value
        return flat

    @property
    def name(self) -> str:
        """The called function's name."""
        return self.function.name

    def arguments_as_object(self) -> Any:
        """The arguments as a JSON value: a JSON string is parsed (and returned unchanged if it is not JSON).

        Object arguments come back as a copy, so changing the result never changes this frozen call.
        """
        arguments = self.function.arguments
        if isinstance(arguments, str):
            try:
                return json.loads(arguments)
            except json.JSONDecodeError:
                return arguments
        return copy.deepcopy(arguments)


_CONTENT_FIX = 'pass text as a string, or a list of parts such as [{"type": "text", "text": "..."}]'


class Message(_Model):
    """One chat message in OpenAI format (with the Hugging Face variants). Unknown keys are kept."""

    role: Role
    content: str | list[SerializeAsAny[ContentPart]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    thinking: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _check_role(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        roles = ", ".join(VALID_ROLES)
        if "role" not in data:
            raise _fail("message has no role", f"add a 'role': one of {roles}")
        role = data["role"]
        if not isinstance(role, str) or role not in VALID_ROLES:
            raise _fail(f"unknown role {role!r}; valid roles are {roles}", f"set 'role' to one of {roles}")
        return data

    @field_validator("content", mode="before")
    @classmethod
    def _check_content(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list):
            return [_validate_part(part, position) for position, part in enumerate(value)]
        fix = "wrap the part in a list: [part]" if isinstance(value, dict) else _CONTENT_FIX
        raise _fail(f"must be a string, a list of content parts, or None; got {type(value).__name__}", fix)

    @model_validator(mode="after")
    def _check_calls(self) -> Message:
        if not self.tool_calls:
            return self
        if self.role != "assistant":
            raise _fail(
                f"a {self.role} message carries tool_calls; only assistant messages make tool calls",
                "move the tool calls to an assistant message",
            )
        first_seen: dict[str, int] = {}
        for position, call in enumerate(self.tool_calls):
            if call.id is None:
                continue
            if call.id in first_seen:
                raise _fail(
                    f"duplicate tool call id {call.id!r} in tool_calls[{first_seen[call.id]}] and "
                    f"tool_calls[{position}]",
                    "give every tool call of a message its own id",
                    where="tool_calls",
                )
            first_seen[call.id] = position
        return self

    @model_validator(mode="after")
    def _check_text(self) -> Message:
        # Once per message, at construction (messages are frozen): every string and key, every nesting level.
        problem = find_problem(self, MAX_DEPTH)
        if problem is not None:
            where, what, fix = problem
            raise _fail(what, fix, where=where)
        for position, call in enumerate(self.tool_calls or ()):
            arguments = call.function.arguments
            # JSON-string arguments are parsed before the template sees them (by the server, and by the counter's
            # server view): an escaped lone surrogate ("\ud800") comes out as one.
            if type(arguments) is str and "\\u" in arguments and (found := _ESCAPED_LONE.search(arguments)):
                try:
                    parsed = json.loads(arguments)
                except ValueError:
                    continue  # not JSON: the server view sends {} instead
                if find_problem(parsed, MAX_DEPTH) is not None:
                    raise _fail(
                        f"holds the JSON escape {found.group(0)!r} of a lone surrogate at character "
                        f"{found.start()} (of {len(arguments)}); parsed, as servers parse arguments, it is not valid "
                        "Unicode, so no tokenizer or server can encode it as UTF-8",
                        _SURROGATE_FIX,
                        where=f"tool_calls[{position}].function.arguments",
                    )
        return self

    @classmethod
    def from_dict(cls, data: MessageLike) -> Message:
        """Validate one message: a dict, a :class:`Message`, or an object with ``model_dump()`` (openai SDK).

        The input is deep-copied first, so the frozen message never shares mutable state with the caller.
        Raises :class:`InvalidMessage` (``index`` None).
        """
        return _parse_message(data, None)[0]

    def to_dict(self) -> dict[str, Any]:
        """The message as a plain dict, exactly as it was given (unset fields omitted, explicit None kept)."""
        if self.tool_calls is None and not isinstance(self.content, list) and not self.__pydantic_extra__:
            # Only strings and None: the dict _to_dict_reference makes, without the serializer's cost.
            given = self.model_fields_set
            return {key: getattr(self, key) for key in _MESSAGE_FIELDS if key in given}
        return self._to_dict_reference()

    def _to_dict_reference(self) -> dict[str, Any]:
        """:meth:`to_dict` by pydantic's serializer alone, for every message."""
        return self.model_dump(exclude_unset=True)

    @property
    def has_tool_calls(self) -> bool:
        """Whether this is an assistant message with at least one tool call."""
        return bool(self.tool_calls)

    def text_parts(self) -> list[str]:
        """The text of the message: the string content, or the text of each text-like part, in order."""
        if self.content is None:
            return []
        if isinstance(self.content, str):
            return [self.content]
        return [text for part in self.content if (text := part.as_text()) is not None]

    def media_parts(self) -> list[ContentPart]:
        """The parts that are not text (images, audio, video, files, unknown types), in order."""
        if not isinstance(self.content, list):
            return []
        return [part for part in self.content if not part.is_text]


_MESSAGE_FIELDS = tuple(Message.model_fields)

# A dict (any Mapping), a Message, an object with a pydantic-style model_dump() (openai SDK messages) or a
# dataclass. Any rather than a union: type checkers infer literal message lists as list[object].
MessageLike: TypeAlias = Any

_InputFormat: TypeAlias = Literal["dict", "message", "object"]


class _StrictSnapshot(dict):  # type: ignore[type-arg]
    """The copy of an input dict holding free-form data (object arguments, unknown keys), compared with the input
    the way a template sees it: key order and value types count ({"a": 1, "b": 2} is not {"b": 2, "a": 1}, nor
    1 the same as True)."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, dict) or len(other) != len(self):
            return False
        return all(
            key == other_key and same_values(value, other_value)
            for (key, value), (other_key, other_value) in zip(self.items(), other.items(), strict=True)
        )

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    __hash__ = None


class _Exact:
    """A :class:`Message` holding free-form data, to be recognised again only as the very same object: two equal
    messages may render apart (their argument keys in another order)."""

    __slots__ = ("message",)

    def __init__(self, message: Message) -> None:
        self.message = message

    def __eq__(self, other: object) -> bool:
        return other is self.message

    def __ne__(self, other: object) -> bool:
        return other is not self.message

    __hash__ = None  # type: ignore[assignment]


def _free_form(model: _Model) -> bool:
    """:func:`_free_form_reference`, answered without a walk for most messages: text content, and tool calls
    (if any) whose extra keys and arguments are all the walk would find."""
    if isinstance(model, Message) and not model.__pydantic_extra__ and type(model.content) is not list:
        return any(
            call.__pydantic_extra__ or call.function.__pydantic_extra__ or type(call.function.arguments) is not str
            for call in model.tool_calls or ()
        )
    return _free_form_reference(model)


def _free_form_reference(model: _Model) -> bool:
    """Whether a validated message holds data whose order or types a template renders and Python's ``==``
    ignores: unknown keys (anywhere) or object-valued tool-call arguments. Everything else is a typed field,
    written in the model's own order."""
    stack: list[_Model] = [model]
    while stack:
        item = stack.pop()
        if item.__pydantic_extra__:
            return True
        for value in item.__dict__.values():
            if type(value) is dict:
                return True
            if isinstance(value, _Model):
                stack.append(value)
            elif type(value) is list:
                stack.extend(v for v in value if isinstance(v, _Model))
    return False


def _check_of(message: Message, snapshot: dict[str, Any]) -> dict[str, Any]:
    """What an input dict is compared with to know it is unchanged: its copy, order-true when it needs to be."""
    return _StrictSnapshot(snapshot) if _free_form(message) else snapshot


def _parse_entry_size(item: dict[str, Any], entry: tuple[dict[str, Any], Message]) -> int:
    # The entry holds the caller's dict (so its id stays unique), its copy and the message. The three share their
    # strings, and the dicts are alike: twice the copy's size and the message's own objects, without walking the
    # message too (a validation costs about as much as that walk).
    return 2 * data_size(entry[0]) + _MODEL_BYTES * (1 + len(entry[1].tool_calls or ()))


def _unchanged(item: dict[str, Any], entry: tuple[dict[str, Any], Message]) -> bool:
    # A deep comparison with the copy taken at validation, cheap because the strings are shared; order- and
    # type-true for free-form data (see _StrictSnapshot). The snapshot's own __eq__ decides: it is on the left.
    return bool(entry[0] == item)


_PARSED: IdentityMemo[dict[str, Any], tuple[dict[str, Any], Message]] = IdentityMemo(
    "messages.parsed", sizer=_parse_entry_size, fresh=_unchanged
)

"""Validated messages of recently seen input dicts (with the copy each was validated from), so a growing chat
re-validates only its new turns; a dict changed in place since is validated again. Within the shared cache
budget, reported by ``cache_usage()`` as ``messages.parsed``."""


class _TooDeep(Exception):
    """Raised by ``_copy`` past :data:`MAX_DEPTH`; turned into an InvalidMessage with the depth found."""


class _Uncopyable(Exception):
    """Raised by ``_copy`` for a value ``copy.deepcopy`` refuses (a lock, a generator, an open file)."""


class _Shared(Exception):
    """Raised by ``_copy_json`` at a dict or list it meets twice: the data goes to ``_copy_reference``."""


def _copy(value: Any, depth: int = 0) -> Any:
    """:func:`_copy_reference` for JSON-shaped data (dicts with string keys, lists, scalars), several times
    faster; anything else, and data holding a dict or list in two places, goes to it. Refuses (``_TooDeep``)
    data nested deeper than ``MAX_DEPTH``."""
    try:
        return _copy_json(value, depth, None)
    except _Shared:
        # One copy per path would be 2**40 lists for a list doubled forty times; deepcopy copies each object
        # once, keeping the sharing, and validation then measures what it adds (MAX_REPEATED).
        return _copy_reference(value, depth)


def _copy_json(value: Any, depth: int, seen: set[int] | None) -> Any:
    """The copy of :func:`_copy`; ``seen`` holds the ids of the containers met so far, None at the top (which
    only a cycle reaches again, and the depth bound stops those)."""
    kind = type(value)
    if kind in _SCALARS:
        return value
    if kind is dict:
        if depth >= MAX_DEPTH:
            raise _TooDeep
        if all(type(key) is str for key in value):
            if seen is None:
                seen = set()
            elif id(value) in seen:
                raise _Shared
            else:
                seen.add(id(value))
            return {key: _copy_json(item, depth + 1, seen) for key, item in value.items()}
    elif kind is list:
        if depth >= MAX_DEPTH:
            raise _TooDeep
        if seen is None:
            seen = set()
        elif id(value) in seen:
            raise _Shared
        else:
            seen.add(id(value))
        return [_copy_json(item, depth + 1, seen) for item in value]
    return _copy_reference(value, depth)


def _copy_reference(value: Any, depth: int = 0) -> Any:
    """``copy.deepcopy`` of ``value`` found ``depth`` levels down, refused (``_TooDeep``) when its nesting
    (see :func:`_depth`) would go past :data:`MAX_DEPTH`, or (``_Uncopyable``) when it cannot be copied."""
    if depth + _depth(value)[0] > MAX_DEPTH:
        raise _TooDeep
    try:
        return copy.deepcopy(value)
    except Exception as exc:  # deepcopy falls back on pickling, which raises anything
        raise _Uncopyable(exc) from None


def _shares(root: Any) -> bool:
    """Whether some container (list, tuple, dict, model) is reached twice from ``root``: held in two places, or
    holding itself. Nothing else is measured, so the common case, nothing shared, costs one look at each value."""
    seen = {id(root)}
    stack = [root]
    while stack:
        for _, child in _children(stack.pop()) or ():
            if type(child) in _SCALARS or _children(child) is None:
                continue
            if id(child) in seen:
                return True
            seen.add(id(child))
            stack.append(child)
    return False


def _refuse_shared(data: Any, index: int | None) -> None:
    """Raise InvalidMessage when ``data`` (a dataclass message's fields, before ``asdict`` copies them along every
    path) holds containers in more than one place that nest too deep or add more than :data:`MAX_REPEATED`."""
    if not _shares(data):
        return
    problem = _shape_problem(data, MAX_DEPTH)
    if problem is not None:
        where, what, fix = problem
        raise InvalidMessage(f"{where}: {what}" if where != _where(()) else what, index=index, fix=fix)


def _too_deep(data: Any, index: int | None) -> InvalidMessage:
    """The error for a message nested deeper than :data:`MAX_DEPTH`: where, and how deep it goes."""
    depth, top = _depth(data) if data is not None else (0, None)
    found = _nesting(depth, MAX_DEPTH) if depth else f"data nested more than {MAX_DEPTH} levels deep"
    where = f"{_where((top,))}: " if top is not None else ""
    return InvalidMessage(f"{where}{found}", index=index, fix=_DEPTH_FIX)


def _uncopyable(data: Any, index: int | None, exc: _Uncopyable) -> InvalidMessage:
    """The error for a message holding a value that cannot be copied: which key, what type, and why."""
    where = ""
    if isinstance(data, dict):
        for key, value in data.items():
            try:
                copy.deepcopy(value)
            except Exception:  # the first key whose value fails is the one to name
                where = f"{_where((key,))}: "
                break
    cause = exc.args[0] if exc.args else exc
    return InvalidMessage(
        f"{where}holds a value that cannot be copied ({type(cause).__name__}: {cause}); a message is data, and "
        "contextkeeper copies it so that nothing you pass is shared or changed",
        index=index,
        fix="send the value as a string or as JSON-like data (dicts, lists, strings, numbers), or leave it out",
    )


def _parse_message(item: object, index: int | None) -> tuple[Message, _InputFormat, object]:
    """:func:`_parse_message_reference`, answered from the parse memo for a dict seen before and unchanged since."""
    if type(item) is dict:
        known = _PARSED.get(item)
        if known is not None:
            return known[1], "dict", known[0]
        parsed = _parse_message_reference(item, index)
        check: Any = parsed[2]
        _PARSED.put(item, (check, parsed[0]))
        return parsed
    return _parse_message_reference(item, index)


def _parse_message_reference(item: object, index: int | None) -> tuple[Message, _InputFormat, object]:
    """The validated message, the input's format, and what a later call can compare the input with to know it
    is unchanged (a deep copy of a dict, the Message itself; None when there is nothing cheap to compare)."""
    if isinstance(item, Message):
        return item, "message", (_Exact(item) if _free_form(item) else item)
    fmt: _InputFormat
    if type(item) is dict:
        try:
            snapshot = _copy(item)
            message = Message.model_validate(_copy(snapshot))
        except _TooDeep:
            raise _too_deep(item, index) from None
        except _Uncopyable as exc:
            raise _uncopyable(item, index, exc) from None
        except ValidationError as exc:
            text, fix = _describe(exc)
            raise InvalidMessage(text, index=index, fix=fix) from None
        return message, "dict", _check_of(message, snapshot)
    raw: Any = None
    try:
        if isinstance(item, Mapping):
            raw = dict(item)
            fmt = "dict"
        elif callable(getattr(item, "model_dump", None)):
            # Plain model_dump(), as transformers does; the copy guards against objects that hand out their state.
            raw = item.model_dump()  # type: ignore[attr-defined]
            fmt = "object"
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            # asdict follows every path too: its fields are measured first.
            _refuse_shared({field.name: getattr(item, field.name) for field in dataclasses.fields(item)}, index)
            try:
                raw = dataclasses.asdict(item)
            except RecursionError:
                raise _TooDeep from None
            except Exception as exc:  # asdict deep-copies what is not a dataclass, list or dict
                raise _Uncopyable(exc) from None
            fmt = "object"
        else:
            raise InvalidMessage(
                f"a message must be a dict or a Message, got {type(item).__name__}",
                index=index,
                fix='pass messages as dicts such as {"role": "user", "content": "..."}',
            )
        data: Any = _copy(raw)
    except _TooDeep:
        raise _too_deep(raw, index) from None
    except _Uncopyable as exc:
        raise _uncopyable(raw, index, exc) from None
    if not isinstance(data, dict):
        raise InvalidMessage(
            f"model_dump() of {type(item).__name__} returned {type(data).__name__}, not a dict",
            index=index,
            fix="pass the message as a dict",
        )
    try:
        return Message.model_validate(data), fmt, None
    except ValidationError as exc:
        text, fix = _describe(exc)
        raise InvalidMessage(text, index=index, fix=fix) from None
