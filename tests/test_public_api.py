"""The flat public API: ``__all__`` is complete, without repeats, and every name resolves."""

from __future__ import annotations

import inspect

import contextkeeper as ck


def test_all_names_resolve_and_are_sorted() -> None:
    assert len(ck.__all__) == len(set(ck.__all__))  # the order is ruff's (RUF022), checked by `ruff check`
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
        if inspect.isclass(value) and issubclass(value, Exception) and not issubclass(value, Warning):
            assert issubclass(value, ck.ContextKeeperError), name
