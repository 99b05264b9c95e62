"""Exact prompt counts with mistral-common, the encoder vLLM uses for Mistral models."""

from __future__ import annotations

import copy
import json
import logging
import sys
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._exceptions import ChatTemplateError, TokenizerNotFound
from .._memo import IdentityMemo, Memo, memoize
from ..messages import ContentPart, Conversation, Message, check_text, check_tools, server_view, server_view_message
from .base import Measurement, MessagesLike, ToolsLike
from .media import MediaCost, media_cost_for

__all__ = ["MistralCounter", "load_mistral_tokenizer", "mistral_tokenizer_names"]

logger = logging.getLogger("contextkeeper")

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


def _short_ids(message: dict[str, Any]) -> dict[str, Any]:
    """vLLM keeps the last 9 characters of tool-call ids for Mistral tokenizers (changes the new dict in place)."""
    for call in message.get("tool_calls", ()):
        if isinstance(call.get("id"), str):
            call["id"] = call["id"][-9:]
    if isinstance(message.get("tool_call_id"), str):
        message["tool_call_id"] = message["tool_call_id"][-9:]
    return message


def _tekken_bpe(raw: Any) -> Any:
    """The tiktoken model under a Tekken tokenizer whose ``encode`` is mistral-common's own (tiktoken's ids, each
    shifted past the special tokens with a property read per token); None for any other tokenizer."""
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    return raw._model if type(raw).encode is Tekkenizer.encode else None


def _counting_twin(instruct: Any) -> Any:
    """mistral-common's instruct tokenizer, copied, with a Tekken ``encode`` that gives the same ids faster: the
    library's adds the special tokens' offset to each id through a property read per token (as long as the BPE
    itself). Other tokenizers come back as they are."""
    raw = instruct.tokenizer
    model = _tekken_bpe(raw)
    if model is None:
        return instruct
    offset, bos_id, eos_id = raw.num_special_tokens, raw.bos_id, raw.eos_id

    def encode(s: str, bos: bool, eos: bool) -> list[int]:
        tokens = [t + offset for t in model.encode(s)]
        if bos:
            tokens.insert(0, bos_id)
        if eos:
            tokens.append(eos_id)
        return tokens

    fast = copy.copy(raw)
    fast.encode = encode
    twin = copy.copy(instruct)
    twin.tokenizer = fast
    return twin


@dataclass(eq=False)
class _Read:
    """One message as mistral-common reads it, made once per message: the converted message, its normalised form
    where it stands alone in its run of one role, the parts priced apart, and its tokens by position."""

    converted: Any
    normalized: Any  # None until first needed
    media: list[ContentPart]
    role: str
    weight: Any  # training weight (finetuning messages only): neighbours of one role and weight are joined
    tokens: dict[Any, int] = field(default_factory=dict)
    checked: set[tuple[bool, bool]] = field(default_factory=set)  # (last message, training mode) it passed in


def _read_size(message: Message, read: _Read) -> int:
    # The message itself is the caller's; the converted copies share nothing with it: about three times its text.
    content = message.content
    text = len(content) if type(content) is str else 256
    return 2048 + 3 * text + 96 * len(read.tokens)


@dataclass(frozen=True, eq=False)
class _Setting:
    """What a request gives every user message besides its own content: the tools, the system prompt that
    mistral-common folds into a user message (tokenizers before v7) and the model settings."""

    serial: int
    tools: Any
    system_prompt: str | None
    settings: Any


_USER, _ASSISTANT, _TOOL, _SYSTEM = "user", "assistant", "tool", "system"


def _normalized(reads: list[_Read], normalizer: Any) -> tuple[list[Any], list[_Read | None], list[str]]:
    """The messages mistral-common's normaliser makes of ``reads``, each with its role and the read it stands for
    alone (None for a joined run, and for the empty user message put first where the list needs one)."""
    from mistral_common.protocol.instruct.messages import UserMessage

    # The normaliser's runs: neighbours of one role (and one training weight) become one message, tool results
    # stay one each, system messages leave the list (before v7) or stay as they are.
    messages: list[Any] = []
    owners: list[_Read | None] = []
    roles: list[str] = []
    i, n = 0, len(reads)
    while i < n:
        role, weight = reads[i].role, reads[i].weight
        j = i + 1
        while j < n and reads[j].role == role and reads[j].weight == weight:
            j += 1
        if role == _TOOL or (j - i == 1 and role != _SYSTEM):
            for read in reads[i:j]:
                if read.normalized is None:  # made after the validation, which speaks first
                    (read.normalized,) = normalizer._aggregate_role([read.converted], role, [])
                messages.append(read.normalized)
                owners.append(read)
                roles.append(role)
        else:
            joined = normalizer._aggregate_role([r.converted for r in reads[i:j]], role, [])
            messages.extend(joined)
            owners.extend([None] * len(joined))
            roles.extend(m.role for m in joined)
        i = j
    if not messages or (not getattr(normalizer, "_system_prompt_in_begin", False) and roles[0] != _USER):
        messages.insert(0, UserMessage(content=""))
        owners.insert(0, None)
        roles.insert(0, _USER)
    return messages, owners, roles


