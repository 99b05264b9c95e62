"""The contextkeeper pytest plugin: unit tests for prompt budgets.

Registered through the ``pytest11`` entry point, so installing contextkeeper enables it. It costs nothing until a
test asks for one of its fixtures: this module imports only pytest and the standard library, and tokenizers are
loaded on first use (then shared by every test of the session with the same settings).

Fixtures:

* ``prompt_budget(tokenizer=..., context_window=..., max_tokens=..., chat_template=None, policy=None,
  model=None, gpu=None, concurrency=1)`` returns a :class:`~contextkeeper.testing.PromptBudget` with
  ``assert_fits(messages, tools=None)``, ``count(...)``, ``fit(...)`` and ``snapshot(...)``;
* ``prompt_snapshot(fit, name=None)`` pins a fitted prompt in ``__snapshots__/<test module>/<name>.json``.

Defaults, closest first: the factory's arguments, ``@pytest.mark.contextkeeper(...)`` (same keywords; a class or
module marker applies to its tests), ``[tool.contextkeeper]`` in the project's ``pyproject.toml``.
``--update-prompt-snapshots`` rewrites snapshots.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from .budget import PromptBudget
    from .snapshot import SnapshotLog, SnapshotStore

__all__ = ["prompt_budget", "prompt_snapshot"]

MARKER_HELP = (
    "contextkeeper(tokenizer=..., context_window=..., max_tokens=..., chat_template=None, policy=None, "
    "model=None, gpu=None, concurrency=1): defaults for the prompt_budget fixture "
    "(closest wins: fixture arguments > marker > [tool.contextkeeper] in pyproject.toml)"
)


@dataclass
class _Session:
    """Per-session caches: the pyproject settings, counters by tokenizer, keepers by settings, snapshot log."""

    pyproject: dict[str, Any] | None = None
    counters: dict[Any, Any] = field(default_factory=dict)
    keepers: dict[Any, Any] = field(default_factory=dict)
    log: SnapshotLog | None = None


_SESSION = pytest.StashKey[_Session]()
_STORE = pytest.StashKey["SnapshotStore"]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("contextkeeper", "contextkeeper prompt budgets")
    group.addoption(
        "--update-prompt-snapshots",
        action="store_true",
        default=False,
        help="rewrite the prompt snapshots of prompt_snapshot / budget.snapshot() with this run's fitted prompts",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARKER_HELP)
    config.stash[_SESSION] = _Session()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    log = config.stash[_SESSION].log if _SESSION in config.stash else None
    if log is None or not (log.created or log.updated):
        return
    terminalreporter.write_sep("-", "contextkeeper prompt snapshots")
    for verb, paths in (("wrote", log.created), ("updated", log.updated)):
        for path in paths:
            terminalreporter.write_line(f"{verb} {path}")


def _session(config: pytest.Config) -> _Session:
    if _SESSION not in config.stash:  # the plugin was registered after configure (pytester inline runs)
        config.stash[_SESSION] = _Session()
    return config.stash[_SESSION]


def _pyproject(config: pytest.Config) -> dict[str, Any]:
    from .settings import read_pyproject

    session = _session(config)
    if session.pyproject is None:
        session.pyproject = read_pyproject(config.rootpath)  # SettingsError: the test using it fails
    return session.pyproject


def _markers(node: pytest.Item) -> list[Mapping[str, Any]]:
    from .settings import SettingsError, check_values

    found = []
    for marker in node.iter_markers("contextkeeper"):  # closest first
        if marker.args:
            raise SettingsError(
                f"@pytest.mark.contextkeeper takes keywords only (tokenizer=..., context_window=...), got "
                f"positional {marker.args!r}"
            )
        check_values(marker.kwargs, "@pytest.mark.contextkeeper", strict_types=False)
        found.append(marker.kwargs)
    return found


def _store(request: pytest.FixtureRequest) -> SnapshotStore:
    from .snapshot import SnapshotLog, SnapshotStore

    node: pytest.Item = request.node
    if _STORE not in node.stash:
        session = _session(request.config)
        if session.log is None:
            session.log = SnapshotLog()
        directory = request.path.parent / "__snapshots__" / request.path.stem
        update = bool(request.config.getoption("update_prompt_snapshots", False))
        node.stash[_STORE] = SnapshotStore(directory, node.name, update=update, log=session.log)
    return node.stash[_STORE]


@pytest.fixture
def prompt_budget(request: pytest.FixtureRequest) -> Callable[..., PromptBudget]:
    """A factory of prompt budgets: ``prompt_budget(tokenizer=..., context_window=..., max_tokens=...)``.

    Unset arguments come from ``@pytest.mark.contextkeeper(...)`` and then ``[tool.contextkeeper]``.
    """

    def factory(
        tokenizer: Any = None,
        *,
        context_window: int | None = None,
        max_tokens: int | None = None,
        chat_template: str | None = None,
        policy: Any = None,
        model: Any = None,
        gpu: Any = None,
        concurrency: int | None = None,
        runtime: str | None = None,
        kv_dtype: str | None = None,
    ) -> PromptBudget:
        __tracebackhide__ = True
        from .._exceptions import ContextKeeperError
        from .budget import PromptBudget, build_keeper
        from .settings import SettingsError, merge_settings

        arguments = {
            "tokenizer": tokenizer,
            "context_window": context_window,
            "max_tokens": max_tokens,
            "chat_template": chat_template,
            "policy": policy,
            "model": model,
            "gpu": gpu,
            "concurrency": concurrency,
            "runtime": runtime,
            "kv_dtype": kv_dtype,
        }
        try:
            settings = merge_settings(arguments, _markers(request.node), _pyproject(request.config))
        except SettingsError as exc:
            pytest.fail(str(exc), pytrace=False)
        answer = settings.get("max_tokens")
        if answer is not None and (isinstance(answer, bool) or not isinstance(answer, int) or answer <= 0):
            pytest.fail(f"prompt_budget: max_tokens must be a positive integer, got {answer!r}", pytrace=False)
        session = _session(request.config)
        key = settings.key()
        keeper = session.keepers.get(key)
        if keeper is None:
            try:
                keeper = build_keeper(settings, session.counters)
            except ContextKeeperError as exc:
                pytest.fail(
                    f"prompt_budget: {exc}\n(settings: {settings.describe() or 'none'}; set them as fixture "
                    "arguments, with @pytest.mark.contextkeeper(...), or in [tool.contextkeeper] of pyproject.toml)",
                    pytrace=False,
                )
            session.keepers[key] = keeper
        return PromptBudget(keeper, settings, _store(request))

    return factory


@pytest.fixture
def prompt_snapshot(request: pytest.FixtureRequest) -> SnapshotStore:
    """``prompt_snapshot(fit, name=None)``: compare a fitted prompt with its stored snapshot (fail with a diff
    when it changed; ``--update-prompt-snapshots`` rewrites it)."""
    return _store(request)
