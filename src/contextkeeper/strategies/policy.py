"""Policies: per-model pipelines of strategy steps, as TOML files in the top-level ``strategies/`` folder.

A policy file names the models it is for (globs over the model or tokenizer name), the answer reservation to
use when a call gives none, and its ordered steps. Each step names a registered strategy, its settings and when
it runs (``when``: ``"over_budget"`` — the default —, ``"always"``, ``"over:0.9"`` for a fraction of the budget,
``"every:5"`` for every fifth fit, combined with ``|`` and ``&``). Everything is checked when the file is loaded,
against each strategy's settings model (see :func:`~contextkeeper.strategies.settings_model`): an unknown key, a
value of the wrong type or out of range is a :class:`PolicyError` naming the file, the step, the key, the value
and what is allowed. The sliding window always closes the pipeline, so a fit is guaranteed whatever the steps do.

Your own policy files take part in ``policy="auto"`` (and in look-ups by name) before the built-in ones: list
files or folders in the ``CONTEXTKEEPER_POLICY_PATH`` environment variable (separated like ``PATH``), or call
:func:`register_policy_path`.
"""

from __future__ import annotations

import fnmatch
import functools
import os
import sys
from collections.abc import Iterable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar

from pydantic import ConfigDict, Field, model_validator

from .._exceptions import ConfigurationError, PolicyError
from .._memo import memoize
from .base import STRATEGIES, Always, OverBudget, Pipeline, Trigger, TurnCount
from .registry import build_strategy, load_builtin, settings_model
from .settings import Settings

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = [
    "POLICY_PATH_ENV",
    "Policy",
    "PolicyError",
    "PolicyStep",
    "load_policy",
    "parse_trigger",
    "policy_files",
    "register_policy_path",
    "resolve_policy",
    "user_policy_files",
    "validate_policy_files",
]

#: The environment variable listing your own policy files and folders (``os.pathsep``-separated).
POLICY_PATH_ENV = "CONTEXTKEEPER_POLICY_PATH"

_TRIGGERS = "over_budget, always, over:F (0 < F <= 1), every:N (N >= 1), combined with | and &"


class PolicyStep(Settings):
    """One pipeline step: a strategy, when it runs, and its settings (every other key), checked against the
    strategy's settings model when the step is made."""

    model_config = ConfigDict(extra="allow")  # merged with Settings' own
    subject: ClassVar[str] = "policy step"
    error_type: ClassVar[type[ConfigurationError]] = PolicyError

    strategy: str = Field(json_schema_extra={"allowed": "the name of a registered strategy"})
    when: str = Field(default="over_budget", json_schema_extra={"allowed": f"a trigger: {_TRIGGERS}"})

    @model_validator(mode="after")
    def _check(self) -> PolicyStep:
        where = f"step ({self.strategy})"
        _step_trigger(self.when, where)
        try:
            model = settings_model(self.strategy)
        except ConfigurationError as exc:
            raise PolicyError(f"{where}: {exc}") from None
        model.checked(self.settings(), where=where, error=PolicyError)
        return self

    def settings(self) -> dict[str, Any]:
        """The strategy's settings: every key but ``strategy`` and ``when``."""
        return dict(self.model_extra or {})


class Policy(Settings):
    """A named pipeline for the models matching ``match``."""

    subject: ClassVar[str] = "policy"
    error_type: ClassVar[type[ConfigurationError]] = PolicyError

    name: str = Field(min_length=1)
    description: str = ""
    match: tuple[str, ...] = Field(default=(), json_schema_extra={"allowed": "a list of globs (strings)"})
    answer_tokens: int = Field(default=1024, gt=0)
    # Expected characters per token beyond which history is not read (0: read everything).
    horizon: float = Field(default=4.75, ge=0)
    steps: tuple[PolicyStep, ...] = Field(default=(), json_schema_extra={"allowed": "a list of [[steps]] tables"})

    def pipeline(self) -> Pipeline:
        """The strategies, built and configured, each with its trigger."""
        built = []
        for index, step in enumerate(self.steps):
            where = f"policy {self.name!r}: steps[{index}] ({step.strategy})"
            strategy = build_strategy(step.strategy, step.settings(), where=where, error=PolicyError)
            built.append((strategy, parse_trigger(step.when)))
        return Pipeline(tuple(built))


# ------------------------------------------------------------------------------------------- triggers