def _validate_tool_results(instruct: Any, normalizer: Any, messages: list[Any], setting: _Setting) -> None:
    """The instruct tokenizer's check of tool results against their calls, where its version has one."""
    checks = getattr(instruct, "_validate_tool_results", None)
    if checks is not None:
        checks(
            request=normalizer._instruct_request_class.model_construct(
                messages=messages, system_prompt=setting.system_prompt, available_tools=setting.tools
            )
        )


def _encoded_length(instruct: Any, message: Any, role: str, k: int, first: int, last: int, setting: _Setting) -> int:
    """Tokens of the normalised message at position ``k`` (``first`` and ``last``: the user messages' ends)."""
    if role == _USER:
        encoded = instruct.encode_user_message(
            message,
            setting.tools,
            k == last,
            k == first,
            system_prompt=setting.system_prompt,
            force_img_first=True,
            settings=setting.settings,
        )[0]
    elif role == _TOOL:
        encoded = instruct.encode_tool_message(message, k < last)[0]
    elif role == _ASSISTANT:
        encoded = instruct.encode_assistant_message(message=message, is_before_last_user_message=k < last)
    else:
        encoded = instruct.encode_system_message(message)[0]
    return len(encoded or ())


class MistralCounter:
    """Counts with mistral-common's own chat encoder (``encode_chat_completion``).

    This is the reference for Mistral models: vLLM's ``--tokenizer-mode mistral`` encodes requests with it.
    Tool-call ids are shortened to their last 9 characters first, as vLLM does for Mistral tokenizers.
    mistral-common has no separate generation prompt: a conversation ending on a user or tool turn is encoded
    for serving (ending in ``[/INST]`` or the tool results), one ending on an assistant turn as a finished
    exchange; ``add_generation_prompt`` is accepted for the protocol and does not change the count.

    Counts are incremental: each message is converted, normalised and encoded by mistral-common once per position
    it can take (last user message or not, before the last user message or after it), and a count adds up the
    messages' tokens as ``encode_chat_completion`` does, after the same validation of the whole request. The
    whole-request encode (``incremental=False``) stays as the reference; a probe conversation checks the two
    agree when the counter is made, and the incremental path is switched off where they do not.
    """

    def __init__(self, name: str, *, media_cost: MediaCost | None = None, incremental: bool = True) -> None:
        self.name = f"mistral:{name}"
        self._serving = load_mistral_tokenizer(name)
        self._finetuning: Any = None
        self._spec = name
        self.media_cost = media_cost_for(self.name, media_cost)
        self._lock = threading.Lock()
        self._reads: IdentityMemo[Message, _Read] = IdentityMemo("mistral.messages", sizer=_read_size)
        self._settings: Memo[str, _Setting] = Memo(
            "mistral.settings", sizer=lambda key, value: 1024 + 2 * sys.getsizeof(key)
        )
        self._serials = 0
        from mistral_common.protocol.instruct.validator import MistralRequestValidator

        # Content is checked once per message only where the validator checks it message by message.
        validator = type(self._serving._chat_completion_request_validator)
        self._checks_each = (
            validator.validate_messages is MistralRequestValidator.validate_messages
            and validator._validate_message_list_content is MistralRequestValidator._validate_message_list_content
        )
        self._instruct = _counting_twin(self._serving.instruct_tokenizer)
        self.incremental = incremental and self._agrees()
        # Tekken's encode is tiktoken's plus one Python addition per token: snippets are counted on tiktoken's ids.
        self._bpe: Any = _tekken_bpe(self._serving.instruct_tokenizer.tokenizer)

    @property
    def tokenizer(self) -> Any:
        """The mistral-common ``MistralTokenizer`` used for serving-mode encodes."""
        return self._serving

    def text_tokens(self, text: str) -> int:
        """Tokens of a snippet on its own with this tokenizer (no BOS/EOS, no template)."""
        check_text(text)
        if self._bpe is not None:
            return len(self._bpe.encode(text))
        return self.text_tokens_reference(text)

    def text_tokens_reference(self, text: str) -> int:
        """:meth:`text_tokens` through mistral-common's ``encode`` (the fast path skips its shift of every id
        past the special tokens, which does not change the count)."""
        return len(self._serving.instruct_tokenizer.tokenizer.encode(text, bos=False, eos=False))

    def count(self, messages: MessagesLike, *, tools: ToolsLike = None, add_generation_prompt: bool = True) -> int:
        """Exact prompt tokens as mistral-common encodes them."""
        return self.measure(messages, tools=tools, add_generation_prompt=add_generation_prompt).tokens

    def measure(
        self, messages: MessagesLike, *, tools: ToolsLike = None, add_generation_prompt: bool = True
    ) -> Measurement:
        """Count ``messages`` and ``tools`` and say what the count is made of."""
        from mistral_common.exceptions import MistralCommonException

        conversation = messages if isinstance(messages, Conversation) else Conversation.from_messages(messages)
        if tools:
            check_tools(tools)
        try:
            if self.incremental:
                tokens, media = self._incremental(conversation, tools)
            else:
                tokens, media = self._whole(conversation, tools)
        except (MistralCommonException, ValueError, TypeError, KeyError, AssertionError) as exc:
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

    def _tokenizer_for(self, last_role: str | None) -> Any:
        if last_role != _ASSISTANT:
            return self._serving
        # A conversation whose last turn is answered is only valid in mistral-common's training mode.
        with self._lock:
            if self._finetuning is None:
                self._finetuning = _finetuning_twin(self._serving)
        return self._finetuning

    def _whole(self, conversation: Conversation, tools: ToolsLike) -> tuple[int, list[tuple[int, ContentPart]]]:
        """The reference: ``encode_chat_completion`` of the whole request."""
        from mistral_common.protocol.instruct.request import ChatCompletionRequest

        plain, media = server_view(conversation, content_format="string")
        for message in plain:
            _short_ids(message)
        tokenizer = self._tokenizer_for(plain[-1]["role"] if plain else None)
        request = ChatCompletionRequest.from_openai(messages=plain, tools=[dict(t) for t in tools] if tools else None)
        return len(tokenizer.encode_chat_completion(request).tokens), media

    def _read(self, message: Message) -> _Read:
        from mistral_common.protocol.instruct.converters import convert_openai_messages

        read = self._reads.get(message)
        if read is None:
            plain, media = server_view_message(message, content_format="string")
            converted = convert_openai_messages([_short_ids(plain)])[0]
            read = _Read(converted, None, media, converted.role, getattr(converted, "weight", None))
            self._reads.put(message, read)
        return read

    def _validate(self, reads: list[_Read], tokenizer: Any) -> None:
        """mistral-common's ``validate_messages``: the structure of the whole list, each message's content once
        per position (last or not) and mode, where the validator checks content message by message."""
        validator = tokenizer._chat_completion_request_validator
        converted = [r.converted for r in reads]
        if not self._checks_each:
            validator.validate_messages(converted)
            return
        validator._validate_message_list_structure(converted)
        training = tokenizer is not self._serving
        last = len(reads) - 1
        for k, read in enumerate(reads):
            key = (k == last, training)
            if key in read.checked:
                continue
            if read.role == _ASSISTANT:
                validator._validate_assistant_message(read.converted, is_last_message=k == last)
            else:
                validator._validate_message_list_content([read.converted])
            read.checked.add(key)

    def _setting(self, reads: list[_Read], tools: ToolsLike) -> _Setting:
        """The tools, system prompt and settings mistral-common derives for this request, from a request of the
        system messages and the tools alone (validated as the whole one would be), once per such pair."""
        from mistral_common.protocol.instruct.messages import UserMessage
        from mistral_common.protocol.instruct.request import ChatCompletionRequest

        systems = [r.converted for r in reads if r.role == _SYSTEM]
        key = json.dumps(
            [[m.model_dump(mode="json") for m in systems], [dict(t) for t in tools] if tools else None],
            ensure_ascii=False,
            default=str,
        )
        setting = self._settings.get(key)
        if setting is None:
            probe = ChatCompletionRequest.from_openai(
                messages=[{"role": "user", "content": ""}], tools=[dict(t) for t in tools] if tools else None
            )
            probe = ChatCompletionRequest(messages=[*systems, UserMessage(content="")], tools=probe.tools)
            validated = self._serving._chat_completion_request_validator.validate_request(probe)
            instruct = self._serving._instruct_request_normalizer.from_chat_completion_request(validated)
            with self._lock:
                self._serials += 1
                serial = self._serials
            setting = _Setting(serial, instruct.available_tools, instruct.system_prompt, instruct.settings)
            self._settings.put(key, setting)
        return setting

    def _incremental(self, conversation: Conversation, tools: ToolsLike) -> tuple[int, list[tuple[int, ContentPart]]]:
        """``encode_chat_completion``'s count made of each message's own tokens (see the class)."""
        found = self._reads.get_many(conversation)
        reads = [read if read is not None else self._read(m) for m, read in zip(conversation, found, strict=True)]
        tokenizer = self._tokenizer_for(reads[-1].role if reads else None)
        self._validate(reads, tokenizer)
        setting = self._setting(reads, tools)
        normalizer = tokenizer._instruct_request_normalizer
        instruct = self._instruct
        messages, owners, roles = _normalized(reads, normalizer)
        instruct.validate_messages(messages)
        users = [k for k, role in enumerate(roles) if role == _USER]
        first, last = (users[0], users[-1]) if users else (-1, -1)
        _validate_tool_results(instruct, normalizer, messages, setting)
        total = len(instruct.start())
        # A message's tokens by its position: a user message's by (last, first, setting), the others' by whether
        # they come before the last user message (system messages' by nothing).
        serial = setting.serial
        for k, (message, owner, role) in enumerate(zip(messages, owners, roles, strict=True)):
            key: Any = (k == last, k == first, serial) if role == _USER else (k < last if role != _SYSTEM else None)
            tokens = owner.tokens.get(key) if owner is not None else None
            if tokens is None:
                tokens = _encoded_length(instruct, message, role, k, first, last, setting)
                if owner is not None:
                    owner.tokens[key] = tokens
            total += tokens
        media = [(index, part) for index, read in enumerate(reads) for part in read.media]
        return total, media

    def _agrees(self) -> bool:
        """Whether the incremental count is the whole-request count on a probe conversation with every kind of
        message, run and position (a mistral-common whose encoder works otherwise switches it off)."""
        look = {"name": "look", "arguments": '{"q": "x", "n": 1.0}'}
        call = {"id": "a1b2c3d4e", "type": "function", "function": look}
        other = {"id": "f5g6h7i8j", "type": "function", "function": {"name": "look", "arguments": "{}"}}
        probe = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Find it."},
            {"role": "assistant", "content": "", "tool_calls": [call, other]},
            {"role": "tool", "tool_call_id": "f5g6h7i8j", "content": '{"found": [1, 2]}'},
            {"role": "tool", "tool_call_id": "a1b2c3d4e", "content": "plain text"},
            {"role": "assistant", "content": "Found."},
            {"role": "user", "content": "And then?"},
            {"role": "user", "content": "Say more."},
            {"role": "assistant", "content": "More."},
            {"role": "user", "content": "Thanks."},
        ]
        tools = [
            {
                "type": "function",
                "function": {
                    "name": "look",
                    "description": "Look.",
                    "parameters": {"type": "object", "properties": {"q": {"type": "string"}, "n": {"type": "number"}}},
                },
            }
        ]
        cases = [(probe, tools), (probe[:-1], None), (probe[1:5], tools), (probe[5:], tools), (probe[2:], None)]

        def outcome(count: Any, conversation: Conversation, given: ToolsLike) -> int | str:
            try:
                return int(count(conversation, given)[0])
            except Exception as exc:  # a refusal must be the same refusal
                return f"{type(exc).__name__}: {exc}"

        for messages, given in cases:
            conversation = Conversation.from_messages(messages)
            ours, reference = outcome(self._incremental, conversation, given), outcome(self._whole, conversation, given)
            if ours != reference:
                logger.info(
                    "contextkeeper: %s: incremental counting is off (%s where mistral-common gives %s); counting "
                    "whole requests",
                    self.name,
                    ours,
                    reference,
                )
                return False
        return True
