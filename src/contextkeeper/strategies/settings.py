"""Validated settings: the base model of every strategy's settings (and of a policy's own fields), and error texts
that name the key, the bad value and what is allowed.

A settings model is frozen, refuses unknown keys and checks types strictly: ``"three"`` is not a number, ``1`` is
not ``true`` and ``3.0`` is not a whole number (a TOML file says what it means). Lists become tuples, so a policy
file's arrays and a caller's lists are both accepted. Numbers must be finite. A bad value, from a policy file or
from Python, is a :class:`~contextkeeper.ConfigurationError` (never pydantic's own error, never a ``TypeError``
later in ``fit``) that names each bad key, its value, and the allowed type and range, with a ``Fix:``.
"""

from __future__ import annotations

import difflib
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeVar, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from .._exceptions import ConfigurationError

__all__ = ["Settings", "describe", "settings_problems"]

M = TypeVar("M", bound="Settings")

_KINDS: dict[Any, tuple[str, str]] = {  # annotation -> (one, many)
    bool: ("true or false", "true/false values"),
    int: ("a whole number", "whole numbers"),
    float: ("a number", "numbers"),
    str: ("a string", "strings"),
}
_TYPE_NAMES = {bool: "a boolean", int: "a whole number", float: "a number", str: "a string"}


