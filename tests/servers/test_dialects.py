"""Server dialects: counts equal what a real llama-server counted (recorded fixtures), and the registry's contract.

The fixtures in tests/fixtures/llama_server/ are llama-server's own ``usage.prompt_tokens`` and ``/apply-template``
text for the cases of tests/server_corpus.py, recorded by scripts/record_llama_server.py from a server built from
the llama.cpp source the llama-cpp-python sdist vendors. ``pytest -m server`` sends the cases to a live server again.
"""

from __future__ import annotations

import copy
import datetime as dt
import functools
import json
from pathlib import Path
from typing import Any

import pytest

import assets
import contextkeeper as ck
from contextkeeper._exceptions import ConfigurationError, CountingError, InvalidMessage
from contextkeeper.servers.dialects import DIALECTS, Dialect, dialect_of
from contextkeeper.tokens import load_counter
from recorded_servers import FIXTURES, RECORDED, RECORDED_MORE, live_llama_server, vocab_of
from server_corpus import ENGINE_TEMPLATE, cases, continuation_cases, engine_cases, number_cases

# Where llama.cpp's C++ Jinja engine renders differently from Python's and no dialect rule follows it (yet); each
# is listed in docs/dialects.md. strict: a case that starts to agree fails here, so the list stays true.
ENGINE_DIFFERENCES: dict[tuple[str, str], str] = {}
ENGINE = json.loads((FIXTURES / "llama_engine.json").read_text(encoding="utf-8"))
CONTINUED = json.loads((FIXTURES / "llama_continuation.json").read_text(encoding="utf-8"))
NUMBERS = json.loads((FIXTURES / "llama_numbers.json").read_text(encoding="utf-8"))
EVERY = {**RECORDED, **RECORDED_MORE}


def _context(fixture: dict[str, Any]) -> dict[str, str]:
    # The server passed the date of the recording; pass the same so that today's date does not change the text.
    day = dt.datetime.strptime(fixture["recorded"], "%Y-%m-%d")
    return {"date_string": day.strftime("%d %b %Y"), "datetime": day.strftime("%b %d %Y")}


@functools.cache
def _counter(vocab: str, recorded: str = "") -> Any:
    """The llama.cpp counter of ``vocab``'s recorded pair, passed the date of the recording (``recorded``: another
    recording's date)."""
    fixture = EVERY[vocab]
    return load_counter(
        str(assets.tokenizer_dir(fixture["vocab"])),
        chat_template=assets.template(fixture["template"]),
        template_kwargs=_context({"recorded": recorded or fixture["recorded"]}),
        server="llama.cpp",
    )


def _recorded_cases() -> list[Any]:
    out = []
    for vocab, fixture in EVERY.items():
        for case in fixture["cases"]:
            reason = ENGINE_DIFFERENCES.get((vocab, case["name"]))
            marks = [pytest.mark.xfail(reason=reason, strict=True)] if reason else []
            out.append(pytest.param(vocab, case, id=f"{vocab}-{case['name']}", marks=marks))
    return out


def test_the_recordings_cover_the_corpus_on_three_tokenizers_or_more() -> None:
    assert len(RECORDED) >= 3
    assert "llama-bpe@llama3-original" in RECORDED_MORE  # BOS written inside the loop
    names = [case["name"] for case in cases()]
    for fixture in EVERY.values():
        assert [case["name"] for case in fixture["cases"]] == names
    assert sum(len(fixture["cases"]) for fixture in RECORDED.values()) >= 150
    assert set(NUMBERS["pairs"]) == set(EVERY)
    for pair in NUMBERS["pairs"].values():
        assert [case["name"] for case in pair["cases"]] == [case["name"] for case in number_cases()]


