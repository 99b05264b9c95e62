"""The write-ahead transcript of wrapped calls: entries, the in-memory and SQLite stores (:mod:`.store`) and the
Postgres store with its outbox (:mod:`.postgres`)."""

from .store import Transcript, TranscriptEntry, open_transcript

__all__ = ["Transcript", "TranscriptEntry", "open_transcript"]
