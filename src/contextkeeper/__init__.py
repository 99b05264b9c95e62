"""contextkeeper: keep chat applications inside their model's context and their GPU's memory.

Counts are exact: the length of the token ids the model's own chat template (or mistral-common encoder)
produces for the messages and tools, after the preprocessing an OpenAI-compatible server applies.
"""

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
