"""``tojson`` as llama.cpp's Jinja engine writes it (common/jinja/value.cpp: ``tojson``, ``value_to_json_internal``).

It differs from Python's ``json.dumps`` in three ways a count sees: a float goes through a C++ stream at its default
precision (six significant digits, so 1.0 -> ``1``, 3.14159265 -> ``3.14159``, 1e-7 -> ``1e-07``, 1234567.0 ->
``1.23457e+06``); an indent that is not an integer means none; and ``sort_keys=true`` fails the render. Strings,
separators, nesting and the order of keys are written as Python writes them, so a value without floats takes
``json.dumps`` (the fast path); :func:`c_json` writes everything itself (the reference the tests hold it equal to).
"""

from __future__ import annotations

import json
from typing import Any

from jinja2.exceptions import TemplateError

__all__ = ["c_json", "c_tojson", "has_float"]


def has_float(value: Any) -> bool:
    """Whether a float is anywhere in ``value`` (dicts and lists at any depth)."""
    stack = [value]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind is float:
            return True
        if kind is dict or isinstance(item, dict):
            stack.extend(item.values())
        elif kind is list or isinstance(item, (list, tuple)):
            stack.extend(item)
    return False


def _key(key: Any) -> str:
    return key if isinstance(key, str) else str(key)


def c_json(value: Any, indent: int = -1, item_sep: str | None = None, key_sep: str = ": ", ascii: bool = False) -> str:
    """``value`` written as llama.cpp's ``value_to_json`` writes it (``indent`` < 0: on one line)."""
    items = item_sep if item_sep is not None else (", " if indent < 0 else ",")
    newline = "\n" if indent >= 0 else ""
    out: list[str] = []

    def write(item: Any, level: int) -> None:
        if item is None or item is True or item is False:
            out.append("null" if item is None else "true" if item else "false")
        elif isinstance(item, int):
            out.append(str(item))
        elif isinstance(item, float):
            out.append(f"{item:g}")
        elif isinstance(item, str):
            out.append(json.dumps(item, ensure_ascii=ascii))
        elif isinstance(item, (list, tuple, dict)):
            opening, closing = ("{", "}") if isinstance(item, dict) else ("[", "]")
            out.append(opening)
            entries = list(item.items()) if isinstance(item, dict) else list(item)
            if entries:
                out.append(newline)
                pad = " " * (indent * (level + 1)) if indent > 0 else ""
                for index, entry in enumerate(entries):
                    out.append(pad)
                    if isinstance(item, dict):
                        out.append(json.dumps(_key(entry[0]), ensure_ascii=ascii))
                        out.append(key_sep)
                        write(entry[1], level + 1)
                    else:
                        write(entry, level + 1)
                    if index < len(entries) - 1:
                        out.append(items)
                    out.append(newline)
                out.append(" " * (indent * level) if indent > 0 else "")
            out.append(closing)
        else:  # undefined values and anything without a JSON form
            out.append("null")

    write(value, 0)
    return "".join(out)


def c_tojson(
    value: Any, ensure_ascii: Any = False, indent: Any = None, separators: Any = None, sort_keys: Any = False
) -> str:
    """The ``tojson`` filter under llama.cpp's rules: ``json.dumps`` where that writes the same, else :func:`c_json`."""
    if sort_keys:
        raise TemplateError("tojson sort_keys=true not implemented (llama.cpp's Jinja engine refuses it)")
    width = indent if type(indent) is int else -1
    given = list(separators) if isinstance(separators, (list, tuple)) else []
    item_sep = str(given[0]) if given else None
    key_sep = str(given[1]) if len(given) > 1 else ": "
    if not has_float(value):
        return json.dumps(
            value,
            ensure_ascii=bool(ensure_ascii),
            indent=width if width >= 0 else None,
            separators=(item_sep if item_sep is not None else (", " if width < 0 else ","), key_sep),
            default=lambda _: None,
        )
    return c_json(value, width, item_sep, key_sep, bool(ensure_ascii))