@pytest.mark.parametrize("recording", ["llama-bpe", "llama-bpe@llama3-original"])
def test_a_tokenizer_that_adds_bos_counts_one_bos_wherever_the_template_writes_it(
    recording: str, tmp_path: Path
) -> None:
    # Meta's Llama 3.1 tokenizer.json adds BOS (its post-processor) as llama.cpp does (the GGUF's add_bos_token);
    # llama-server cuts a BOS the template wrote at the very start of the prompt, then tokenizes adding one. The
    # vendored Llama 3.3 template writes it before the loop, Meta's original inside the loop, on the first message.
    assets.require_assets()
    fixture = EVERY[recording]
    counter = load_counter(
        str(assets.bos_adding_tokenizer(fixture["vocab"], tmp_path)),
        chat_template=assets.template(fixture["template"]),
        template_kwargs=_context(fixture),
        server="llama.cpp",
    )
    assert counter._adds_bos
    counted = [
        (case["name"], counter.count(case["messages"], tools=case["tools"]), case["prompt_tokens"])
        for case in fixture["cases"]
        if case["prompt_tokens"] is not None
    ]
    assert [c for c in counted if c[1] != c[2]] == []
    assert len(counted) >= 50


@pytest.mark.parametrize(
    ("vocab", "case"),
    [
        pytest.param(vocab, case, id=f"{vocab}-{case['name']}")
        for vocab, pair in NUMBERS["pairs"].items()
        for case in pair["cases"]
    ],
)
def test_numbers_count_as_llama_server_reads_and_writes_them(vocab: str, case: dict[str, Any]) -> None:
    # Integers past int64 wrap or become doubles (nlohmann::json, then int64_t); tojson writes a double through a
    # C++ stream (six significant digits), in tool-call arguments and tool schemas.
    assets.require_assets()
    counter = _counter(vocab, NUMBERS["recorded"])
    messages, tools = copy.deepcopy(case["messages"]), copy.deepcopy(case["tools"])
    if case["prompt_tokens"] is None:
        with pytest.raises((InvalidMessage, CountingError)):
            counter.count(messages, tools=tools)
        return
    assert counter.render(messages, tools=tools) == case["prompt"]
    assert counter.count(messages, tools=tools) == case["prompt_tokens"]
    assert (messages, tools) == (case["messages"], case["tools"])


@pytest.mark.parametrize(("vocab", "case"), _recorded_cases())
def test_llamacpp_dialect_counts_what_llama_server_counted(vocab: str, case: dict[str, Any]) -> None:
    assets.require_assets()
    counter = _counter(vocab)
    messages, tools = copy.deepcopy(case["messages"]), copy.deepcopy(case["tools"])
    if case["prompt_tokens"] is None:
        # The server refused the request: so does the count, with a typed error.
        with pytest.raises((InvalidMessage, CountingError)):
            counter.count(messages, tools=tools)
        return
    assert counter.count(messages, tools=tools) == case["prompt_tokens"]
    assert counter.render(messages, tools=tools) == case["prompt"]
    assert (messages, tools) == (case["messages"], case["tools"])  # nothing the caller gave is changed


@pytest.mark.parametrize(
    ("vocab", "case"),
    [
        pytest.param(vocab, case, id=f"{vocab}-{case['name']}")
        for vocab, pair in CONTINUED["pairs"].items()
        for case in pair["cases"]
    ],
)
def test_a_continued_final_message_with_reasoning_counts_as_llama_server_counted(
    vocab: str, case: dict[str, Any]
) -> None:
    # Reasoning and no content: the server continues inside the open reasoning block; reasoning and content: the
    # block is closed, then the content follows (templates without reasoning markers leave the reasoning out).
    assets.require_assets()
    assert [c["name"] for c in CONTINUED["pairs"][vocab]["cases"]] == [c["name"] for c in continuation_cases()]
    counter = _counter(vocab, CONTINUED["recorded"])
    assert counter.render(case["messages"]) == case["prompt"]
    assert counter.count(case["messages"]) == case["prompt_tokens"]


@functools.cache
def _engine_counter(server: str) -> Any:
    return load_counter(str(assets.tokenizer_dir("qwen2")), chat_template=ENGINE_TEMPLATE, server=server)


@pytest.mark.parametrize("case", ENGINE["cases"], ids=[case["name"] for case in ENGINE["cases"]])
def test_values_and_stripped_text_are_written_as_llama_servers_engine_writes_them(case: dict[str, Any]) -> None:
    # A template of our own writes every value an argument can hold ({{ v }}, 'c' ~ v, v | string) and strips text
    # every way (strip, lstrip, rstrip, trim): the render equals what llama-server rendered.
    assets.require_assets()
    assert _engine_counter("llama.cpp").render(case["messages"]) == case["prompt"]
    # ... and Python's engine writes some of them otherwise: the rules are what makes them equal.
    plain = _engine_counter("transformers")
    if case["name"] in ("values-floats", "values-nulls", "values-lists", "values-objects", "strip-mixed-space"):
        assert plain.render(case["messages"]) != case["prompt"]


