"""A real OpenAI-compatible chat server on 127.0.0.1 for tests that drive the official ``openai`` SDK.

It counts prompts on its own, with transformers only (no contextkeeper code), the way vLLM does, so that "our
count equals the server's" is a real check, and it rejects or truncates over-long prompts in the exact words of
vLLM, llama.cpp, Ollama and OpenAI (:data:`DIALECTS`)::

    with ChatServer(tokenizer_dir("qwen2"), max_model_len=4096) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="test", max_retries=0)
        client.chat.completions.create(model="m", messages=[...], max_tokens=64)
        server.requests[-1].prompt_tokens

Counting (``preprocess="vllm"``, the default), as vLLM's chat endpoint does it:

* messages: rebuilt as role, content, then the keys vLLM passes on (``name``; ``tool_calls`` and ``reasoning``
  (also given as ``reasoning_content``) on assistant messages; ``tool_call_id`` on tool messages). Tool-call
  ``arguments`` JSON strings are parsed into objects (``{}`` if not JSON); an empty ``tool_calls`` list is
  dropped. Content follows the template's content format, detected from the template's Jinja AST like vLLM:
  ``"string"`` (text parts joined with ``"\\n"``, None -> ``""``) unless the template loops over
  ``message.content`` (``"openai"``: a list of text parts, None -> ``[]``; a tool result stays one string);
* tools: as vLLM's pydantic ``model_dump()`` hands them over: ``{"type": "function", "function": {"name",
  "description", "parameters", ...extra keys}}`` with a missing description or parameters given as ``None``
  (templates that ``tojson`` a tool render that ``null``);
* ``tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)`` with the
  tokenizer from the folder and the optional ``chat_template`` override.

``preprocess="llamacpp"`` (the default of the llama.cpp dialects) is what llama.cpp's server does instead: tools keep
only ``name``, ``description`` and ``parameters`` (``strict`` and other keys are dropped), and a final assistant
message is continued, not closed: the messages before it are rendered with the generation prompt and its text is
appended (``prefill_assistant``). ``preprocess="raw"`` hands the request's messages and tools to transformers
untouched.

Each dialect's answers carry the marks of its server, as clients see them: vLLM's ``stop_reason`` on choices and
``prompt_logprobs`` / ``kv_transfer_params`` on the response, llama.cpp's build as ``system_fingerprint`` and its
``timings``, Ollama's ``system_fingerprint: "fp_ollama"``, OpenAI's ``fp_...`` fingerprint and ``service_tier``.

Hidden tokens (what a server adds that the client cannot see) are real: ``hidden_prefix`` is a text whose token
ids (``add_special_tokens=False``) are prepended to the prompt ids, and ``hidden_tokens`` is a constant added on
top; both go into ``usage.prompt_tokens`` and into the limit check.

Request fields that change the prompt are rendered as vLLM renders them (``vllm/entrypoints/chat_utils.py``
``apply_hf_chat_template``; ``serving_chat.py`` passes the request's fields): ``documents`` is handed to the
template as ``documents=``, ``chat_template_kwargs`` are splatted into ``apply_chat_template`` (the names the call
itself sets are left out, as vLLM's resolution of the kwargs does), and a per-request ``chat_template`` replaces the
server's. Media parts (``image_url``, ``input_image``, ``input_audio``, ``video_url``, ``file``) count
``media_tokens`` each (the placeholder tokens a vision or audio model expands one part into; 0 by default, as a
text model has none). ``n`` answers are generated (each the scripted reply; ``completion_tokens`` counts them
all), as vLLM does for ``n``.

Replies are scripted: ``server.replies.append("text" | {"content": ..., "tool_calls": [...]} | callable)``;
with the queue empty the reply is ``"Reply to request N."``. ``completion_tokens`` is the tokenizer's count of
the reply text (``add_special_tokens=False``; tool calls: name plus arguments of each call); a reply longer than
``max_tokens`` (or than the room left in the context) is cut there with ``finish_reason="length"``.

Failures: ``server.fail_next(kind, times=1)`` queues ``"timeout"`` (answer only after ``delay`` seconds),
``"500"``, ``"503"``, ``"429"`` (with ``Retry-After``), ``"malformed"`` (200 with a non-JSON body) or
``"disconnect"`` (close the socket without a response), ``"cut"`` (a stream sends ``after`` events, the role
chunk included, then the connection drops; a plain answer sends half its body, then drops) or ``"overstate"``
(refuse in the dialect's own words as if the prompt had ``reported`` tokens); each chat request takes the next one,
in order. ``server.random_failures({"cut": 0.2, ...}, seed=...)`` draws a failure for every request with none
queued. A request delayed past its client's timeout is recorded as failed (``status=0``) and never answered; one
whose client waited is answered normally (``failure="timeout"``, counted as accepted or rejected).
``response_delay`` (seconds before each answer) and ``chunk_delay`` (between stream events) make calls slow enough
to be interrupted on purpose.

The openai SDK retries 408, 409, 429 and 5xx responses and connection errors (timeouts and dropped connections
included) on its own, ``max_retries=2`` by default, honouring ``Retry-After`` up to 60 s; build clients with
``max_retries=0`` to see each failure once. Its exceptions carry the parsed ``error`` object (or the whole body
when it has none, as old vLLM's) as ``exc.body``. What each failure raises in the SDK (openai 2.x/3.x):
timeout -> ``APITimeoutError``, 500/503 -> ``InternalServerError``, 429 -> ``RateLimitError``, disconnect ->
``APIConnectionError``, malformed -> ``json.JSONDecodeError`` itself (not an ``openai.APIError``), a cut stream ->
``APIConnectionError`` while iterating (its cause: httpx's "incomplete chunked read").

Prefix caching (``prefix_cache=True``): the server keeps the KV blocks of every prompt it accepted and reports
the tokens a new prompt reuses as ``usage.prompt_tokens_details.cached_tokens``, by vLLM's rule (automatic prefix
caching, ``vllm/v1/core/kv_cache_manager.py``: ``get_computed_blocks``): prompts are cut into blocks of
``block_size`` token ids (16, vLLM's default), each identified by a hash of its ids chained with the hash of the
block before; only full blocks are cached; the hit is the longest run of leading blocks found, and it never
covers the last prompt token (``max_cache_hit_length = num_tokens - 1``: that token is computed again for its
logits), so the hit is ``block_size * (the leading cached blocks among the first (n - 1) // block_size)``. Hidden
prefix ids are part of the prompt's ids; the ``hidden_tokens`` constant is not (it has no ids). vLLM also caches
the full blocks its answers fill while decoding; this server caches prompt blocks only (its answers are scripted
text, not decoded ids). ``cache_blocks`` bounds the cache (least recently used blocks go first; None: unbounded).

Pass ``tokenizer=`` (an already loaded transformers tokenizer) to skip loading it again for each server.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import random
import re
import select
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

__all__ = [
    "DIALECTS",
    "FAILURE_KINDS",
    "ChatServer",
    "Dialect",
    "Outcome",
    "RequestRecord",
    "context_error",
]

FAILURE_KINDS = ("timeout", "500", "503", "429", "malformed", "disconnect", "cut", "overstate")
# Content parts a multimodal model expands into placeholder tokens (``media_tokens`` each).
MEDIA_PARTS = frozenset({"image_url", "input_image", "input_audio", "video_url", "file"})
# What the chat call sets itself: request kwargs under these names are not passed on (vLLM resolves the kwargs so).
_CALL_KWARGS = frozenset(
    {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt", "tokenize",
     "return_dict", "continue_final_message"}
)  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Dialects: what each server does with a prompt that does not fit, in its own words.
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """A dialect's verdict: reject (``status`` and ``body``), or accept with at most ``max_completion`` tokens."""

    status: int = 200
    body: dict[str, Any] | None = None
    max_completion: int | None = None  # room left for the answer; None: no cap beyond max_tokens
    truncate_to: int | None = None  # Ollama: shorten the prompt to fit this many tokens instead of failing

    @property
    def rejected(self) -> bool:
        return self.status != 200

    @property
    def message(self) -> str | None:
        """The error text, wherever the dialect puts it."""
        if self.body is None:
            return None
        error = self.body.get("error", self.body)
        return str(error.get("message")) if isinstance(error, dict) else str(error)