def parse_trigger(text: str) -> Trigger:
    """``over_budget``, ``always``, ``over:F``, ``every:N``, combined with ``|`` (lower precedence) and ``&``.

    A bad trigger is a :class:`PolicyError` naming the term, what is allowed, and a fix."""
    if not isinstance(text, str):
        raise PolicyError(f'when = {text!r}: a trigger is a string. Fix: write when = "over_budget" ({_TRIGGERS})')
    result: Trigger | None = None
    for alternative in text.split("|"):
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
    problem = f"unknown trigger {term!r}"
    if name == "over":
        try:
            fraction = float(value)
        except ValueError:
            problem = "F is not a number"
        else:
            if 0 < fraction <= 1:  # also refuses nan
                return OverBudget(fraction)
            problem = "the fraction of the budget F is out of range"
    elif name == "every":
        try:
            every = int(value)
        except ValueError:
            problem = "N is not a whole number"
        else:
            if every >= 1:
                return TurnCount(every)
            problem = "the period N is out of range"
    if name in ("over", "every") and term != whole:
        problem = f"{problem} in {term!r}"
    raise PolicyError(
        f'when = {whole!r}: {problem}; allowed: {_TRIGGERS}. Fix: e.g. when = "over:0.8" (at 80% of the budget) '
        'or when = "every:5 & over_budget"'
    )


def _step_trigger(when: str, where: str) -> None:
    try:
        parse_trigger(when)
    except PolicyError as exc:
        raise PolicyError(f"{where}: {exc}") from None


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
    source = Path(__file__).resolve().parents[3] / "strategies"
    if source.is_dir() and source not in dirs:
        dirs.append(source)
    return dirs


def policy_files() -> list[Path]:
    """Every built-in policy file."""
    return sorted(p for d in _policy_dirs() for p in d.glob("*.toml"))


def _read(file: Path) -> dict[str, Any]:
    """The TOML table in ``file``; a PolicyError for anything that is not a readable UTF-8 TOML file."""
    if file.is_dir():
        raise PolicyError(
            f"{file} is a folder, not a policy file. Fix: pass one .toml file, or list the folder in "
            f"{POLICY_PATH_ENV} (or register_policy_path) so that policy='auto' and names find its files"
        )
    try:
        raw = file.read_bytes()
    except FileNotFoundError:
        raise PolicyError(f"policy file {file} does not exist. Fix: check the path, or name a policy") from None
    except OSError as exc:
        raise PolicyError(f"cannot read policy file {file}: {exc.strerror or exc}. Fix: check the path") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PolicyError(
            f"{file}: not a text file (byte {exc.start} is 0x{raw[exc.start]:02x}, not UTF-8). Fix: a policy file is "
            "UTF-8 TOML; pass the .toml file, not a binary one"
        ) from None
    if "\x00" in text:
        raise PolicyError(f"{file}: not a text file (it holds NUL bytes). Fix: pass a UTF-8 TOML policy file")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(f"{file}: not valid TOML: {exc}. Fix: correct the TOML syntax at that line") from None


def load_policy(path: str | os.PathLike[str]) -> Policy:
    """Read and validate one policy file: every key, step, trigger and setting."""
    file = Path(path)
    data = _read(file)
    raw_steps = data.get("steps", [])
    if not isinstance(raw_steps, list):
        raise PolicyError(
            f"{file}: steps = {_show(raw_steps)}: expected a list of [[steps]] tables. Fix: write each step as its "
            'own [[steps]] block (double brackets) with strategy = "..."'
        )
    # Every problem of the file at once: one run of `policy validate` shows all that needs fixing.
    problems: list[PolicyError] = []
    steps: list[PolicyStep] = []
    for index, raw in enumerate(raw_steps):
        try:
            steps.append(_load_step(file, index, raw))
        except PolicyError as exc:
            problems.append(exc)
    fields = {key: value for key, value in data.items() if key != "steps"}
    fields.setdefault("name", file.stem)
    try:
        policy = Policy.checked({**fields, "steps": tuple(steps)}, where=str(file))
    except PolicyError as exc:
        problems.append(exc)
    if len(problems) == 1:
        raise problems[0]
    if problems:
        prefix = f"{file}: "
        parts = [str(problem).removeprefix(prefix).partition(". Fix: ") for problem in problems]
        fixes = "; ".join(fix for _, _, fix in parts if fix)
        raise PolicyError(f"{file}: {len(parts)} problems: {' | '.join(text for text, _, _ in parts)}. Fix: {fixes}")
    return policy


def _load_step(file: Path, index: int, raw: Any) -> PolicyStep:
    where = f"{file}: steps[{index}]"
    if not isinstance(raw, Mapping):
        raise PolicyError(
            f"{where} = {_show(raw)}: expected a table. Fix: write the step as a [[steps]] block with "
            'strategy = "..." and its settings'
        )
    strategy = raw.get("strategy")
    if not isinstance(strategy, str):
        got = "is missing" if strategy is None else f"= {_show(strategy)} is not a string"
        raise PolicyError(f'{where}.strategy {got}. Fix: add strategy = "<name>" to the step ({_known()})')
    try:
        model = settings_model(strategy)
    except ConfigurationError:
        raise PolicyError(
            f"{where}.strategy = {strategy!r}: unknown strategy; known: {_known()}. Fix: use one of those names, "
            "or register your strategy before loading the file"
        ) from None
    _step_trigger(raw.get("when", "over_budget"), where)
    settings = {key: value for key, value in raw.items() if key not in ("strategy", "when")}
    model.checked(settings, where=f"{where} ({strategy})", error=PolicyError)
    return PolicyStep(**raw)


