"""Server dialects: how each server prepares a chat request before its chat template sees it.

A count is exact only for one server's preprocessing. vLLM (the default) parses tool-call arguments and shapes
content for the template; llama.cpp's server also maps roles, rewrites tool schemas, strips a leading BOS the
template wrote (its tokenizer adds one), passes today's date and ``enable_thinking``, and continues a final
assistant message instead of answering it. Each dialect is one data-like :class:`Dialect` in :data:`DIALECTS`;
the counter reads its fields at the few points where servers differ (docs/dialects.md lists every rule with the
server source it comes from, and which rules are checked against recordings of a real server).
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from ._exceptions import ConfigurationError, InvalidMessage
from .messages import Message

__all__ = ["DIALECTS", "Dialect", "dialect_of"]


@dataclass(frozen=True, kw_only=True)
class Dialect:
    """One server's preprocessing, as rules the counter applies (defaults: vLLM's)."""

    name: str
    description: str
    # "server": vLLM's message view (arguments parsed, content shaped for the template); "raw": as transformers'
    # apply_chat_template takes the messages.
    view: Literal["server", "raw"] = "server"
    roles: Mapping[str, str] = field(default_factory=dict)  # role renamed before templating (developer -> system)
    roles_kept_when: str = ""  # ...unless the template holds this text (llama.cpp keeps developer for gpt-oss)
    # "given": schemas as sent; "function-triple": {"type", "function": {name, description, parameters}} with
    # description "" and parameters {} filled in and every other key (strict, ...) dropped.
    tools: Literal["given", "function-triple"] = "given"
    # Content sent as a string stays a string even for templates that loop over content parts.
    string_content_stays: bool = False
    json_whole_floats: bool = False  # the template's ``tojson`` writes 1.0 as 1 (nlohmann::json's dump)
    # "template": tokens as rendered; "runtime": a leading BOS the template wrote is cut and the tokenizer adds one
    # (net: +1 where the template writes none but the tokenizer adds BOS).
    bos: Literal["template", "runtime"] = "template"
    today: bool = False  # date_string ("01 Dec 2026") and datetime ("Dec 01 2026") passed to the template
    enable_thinking: bool | None = None  # passed to the template when not None
    unicode_normalization: bool = True  # the tokenizer's Unicode normal form (NFC for Qwen) applied to text
    ascii_trim: bool = False  # the template's ``trim`` filter strips ASCII whitespace only (U+00A0, U+3000 stay)
    # "empty": tool-call arguments that are not JSON reach the template as {} (vLLM); "refuse": the server refuses
    # the request (llama.cpp), so the count raises InvalidMessage.
    invalid_arguments: Literal["empty", "refuse"] = "empty"
    # "answer": a final assistant message is closed and a generation prompt added; "continue": the prompt ends
    # right after that message's content (the server continues it).
    final_assistant: Literal["answer", "continue"] = "answer"
    sources: tuple[str, ...] = ()  # where the rules come from in the server's source

    def template_context(self, now: dt.datetime | None = None) -> dict[str, Any]:
        """Variables the server adds to the template's context."""
        context: dict[str, Any] = {}
        if self.today:
            moment = now or dt.datetime.now()
            context["date_string"] = moment.strftime("%d %b %Y")
            context["datetime"] = moment.strftime("%b %d %Y")
        if self.enable_thinking is not None:
            context["enable_thinking"] = self.enable_thinking
        return context

    def prepare_message(self, data: dict[str, Any], given: Message, template: str) -> dict[str, Any]:
        """The server's dict for message ``given``, from its vLLM view ``data`` (a new dict; neither changes)."""
        # llama.cpp parses arguments only for templates that take them as objects (its caps probe); one that
        # never reads tool calls takes the request as it is.
        if self.invalid_arguments == "refuse" and "tool_calls" in template:
            for index, call in enumerate(given.tool_calls or ()):
                arguments = call.function.arguments
                if isinstance(arguments, str) and not _is_json(arguments):
                    raise InvalidMessage(
                        f"tool call {index} ({call.function.name!r}) has arguments that are not JSON "
                        f"({arguments[:40]!r}); {self.name} refuses such a request. Fix: send the arguments as a "
                        "JSON object string, or count for another server (server=...)"
                    )
        role = str(data.get("role"))
        if role in self.roles and not (self.roles_kept_when and self.roles_kept_when in template):
            data = {**data, "role": self.roles[role]}
        return data

    def prepare_tools(self, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The tool schemas as the server hands them to the template."""
        if self.tools == "given":
            return tools
        out = []
        for tool in tools:
            function = tool["function"] if isinstance(tool.get("function"), Mapping) else tool
            out.append(
                {
                    "type": "function",
                    "function": {
                        "name": function.get("name"),
                        "description": function.get("description", ""),
                        "parameters": function.get("parameters", {}),
                    },
                }
            )
        return out


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


_VLLM = Dialect(
    name="vllm",
    description="vLLM's OpenAI server: tool-call arguments parsed, content shaped for the template",
    sources=("vllm/entrypoints/chat_utils.py: parse_chat_messages, _postprocess_messages",),
)
_LLAMACPP = Dialect(
    name="llama.cpp",
    description="llama.cpp's llama-server with --jinja",
    roles={"developer": "system"},
    roles_kept_when="<|channel|>",
    tools="function-triple",
    string_content_stays=True,
    json_whole_floats=True,
    ascii_trim=True,
    unicode_normalization=False,
    invalid_arguments="refuse",
    bos="runtime",
    today=True,
    enable_thinking=True,
    final_assistant="continue",
    sources=(
        "common/chat.cpp: workaround::map_developer_role_to_system (developer -> system, not for gpt-oss)",
        "common/chat.cpp: common_chat_tools_parse_oaicompat / common_chat_tools_to_json_oaicompat (tool triple)",
        "common/chat.cpp: common_chat_template_direct_apply_impl (leading BOS cut; enable_thinking passed)",
        "common/chat.cpp: common_chat_extra_context (date_string, datetime)",
        "common/chat.cpp: common_chat_templates_apply_jinja (continue_final_message: the final assistant message "
        "continued); tools/server/server-common.cpp: oaicompat_chat_params_parse (prefill_assistant)",
        "common/chat.cpp: workaround::func_args_not_string (arguments parsed with nlohmann::json; not JSON: refused)",
        "src/llama-vocab.cpp: llama_vocab::tokenize (no Unicode normalisation of the text)",
        "common/jinja/runtime.cpp: the trim filter (C isspace: ASCII whitespace only)",
    ),
)

DIALECTS: dict[str, Dialect] = {
    dialect.name: dialect
    for dialect in (
        _VLLM,
        Dialect(
            name="sglang",
            description="SGLang's OpenAI server: the same message preprocessing as vLLM for chat templates",
            sources=("python/sglang/srt/entrypoints/openai/serving_chat.py: _apply_jinja_template",),
        ),
        _LLAMACPP,
        replace(
            _LLAMACPP,
            name="lmstudio",
            description="LM Studio (llama.cpp's engine and template handling underneath)",
        ),
        replace(
            _LLAMACPP,
            name="ollama",
            description=(
                "Ollama: llama.cpp's engine and tokenizer; Ollama renders its own Go templates, so these are "
                "llama.cpp's rules for the Jinja template you give (not verified against Ollama)"
            ),
        ),
        Dialect(
            name="transformers",
            description="transformers' apply_chat_template on the messages as given (transformers serve)",
            view="raw",
            sources=("transformers/utils/chat_template_utils.py: render_jinja_template",),
        ),
        Dialect(
            name="openai",
            description="hosted OpenAI-compatible APIs: vLLM's preprocessing (their own counts are not published)",
        ),
    )
}


def dialect_of(server: str | Dialect | None) -> Dialect:
    """The dialect named ``server`` (None: vLLM's); a clear error for an unknown name."""
    if server is None:
        return _VLLM
    if isinstance(server, Dialect):
        return server
    key = str(server).strip().lower().replace("llamacpp", "llama.cpp").replace("llama-cpp", "llama.cpp")
    if key in DIALECTS:
        return DIALECTS[key]
    raise ConfigurationError(
        f"unknown server dialect {server!r}. Fix: server= one of {', '.join(DIALECTS)} (default vllm)"
    )