@dataclass(frozen=True)
class Dialect:
    """One server's limit rule and error wording.

    ``templates`` holds the exact message formats (``str.format`` fields: ``limit``, ``prompt``, ``max_tokens``,
    ``total``, ``max_input``, ``reported``, ``excess``, ``param``), for parsers to be tested against; ``check``
    applies the server's rule to (prompt tokens, max_tokens or None, max_tokens parameter name, limit).
    """

    name: str
    source: str
    templates: Mapping[str, str]
    check: Callable[[int, int | None, str, int], Outcome]

    def render(self, key: str, **values: Any) -> str:
        return self.templates[key].format(**values)


def _nested(message: str, type_: str, code: Any, param: Any = None, **extra: Any) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code, **extra}}


# vLLM, current (renderer path): vllm/renderers/params.py, TokenizeParams (commit 1aa021e8):
#   __post_init__:   f"{self.max_output_tokens_param}={max_output_tokens}"
#                    f"cannot be greater than "
#                    f"{self.max_total_tokens_param}={max_total_tokens=}. "
#                    f"Please request fewer output tokens."          (sic: no space, and a self-documenting `=`)
#   _token_len_check: f"You passed {len(tokens)} input tokens "
#                    f"and requested {self.max_output_tokens} output tokens. "
#                    f"However, the model's context length is only "
#                    f"{self.max_total_tokens} tokens, resulting in a maximum "
#                    f"input length of {max_input_tokens} tokens. "
#                    f"Please reduce the length of the input prompt."   (parameter="input_tokens")
# ChatCompletionRequest.build_tok_params (vllm/entrypoints/openai/chat_completion/protocol.py) passes
# max_output_tokens = max_completion_tokens or max_tokens or 0, max_total_tokens_param="max_model_len" and
# max_output_tokens_param = "max_completion_tokens" | "max_tokens". get_encode_kwargs() truncates the prompt to
# max_input_tokens + 1 ids before the check "while still failing", so the input count in this message is capped
# at max_input + 1 — not the prompt's length (bodies seen in the wild agree: 147421 passed, 147420 maximum).
# VLLMValidationError.__str__ (vllm/exceptions.py) appends " (parameter=..., value=...)"; create_error_response
# (vllm/entrypoints/openai/engine/serving.py) sends ErrorResponse(error=ErrorInfo(message, type="BadRequestError",
# param=exc.parameter, code=400)).
_VLLM_TEMPLATES = {
    "input": "You passed {reported} input tokens and requested {max_tokens} output tokens. However, the model's "
    "context length is only {limit} tokens, resulting in a maximum input length of {max_input} tokens. Please "
    "reduce the length of the input prompt. (parameter=input_tokens, value={reported})",
    "output": "{param}={max_tokens}cannot be greater than max_model_len=max_total_tokens={limit}. Please request "
    "fewer output tokens. (parameter={param}, value={max_tokens})",
}


def _vllm(prompt: int, max_tokens: int | None, param: str, limit: int) -> Outcome:
    requested = max_tokens or 0
    if requested > limit:
        message = _VLLM_TEMPLATES["output"].format(param=param, max_tokens=requested, limit=limit)
        return Outcome(400, _nested(message, "BadRequestError", 400, param))
    max_input = limit - requested
    if prompt > max_input:
        reported = min(prompt, max_input + 1)
        message = _VLLM_TEMPLATES["input"].format(
            reported=reported, max_tokens=requested, limit=limit, max_input=max_input
        )
        return Outcome(400, _nested(message, "BadRequestError", 400, "input_tokens"))
    # Without max_tokens vLLM generates up to the rest of the context (get_max_tokens).
    return Outcome(max_completion=limit - prompt)


# vLLM, OpenAIServing._validate_input (vllm/entrypoints/openai/engine/serving.py, commit 00bd1493; earlier in
# vllm/entrypoints/openai/serving_engine.py):
#   f"This model's maximum context length is "
#   f"{max_model_len} tokens. However, your request has "
#   f"{token_num} input tokens. Please reduce the length of "
#   "the input messages."                                         (token_num >= max_model_len; "input_tokens")
#   "'max_tokens' or 'max_completion_tokens' is too large: "
#   f"{max_tokens}. This model's maximum context length is "
#   f"{max_model_len} tokens and your request has "
#   f"{token_num} input tokens ({max_tokens} > {max_model_len}"
#   f" - {token_num})."                                           (token_num + max_tokens > max_model_len)
# with the VLLMValidationError suffix " (parameter=..., value=...)" (releases before it sent the bare text).
_VLLM_VALIDATE_TEMPLATES = {
    "input": "This model's maximum context length is {limit} tokens. However, your request has {prompt} input "
    "tokens. Please reduce the length of the input messages. (parameter=input_tokens, value={prompt})",
    "output": "'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum context "
    "length is {limit} tokens and your request has {prompt} input tokens ({max_tokens} > {limit} - {prompt}). "
    "(parameter=max_tokens, value={max_tokens})",
}


