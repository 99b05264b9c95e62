"""Validated OpenAI-format chat messages.

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

import copy
import dataclasses
import json
import re
import reprlib
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, TypeAlias, overload

from pydantic import (
    BaseModel,
    ConfigDict,
    ModelWrapValidatorHandler,
    PrivateAttr,
    SerializeAsAny,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from contextkeeper._exceptions import InvalidMessage, MessageError, MissingToolResult, OrphanToolResult
from contextkeeper._memo import IdentityMemo, data_size, same_values

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

Role: TypeAlias = Literal["system", "developer", "user", "assistant", "tool"]
UnitKind: TypeAlias = Literal["system", "user", "assistant"]
ContentFormat: TypeAlias = Literal["string", "openai"]

VALID_ROLES: tuple[str, ...] = ("system", "developer", "user", "assistant", "tool")

# Part types whose payload is text, and the field that holds it. vLLM renders all of these as text.
_TEXT_FIELDS: dict[str, str] = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}

_ERROR_TYPE = "contextkeeper"
_MAX_REPORTED_ERRORS = 3


def _fail(message: str, fix: str = "", where: str | None = None) -> PydanticCustomError:
    """A pydantic error that carries our wording; ``_describe`` unpacks it again."""
    ctx: dict[str, Any] = {"message": message, "fix": fix}
    if where is not None:
        ctx["where"] = where
    return PydanticCustomError(_ERROR_TYPE, "{message}", ctx)


class _Model(BaseModel):
    # strict: no silent coercion (bytes -> str, tuple -> list), so what we return is what we were given.
    # hide_input_in_errors: printing the input of an error is unbounded for data that holds one list in many
    # places (see MAX_REPEATED); the error's own words say what is wrong and where.
    model_config = ConfigDict(frozen=True, extra="allow", strict=True, hide_input_in_errors=True)

    def approx_size(self) -> int:
        """Bytes this validated object holds (its fields, unknown keys and the objects inside), for the caches'
        byte budget; a fixed cost stands for the model instance, its ``__dict__`` and field set."""
        extra = self.__pydantic_extra__
        return _MODEL_BYTES + sum(map(data_size, self.__dict__.values())) + (data_size(extra) if extra else 0)


# What a model instance costs besides its values: the object, its __dict__ and its set of given fields (measured
# with tracemalloc for a Message of two fields: 610 bytes).
_MODEL_BYTES = 640


# ------------------------------------------------------------------------------- text a server can encode

MAX_DEPTH = 100
"""How deeply a message's (or a tool schema's) data may nest: lists and objects inside one another, counted
from the message (a tool call's arguments sit three levels down). Deeper data is refused before anything
recurses over it (copies, templates' ``tojson``)."""

MAX_REPEATED = 32_000_000
"""How much a message's (or a tool schema's) lists and dicts held in more than one place may add when written
out, in characters (every value at least one, strings and keys their length). Python data can hold one object in
many places, JSON cannot: copies, comparisons and a template's ``tojson`` write out every place, so ``a = [a, a]``
forty times over is 2**40 values. The bound is a chat template's output bound (``TemplateLimits.output_chars``):
a prompt holding the repeats would be at least that long. Unshared data adds nothing, whatever its size."""

# A lone surrogate (U+D800..U+DFFF) is not a character: it has no UTF-8 encoding, so neither a tokenizer nor a
# server's JSON encoder can take it.
_LONE = re.compile("[\ud800-\udfff]")
_SURROGATE_FIX = (
    "remove the character, or decode the text's bytes with errors='replace' (lone surrogates usually come from "
    "bytes decoded with errors='surrogateescape' or from JSON escapes such as \\ud800)"
)
_DEPTH_FIX = "flatten the data, or send deeply nested values as a JSON string"
_ESCAPED_LONE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _has_lone(text: str) -> bool:
    return not text.isascii() and _LONE.search(text) is not None


def _children(value: Any) -> Iterable[tuple[str | int, Any]] | None:
    """The (key, child) pairs of a container or model, or None for a leaf."""
    kind = type(value)
    if kind is dict:
        return value.items()  # type: ignore[no-any-return]
    if kind is list or kind is tuple:
        return enumerate(value)
    if isinstance(value, _Model):
        fields = value.__dict__.items()
        extra = value.__pydantic_extra__
        return [*fields, *extra.items()] if extra else fields
    return None


def _clean(root: Any, limit: int) -> bool:
    """:func:`_clean_reference` in one pass: no paths kept, strings checked without being pushed, ASCII text
    not searched, and a container met twice is enough to answer False."""
    if type(root) is str:
        return not _has_lone(root)
    stack = [(root, 0)]
    pop, push = stack.pop, stack.append
    seen: set[int] | None = None  # containers met below root: one met again is shared (the careful pass measures it)
    while stack:
        value, depth = pop()
        children = _children(value)
        if children is None:
            continue
        if depth >= limit:
            return False
        if depth:  # root is reached again only by a cycle, which the depth bound stops
            if seen is None:
                seen = set()
            elif id(value) in seen:
                return False
            seen.add(id(value))
        is_dict = type(value) is dict
        for key, child in children:
            if is_dict and type(key) is str and _has_lone(key):
                return False
            kind = type(child)
            if kind is str:
                if _has_lone(child):
                    return False
            elif kind is not int and kind is not bool and kind is not float and child is not None:
                push((child, depth + 1))
    return True


def _clean_reference(root: Any, limit: int) -> bool:
    """Whether ``root`` holds no lone surrogate (in strings, or in the keys of dicts), nests at most ``limit``
    levels deep (see :func:`_depth`) and holds no container in two places (see :func:`_measure`)."""
    shape = _measure(root)
    if shape.depth > limit or shape.written > shape.held:
        return False
    stack = [root]
    while stack:
        value = stack.pop()
        if type(value) is str:
            if _LONE.search(value):
                return False
            continue
        for key, child in _children(value) or ():
            if type(value) is dict and type(key) is str and _LONE.search(key):
                return False
            stack.append(child)
    return True


def _where(path: tuple[str | int, ...]) -> str:
    out = ""
    for item in path:
        if isinstance(item, str) and _has_lone(item):
            item = ascii(item)  # a key that holds the surrogate itself: written with escapes, as Python would
        out += f"[{item}]" if isinstance(item, int) else (f".{item}" if out else str(item))
    return out or "the value"


_ENDLESS = sys.maxsize
"""The depth :func:`_depth` gives data that contains itself (a list appended to itself): it nests without end."""


@dataclasses.dataclass(frozen=True)
class _Shape:
    """What :func:`_measure` finds: the nesting and the written-out size of some data."""

    depth: int  # levels of containers, root included; _ENDLESS for data that contains itself
    top: str | int | None  # the key of root under which the deepest level lies
    written: int  # size written out once per place a container is reached (every path), capped at _HUGE
    held: int  # size with each container counted once: what the data really holds
    sizes: dict[int, int] = dataclasses.field(repr=False, compare=False)  # id -> written size of that container

    @property
    def repeated(self) -> int:
        """What the containers held in more than one place add when written out: 0 for data without them."""
        return self.written - self.held


_HUGE = 10**15  # written sizes stop growing here: far past any bound, and the arithmetic stays small


def _own_size(value: Any, children: Iterable[tuple[str | int, Any]]) -> int:
    """A container's own part of its written size: one for itself, and for each entry its key's length (dicts,
    models) and its value's size if that is not a container (one, or one plus the length of a string)."""
    keyed = type(value) is not list and type(value) is not tuple
    size = 1
    for key, child in children:
        if keyed:
            size += len(key) if type(key) is str else 1
        if type(child) is str:
            size += 1 + len(child)
        elif _children(child) is None:
            size += 1
    return size


def _measure(root: Any) -> _Shape:
    """The nesting of ``root`` (containers and models, ``root`` itself included), the key of ``root`` under which
    the deepest level lies (the last such key where several tie), and its size written out along every path and
    held once per container (see :data:`MAX_REPEATED`). Iterative, and each container is measured once however
    often it is reached, so any depth, shared sub-objects and cycles all take time linear in the containers."""
    if _children(root) is None:
        size = 1 + len(root) if type(root) is str else 1
        return _Shape(0, None, size, size, {})
    heights: dict[int, int] = {}  # id -> levels from that container down (the objects live: root holds them)
    sizes: dict[int, int] = {}  # id -> written size from that container down
    held = 0
    open_: set[int] = set()  # containers whose levels are being measured: reaching one again is a cycle
    top: str | int | None = None
    # (container, whether its children are measured, the key of root it lies under)
    stack: list[tuple[Any, bool, str | int | None]] = [(root, False, None)]
    while stack:
        value, measured, under = stack.pop()
        key = id(value)
        if measured:
            open_.discard(key)
            children = list(_children(value) or ())
            inner = [id(child) for _, child in children if _children(child) is not None]
            heights[key] = 1 + max((heights[child] for child in inner), default=0)
            own = _own_size(value, children)
            held += own
            sizes[key] = min(_HUGE, own + sum(sizes[child] for child in inner))
            continue
        if key in heights:
            continue
        if key in open_:
            return _Shape(_ENDLESS, under, _HUGE, held, sizes)
        open_.add(key)
        stack.append((value, True, under))
        for name, child in _children(value) or ():
            if _children(child) is not None and id(child) not in heights:
                stack.append((child, False, name if value is root else under))
    best = 0
    for name, child in _children(root) or ():
        if _children(child) is not None and heights[id(child)] >= best:
            best, top = heights[id(child)], name
    return _Shape(heights[id(root)], top, sizes[id(root)], held, sizes)


def _depth(root: Any) -> tuple[int, str | int | None]:
    """Levels of nesting in ``root`` and the key of ``root`` under which the deepest level lies (see
    :func:`_measure`)."""
    shape = _measure(root)
    return shape.depth, shape.top


def _repeats_at(root: Any, shape: _Shape) -> tuple[str | int, ...]:
    """The keys down to where the repeats of ``root`` lie: from ``root``, into the one container whose written
    size alone is past :data:`MAX_REPEATED`, while there is exactly one and it is held there once."""
    path: list[str | int] = []
    value = root
    while True:
        big = [
            (key, child)
            for key, child in _children(value) or ()
            if _children(child) is not None and shape.sizes.get(id(child), 0) > MAX_REPEATED
        ]
        if len(big) != 1:
            return tuple(path)
        key, child = big[0]
        if sum(1 for _, other in _children(value) or () if other is child) > 1:
            return tuple(path)  # held twice right here: this is the place
        path.append(key)
        value = child


def _nesting(depth: int, limit: int) -> str:
    """The words for data ``depth`` levels deep, over ``limit``."""
    if depth == _ENDLESS:
        return f"data that contains itself, so it nests without end; at most {limit} levels are allowed"
    return f"data nested {depth} levels deep; at most {limit} are allowed"


_REPEATS_FIX = (
    "hold each list or dict in one place (build a new one for each place, as JSON data would), or refer to shared "
    "data by a name or an id instead of repeating it"
)


def _repeating(shape: _Shape) -> str:
    """The words for data whose repeats add more than :data:`MAX_REPEATED`."""
    added = f"{shape.repeated:,}" if shape.written < _HUGE else f"more than {_HUGE:,}"
    return (
        f"holds lists or dicts in more than one place, and written out once per place (as copies and a template's "
        f"tojson write them) they add {added} characters; at most {MAX_REPEATED:,} are allowed (MAX_REPEATED)"
    )


def _shape_problem(root: Any, limit: int, base: tuple[str | int, ...] = ()) -> tuple[str, str, str] | None:
    """``(where, what, fix)`` when ``root`` nests deeper than ``limit`` levels or its repeats add more than
    :data:`MAX_REPEATED`; None otherwise. Linear in the containers (see :func:`_measure`)."""
    shape = _measure(root)
    if shape.depth > limit:
        return _where((*base, shape.top) if shape.top is not None else base), _nesting(shape.depth, limit), _DEPTH_FIX
    if shape.repeated > MAX_REPEATED:
        return _where((*base, *_repeats_at(root, shape))), _repeating(shape), _REPEATS_FIX
    return None


def _problem(root: Any, limit: int, base: tuple[str | int, ...] = ()) -> tuple[str, str, str] | None:
    """``(where, what, fix)`` of the first lone surrogate in ``root``, or of its nesting when deeper than
    ``limit`` levels (with the depth found), or of its repeats when they add more than :data:`MAX_REPEATED`;
    None when it is clean. The careful pass, for errors and shared data: each container is searched once, so it
    is linear too."""
    if _clean(root, limit):
        return None
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(root, base)]
    searched: set[int] = set()  # containers searched already, reached again by another path
    while stack:
        value, path = stack.pop()
        if type(value) is str:
            found = _LONE.search(value)
            if found is not None:
                return _where(path), _surrogate_text(value, found.start()), _SURROGATE_FIX
            continue
        children = _children(value)
        if children is None or len(path) - len(base) > limit or id(value) in searched:
            continue
        searched.add(id(value))
        for key, child in children:
            if isinstance(key, str) and type(value) is dict and (found := _LONE.search(key)) is not None:
                return _where((*path, key)), "an object key " + _surrogate_text(key, found.start()), _SURROGATE_FIX
            stack.append((child, (*path, key)))
    return _shape_problem(root, limit, base)


def _surrogate_text(text: str, position: int) -> str:
    return (
        f"holds a lone surrogate {text[position]!r} at character {position} (of {len(text)}); it is not valid "
        "Unicode, so no tokenizer or server can encode it as UTF-8"
    )


def surrogate_at(text: str) -> int | None:
    """The position of the first lone surrogate in ``text``, or None (no search at all for ASCII text)."""
    if text.isascii():
        return None
    found = _LONE.search(text)
    return None if found is None else found.start()


def check_text(text: str, *, what: str = "text") -> None:
    """Raise :class:`MessageError` if ``text`` holds a lone surrogate (with its position)."""
    position = surrogate_at(text) if type(text) is str else None
    if position is not None:
        raise MessageError(f"{what} {_surrogate_text(text, position)}", fix=_SURROGATE_FIX)


def _tool_name(tool: Mapping[str, Any]) -> str | None:
    """The function name of an OpenAI (``{"function": {"name": ...}}``) or flat (``{"name": ...}``) schema."""
    function = tool.get("function")
    name = function.get("name") if isinstance(function, Mapping) else tool.get("name")
    return name if isinstance(name, str) else None


def check_tools(tools: Iterable[Any]) -> None:
    """Refuse tool schemas a server could not take: a schema that is not an object, text with a lone surrogate,
    or data nested deeper than :data:`MAX_DEPTH`. Raises :class:`MessageError` naming the tool."""
    for position, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise MessageError(
                f"tools[{position}] must be an object (a tool schema), got {type(tool).__name__}",
                fix='pass tools as [{"type": "function", "function": {"name": ..., "parameters": {...}}}]',
            )
        data = tool if type(tool) is dict else dict(tool)
        problem = _problem(data, MAX_DEPTH, ())
        if problem is not None:
            where, what, fix = problem
            name = _tool_name(tool)
            label = (
                f"tools[{position}] ({name!r})" if name is not None and not _has_lone(name) else f"tools[{position}]"
            )
            raise MessageError(f"{label} {where}: {what}", fix=fix)


# --------------------------------------------------------------------------------------------- content parts


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


# ---------------------------------------------------------------------------------------------- tool calls


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


# ------------------------------------------------------------------------------------------------ messages

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
        problem = _problem(self, MAX_DEPTH)
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
                if _problem(parsed, MAX_DEPTH) is not None:
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


_SCALARS = frozenset({str, int, float, bool, type(None)})


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


# ------------------------------------------------------------------------------------------ error wording


def _render_loc(loc: tuple[int | str, ...], prefix: str = "") -> str:
    out = prefix
    for item in loc:
        if isinstance(item, int):
            out += f"[{item}]"
        else:
            out += f".{item}" if out else item
    return out


# A bounded repr: the repr of a list held in many places (see MAX_REPEATED) would follow every path.
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 60, 60


def _short(value: Any) -> str:
    text = repr(value) if type(value) in _SCALARS else _REPR.repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _describe(exc: ValidationError, prefix: str = "") -> tuple[str, str | None]:
    """Turn a pydantic error into one readable sentence and a fix."""
    texts: list[str] = []
    fixes: list[str] = []
    errors = exc.errors(include_url=False)
    for error in errors[:_MAX_REPORTED_ERRORS]:
        ctx = error.get("ctx") or {}
        if error["type"] == _ERROR_TYPE:
            where = ctx.get("where")
            where = _render_loc(error["loc"], prefix) if where is None else str(where)
            message = str(ctx.get("message", error["msg"]))
            fix = str(ctx.get("fix") or "")
        else:
            where = _render_loc(error["loc"], prefix)
            if error["type"] == "missing":
                message, fix = "required field is missing", f"add {where}"
            else:
                message = f"{error['msg']}, got {_short(error['input'])}"
                rest = error["msg"].removeprefix("Input should be ")
                fix = f"make {where} {rest}" if rest != error["msg"] else ""
        texts.append(f"{where}: {message}" if where else message)
        if fix and fix not in fixes:
            fixes.append(fix)
    if len(errors) > _MAX_REPORTED_ERRORS:
        texts.append(f"and {len(errors) - _MAX_REPORTED_ERRORS} more problem(s)")
    return "; ".join(texts), ("; ".join(fixes) or None)


# ------------------------------------------------------------------------------------------- conversation


@dataclasses.dataclass(frozen=True)
class Unit:
    """Messages that must be kept or dropped together.

    A system/developer message, a user message, or an assistant message with all of its tool results.
    ``start``/``stop`` are the message index range in the conversation.
    """

    kind: UnitKind
    start: int
    stop: int
    messages: tuple[Message, ...]

    @property
    def indices(self) -> range:
        """The message indices of this unit."""
        return range(self.start, self.stop)


def _describe_call(call: ToolCall, position: int) -> str:
    ident = f" id {call.id!r}" if call.id is not None else ""
    return f"tool_calls[{position}] ({call.function.name!r}{ident})"


def _group_units(messages: Sequence[Message], start: int = 0) -> tuple[Unit, ...]:
    """Check the tool call / tool result structure and group ``messages[start:]`` into units (``start`` must
    begin a unit)."""
    units: list[Unit] = []
    count = len(messages)
    i = start
    while i < count:
        message = messages[i]
        if message.role == "tool":
            raise OrphanToolResult(
                f"tool result (tool_call_id={message.tool_call_id!r}) does not follow an assistant message "
                "with tool_calls",
                index=i,
                fix="put it right after the assistant message that made the call (and that call's other "
                "results), or drop it",
            )
        if message.role != "assistant":
            kind: UnitKind = "user" if message.role == "user" else "system"
            units.append(Unit(kind, i, i + 1, (message,)))
            i += 1
            continue
        calls = message.tool_calls or []
        by_id = {call.id: position for position, call in enumerate(calls) if call.id is not None}
        answered = [False] * len(calls)
        j = i + 1
        while j < count and messages[j].role == "tool":
            result_id = messages[j].tool_call_id
            position = j - i - 1  # the n-th result answers the n-th call when calls have no ids
            if not calls:
                raise OrphanToolResult(
                    f"tool result (tool_call_id={result_id!r}) follows assistant message {i}, which made no tool calls",
                    index=j,
                    fix="add the matching call to that assistant message's tool_calls, or drop this result",
                )
            if result_id is not None and result_id in by_id:
                target = by_id[result_id]
            elif position < len(calls) and calls[position].id is None:
                target = position
            elif result_id is not None and by_id:
                known = ", ".join(repr(call_id) for call_id in by_id)
                raise OrphanToolResult(
                    f"tool result's tool_call_id {result_id!r} matches no call of assistant message {i} "
                    f"(its call ids: {known})",
                    index=j,
                    fix="use the id of the call this result answers, or drop the result",
                )
            elif position >= len(calls):
                raise OrphanToolResult(
                    f"tool result (tool_call_id={result_id!r}) has no call to answer: assistant message {i} "
                    f"made {len(calls)} call(s) and this is result {position + 1}",
                    index=j,
                    fix="drop the extra tool result, or add its call to the assistant message",
                )
            else:
                expected = calls[position].id
                raise InvalidMessage(
                    "tool result has no tool_call_id (missing id), but the call it answers, "
                    f"{_describe_call(calls[position], position)} of assistant message {i}, has one",
                    index=j,
                    fix=f"set tool_call_id to {expected!r}",
                )
            if answered[target]:
                raise InvalidMessage(
                    f"second tool result for {_describe_call(calls[target], target)} of assistant message {i}",
                    index=j,
                    fix="keep one result per tool call",
                )
            answered[target] = True
            j += 1
        if j < count and not all(answered):
            missing = ", ".join(
                _describe_call(call, position)
                for position, (call, done) in enumerate(zip(calls, answered, strict=True))
                if not done
            )
            raise MissingToolResult(
                f"assistant message's tool calls {missing} have no result before message {j} ({messages[j].role})",
                index=i,
                fix="add a role='tool' message answering each call right after the assistant message "
                "(its other results), or remove the unanswered calls",
            )
        units.append(Unit("assistant", i, j, tuple(messages[i:j])))
        i = j
    return tuple(units)


class Conversation(Sequence[Message]):
    """An immutable, validated list of messages that remembers each message's input format.

    Build it with :meth:`from_messages`. Validation covers each message and the tool call structure: every
    tool result answers a call of the assistant message before it, and every call is answered before the
    conversation moves on (pending calls are allowed only in the final unit).
    """

    __slots__ = ("_checks", "_formats", "_messages", "_sources", "_units")

    _messages: tuple[Message, ...]
    _formats: tuple[_InputFormat, ...]
    _sources: tuple[object, ...]
    _units: tuple[Unit, ...] | None  # None: not grouped yet (messages assembled from units already checked)
    _checks: tuple[object, ...] | None

    def __init__(
        self, messages: Sequence[MessageLike] | Conversation = (), *, previous: Conversation | None = None
    ) -> None:
        """Same as :meth:`from_messages`."""
        if isinstance(messages, Conversation):
            self._set(messages._messages, messages._formats, messages._sources, messages._grouped(), messages._checks)
            return
        if not isinstance(messages, (list, tuple)):
            raise MessageError(
                f"expected a list of messages, got {type(messages).__name__}",
                index=None,
                fix="pass a list such as [{'role': 'user', 'content': '...'}] (a single message in a list)",
            )
        start = _unchanged_prefix(messages, previous)
        parsed: list[Message] = []
        formats: list[_InputFormat] = []
        checks: list[object] = []
        for index in range(start, len(messages)):
            message, fmt, check = _parse_message(messages[index], index)
            parsed.append(message)
            formats.append(fmt)
            checks.append(check)
        if start and previous is not None and previous._checks is not None:
            # The previous last unit may grow (more tool results) or now need its results: group it again.
            grouped = previous._grouped()
            regroup_from = grouped[-1].start
            built = previous._messages + tuple(parsed)
            units = grouped[:-1] + _group_units(built, regroup_from)
            all_formats = previous._formats + tuple(formats)
            complete = None if None in checks else previous._checks + tuple(checks)
        else:
            built = tuple(parsed)
            units = _group_units(built)
            all_formats = tuple(formats)
            complete = None if None in checks else tuple(checks)
        self._set(built, all_formats, tuple(messages), units, complete)

    def _set(
        self,
        messages: tuple[Message, ...],
        formats: tuple[_InputFormat, ...],
        sources: tuple[object, ...],
        units: tuple[Unit, ...] | None,
        checks: tuple[object, ...] | None = None,
    ) -> None:
        object.__setattr__(self, "_messages", messages)
        object.__setattr__(self, "_formats", formats)
        # Kept only to hand foreign objects (e.g. openai SDK messages) back as themselves.
        if "object" in formats:
            kept = tuple(src if fmt == "object" else None for src, fmt in zip(sources, formats, strict=True))
        else:
            kept = (None,) * len(formats)
        object.__setattr__(self, "_sources", kept)
        object.__setattr__(self, "_units", units)
        # What each input compares equal to while unchanged (copies of dicts), for from_messages(previous=...).
        object.__setattr__(self, "_checks", checks)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Conversation is immutable")

    def __copy__(self) -> Conversation:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Conversation:
        return self  # immutable, and the messages are deep copies of the caller's already

    def __reduce__(self) -> tuple[Any, ...]:
        return (_restore_conversation, (self._messages, self._formats, self._sources, self._grouped()))

    @classmethod
    def from_messages(
        cls, messages: Sequence[MessageLike] | Conversation, *, previous: Conversation | None = None
    ) -> Conversation:
        """Validate a list of messages (dicts, :class:`Message` objects, objects with ``model_dump()``).

        The caller's list and dicts are never changed. Raises :class:`MessageError` (``index`` None) for a
        non-list, and :class:`InvalidMessage`, :class:`OrphanToolResult` or :class:`MissingToolResult` with
        the offending message's ``index``.

        ``previous``: the conversation built from an earlier state of the same chat. When ``messages`` starts
        with exactly what it was built from (compared by value, so edits in place are noticed), only the rest
        is validated.
        """
        if isinstance(messages, Conversation):
            return messages
        return cls(messages, previous=previous)

    @overload
    def __getitem__(self, index: int) -> Message: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[Message, ...]: ...

    def __getitem__(self, index: int | slice) -> Message | tuple[Message, ...]:
        # A slice may cut a unit in half, so it is a plain tuple; select() gives a validated sub-conversation.
        return self._messages[index]

    def __len__(self) -> int:
        return len(self._messages)

    def __iter__(self) -> Iterator[Message]:
        return iter(self._messages)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Conversation):
            return NotImplemented
        return self._messages == other._messages

    def __repr__(self) -> str:
        return f"Conversation({len(self._messages)} messages, {len(self._grouped())} units)"

    @property
    def messages(self) -> tuple[Message, ...]:
        """The validated messages."""
        return self._messages

    def units(self) -> tuple[Unit, ...]:
        """The atomic units, in order; together they cover every message exactly once."""
        return self._grouped()

    def _grouped(self) -> tuple[Unit, ...]:
        units = self._units
        if units is None:
            units = _group_units(self._messages)
            object.__setattr__(self, "_units", units)
        return units

    def to_dicts(self) -> list[dict[str, Any]]:
        """Every message as a new plain dict, equal to what was given."""
        return [message.to_dict() for message in self._messages]

    def to_caller_format(self) -> list[Any]:
        """The messages in the format each came in: dicts as new dicts, Messages and other objects as is."""
        out: list[Any] = []
        for message, fmt, source in zip(self._messages, self._formats, self._sources, strict=True):
            if fmt == "dict":
                out.append(message.to_dict())
            elif fmt == "object":
                out.append(source)
            else:
                out.append(message)
        return out

    def select(self, indices: Iterable[int]) -> Conversation:
        """A new conversation of the messages at ``indices`` (in the given order), re-validated.

        Each message keeps its input format. Raises the usual errors if the selection breaks tool call pairs.
        """
        chosen = list(indices)
        for index in chosen:
            if not -len(self._messages) <= index < len(self._messages):
                raise IndexError(f"message index {index} out of range for {len(self._messages)} messages")
        messages = tuple(self._messages[index] for index in chosen)
        return _restore_conversation(
            messages,
            tuple(self._formats[index] for index in chosen),
            tuple(self._sources[index] for index in chosen),
            _group_units(messages),
        )


def _unchanged_prefix(messages: Sequence[MessageLike], previous: Conversation | None) -> int:
    """len(previous) when ``messages`` begins with the very inputs ``previous`` was validated from, else 0."""
    if previous is None or previous._checks is None or not previous._messages:
        return 0
    size = len(previous._messages)
    if len(messages) < size:
        return 0
    # One C-level comparison: identical strings inside make it cheap, and a dict changed in place fails it.
    return size if tuple(messages[:size]) == previous._checks else 0


def _restore_conversation(
    messages: tuple[Message, ...],
    formats: tuple[_InputFormat, ...],
    sources: tuple[object, ...],
    units: tuple[Unit, ...] | None = None,
) -> Conversation:
    """A Conversation of messages already checked together; ``units`` None groups them when first asked."""
    conversation = Conversation.__new__(Conversation)
    conversation._set(messages, formats, sources, units)
    return conversation


# ----------------------------------------------------------------------------------------------- views


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
