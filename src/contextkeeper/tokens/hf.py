"""Exact prompt counts through a Hugging Face tokenizer and its Jinja chat template."""

from __future__ import annotations

import copy
import json
import logging
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import jinja2
import jinja2.meta
import jinja2.nodes

from .._exceptions import ChatTemplateError, ConfigurationError, CountingError
from .._memo import IdentityMemo, data_size, memoize, shared_prefix, shared_suffix
from ..messages import (
    ContentPart,
    Conversation,
    Message,
    check_text,
    check_tools,
    server_view_message,
    surrogate_at,
)
from ..servers.dialects import Dialect, dialect_of
from ._sandbox import (
    FROZEN_JSON,
    JINJA_RULES,
    JinjaRules,
    TemplateLimits,
    bounded,
    compile_template,
    limits_of,
    same_values,
)
from .base import Measurement, MessagesLike, ToolsLike
from .media import MediaCost, media_cost_for
from .pieces import PieceCounter
from .render import IncrementalRenderer, SplitTemplate, split_template

__all__ = ["HFChatTemplateCounter", "detect_content_format"]

logger = logging.getLogger("contextkeeper")

View = Literal["server", "raw"]
ContentFormat = Literal["auto", "string", "openai"]

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def detect_content_format(source: str) -> Literal["string", "openai"]:
    """``"openai"`` when the template loops over a message's ``content`` (it expects a list of parts), else
    ``"string"`` — the same decision vLLM's ``--chat-template-content-format auto`` makes."""
    try:
        ast = _parse(source)
    except jinja2.TemplateSyntaxError:
        return "string"
    for loop in ast.find_all(jinja2.nodes.For):
        node: jinja2.nodes.Node = loop.iter
        while isinstance(node, jinja2.nodes.Filter) and node.node is not None:
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


@memoize("hf.template_variables", sizer=lambda key, names: 2 * len(key[0]) + 64 * len(names) + 256)
def _template_variables(source: str) -> frozenset[str]:
    """Names a template reads from its context (``messages``, ``tools``, ``bos_token``, …); parsed once per
    source, as a counter's forks (a keeper's side counter, one per conversation) read the same template."""
    try:
        ast = _parse(source)
    except jinja2.TemplateSyntaxError:
        return frozenset({"tools"})  # unknown: assume it reads tools rather than claim it ignores them
    return frozenset(jinja2.meta.find_undeclared_variables(ast))


def _split_size(key: Any, split: Any) -> int:
    if not isinstance(split, SplitTemplate):
        return 64  # a template that cannot be split: its None remembered
    # The marked whole, head, body and tail, compiled: at most 107 bytes per source character over the templates
    # the tests fetch (see compile_template's estimate).
    return 128 * len(key[0]) + 128 * 1024


def _reasoning_tags(markers: str) -> tuple[str, str]:
    """An empty reasoning block cut into its opening and its closing: the opening ends at its first line break
    when that comes before the next tag ("<think>\n" + "\n</think>\n\n"), else at the next tag ("<think>" +
    "</think>"), as llama.cpp's reasoning markers read."""
    tag = markers.find("<", 1)
    line = markers.find("\n")
    cut = line + 1 if line != -1 and (tag == -1 or line < tag) else tag
    return (markers[:cut], markers[cut:]) if cut > 0 else (markers, "")


def _ends_with(segments: list[str], suffix: str) -> bool:
    """Whether the joined ``segments`` end with ``suffix`` (joining only the last few)."""
    tail = ""
    for segment in reversed(segments):
        tail = segment + tail
        if len(tail) >= len(suffix):
            break
    return tail.endswith(suffix)


def _starts_with(segments: list[str], prefix: str) -> bool:
    """Whether the joined ``segments`` start with ``prefix`` (joining only the first few: the first segments may
    be empty, as when a template writes its BOS inside the message loop)."""
    head = ""
    for segment in segments:
        head += segment
        if len(head) >= len(prefix):
            break
    return head.startswith(prefix)


