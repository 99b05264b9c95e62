"""A wrapped call from start to end: the request and reply a backend speaks (:mod:`.base`), the call loop that fits,
admits, sends, recovers and records (:mod:`.loop`), provider errors mapped in one place (:mod:`.errors`), admission
(:mod:`.ledger`, :mod:`.redis_ledger`), what replicas share (:mod:`.shared`), tracing, and the write-ahead
transcript (:mod:`.transcript`).
"""

from .._exceptions import (
    AdmissionTimeout,
    ExceedsCapacity,
    LedgerUnavailable,
    SharedUnavailable,
    TranscriptUnavailable,
    UnknownCall,
)
from .base import Backend, Reply, Request
from .errors import Failure, classify, parse_context_error
from .ledger import Ledger
from .loop import CallReport, DriftWarning, Hooks, ServerState
from .redis_ledger import RedisLedger
from .shared import ConversationShare, ServerFacts, SharedState, SummaryClaim
from .transcript import Transcript, TranscriptEntry, open_transcript
from .transcript.postgres import PostgresTranscript

__all__ = [
    "AdmissionTimeout",
    "Backend",
    "CallReport",
    "ConversationShare",
    "DriftWarning",
    "ExceedsCapacity",
    "Failure",
    "Hooks",
    "Ledger",
    "LedgerUnavailable",
    "PostgresTranscript",
    "RedisLedger",
    "Reply",
    "Request",
    "ServerFacts",
    "ServerState",
    "SharedState",
    "SharedUnavailable",
    "SummaryClaim",
    "Transcript",
    "TranscriptEntry",
    "TranscriptUnavailable",
    "UnknownCall",
    "classify",
    "open_transcript",
    "parse_context_error",
]
