"""A wrapped call from start to end: the request and reply a backend speaks (:mod:`.base`), the call loop that fits,
admits, sends, recovers and records (:mod:`.loop`), provider errors mapped in one place (:mod:`.errors`), admission
(:mod:`.ledger`, :mod:`.redis_ledger`), what replicas share (:mod:`.shared`), tracing, and the write-ahead
transcript (:mod:`.transcript`).
"""

from .base import Backend, Reply, Request
from .errors import Failure, classify, parse_context_error
from .loop import CallReport, DriftWarning, ServerState

__all__ = [
    "Backend",
    "CallReport",
    "DriftWarning",
    "Failure",
    "Reply",
    "Request",
    "ServerState",
    "classify",
    "parse_context_error",
]
