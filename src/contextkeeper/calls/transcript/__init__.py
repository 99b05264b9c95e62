"""The transcript: everything each wrapped call was given, sent and received, so nothing fitting removes is lost.

A :class:`TranscriptEntry` per call holds the caller's full message list, the fitted prompt, the reply, which
inputs the prompt left out (``dropped``) or carried in a changed form (``rewritten``: pruned, truncated,
de-duplicated, summarised) and the fit's report. ``recover(call)`` gives those inputs back in their original
form; ``history(conversation)`` the whole, never-trimmed chat to resume from.

Wrapped calls write ahead: :meth:`Transcript.start` stores (and, in SQLite, commits) the caller's inputs before
anything is sent, and :meth:`Transcript.end` completes that entry with the prompt, the reply or the error. A call
whose process ended in between reads back with ``status="interrupted"``.

A call refused by our own checks before anything was sent (too large, invalid) is completed with
:meth:`Transcript.refuse`: its entry keeps the refusal (error, time, sizes) but not the inputs, and whatever its
write-ahead stored that no other entry uses is deleted (``status="refused"``; :meth:`Transcript.history` skips it).

Storage is content-addressed so a long chat costs linear space, not quadratic: every distinct message (and
tools list) is stored once under a hash of its JSON, and a call's message lists are paths in a trie of (previous
message, message) nodes, so a call that extends the previous call's list adds only its new messages. The JSON
keeps the caller's key order at every depth (a template renders keys in that order, so a replayed prompt counts
as the sent one did). Index lists are stored as runs. :class:`MemoryTranscript` keeps this in dicts (the default
store, ``open_transcript(None)``, is bounded by :data:`DEFAULT_MEMORY_BYTES` and evicts the least recently used
conversations whole); :class:`SQLiteTranscript` in a SQLite file (WAL mode) that survives restarts;
``PostgresTranscript`` (:mod:`.postgres`) in Postgres, shared by every process and replica.
Those two are the user's storage: never evicted.

The package in parts: :mod:`.entry` (entries and the prompt diff), :mod:`.base` (the storage logic every store
shares), the stores :mod:`.memory`, :mod:`.sqlite` and :mod:`.postgres`, and :mod:`.opening` (``transcript=``).
"""

from __future__ import annotations

from .base import Begun, Transcript
from .entry import DEFAULT_MEMORY_BYTES, INTERRUPTED, TranscriptEntry, diff_prompt, make_entry
from .memory import MemoryTranscript
from .opening import URL_STORES, check_transcript, open_transcript
from .sqlite import SQLiteTranscript

__all__ = [
    "DEFAULT_MEMORY_BYTES",
    "INTERRUPTED",
    "URL_STORES",
    "Begun",
    "MemoryTranscript",
    "SQLiteTranscript",
    "Transcript",
    "TranscriptEntry",
    "check_transcript",
    "diff_prompt",
    "make_entry",
    "open_transcript",
]
