"""The shapes every message module shares: roles, the strict frozen model base, and the error constructor that carries
our wording through pydantic."""

from __future__ import annotations

from typing import Any, Literal, TypeAlias

from pydantic import (
    BaseModel,
    ConfigDict,
)
from pydantic_core import PydanticCustomError

from contextkeeper._memo import data_size

__all__ = ["VALID_ROLES", "ContentFormat", "Role", "UnitKind"]


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

_SCALARS = frozenset({str, int, float, bool, type(None)})
