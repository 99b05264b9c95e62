"""``server="transformers"`` counts what a real ``transformers serve`` counted (recorded fixtures), and follows the
server's own message preprocessing on shapes the corpus lacks.

The fixtures in tests/fixtures/transformers_serve/ are the server's ``usage.prompt_tokens`` for the cases of
tests/server_corpus.py, with the prompt text its preprocessing renders, recorded by
scripts/record_transformers_serve.py from ``transformers serve`` on tiny random-weight models around each
vocabulary. ``pytest -m server`` starts the server again and compares live.
"""

from __future__ import annotations

import copy
import json
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import assets
import contextkeeper as ck
from conftest import hf_tokenizer
from contextkeeper._exceptions import ChatTemplateError, ContextKeeperError, InvalidMessage
from contextkeeper.servers.dialects import DIALECTS
from contextkeeper.tokens import HFChatTemplateCounter
from server_corpus import TEXTS, WEATHER, cases

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "transformers_serve"
RECORDED = {path.stem: json.loads(path.read_text(encoding="utf-8")) for path in sorted(FIXTURES.glob("*.json"))}
ANSWERS = json.loads((FIXTURES / "answers" / "transformers-serve.json").read_text(encoding="utf-8"))

_COUNTERS: dict[str, Any] = {}


def _counter(vocab: str, template: str | None = None, *, incremental: bool = True) -> Any:
    """A transformers-dialect counter for ``vocab`` with ``template`` (default: the recorded one), made once."""
    template = template or RECORDED[vocab]["template"]
    key = f"{vocab} {template} {incremental}"
    if key not in _COUNTERS:
        assets.require_assets()
        _COUNTERS[key] = HFChatTemplateCounter(
            hf_tokenizer(vocab),
            chat_template=assets.template(template),
            server="transformers",
            incremental=incremental,
        )
    return _COUNTERS[key]


def _recorded_cases() -> list[Any]:
    return [
        pytest.param(vocab, case, id=f"{vocab}-{case['name']}")
        for vocab, fixture in RECORDED.items()
        for case in fixture["cases"]
    ]


def test_the_recordings_cover_the_corpus_on_four_tokenizers() -> None:
    assert {"qwen2", "llama-bpe", "gemma-4", "phi-3"} <= set(RECORDED)
    names = [case["name"] for case in cases()]
    for fixture in RECORDED.values():
        assert fixture["server"].startswith("transformers serve 5.")
        assert [case["name"] for case in fixture["cases"]] == names
        assert [c["messages"] for c in fixture["cases"]] == [c["messages"] for c in cases()]


@pytest.mark.parametrize(("vocab", "case"), _recorded_cases())
def test_the_transformers_dialect_counts_what_transformers_serve_counted(vocab: str, case: dict[str, Any]) -> None:
    assets.require_assets()
    counter = _counter(vocab)
    messages, tools = copy.deepcopy(case["messages"]), copy.deepcopy(case["tools"])
    if case["prompt_tokens"] is None:
        # The server answered 500 (its own exception is recorded): the count refuses with a typed error.
        with pytest.raises(ContextKeeperError) as refused:
            counter.count(messages, tools=tools)
        expected = InvalidMessage if case["error"]["raised"].startswith("JSONDecodeError") else ChatTemplateError
        assert isinstance(refused.value, expected)
    else:
        assert counter.count(messages, tools=tools) == case["prompt_tokens"]
        assert counter.render(messages, tools=tools) == case["prompt"]
    assert (messages, tools) == (case["messages"], case["tools"])  # nothing the caller gave is changed


def test_invalid_arguments_are_refused_whatever_the_template_reads() -> None:
    """transformers serve parses every call's arguments before templating, so even Phi-3.5's template, which never
    reads tool calls, gets a 500 for arguments that are not JSON; llama.cpp's rule refuses only for templates that
    read them."""
    assets.require_assets()
    case = next(c for c in RECORDED["phi-3"]["cases"] if c["name"] == "args-invalid")
    assert case["prompt_tokens"] is None
    with pytest.raises(InvalidMessage, match=r"not JSON.*transformers refuses") as refused:
        _counter("phi-3").count(case["messages"], tools=case["tools"])
    assert refused.value.fix_text()
    llamacpp = HFChatTemplateCounter(
        hf_tokenizer("phi-3"), chat_template=assets.template(RECORDED["phi-3"]["template"]), server="llama.cpp"
    )
    assert llamacpp.count(case["messages"], tools=case["tools"]) > 0