def test_the_engine_recording_covers_every_probe() -> None:
    assert [case["name"] for case in ENGINE["cases"]] == [case["name"] for case in engine_cases()]
    assert all(case["prompt"] is not None for case in ENGINE["cases"])


def test_the_default_dialect_is_vllm_and_counts_as_before() -> None:
    assets.require_assets()
    fixture = RECORDED["qwen2"]
    plain = load_counter(str(assets.tokenizer_dir("qwen2")), chat_template=assets.template(fixture["template"]))
    named = load_counter(
        str(assets.tokenizer_dir("qwen2")), chat_template=assets.template(fixture["template"]), server="vllm"
    )
    assert plain.dialect is DIALECTS["vllm"]
    differ = 0
    for case in fixture["cases"]:
        count = plain.count(case["messages"], tools=case["tools"])
        assert named.count(case["messages"], tools=case["tools"]) == count
        differ += case["prompt_tokens"] is not None and count != case["prompt_tokens"]
    # vLLM's rules are not llama.cpp's: on this corpus they differ (developer role, tool triples, NFC, ...).
    assert differ >= 10


def test_the_registry_holds_the_contract_names() -> None:
    assert set(DIALECTS) == {"vllm", "sglang", "llama.cpp", "ollama", "lmstudio", "transformers", "openai"}
    assert all(isinstance(d, Dialect) and d.name == name for name, d in DIALECTS.items())
    assert dialect_of("llamacpp") is DIALECTS["llama.cpp"]
    assert dialect_of("LLaMA.cpp") is DIALECTS["llama.cpp"]
    assert dialect_of(None) is DIALECTS["vllm"]


def test_an_unknown_server_is_a_clear_error() -> None:
    with pytest.raises(ConfigurationError, match=r"unknown server dialect 'tgi'.*server= one of vllm"):
        dialect_of("tgi")


def test_mistral_tokenizers_refuse_a_template_dialect() -> None:
    with pytest.raises(ConfigurationError, match="mistral-common"):
        load_counter("mistral:tekken", server="llama.cpp")


def test_the_keeper_fits_with_the_server_dialect() -> None:
    assets.require_assets()
    fixture = RECORDED["qwen2"]
    case = next(case for case in fixture["cases"] if case["name"] == "developer")
    keeper = ck.ContextKeeper(
        str(assets.tokenizer_dir("qwen2")),
        chat_template=assets.template(fixture["template"]),
        context_window=4096,
        server="llama.cpp",
    )
    fit = keeper.fit(case["messages"], max_tokens=64)
    assert fit.tokens == case["prompt_tokens"]
    assert fit.messages == case["messages"]  # the caller's own format: the role stays "developer"


def test_the_transformers_dialect_is_the_serve_view() -> None:
    # transformers serve's own preprocessing, not the raw view (test_dialects_transformers.py checks its rules).
    assets.require_assets()
    counter = load_counter(str(assets.tokenizer_dir("qwen2")), server="transformers")
    assert counter.view == "server"


# ------------------------------------------------------------------------------------------------- live


@pytest.mark.server
@pytest.mark.parametrize("vocab", sorted(EVERY))
def test_live_llama_server_still_counts_the_recordings(vocab: str) -> None:
    server_context = live_llama_server(vocab)
    counter = load_counter(
        str(assets.tokenizer_dir(vocab_of(vocab))),
        chat_template=assets.template(EVERY[vocab]["template"]),
        server="llama.cpp",
    )
    with server_context as server:
        for case in cases() + number_cases():
            if (vocab, case["name"]) in ENGINE_DIFFERENCES:
                continue
            live = server.record(case)
            if live["prompt_tokens"] is None:
                with pytest.raises((InvalidMessage, CountingError)):
                    counter.count(case["messages"], tools=case["tools"])
            else:
                assert counter.count(case["messages"], tools=case["tools"]) == live["prompt_tokens"], case["name"]