def _vllm_validate(prompt: int, max_tokens: int | None, param: str, limit: int) -> Outcome:
    if prompt >= limit:
        message = _VLLM_VALIDATE_TEMPLATES["input"].format(limit=limit, prompt=prompt)
        return Outcome(400, _nested(message, "BadRequestError", 400, "input_tokens"))
    if max_tokens is not None and prompt + max_tokens > limit:
        message = _VLLM_VALIDATE_TEMPLATES["output"].format(max_tokens=max_tokens, limit=limit, prompt=prompt)
        return Outcome(400, _nested(message, "BadRequestError", 400, "max_tokens"))
    return Outcome(max_completion=limit - prompt)


# vLLM, legacy OpenAIServing._validate_prompt_and_tokenize (vllm/entrypoints/openai/serving_engine.py, commit
# 0030b9ff, the 0.4/0.5 era):
#   f"This model's maximum context length is "
#   f"{self.max_model_len} tokens. However, you requested "
#   f"{token_num} tokens in the messages, "
#   f"Please reduce the length of the messages."                  (max_tokens None and token_num >= limit)
#   request.max_tokens = self.max_model_len - token_num           (max_tokens None: the rest of the context)
#   f"This model's maximum context length is "
#   f"{self.max_model_len} tokens. However, you requested "
#   f"{request.max_tokens + token_num} tokens "
#   f"({token_num} in the messages, "
#   f"{request.max_tokens} in the completion). "
#   f"Please reduce the length of the messages or completion."
# The body then was ErrorResponse(object="error", message, type="BadRequestError", param=None, code=400), not
# nested under "error" (the SDK then gives the whole body as exc.body).
_VLLM_LEGACY_TEMPLATES = {
    "input": "This model's maximum context length is {limit} tokens. However, you requested {prompt} tokens in "
    "the messages, Please reduce the length of the messages.",
    "total": "This model's maximum context length is {limit} tokens. However, you requested {total} tokens "
    "({prompt} in the messages, {max_tokens} in the completion). Please reduce the length of the messages or "
    "completion.",
}


def _vllm_legacy(prompt: int, max_tokens: int | None, param: str, limit: int) -> Outcome:
    def body(message: str) -> dict[str, Any]:
        return {"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": 400}

    if max_tokens is None:
        if prompt >= limit:
            return Outcome(400, body(_VLLM_LEGACY_TEMPLATES["input"].format(limit=limit, prompt=prompt)))
        max_tokens = limit - prompt
    if prompt + max_tokens > limit:
        message = _VLLM_LEGACY_TEMPLATES["total"].format(
            limit=limit, total=prompt + max_tokens, prompt=prompt, max_tokens=max_tokens
        )
        return Outcome(400, body(message))
    return Outcome(max_completion=max_tokens)


# llama.cpp server, tools/server/server-context.cpp (recent master):
#   if (slot.task->n_tokens() >= slot.n_ctx) {
#       send_error(slot, "request (%d tokens) exceeds the available context size (%d tokens), try increasing it",
#                  ERROR_TYPE_EXCEED_CONTEXT_SIZE);
# server-common.cpp format_error_response: ERROR_TYPE_EXCEED_CONTEXT_SIZE -> type "exceed_context_size_error",
# code 400, json {"code", "message", "type"}; server-task.cpp server_task_result_error::to_json adds
# "n_prompt_tokens" and "n_ctx" for that type; the HTTP layer wraps it as {"error": {...}}. Only the prompt is
# checked (n_ctx is the per-slot context, n_ctx / --parallel); max_tokens is not, generation stops at the end of
# the context with finish_reason "length" (context shift is off by default).
_LLAMACPP_TEMPLATES = {
    "input": "request ({prompt} tokens) exceeds the available context size ({limit} tokens), try increasing it",
}
# Earlier builds (2025) sent the same type and fields with a message without numbers:
#   "the request exceeds the available context size, try increasing it"
# and before ERROR_TYPE_EXCEED_CONTEXT_SIZE existed (examples/server/server.cpp, 2024) an invalid_request_error:
#   "the request exceeds the available context size. try increasing the context size or enable context shift"
_LLAMACPP_LEGACY_TEMPLATES = {"input": "the request exceeds the available context size, try increasing it"}


def _llamacpp_with(templates: Mapping[str, str]) -> Callable[[int, int | None, str, int], Outcome]:
    def check(prompt: int, max_tokens: int | None, param: str, limit: int) -> Outcome:
        if prompt >= limit:
            message = templates["input"].format(prompt=prompt, limit=limit)
            body = {
                "error": {
                    "code": 400,
                    "message": message,
                    "type": "exceed_context_size_error",
                    "n_prompt_tokens": prompt,
                    "n_ctx": limit,
                }
            }
            return Outcome(400, body)
        return Outcome(max_completion=limit - prompt)

    return check


# Ollama does not reject a chat prompt by default: server/prompt.go chatPrompt drops the oldest messages (keeping
# system messages, the last message, and whole assistant tool-call blocks) until the rendered prompt fits num_ctx
# (`ctxLen <= opts.NumCtx`, max_tokens not reserved), logging "truncating input messages which exceed context
# length" at debug level; runner/ollamarunner/runner.go NewSequence then cuts a still-too-long token prompt
# (keeping numKeep tokens) with slog.Warn("truncating input prompt", ...). The answer is a 200 whose
# usage.prompt_tokens counts what was kept. Its OpenAI layer (openai/openai.go NewError) shapes errors as
# {"error": {"message", "type": "invalid_request_error" (400) | "not_found_error" | "api_error", "param": null,
# "code": null}}.
#
# "ollama-error": clients (pi-ai's overflow patterns and others) attribute to Ollama the 400
#   "prompt too long; exceeded max context length by N tokens"
# — not found in the Ollama source read here (likely ollama.com's hosted models); N is taken as prompt - limit.
_OLLAMA_ERROR_TEMPLATES = {"input": "prompt too long; exceeded max context length by {excess} tokens"}


