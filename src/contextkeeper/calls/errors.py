"""Provider errors, mapped in one place.

Every backend's exception goes through :func:`classify`, which says what kind of failure it is and what numbers
the server reported:

- ``context``: the server refused the prompt as too long. The wordings of vLLM (old and new), OpenAI, llama.cpp's
  server and Ollama are parsed for the server's limit and its count of the prompt.
- ``oom``: ``torch.OutOfMemoryError`` from a local model.
- ``transport``: timeouts, dropped connections, 408/409/429/5xx, and replies the SDK could not parse.
- ``other``: anything else (bad API key, unknown model...); it goes back to the caller unchanged.

The classifiers are a registry keyed by exception class name (walked along the class's MRO), so no SDK has to
be importable for its errors to be recognised. What the caller finally gets when every attempt failed is worded
here too (:func:`provider_error`, one wording per kind).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from .._exceptions import ContextLengthExceeded, OutOfMemory, ProviderError, TransportError

__all__ = ["CONTEXT_PATTERNS", "Attempted", "Failure", "classify", "parse_context_error", "provider_error"]

Kind = Literal["context", "oom", "transport", "other"]


@dataclass(frozen=True, kw_only=True)
class Failure:
    """What went wrong in a model call, with the numbers the server gave (None where it gave none)."""

    kind: Kind
    message: str
    limit: int | None = None  # the server's context length
    prompt_tokens: int | None = None  # the server's count of the prompt (capped at the limit by some servers)
    excess: int | None = None  # tokens over the limit, when that is all the server said
    retry_after: float | None = None  # seconds, from a Retry-After header


# Phrases that mark a refusal for length, in the servers' own wordings (lower-cased).
_CONTEXT_PHRASES = (
    "maximum context length",  # vLLM, OpenAI, SGLang
    "context length is only",  # vLLM (current: input plus requested output over max_model_len)
    "cannot be greater than max_model_len",  # vLLM, max_tokens alone over the context
    "exceeded max context length",  # Ollama's hosted models, as clients quote them
    "context_length_exceeded",  # OpenAI's error code
    "exceeds the available context size",  # llama.cpp server (exceed_context_size_error)
    "exceed_context_size_error",
    "context size has been exceeded",  # llama.cpp server, older builds
    "input is too large to process",  # llama.cpp server, prompt longer than the batch
    "is longer than the model's context length",  # vLLM, prompt alone too long
    "input length exceeds the context length",  # Ollama
    "exceeds maximum context length",
    "prompt is too long",  # Anthropic-style gateways
    "too many tokens",
    "'max_tokens' or 'max_completion_tokens' is too large",  # vLLM, answer reservation too large
)

# Numbers in those wordings: (what, pattern). The first match of each kind wins.
CONTEXT_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("limit", re.compile(r"maximum context length (?:is|of) (\d[\d,]*)")),
    ("limit", re.compile(r"context length (?:is|of) (?:only )?(\d[\d,]*)")),
    ("limit", re.compile(r"max_model_len=(?:max_total_tokens=)?(\d[\d,]*)")),
    ("limit", re.compile(r"\"n_ctx\"\s*:\s*(\d+)")),
    ("limit", re.compile(r"context (?:size|window|length)[^0-9]{0,20}\((\d[\d,]*)(?: tokens)?\)")),
    ("prompt", re.compile(r"\((\d[\d,]*) in the messages")),
    ("prompt", re.compile(r"(?:has|contains) (\d[\d,]*) input tokens")),
    ("prompt", re.compile(r"messages resulted in (\d[\d,]*) tokens")),
    ("prompt", re.compile(r"\"n_prompt_tokens\"\s*:\s*(\d+)")),
    ("prompt", re.compile(r"[Yy]ou passed (\d[\d,]*) input tokens")),
    ("prompt", re.compile(r"request \((\d[\d,]*) tokens\)")),
    ("prompt", re.compile(r"prompt \(length (\d[\d,]*)\)")),
    ("prompt", re.compile(r"prompt(?: length)? (?:of )?(\d[\d,]*) tokens")),
    ("requested", re.compile(r"you requested (\d[\d,]*) tokens")),
    ("completion", re.compile(r"(\d[\d,]*) in the completion")),
    ("excess", re.compile(r"exceeded max context length by (\d[\d,]*)")),
)


def _number(text: str) -> int:
    return int(text.replace(",", ""))


def parse_context_error(text: str) -> Failure | None:
    """The refusal for length in an error's text (message plus JSON body), with its numbers; None if it is
    not one."""
    lowered = text.lower()
    if not any(phrase in lowered for phrase in _CONTEXT_PHRASES):
        return None
    found: dict[str, int] = {}
    for what, pattern in CONTEXT_PATTERNS:
        if what not in found and (match := pattern.search(text)):
            found[what] = _number(match.group(1))
    prompt = found.get("prompt")
    if prompt is None and "requested" in found and "completion" in found:
        prompt = found["requested"] - found["completion"]  # vLLM's older wording gives the total and the answer
    return Failure(
        kind="context", message=text, limit=found.get("limit"), prompt_tokens=prompt, excess=found.get("excess")
    )


def _text(exc: BaseException) -> str:
    parts = [str(exc)]
    body = getattr(exc, "body", None)
    if body is not None:
        try:
            parts.append(json.dumps(body))
        except (TypeError, ValueError):
            parts.append(str(body))
    return " ".join(parts)


def _retry_after(exc: BaseException) -> float | None:
    response = getattr(exc, "response", None)
    headers = getattr(response, "headers", None)
    value = headers.get("retry-after") if headers is not None else None
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _status(exc: BaseException) -> Failure | None:
    """An HTTP status error (openai's APIStatusError and its subclasses)."""
    code = int(getattr(exc, "status_code", 0) or 0)
    text = _text(exc)
    refusal = parse_context_error(text)
    if refusal is not None:
        return refusal
    if code in (408, 409, 429) or code >= 500:
        return Failure(kind="transport", message=text, retry_after=_retry_after(exc))
    return Failure(kind="other", message=text)


def _transport(exc: BaseException) -> Failure:
    return Failure(kind="transport", message=_text(exc) or type(exc).__name__)


def _oom(exc: BaseException) -> Failure:
    return Failure(kind="oom", message=str(exc))


def _by_text(exc: BaseException) -> Failure | None:
    """Errors raised by plain callables or local servers: recognised by their wording alone."""
    return parse_context_error(_text(exc))


_CLASSIFIERS: dict[str, Callable[[BaseException], Failure | None]] = {
    # openai SDK
    "APIStatusError": _status,
    "APITimeoutError": _transport,
    "APIConnectionError": _transport,
    "APIResponseValidationError": _transport,
    # httpx and the standard library, for clients that raise them directly
    "TimeoutException": _transport,
    "TransportError": _transport,
    "TimeoutError": _transport,
    "ConnectionError": _transport,
    "JSONDecodeError": _transport,
    # torch: torch.cuda.OutOfMemoryError is the same class
    "OutOfMemoryError": _oom,
    "ValueError": _by_text,
    "RuntimeError": _by_text,
}


def classify(exc: BaseException) -> Failure:
    """What kind of failure ``exc`` is; ``other`` when no classifier recognises it."""
    from .._exceptions import ContextKeeperError

    if isinstance(exc, ContextKeeperError):
        return Failure(kind="other", message=str(exc))  # our own errors are final, never retried
    for cls in type(exc).__mro__:
        classifier = _CLASSIFIERS.get(cls.__name__)
        if classifier is not None and (failure := classifier(exc)) is not None:
            return failure
    return Failure(kind="other", message=str(exc))


# ------------------------------------------------------------------------------------------------ wording


@dataclass(frozen=True, kw_only=True)
class Attempted:
    """What a wrapped call had done when it gave up: the prompt tokens it last sent, the answer it reserved (and
    the caller's argument that set it), its attempts, and the last fit's report."""

    sent: int
    answer: int
    answer_key: str | None
    attempts: int
    report: Any = None


def _too_long(failure: Failure, call: Attempted) -> ProviderError:
    return ContextLengthExceeded(
        f"the server refused the prompt as too long after {call.attempts} attempt(s): we sent {call.sent:,} "
        f"tokens with {call.answer:,} reserved for the answer; the server reported a limit of {failure.limit} and "
        f"a prompt of {failure.prompt_tokens} tokens. Fix: set context_window to the server's max_model_len (or "
        f"n_ctx), lower {call.answer_key or 'max_tokens'}, or let more attempts run (attempts=...). Server said: "
        f"{failure.message[:300]}",
        limit=failure.limit,
        prompt_tokens=failure.prompt_tokens,
        report=call.report,
        attempts=call.attempts,
    )


def _out_of_memory(failure: Failure, call: Attempted) -> ProviderError:
    return OutOfMemory(
        f"the model ran out of memory on a {call.sent:,}-token prompt with {call.answer:,} answer tokens, after "
        f"{call.attempts} attempt(s). Fix: lower context_window or max_tokens, set gpu= and concurrency= so the "
        "limit comes from the memory model, or use a smaller KV dtype",
        report=call.report,
        attempts=call.attempts,
    )


def _transport_failed(failure: Failure, call: Attempted) -> ProviderError:
    return TransportError(
        f"the call failed after {call.attempts} attempt(s): {failure.message[:300].rstrip('.')}. Fix: check the "
        "server, raise attempts=... or the client's timeout",
        report=call.report,
        attempts=call.attempts,
    )


_WORDING: dict[Kind, Callable[[Failure, Attempted], ProviderError]] = {
    "context": _too_long,
    "oom": _out_of_memory,
    "transport": _transport_failed,
}


def provider_error(failure: Failure, call: Attempted) -> ProviderError:
    """The error a wrapped call raises for ``failure`` once its attempts are spent (``other`` failures are not
    mapped: the caller's own exception goes back unchanged)."""
    return _WORDING[failure.kind if failure.kind != "other" else "transport"](failure, call)
