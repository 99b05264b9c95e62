"""The flat public API: ``__all__`` is complete, sorted, and every name resolves."""

from __future__ import annotations

import inspect

import contextkeeper as ck


def test_all_names_resolve_and_are_sorted() -> None:
    assert ck.__all__ == sorted(set(ck.__all__))
    for name in ck.__all__:
        assert hasattr(ck, name), name


def test_every_public_class_and_function_is_exported() -> None:
    public = {
        name
        for name, value in vars(ck).items()
        if not name.startswith("_")
        and (inspect.isclass(value) or inspect.isfunction(value))
        and value.__module__.startswith("contextkeeper")
    }
    assert public <= set(ck.__all__), public - set(ck.__all__)


def test_errors_form_one_tree() -> None:
    for name in ck.__all__:
        value = getattr(ck, name)
        if inspect.isclass(value) and issubclass(value, Exception):
            assert issubclass(value, ck.ContextKeeperError), name
