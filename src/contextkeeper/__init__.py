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
    OrphanToolResult,
    TokenizerNotFound,
    UnsupportedContent,
)
from .messages import ContentPart, Conversation, FunctionCall, Message, ToolCall, Unit, raw_view, server_view
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
    "Breakdown",
    "ChatTemplateError",
    "ConfigurationError",
    "ContentPart",
    "ContextKeeperError",
    "Conversation",
    "CountingError",
    "FunctionCall",
    "HFChatTemplateCounter",
    "InvalidMessage",
    "Measurement",
    "MediaCost",
    "Message",
    "MessageError",
    "MissingToolResult",
    "MistralCounter",
    "OrphanToolResult",
    "TokenCounter",
    "TokenizerNotFound",
    "ToolCall",
    "Unit",
    "UnsupportedContent",
    "__version__",
    "breakdown",
    "load_counter",
    "raw_view",
    "server_view",
]
