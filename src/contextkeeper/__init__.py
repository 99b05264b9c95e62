"""contextkeeper: keep chat applications inside their model's context and their GPU's memory.

Counts are exact: the length of the token ids the model's own chat template (or mistral-common encoder)
produces for the messages and tools, after the preprocessing an OpenAI-compatible server applies.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._exceptions import (
    ChatTemplateError,
    ConfigurationError,
    ContextKeeperError,
    CountingError,
    InvalidMessage,
    MessageError,
    MissingToolResult,
    ModelConfigError,
    OrphanToolResult,
    TokenizerNotFound,
    UnknownGPU,
    UnknownModel,
    UnsupportedContent,
)

if TYPE_CHECKING:  # the names, for type checkers; at run time they load on first use
    from .keeper import ContextKeeper, Fit, FitReport, InvariantViolation, RequestTooLarge
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
    from .policy import Policy, PolicyError, load_policy
    from .tokens import (
        Breakdown,
        HFChatTemplateCounter,
        Measurement,
        MediaCost,
        MistralCounter,
        TokenCounter,
        breakdown,
        load_counter,
    )

# Importing contextkeeper (and so its pytest plugin, in every test session) stays cheap: each name's module is
# imported when the name is first used.
_LAZY: dict[str, str] = {
    "Breakdown": ".tokens",
    "ContentPart": ".messages",
    "ContextKeeper": ".keeper",
    "Conversation": ".messages",
    "DetectedGPU": ".memory",
    "Fit": ".keeper",
    "FitReport": ".keeper",
    "FunctionCall": ".messages",
    "GPU": ".memory",
    "HFChatTemplateCounter": ".tokens",
    "InvariantViolation": ".keeper",
    "KVReport": ".memory",
    "Measurement": ".tokens",
    "MediaCost": ".tokens",
    "Message": ".messages",
    "MistralCounter": ".tokens",
    "ModelSpec": ".memory",
    "Plan": ".memory",
    "PlanSettings": ".memory",
    "Policy": ".policy",
    "PolicyError": ".policy",
    "Recommendation": ".memory",
    "RequestTooLarge": ".keeper",
    "TokenCounter": ".tokens",
    "ToolCall": ".messages",
    "Unit": ".messages",
    "breakdown": ".tokens",
    "detect_gpus": ".memory",
    "find_gpu": ".memory",
    "gpu_catalog": ".memory",
    "load_counter": ".tokens",
    "load_policy": ".policy",
    "plan": ".memory",
    "raw_view": ".messages",
    "recommend": ".memory",
    "server_view": ".messages",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'contextkeeper' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.1.0"

__all__ = [
    "GPU",
    "Breakdown",
    "ChatTemplateError",
    "ConfigurationError",
    "ContentPart",
    "ContextKeeper",
    "ContextKeeperError",
    "Conversation",
    "CountingError",
    "DetectedGPU",
    "Fit",
    "FitReport",
    "FunctionCall",
    "HFChatTemplateCounter",
    "InvalidMessage",
    "InvariantViolation",
    "KVReport",
    "Measurement",
    "MediaCost",
    "Message",
    "MessageError",
    "MissingToolResult",
    "MistralCounter",
    "ModelConfigError",
    "ModelSpec",
    "OrphanToolResult",
    "Plan",
    "PlanSettings",
    "Policy",
    "PolicyError",
    "Recommendation",
    "RequestTooLarge",
    "TokenCounter",
    "TokenizerNotFound",
    "ToolCall",
    "Unit",
    "UnknownGPU",
    "UnknownModel",
    "UnsupportedContent",
    "__version__",
    "breakdown",
    "detect_gpus",
    "find_gpu",
    "gpu_catalog",
    "load_counter",
    "load_policy",
    "plan",
    "raw_view",
    "recommend",
    "server_view",
]
