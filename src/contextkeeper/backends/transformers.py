"""A local transformers model: ``keeper.wrap(model, tokenizer=tok)`` or ``keeper.wrap(pipeline)``.

The model's own ``apply_chat_template`` renders the fitted messages (after the server preprocessing the keeper
counts with), ``generate`` answers, and the cache the call really held is measured: every tensor reachable from
the returned ``past_key_values``, each storage once. Its prompt length is compared with the keeper's count, as a
server's ``usage.prompt_tokens`` is. ``torch.OutOfMemoryError`` is mapped to a shrink-and-retry.

Call shapes: the model wrapper is ``chat(messages, max_new_tokens=..., tools=..., **generate_kwargs) -> message
dict``; the pipeline wrapper keeps the text-generation pipeline's chat shape, ``pipe(messages,
max_new_tokens=...) -> [{"generated_text": [*messages, reply]}]``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..calls.base import Reply, Request
from ..calls.loop import Call, call_sync, options
from ..diagnose.profile import cache_bytes
from ..messages import server_view
from ..tokens.hf import detect_content_format
from .registry import register_wrapper

if TYPE_CHECKING:
    from ..keeper import ContextKeeper

__all__ = ["TransformersBackend"]

_GENERATE_ONLY = ("tools", "max_tokens", "messages")


class TransformersBackend:
    """Generates with a local model; measures the real cache."""

    def __init__(self, model: Any, tokenizer: Any, *, pipeline: bool = False) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.pipeline = pipeline
        self.server = f"transformers:{getattr(model, 'name_or_path', '') or type(model).__name__}"
        template = getattr(tokenizer, "chat_template", None)
        self.content_format = detect_content_format(template) if isinstance(template, str) else "string"

    def complete(self, request: Request) -> Reply:
        import torch

        params = {k: v for k, v in request.params.items() if k not in _GENERATE_ONLY}
        if request.max_tokens is not None:
            params["max_new_tokens"] = request.max_tokens
        inputs = self.tokenizer.apply_chat_template(
            server_view(request.messages, content_format=self.content_format)[0],
            tools=request.tools,
            add_generation_prompt=True,
            return_dict=True,
            return_tensors="pt",
        ).to(self.model.device)
        prompt = int(inputs["input_ids"].shape[-1])
        params.setdefault("do_sample", False)
        if self.tokenizer.pad_token_id is None and self.tokenizer.eos_token_id is not None:
            params.setdefault("pad_token_id", self.tokenizer.eos_token_id)
        try:
            with torch.no_grad():
                out = self.model.generate(**inputs, **params, return_dict_in_generate=True)
        except torch.OutOfMemoryError:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # give the failed attempt's blocks back before the smaller retry
            raise
        new = out.sequences[0, prompt:]
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        message = {"role": "assistant", "content": text}
        # transformers 5 names the returned cache ``cache``; earlier versions ``past_key_values``.
        cache = out["cache"] if "cache" in out else out.get("past_key_values")
        result: Any = message
        if self.pipeline:
            result = [{"generated_text": [*request.messages, message]}]
        return Reply(
            result=result,
            message=message,
            prompt_tokens=prompt,
            completion_tokens=int(new.shape[-1]),
            cache_bytes=cache_bytes(cache) if cache is not None else None,
        )


def wrap_transformers(keeper: ContextKeeper, client: Any, *, tokenizer: Any = None, **given: Any) -> Any:
    """A chat callable around a local model (``tokenizer`` required) or a text-generation pipeline."""
    from .._exceptions import ConfigurationError

    is_pipeline = hasattr(client, "model") and hasattr(client, "tokenizer") and not hasattr(client, "generate")
    model = client.model if is_pipeline else client
    tokenizer = tokenizer if tokenizer is not None else getattr(client, "tokenizer", None)
    if tokenizer is None:
        raise ConfigurationError("wrapping a transformers model needs its tokenizer: keeper.wrap(model, tokenizer=tok)")
    backend = TransformersBackend(model, tokenizer, pipeline=is_pipeline)
    settings = options(**{"answer_keys": ("max_new_tokens", "max_tokens"), **given})
    calls = keeper.calls

    def chat(messages: Any, **kwargs: Any) -> Any:
        """Fit ``messages``, generate, and return the reply (the pipeline's shape for a pipeline)."""
        return call_sync(Call(calls, backend, settings, messages, kwargs.get("tools"), kwargs))

    chat.backend = backend  # type: ignore[attr-defined]
    return chat


def _is_transformers(client: Any) -> bool:
    generate = callable(getattr(client, "generate", None)) and hasattr(client, "config")
    pipeline = hasattr(client, "model") and hasattr(client, "tokenizer") and callable(client)
    return generate or pipeline


register_wrapper(_is_transformers)(wrap_transformers)