class Settings(BaseModel):
    """Base of a strategy's settings: frozen, strict, unknown keys refused; bad values raise ConfigurationError.

    ``subject`` names the thing configured in error messages (a strategy's registered name)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)

    subject: ClassVar[str] = ""
    error_type: ClassVar[type[ConfigurationError]] = ConfigurationError  # what a bad value raises

    def __init__(self, *args: Any, **data: Any) -> None:
        if args:
            raise type(self).error_type(
                f"{type(self)._subject()}: settings are keyword arguments, got {len(args)} positional value(s) "
                f"{args!r}. Fix: name each setting ({', '.join(type(self).model_fields) or 'none'})"
            )
        try:
            super().__init__(**data)
        except ValidationError as exc:
            error = type(self).error_type(invalid(type(self)._subject(), type(self), exc))
            error._validation = (type(self), exc)  # type: ignore[attr-defined]  # for checked(): its own place
            raise error from None

    @model_validator(mode="before")
    @classmethod
    def _lists_as_tuples(cls, data: Any) -> Any:
        # TOML arrays and callers' lists alike: the frozen model holds tuples (a field typed as a list, lists).
        if not isinstance(data, Mapping):
            return data
        out = {}
        for key, value in data.items():
            field = cls.model_fields.get(key)
            if isinstance(value, (list, tuple)):
                value = list(value) if field is not None and _is_list(field.annotation) else tuple(value)
            out[key] = value
        return out

    @classmethod
    def _subject(cls) -> str:
        if cls.subject:
            return cls.subject
        name = getattr(cls, "name", "")
        return f"strategy {name!r}" if isinstance(name, str) and name else cls.__name__

    @classmethod
    def checked(
        cls: type[M],
        data: Mapping[str, Any],
        *,
        where: str | None = None,
        error: type[ConfigurationError] | None = None,
    ) -> M:
        """``data`` validated; a bad value raises ``error`` (default: ``error_type``) naming ``where`` (default:
        the subject)."""
        try:
            return cls(**dict(data))
        except ConfigurationError as exc:
            found: tuple[type[BaseModel], ValidationError] | None = getattr(exc, "_validation", None)
            if found is None or found[0] is not cls:  # not this model's own check (a nested one's, say)
                raise
            raise (error or cls.error_type)(invalid(where or cls._subject(), cls, found[1])) from None


def _is_list(annotation: Any) -> bool:
    if get_origin(annotation) in (Union, types.UnionType):
        return any(_is_list(arg) for arg in get_args(annotation))
    return annotation is list or get_origin(annotation) is list


# ------------------------------------------------------------------------------------------------ messages


@dataclass(frozen=True)
class Problem:
    """One bad key: what it is, why it is refused, what would be accepted, and the change that fixes it."""

    key: str
    text: str
    fix: str


def invalid(where: str, model: type[BaseModel], exc: ValidationError) -> str:
    """The whole error message: ``where: problem; problem. Fix: ...``."""
    found = settings_problems(model, exc)
    return f"{where}: {'; '.join(p.text for p in found)}. Fix: {'; '.join(dict.fromkeys(p.fix for p in found))}"


def settings_problems(model: type[BaseModel], exc: ValidationError) -> list[Problem]:
    """Each error of ``exc`` as a :class:`Problem` (one per key: a union's alternatives are one problem)."""
    problems: dict[str, Problem] = {}
    for error in exc.errors(include_url=False):
        loc = error.get("loc", ())
        kind = str(error.get("type", ""))
        field_name = str(loc[0]) if loc and isinstance(loc[0], str) else ""
        key = _key(loc)
        if key in problems:
            continue
        field = model.model_fields.get(field_name)
        value = error.get("input")
        if not field_name and kind == "value_error":  # a check across settings (a model validator)
            problems[key] = Problem(key, _reason(kind, error, value), "change one of the settings it names")
            continue
        if kind == "extra_forbidden":
            known = list(model.model_fields)
            close = difflib.get_close_matches(field_name, known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            problems[key] = Problem(
                key,
                f"{key} = {_show(value)}: unknown key{hint}; the keys are {', '.join(known) or 'none'}",
                f"rename {key} to {close[0]}" if close else f"remove {key}",
            )
            continue
        allowed = describe(field) if field is not None else "a valid value"
        if kind == "missing":
            problems[key] = Problem(key, f"{key} is missing: expected {allowed}", f"set {key} to {allowed}")
            continue
        reason = _reason(kind, error, value)
        default = _default(field)
        leave = f", or leave it out (default {default})" if default is not None else ""
        problems[key] = Problem(
            key,
            f"{key} = {_show(value)}: {reason}; allowed: {allowed}" + (f" (default {default})" if default else ""),
            f"set {field_name or key} to {allowed}{leave}",
        )
    return list(problems.values())


def _key(loc: tuple[Any, ...]) -> str:
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif isinstance(part, str) and not part.startswith(("function-", "tuple[", "list[")):
            text += f".{part}" if text else part
    return text or "value"


def _reason(kind: str, error: Any, value: Any) -> str:
    if kind.endswith("_type") or kind in ("literal_error", "is_instance_of"):
        return f"wrong type ({_type_name(value)})" if kind != "literal_error" else "not one of the allowed values"
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        return "out of range"
    if kind == "finite_number":
        return "not a finite number"
    if kind in ("too_short", "string_too_short"):
        return "too short"
    if kind == "value_error":
        ctx = error.get("ctx") or {}
        return str(ctx.get("error", error.get("msg", "not allowed")))
    return str(error.get("msg", "not allowed"))


def _type_name(value: Any) -> str:
    name = _TYPE_NAMES.get(type(value))
    if name is not None:
        return name
    if isinstance(value, (tuple, list)):
        return "a list"
    if isinstance(value, dict):
        return "a table"
    return type(value).__name__


def _show(value: Any) -> str:
    text = ("true" if value else "false") if isinstance(value, bool) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _default(field: FieldInfo | None) -> str | None:
    if field is None or field.default is PydanticUndefined or field.default_factory is not None:
        return None
    value = field.default
    if value is None:
        return "unset"
    if isinstance(value, tuple):
        return "[" + ", ".join(repr(v) for v in value) + "]" if value else "[]"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, str) else str(value)


def describe(field: FieldInfo) -> str:
    """What a field accepts, in words: ``"a whole number >= 0"``, ``"a list of strings"``, ``"a number in [0, 1)"``.

    A field may say it itself with ``json_schema_extra={"allowed": "..."}`` (for checks a validator makes)."""
    extra = field.json_schema_extra
    if isinstance(extra, dict) and isinstance(extra.get("allowed"), str):
        return str(extra["allowed"])
    return _kind(field.annotation) + _bounds(field.metadata)


def _kind(annotation: Any, many: bool = False) -> str:
    if annotation in _KINDS:
        return _KINDS[annotation][1 if many else 0]
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        values = ", ".join(repr(a) for a in args)
        return f"values from {values}" if many else f"one of {values}"
    if origin in (tuple, list) or annotation in (tuple, list):
        inner = args[0] if args else Any
        return f"a list of {_kind(inner, many=True)}"
    if origin in (Union, types.UnionType):
        kinds = [_kind(a, many) for a in args if a is not type(None)]
        text = " or ".join(kinds)
        return f"{text} (or unset)" if type(None) in args and not many else text
    if annotation is Any or annotation is None:
        return "any value"
    return getattr(annotation, "__name__", str(annotation))


def _bounds(metadata: list[Any]) -> str:
    low: tuple[str, Any] | None = None
    high: tuple[str, Any] | None = None
    for item in metadata:
        for attr, side in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            bound = getattr(item, attr, None)
            if bound is not None and isinstance(item, (annotated_types.BaseMetadata, annotated_types.Interval)):
                if side.startswith(">"):
                    low = (side, bound)
                else:
                    high = (side, bound)
        if isinstance(item, annotated_types.MinLen) and item.min_length:
            return " (not empty)" if item.min_length == 1 else f" of at least {item.min_length}"
    if low and high:
        return f" in {'[' if low[0] == '>=' else '('}{low[1]}, {high[1]}{']' if high[0] == '<=' else ')'}"
    if low:
        return f" {low[0]} {low[1]}"
    if high:
        return f" {high[0]} {high[1]}"
    return ""
