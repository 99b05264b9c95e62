"""What a keeper is configured with, as frozen keyword-only objects, each checked once when made.

``ContextKeeper(tokenizer, limit=Limit(...), admission=Admission(...), sharing=Sharing(...),
recording=Recording(...))``; the keywords of earlier releases (``context_window=``, ``ledger=``, ``transcript=``,
...) stay as shortcuts that fill the same objects. A bad value is a :class:`ConfigurationError` naming the setting.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from ._exceptions import ConfigurationError
from .calls.redis_client import SCHEMES, is_redis_url

__all__ = ["Admission", "Limit", "Recording", "Sharing"]

Unavailable = Literal["fail", "local"]


def _positive_int(name: str, value: Any, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigurationError(f"{name} must be a positive integer ({what}), got {value!r}")


def _choice(name: str, value: Any, allowed: dict[str, str]) -> None:
    if value not in allowed:
        said = " or ".join(f"{key!r} ({why})" for key, why in allowed.items())
        raise ConfigurationError(f"{name} must be {said}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class Limit:
    """Where the token limit comes from: the least of ``context_window``, the model's maximum context and, with a
    ``gpu``, what it holds for ``concurrency`` sequences on ``runtime`` with the KV cache in ``kv_dtype``
    (``model``: a config.json file or folder, a hub id, a catalog name or a ModelSpec)."""

    context_window: int | None = None
    model: Any = None
    gpu: Any = None
    concurrency: int = 1
    runtime: str = "vllm"
    kv_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.context_window is not None:
            _positive_int("context_window", self.context_window, "the tokens the model takes")
        _positive_int("concurrency", self.concurrency, "sequences the GPU holds at once")
        if self.gpu is not None and self.model is None:
            raise ConfigurationError("gpu=... needs model=... too (the KV cache per token comes from the model config)")
        if self.context_window is None and self.model is None:
            raise ConfigurationError("set context_window=N (or model=... so the model's maximum context applies)")


@dataclass(frozen=True, kw_only=True)
class Admission:
    """How wrapped calls are admitted against the KV capacity: ``mode`` "wait" (for room) or "shrink" (fitted
    into what is free) for at most ``timeout`` seconds; ``capacity`` in tokens (default: planned from the model and
    GPU, else unlimited); ``ledger`` a Redis URL that admits every process against one pool named ``pool``, and
    ``unavailable`` what to do when it cannot be reached."""

    mode: Literal["wait", "shrink"] = "wait"
    timeout: float = 30.0
    capacity: int | None = None
    ledger: str | None = None
    pool: str = "default"
    unavailable: Unavailable = "fail"

    def __post_init__(self) -> None:
        _choice("admission", self.mode, {"wait": "wait for room", "shrink": "fit the call into what is free"})
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or not self.timeout >= 0:
            raise ConfigurationError(f"admission_timeout must be a number of seconds >= 0, got {self.timeout!r}")
        if self.capacity is not None:
            _positive_int("kv_capacity", self.capacity, "KV tokens the server holds")
        if self.ledger is not None and not is_redis_url(self.ledger):
            raise ConfigurationError(
                f"ledger must be a Redis URL ({', '.join(SCHEMES)}...) or None (admission in this process), "
                f"got {self.ledger!r}"
            )
        _choice(
            "ledger_unavailable",
            self.unavailable,
            {"fail": "a typed error when Redis cannot be reached", "local": "admit in this process, with a warning"},
        )


@dataclass(frozen=True, kw_only=True)
class Sharing:
    """What replicas learn once (server limits and hidden tokens, detections, summaries): ``state`` a Redis URL or
    a SharedState, False to learn per process, None for the ledger's Redis; ``unavailable`` what to do when it
    cannot be reached (None: the ledger's choice)."""

    state: Any = None
    unavailable: Unavailable | None = None

    def __post_init__(self) -> None:
        from .calls.shared import SharedState

        state = self.state
        if not (state is False or state is None or is_redis_url(state) or isinstance(state, SharedState)):
            raise ConfigurationError(
                f"shared must be a Redis URL ({', '.join(SCHEMES)}...), a SharedState, or False (learn per process), "
                f"got {state!r}"
            )
        if self.unavailable is not None:
            _choice(
                "shared_unavailable",
                self.unavailable,
                {"fail": "a typed error when Redis cannot be reached", "local": "go on with what this process learns"},
            )

    def resolved(self, admission: Admission) -> Sharing:
        """With the defaults that follow the admission filled in: the ledger's Redis and its choice."""
        state = admission.ledger if self.state is None else self.state
        unavailable = self.unavailable if self.unavailable is not None else admission.unavailable
        return Sharing(state=state or None, unavailable=unavailable)


@dataclass(frozen=True, kw_only=True)
class Recording:
    """What wrapped calls leave behind: ``transcript`` (None: in memory; a .sqlite path; a postgresql:// URL; a
    Transcript) and ``monitor`` (a MemoryMonitor sampled after each call)."""

    transcript: Any = None
    monitor: Any = None

    def __post_init__(self) -> None:
        from .calls.transcript import check_transcript

        object.__setattr__(self, "transcript", check_transcript(self.transcript))


C = TypeVar("C", Limit, Admission, Sharing, Recording)


def merged(kind: type[C], given: C | None, name: str, shortcuts: dict[str, tuple[str, Any]]) -> C:
    """``given`` (passed as ``name=``), or one made from the shortcut keywords (``field: (keyword, value)``). Both
    at once is an error when a shortcut differs from its default: one place says each setting."""
    if given is None:
        return kind(**{field: value for field, (_, value) in shortcuts.items()})
    if not isinstance(given, kind):
        raise ConfigurationError(f"{name} must be a contextkeeper.config.{kind.__name__}, got {given!r}")
    defaults = {field.name: field.default for field in dataclasses.fields(kind)}
    clashing = [keyword for field, (keyword, value) in shortcuts.items() if value != defaults[field]]
    if clashing:
        raise ConfigurationError(
            f"{name}={kind.__name__}(...) and {', '.join(f'{k}=' for k in clashing)} both given. Fix: set "
            f"{'it' if len(clashing) == 1 else 'them'} in the {kind.__name__} (its fields: "
            f"{', '.join(defaults)})"
        )
    return given