@memoize("hf.split_templates", sizer=_split_size)
def _split(source: str, values: str = "python") -> SplitTemplate | None:
    """The template cut at its message loop (see ``split_template``), compiled once per source, engine and
    process, like the template itself: counters of the same template (a keeper's main and side counters) share
    it."""
    return split_template(compile_template(source, True, values), source)


def _parse(source: str) -> jinja2.nodes.Template:
    # The sandbox environment knows transformers' extra tags ({% generation %}), so parse with it.
    return compile_template(source).environment.parse(source)


def _compile(source: str, name: str) -> None:
    """Compile ``source`` now, so a template that does not compile is refused when the counter is built."""
    try:
        compile_template(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(
            f"the chat template of {name} does not compile: line {exc.lineno}: {str(exc.message).rstrip('.')}. Fix: "
            "correct the template, or pass another chat_template",
            template_message=str(exc),
        ) from exc
    except Exception as exc:  # the template's code: whatever Jinja or Python's compiler refuses in it
        raise ChatTemplateError(
            f"the chat template of {name} does not compile ({type(exc).__name__}: {exc}). Fix: correct the "
            "template, or pass another chat_template",
            template_message=f"{type(exc).__name__}: {exc}",
        ) from exc


def _view_size(message: Message, entry: tuple[dict[str, Any], list[ContentPart]]) -> int:
    # The message and its view, estimated from the message's fields without walking either (this runs for every
    # new message of a count): their objects, the text they share, and a tool call's parsed arguments (new
    # objects, about three times the JSON's length).
    view, media = entry
    size = 1536 + sum(sys.getsizeof(value) for value in view.values() if type(value) is str)
    content = view.get("content")
    if type(content) is list:
        size += data_size(content)
    for call in message.tool_calls or ():
        arguments = call.function.arguments
        size += 2048 + (3 * sys.getsizeof(arguments) if type(arguments) is str else 2 * data_size(arguments))
    return size + (data_size(media) if media else 0)


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    """What transformers hands the template for one message: None values dropped, reasoning aliased."""
    # The dicts come new from to_dict or the server view; copied only when a None must go.
    clean = (
        message if all(v is not None for v in message.values()) else {k: v for k, v in message.items() if v is not None}
    )
    reasoning = next((clean[k] for k in _REASONING_FIELDS if k in clean), None)
    if reasoning is not None:
        clean = {"thinking": reasoning, **clean, "reasoning_content": reasoning}
    return clean


def _adds_bos(tokenizer: Any) -> bool:
    bos, backend = getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "backend_tokenizer", None)
    if bos is None:
        return False
    if backend is not None:
        return list(backend.encode("a", add_special_tokens=True).ids[:1]) == [bos]
    return list(tokenizer.encode("a", add_special_tokens=True)[:1]) == [bos]


_UNICODE_FORMS = frozenset({"NFC", "NFD", "NFKC", "NFKD"})


def _without_unicode_forms(tokenizer: Any) -> Any:
    """A copy of ``tokenizer`` whose backend applies no Unicode normal form (servers such as llama.cpp apply
    none), or ``tokenizer`` itself when it applies none; the caller's tokenizer is not changed."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None:
        return tokenizer
    data = json.loads(backend.to_str())
    normalizer = data.get("normalizer")
    if not normalizer:
        return tokenizer
    if normalizer.get("type") in _UNICODE_FORMS:
        data["normalizer"] = None
    elif normalizer.get("type") == "Sequence":
        kept = [part for part in normalizer.get("normalizers", []) if part.get("type") not in _UNICODE_FORMS]
        if len(kept) == len(normalizer.get("normalizers", [])):
            return tokenizer
        data["normalizer"] = {"type": "Sequence", "normalizers": kept} if kept else None
    else:
        return tokenizer
    from tokenizers import Tokenizer  # only here: the embedded default runs without the hf extras

    clone = copy.copy(tokenizer)
    clone._tokenizer = Tokenizer.from_str(json.dumps(data))
    return clone


@dataclass(frozen=True)
class _LastPrompt:
    """A counter's previous render: its messages (compared by identity), tools, flag, segments and media."""

    messages: tuple[Message, ...]
    tools: list[dict[str, Any]] | None
    add_generation_prompt: bool
    second: int  # the clock's second when rendered, for templates that write the date (else 0)
    segments: tuple[str, ...]
    media: tuple[tuple[int, ContentPart], ...]