@pytest.mark.server
def test_a_long_wrapped_chat_against_llama_server_counts_every_prompt_right() -> None:
    """60 turns through ``keeper.wrap`` with tools, tool calls and every script, fitted to the server's context:
    every prompt the server counts is the keeper's count, with no refusal and no drift warning."""
    import warnings

    import openai

    from server_corpus import ARGUMENTS, TEXTS, TOOL_SHAPES

    vocab, context = "qwen2", 2048
    template = RECORDED[vocab]["template"]
    tools = TOOL_SHAPES["tools-full"] + TOOL_SHAPES["tools-strict"] + TOOL_SHAPES["tools-name-only"]
    texts, arguments = list(TEXTS.values()), list(ARGUMENTS.values())[:-1]  # the server refuses invalid JSON
    with live_llama_server(vocab, context) as server:
        keeper = ck.ContextKeeper(
            str(assets.tokenizer_dir(vocab)),
            chat_template=assets.template(template),
            context_window=context,
            server="llama.cpp",
        )
        client = keeper.wrap(openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0))
        chat: list[dict[str, Any]] = [{"role": "developer", "content": "Answer briefly.\u3000"}]
        trimmed = 0
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a DriftWarning (or any other) fails the test
            for turn in range(60):
                chat.append({"role": "user", "content": f"{turn}: {texts[turn % len(texts)]}"})
                if turn % 4 == 3:
                    call = {
                        "id": f"c{turn}",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": arguments[turn % len(arguments)]},
                    }
                    chat.append({"role": "assistant", "content": None, "tool_calls": [call]})
                    chat.append({"role": "tool", "tool_call_id": f"c{turn}", "content": texts[(turn + 3) % 8]})
                reply = client.chat.completions.create(model="tiny", messages=chat, tools=tools, max_tokens=16)
                fit = keeper.last_fit
                assert fit is not None
                assert reply.usage is not None
                assert reply.usage.prompt_tokens == fit.tokens, turn
                trimmed += len(fit.messages) < len(chat)
                chat.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
    assert trimmed > 10  # the chat outgrew the context, so most late turns were fitted


@pytest.mark.parametrize("vocab", sorted(EVERY))
def test_the_dialects_fast_path_equals_its_whole_renders(vocab: str) -> None:
    """Message-by-message rendering and piece counting under llama.cpp's rules equal whole renders, and the whole
    prompt encoded at once, on every corpus case and on every prefix of a growing chat (a new turn each)."""
    assets.require_assets()
    from contextkeeper.tokens import HFChatTemplateCounter
    from contextkeeper.tokens.loading import load_hf_tokenizer

    fixture = EVERY[vocab]
    tokenizer = load_hf_tokenizer(str(assets.tokenizer_dir(fixture["vocab"])))
    made = {
        incremental: HFChatTemplateCounter(
            tokenizer,
            chat_template=assets.template(fixture["template"]),
            template_kwargs=_context(fixture),
            server="llama.cpp",
            incremental=incremental,
        )
        for incremental in (True, False)
    }
    fast, whole = made[True], made[False]
    for case in fixture["cases"]:
        if case["prompt_tokens"] is None:
            continue
        count = fast.count(case["messages"], tools=case["tools"])
        assert count == whole.count(case["messages"], tools=case["tools"])
        # ... and the whole prompt the server tokenizes, encoded in one piece by the Rust tokenizer.
        prompt = "".join(whole._prompt(case["messages"], case["tools"], True)[0])
        assert count == len(whole.tokenizer.backend_tokenizer.encode(prompt, add_special_tokens=False).ids)
        text = whole.render(case["messages"], tools=case["tools"])
        assert fast.render(case["messages"], tools=case["tools"]) == text
    grown = [m for case in fixture["cases"] if case["name"].startswith("system-") for m in case["messages"]]
    for end in range(1, len(grown) + 1):
        assert fast.count(grown[:end]) == whole.count(grown[:end]), end