def test_content_beside_tool_calls_is_dropped_and_kept_in_the_callers_messages() -> None:
    """The parallel-calls case: the assistant's "Checking both." is not sent to the template (Phi-3.5 renders an
    empty assistant turn); the fitted messages still hold it, in the caller's own format."""
    assets.require_assets()
    fixture = RECORDED["phi-3"]
    case = next(c for c in fixture["cases"] if c["name"] == "parallel-calls")
    keeper = ck.ContextKeeper(
        str(assets.tokenizer_dir("phi-3")),
        chat_template=assets.template(fixture["template"]),
        context_window=4096,
        server="transformers",
    )
    fit = keeper.fit(case["messages"], tools=case["tools"], max_tokens=64)
    assert fit.tokens == case["prompt_tokens"]
    assert fit.messages == case["messages"]
    assert "Checking both." not in case["prompt"]


# ------------------------------------------------------- the server's own preprocessing, on shapes beyond the corpus


def _server_count(vocab: str, template: str, messages: list[dict[str, Any]], tools: Any = None) -> int:
    """What transformers serve counts for a text model: its own message preprocessing
    (``BaseHandler.get_processor_inputs_from_messages``), then ``apply_chat_template`` as its handler calls it."""
    from transformers.cli.serving.utils import BaseHandler, Modality

    prepared = BaseHandler.get_processor_inputs_from_messages(messages, Modality.LLM)
    ids = hf_tokenizer(vocab).apply_chat_template(
        prepared, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=True, chat_template=template
    )["input_ids"]
    return len(ids)


_CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
SHAPES: dict[str, list[dict[str, Any]]] = {
    # Qwen3 renders a final assistant's reasoning_content; the server does not pass it on.
    "reasoning-on-the-last-turn": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Two plus two."},
    ],
    "content-beside-a-call": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me look that up.", "tool_calls": [_CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
    ],
    "arguments-as-an-object": [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{**_CALL, "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
    ],
    "parts-of-every-text-kind": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "One."},
                {"type": "input_text", "text": "Two."},
                {"type": "refusal", "refusal": "Not this."},
                {"type": "text", "text": TEXTS["cjk"]},
            ],
        }
    ],
    "tool-result-in-parts": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [_CALL]},
        {
            "role": "tool",
            "tool_call_id": "call_1",
            "content": [{"type": "text", "text": "Sunny"}, {"type": "text", "text": "4°C"}],
        },
    ],
    "names-and-extras": [
        {"role": "system", "content": "Be brief.", "name": "policy"},
        {"role": "user", "content": "Hi", "name": "ana"},
    ],
    "assistant-none-content": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "Still there?"},
    ],
}


@pytest.mark.parametrize(
    ("vocab", "template"),
    [("qwen2", "Qwen-Qwen3-0.6B"), ("llama-bpe", "meta-llama-Llama-3.3-70B-Instruct"), ("qwen2", "Kimi-K3")],
)
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_dialect_follows_the_servers_own_preprocessing(vocab: str, template: str, shape: str) -> None:
    assets.require_assets()
    messages = copy.deepcopy(SHAPES[shape])
    expected = _server_count(vocab, assets.template(template), messages, [WEATHER])
    assert _counter(vocab, template).count(messages, tools=[WEATHER]) == expected
    assert messages == SHAPES[shape]


def test_a_media_part_is_priced_apart_from_the_text_the_server_counts() -> None:
    """For a text model transformers serve drops an image part; the count's text equals the server's and the image
    stays a priced estimate (the counter cannot tell a text model from a vision model)."""
    assets.require_assets()
    source = assets.template("Qwen-Qwen3-0.6B")
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in it?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
            ],
        }
    ]
    counter = HFChatTemplateCounter(
        hf_tokenizer("qwen2"), chat_template=source, server="transformers", media_cost=ck.MediaCost(image=100)
    )
    measured = counter.measure(messages)
    assert measured.text_tokens == _server_count("qwen2", source, messages)
    assert (measured.media_parts, measured.media_tokens, measured.estimated) == (1, 100, True)


def test_the_dialects_fast_path_equals_its_whole_renders() -> None:
    """Whole renders (no message-by-message rendering) under the transformers rules count the recordings too."""
    assets.require_assets()
    for vocab, fixture in RECORDED.items():
        whole = _counter(vocab, incremental=False)
        for case in fixture["cases"]:
            if case["prompt_tokens"] is not None:
                assert whole.count(case["messages"], tools=case["tools"]) == case["prompt_tokens"], case["name"]
                assert whole.render(case["messages"], tools=case["tools"]) == case["prompt"], case["name"]


