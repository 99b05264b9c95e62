"""Which server software answers a wrapped client, and what a prompt count that differs from ours means there.

A server is recognised, in this order of trust, from its answers (fields only it sends, which the openai SDK keeps),
from the wording of its refusals, or from its address (Ollama's port, OpenAI's host). Each kind is one entry in a
registry (:data:`KINDS`); :func:`fewer_advice` asks the entry what a smaller count than ours means for it:

- **llama.cpp** never cuts a prompt silently (it refuses one that is too long). It continues a final assistant
  message instead of closing it and adding a generation prompt, and it drops ``strict`` (and any other extra key)
  from tool schemas, so such prompts count a few tokens fewer there; nothing was lost.
- **Ollama** cuts a prompt longer than its ``num_ctx`` silently, dropping the oldest messages.
- **vLLM** (and OpenAI) refuse a prompt that is too long, so a smaller count means another chat template.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

__all__ = ["KINDS", "Drift", "ServerKind", "fewer_advice", "kind_of_error", "kind_of_reply", "kind_of_url"]


@dataclass(frozen=True, kw_only=True)
class Drift:
    """A call whose server counted fewer prompt tokens than the keeper: by how much, and what the prompt held."""

    tokens: int  # how many fewer (> 0)
    final_assistant: bool  # the prompt ends with an assistant message
    strict_tools: int  # tool schemas with a "strict" key


@dataclass(frozen=True, kw_only=True)
class ServerKind:
    """One kind of server: how to recognise it, and what a smaller count than ours means there."""

    name: str
    marks: Callable[[Any], bool]  # a response or stream chunk of this server
    wording: tuple[str, ...] = ()  # lower-case phrases of its refusals that no other server uses
    hosts: tuple[str, ...] = ()  # host names (or ":port") of its usual address
    fewer: Callable[[Drift], str]


def _extra(obj: Any) -> dict[str, Any]:
    """The fields of a response (SDK object or dict), the ones the SDK does not model included."""
    if isinstance(obj, dict):
        return obj
    extra = getattr(obj, "model_extra", None) or {}
    fingerprint = getattr(obj, "system_fingerprint", None)
    return {**extra, "system_fingerprint": fingerprint} if fingerprint is not None else dict(extra)


def _first_choice(obj: Any) -> dict[str, Any]:
    choices = obj.get("choices") if isinstance(obj, dict) else getattr(obj, "choices", None)
    return _extra(choices[0]) if choices else {}


def _fingerprint(obj: Any) -> str:
    return str(_extra(obj).get("system_fingerprint") or "")


_LLAMACPP_BUILD = re.compile(r"^b\d+-[0-9a-f]+$")  # llama.cpp's build_info: "b<build number>-<commit>"
_OPENAI_FINGERPRINT = re.compile(r"^fp_[0-9a-f]{6,}$")

_NOT_CUT = "It never cuts a prompt without saying so (it refuses one that is too long)"


def _llamacpp_fewer(drift: Drift) -> str:
    causes = []
    if drift.final_assistant:
        causes.append("the prompt ends with an assistant message, which llama.cpp continues rather than closing it")
    if drift.strict_tools:
        causes.append(f'{drift.strict_tools} tool schema(s) carry "strict", which llama.cpp drops')
    # Each cause is a handful of tokens: the closed turn and a generation prompt, or `"strict": true` per tool.
    small = drift.tokens <= 32 + 8 * drift.strict_tools
    if causes and small:
        return (
            f" A known difference: {'; '.join(causes)}. {_NOT_CUT}, so nothing was lost, and the keeper's count "
            "stays an upper bound. Fix: none needed"
        )
    known = f" ({'; '.join(causes)}, explains only a few of them)" if causes else ""
    return (
        f" llama.cpp renders this prompt with fewer tokens{known}. {_NOT_CUT}, so its chat template differs from "
        "the keeper's. Fix: pass the template the server uses as chat_template=... (llama-server prints it at "
        "start, and GET /props returns it)"
    )


def _ollama_fewer(drift: Drift) -> str:
    return (
        " Ollama may have cut the prompt: it drops the oldest messages of a prompt longer than its num_ctx, without "
        "an error. Fix: set context_window to the model's num_ctx (or raise num_ctx in its options), and pass its "
        "own chat template and tokenizer"
    )


def _refusing_fewer(name: str) -> Callable[[Drift], str]:
    def advice(drift: Drift) -> str:
        return (
            f" {name} {_NOT_CUT[3:]}, so it renders this prompt with another chat template. Fix: pass the served "
            "model's own chat template (chat_template=...) and tokenizer"
        )

    return advice


def _unknown_fewer(drift: Drift) -> str:
    return (
        " The server may have cut the prompt without saying so (Ollama does past num_ctx), or it renders it with "
        "another chat template. Fix: set context_window to the server's context (Ollama: num_ctx), and pass its own "
        "chat template and tokenizer"
    )


KINDS: dict[str, ServerKind] = {
    kind.name: kind
    for kind in (
        ServerKind(
            name="llama.cpp",
            marks=lambda r: "timings" in _extra(r) or bool(_LLAMACPP_BUILD.match(_fingerprint(r))),
            wording=("exceed_context_size_error", "available context size", "context size has been exceeded"),
            fewer=_llamacpp_fewer,
        ),
        ServerKind(
            name="ollama",
            marks=lambda r: _fingerprint(r) == "fp_ollama",
            wording=("exceeded max context length by", "input length exceeds the context length"),
            hosts=(":11434",),
            fewer=_ollama_fewer,
        ),
        ServerKind(
            name="vllm",
            marks=lambda r: (
                bool({"kv_transfer_params", "prompt_logprobs"} & set(_extra(r))) or "stop_reason" in _first_choice(r)
            ),
            wording=("max_model_len", "(parameter=", "context length is only"),
            fewer=_refusing_fewer("vLLM"),
        ),
        ServerKind(
            name="openai",
            marks=lambda r: bool(_OPENAI_FINGERPRINT.match(_fingerprint(r))),
            wording=("context_length_exceeded",),
            hosts=("api.openai.com",),
            fewer=_refusing_fewer("OpenAI"),
        ),
    )
}


def kind_of_reply(obj: Any) -> str | None:
    """The server kind a response or stream chunk comes from, when its fields tell."""
    for kind in KINDS.values():
        try:
            if kind.marks(obj):
                return kind.name
        except (AttributeError, TypeError, IndexError, KeyError):
            continue
    return None


def kind_of_error(text: str) -> str | None:
    """The server kind whose refusal reads like ``text``."""
    lowered = text.lower()
    return next((k.name for k in KINDS.values() if any(phrase in lowered for phrase in k.wording)), None)


def kind_of_url(url: str) -> str | None:
    """The server kind usually found at ``url`` (Ollama's port 11434, api.openai.com)."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname or "", parts.port
    except ValueError:
        return None
    for kind in KINDS.values():
        for hint in kind.hosts:
            if (hint.startswith(":") and port == int(hint[1:])) or host == hint:
                return kind.name
    return None


def fewer_advice(kind: str | None, drift: Drift) -> str:
    """What a server of ``kind`` counting ``drift.tokens`` fewer prompt tokens than the keeper means, and the fix."""
    entry = KINDS.get(kind or "")
    return entry.fewer(drift) if entry is not None else _unknown_fewer(drift)
