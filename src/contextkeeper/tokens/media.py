"""Token costs of non-text content parts (images, audio, video, files).

A text-only count of a prompt that carries an image is wrong by hundreds of tokens, and a silent zero is the
worst answer. Where a model family's cost per part is a fixed, documented number we use it; otherwise the
configured per-part cost applies. Either way the count is marked as an estimate, because the exact figure
depends on the processor and often on the media's resolution or duration.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

__all__ = ["KNOWN_MEDIA_RULES", "MediaCost", "media_cost_for"]

# Modality of each OpenAI / HF content-part type.
PART_MODALITY: Mapping[str, str] = MappingProxyType(
    {
        "image_url": "image",
        "image": "image",
        "input_image": "image",
        "image_pil": "image",
        "input_audio": "audio",
        "audio_url": "audio",
        "audio": "audio",
        "video_url": "video",
        "video": "video",
        "file": "file",
    }
)


@dataclass(frozen=True, kw_only=True)
class MediaCost:
    """Tokens charged per non-text content part, by modality.

    The defaults are deliberately generous placeholders for "unknown model": set the numbers for your model
    (``MediaCost(image=256)``) to tighten them.
    """

    image: int = 1024
    audio: int = 1500
    video: int = 4096
    file: int = 2048
    source: str = "configured per-part cost"

    def for_part(self, part_type: str) -> int:
        """Tokens for one part of ``part_type`` (an unknown type is priced as a file)."""
        modality = PART_MODALITY.get(part_type, "file")
        value: int = getattr(self, modality)
        return value

    def for_parts(self, parts: Iterable[tuple[int, Any]]) -> int:
        """Tokens for ``(message index, part)`` pairs, as a counter's view lists the non-text parts."""
        return sum(self.for_part(str(part.type)) for _, part in parts)


# Fixed per-image costs that the model families document (the image's own placeholder tokens; the template's
# begin/end markers are text and are counted exactly). Matched against the tokenizer's name or path.
KNOWN_MEDIA_RULES: Mapping[str, MediaCost] = MappingProxyType(
    {
        "*gemma-3*": MediaCost(image=256, source="Gemma 3: 256 soft tokens per image"),
        "*paligemma*224*": MediaCost(image=256, source="PaliGemma 224px: 256 tokens per image"),
        "*llava-1.5*": MediaCost(image=576, source="LLaVA 1.5: 576 tokens per image (24x24 patches)"),
        "*llava-v1.5*": MediaCost(image=576, source="LLaVA 1.5: 576 tokens per image (24x24 patches)"),
    }
)


_DEFAULT = MediaCost(source="default per-part cost (unknown model; set media_cost= to tighten)")


def media_cost_for(name: str | None, override: MediaCost | None = None) -> MediaCost:
    """The rule for a tokenizer called ``name``: an explicit override, a known family rule, else the default."""
    if override is not None:
        return override
    lowered = (name or "").lower()
    for pattern, rule in KNOWN_MEDIA_RULES.items():
        if fnmatch.fnmatch(lowered, pattern):
            return rule
    return _DEFAULT
