"""Exact token counting: the protocol, the Hugging Face and mistral-common counters, and loading."""

from ._sandbox import TemplateLimits
from .base import (
    BatchTextCounting,
    Forgetting,
    Forking,
    Measurement,
    Measuring,
    MessagesLike,
    PromptBounding,
    TextBounding,
    TextCounting,
    TokenCounter,
    ToolFreezing,
    ToolsLike,
)
from .breakdown import Breakdown, breakdown
from .hf import HFChatTemplateCounter, detect_content_format
from .loading import load_counter, load_hf_tokenizer
from .media import MediaCost
from .mistral import MistralCounter

__all__ = [
    "BatchTextCounting",
    "Breakdown",
    "Forgetting",
    "Forking",
    "HFChatTemplateCounter",
    "Measurement",
    "Measuring",
    "MediaCost",
    "MessagesLike",
    "MistralCounter",
    "PromptBounding",
    "TemplateLimits",
    "TextBounding",
    "TextCounting",
    "TokenCounter",
    "ToolFreezing",
    "ToolsLike",
    "breakdown",
    "detect_content_format",
    "load_counter",
    "load_hf_tokenizer",
]
