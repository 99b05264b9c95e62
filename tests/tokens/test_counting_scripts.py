"""Exactness in every script and every template family: agent chats written in Latin with diacritics, CJK,
Cyrillic, Arabic, Devanagari, Greek, code and six scripts mixed, counted as they grow (the incremental paths:
pieces, pre-token rules, message-by-message renders with carried state and look-aheads) against the template
applied whole, and for Mistral's Tekken against mistral-common's own request encoding."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

import contextkeeper as ck
from assets import template
from conftest import hf_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from agent_conversation import SCRIPTS, TOOLS, build_script, mistral_call_ids

FAMILIES = [
    ("Qwen-Qwen3-0.6B", "qwen2"),
    ("meta-llama-Llama-3.3-70B-Instruct", "llama-bpe"),
    ("openai-gpt-oss-120b", "harmony-on-qwen2"),
    ("google-gemma-4-31B-it", "gemma-4"),
    ("deepseek-ai-DeepSeek-V3.1", "deepseek-v4"),
]
# Each chat is counted at these lengths, in order, by one counter (so later counts resume from earlier ones).
LENGTHS = (24, 25, 31, 40)


def _chat(script: str, length: int, seed: int) -> list[dict[str, Any]]:
    # A chat must end on a request: trailing assistant messages are dropped.
    messages = build_script(script, length + 8, seed=seed)[:length]
    while messages[-1]["role"] == "assistant":
        messages.pop()
    return messages


def _reference(tokenizer: Any, source: str, messages: list[dict[str, Any]], fmt: str) -> int:
    plain, _ = ck.server_view(messages, content_format=fmt)  # type: ignore[arg-type]
    ids = tokenizer.apply_chat_template(
        plain, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False, chat_template=source
    )
    return len(ids)


@pytest.mark.parametrize(("name", "vocab"), FAMILIES, ids=[name for name, _ in FAMILIES])
def test_a_growing_chat_in_every_script_counts_as_the_template_applied_whole(name: str, vocab: str) -> None:
    tokenizer = hf_tokenizer(vocab)
    source = template(name)
    counter = ck.HFChatTemplateCounter(tokenizer, chat_template=source, name=name)
    for seed, script in enumerate(sorted(SCRIPTS)):
        full = _chat(script, max(LENGTHS), seed)
        for length in LENGTHS:
            messages = full[:length]
            while messages[-1]["role"] == "assistant":
                messages = messages[:-1]
            expected = _reference(tokenizer, source, messages, counter.content_format)
            assert counter.count(messages, tools=TOOLS) == expected, (name, script, length)


def test_tekken_counts_chats_in_every_script_as_mistral_common_encodes_them() -> None:
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    from contextkeeper.tokens.mistral import _resolve

    reference = MistralTokenizer.from_file(str(_resolve("tekken")))
    counter = ck.load_counter("mistral:tekken")
    for seed, script in enumerate(sorted(SCRIPTS)):
        messages = mistral_call_ids(_chat(script, 31, seed))
        plain, _ = ck.server_view(messages)
        request = ChatCompletionRequest.from_openai(plain, tools=TOOLS)
        assert counter.count(messages, tools=TOOLS) == len(reference.encode_chat_completion(request).tokens), script