def test_the_transformers_dialect_is_the_serve_preprocessing() -> None:
    dialect = DIALECTS["transformers"]
    assert dialect.view == "server"
    assert dialect.message_keys == ("role", "content", "tool_calls", "tool_call_id")
    assert any("get_processor_inputs_from_messages" in source for source in dialect.sources)


def test_what_transformers_serve_answers_to_detection() -> None:
    """The recorded answers the lead's detection reads: a models list of pinned local models owned by "local",
    FastAPI's 404 for every other server's endpoint, and usage in every chat completion."""
    answers = ANSWERS["answers"]
    (card,) = answers["/v1/models"]["json"]["data"]
    assert card["owned_by"] == "local"
    assert card["status"] == {"value": "loaded"}  # not an OpenAI field: transformers serve's own
    for path in ("/props", "/api/version", "/get_server_info", "/version"):
        assert answers[path]["status"] == 404
    reply = answers["/v1/chat/completions"]["json"]
    assert reply["usage"]["prompt_tokens"] == RECORDED["qwen2"]["cases"][0]["prompt_tokens"]


# ------------------------------------------------------------------------------------------------- live


def _serve(vocab: str) -> Iterator[Any]:
    """A ``transformers serve`` (CPU, loopback) on the tiny model for the vocabulary, stopped when done."""
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        pytest.skip("transformers serve needs fastapi and uvicorn: pip install -e '.[dev]'")
    assets.require_assets()
    sys.path.insert(0, str(ROOT / "scripts"))
    from record_transformers_serve import TransformersServer, tiny_model  # type: ignore[import-not-found]

    with TransformersServer(tiny_model(vocab), wait_s=120) as server:  # stopped even if a test fails
        server.vocab = vocab
        yield server


@pytest.fixture(scope="module", params=["qwen2", "llama-bpe"])
def live(request: pytest.FixtureRequest) -> Iterator[Any]:
    yield from _serve(request.param)


@pytest.fixture(scope="module")
def served() -> Iterator[Any]:
    """The live server the default run starts: Qwen3's template on the qwen2 vocabulary."""
    yield from _serve("qwen2")


@pytest.mark.server
def test_live_transformers_serve_still_counts_the_recordings(live: Any) -> None:
    counter = _counter(live.vocab)
    for case in cases():
        recorded = live.record(case)
        if recorded["prompt_tokens"] is None:
            with pytest.raises(ContextKeeperError):
                counter.count(case["messages"], tools=case["tools"])
        else:
            assert counter.count(case["messages"], tools=case["tools"]) == recorded["prompt_tokens"], case["name"]


def test_a_wrapped_chat_against_a_live_transformers_serve_counts_every_prompt(served: Any) -> None:
    """Run by default: the real server started here, the chat below through it."""
    _wrapped_chat(served)


@pytest.mark.server
def test_a_wrapped_chat_against_transformers_serve_counts_every_prompt(live: Any) -> None:
    _wrapped_chat(live)


def _wrapped_chat(live: Any) -> None:
    """Turns through ``keeper.wrap`` and the openai SDK, with tools, tool calls and every script, fitted to a small
    context: each prompt the server counts is the keeper's count, and no drift warning is raised."""
    import openai

    fixture = RECORDED[live.vocab]
    keeper = ck.ContextKeeper(
        str(assets.tokenizer_dir(live.vocab)),
        chat_template=assets.template(fixture["template"]),
        context_window=1024,
        server="transformers",
    )
    client = keeper.wrap(openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0))
    texts = list(TEXTS.values())
    chat: list[dict[str, Any]] = [{"role": "developer", "content": "Answer briefly."}]
    trimmed = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", ck.DriftWarning)
        for turn in range(24):
            chat.append({"role": "user", "content": f"{turn}: {texts[turn % len(texts)]}"})
            if turn % 4 == 3:
                call = {**_CALL, "id": f"c{turn}"}
                chat.append({"role": "assistant", "content": "Looking.", "tool_calls": [call]})
                chat.append({"role": "tool", "tool_call_id": f"c{turn}", "content": texts[(turn + 3) % 8]})
            reply = client.chat.completions.create(model=str(live.model), messages=chat, tools=[WEATHER], max_tokens=4)
            fit = keeper.last_fit
            assert fit is not None
            assert reply.usage is not None
            assert reply.usage.prompt_tokens == fit.tokens, turn
            trimmed += len(fit.messages) < len(chat)
            chat.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
    assert trimmed > 8  # the chat outgrew the context, so the late turns were fitted