def _ollama(prompt: int, max_tokens: int | None, param: str, limit: int) -> Outcome:
    if prompt > limit:
        return Outcome(truncate_to=limit, max_completion=max_tokens)
    return Outcome(max_completion=max_tokens)


def _ollama_error(prompt: int, max_tokens: int | None, param: str, limit: int) -> Outcome:
    if prompt > limit:
        message = _OLLAMA_ERROR_TEMPLATES["input"].format(excess=prompt - limit)
        return Outcome(400, _nested(message, "invalid_request_error", None))
    return Outcome(max_completion=max_tokens)


# OpenAI (api.openai.com), as its 400s read: code "context_length_exceeded", type "invalid_request_error",
# param "messages":
#   "This model's maximum context length is 128000 tokens. However, your messages resulted in 130000 tokens.
#    Please reduce the length of the messages."                                    (the messages alone too long)
#   "This model's maximum context length is 4096 tokens. However, you requested 4222 tokens (1222 in the
#    messages, 3000 in the completion). Please reduce the length of the messages or completion."
#                                                      (with the completion; the wording vLLM's legacy text copies)
_OPENAI_TEMPLATES = {
    "input": "This model's maximum context length is {limit} tokens. However, your messages resulted in {prompt} "
    "tokens. Please reduce the length of the messages.",
    "total": "This model's maximum context length is {limit} tokens. However, you requested {total} tokens "
    "({prompt} in the messages, {max_tokens} in the completion). Please reduce the length of the messages or "
    "completion.",
}


def _openai(prompt: int, max_tokens: int | None, param: str, limit: int) -> Outcome:
    if prompt > limit:
        message = _OPENAI_TEMPLATES["input"].format(limit=limit, prompt=prompt)
        return Outcome(400, _nested(message, "invalid_request_error", "context_length_exceeded", "messages"))
    if max_tokens is not None and prompt + max_tokens > limit:
        message = _OPENAI_TEMPLATES["total"].format(
            limit=limit, total=prompt + max_tokens, prompt=prompt, max_tokens=max_tokens
        )
        return Outcome(400, _nested(message, "invalid_request_error", "context_length_exceeded", "messages"))
    return Outcome(max_completion=limit - prompt)


DIALECTS: dict[str, Dialect] = {
    d.name: d
    for d in (
        Dialect("vllm", "vllm/renderers/params.py TokenizeParams (current)", _VLLM_TEMPLATES, _vllm),
        Dialect(
            "vllm-validate",
            "vllm/entrypoints/openai/engine/serving.py OpenAIServing._validate_input",
            _VLLM_VALIDATE_TEMPLATES,
            _vllm_validate,
        ),
        Dialect(
            "vllm-legacy",
            "vllm/entrypoints/openai/serving_engine.py _validate_prompt_and_tokenize (0.4/0.5)",
            _VLLM_LEGACY_TEMPLATES,
            _vllm_legacy,
        ),
        Dialect(
            "llamacpp",
            "llama.cpp tools/server/server-context.cpp",
            _LLAMACPP_TEMPLATES,
            _llamacpp_with(_LLAMACPP_TEMPLATES),
        ),
        Dialect(
            "llamacpp-legacy",
            "llama.cpp server, 2025 builds",
            _LLAMACPP_LEGACY_TEMPLATES,
            _llamacpp_with(_LLAMACPP_LEGACY_TEMPLATES),
        ),
        Dialect("ollama", "ollama server/prompt.go chatPrompt (truncates, no error)", {}, _ollama),
        Dialect("ollama-error", "as clients quote Ollama", _OLLAMA_ERROR_TEMPLATES, _ollama_error),
        Dialect("openai", "api.openai.com", _OPENAI_TEMPLATES, _openai),
    )
}


def context_error(
    dialect: str, prompt_tokens: int, max_tokens: int | None, max_model_len: int, *, param: str = "max_tokens"
) -> Outcome:
    """What ``dialect`` answers for a prompt of ``prompt_tokens`` (all tokens, hidden ones included)."""
    return DIALECTS[dialect].check(prompt_tokens, max_tokens, param, max_model_len)


# The server each dialect comes from, and the fields its answers carry that the others' do not (the openai SDK keeps
# unknown fields, so a client can read them): vLLM's ChatCompletionResponse adds ``prompt_logprobs`` and
# ``kv_transfer_params`` and its choices ``stop_reason`` (vllm/entrypoints/openai/chat_completion/protocol.py);
# llama.cpp's server sends its build as ``system_fingerprint`` and adds ``timings``
# (tools/server/server-task.cpp, to_json_oaicompat_chat); Ollama's OpenAI layer answers with
# ``system_fingerprint: "fp_ollama"`` (openai/openai.go); OpenAI with an ``fp_`` fingerprint and ``service_tier``.
SERVER_OF_DIALECT: dict[str, str] = {
    "vllm": "vllm",
    "vllm-validate": "vllm",
    "vllm-legacy": "vllm",
    "llamacpp": "llama.cpp",
    "llamacpp-legacy": "llama.cpp",
    "ollama": "ollama",
    "ollama-error": "ollama",
    "openai": "openai",
}
_LLAMACPP_BUILD = "b6890-7e9d7ba1"  # the form of llama.cpp's build_info: "b<build number>-<commit>"


