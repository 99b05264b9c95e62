"""``transcript=`` settings: None (in memory), a path (SQLite), a URL (Postgres), a Transcript; checked without
connecting (:func:`check_transcript`) and opened (:func:`open_transcript`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..._exceptions import ConfigurationError
from .base import Transcript, safe_url
from .entry import DEFAULT_MEMORY_BYTES
from .memory import MemoryTranscript
from .sqlite import SQLiteTranscript

__all__ = ["URL_STORES", "check_transcript", "open_transcript"]


_SQLITE_HEADER = b"SQLite format 3\x00"

#: URL schemes ``transcript=`` takes, each with the ``module:class`` that stores transcripts there. The module is
#: imported only when such a URL is given (its client library is an extra); the class has ``check_url(url)``
#: (validates without connecting, raises :class:`ConfigurationError`) and is built as ``cls(url)``.
URL_STORES: dict[str, str] = {
    "postgresql": "contextkeeper.calls.transcript.postgres:PostgresTranscript",
    "postgres": "contextkeeper.calls.transcript.postgres:PostgresTranscript",
}


def _url_store(scheme: str) -> Any:
    import importlib

    module, _, name = URL_STORES[scheme].partition(":")
    return getattr(importlib.import_module(module), name)


def check_transcript(spec: Any) -> Transcript | Path | str | None:
    """``spec`` as :func:`open_transcript` takes it, checked without opening or connecting to anything: None, a
    :class:`Transcript`, the path of a SQLite file (new, or one this library wrote), or a database URL with a
    scheme of :data:`URL_STORES` (returned as given). Anything else is a :class:`ConfigurationError` that names
    the value and the fix."""
    fix = (
        "pass transcript=None (in memory), a file path such as 'chat.sqlite', a URL such as "
        "'postgresql://user@host/db', or a Transcript object"
    )
    if spec is None or isinstance(spec, Transcript):
        return spec
    if not isinstance(spec, (str, os.PathLike)) or isinstance(spec, bytes):
        raise ConfigurationError(f"transcript={spec!r} ({type(spec).__name__}) is not a path. Fix: {fix}")
    text = os.fspath(spec)
    if not text.strip():
        raise ConfigurationError(f"transcript={spec!r} is an empty path. Fix: {fix}")
    if "://" in text:
        scheme = text.partition("://")[0].lower()
        if scheme not in URL_STORES:
            supported = ", ".join(f"{name}://" for name in URL_STORES)
            raise ConfigurationError(
                f"transcript={safe_url(text)!r} is a URL of scheme {scheme!r}; the URLs supported are {supported}. "
                "Fix: pass a Postgres URL, the path of a SQLite file (e.g. 'chat.sqlite'), or a Transcript object "
                "of your own"
            )
        _url_store(scheme).check_url(text)
        return text
    path = Path(text).expanduser()
    if path.is_dir():
        raise ConfigurationError(
            f"transcript={text!r} is a directory. Fix: name a file in it, e.g. {str(path / 'transcript.sqlite')!r}"
        )
    if path.exists():
        try:
            with path.open("rb") as file:
                head = file.read(len(_SQLITE_HEADER))
        except OSError as exc:
            raise ConfigurationError(f"transcript={text!r} cannot be read ({exc}). Fix: {fix}") from exc
        if head and head != _SQLITE_HEADER:
            raise ConfigurationError(
                f"transcript={text!r} exists and is not a SQLite file (it starts with {head[:8]!r}); it is left as "
                "it is. Fix: pass a new file name, or the path of a transcript file this library wrote"
            )
    else:
        parent = next((p for p in path.absolute().parents if p.exists()), None)
        if parent is not None and not parent.is_dir():
            raise ConfigurationError(f"transcript={text!r}: {str(parent)!r} is a file, not a folder. Fix: {fix}")
        if parent is not None and not os.access(parent, os.W_OK | os.X_OK):
            raise ConfigurationError(
                f"transcript={text!r}: the folder {str(parent)!r} is not writable. Fix: pass a path you can write"
            )
    return path


def open_transcript(spec: Transcript | str | Path | None) -> Transcript:
    """None: a :class:`MemoryTranscript` bounded by :data:`DEFAULT_MEMORY_BYTES`; a path: a
    :class:`SQLiteTranscript` there; a URL: the store of its scheme (``postgresql://``: a
    :class:`~contextkeeper.calls.transcript.postgres.PostgresTranscript`); a transcript: itself. A bad value is a
    :class:`ConfigurationError` (see :func:`check_transcript`)."""
    checked = check_transcript(spec)
    if checked is None:
        return MemoryTranscript(max_bytes=DEFAULT_MEMORY_BYTES)
    if isinstance(checked, Transcript):
        return checked
    if isinstance(checked, str):  # a URL (paths come back as Path)
        store: Transcript = _url_store(checked.partition("://")[0].lower())(checked)
        return store
    return SQLiteTranscript(checked)
