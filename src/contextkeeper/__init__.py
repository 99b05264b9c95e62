"""contextkeeper: keep chat applications inside their model's context and their GPU's memory.

Counts are exact: the length of the token ids the model's own chat template (or mistral-common encoder)
produces for the messages and tools, after the preprocessing an OpenAI-compatible server applies.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from ._exceptions import (
    AdmissionTimeout,
    ChatTemplateError,
    ConfigurationError,
    ContextKeeperError,
    ContextKeeperWarning,
    ContextLengthExceeded,
    CountingError,
    DetectionWarning,
    DriftWarning,
    ExceedsCapacity,
    InvalidMessage,
    InvariantViolation,
    LedgerUnavailable,
    MessageError,
    MissingToolResult,
    ModelConfigError,
    OrphanToolResult,
    OutOfMemory,
    PolicyError,
    ProviderError,
    ProxyConfigError,
    RequestRejected,
    RequestTooLarge,
    SharedUnavailable,
    StreamInterrupted,
    TemplateLimitExceeded,
    TokenizerNotFound,
    TranscriptUnavailable,
    TransportError,
    UnknownCall,
    UnknownGPU,
    UnknownModel,
    UnknownSymptom,
    UnsupportedContent,
)

if TYPE_CHECKING:  # the names, for type checkers; at run time they load on first use
    from ._memo import CacheUsage, cache_bytes, cache_usage, set_cache_bytes
    from .calls import CallReport
    from .calls.ledger import Ledger
    from .calls.redis_ledger import RedisLedger
    from .calls.shared import ConversationShare, ServerFacts, SharedState, SummaryClaim
    from .calls.transcript import Transcript, TranscriptEntry, open_transcript
    from .calls.transcript.postgres import PostgresTranscript
    from .diagnose import Diagnosis, MemoryMonitor, MonitorReport, ProfileReport, profile
    from .diagnose import diagnose as doctor
    from .fit.budget import Reserve
    from .fit.report import Fit, FitReport
    from .keeper import ContextKeeper
    from .memory import (
        GPU,
        DetectedGPU,
        KVReport,
        ModelSpec,
        Plan,
        PlanSettings,
        Recommendation,
        detect_gpus,
        find_gpu,
        gpu_catalog,
        plan,
        recommend,
    )
    from .messages import ContentPart, Conversation, FunctionCall, Message, ToolCall, Unit, raw_view, server_view
    from .servers.calibration import Calibration, Probe, ProbeResult, calibrate
    from .servers.detection import Detection, detect_server
    from .servers.dialects import Dialect, dialect_of
    from .strategies.policy import Policy, load_policy, register_policy_path
    from .tokens import (
        Breakdown,
        HFChatTemplateCounter,
        Measurement,
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
    "Calibration": ".servers.calibration",
    "Probe": ".servers.calibration",
    "ProbeResult": ".servers.calibration",
    "calibrate": ".servers.calibration",
    "Dialect": ".servers.dialects",
    "dialect_of": ".servers.dialects",
    "Detection": ".servers.detection",
    "detect_server": ".servers.detection",
    "Breakdown": ".tokens",
    "CacheUsage": "._memo",
    "CallReport": ".calls",
    "ContentPart": ".messages",
    "ContextKeeper": ".keeper",
    "Conversation": ".messages",
    "DetectedGPU": ".memory",
    "Diagnosis": ".diagnose",
    "Fit": ".fit.report",
    "FitReport": ".fit.report",
    "FunctionCall": ".messages",
    "GPU": ".memory",
    "HFChatTemplateCounter": ".tokens",
    "KVReport": ".memory",
    "Ledger": ".calls.ledger",
    "RedisLedger": ".calls.redis_ledger",
    "ConversationShare": ".calls.shared",
    "PostgresTranscript": ".calls.transcript.postgres",
    "ServerFacts": ".calls.shared",
    "SharedState": ".calls.shared",
    "SummaryClaim": ".calls.shared",
    "Measurement": ".tokens",
    "MediaCost": ".tokens",
    "MemoryMonitor": ".diagnose",
    "Message": ".messages",
    "MistralCounter": ".tokens",
    "ModelSpec": ".memory",
    "MonitorReport": ".diagnose",
    "Plan": ".memory",
    "PlanSettings": ".memory",
    "Policy": ".strategies.policy",
    "ProfileReport": ".diagnose",
    "Recommendation": ".memory",
    "Reserve": ".fit.budget",
    "TemplateLimits": ".tokens",
    "TokenCounter": ".tokens",
    "ToolCall": ".messages",
    "Transcript": ".calls.transcript",
    "TranscriptEntry": ".calls.transcript",
    "Unit": ".messages",
    "breakdown": ".tokens",
    "cache_bytes": "._memo",
    "cache_usage": "._memo",
    "detect_gpus": ".memory",
    "find_gpu": ".memory",
    "gpu_catalog": ".memory",
    "load_counter": ".tokens",
    "load_policy": ".strategies.policy",
    "open_transcript": ".calls.transcript",
    "plan": ".memory",
    "profile": ".diagnose",
    "raw_view": ".messages",
    "recommend": ".memory",
    "register_policy_path": ".strategies.policy",
    "server_view": ".messages",
    "set_cache_bytes": "._memo",
}


# Names that differ from the module's own: ``contextkeeper.diagnose`` is a subpackage, so its function is
# exported as ``doctor`` (the CLI command's name) rather than shadowing the package.
_ALIASES: dict[str, tuple[str, str]] = {"doctor": (".diagnose", "diagnose")}


def __getattr__(name: str) -> Any:
    module, attribute = _ALIASES.get(name) or (_LAZY.get(name), name)
    if module is None:
        # A submodule (``ck.messages.MAX_DEPTH``, ``ck.tokens.TextCounting``) works before anything imported it.
        if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
            return importlib.import_module(f".{name}", __name__)
        raise AttributeError(f"module 'contextkeeper' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_ALIASES))


__version__ = "0.1.0"

__all__ = [
    "GPU",
    "AdmissionTimeout",
    "Breakdown",
    "CacheUsage",
    "Calibration",
    "CallReport",
    "ChatTemplateError",
    "ConfigurationError",
    "ContentPart",
    "ContextKeeper",
    "ContextKeeperError",
    "ContextKeeperWarning",
    "ContextLengthExceeded",
    "Conversation",
    "ConversationShare",
    "CountingError",
    "DetectedGPU",
    "Detection",
    "DetectionWarning",
    "Diagnosis",
    "Dialect",
    "DriftWarning",
    "ExceedsCapacity",
    "Fit",
    "FitReport",
    "FunctionCall",
    "HFChatTemplateCounter",
    "InvalidMessage",
    "InvariantViolation",
    "KVReport",
    "Ledger",
    "LedgerUnavailable",
    "Measurement",
    "MediaCost",
    "MemoryMonitor",
    "Message",
    "MessageError",
    "MissingToolResult",
    "MistralCounter",
    "ModelConfigError",
    "ModelSpec",
    "MonitorReport",
    "OrphanToolResult",
    "OutOfMemory",
    "Plan",
    "PlanSettings",
    "Policy",
    "PolicyError",
    "PostgresTranscript",
    "Probe",
    "ProbeResult",
    "ProfileReport",
    "ProviderError",
    "ProxyConfigError",
    "Recommendation",
    "RedisLedger",
    "RequestRejected",
    "RequestTooLarge",
    "Reserve",
    "ServerFacts",
    "SharedState",
    "SharedUnavailable",
    "StreamInterrupted",
    "SummaryClaim",
    "TemplateLimitExceeded",
    "TemplateLimits",
    "TokenCounter",
    "TokenizerNotFound",
    "ToolCall",
    "Transcript",
    "TranscriptEntry",
    "TranscriptUnavailable",
    "TransportError",
    "Unit",
    "UnknownCall",
    "UnknownGPU",
    "UnknownModel",
    "UnknownSymptom",
    "UnsupportedContent",
    "__version__",
    "breakdown",
    "cache_bytes",
    "cache_usage",
    "calibrate",
    "detect_gpus",
    "detect_server",
    "dialect_of",
    "doctor",
    "find_gpu",
    "gpu_catalog",
    "load_counter",
    "load_policy",
    "open_transcript",
    "plan",
    "profile",
    "raw_view",
    "recommend",
    "register_policy_path",
    "server_view",
    "set_cache_bytes",
]