def server_marks(server: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(response fields, choice fields)`` that mark an answer (and each stream chunk) of ``server``."""
    if server == "vllm":
        return {"system_fingerprint": None, "prompt_logprobs": None, "kv_transfer_params": None}, {"stop_reason": None}
    if server == "llama.cpp":
        return {"system_fingerprint": _LLAMACPP_BUILD}, {}
    if server == "ollama":
        return {"system_fingerprint": "fp_ollama"}, {}
    return {"system_fingerprint": "fp_50cad350e4", "service_tier": "default"}, {}


# ---------------------------------------------------------------------------------------------------------------
# Counting as vLLM does, with transformers only.
# ---------------------------------------------------------------------------------------------------------------


def _content_format(template: str) -> str:
    """``"openai"`` if the template loops over a message's content, else ``"string"`` (vLLM's detection idea)."""
    import jinja2
    import jinja2.nodes

    try:
        ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols", "jinja2.ext.do"]).parse(template)
    except jinja2.TemplateSyntaxError:
        return "string"  # vLLM falls back to "string" when it cannot read the template
    for loop in ast.find_all(jinja2.nodes.For):
        node = loop.iter
        while isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)) and node.node is not None:
            node = node.node
        if isinstance(node, jinja2.nodes.Getattr) and node.attr == "content":
            return "openai"
        if (
            isinstance(node, jinja2.nodes.Getitem)
            and isinstance(node.arg, jinja2.nodes.Const)
            and node.arg.value == "content"
        ):
            return "openai"
    return "string"


def _parse_arguments(arguments: Any) -> Any:
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except ValueError:
        return {}


def vllm_messages(messages: list[dict[str, Any]], content_format: str) -> list[dict[str, Any]]:
    """The conversation vLLM hands the chat template (see the module docstring)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message["role"]
        content = message.get("content")
        if content is None:
            texts: list[str] = []
        elif isinstance(content, str):
            texts = [content]
        else:
            texts = [part["text"] for part in content if part.get("type") == "text" and part.get("text") is not None]
        # A tool result without media stays one string in "openai" format too (recent vLLM; taken from the
        # lead's notes, not re-read in vLLM's source here).
        if content_format == "string" or role == "tool":
            shaped: Any = "\n".join(texts)
        else:
            shaped = [{"type": "text", "text": text} for text in texts]
        item: dict[str, Any] = {"role": role, "content": shaped}
        if role == "assistant":
            calls = message.get("tool_calls")
            if calls:
                item["tool_calls"] = [
                    {
                        **call,
                        "function": {
                            **call["function"],
                            "arguments": _parse_arguments(call["function"].get("arguments")),
                        },
                    }
                    for call in calls
                ]
            reasoning = message.get("reasoning", message.get("reasoning_content"))
            if reasoning is not None:
                item["reasoning"] = item["reasoning_content"] = reasoning
        elif role == "tool" and "tool_call_id" in message:
            item["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            item["name"] = message["name"]
        out.append(item)
    return out


def vllm_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The tools as vLLM's ``ChatCompletionToolsParam.model_dump()`` gives them to the template."""
    if tools is None:
        return None
    dumped = []
    for tool in tools:
        function = dict(tool["function"])
        head = {
            "name": function.pop("name"),
            "description": function.pop("description", None),
            "parameters": function.pop("parameters", None),
        }
        dumped.append({"type": tool.get("type", "function"), "function": {**head, **function}})
    return dumped


def llamacpp_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The tools as llama.cpp's server hands them to the template (common_chat_tools_parse_oaicompat, then
    common_chat_tools_to_json_oaicompat): name, description and parameters only, so ``strict`` is gone."""
    if tools is None:
        return None
    out = []
    for tool in tools:
        function = tool["function"]
        out.append(
            {
                "type": "function",
                "function": {
                    "name": function["name"],
                    "description": function.get("description", ""),
                    "parameters": function.get("parameters", {}),
                },
            }
        )
    return out


# ---------------------------------------------------------------------------------------------------------------
# The server.
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class RequestRecord:
    """One chat request as the server saw it."""

    index: int  # 1-based, over all chat requests
    body: dict[str, Any]
    prompt_tokens: int | None = None  # counted (hidden tokens included); None when a failure came first
    max_tokens: int | None = None  # max_completion_tokens or max_tokens as sent
    accepted: bool = False
    status: int = 200
    failure: str | None = None  # the injected failure this request took
    error: str | None = None  # the error message sent back
    completion_tokens: int = 0
    truncated_messages: int = 0  # Ollama: messages dropped from the front
    finish_reason: str | None = None
    streamed: str | None = None  # a stream: the content it sent (all of it, or what went out before a cut)
    cached_tokens: int | None = None  # prompt tokens reused from the prefix cache (prefix_cache=True only)


@dataclass
class _Failure:
    kind: str
    delay: float
    retry_after: str
    after: int = 2  # "cut": events sent before the connection drops
    reported: int | None = None  # "overstate": the prompt tokens the refusal claims


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True  # a client holding a keep-alive connection must not block close()
    # The listen backlog (socketserver's default is 5): a burst of new connections past it has its SYNs dropped,
    # and each such client waits the kernel's 1 s retransmit; servers in use (uvicorn for vLLM) take 2048.
    request_queue_size = 1024

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that hung up mid-response (a cancelled stream, a client-side timeout) is what those tests do;
        # anything else is still printed.
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


class ChatServer:
    """An OpenAI-compatible ``/v1`` server on 127.0.0.1 (ephemeral port) that counts with transformers.

    ``with ChatServer(tokenizer_dir, ...) as server:`` starts it; ``server.base_url`` is ``http://127.0.0.1:PORT/v1``.
    Thread-safe: requests are served on threads; counting is serialised, waits are not.
    """

    def __init__(
        self,
        tokenizer_dir: str | Path,
        chat_template: str | None = None,
        max_model_len: int = 4096,
        dialect: str = "vllm",
        hidden_tokens: int = 0,
        *,
        hidden_prefix: str | None = None,
        served_model_name: str = "test-model",
        preprocess: str | None = None,
        stream_chunk_words: int = 2,
        tokenizer: Any = None,
        response_delay: float = 0.0,
        chunk_delay: float = 0.0,
        prefix_cache: bool = False,
        block_size: int = 16,
        cache_blocks: int | None = None,
        media_tokens: int = 0,
    ) -> None:
        if dialect not in DIALECTS:
            raise ValueError(f"unknown dialect {dialect!r}; known: {', '.join(DIALECTS)}")
        self.server_kind = SERVER_OF_DIALECT[dialect]
        if preprocess is None:  # each server's own
            preprocess = "llamacpp" if self.server_kind == "llama.cpp" else "vllm"
        if preprocess not in ("vllm", "llamacpp", "raw"):
            raise ValueError(f"preprocess must be 'vllm', 'llamacpp' or 'raw', got {preprocess!r}")
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        template = chat_template or tokenizer.chat_template
        if not template:
            raise ValueError(f"{tokenizer_dir} has no chat template; pass chat_template=<Jinja source>")
        self.content_format = _content_format(template if isinstance(template, str) else "\n".join(template.values()))
        self.max_model_len = max_model_len
        self.dialect = dialect
        self.hidden_tokens = hidden_tokens
        self.media_tokens = media_tokens
        self.hidden_prefix = hidden_prefix
        self._hidden_ids: list[int] = (
            list(tokenizer.encode(hidden_prefix, add_special_tokens=False)) if hidden_prefix else []
        )
        self.served_model_name = served_model_name
        self.preprocess = preprocess
        self.stream_chunk_words = max(1, stream_chunk_words)
        self.response_delay = response_delay
        self.chunk_delay = chunk_delay
        self._marks = server_marks(self.server_kind)
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.prefix_cache = prefix_cache
        self.block_size = block_size
        self.cache_blocks = cache_blocks
        self._blocks: collections.OrderedDict[int, None] = collections.OrderedDict()  # block hashes, LRU first
        self._chaos: tuple[random.Random, dict[str, float], tuple[int, int]] | None = None

        self.replies: collections.deque[str | dict[str, Any] | Callable[[dict[str, Any]], Any]] = collections.deque()
        self.requests: list[RequestRecord] = []
        self.accepted = 0
        self.rejected = 0
        self.failed = 0
        self._failures: collections.deque[_Failure] = collections.deque()
        self._numbers = itertools.count(1)
        self._lock = threading.Lock()  # records, counters, queues
        self._count_lock = threading.Lock()  # the tokenizer and template rendering
        self._closing = threading.Event()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle --------------------------------------------------------------------------------------------

    @property
    def hidden(self) -> int:
        """Tokens the server adds to every prompt that the client cannot see."""
        return len(self._hidden_ids) + self.hidden_tokens

    @property
    def port(self) -> int:
        if self._httpd is None:
            raise RuntimeError("the server is not running")
        return int(self._httpd.server_address[1])

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> ChatServer:
        if self._httpd is not None:
            return self
        self._closing.clear()
        self._httpd = _HTTPServer(("127.0.0.1", 0), _make_handler(self))
        # A short poll interval: shutdown() waits up to one interval, and tests start many servers.
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.02}, name="chat-server", daemon=True
        )
        self._thread.start()
        return self

    def close(self) -> None:
        if self._httpd is None:
            return
        self._closing.set()  # wakes handlers sleeping on an injected timeout
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._httpd = None
        self._thread = None

    def __enter__(self) -> ChatServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- test controls ------------------------------------------------------------------------------------------

    def fail_next(
        self,
        kind: str,
        times: int = 1,
        *,
        delay: float = 2.0,
        retry_after: float | str = 1,
        after: int = 2,
        reported: int | None = None,
    ) -> None:
        """Queue ``times`` failures of ``kind`` (see :data:`FAILURE_KINDS`) for the next chat requests. ``after``:
        the events a ``"cut"`` stream sends first; ``reported``: the prompt tokens an ``"overstate"`` refusal
        claims (at least ``max_model_len``, so the dialect refuses)."""
        if kind not in FAILURE_KINDS:
            raise ValueError(f"unknown failure kind {kind!r}; known: {', '.join(FAILURE_KINDS)}")
        if kind == "overstate" and (reported is None or reported < self.max_model_len):
            raise ValueError(f"an 'overstate' refusal needs reported >= max_model_len ({self.max_model_len})")
        with self._lock:
            self._failures.extend(
                _Failure(kind, delay, str(retry_after), after=after, reported=reported) for _ in range(times)
            )

    def random_failures(
        self, rates: Mapping[str, float] | None, *, seed: int = 0, after: tuple[int, int] = (0, 4)
    ) -> None:
        """From now on, every chat request with no failure queued takes ``kind`` with probability ``rates[kind]``
        (a cut stream after a number of events drawn from ``after``); None stops it."""
        if rates is None:
            with self._lock:
                self._chaos = None
            return
        unknown = set(rates) - set(FAILURE_KINDS) - {"overstate"}
        if unknown or "overstate" in rates or "timeout" in rates:
            raise ValueError(f"random failures take {', '.join(FAILURE_KINDS[1:-1])}; got {sorted(rates)}")
        with self._lock:
            self._chaos = (random.Random(seed), dict(rates), after)

    @property
    def pending_failures(self) -> list[str]:
        with self._lock:
            return [f.kind for f in self._failures]

    def clear(self) -> None:
        """Forget records, counters, queued replies and failures."""
        with self._lock:
            self.requests.clear()
            self.replies.clear()
            self._failures.clear()
            self.accepted = self.rejected = self.failed = 0

    def count(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, **fields: Any) -> int:
        """The prompt tokens this server reports for these messages and tools (hidden tokens included), with the
        request's prompt fields (``documents``, ``chat_template_kwargs``, ``chat_template``)."""
        return len(self.prompt_ids(messages, tools, **fields)) + self.hidden_tokens + self.media_count(messages)

    def media_count(self, messages: list[dict[str, Any]]) -> int:
        """The placeholder tokens of the messages' media parts (``media_tokens`` each)."""
        parts = sum(
            1
            for message in messages
            if isinstance(message.get("content"), list)
            for part in message["content"]
            if isinstance(part, dict) and part.get("type") in MEDIA_PARTS
        )
        return parts * self.media_tokens

    def prompt_ids(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        documents: list[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> list[int]:
        """The prompt's token ids: the hidden prefix, then the chat template's ids (the request's ``documents``,
        ``chat_template_kwargs`` and ``chat_template`` as vLLM passes them)."""
        template = chat_template or self.chat_template
        extra = {k: v for k, v in (chat_template_kwargs or {}).items() if k not in _CALL_KWARGS}
        if documents is not None:
            extra["documents"] = documents
        if self.preprocess == "raw":
            conversation, tool_dicts = messages, tools
        else:
            conversation = vllm_messages(messages, self.content_format)
            tool_dicts = vllm_tools(tools) if self.preprocess == "vllm" else llamacpp_tools(tools)
        prefill = None
        if self.preprocess == "llamacpp" and len(conversation) > 1 and conversation[-1]["role"] == "assistant":
            # llama.cpp continues a final assistant message: the rest with the generation prompt, then its text.
            last = conversation[-1]["content"]
            prefill = last if isinstance(last, str) else "".join(part["text"] for part in last)
            conversation = conversation[:-1]
        with self._count_lock:
            if prefill is None:
                ids = self.tokenizer.apply_chat_template(
                    conversation,
                    tools=tool_dicts,
                    chat_template=template,
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=False,
                    **extra,
                )
            else:
                text = self.tokenizer.apply_chat_template(
                    conversation,
                    tools=tool_dicts,
                    chat_template=template,
                    add_generation_prompt=True,
                    tokenize=False,
                    **extra,
                )
                ids = self.tokenizer.encode(text + prefill, add_special_tokens=False)
        return self._hidden_ids + list(ids)

    def cache_prompt(self, ids: list[int]) -> int:
        """vLLM's prefix-cache hit for a prompt of ``ids`` (see the module), then its full blocks cached."""
        size = self.block_size
        hashes: list[int] = []
        parent = 0
        for start in range(0, len(ids) - size + 1, size):
            parent = hash((parent, tuple(ids[start : start + size])))
            hashes.append(parent)
        with self._lock:
            hit = 0
            for block in hashes[: (len(ids) - 1) // size]:
                if block not in self._blocks:
                    break
                hit += size
            for block in hashes:
                self._blocks[block] = None
                self._blocks.move_to_end(block)
            while self.cache_blocks is not None and len(self._blocks) > self.cache_blocks:
                self._blocks.popitem(last=False)
        return hit

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (vLLM's ``/reset_prefix_cache``)."""
        with self._lock:
            self._blocks.clear()

    def tokens(self, text: str) -> list[int]:
        with self._count_lock:
            return list(self.tokenizer.encode(text, add_special_tokens=False))

    # -- request handling ----------------------------------------------------------------------------------

    def _take_failure(self) -> _Failure | None:
        with self._lock:
            if self._failures:
                return self._failures.popleft()
            if self._chaos is None:
                return None
            rng, rates, after = self._chaos
            draw = rng.random()
            for kind, rate in rates.items():
                if draw < rate:
                    return _Failure(kind, 0.0, "0", after=rng.randint(*after))
                draw -= rate
            return None

    def _record(self, record: RequestRecord) -> None:
        with self._lock:
            self.requests.append(record)
            if record.failure == "overstate":
                self.rejected += 1
            elif record.failure is not None and (record.failure != "timeout" or record.status == 0):
                self.failed += 1
            elif record.accepted:
                self.accepted += 1
            else:
                self.rejected += 1

    def _next_reply(self, body: dict[str, Any], number: int) -> dict[str, Any]:
        with self._lock:
            scripted = self.replies.popleft() if self.replies else None
        if callable(scripted):
            scripted = scripted(body)
        if scripted is None:
            scripted = f"Reply to request {number}."
        if isinstance(scripted, str):
            return {"content": scripted}
        return dict(scripted)

    def _complete(
        self, body: dict[str, Any], record: RequestRecord, overstate: int | None = None
    ) -> tuple[int, dict[str, Any], dict[str, Any]]:
        """Count, check the limit, and build the answer: (status, response or error body, reply). ``overstate``:
        refuse as if the prompt had that many tokens."""
        messages = list(body.get("messages") or [])
        tools = body.get("tools")
        if body.get("max_completion_tokens") is not None:
            max_tokens, param = int(body["max_completion_tokens"]), "max_completion_tokens"
        elif body.get("max_tokens") is not None:
            max_tokens, param = int(body["max_tokens"]), "max_tokens"
        else:
            max_tokens, param = None, "max_tokens"
        record.max_tokens = max_tokens
        fields = {key: body[key] for key in ("documents", "chat_template_kwargs", "chat_template") if body.get(key)}
        prompt_ids = self.prompt_ids(messages, tools, **fields)
        prompt = len(prompt_ids) + self.hidden_tokens + self.media_count(messages)
        outcome = DIALECTS[self.dialect].check(
            prompt if overstate is None else overstate, max_tokens, param, self.max_model_len
        )
        if overstate is not None and not outcome.rejected:
            raise ValueError(f"the {self.dialect} dialect does not refuse {overstate} tokens")
        if outcome.truncate_to is not None:
            prompt, record.truncated_messages = self._ollama_truncate(messages, tools, outcome.truncate_to)
        record.prompt_tokens = prompt
        if outcome.rejected:
            record.status, record.error = outcome.status, outcome.message
            return outcome.status, outcome.body or {}, {}

        reply = self._next_reply(body, record.index)
        caps = [x for x in (max_tokens, outcome.max_completion) if x is not None]
        budget = min(caps) if caps else None
        finish = "tool_calls" if reply.get("tool_calls") else "stop"
        content = reply.get("content")
        used = 0
        if content:
            ids = self.tokens(content)
            if budget is not None and len(ids) > budget:
                with self._count_lock:
                    content = self.tokenizer.decode(ids[:budget])
                ids, finish = ids[:budget], "length"
            used = len(ids)
        calls = []
        for n, call in enumerate(reply.get("tool_calls") or []):
            function = dict(call["function"])
            if not isinstance(function.get("arguments"), str):
                function["arguments"] = json.dumps(function.get("arguments") or {})
            calls.append({"id": call.get("id", f"call_{record.index}_{n}"), "type": "function", "function": function})
            used += len(self.tokens(function["name"])) + len(self.tokens(function["arguments"]))
        answers = int(body.get("n") or 1)  # n sequences, each given the scripted reply
        used *= answers
        record.accepted, record.completion_tokens, record.finish_reason = True, used, finish
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": used, "total_tokens": prompt + used}
        if self.prefix_cache:
            record.cached_tokens = self.cache_prompt(prompt_ids)
            usage["prompt_tokens_details"] = {"cached_tokens": record.cached_tokens}
        marks, choice_marks = self._marks
        response = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model") or self.served_model_name,
            "choices": [
                {"index": i, "message": message, "logprobs": None, "finish_reason": finish, **choice_marks}
                for i in range(answers)
            ],
            "usage": usage,
            **marks,
        }
        if self.server_kind == "llama.cpp":
            response["timings"] = {"prompt_n": prompt, "prompt_ms": 1.0, "predicted_n": used, "predicted_ms": 1.0}
        return 200, response, message

    def _ollama_truncate(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, limit: int
    ) -> tuple[int, int]:
        """Ollama's chatPrompt: drop the oldest messages (system kept, tool blocks whole) until the prompt fits."""
        last = len(messages) - 1
        start = 0
        for i in range(last + 1):
            start = i
            # Never orphan a tool result from the assistant turn that called it.
            if messages[i].get("role") == "tool":
                j = i
                while j > 0 and messages[j - 1].get("role") == "tool":
                    j -= 1
                if j > 0 and messages[j - 1].get("role") == "assistant" and messages[j - 1].get("tool_calls"):
                    start = j - 1
            kept = [m for m in messages[:start] if m.get("role") == "system"] + messages[start:]
            prompt = self.count(kept, tools)
            if prompt <= limit or i == last:
                break
        # The runner then cuts a still-too-long token prompt to the context.
        return min(prompt, limit), start - sum(1 for m in messages[:start] if m.get("role") == "system")


def _make_handler(server: ChatServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = 10  # idle keep-alive connections end on their own
        # TCP_NODELAY, as asyncio servers (vLLM's uvicorn) set it: with Nagle's algorithm on, a body written after
        # its headers waits ~40 ms for the client's delayed ACK, and every latency measured through it is noise.
        disable_nagle_algorithm = True
        server_version = "contextkeeper-test-server/1.0"

        def log_message(self, format: str, *args: Any) -> None:  # quiet in tests
            pass

        # -- plumbing --------------------------------------------------------------------------------------

        def _send_json(self, status: int, payload: Any, headers: Mapping[str, str] | None = None) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(data)

        def _read_body(self) -> dict[str, Any] | None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw or b"{}")
            except ValueError:
                self._send_json(400, _nested("request body is not JSON", "BadRequestError", 400))
                return None
            if not isinstance(body, dict):
                self._send_json(400, _nested("request body must be a JSON object", "BadRequestError", 400))
                return None
            return body

        # -- routes ----------------------------------------------------------------------------------------

        def do_GET(self) -> None:
            if self.path.rstrip("/") == "/v1/models":
                card = {
                    "id": server.served_model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "contextkeeper-tests",
                    "max_model_len": server.max_model_len,
                }
                self._send_json(200, {"object": "list", "data": [card]})
            else:
                self._send_json(404, _nested(f"no route {self.path}", "NotFoundError", 404))

        def do_POST(self) -> None:
            if self.path.rstrip("/") != "/v1/chat/completions":
                self._send_json(404, _nested(f"no route {self.path}", "NotFoundError", 404))
                return
            body = self._read_body()
            if body is None:
                return
            record = RequestRecord(index=next(server._numbers), body=body)
            failure = server._take_failure()
            try:
                if failure is not None and failure.kind not in ("cut", "overstate") and self._fail(failure, record):
                    return
                self._chat(body, record, failure)
            except (TimeoutError, BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (its own timeout); nothing to answer

        def _fail(self, failure: _Failure, record: RequestRecord) -> bool:
            """Apply an injected failure; True when it replaced the answer."""
            record.failure = failure.kind
            if failure.kind == "timeout":
                # Answer, but late. A client with a shorter timeout has hung up by then: record the request as
                # failed (status 0) without answering, so it takes no scripted reply and counts as not served.
                server._closing.wait(failure.delay)
                if not server._closing.is_set() and not self._client_gone():
                    return False
                record.status = 0
            server._record(record)
            if failure.kind == "timeout":
                self.close_connection = True
            elif failure.kind == "disconnect":
                record.status = 0
                self.close_connection = True
                with contextlib.suppress(OSError):
                    self.connection.shutdown(socket.SHUT_RDWR)
            elif failure.kind == "malformed":
                record.status = 200
                data = b'{"id": "chatcmpl-broken", "choices": [ <truncated'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            else:
                status = int(failure.kind)
                record.status = status
                texts = {
                    500: ("Internal server error", "InternalServerError"),
                    503: ("Service Unavailable", "ServiceUnavailableError"),
                    429: ("Rate limit exceeded. Please retry after a short wait.", "rate_limit_error"),
                }
                message, type_ = texts[status]
                record.error = message
                headers = {"Retry-After": failure.retry_after} if status == 429 else None
                self._send_json(status, _nested(message, type_, status), headers)
            return True

        def _client_gone(self) -> bool:
            """Whether the client closed its end (a readable socket with nothing to read)."""
            try:
                readable, _, _ = select.select([self.connection], [], [], 0)
                return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
            except OSError:
                return True

        def _chat(self, body: dict[str, Any], record: RequestRecord, failure: _Failure | None = None) -> None:
            if server.response_delay:
                server._closing.wait(server.response_delay)
            cut = failure.after if failure is not None and failure.kind == "cut" else None
            overstate = failure.reported if failure is not None and failure.kind == "overstate" else None
            if failure is not None:
                record.failure = failure.kind
            try:
                status, payload, message = server._complete(body, record, overstate)
            except Exception as exc:  # a template that raises: vLLM answers 400 with the error text
                record.status, record.error = 400, f"{type(exc).__name__}: {exc}"
                server._record(record)
                self._send_json(400, _nested(str(exc), "BadRequestError", 400))
                return
            server._record(record)
            if status != 200:
                self._send_json(status, payload)
            elif body.get("stream"):
                include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                self._stream(payload, message, include_usage, record, cut)
            elif cut is not None:
                data = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data[: len(data) // 2])
                self._hang_up()
            else:
                self._send_json(200, payload)

        def _hang_up(self) -> None:
            """Drop the connection mid-response."""
            self.wfile.flush()
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)

        def _stream(
            self,
            response: dict[str, Any],
            message: dict[str, Any],
            include_usage: bool,
            record: RequestRecord,
            cut: int | None = None,
        ) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            marks, choice_marks = server._marks
            head = {k: response[k] for k in ("id", "created", "model")}
            head.update({k: v for k, v in marks.items() if k == "system_fingerprint"})
            events: list[tuple[bytes, str]] = []

            answers = len(response["choices"])

            def chunk(choices: list[dict[str, Any]], content: str = "", **extra: Any) -> None:
                # (each sequence of n gets the same deltas, under its own index)
                choices = [{**choice, "index": i} for choice in choices for i in range(answers)]
                for choice in choices:
                    choice.update(choice_marks)
                event = {**head, "object": "chat.completion.chunk", "choices": choices, **extra}
                events.append((f"data: {json.dumps(event)}\n\n".encode(), content))

            choice = response["choices"][0]
            chunk(
                [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
            )
            words = re.findall(r"\s*\S+\s*|\s+", message.get("content") or "")
            step = server.stream_chunk_words
            for i in range(0, len(words), step):
                delta = {"content": "".join(words[i : i + step])}
                chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}], delta["content"])
            for n, call in enumerate(message.get("tool_calls") or []):
                delta = {"tool_calls": [{"index": n, **call}]}
                chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}])
            chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]}])
            if include_usage:
                chunk([], usage=response["usage"])
            record.streamed = ""
            for number, (data, content) in enumerate(events):
                if cut is not None and number >= cut:
                    self._hang_up()
                    return
                if number and server.chunk_delay:
                    server._closing.wait(server.chunk_delay)
                self._write_chunk(data)
                record.streamed += content
            self._write_chunk(b"data: [DONE]\n\n")
            self._write_chunk(b"")

        def _write_chunk(self, data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

    return Handler
