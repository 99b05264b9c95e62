"""Template behaviours the counter must handle honestly, media parts, breakdowns and mistral-common."""

from __future__ import annotations

import logging
from typing import Any

import pytest

import contextkeeper as ck
from assets import template
from conftest import hf_tokenizer
from conversations import TOOLS, parallel_calls, simple, tool_round


def counter_for(name: str, vocab: str, **kwargs: Any) -> ck.HFChatTemplateCounter:
    return ck.HFChatTemplateCounter(hf_tokenizer(vocab), chat_template=template(name), name=name, **kwargs)


def test_template_that_ignores_tools_is_reported_once(caplog: pytest.LogCaptureFixture) -> None:
    counter = counter_for("google-gemma-2-2b-it", "gemma-4")
    messages = [{"role": "user", "content": "hi"}]
    with caplog.at_level(logging.WARNING, logger="contextkeeper"):
        with_tools = counter.measure(messages, tools=TOOLS)
        counter.measure(messages, tools=TOOLS)
    assert with_tools.tokens == counter.count(messages)
    assert counter.ignores_tools is True
    assert any("ignores tools" in note for note in with_tools.notes)
    assert len([r for r in caplog.records if "never reads `tools`" in r.getMessage()]) == 1


def test_template_that_renders_tools_is_not_flagged() -> None:
    counter = counter_for("Qwen-Qwen2.5-7B-Instruct", "qwen2")
    measured = counter.measure(simple(), tools=TOOLS)
    assert counter.ignores_tools is False
    assert measured.tokens > counter.count(simple()) + 50


def test_llama_puts_tools_in_the_first_user_message_and_renders_the_date() -> None:
    counter = counter_for("meta-llama-Llama-3.1-8B-Instruct", "llama-bpe")
    text = counter.render(simple(), tools=TOOLS)
    first_user = text.index("<|start_header_id|>user<|end_header_id|>")
    assert text.index('"get_weather"') > first_user
    assert "Today Date:" in text
    assert any("today's date" in note for note in counter.measure(simple()).notes)


def test_tool_schemas_changed_in_place_between_counts_are_counted_again() -> None:
    """Tool schemas are rendered once and reused while unchanged (their ``tojson`` is memoised): an edit made
    in place, even 1 -> True, must still reach the count."""
    import copy

    counter = counter_for("meta-llama-Llama-3.3-70B-Instruct", "llama-bpe")
    tools = copy.deepcopy(TOOLS)
    messages = simple()
    before = counter.count(messages, tools=tools)
    assert before == counter.reference_count(messages, tools=tools)
    first = tools[0]["function"]["parameters"]
    first["properties"][next(iter(first["properties"]))]["description"] = "a much longer description " * 5
    grown = counter.count(messages, tools=tools)
    assert grown == counter.reference_count(messages, tools=tools)
    assert grown > before
    first["strict_flag"] = 1
    as_int = counter.count(messages, tools=tools)
    assert as_int == counter.reference_count(messages, tools=tools)
    first["strict_flag"] = True
    as_bool = counter.count(messages, tools=tools)
    assert as_bool == counter.reference_count(messages, tools=tools)
    assert as_int != as_bool  # "1" and "true" are different tokens
    assert TOOLS[0]["function"]["parameters"] != first  # the module's schemas were never touched


def test_template_error_keeps_the_templates_own_message() -> None:
    counter = counter_for("google-gemma-2-2b-it", "gemma-4")
    with pytest.raises(ck.ChatTemplateError) as info:
        counter.count(simple())  # Gemma 2 has no system role
    assert info.value.template_message == "System role not supported"
    assert "System role not supported" in str(info.value)


def test_llama_3_1_refuses_parallel_calls_with_its_message() -> None:
    counter = counter_for("meta-llama-Llama-3.1-8B-Instruct", "llama-bpe")
    with pytest.raises(ck.ChatTemplateError, match="single tool-calls"):
        counter.count(parallel_calls(), tools=TOOLS)


def test_no_double_bos() -> None:
    # deepseek-llm's tokenizer adds BOS by itself, and DeepSeek's template writes {{ bos_token }} too.
    tokenizer = hf_tokenizer("deepseek-llm")
    counter = counter_for("deepseek-ai-DeepSeek-R1-Distill-Llama-8B", "deepseek-llm")
    text = counter.render(tool_round())
    assert text.startswith(tokenizer.bos_token)
    naive = tokenizer(text)["input_ids"]  # the classic mistake: encoding the rendered text adds a second BOS
    assert naive[:2] == [tokenizer.bos_token_id, tokenizer.bos_token_id]
    assert counter.count(tool_round()) == len(naive) - 1


def test_templates_render_in_a_sandbox() -> None:
    escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    counter = ck.HFChatTemplateCounter(hf_tokenizer("qwen2"), chat_template=escape)
    with pytest.raises(ck.ChatTemplateError):
        counter.count(simple())
    mutate = "{% set _ = messages.append({'role': 'user', 'content': 'x'}) %}{{ messages | length }}"
    messages = simple()
    with pytest.raises(ck.ChatTemplateError):
        ck.HFChatTemplateCounter(hf_tokenizer("qwen2"), chat_template=mutate).count(messages)
    assert messages == simple()


