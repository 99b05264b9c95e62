"""Which server is behind a client: asked once, from the answers only that server gives.

``ContextKeeper(server="auto")`` asks when it wraps an openai client and counts with the dialect found (see
docs/dialects.md). Each sign is one endpoint and a reading of its answer (:data:`SIGNS`), tried in order until
one tells: the ``owned_by`` of the models list first (every OpenAI-compatible server has that endpoint), then
endpoints only one server has. Nothing is sent to a hosted API recognised by its address.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .._exceptions import DetectionWarning, TransportError
from .http import api_key, request_json, root_url
from .kinds import kind_of_url

__all__ = ["OWNERS", "SIGNS", "Detection", "DetectionWarning", "Sign", "detect_server"]

# owned_by in /v1/models -> dialect (vllm/entrypoints/openai/protocol.py ModelCard; sglang/srt/entrypoints/openai/
# protocol.py ModelCard; llama.cpp tools/server: "llamacpp"; Ollama openai/openai.go: "library"; LM Studio:
# "organization_owner")
OWNERS: Mapping[str, str] = {
    "vllm": "vllm",
    "sglang": "sglang",
    "llamacpp": "llama.cpp",
    "library": "ollama",
    "organization_owner": "lmstudio",
}


@dataclass(frozen=True, kw_only=True)
class Sign:
    """One endpoint and what its answer says about the server."""

    path: str  # from the server's root; "models" is the client's own models list (base URL + /models)
    reads: Callable[[Any], tuple[str, str] | None]  # answer -> (dialect, what showed it), None: tells nothing


@dataclass(frozen=True, kw_only=True)
class Detection:
    """What asking a server found: its dialect (None: nothing told) and the answer that showed it."""

    url: str
    server: str | None
    evidence: str
    asked: tuple[str, ...] = ()  # the endpoints asked, in order


def _models(answer: Any) -> tuple[str, str] | None:
    cards = answer.get("data") if isinstance(answer, dict) else None
    cards = [card for card in cards or () if isinstance(card, dict)]
    owners = {str(card.get("owned_by")) for card in cards}
    found = {OWNERS[owner] for owner in owners if owner in OWNERS}
    if len(found) == 1:
        owner = next(o for o in owners if o in OWNERS)
        return next(iter(found)), f"owned_by {owner!r}"
    # transformers serve's cards (cli/serving/model_manager.py) own by the model's organisation ("local" for a
    # folder) and say whether the model is loaded: {"status": {"value": "loaded"}}
    loaded = [card.get("status") for card in cards]
    if not found and cards and all(isinstance(status, dict) and "value" in status for status in loaded):
        return "transformers", "a model card with status " + json.dumps(cards[0]["status"])
    return None


def _props(answer: Any) -> tuple[str, str] | None:
    # llama-server's /props: its generation settings and build
    if isinstance(answer, dict) and "default_generation_settings" in answer:
        return "llama.cpp", f"build {answer.get('build_info', '?')}"
    return None


def _version_only(server: str) -> Callable[[Any], tuple[str, str] | None]:
    def reads(answer: Any) -> tuple[str, str] | None:
        if isinstance(answer, dict) and isinstance(answer.get("version"), str) and len(answer) <= 2:
            return server, f"version {answer['version']}"
        return None

    return reads


def _server_info(answer: Any) -> tuple[str, str] | None:
    # SGLang's /get_server_info: its server arguments (vLLM has no such endpoint)
    if isinstance(answer, dict) and ("tokenizer_path" in answer or "model_path" in answer):
        return "sglang", f"version {answer.get('version', '?')}"
    return None


SIGNS: tuple[Sign, ...] = (
    Sign(path="models", reads=_models),
    Sign(path="/props", reads=_props),
    Sign(path="/api/version", reads=_version_only("ollama")),  # Ollama's native API
    Sign(path="/get_server_info", reads=_server_info),
    Sign(path="/version", reads=_version_only("vllm")),  # after SGLang's own endpoint: both answer /version
)


def detect_server(target: Any, *, timeout: float = 3.0) -> Detection:
    """Ask the server at ``target`` (an openai client or its base URL) which it is, once per sign, in order.

    A server that cannot be reached is a TransportError; one that answers but tells nothing is a Detection with
    ``server=None``."""
    base = str(getattr(target, "base_url", target) or "").rstrip("/")
    root = root_url(target, "server detection")
    hinted = kind_of_url(base)
    if hinted == "openai":
        return Detection(url=root, server="openai", evidence=f"the address {base}")
    key, asked = api_key(target), []
    reached = False
    for sign in SIGNS:
        url = f"{base}/models" if sign.path == "models" else root + sign.path
        asked.append(sign.path if sign.path.startswith("/") else "/v1/models")
        try:
            status, answer = request_json(url, None, timeout=timeout, purpose="server detection", key=key)
        except TransportError:
            if reached:
                continue  # one endpoint hung up; the server itself answered before
            raise
        reached = True
        told = sign.reads(answer) if status == 200 else None
        if told is not None:
            return Detection(url=root, server=told[0], evidence=f"GET {asked[-1]}: {told[1]}", asked=tuple(asked))
    if hinted is not None:
        return Detection(url=root, server=hinted, evidence=f"the address {base}", asked=tuple(asked))
    return Detection(url=root, server=None, evidence="no endpoint told", asked=tuple(asked))