class _FrozenTools(list):  # type: ignore[type-arg]
    """A counter's deep copy of tool schemas; nothing ever changes it."""


class HFChatTemplateCounter:
    """Counts prompts exactly as an OpenAI-compatible server does with this tokenizer and template.

    ``count`` equals ``len(tokenizer.apply_chat_template(server_view(messages), tools=tools,
    add_generation_prompt=True, tokenize=True))``: the messages are first given the preprocessing vLLM applies
    (``view="server"``: JSON-string tool arguments parsed, empty ``tool_calls`` dropped, content shaped for the
    template's content format), or left as transformers takes them (``view="raw"``). The template renders in a
    sandbox; the rendered text is counted piece by piece between special tokens, with a cache, so a new turn
    costs its own text. Templates whose message loop provably depends only on each message's own window are
    rendered message by message with each output remembered (``incremental=False`` always renders whole).
    Every render is bounded by ``template_limits`` (steps, output, time, nesting; see :class:`TemplateLimits`).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        chat_template: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        view: View = "server",
        content_format: ContentFormat = "auto",
        media_cost: MediaCost | None = None,
        name: str | None = None,
        incremental: bool = True,
        template_limits: TemplateLimits | None = None,
        server: str | Dialect | None = None,
    ) -> None:
        if not callable(getattr(tokenizer, "encode", None)) or not hasattr(tokenizer, "special_tokens_map"):
            # A path here would fail only at the first count, deep in a render.
            raise ConfigurationError(
                f"HFChatTemplateCounter needs a loaded Hugging Face tokenizer, got {type(tokenizer).__name__} "
                f"{str(tokenizer)[:80]!r}. Fix: load_counter(path) or ContextKeeper(tokenizer=path) for a folder, "
                "file or hub id, or pass transformers.AutoTokenizer.from_pretrained(path)"
            )
        self.tokenizer = tokenizer
        self.template_limits = limits_of(template_limits)
        self.name = name or str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)
        source = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
        if not source:
            raise ChatTemplateError(
                f"tokenizer {self.name!r} has no chat template. Pass chat_template=<Jinja source> (Python) or "
                "--chat-template FILE (CLI), or use a tokenizer folder whose tokenizer_config.json or "
                "chat_template.jinja holds one."
            )
        self._templates: str | dict[str, str] = source
        self.template_kwargs = dict(template_kwargs or {})
        # The server whose preprocessing the count follows (vLLM's unless told); its view wins over ``view``.
        self.dialect = dialect_of(server)
        self.view: View = "raw" if self.dialect.view == "raw" else view
        self._jinja = JinjaRules(ascii_trim=self.dialect.ascii_trim, c_json=self.dialect.json_numbers == "llama.cpp")
        if not self.dialect.unicode_normalization:
            tokenizer = self.tokenizer = _without_unicode_forms(tokenizer)
        sources = [source] if isinstance(source, str) else list(source.values())
        self._template_text = "\n".join(sources)
        self._prompt_ends = tuple(end for end in self.dialect.prompt_ends if end.template_holds in self._template_text)
        for template_source in sources:
            _compile(template_source, self.name)
        self.content_format: Literal["string", "openai"] = (
            detect_content_format(self._template_text) if content_format == "auto" else content_format
        )
        self.media_cost = media_cost_for(self.name, media_cost)
        # Both decided from what the template reads, not from one rendering: a template may read tools only in
        # some conversations (say, when there is a system message), and then it does not ignore them.
        variables = frozenset().union(*(_template_variables(t) for t in sources))
        self.renders_date = bool({"strftime_now", "date_string", "datetime"} & variables)
        # Whether the tokenizer puts a BOS before text of its own accord (a runtime that cuts the template's BOS then
        # adds one). Asked of the backend: calling the tokenizer would reset the caller's padding and truncation.
        self._adds_bos = self.dialect.bos == "runtime" and _adds_bos(tokenizer)
        self.ignores_tools = "tools" not in variables
        self._warned_tools = False
        self._lock = threading.Lock()
        # Template-ready views by message identity; an entry holds its message, so the id stays unique.
        self._views: IdentityMemo[Message, tuple[dict[str, Any], list[ContentPart]]] = IdentityMemo(
            "hf.views", sizer=_view_size
        )
        self._last_view: tuple[tuple[Message, ...], list[dict[str, Any]], list[tuple[int, ContentPart]]] = ((), [], [])
        self._last_conversation: Conversation | None = None
        self._last_prompt: _LastPrompt | None = None
        self._tools: list[dict[str, Any]] | None = None
        self.incremental = incremental
        self._renderers: dict[str, IncrementalRenderer | None] = {}
        if incremental:
            for template_source in sources:
                _split(template_source, self.dialect.jinja_values)  # now, once per process, not on a first count
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._pieces = PieceCounter(backend) if backend is not None else None
        if self._pieces is not None:
            self._pieces.verify()
            if not self._pieces.fast:
                logger.info(
                    "contextkeeper: %s: piece-wise counting disagreed with the tokenizer; counting whole "
                    "prompts instead (exact, slower)",
                    self.name,
                )

    # -- the protocol ----------------------------------------------------------------------------------------
    def count(self, messages: MessagesLike, *, tools: ToolsLike = None, add_generation_prompt: bool = True) -> int:
        """Exact prompt tokens (text exact; non-text parts priced by ``media_cost``, see ``measure``)."""
        return self.measure(messages, tools=tools, add_generation_prompt=add_generation_prompt).tokens

    def measure(
        self, messages: MessagesLike, *, tools: ToolsLike = None, add_generation_prompt: bool = True
    ) -> Measurement:
        """Count ``messages`` and ``tools`` and say what the count is made of."""
        segments, media, tool_list = self._prompt(messages, tools, add_generation_prompt)
        notes: list[str] = []
        if tool_list and self.ignores_tools and not self._warned_tools:
            self._warned_tools = True
            logger.warning(
                "contextkeeper: the chat template of %s never reads `tools`: tool schemas cost 0 tokens in this "
                "template and the model never sees them; describe the tools in the system prompt instead",
                self.name,
            )
        if tool_list and self.ignores_tools:
            notes.append("the chat template ignores tools: they cost 0 tokens and the model does not see them")
        if self.renders_date:
            notes.append("the chat template renders today's date; the count is exact for today")
        text_tokens = self._count_segments(segments)
        media_tokens = self.media_cost.for_parts(media)
        if media:
            notes.append(f"{len(media)} non-text part(s) priced at {media_tokens} tokens by {self.media_cost.source}")
        return Measurement(
            tokens=text_tokens + media_tokens,
            text_tokens=text_tokens,
            media_tokens=media_tokens,
            media_parts=len(media),
            estimated=bool(media),
            notes=tuple(notes),
        )

    def bound(
        self, messages: MessagesLike, *, tools: ToolsLike = None, add_generation_prompt: bool = True
    ) -> int | None:
        """An upper bound on :meth:`count` found by rendering alone, without tokenizing: the prompt's UTF-8
        length, for tokenizers that make at most one token per byte (None for the others)."""
        if self._pieces is None:
            return None
        segments, media, _ = self._prompt(messages, tools, add_generation_prompt)
        most = self._pieces.bound_many(segments)
        return None if most is None else most + self.media_cost.for_parts(media)

    def _prompt(
        self, messages: MessagesLike, tools: ToolsLike, add_generation_prompt: bool
    ) -> tuple[list[str], list[tuple[int, ContentPart]], list[dict[str, Any]] | None]:
        """The rendered prompt (in segments, see ``IncrementalRenderer.render_segments``), the non-text parts and
        the counter's copy of the tools."""
        conversation = self._conversation(messages)
        tool_list = self._tool_list(tools)
        # A template that writes the date or time renders anew once the clock's second has moved on.
        second = int(time.time()) if self.renders_date else 0
        last = self._last_prompt
        if (
            last is not None
            and last.second == second
            and last.tools is tool_list
            and last.add_generation_prompt == add_generation_prompt
            and len(last.messages) == len(conversation.messages)
            and shared_prefix(conversation.messages, last.messages) == len(last.messages)
        ):
            # The same messages (by identity) and tools as the previous call: a fit counts its final prompt, then
            # takes that very prompt's text for its prefix report.
            return list(last.segments), list(last.media), tool_list
        plain, media = self._view(conversation)
        plain = self.dialect.prepare_conversation(
            plain, conversation.messages, self._template_text, add_generation_prompt
        )
        segments = self._server_segments(plain, tool_list, add_generation_prompt)
        self._last_prompt = _LastPrompt(
            conversation.messages, tool_list, add_generation_prompt, second, tuple(segments), tuple(media)
        )
        return segments, media, tool_list

    def _server_segments(
        self, plain: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool
    ) -> list[str]:
        """The rendered prompt as the dialect's server tokenizes it (continuation, BOS)."""
        dialect = self.dialect
        if (
            dialect.final_assistant == "continue"
            and add_generation_prompt
            and plain
            and plain[-1]["role"] == "assistant"
        ):
            segments = [self._continuation(plain, tools)]
        else:
            segments = self._render(plain, tools=tools, add_generation_prompt=add_generation_prompt)
            for end in self._prompt_ends if add_generation_prompt else ():
                if _ends_with(segments, end.prompt_ends):
                    segments = [*segments, end.append]
        if dialect.bos == "runtime" and self._adds_bos:
            bos = str(self.tokenizer.bos_token)
            # The server cuts a BOS the template wrote at the very start of the prompt and its tokenizer adds one:
            # one BOS either way. A BOS written later is kept, and the tokenizer's comes before it.
            if not _starts_with(segments, bos):
                segments = [bos, *segments]
        return segments

    def _continuation(self, plain: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        """The prompt of a server that continues the final assistant message, as llama.cpp builds it: the earlier
        messages without a generation prompt, then what a generation prompt adds to them (the text after the
        two renders' common prefix, which for some templates starts inside a special token, as the server's
        does), the reasoning block a thinking template writes (empty when the message has no
        ``reasoning_content``; left open when it has reasoning and no content, which the server then continues),
        and the content."""
        head = plain[:-1]
        closed, added = self._generation_prompt(head, tools, None)
        markers = ""
        if "enable_thinking" in self._template_text:
            _, added_off = self._generation_prompt(head, tools, {"enable_thinking": False})
            markers = added_off[len(added) :] if added_off.startswith(added) else ""
        content = plain[-1].get("content")
        text = (
            content
            if isinstance(content, str)
            else "".join(part.get("text", "") for part in content or () if isinstance(part, dict))
        )
        reasoning = plain[-1].get("reasoning_content")
        if markers and isinstance(reasoning, str) and reasoning:
            opening, closing = _reasoning_tags(markers)
            if not content:  # only reasoning: the server continues it, inside the open block
                return closed + added + opening + reasoning
            return closed + added + opening + reasoning + closing + text
        return closed + added + markers + text

    def _generation_prompt(
        self, plain: list[dict[str, Any]], tools: list[dict[str, Any]] | None, extra: Mapping[str, Any] | None
    ) -> tuple[str, str]:
        """The prompt without a generation prompt, and the text after its common prefix with the prompt with one."""
        closed = "".join(self._render(plain, tools=tools, add_generation_prompt=False, extra=extra))
        opened = "".join(self._render(plain, tools=tools, add_generation_prompt=True, extra=extra))
        common = next((i for i, (a, b) in enumerate(zip(closed, opened, strict=False)) if a != b), None)
        return closed, opened[min(len(closed), len(opened)) if common is None else common :]

    # -- pieces ----------------------------------------------------------------------------------------------
    def freeze_tools(self, tools: ToolsLike) -> list[dict[str, Any]] | None:
        """The counter's own copy of ``tools``, which every counter of this class takes as is: a caller that
        counts the same tools many times (the keeper, in one fit) compares them with the previous call's once."""
        return self._tool_list(tools)

    def _tool_list(self, tools: ToolsLike) -> list[dict[str, Any]] | None:
        """Our own deep copy of the tool schemas: the same objects while the caller's tools stay the same, so the
        template's ``tojson`` of them is computed once (see ``FrozenJSON``)."""
        if not tools:
            return None
        if type(tools) is _FrozenTools:
            return tools  # made by a counter from a deep copy, and never handed to the caller
        if not all(isinstance(t, Mapping) for t in tools):
            check_tools(tools)  # says which schema is not an object
        given = [dict(t) for t in tools]
        with self._lock:
            last = self._tools
            # Order- and type-true: schemas with their keys in another order render (and count) differently.
            if last is not None and len(given) == len(last) and all(map(same_values, given, last)):
                return last
            check_tools(given)
            mine = _FrozenTools(self.dialect.prepare_tools(copy.deepcopy(given)))
            FROZEN_JSON.register(mine)
            if last is not None:
                FROZEN_JSON.unregister(last)
            self._tools = mine
            return mine

    def _conversation(self, messages: MessagesLike) -> Conversation:
        """Validate, re-validating only what is new since the previous call (a chat that grew)."""
        if isinstance(messages, Conversation):
            return messages
        conversation = Conversation.from_messages(messages, previous=self._last_conversation)
        self._last_conversation = conversation
        return conversation

    def _view(self, conversation: Conversation) -> tuple[list[dict[str, Any]], list[tuple[int, ContentPart]]]:
        """Template-ready dicts for each message, from a per-message cache (messages are immutable)."""
        plain: list[dict[str, Any]] = []
        media: list[tuple[int, ContentPart]] = []
        cache = self._views
        messages = conversation.messages
        last_messages, last_plain, last_media = self._last_view
        start = 0
        # A conversation that grew shares its validated Message objects with the previous call: take their views
        # in one step instead of one cache look-up per message. Identity, not equality: Message(n=1) equals
        # Message(n=True), yet their views render differently.
        stop = len(messages)
        if shared_prefix(messages, last_messages) == len(last_messages):
            start = len(last_messages)
            plain = list(last_plain)
            media = list(last_media)
        elif last_messages:
            # A window that dropped its oldest messages ends with the previous call's: take those views whole too.
            stop -= shared_suffix(messages, last_messages)
        new: list[tuple[Message, tuple[dict[str, Any], list[ContentPart]]]] = []
        for index, entry in enumerate(cache.get_many(messages[start:stop]), start):
            if entry is None:
                message = messages[index]
                entry = self._view_one(message)
                new.append((message, entry))
            plain.append(entry[0])
            if entry[1]:
                media.extend((index, part) for part in entry[1])
        if new:
            cache.put_many(new)
        if stop < len(messages):
            shift = len(messages) - len(last_messages)
            plain.extend(last_plain[stop - shift :])
            media.extend((index + shift, part) for index, part in last_media if index >= stop - shift)
        self._last_view = (messages, plain, media)
        return plain, media

    def _view_one(self, message: Message) -> tuple[dict[str, Any], list[ContentPart]]:
        if self.view == "raw":
            return _template_message(message.to_dict()), []
        content_format = self.content_format
        if self.dialect.string_content_stays and type(message.content) is str:
            content_format = "string"
        data, media = server_view_message(message, content_format=content_format)
        return _template_message(self.dialect.prepare_message(data, message, self._template_text)), media

    def template_for(self, tools: Sequence[Any] | None) -> str:
        """The template source used for this call (a named ``tool_use`` template when tools are given)."""
        templates = self._templates
        if isinstance(templates, str):
            return templates
        if tools and "tool_use" in templates:
            return templates["tool_use"]
        if "default" in templates:
            return templates["default"]
        raise ChatTemplateError(
            f"tokenizer {self.name!r} has named chat templates {sorted(templates)} but no 'default'; pass "
            "chat_template=<one of them>."
        )

    def render_view(
        self, plain: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None, add_generation_prompt: bool
    ) -> str:
        """Render already-preprocessed message dicts with the template, in the sandbox."""
        return "".join(self._render(plain, tools=tools, add_generation_prompt=add_generation_prompt))

    def _render(
        self,
        plain: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        extra: Mapping[str, Any] | None = None,
    ) -> list[str]:
        source = self.template_for(tools)
        template = compile_template(source, True, self.dialect.jinja_values)
        context = {
            **self.tokenizer.special_tokens_map,
            **self.dialect.template_context(),
            **self.template_kwargs,
            **(extra or {}),
            "messages": plain,
            "tools": tools,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        if source not in self._renderers:
            split = _split(source, self.dialect.jinja_values) if self.incremental else None
            self._renderers[source] = IncrementalRenderer(split) if split is not None else None
        renderer = self._renderers[source]
        rules = JINJA_RULES.set(self._jinja)
        try:
            with bounded(self.template_limits):
                if renderer is not None:
                    return renderer.render_segments(context)
                return [template.render(context)]
        except CountingError:
            raise  # a bound the sandbox enforced, or a refusal it worded: already clear
        except jinja2.TemplateError as exc:
            rejected = ChatTemplateError(
                f"the chat template of {self.name} rejected these messages: {str(exc).rstrip('.!')}. This model's "
                "template does not accept this conversation shape; change the messages (for example merge system "
                "messages or alternate user/assistant), or pass another chat_template.",
                template_message=str(exc),
            )
            # What fix_text() gives, as the message words it without a "Fix:" marker.
            rejected.fix = (
                "change the messages (for example merge system messages or alternate user/assistant), or pass "
                "another chat_template"
            )
            raise rejected from exc
        except RecursionError as exc:
            raise ChatTemplateError(
                f"the chat template of {self.name} recursed deeper than Python's stack allows. Fix: lower "
                f"template_limits.nesting (now {self.template_limits.nesting}) so it is stopped sooner, or use "
                "another template.",
                template_message=f"{type(exc).__name__}: {exc}",
            ) from exc
        except (TypeError, LookupError, AttributeError, ValueError, ArithmeticError, MemoryError) as exc:
            raise ChatTemplateError(
                f"the chat template of {self.name} failed on these messages ({type(exc).__name__}: {exc}). "
                "It expects another message shape; check optional fields such as content=None or tool_calls.",
                template_message=f"{type(exc).__name__}: {exc}",
            ) from exc
        finally:
            JINJA_RULES.reset(rules)

    def render(self, messages: MessagesLike, *, tools: ToolsLike = None, add_generation_prompt: bool = True) -> str:
        """The prompt text the template produces for ``messages`` (after the configured preprocessing)."""
        text = "".join(self._prompt(messages, tools, add_generation_prompt)[0])
        bos = self.tokenizer.bos_token
        if self.dialect.bos == "runtime" and bos and text.startswith(bos):
            return text[len(bos) :]  # the server's text: its tokenizer adds the BOS
        return text

    def count_text(self, text: str) -> int:
        """Tokens of an already-rendered prompt, no special tokens added."""
        check_text(text)
        return self._count_text(text)

    def _count_text(self, text: str) -> int:
        if self._pieces is None:
            return len(self.tokenizer.encode(text, add_special_tokens=False))
        with self._lock:
            return self._pieces.count(text)

    def _count_segments(self, segments: list[str]) -> int:
        """Tokens of the prompt ``"".join(segments)``."""
        try:
            if self._pieces is None or len(segments) == 1:
                return self._count_text("".join(segments))
            with self._lock:
                return self._pieces.count_segments(segments)
        except (TypeError, UnicodeError) as exc:
            # Messages and tools are checked for lone surrogates when they come in: the template wrote this one.
            for segment in segments:
                position = surrogate_at(segment)
                if position is not None:
                    raise ChatTemplateError(
                        f"the chat template of {self.name} wrote a lone surrogate {segment[position]!r} (not valid "
                        "Unicode), which no tokenizer or server can encode. Fix: use another template.",
                        template_message=str(exc),
                    ) from exc
            raise

    def fork(self) -> HFChatTemplateCounter:
        """A counter with the same tokenizer and settings and incremental state of its own, for counts that should
        not disturb this one's (small side counts between counts of one long, growing prompt; one conversation
        of many). The two share their cache of token counts by piece text, so text either one counted is not
        tokenized again, and their template-ready views. Nothing is compiled or verified again."""
        clone = copy.copy(self)
        clone._lock = threading.Lock()
        clone._last_view = ((), [], [])
        clone._last_conversation = None
        clone._last_prompt = None
        clone._tools = None
        clone._renderers = {}
        if self._pieces is not None:
            clone._pieces = self._pieces.fork()
        return clone

    def forget(self) -> None:
        """Drop the last prompt's incremental state (its views, render and resume point); caches stay."""
        with self._lock:
            self._last_view = ((), [], [])
            self._last_conversation = None
            self._last_prompt = None
            self._renderers = {}
            if self._pieces is not None:
                self._pieces.forget()

    def text_tokens(self, text: str) -> int:
        """Tokens of a snippet on its own (no template, no special tokens), cached by text."""
        check_text(text)
        if self._pieces is None:
            return len(self.tokenizer.encode(text, add_special_tokens=False))
        with self._lock:
            return self._pieces.alone(text)

    def text_tokens_bound(self, text: str) -> int | None:
        """An upper bound on :meth:`text_tokens` found without tokenizing, or None when none is known."""
        return self._pieces.bound(text) if self._pieces is not None else None

    def text_tokens_many(self, texts: Sequence[str]) -> list[int]:
        """:meth:`text_tokens` of each text, the uncached ones tokenized in one batch."""
        for text in texts:
            check_text(text)
        if self._pieces is None:
            return [self.text_tokens(text) for text in texts]
        with self._lock:
            return self._pieces.alone_many(list(texts))

    @property
    def encoded_chars(self) -> int:
        """Characters handed to the tokenizer so far (under the pre-token rule, those of new pre-tokens); cached
        pieces cost nothing here."""
        return self._pieces.encoded_chars if self._pieces is not None else 0

    @property
    def piece_counting(self) -> bool:
        """Whether counts use the cached piece rule (verified for this tokenizer) or whole-text encoding."""
        return self._pieces is not None and self._pieces.fast

    # -- reference -------------------------------------------------------------------------------------------
    def reference_count(
        self, messages: MessagesLike, *, tools: ToolsLike = None, add_generation_prompt: bool = True
    ) -> int:
        """The slow, obvious count through ``tokenizer.apply_chat_template`` (for tests and audits) of the vLLM
        view. A dialect's own rules (its server's Jinja engine, continuation, BOS) are checked against recordings
        of that server instead (tests/servers/test_dialects.py), and its fast path against ``incremental=False``."""
        conversation = messages if isinstance(messages, Conversation) else Conversation.from_messages(messages)
        plain, media = self._view(conversation)
        plain = self.dialect.prepare_conversation(
            plain, conversation.messages, self._template_text, add_generation_prompt
        )
        ids = self.tokenizer.apply_chat_template(
            plain,
            tools=self.dialect.prepare_tools(copy.deepcopy([dict(t) for t in tools])) if tools else None,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=False,
            chat_template=self.template_for(tools),
            **self.template_kwargs,
        )
        return len(ids) + self.media_cost.for_parts(media)
