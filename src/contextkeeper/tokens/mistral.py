"""Exact prompt counts with mistral-common, the encoder vLLM uses for Mistral models."""

from __future__ import annotations

import threading
import warnings
from pathlib import Path
from typing import Any

from .._exceptions import ChatTemplateError, TokenizerNotFound
from .._memo import memoize
from ..messages import Conversation, check_text, check_tools, server_view
from .base import Measurement, MessagesLike, ToolsLike
from .media import MediaCost, media_cost_for

__all__ = ["MistralCounter", "load_mistral_tokenizer", "mistral_tokenizer_names"]

# Friendly names for the tokenizer files mistral-common ships.
_ALIASES = {
    "tekken": "tekken_240911.json",
    "tekken-mm": "tekken_240911.json",
    "nemo": "tekken_240718.json",
    "v1": "tokenizer.model.v1",
    "v2": "mistral_instruct_tokenizer_240216.model.v2",
    "v3": "mistral_instruct_tokenizer_240323.model.v3",
    "v7": "mistral_instruct_tokenizer_241114.model.v7",
}


def _data_dir() -> Path:
    import mistral_common

    return Path(mistral_common.__file__).parent / "data"


def mistral_tokenizer_names() -> list[str]:
    """Names accepted after ``mistral:`` (aliases and the files mistral-common ships)."""
    shipped = sorted(p.name for p in _data_dir().iterdir() if p.is_file() and not p.name.startswith("_"))
    return sorted(_ALIASES) + shipped


def _resolve(name: str) -> Path:
    candidate = Path(name).expanduser()
    if candidate.is_file():
        return candidate
    data = _data_dir()
    if name in _ALIASES:
        return data / _ALIASES[name]
    matches = sorted(p for p in data.iterdir() if p.is_file() and p.name.startswith(name))
    if matches:
        return matches[0]
    raise TokenizerNotFound(
        f"mistral:{name} is not a tokenizer that mistral-common ships. Use one of "
        f"{', '.join('mistral:' + n for n in mistral_tokenizer_names())}, or mistral:<path to tekken.json>."
    )


def _tokenizer_size(key: Any, tokenizer: Any) -> int:
    # A loaded tokenizer holds 2.4 (Tekken) to 4.5 (SentencePiece) times its file's bytes.
    try:
        return 5 * _resolve(key[0]).stat().st_size
    except (OSError, TokenizerNotFound):
        return 64 * 1024 * 1024


@memoize("mistral.tokenizers", sizer=_tokenizer_size)
def load_mistral_tokenizer(name: str) -> Any:
    """Load a mistral-common ``MistralTokenizer`` by alias, shipped file name or path (cached: loads take ~1 s)."""
    try:
        from mistral_common.protocol.instruct.validator import ValidationMode
        from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise TokenizerNotFound(
            "mistral:<name> tokenizers need mistral-common: pip install 'contextkeeper[mistral]'"
        ) from exc
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return MistralTokenizer.from_file(str(_resolve(name)), mode=ValidationMode.test)


def _finetuning_twin(serving: Any) -> Any:
    """The same tokenizer with mistral-common's training-mode validator (no second ~1 s file load)."""
    from mistral_common.protocol.instruct.validator import ValidationMode, get_validator
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    instruct = serving.instruct_tokenizer
    return MistralTokenizer(
        instruct,
        validator=get_validator(instruct.tokenizer.version, mode=ValidationMode.finetuning),
        request_normalizer=serving._instruct_request_normalizer,
    )


class MistralCounter:
    """Counts with mistral-common's own chat encoder (``encode_chat_completion``).

    This is the reference for Mistral models: vLLM's ``--tokenizer-mode mistral`` encodes requests with it.
    Tool-call ids are shortened to their last 9 characters first, as vLLM does for Mistral tokenizers.
    mistral-common has no separate generation prompt: a conversation ending on a user or tool turn is encoded
    for serving (ending in ``[/INST]`` or the tool results), one ending on an assistant turn as a finished
    exchange; ``add_generation_prompt`` is accepted for the protocol and does not change the count.
    """

    def __init__(self, name: str, *, media_cost: MediaCost | None = None) -> None:
        self.name = f"mistral:{name}"
        self._serving = load_mistral_tokenizer(name)
        self._finetuning: Any = None
        self._spec = name
        self.media_cost = media_cost_for(self.name, media_cost)
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> Any:
        """The mistral-common ``MistralTokenizer`` used for serving-mode encodes."""
        return self._serving

    def text_tokens(self, text: str) -> int:
        """Tokens of a snippet on its own with this tokenizer (no BOS/EOS, no template)."""
        check_text(text)
        raw = self._serving.instruct_tokenizer.tokenizer
        return len(raw.encode(text, bos=False, eos=False))

    def count(self, messages: MessagesLike, *, tools: ToolsLike = None, add_generation_prompt: bool = True) -> int:
        """Exact prompt tokens as mistral-common encodes them."""
        return self.measure(messages, tools=tools, add_generation_prompt=add_generation_prompt).tokens

    def measure(
        self, messages: MessagesLike, *, tools: ToolsLike = None, add_generation_prompt: bool = True
    ) -> Measurement:
        """Count ``messages`` and ``tools`` and say what the count is made of."""
        from mistral_common.exceptions import MistralCommonException
        from mistral_common.protocol.instruct.request import ChatCompletionRequest

        conversation = messages if isinstance(messages, Conversation) else Conversation.from_messages(messages)
        if tools:
            check_tools(tools)
        plain, media = server_view(conversation, content_format="string")
        for message in plain:
            for call in message.get("tool_calls", ()):
                if isinstance(call.get("id"), str):
                    call["id"] = call["id"][-9:]
            if isinstance(message.get("tool_call_id"), str):
                message["tool_call_id"] = message["tool_call_id"][-9:]
        tokenizer = self._serving
        if plain and plain[-1]["role"] == "assistant":
            # A conversation whose last turn is answered is only valid in mistral-common's training mode.
            with self._lock:
                if self._finetuning is None:
                    self._finetuning = _finetuning_twin(self._serving)
            tokenizer = self._finetuning
        try:
            request = ChatCompletionRequest.from_openai(
                messages=plain, tools=[dict(t) for t in tools] if tools else None
            )
            tokens = len(tokenizer.encode_chat_completion(request).tokens)
        except (MistralCommonException, ValueError, TypeError, KeyError) as exc:
            hint = (
                " Mistral models need tool-call ids of 9 letters or digits; servers keep the last 9 characters of "
                "longer ids, so give your calls such ids."
                if "tool call id" in str(exc).lower()
                else ""
            )
            raise ChatTemplateError(
                f"mistral-common refused these messages for {self.name}: {str(exc).rstrip('.')}.{hint}",
                template_message=str(exc),
            ) from exc
        media_tokens = self.media_cost.for_parts(media)
        notes = (f"{len(media)} non-text part(s) priced by {self.media_cost.source}",) if media else ()
        return Measurement(
            tokens=tokens + media_tokens,
            text_tokens=tokens,
            media_tokens=media_tokens,
            media_parts=len(media),
            estimated=bool(media),
            notes=notes,
        )