def _known() -> str:
    load_builtin()
    return ", ".join(sorted(STRATEGIES))


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@functools.cache
def _builtin() -> tuple[Policy, ...]:
    return tuple(load_policy(path) for path in policy_files())


# ------------------------------------------------------------------------------------------- your own policies

_REGISTERED: list[Path] = []


def register_policy_path(*paths: str | os.PathLike[str]) -> None:
    """Add policy files or folders (every ``*.toml`` in it) to those ``policy="auto"`` and look-ups by name search
    before the built-in ones (after the ones in ``CONTEXTKEEPER_POLICY_PATH``), in the order given."""
    for path in paths:
        entry = Path(path).expanduser()
        if not entry.exists():
            raise PolicyError(f"register_policy_path: {entry} does not exist. Fix: pass a policy file or folder")
        entry = entry.resolve()
        if entry not in _REGISTERED:
            _REGISTERED.append(entry)


def user_policy_files() -> list[Path]:
    """Your policy files, in search order: those in ``CONTEXTKEEPER_POLICY_PATH``, then those registered with
    :func:`register_policy_path`; a folder contributes its ``*.toml`` files by name."""
    entries: list[Path] = []
    for text in os.environ.get(POLICY_PATH_ENV, "").split(os.pathsep):
        if text.strip():
            entry = Path(text.strip()).expanduser()
            if not entry.exists():
                raise PolicyError(
                    f"{POLICY_PATH_ENV} names {entry}, which does not exist. Fix: correct or remove that entry"
                )
            entries.append(entry.resolve())
    entries.extend(_REGISTERED)
    files: list[Path] = []
    for entry in entries:
        for file in sorted(entry.glob("*.toml")) if entry.is_dir() else [entry]:
            if file not in files:
                files.append(file)
    return files


def _user_policies() -> list[Policy]:
    """Your policies, loaded once per file version (a file that changes is read again)."""
    policies = []
    for file in user_policy_files():
        stat = file.stat()
        policies.append(_load_version(file, (stat.st_mtime_ns, stat.st_size)))
    return policies


@memoize("policy.files", sizer=lambda key, policy: 2048 + 512 * len(policy.steps))
def _load_version(file: Path, version: tuple[int, int]) -> Policy:
    """One version (mtime, size) of a policy file, parsed once while it stays in the shared cache."""
    return load_policy(file)


def _is_path(policy: str) -> bool:
    return policy.endswith(".toml") or "/" in policy or os.sep in policy or Path(policy).is_file()


def resolve_policy(policy: str | os.PathLike[str] | Policy | None, model_name: str = "") -> Policy:
    """A Policy object, a file path, a policy name, or ``None``/``"auto"`` for the first policy whose ``match``
    globs match ``model_name`` (else ``default``). Your own policies (``CONTEXTKEEPER_POLICY_PATH``,
    :func:`register_policy_path`) come before the built-in ones, for names and for ``match``."""
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, os.PathLike) or (isinstance(policy, str) and _is_path(policy)):
        return load_policy(policy)
    if policy is not None and not isinstance(policy, str):
        raise PolicyError(
            f"policy must be a name, a .toml file or a Policy, got {type(policy).__name__}. Fix: pass e.g. "
            'policy="default"'
        )
    own = _user_policies()
    builtin = _builtin()
    if policy in (None, "auto"):
        name = model_name.lower()
        for candidate in own:
            if any(fnmatch.fnmatch(name, glob.lower()) for glob in candidate.match):
                return candidate
        for candidate in builtin:
            if candidate.name != "default" and any(fnmatch.fnmatch(name, glob.lower()) for glob in candidate.match):
                return candidate
        policy = "default"
    for candidate in (*own, *builtin):
        if candidate.name == policy:
            return candidate
    yours = f"your policies: {', '.join(p.name for p in own)}; " if own else ""
    folder = f" ({policy} is a folder: pass one .toml file from it)" if Path(policy).is_dir() else ""
    raise PolicyError(
        f"unknown policy {policy!r}{folder}: pass a .toml file or a policy name ({yours}built-in policies: "
        f"{', '.join(p.name for p in builtin)}). Fix: use one of those names, or list your policy files in "
        f"{POLICY_PATH_ENV}"
    )


def validate_policy_files(paths: Iterable[str | os.PathLike[str]]) -> list[tuple[Path, str]]:
    """``(file, problem)`` for each file that does not validate (empty: all good)."""
    problems: list[tuple[Path, str]] = []
    for path in paths:
        try:
            load_policy(path)
        except PolicyError as exc:
            problems.append((Path(path), str(exc)))
    return problems
