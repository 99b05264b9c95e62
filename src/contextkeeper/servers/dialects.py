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
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from .._exceptions import ConfigurationError, InvalidMessage
from ..messages import Message

__all__ = ["DIALECTS", "Dialect", "PromptEnd", "dialect_of"]


@dataclass(frozen=True, kw_only=True)
class PromptEnd:
    """Text a server adds after the rendered prompt for one template family: ``append`` when a generation prompt
    is asked for, the template's source holds ``template_holds`` and the prompt ends with ``prompt_ends``."""

    template_holds: str
    prompt_ends: str
    append: str


@dataclass(frozen=True, kw_only=True)
class Dialect:
    """One server's preprocessing, as rules the counter applies (defaults: vLLM's)."""

    name: str
    description: str
    # "server": vLLM's message view (arguments parsed, content shaped for the template); "raw": as transformers'
    # apply_chat_template takes the messages.
    view: Literal["server", "raw"] = "server"
    roles: Mapping[str, str] = field(default_factory=dict)  # role renamed before templating (developer -> system)
    # ...unless the template holds this text, or any of these (llama.cpp keeps developer for gpt-oss; vLLM for a
    # template that names the role in quotes)
    roles_kept_when: str | tuple[str, ...] = ""
    # After a role was renamed to system, all system messages are merged into one first message, their texts
    # joined by a blank line (vLLM, for templates that want the system message first).
    merge_system: bool = False
    # "given": schemas as sent; "function-triple": {"type", "function": {name, description, parameters}} with
    # description "" and parameters {} filled in and every other key (strict, ...) dropped; "fields": vLLM's
    # request model dumped, {"type": "function", "function": {name, description, parameters[, strict]}} with a
    # missing description or parameters written as null and other keys dropped; "fields-client-order": SGLang's,
    # the client's key order kept, a missing description or parameters added as null after the client's keys,
    # and "defer_loading": null beside every function.
    tools: Literal["given", "function-triple", "fields", "fields-client-order"] = "given"
    # Content sent as a string stays a string even for templates that loop over content parts.
    string_content_stays: bool = False
    # What joins the text parts of content sent as a list where the server makes it one string (for templates
    # that take strings, and tool results): vLLM "\n", SGLang " ".
    flat_joiner: str = "\n"
    # "dropped": an empty tool_calls list is not passed on (vLLM); "kept": the template sees it (SGLang).
    empty_tool_calls: Literal["dropped", "kept"] = "dropped"
    # "python": numbers as Python reads and writes them; "llama.cpp": as nlohmann::json reads the request (an integer
    # in [2**63, 2**64) wraps to a negative int64, one beyond becomes a double, a non-finite number is refused) and
    # llama.cpp's Jinja engine writes them (``tojson``: floats through a C++ stream, six significant digits).
    json_numbers: Literal["python", "llama.cpp"] = "python"
    # "template": tokens as rendered; "runtime": a leading BOS the template wrote is cut and the tokenizer adds one
    # (net: +1 where the template writes none but the tokenizer adds BOS).
    bos: Literal["template", "runtime"] = "template"
    today: bool = False  # date_string ("01 Dec 2026") and datetime ("Dec 01 2026") passed to the template
    enable_thinking: bool | None = None  # passed to the template when not None
    unicode_normalization: bool = True  # the tokenizer's Unicode normal form (NFC for Qwen) applied to text
    ascii_trim: bool = False  # ``trim`` and ``str.strip()`` strip ASCII whitespace only (U+00A0, U+3000 stay)
    # How ``{{ value }}`` writes a value: "python" (str()) or "llama.cpp" (floats as C's %f without trailing zeros;
    # None, undefined values and mappings as nothing; a list as its items joined).
    jinja_values: Literal["python", "llama.cpp"] = "python"
    # "empty": tool-call arguments that are not JSON reach the template as {} (vLLM); "refuse": the server refuses
    # the request (llama.cpp), so the count raises InvalidMessage.
    invalid_arguments: Literal["empty", "refuse"] = "empty"
    # ...refused only for templates holding this text (llama.cpp parses arguments for templates that read tool
    # calls); "": for every template (transformers serve parses every call before templating).
    invalid_arguments_when: str = "tool_calls"
    # The only message keys the server passes on, in its order (empty: every key of the server view).
    message_keys: tuple[str, ...] = ()
    # Content made one string: the text of its parts of these types joined with this (None: shaped for the
    # template); other parts (refusal, thinking, media) are not text to such a server.
    content_joiner: str | None = None
    joined_part_types: tuple[str, ...] = ("text", "input_text", "output_text")
    # "kept": an assistant message's content goes with its tool calls; "empty": it is dropped for "" (the server
    # takes it for tool-call markup).
    tool_call_content: Literal["kept", "empty"] = "kept"
    prompt_ends: tuple[PromptEnd, ...] = ()  # what the server adds after the prompt of some template families
    # "answer": a final assistant message is closed and a generation prompt added; "continue": the prompt ends
    # right after that message's content (the server continues it); "user": a final assistant message with text
    # content is sent as a user message of that text, and answered (SGLang).
    final_assistant: Literal["answer", "continue", "user"] = "answer"
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
        if self.invalid_arguments == "refuse" and self.invalid_arguments_when in template:
            for index, call in enumerate(given.tool_calls or ()):
                arguments = call.function.arguments
                if isinstance(arguments, str) and not _is_json(arguments):
                    raise InvalidMessage(
                        f"tool call {index} ({call.function.name!r}) has arguments that are not JSON "
                        f"({arguments[:40]!r}); {self.name} refuses such a request. Fix: send the arguments as a "
                        "JSON object string, or count for another server (server=...)"
                    )
        if self.json_numbers == "llama.cpp":
            data = _int64_numbers(data)
        role = str(data.get("role"))
        if role in self.roles and not self._keeps_roles(template):
            data = {**data, "role": self.roles[role]}
        if self.empty_tool_calls == "kept" and given.tool_calls == [] and "tool_calls" not in data:
            data = {**data, "tool_calls": []}
        if self.flat_joiner != "\n" and isinstance(given.content, list) and isinstance(data.get("content"), str):
            data = {**data, "content": self._flat_content(given.content)}
        if self.tool_call_content == "empty" and given.tool_calls:
            data = {**data, "content": ""}
        elif self.content_joiner is not None:
            data = {**data, "content": self._joined_content(given)}
        if self.message_keys:
            data = {key: data[key] for key in self.message_keys if key in data}
        return data

    def _keeps_roles(self, template: str) -> bool:
        kept = self.roles_kept_when
        return any(text and text in template for text in ((kept,) if isinstance(kept, str) else kept))

    def _flat_content(self, parts: list[Any]) -> str:
        # SGLang's flattening: the text of "text" and "input_text" parts only.
        texts = (part.as_text() for part in parts if part.type in ("text", "input_text"))
        return self.flat_joiner.join(text for text in texts if text is not None)

    def prepare_conversation(
        self, plain: list[dict[str, Any]], given: Sequence[Message], template: str, add_generation_prompt: bool
    ) -> list[dict[str, Any]]:
        """The server's rules over the whole list of message dicts (``plain``, the dicts of ``given``): system
        messages merged, a final assistant message sent as a user's. ``plain`` itself when no rule applies;
        otherwise a new list (the dicts in it are not changed)."""
        renamed = self.merge_system and self.roles and not self._keeps_roles(template)
        if renamed and any(message.role in self.roles for message in given):
            plain = _merged_system(plain)
        if self.final_assistant == "user" and add_generation_prompt and plain:
            last = plain[-1]
            if last.get("role") == "assistant" and isinstance(last.get("content"), str):
                plain = [*plain[:-1], {"role": "user", "content": last["content"]}]
        return plain

    def _joined_content(self, given: Message) -> str:
        content = given.content
        if content is None or isinstance(content, str):
            return content or ""
        kinds = self.joined_part_types
        return str(self.content_joiner).join(
            text for part in content if part.type in kinds and (text := part.as_text()) is not None
        )

    def prepare_tools(self, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The tool schemas as the server hands them to the template."""
        if self.json_numbers == "llama.cpp":
            tools = _int64_numbers(tools)
        return self._shaped_tools(tools)

    def _shaped_tools(self, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self.tools == "given":
            return tools
        if self.tools == "fields":
            return [_fields_tool(tool) for tool in tools]
        if self.tools == "fields-client-order":
            return [_client_order_tool(tool) for tool in tools]
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


_INT64 = 2**63


def _int64_numbers(value: Any) -> Any:
    """``value`` with its numbers as nlohmann::json reads them and llama.cpp's engine takes them (``get<int64_t>``):
    an integer in [2**63, 2**64) wrapped to a negative int64, one further out a double; the same object when none
    changes. A number no double holds is refused, as the server refuses the request."""
    kind = type(value)
    if kind is int:
        if -_INT64 <= value < _INT64:
            return value
        if _INT64 <= value < 2 * _INT64:
            return value - 2 * _INT64
        try:
            return float(value)
        except OverflowError:
            raise InvalidMessage(
                f"a number of {len(str(value))} digits is beyond a double; llama.cpp refuses such a request "
                "(number overflow). Fix: send it as a string"
            ) from None
    if kind is float and not math.isfinite(value):
        raise InvalidMessage(
            f"{value} is not a JSON number; llama.cpp refuses such a request. Fix: send it as a string"
        )
    if kind is dict:
        items = {key: _int64_numbers(item) for key, item in value.items()}
        return value if all(items[key] is value[key] for key in value) else items
    if kind is list:
        listed = [_int64_numbers(item) for item in value]
        return value if all(a is b for a, b in zip(listed, value, strict=True)) else listed
    return value


def _merged_system(plain: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's merge: every system message's text (parts joined by a newline), the non-empty ones joined by a blank
    line, in one system message at the start; ``plain`` itself when the only system message is already first."""
    texts: list[str] = []
    rest: list[dict[str, Any]] = []
    merge = False
    for index, message in enumerate(plain):
        if message.get("role") != "system":
            rest.append(message)
            continue
        merge = merge or index > 0 or bool(texts)
        content = message.get("content", "")
        if isinstance(content, list):
            content = "\n".join(
                str(part["text"]) if isinstance(part, Mapping) else part
                for part in content
                if (isinstance(part, Mapping) and "text" in part) or isinstance(part, str)
            )
        if content:
            texts.append(str(content))
    return [{"role": "system", "content": "\n\n".join(texts)}, *rest] if merge else plain


def _function_of(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    function = tool.get("function")
    return function if isinstance(function, Mapping) else tool


def _fields_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    """A tool schema as vLLM's ChatCompletionToolsParam dumps it."""
    function = _function_of(tool)
    out: dict[str, Any] = {
        "name": function.get("name"),
        "description": function.get("description"),
        "parameters": function.get("parameters"),
    }
    if function.get("strict") is not None:
        out["strict"] = function["strict"]
    deferred = function.get("defer_loading", tool.get("defer_loading"))
    if deferred is not None:
        out["defer_loading"] = deferred
    dumped: dict[str, Any] = {"type": "function", "function": out}
    if tool.get("defer_loading") is not None:
        dumped["defer_loading"] = tool["defer_loading"]
    return dumped


def _client_order_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    """A tool schema as SGLang's Tool dumps it: the function's fields in the client's order (those it left out
    after them), and the tool's own defer_loading, null or not."""
    function = _function_of(tool)
    deferred = tool.get("defer_loading")
    fields: dict[str, Any] = {
        "description": function.get("description"),
        "name": function.get("name"),
        "parameters": function.get("parameters"),
        "strict": function.get("strict"),
        "defer_loading": deferred if function.get("defer_loading") is None else function["defer_loading"],
    }
    fields = {
        key: value for key, value in fields.items() if value is not None or key not in ("strict", "defer_loading")
    }
    order = [key for key in function if key in fields] + [key for key in fields if key not in function]
    return {
        "type": tool.get("type", "function"),
        "function": {key: fields[key] for key in order},
        "defer_loading": deferred,
    }


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


_VLLM = Dialect(
    name="vllm",
    description=(
        "vLLM's OpenAI server: tool-call arguments parsed, content shaped for the template, developer messages "
        "made system ones (merged into the first) for templates that do not name the role, tool schemas as its "
        "request model dumps them"
    ),
    roles={"developer": "system"},
    roles_kept_when=('"developer"', "'developer'"),
    merge_system=True,
    tools="fields",
    sources=(
        "vllm/renderers/chat_utils/chat_message.py: parse_chat_messages (arguments parsed, not JSON: {}; content "
        "shaped for the template's content format)",
        "vllm/renderers/hf.py: safe_apply_chat_template, _detect_developer_role_support, "
        "_convert_developer_to_system, _consolidate_system_messages (developer -> system, system messages merged)",
        "vllm/renderers/online_renderer.py: OnlineRenderer.render_chat (tool_dicts = [tool.model_dump() for tool in "
        "request.tools]); vllm/entrypoints/openai/chat_completion/protocol.py: ChatCompletionToolsParam, "
        "vllm/entrypoints/generate/base/protocol.py: FunctionDefinition (the dump: null description and "
        "parameters, strict only when set)",
        "vllm/renderers/base.py: BaseRenderer.default_chat_tok_params, "
        "ChatCompletionRequest.build_tok_params (add_special_tokens=False: the template's BOS only)",
    ),
)
_LLAMACPP = Dialect(
    name="llama.cpp",
    description="llama.cpp's llama-server with --jinja",
    roles={"developer": "system"},
    roles_kept_when="<|channel|>",
    tools="function-triple",
    string_content_stays=True,
    json_numbers="llama.cpp",
    ascii_trim=True,
    jinja_values="llama.cpp",
    # Gemma 4's template writes no model turn after an assistant message with content and tool calls; llama-server
    # opens one.
    prompt_ends=(PromptEnd(template_holds="'<|tool_call>call:'", prompt_ends="<turn|>\n", append="<|turn>model\n"),),
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
        "common/parsers/gemma4.cpp: common_chat_params_init_gemma4 (a model turn opened after a closed turn)",
        "common/jinja/string.cpp: string::strip, behind the trim filter and str.strip() (C isspace: ASCII only)",
        "common/jinja/runtime.h: gather_string_parts_recursive; value.h: value_float_t::as_string (what "
        "{{ value }} writes)",
        "common/jinja/value.cpp: from_json (integers as int64_t), tojson and value_to_json_internal (floats "
        "through a C++ stream; sort_keys refused)",
    ),
)

DIALECTS: dict[str, Dialect] = {
    dialect.name: dialect
    for dialect in (
        _VLLM,
        Dialect(
            name="sglang",
            description=(
                "SGLang's OpenAI server: arguments parsed (not JSON: refused), string content kept as a string, "
                "list content joined by spaces for templates that take strings, empty tool_calls kept, a final "
                "assistant message sent as a user one, tool schemas in the client's key order"
            ),
            string_content_stays=True,
            flat_joiner=" ",
            empty_tool_calls="kept",
            invalid_arguments="refuse",
            invalid_arguments_when="",
            final_assistant="user",
            tools="fields-client-order",
            sources=(
                "sglang/srt/entrypoints/openai/serving_chat.py: OpenAIServingChat._apply_jinja_template "
                "(normalize_assistant_tool_call_arguments, strict: arguments that are not a JSON object refused; "
                "content None made ''; normalize_tool_content joins a tool result's text parts with ' ')",
                "sglang/srt/entrypoints/openai/serving_chat.py: OpenAIServingChat._handle_last_assistant_message "
                "(continue_final_message false: a final assistant message with string content becomes "
                "{'role': 'user', 'content': ...})",
                "sglang/srt/parser/jinja_template_utils.py: process_content_for_template_format (a string stays a "
                "string; a list keeps its parts, or is joined with ' ' for a 'string' template; None values "
                "dropped, an empty tool_calls list kept)",
                "sglang/srt/entrypoints/openai/serving_chat.py: OpenAIServingChat._process_messages (tools = "
                "[item.model_dump() for item in request.tools]); sglang/srt/entrypoints/openai/protocol.py: "
                "Function._serialize (the client's key order), Tool (defer_loading dumped as null)",
                "sglang/srt/entrypoints/openai/serving_chat.py: OpenAIServingChat._render_and_encode_chat_template "
                "(apply_chat_template to text, then encoded without special tokens where the tokenizer adds them)",
            ),
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
            description=(
                "transformers serve (a text model): role, content, tool calls and tool_call_id only; content one "
                "string, its text parts joined with spaces, and empty beside tool calls; arguments parsed"
            ),
            message_keys=("role", "content", "tool_calls", "tool_call_id"),
            content_joiner=" ",
            tool_call_content="empty",
            invalid_arguments="refuse",
            invalid_arguments_when="",
            sources=(
                "transformers/cli/serving/utils.py: BaseHandler.get_processor_inputs_from_messages (the four keys; "
                "arguments parsed with json.loads, not JSON: 500; content ignored beside tool calls; text parts "
                "joined with ' ' for a text model; empty tool_calls dropped)",
                "transformers/cli/serving/chat_completion.py: ChatCompletionHandler.handle_request "
                "(apply_chat_template with the tools as sent and add_generation_prompt=True; usage.prompt_tokens is "
                "the length of its input_ids)",
            ),
        ),
        replace(
            _VLLM,
            name="openai",
            description="hosted OpenAI-compatible APIs: vLLM's preprocessing (their own counts are not published)",
            sources=(),
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
    auto = "; 'auto' is for ContextKeeper(server='auto'), which asks the server when it wraps a client"
    raise ConfigurationError(
        f"unknown server dialect {server!r}. Fix: server= one of {', '.join(DIALECTS)} (default vllm)"
        + (auto if key == "auto" else "")
    )
