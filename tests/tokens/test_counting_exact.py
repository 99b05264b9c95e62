"""Exactness: our count equals len(apply_chat_template(server_view(messages), tools, add_generation_prompt=True))
for real chat templates and real vocabularies, for every conversation shape — or both refuse the input."""

from __future__ import annotations

import copy
from typing import Any

import pytest

import contextkeeper as ck
from assets import ASSETS, template
from conftest import hf_tokenizer
from conversations import CONVERSATIONS, TOOLS

# (template, vocabulary, template kwargs)
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("meta-llama-Llama-3.1-8B-Instruct", "llama-bpe", {}),
    ("meta-llama-Llama-3.2-3B-Instruct", "llama-bpe", {}),
    ("meta-llama-Llama-3.3-70B-Instruct", "llama-bpe", {}),
    ("Qwen-Qwen2.5-7B-Instruct", "qwen2", {}),
    ("Qwen-Qwen3-0.6B", "qwen2", {}),
    ("Qwen-Qwen3-0.6B", "qwen2", {"enable_thinking": False}),
    ("Qwen-QwQ-32B", "qwen2", {}),
    ("Qwen3-Coder", "qwen2", {}),
    ("Qwen3.5-4B", "qwen35", {}),
    ("openai-gpt-oss-120b", "harmony-on-qwen2", {}),
    ("openai-gpt-oss-120b", "harmony-on-qwen2", {"reasoning_effort": "high"}),
    ("deepseek-ai-DeepSeek-V3.1", "deepseek-v4", {}),
    ("deepseek-ai-DeepSeek-V3.1", "deepseek-v4", {"thinking": True}),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "deepseek-v4", {}),
    ("microsoft-Phi-3.5-mini-instruct", "phi-3", {}),
    ("google-gemma-2-2b-it", "gemma-4", {}),
    ("google-gemma-4-31B-it", "gemma-4", {}),
]


def reference(
    tokenizer: Any, source: str, messages: list[dict[str, Any]], tools: Any, fmt: str, kwargs: dict[str, Any]
) -> int:
    plain, media = ck.server_view(messages, content_format=fmt)  # type: ignore[arg-type]
    assert not media
    ids = tokenizer.apply_chat_template(
        plain,
        tools=tools,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
        chat_template=source,
        **kwargs,
    )
    return len(ids)


def _case_id(case: tuple[str, str, dict[str, Any]]) -> str:
    name, vocab, kwargs = case
    extra = ",".join(f"{k}={v}" for k, v in kwargs.items())
    return f"{name}[{vocab}]" + (f"[{extra}]" if extra else "")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("with_tools", [False, True], ids=["no-tools", "tools"])
def test_count_equals_apply_chat_template(case: tuple[str, str, dict[str, Any]], with_tools: bool) -> None:
    name, vocab, kwargs = case
    tokenizer = hf_tokenizer(vocab)
    source = template(name)
    counter = ck.HFChatTemplateCounter(tokenizer, chat_template=source, template_kwargs=kwargs, name=name)
    tools = TOOLS if with_tools else None
    agreed = 0
    for shape, build in CONVERSATIONS.items():
        messages = build()
        before = copy.deepcopy(messages)
        try:
            expected = reference(tokenizer, source, messages, tools, counter.content_format, kwargs)
        except Exception as exc:
            with pytest.raises(ck.ChatTemplateError) as info:
                counter.count(messages, tools=tools)
            assert info.value.template_message is not None, shape
            # The template's own error text must reach the user.
            refused = str(exc).split("\n")[0][:40]
            assert refused in info.value.template_message or type(exc).__name__ in str(info.value), shape  # noqa: PT017
            continue
        assert counter.count(messages, tools=tools) == expected, shape
        assert messages == before, f"{shape}: the caller's messages were mutated"
        agreed += 1
    # Gemma 2 has neither a system nor a tool role: it accepts only plain alternating turns.
    assert agreed >= (1 if name == "google-gemma-2-2b-it" else 4), f"{name}: accepted only {agreed} shapes"


def test_piece_counting_is_active_for_every_family() -> None:
    # The fast path must be the one being tested above, not the whole-text fallback.
    for vocab in sorted({vocab for _, vocab, _ in CASES} | {"llama-spm", "deepseek-llm"}):
        counter = ck.HFChatTemplateCounter(hf_tokenizer(vocab), chat_template=template("Qwen-Qwen2.5-7B-Instruct"))
        assert counter.piece_counting, vocab


ALL_TEMPLATES = sorted(p.stem for p in (ASSETS / "templates").glob("*.jinja")) if ASSETS.exists() else []


@pytest.mark.parametrize("name", ALL_TEMPLATES)
def test_every_vendored_template_counts_exactly_or_refuses_cleanly(name: str) -> None:
    """All ~80 real templates llama.cpp vendors, over a vocabulary with their markers as plain text."""
    tokenizer = hf_tokenizer("qwen2")
    source = template(name)
    try:
        counter = ck.HFChatTemplateCounter(tokenizer, chat_template=source, name=name)
    except ck.ChatTemplateError:
        pytest.fail(f"{name}: the counter could not be built")
    for shape in ("simple", "tool_round", "parallel_calls", "reasoning"):
        messages = CONVERSATIONS[shape]()
        for tools in (None, TOOLS):
            try:
                expected = reference(tokenizer, source, messages, tools, counter.content_format, {})
            except Exception:
                with pytest.raises(ck.ChatTemplateError):
                    counter.count(messages, tools=tools)
                continue
            assert counter.count(messages, tools=tools) == expected, (name, shape, tools is not None)
