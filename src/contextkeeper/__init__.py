"""contextkeeper: keep chat applications inside their model's context and their GPU's memory.

Counts are exact: the length of the token ids the model's own chat template (or mistral-common encoder)
produces for the messages and tools, after the preprocessing an OpenAI-compatible server applies.

The top level holds what most programs use: the keeper and its fit, messages, counters, policies and the strategy
extension points, the memory planner, and the errors. The rest lives in its part, each with its own ``__all__``:
``contextkeeper.calls`` (wrapped-call infrastructure: ledgers, shared state, the transcript), ``contextkeeper.servers``
(dialects, detection, calibration), ``contextkeeper.diagnose``, ``contextkeeper.memory``, ``contextkeeper.memo`` (cache
tuning), ``contextkeeper.config`` (the keeper's settings as objects).
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings
from typing import TYPE_CHECKING, Any

from ._exceptions import (
    ChatTemplateError,
    ConfigurationError,
    ContextKeeperError,
    ContextKeeperWarning,
    ContextLengthExceeded,
    CountingError,
    DriftWarning,
    InvalidMessage,
    InvariantViolation,
    MessageError,
    MissingToolResult,
    ModelConfigError,
    OrphanToolResult,
    OutOfMemory,
    PolicyError,
    ProviderError,
    RequestRejected,
    RequestTooLarge,
    StreamInterrupted,
    TemplateLimitExceeded,
    TokenizerNotFound,
    TransportError,
    UnknownGPU,
    UnknownModel,
    UnsupportedContent,
)

if TYPE_CHECKING:  # the names, for type checkers; at run time they load on first use
    from .calls import Backend
    from .fit import Fit, FitReport
    from .keeper import ContextKeeper
    from .memory import GPU, KVReport, ModelSpec, Plan, find_gpu, plan, recommend
    from .messages import ContentPart, Conversation, Message, ToolCall, Unit, raw_view, server_view
    from .strategies import FitState, Pipeline, Strategy, register
    from .strategies.policy import Policy, load_policy, register_policy_path
    from .tokens import (
        Breakdown,
        HFChatTemplateCounter,
        MediaCost,
        MistralCounter,
        TemplateLimits,
        TokenCounter,
        breakdown,
        load_counter,
    )

# Importing contextkeeper (and so its pytest plugin, in every test session) stays cheap: each name's module is
# imported when the name is first used.
_LAZY: dict[str, str] = {
    "Backend": ".calls",
    "Breakdown": ".tokens",
    "ContentPart": ".messages",
    "ContextKeeper": ".keeper",
    "Conversation": ".messages",
    "Fit": ".fit",
    "FitReport": ".fit",
    "FitState": ".strategies",
    "GPU": ".memory",
    "HFChatTemplateCounter": ".tokens",
    "KVReport": ".memory",
    "MediaCost": ".tokens",
    "Message": ".messages",
    "MistralCounter": ".tokens",
    "ModelSpec": ".memory",
    "Pipeline": ".strategies",
    "Plan": ".memory",
    "Policy": ".strategies.policy",
    "Strategy": ".strategies",
    "TemplateLimits": ".tokens",
    "TokenCounter": ".tokens",
    "ToolCall": ".messages",
    "Unit": ".messages",
    "breakdown": ".tokens",
    "find_gpu": ".memory",
    "load_counter": ".tokens",
    "load_policy": ".strategies.policy",
    "plan": ".memory",
    "raw_view": ".messages",
    "recommend": ".memory",
    "register": ".strategies",
    "register_policy_path": ".strategies.policy",
    "server_view": ".messages",
}

# Names the top level had before each part got its own (they still work, with a DeprecationWarning saying where
# each lives now): name -> (module, attribute there).
_MOVED: dict[str, tuple[str, str]] = {
    **{
        name: ("contextkeeper.calls", name)
        for name in (
            "AdmissionTimeout",
            "CallReport",
            "ConversationShare",
            "ExceedsCapacity",
            "Ledger",
            "LedgerUnavailable",
            "PostgresTranscript",
            "RedisLedger",
            "ServerFacts",
            "SharedState",
            "SharedUnavailable",
            "SummaryClaim",
            "Transcript",
            "TranscriptEntry",
            "TranscriptUnavailable",
            "UnknownCall",
            "open_transcript",
        )
    },
    **{
        name: ("contextkeeper.servers", name)
        for name in (
            "Calibration",
            "Detection",
            "DetectionWarning",
            "Dialect",
            "Probe",
            "ProbeResult",
            "calibrate",
            "detect_server",
            "dialect_of",
        )
    },
    **{
        name: ("contextkeeper.diagnose", name)
        for name in ("Diagnosis", "MemoryMonitor", "MonitorReport", "ProfileReport", "UnknownSymptom", "profile")
    },
    "doctor": ("contextkeeper.diagnose", "diagnose"),
    **{
        name: ("contextkeeper.memory", name)
        for name in ("DetectedGPU", "PlanSettings", "Recommendation", "detect_gpus", "gpu_catalog")
    },
    **{name: ("contextkeeper.memo", name) for name in ("CacheUsage", "cache_bytes", "cache_usage", "set_cache_bytes")},
    "FunctionCall": ("contextkeeper.messages", "FunctionCall"),
    "Measurement": ("contextkeeper.tokens", "Measurement"),
    "ProxyConfigError": ("contextkeeper.proxy", "ProxyConfigError"),
    "Reserve": ("contextkeeper.fit", "Reserve"),
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module, __name__), name)
        globals()[name] = value
        return value
    moved = _MOVED.get(name)
    if moved is not None:
        warnings.warn(
            f"contextkeeper.{name} lives in {moved[0]} now: import it from there ({moved[0]}.{moved[1]})",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(moved[0]), moved[1])
    # A submodule (``ck.messages.MAX_DEPTH``, ``ck.tokens.TextCounting``) works before anything imported it.
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'contextkeeper' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.1.0"

__all__ = [
    "GPU",
    "Backend",
    "Breakdown",
    "ChatTemplateError",
    "ConfigurationError",
    "ContentPart",
    "ContextKeeper",
    "ContextKeeperError",
    "ContextKeeperWarning",
    "ContextLengthExceeded",
    "Conversation",
    "CountingError",
    "DriftWarning",
    "Fit",
    "FitReport",
    "FitState",
    "HFChatTemplateCounter",
    "InvalidMessage",
    "InvariantViolation",
    "KVReport",
    "MediaCost",
    "Message",
    "MessageError",
    "MissingToolResult",
    "MistralCounter",
    "ModelConfigError",
    "ModelSpec",
    "OrphanToolResult",
    "OutOfMemory",
    "Pipeline",
    "Plan",
    "Policy",
    "PolicyError",
    "ProviderError",
    "RequestRejected",
    "RequestTooLarge",
    "Strategy",
    "StreamInterrupted",
    "TemplateLimitExceeded",
    "TemplateLimits",
    "TokenCounter",
    "TokenizerNotFound",
    "ToolCall",
    "TransportError",
    "Unit",
    "UnknownGPU",
    "UnknownModel",
    "UnsupportedContent",
    "__version__",
    "breakdown",
    "find_gpu",
    "load_counter",
    "load_policy",
    "plan",
    "raw_view",
    "recommend",
    "register",
    "register_policy_path",
    "server_view",
]
