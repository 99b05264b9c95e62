"""Policies: per-model pipelines of strategy steps, as TOML files in the top-level ``strategies/`` folder.

A policy file names the models it is for (globs over the model or tokenizer name), the answer reservation to
use when a call gives none, and its ordered steps. Each step names a registered strategy, its settings and when
it runs (``when``: ``"over_budget"`` — the default —, ``"always"``, ``"over:0.9"`` for a fraction of the budget,
``"every:5"`` for every fifth fit, combined with ``|`` and ``&``). Unknown keys are errors naming the file and
the key. The sliding window always closes the pipeline, so a fit is guaranteed whatever the steps do.
"""

from __future__ import annotations

import fnmatch
import functools
import sys
from collections.abc import Iterable
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ._exceptions import ConfigurationError
from .strategies.base import STRATEGIES, Always, OverBudget, Pipeline, Trigger, TurnCount, build_strategy

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = [
    "Policy",
    "PolicyError",
    "PolicyStep",
    "load_policy",
    "policy_files",
    "resolve_policy",
    "validate_policy_files",
]


class PolicyError(ConfigurationError):
    """A policy file that cannot be used: malformed TOML, an unknown key, strategy or setting."""


class PolicyStep(BaseModel):
    """One pipeline step: a strategy, when it runs, and its settings (every other key)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    strategy: str
    when: str = "over_budget"

    @field_validator("when")
    @classmethod
    def _check_when(cls, value: str) -> str:
        parse_trigger(value)
        return value

    def settings(self) -> dict[str, Any]:
        extra = dict(self.model_extra or {})
        return {k: tuple(v) if isinstance(v, list) else v for k, v in extra.items()}


class Policy(BaseModel):
    """A named pipeline for the models matching ``match``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    description: str = ""
    match: tuple[str, ...] = ()
    answer_tokens: int = Field(default=1024, gt=0)
    horizon: float = Field(default=4.75, ge=0)  # expected characters per token beyond which history is not read
    steps: tuple[PolicyStep, ...] = ()

    def pipeline(self) -> Pipeline:
        """The strategies, built and configured, each with its trigger."""
        built = []
        for step in self.steps:
            built.append((build_strategy(step.strategy, step.settings()), parse_trigger(step.when)))
        return Pipeline(tuple(built))


def parse_trigger(text: str) -> Trigger:
    """``over_budget``, ``always``, ``over:F``, ``every:N``, combined with ``|`` (lower precedence) and ``&``."""
    alternatives = [part.strip() for part in text.split("|")]
    result: Trigger | None = None
    for alternative in alternatives:
        conjunction: Trigger | None = None
        for term in (t.strip() for t in alternative.split("&")):
            trigger = _term(term, text)
            conjunction = trigger if conjunction is None else conjunction & trigger
        assert conjunction is not None
        result = conjunction if result is None else result | conjunction
    assert result is not None
    return result


def _term(term: str, whole: str) -> Trigger:
    if term == "over_budget":
        return OverBudget()
    if term == "always":
        return Always()
    name, _, value = term.partition(":")
    try:
        if name == "over":
            return OverBudget(float(value))
        if name == "every":
            return TurnCount(int(value))
    except ValueError:
        pass
    raise ValueError(f"unknown trigger {term!r} in {whole!r}: use over_budget, always, over:F or every:N with | and &")


# ------------------------------------------------------------------------------------------- files


def _policy_dirs() -> list[Path]:
    """The packaged policies (``contextkeeper/_policies`` in a wheel) or the repository's ``strategies/``."""
    dirs: list[Path] = []
    try:
        packaged = resources.files("contextkeeper").joinpath("_policies")
        if packaged.is_dir():
            dirs.append(Path(str(packaged)))
    except (ModuleNotFoundError, FileNotFoundError):
        pass
    source = Path(__file__).resolve().parents[2] / "strategies"
    if source.is_dir() and source not in dirs:
        dirs.append(source)
    return dirs


def policy_files() -> list[Path]:
    """Every built-in policy file."""
    return sorted(p for d in _policy_dirs() for p in d.glob("*.toml"))


def load_policy(path: str | Path) -> Policy:
    """Read and validate one policy file."""
    file = Path(path)
    try:
        data = tomllib.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PolicyError(f"policy file {file} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(f"{file}: not valid TOML: {exc}") from None
    data.setdefault("name", file.stem)
    try:
        policy = Policy.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in error['loc']) or 'file'}: {error['msg']}" for error in exc.errors()
        )
        raise PolicyError(f"{file}: {problems}") from None
    from .strategies import _load_builtin

    _load_builtin()
    for index, step in enumerate(policy.steps):
        if step.strategy not in STRATEGIES:
            raise PolicyError(
                f"{file}: steps[{index}].strategy: unknown strategy {step.strategy!r}; "
                f"known: {', '.join(sorted(STRATEGIES))}"
            )
        try:
            build_strategy(step.strategy, step.settings())
        except ConfigurationError as exc:
            raise PolicyError(f"{file}: steps[{index}] ({step.strategy}): {exc}") from None
    return policy


@functools.cache
def _builtin() -> tuple[Policy, ...]:
    return tuple(load_policy(path) for path in policy_files())


def resolve_policy(policy: str | Path | Policy | None, model_name: str = "") -> Policy:
    """A Policy object, a file path, a built-in name, or ``None``/``"auto"`` for the first built-in policy whose
    ``match`` globs match ``model_name`` (else ``default``)."""
    if isinstance(policy, Policy):
        return policy
    if policy is not None and (str(policy).endswith(".toml") or Path(str(policy)).is_file()):
        return load_policy(policy)
    builtin = _builtin()
    if policy in (None, "auto"):
        name = model_name.lower()
        for candidate in builtin:
            if candidate.name != "default" and any(fnmatch.fnmatch(name, glob.lower()) for glob in candidate.match):
                return candidate
        policy = "default"
    for candidate in builtin:
        if candidate.name == policy:
            return candidate
    names = ", ".join(p.name for p in builtin)
    raise PolicyError(f"unknown policy {policy!r}: pass a .toml file or one of the built-in policies: {names}")


def validate_policy_files(paths: Iterable[str | Path]) -> list[tuple[Path, str]]:
    """``(file, problem)`` for each file that does not validate (empty: all good)."""
    problems: list[tuple[Path, str]] = []
    for path in paths:
        try:
            load_policy(path)
        except PolicyError as exc:
            problems.append((Path(path), str(exc)))
    return problems