@pytest.mark.server
def test_a_keeper_counting_for_vllm_names_the_llama_server_it_talks_to() -> None:
    import openai

    vocab = "qwen2"
    case = next(case for case in RECORDED[vocab]["cases"] if case["name"] == "nfd-latin")  # NFC (vLLM) or not
    with live_llama_server(vocab, 2048) as server:
        keeper = ck.ContextKeeper(
            str(assets.tokenizer_dir(vocab)),
            chat_template=assets.template(RECORDED[vocab]["template"]),
            context_window=2048,
        )
        client = keeper.wrap(openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0))
        with pytest.warns(ck.DriftWarning, match=r"The server is llama\.cpp.*server='llama\.cpp'"):
            client.chat.completions.create(model="tiny", messages=case["messages"], max_tokens=4)


@pytest.mark.server
def test_calibrate_names_every_rule_a_vllm_count_misses_and_agrees_under_llamacpp() -> None:
    vocab = "qwen2"
    template = assets.template(RECORDED[vocab]["template"])
    with live_llama_server(vocab, 4096) as server:
        default = ck.ContextKeeper(str(assets.tokenizer_dir(vocab)), chat_template=template, context_window=4096)
        report = default.calibrate(server.url)
        missed = {result.probe for result in report.differences}
        # Not developer-role: vLLM, too, makes Qwen3's developer message a system one (its template does not name
        # the role); not tool-without-description: vLLM's null description costs what llama.cpp's "" does.
        assert {"tool-strict", "whole-float-argument", "decomposed-text", "final-assistant"} <= missed
        assert "plain" not in missed
        assert all(result.cause == result.rule for result in report.differences)
        assert all(not result.cause for result in report.results if result.agrees)
        keeper = ck.ContextKeeper(
            str(assets.tokenizer_dir(vocab)), chat_template=template, context_window=4096, server="llama.cpp"
        )
        followed = keeper.calibrate(server.url)
        assert followed.differences == (), followed.to_dict()
        assert all(result.same_text for result in followed.results)


def test_calibrate_refuses_what_is_not_a_url() -> None:
    assets.require_assets()
    keeper = ck.ContextKeeper(str(assets.tokenizer_dir("qwen2")), context_window=4096)
    with pytest.raises(ConfigurationError, match="http"):
        keeper.calibrate("localhost:8080")


@pytest.mark.parametrize("command", ["count", "fit"])
def test_the_cli_counts_for_the_server_it_is_told(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from contextkeeper.cli import main

    assets.require_assets()
    fixture = RECORDED["qwen2"]
    case = next(case for case in fixture["cases"] if case["name"] == "final-assistant")
    messages = tmp_path / "messages.json"
    messages.write_text(json.dumps(case["messages"]), encoding="utf-8")
    chat_template = assets.ASSETS / "templates" / f"{fixture['template']}.jinja"
    argv = [command, "--tokenizer", str(assets.tokenizer_dir("qwen2")), "--chat-template", str(chat_template)]
    argv += ["--messages", str(messages), "--json"]
    if command == "fit":
        argv += ["--context", "4096", "--max-tokens", "64"]
    counts = {}
    for server in ("vllm", "llama.cpp"):
        assert main([*argv, "--server", server]) == 0
        counts[server] = json.loads(capsys.readouterr().out)["tokens"]
    assert counts == {"vllm": 36, "llama.cpp": case["prompt_tokens"]}  # vLLM's: tests/fixtures/vllm/qwen2.json


@pytest.mark.parametrize("server", ["vllm", "sglang", "llama.cpp"])
def test_the_breakdown_of_a_final_assistant_message_has_no_negative_slot(server: str) -> None:
    # SGLang makes the final assistant message a user one and llama.cpp continues it: both write fewer tokens
    # than the closed message, which the slots put on the request, not a negative template overhead.
    assets.require_assets()
    case = next(case for case in cases() if case["name"] == "final-assistant")
    counter = load_counter(
        str(assets.tokenizer_dir("qwen2")), chat_template=assets.template("Qwen-Qwen3-0.6B"), server=server
    )
    parts = ck.breakdown(counter, case["messages"])
    slots = (parts.system, parts.tools, parts.history, parts.request, parts.template_overhead)
    assert min(slots) >= 0
    assert sum(slots) == parts.tokens == counter.count(case["messages"])
