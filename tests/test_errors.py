"""The error tree: one root, drawn in the docstring of ``contextkeeper._exceptions`` exactly as the classes are.

The drawing is parsed (connectors and all), then held against the classes: every name in ``__all__`` sits under
the nearest drawn class it subclasses, every public error class any module of the package defines is drawn (found
by walking the package in a fresh interpreter, so that no earlier test's imports decide what is found), and
``fix_text()`` of every drawn error reads its "Fix:" text back when no ``fix`` is set.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
import subprocess
import sys
from typing import Any

import pytest

import contextkeeper as ck
from contextkeeper import _exceptions

# Public error classes outside the tree, each with why it is not a ContextKeeperError.
OUTSIDE_THE_TREE: dict[str, str] = {
    "contextkeeper.cli.UsageError": "the command line's own error: exit code 2, never raised to Python callers",
}

# Runs in the fresh interpreter; prints, for every public exception class a module defines, its ancestors.
PROBE = r"""
import importlib, inspect, json, pkgutil

import contextkeeper

found, failures = [], {}
def failed(name):
    failures[name] = "import failed while walking"
for info in pkgutil.walk_packages(contextkeeper.__path__, "contextkeeper.", onerror=failed):
    if info.name.rpartition(".")[2] == "__main__":  # importing it runs the command line
        continue
    try:
        module = importlib.import_module(info.name)
    except Exception as exc:
        failures[info.name] = repr(exc)
        continue
    for name, value in vars(module).items():
        if (
            not name.startswith("_")
            and inspect.isclass(value)
            and issubclass(value, BaseException)
            and value.__module__ == module.__name__
        ):
            mro = [c.__name__ for c in value.__mro__]
            found.append({"key": f"{module.__name__}.{name}", "name": name, "mro": mro, "warning": "Warning" in mro})