def test_tokenizer_without_template_says_how_to_fix() -> None:
    tokenizer = hf_tokenizer("llama-spm")
    assert not tokenizer.chat_template
    with pytest.raises(ck.ChatTemplateError, match="chat_template"):
        ck.HFChatTemplateCounter(tokenizer)


def test_named_tool_use_template_is_selected_with_tools() -> None:
    tokenizer = hf_tokenizer("qwen2")
    templates = {
        "default": "{% for m in messages %}{{ m.content }}{% endfor %}",
        "tool_use": "TOOLS {{ tools | length }}",
    }
    counter = ck.HFChatTemplateCounter(tokenizer, chat_template=templates)  # type: ignore[arg-type]
    assert counter.render(simple(), tools=TOOLS) == "TOOLS 2"
    assert counter.render(simple()).startswith("You are a careful")


def test_content_format_detection_matches_the_template_shape() -> None:
    assert ck.tokens.detect_content_format("{% for m in messages %}{{ m.content }}{% endfor %}") == "string"
    loops = "{% for m in messages %}{% for part in m['content'] %}{{ part.text }}{% endfor %}{% endfor %}"
    assert ck.tokens.detect_content_format(loops) == "openai"
    assert ck.tokens.detect_content_format(template("google-gemma-4-31B-it")) == "openai"


def test_media_parts_are_priced_and_marked_as_estimates() -> None:
    counter = counter_for("Qwen-Qwen2.5-7B-Instruct", "qwen2")
    text_only = [{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"}]}]
    with_image = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in this picture?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
                {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
            ],
        }
    ]
    base = counter.measure(text_only)
    measured = counter.measure(with_image)
    assert not base.estimated
    assert measured.estimated
    assert measured.media_parts == 2
    assert measured.media_tokens == counter.media_cost.image + counter.media_cost.audio
    assert measured.tokens == base.tokens + measured.media_tokens
    assert any("per-part" in note for note in measured.notes)
    tight = counter_for("Qwen-Qwen2.5-7B-Instruct", "qwen2", media_cost=ck.MediaCost(image=256, audio=100))
    assert tight.measure(with_image).media_tokens == 356


def test_a_window_that_drops_old_messages_keeps_its_media_at_their_new_places() -> None:
    # The views of a window that ends like the previous call's list are taken from that call; the indices of
    # its media parts must follow the messages.
    def picture(n: int) -> dict[str, Any]:
        image = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{n}iVBORw0KGgo="}}
        return {"role": "user", "content": [{"type": "text", "text": f"Picture {n}?"}, image]}

    chat: list[dict[str, Any]] = [{"role": "system", "content": "Describe pictures."}]
    for n in range(6):
        chat += [picture(n), {"role": "assistant", "content": f"A cat, number {n}."}]
    counter = counter_for("Qwen-Qwen2.5-7B-Instruct", "qwen2")
    conversation = ck.Conversation.from_messages(chat)
    counter.measure(conversation)
    for drop in (2, 4, 8):
        window = ck.Conversation.from_messages(conversation.messages[:1] + conversation.messages[1 + drop :])
        fresh = counter_for("Qwen-Qwen2.5-7B-Instruct", "qwen2")
        assert counter._view(window) == fresh._view(window)
        assert counter.measure(window) == fresh.measure(window)


def test_known_family_media_rule() -> None:
    rule = ck.tokens.media.media_cost_for("google/gemma-3-4b-it")
    assert rule.image == 256
    assert "Gemma 3" in rule.source


@pytest.mark.parametrize("shape", [simple, tool_round, parallel_calls])
def test_breakdown_slots_sum_to_the_exact_total(shape: Any) -> None:
    counter = counter_for("Qwen-Qwen2.5-7B-Instruct", "qwen2")
    parts = ck.breakdown(counter, shape(), tools=TOOLS)
    assert parts.tokens == counter.count(shape(), tools=TOOLS)
    assert parts.system + parts.tools + parts.history + parts.request + parts.template_overhead == parts.tokens
    assert parts.tools > 0
    assert parts.system > 0
    assert parts.request > 0


def test_breakdown_slots_are_where_the_messages_are() -> None:
    counter = counter_for("Qwen-Qwen2.5-7B-Instruct", "qwen2")
    messages = tool_round()
    parts = ck.breakdown(counter, messages, tools=TOOLS)
    assert parts.messages == {"system": 1, "history": 4, "request": 1}
    system, request = messages[:1], messages[5:]

    def closed(part: list[Any], tools: Any = None) -> int:
        return counter.count(part, tools=tools, add_generation_prompt=False)

    fixed = counter.count(system + request, tools=TOOLS)
    assert parts.system == closed(system)  # Qwen 2.5 cannot render an empty conversation: no baseline to subtract
    assert parts.tools == closed(system, TOOLS) - closed(system)
    assert parts.request == closed(system + request, TOOLS) - closed(system, TOOLS)
    assert parts.template_overhead == fixed - closed(system + request, TOOLS)
    assert parts.history == counter.count(messages, tools=TOOLS) - fixed


