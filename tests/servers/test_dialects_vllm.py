"""The vllm and sglang dialects count what vLLM's and SGLang's own preprocessing counted (recorded fixtures).

tests/fixtures/vllm/ and tests/fixtures/sglang/ hold, for every case of tests/server_corpus.py on four tokenizer +
template pairs, the length of the prompt token ids and the prompt text that vLLM 0.33.0's and SGLang 0.5.23's own
chat-completions preprocessing made of it (or the error where they refused), recorded by scripts/record_vllm.py
with each server's code run in a separate environment (no engine, no GPU). ``pytest -m server`` records again
with those environments and compares.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

import assets
import contextkeeper as ck
from contextkeeper._exceptions import ChatTemplateError, InvalidMessage
from contextkeeper.servers.dialects import DIALECTS
from contextkeeper.tokens import HFChatTemplateCounter, load_counter
from contextkeeper.tokens.loading import load_hf_tokenizer
from server_corpus import cases

ROOT = Path(__file__).resolve().parents[2]
SERVERS = ("vllm", "sglang")
RECORDED = {
    server: {path.stem: json.loads(path.read_text(encoding="utf-8")) for path in sorted(folder.glob("*.json"))}
    for server in SERVERS
    if (folder := Path(__file__).resolve().parents[1] / "fixtures" / server).is_dir()
}
# What a refusal is here: the server's 400 as our typed errors (arguments that are not JSON; a template that
# raises on the messages, as Llama 3.3's does on more than one tool call).
REFUSALS = (InvalidMessage, ChatTemplateError)

_COUNTERS: dict[tuple[str, str], Any] = {}


def _counter(server: str, vocab: str) -> Any:
    if (server, vocab) not in _COUNTERS:
        template = assets.template(RECORDED[server][vocab]["template"])
        _COUNTERS[server, vocab] = load_counter(str(assets.tokenizer_dir(vocab)), chat_template=template, server=server)
    return _COUNTERS[server, vocab]


def _recorded_cases() -> list[Any]:
    return [
        pytest.param(server, vocab, case, id=f"{server}-{vocab}-{case['name']}")
        for server, fixtures in RECORDED.items()
        for vocab, fixture in fixtures.items()
        for case in fixture["cases"]
    ]


def test_the_recordings_cover_the_corpus_on_the_four_pairs_of_the_llama_server_recordings() -> None:
    assert set(RECORDED) == set(SERVERS)
    llama = {
        path.stem: json.loads(path.read_text(encoding="utf-8"))["template"]
        for path in (Path(__file__).resolve().parents[1] / "fixtures" / "llama_server").glob("*.json")
    }
    names = [case["name"] for case in cases()]
    for server, fixtures in RECORDED.items():
        assert {vocab: fixture["template"] for vocab, fixture in fixtures.items()} == llama, server
        for fixture in fixtures.values():
            assert fixture["server"].startswith(f"{server} ")
            assert [case["name"] for case in fixture["cases"]] == names
            # The recorder stores the corpus case beside the server's answer: it is the corpus as it is today.
            assert [(c["messages"], c["tools"]) for c in fixture["cases"]] == [
                (c["messages"], c["tools"]) for c in cases()
            ]


@pytest.mark.parametrize(("server", "vocab", "case"), _recorded_cases())
def test_the_dialect_counts_and_renders_what_the_server_did(server: str, vocab: str, case: dict[str, Any]) -> None:
    assets.require_assets()
    counter = _counter(server, vocab)
    messages, tools = copy.deepcopy(case["messages"]), copy.deepcopy(case["tools"])
    if case["prompt_tokens"] is None:
        with pytest.raises(REFUSALS) as refused:
            counter.count(messages, tools=tools)
        assert refused.value.fix_text(), refused.value  # says which setting or change fixes it
    else:
        assert counter.count(messages, tools=tools) == case["prompt_tokens"]
        assert counter.render(messages, tools=tools) == case["prompt"]
    assert (messages, tools) == (case["messages"], case["tools"])  # nothing the caller gave is changed


@pytest.mark.parametrize("server", SERVERS)
@pytest.mark.parametrize("vocab", ["qwen2", "llama-bpe"])
def test_the_fast_path_equals_whole_renders_under_the_servers_rules(server: str, vocab: str) -> None:
    """Message-by-message rendering and piece counting equal whole renders with the list-level rules (system
    messages merged, a final assistant message sent as a user's) on every recorded case and every prefix of a
    growing chat that has a developer message and ends on assistant turns."""
    assets.require_assets()
    fixture = RECORDED[server][vocab]
    tokenizer = load_hf_tokenizer(str(assets.tokenizer_dir(vocab)))
    fast, whole = (
        HFChatTemplateCounter(
            tokenizer, chat_template=assets.template(fixture["template"]), server=server, incremental=incremental
        )
        for incremental in (True, False)
    )
    for case in fixture["cases"]:
        if case["prompt_tokens"] is not None:
            assert fast.count(case["messages"], tools=case["tools"]) == case["prompt_tokens"], case["name"]
            assert whole.count(case["messages"], tools=case["tools"]) == case["prompt_tokens"], case["name"]
    grown = [{"role": "developer", "content": "Be brief."}]
    grown += [m for case in fixture["cases"] if case["name"].startswith("system-") for m in case["messages"][1:]]
    for end in range(1, len(grown) + 1):
        assert fast.count(grown[:end]) == whole.count(grown[:end]), end
        assert fast.render(grown[:end]) == whole.render(grown[:end]), end


def test_a_developer_message_is_counted_as_vllm_merges_it_and_returned_as_sent() -> None:
    """vLLM renames developer to system for a template that does not name the role and merges every system
    message into the first (Qwen3's template keeps only a first system message): the count is vLLM's, and the
    fitted messages stay in the caller's own format."""
    assets.require_assets()
    fixture = RECORDED["vllm"]["qwen2"]
    case = next(case for case in fixture["cases"] if case["name"] == "developer-and-system")
    keeper = ck.ContextKeeper(
        str(assets.tokenizer_dir("qwen2")), chat_template=assets.template(fixture["template"]), context_window=4096
    )
    fit = keeper.fit(case["messages"], max_tokens=64)
    assert fit.tokens == case["prompt_tokens"]
    assert fit.messages == case["messages"]
    assert "You are a helper.\n\nAnswer in French." in keeper.counter.render(case["messages"])


def test_tool_schemas_are_dumped_as_each_servers_request_model_dumps_them() -> None:
    tool = {
        "function": {"parameters": {"type": "object"}, "name": "f", "strict": True, "x-extra": 1},
        "type": "function",
    }
    assert DIALECTS["vllm"].prepare_tools([tool]) == [
        {
            "type": "function",
            "function": {"name": "f", "description": None, "parameters": {"type": "object"}, "strict": True},
        }
    ]
    sglang = DIALECTS["sglang"].prepare_tools([tool])
    assert sglang == [
        {
            "type": "function",
            "function": {"parameters": {"type": "object"}, "name": "f", "strict": True, "description": None},
            "defer_loading": None,
        }
    ]
    assert list(sglang[0]["function"]) == ["parameters", "name", "strict", "description"]
    assert tool == {
        "function": {"parameters": {"type": "object"}, "name": "f", "strict": True, "x-extra": 1},
        "type": "function",
    }


def test_sglang_refuses_tool_call_arguments_that_are_not_json_whatever_the_template() -> None:
    assets.require_assets()
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c", "content": "sunny"},
    ]
    # Phi-3.5's template never reads tool calls; SGLang parses them before templating all the same.
    counter = _counter("sglang", "phi-3")
    with pytest.raises(InvalidMessage, match=r"not JSON.*sglang refuses.*Fix:"):
        counter.count(messages)
    assert _counter("vllm", "phi-3").count(messages) > 0  # vLLM renders {} instead


# ------------------------------------------------------------------------------------------------- live


def _server_python(server: str) -> Path | None:
    """The Python of the separate environment that holds ``server`` (CK_VLLM_PYTHON / CK_SGLANG_PYTHON, or the
    environment docs/dialects.md makes), or None."""
    given = os.environ.get(f"CK_{server.upper()}_PYTHON", "").strip()
    python = Path(given) if given else Path(f"/work/{server}-venv/bin/python")
    return python if python.exists() else None


@pytest.mark.server
@pytest.mark.parametrize("server", SERVERS)
def test_the_servers_own_preprocessing_still_makes_the_recordings(server: str) -> None:
    python = _server_python(server)
    if python is None:
        pytest.skip(f"no {server} environment: set CK_{server.upper()}_PYTHON (see docs/dialects.md)")
    done = subprocess.run(
        [str(python), str(ROOT / "scripts" / "record_vllm.py"), "--server", server, "--check"],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert done.stdout.count(" 0 differ") == len(RECORDED[server]), done.stdout