print(json.dumps({"found": found, "failures": failures}))
"""

# Keyword arguments the constructors require besides the message (a new class that needs more fails loudly).
REQUIRED: dict[str, dict[str, Any]] = {
    "RequestTooLarge": {"needed": 700, "limit": 600},
    "RequestRejected": {"code": "body_too_large", "status": 413},
    "TemplateLimitExceeded": {"bound": "steps", "limit": 1000, "setting": "max_steps"},
    "AdmissionTimeout": {
        "requested": 900,
        "active": 500,
        "capacity": 1000,
        "waited": 2.0,
        "in_flight": 3,
        "label": "user-42",
    },
    "ExceedsCapacity": {"requested": 1500, "capacity": 1000, "label": "user-42"},
}
_LINE = re.compile(r"(?P<prefix>(?:│   |    )*)(?:(?P<connector>[├└])── )?(?P<name>[A-Za-z]\w*)(?:\s.*)?")


@functools.cache
def drawn(block: int = 1) -> dict[str, str | None]:
    """Each class drawn in the module docstring's tree -> the class drawn as its parent (None for the root), in
    drawing order; ``block`` 1 is the error tree, 3 the warnings. The drawing must be well formed: one root, four
    columns a level, ``└──`` on exactly the last child of each parent and a ``│`` column wherever that ancestor has
    children still to come."""
    doc = _exceptions.__doc__ or ""
    blocks = doc.split("```")
    assert len(blocks) == 5, "the docstring holds two ``` blocks: the errors' tree and the warnings'"
    parents: dict[str, str | None] = {}
    children: dict[str, list[tuple[str, str]]] = {}
    path: list[tuple[str, str]] = []  # the current line's ancestors: (name, its connector)
    for line in blocks[block].strip("\n").splitlines():
        match = _LINE.fullmatch(line)
        assert match, f"not a line of the tree: {line!r}"
        prefix, connector, name = match["prefix"], match["connector"], match["name"]
        assert name not in parents, f"{name} is drawn twice"
        if connector is None:
            assert not parents, f"{name}: only the first line is the root"
            assert not prefix, f"{name}: the root is not indented"
            parents[name] = None
            path = [(name, "└")]
            continue
        depth = len(prefix) // 4 + 1
        assert 1 <= depth <= len(path), f"{name}: indented deeper than its parent"
        path = path[:depth]
        for column, (_, its_connector) in enumerate(path[1:]):
            wanted = "│   " if its_connector == "├" else "    "
            assert prefix[4 * column : 4 * column + 4] == wanted, f"{name}: column {column} should be {wanted!r}"
        parent = path[-1][0]
        parents[name] = parent
        children.setdefault(parent, []).append((name, connector))
        path.append((name, connector))
    for parent, kids in children.items():
        connectors = [connector for _, connector in kids]
        assert connectors == ["├"] * (len(kids) - 1) + ["└"], f"{parent}: └── goes on the last child only"
    return parents


@functools.cache
def probe() -> dict[str, Any]:
    """Every public exception class the package defines, as a fresh interpreter sees it (run once per session)."""
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def nearest_drawn(mro: list[str], block: int = 1) -> str | None:
    """The parent a class belongs under: the first of its ancestors that the tree draws."""
    return next((name for name in mro[1:] if name in drawn(block)), None)


def test_errors_form_one_tree() -> None:
    for name in ck.__all__:
        value = getattr(ck, name)
        if inspect.isclass(value) and issubclass(value, Exception) and not issubclass(value, Warning):
            assert issubclass(value, ck.ContextKeeperError), name


def test_the_drawing_is_one_well_formed_tree_under_the_root() -> None:
    tree = drawn()
    assert next(iter(tree)) == "ContextKeeperError"
    assert [name for name, parent in tree.items() if parent is None] == ["ContextKeeperError"]
    assert len(tree) > 20  # the whole tree was read, not just its first branch


@pytest.mark.parametrize("name", _exceptions.__all__)
def test_every_exported_error_is_drawn_under_the_parent_it_subclasses(name: str) -> None:
    cls = getattr(_exceptions, name)
    assert inspect.isclass(cls)
    warning = issubclass(cls, Warning)
    assert issubclass(cls, _exceptions.ContextKeeperWarning if warning else _exceptions.ContextKeeperError)
    block = 3 if warning else 1
    assert name in drawn(block), f"{name} is in __all__ but not drawn in the module docstring's tree"
    parent = drawn(block)[name]
    assert parent == nearest_drawn([c.__name__ for c in cls.__mro__], block), (
        f"{name} is drawn under {parent}, but the nearest drawn class it subclasses is "
        f"{nearest_drawn([c.__name__ for c in cls.__mro__], block)}"
    )


def test_every_error_the_package_defines_is_drawn_under_its_parent() -> None:
    report = probe()
    assert report["failures"] == {}
    found = [entry for entry in report["found"] if not entry["warning"]]
    names = [entry["name"] for entry in found]
    assert len(names) == len(set(names)), "two modules define an error of the same name: the tree cannot tell them"
    in_tree = {entry["name"]: entry for entry in found if "ContextKeeperError" in entry["mro"]}
    outside = {entry["key"] for entry in found if "ContextKeeperError" not in entry["mro"]}
    assert outside == set(OUTSIDE_THE_TREE), "subclass ContextKeeperError (and draw it), or say here why not"
    assert all(reason.strip() for reason in OUTSIDE_THE_TREE.values())
    assert sorted(in_tree) == sorted(drawn()), "the drawing and the classes the package defines differ"
    misplaced = {
        name: (drawn()[name], nearest_drawn(entry["mro"]))
        for name, entry in in_tree.items()
        if drawn()[name] != nearest_drawn(entry["mro"])
    }
    assert misplaced == {}, "name: (drawn under, subclasses)"


def test_every_warning_the_package_defines_is_drawn_under_its_parent() -> None:
    found = [entry for entry in probe()["found"] if entry["warning"]]
    assert {entry["name"] for entry in found} == set(drawn(3))
    assert next(iter(drawn(3))) == "ContextKeeperWarning"
    assert {e["name"]: drawn(3)[e["name"]] for e in found} == {e["name"]: nearest_drawn(e["mro"], 3) for e in found}


def takes_message(cls: type[BaseException]) -> bool:
    """Whether the class is made from a message (the rest word their own from their numbers)."""
    try:
        parameters = inspect.signature(cls).parameters
    except ValueError:  # Exception's own constructor: the message is its first argument
        return True
    return "message" in parameters


def _raise(cls: type[ck.ContextKeeperError], message: str) -> ck.ContextKeeperError:
    """An instance made as the library makes one: the message first, where the class takes one."""
    kwargs = REQUIRED.get(cls.__name__, {})
    if takes_message(cls):
        return cls(message, **kwargs)
    return cls(**kwargs)  # it words its own message (and fix) from its numbers


@pytest.mark.parametrize("name", list(drawn()))
def test_fix_text_is_the_text_after_fix_when_no_fix_is_set(name: str) -> None:
    cls = getattr(_exceptions, name)
    error = _raise(cls, "the thing is 3 over its limit of 10. Fix: set thing=7 (or raise the limit)")
    worded = error.fix  # set by the few classes that know their fix
    error.fix = None
    if takes_message(cls):
        assert error.fix_text() == "set thing=7 (or raise the limit)"
    else:
        assert error.fix_text() == worded  # the message's own "Fix:" says what .fix says
    error.fix = "use another thing"
    assert error.fix_text() == "use another thing"  # a set fix wins over the message
    if takes_message(cls):
        for message in ("the thing is 3 over its limit of 10", "an empty one is none. Fix:   "):
            error = _raise(cls, message)
            error.fix = None
            assert error.fix_text() is None  # neither a fix nor "Fix:" text: nothing to offer


def test_names_that_match_nothing_say_the_closest_and_the_fix() -> None:
    import contextkeeper as ck

    cases = [
        (lambda: ck.find_gpu("RTX 4095"), "NVIDIA GeForce RTX 4090 24GB", "--gpu 48GB"),
        (lambda: ck.diagnose.diagnose("concurent"), "concurrent", "pass --symptom concurrent"),
        (lambda: ck.ModelSpec.from_config("no-such-model"), None, "config.json path"),
    ]
    for make, closest, fix in cases:
        with pytest.raises(ck.ConfigurationError) as info:
            make()
        error = info.value
        if closest is not None:
            assert closest in error.matches  # type: ignore[attr-defined]
        assert error.fix is not None
        assert fix in error.fix
        assert error.fix_text() == error.fix
