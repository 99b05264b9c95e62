"""Hostile input, refused before anything is built from it: text a server cannot encode (lone surrogates), nesting
deeper than ``MAX_DEPTH``, data that repeats one container past ``MAX_REPEATED`` written bytes, and tool schemas
without names. Each fast check keeps its slow reference beside it."""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Iterable, Mapping
from typing import Any

from contextkeeper._exceptions import MessageError

from .base import _Model

__all__ = ["MAX_DEPTH", "MAX_REPEATED", "check_text", "check_tools", "find_problem", "surrogate_at"]


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


def find_problem(root: Any, limit: int, base: tuple[str | int, ...] = ()) -> tuple[str, str, str] | None:
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
        problem = find_problem(data, MAX_DEPTH, ())
        if problem is not None:
            where, what, fix = problem
            name = _tool_name(tool)
            label = (
                f"tools[{position}] ({name!r})" if name is not None and not _has_lone(name) else f"tools[{position}]"
            )
            raise MessageError(f"{label} {where}: {what}", fix=fix)
