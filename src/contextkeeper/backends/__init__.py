"""Chat-client wrappers and their backends: the openai SDK, local transformers models, plain callables.

``keeper.wrap(client)`` picks the wrapper from a registry (:func:`register_wrapper`); each backend has one
method, ``complete``. Provider errors are mapped in one place (:mod:`.errors`).
"""

from .base import Backend, Reply, Request, register_wrapper, wrap
from .calls import CallReport, DriftWarning, ServerState
from .errors import Failure, classify, parse_context_error

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
    "register_wrapper",
    "wrap",
]
