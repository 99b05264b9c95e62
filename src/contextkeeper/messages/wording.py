"""Error wording: a pydantic validation error turned into one sentence that says what is wrong, where, and the fix."""

from __future__ import annotations

import reprlib
from typing import Any

from pydantic import (
    ValidationError,
)

from .base import _ERROR_TYPE, _MAX_REPORTED_ERRORS, _SCALARS

__all__ = []


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