@pytest.mark.parametrize(
    ("name", "vocab"),
    [
        ("Qwen-Qwen3-0.6B", "qwen2"),
        ("meta-llama-Llama-3.3-70B-Instruct", "llama-bpe"),
        ("openai-gpt-oss-120b", "harmony-on-qwen2"),
    ],
)
def test_count_and_fit_name_the_same_slots_with_the_same_numbers(name: str, vocab: str) -> None:
    """One slot model: ``breakdown`` (the CLI's ``count``) and a fit's report split the same prompt alike."""
    counter = counter_for(name, vocab)
    messages = tool_round()
    fit = ck.ContextKeeper(counter, context_window=32768).fit(messages, tools=TOOLS, max_tokens=256)
    assert fit.messages == messages  # everything fits: both split the very same prompt
    parts = ck.breakdown(counter, messages, tools=TOOLS)
    slots = {k: v for k, v in fit.report.slots.items() if k != "answer"}
    assert slots == {k: getattr(parts, k) for k in slots}
    assert sum(slots.values()) == parts.tokens == fit.tokens


# -- mistral-common ------------------------------------------------------------------------------------------


def _mistral_reference(name: str, messages: list[dict[str, Any]], tools: Any) -> int:
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    from contextkeeper.tokens.mistral import _resolve

    tokenizer = MistralTokenizer.from_file(str(_resolve(name)))
    plain, _ = ck.server_view(messages)
    return len(tokenizer.encode_chat_completion(ChatCompletionRequest.from_openai(plain, tools=tools)).tokens)


@pytest.mark.parametrize("name", ["tekken", "nemo", "v3", "v7"])
@pytest.mark.parametrize("shape", [simple, tool_round, parallel_calls])
def test_mistral_counter_matches_mistral_common(name: str, shape: Any) -> None:
    from mistral_common.exceptions import MistralCommonException

    counter = ck.load_counter(f"mistral:{name}")
    for tools in (None, TOOLS):
        try:
            expected = _mistral_reference(name, shape(), tools)
        except MistralCommonException as exc:
            with pytest.raises(ck.ChatTemplateError) as info:
                counter.count(shape(), tools=tools)
            assert info.value.template_message == str(exc)  # noqa: PT017
            continue
        assert counter.count(shape(), tools=tools) == expected


def test_mistral_long_tool_ids_are_shortened_like_vllm() -> None:
    counter = ck.load_counter("mistral:tekken")
    messages = tool_round()
    renamed = [dict(m) for m in messages]
    renamed[2] = {**renamed[2], "tool_calls": [{**renamed[2]["tool_calls"][0], "id": "call_xyzabcdefghi"}]}
    renamed[3] = {**renamed[3], "tool_call_id": "call_xyzabcdefghi"}
    shortened = [dict(m) for m in messages]
    shortened[2] = {**shortened[2], "tool_calls": [{**shortened[2]["tool_calls"][0], "id": "abcdefghi"}]}
    shortened[3] = {**shortened[3], "tool_call_id": "abcdefghi"}
    assert counter.count(renamed) == counter.count(shortened)
    bad = [dict(m) for m in messages]
    bad[2] = {**bad[2], "tool_calls": [{**bad[2]["tool_calls"][0], "id": "call_12"}]}
    bad[3] = {**bad[3], "tool_call_id": "call_12"}
    with pytest.raises(ck.ChatTemplateError, match="9 letters or digits"):
        counter.count(bad)


def test_unknown_mistral_name_lists_the_choices() -> None:
    with pytest.raises(ck.TokenizerNotFound, match="mistral:tekken"):
        ck.load_counter("mistral:does-not-exist")


def test_raw_view_counts_what_transformers_renders_from_the_messages_as_given() -> None:
    # With JSON-string arguments Qwen2.5's template writes the string itself (quoted) under transformers, and
    # the parsed object under a server: the two views differ, and each is exact for what it claims.
    tokenizer = hf_tokenizer("qwen2")
    source = template("Qwen-Qwen2.5-7B-Instruct")
    messages = tool_round()
    raw = ck.HFChatTemplateCounter(tokenizer, chat_template=source, view="raw")
    served = ck.HFChatTemplateCounter(tokenizer, chat_template=source)
    reference = tokenizer.apply_chat_template(
        ck.raw_view(messages),
        tools=TOOLS,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
        chat_template=source,
    )
    assert raw.count(messages, tools=TOOLS) == len(reference)
    assert raw.count(messages, tools=TOOLS) != served.count(messages, tools=TOOLS)
    assert '"{\\"city\\": \\"Paris\\"}"' in raw.render(messages)
