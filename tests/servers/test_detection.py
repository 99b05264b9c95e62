"""Server detection (``server="auto"``): what a real server answers tells the keeper whose preprocessing to count.

The llama-server answers in tests/fixtures/detection/ were recorded from the real server
(``python scripts/record_llama_server.py --only qwen2 --answers``) and are served again here by a loopback HTTP
server; ``pytest -m server`` asks a live llama-server. The other servers' answers are the shapes their sources
define (detection.OWNERS names the file of each).
"""

from __future__ import annotations

import copy
import socket
import warnings
from typing import Any

import openai
import pytest

import assets
import contextkeeper as ck
from contextkeeper._exceptions import ConfigurationError
from contextkeeper.servers.detection import detect_server
from openai_server import ChatServer
from recorded_servers import LLAMA, QWEN, SERVE, VLLM, answering, live_llama_server, qwen_keeper


def test_the_recorded_llama_server_is_told_by_its_models_list() -> None:
    with answering(LLAMA["answers"]) as url:
        found = detect_server(url)
    assert (found.server, found.asked) == ("llama.cpp", ("/v1/models",))
    assert found.evidence == "GET /v1/models: owned_by 'llamacpp'"


def test_the_recorded_transformers_serve_is_told_by_its_model_cards() -> None:
    with answering(SERVE["answers"]) as url:
        found = detect_server(url)
    assert (found.server, found.asked) == ("transformers", ("/v1/models",))
    assert found.evidence == 'GET /v1/models: a model card with status {"value": "loaded"}'


def test_the_recorded_vllm_is_told_by_its_models_list_and_by_its_version() -> None:
    with answering(VLLM["answers"]) as url:
        found = detect_server(url)
    assert (found.server, found.evidence) == ("vllm", "GET /v1/models: owned_by 'vllm'")
    answers = copy.deepcopy(VLLM["answers"])
    del answers["/v1/models"]
    with answering(answers) as url:
        found = detect_server(url)
    assert (found.server, found.asked[-1], found.evidence) == ("vllm", "/version", "GET /version: version 0.33.0")


def test_a_llama_server_without_owned_by_is_told_by_its_props() -> None:
    answers = copy.deepcopy(LLAMA["answers"])
    for card in answers["/v1/models"]["json"]["data"]:
        card["owned_by"] = "someone"
    with answering(answers) as url:
        found = detect_server(url)
    assert (found.server, found.asked) == ("llama.cpp", ("/v1/models", "/props"))
    assert found.evidence.startswith("GET /props: build ")


@pytest.mark.parametrize(
    ("answers", "server", "asked"),
    [
        # each server's own models card (their sources: see detection.OWNERS)
        ({"/v1/models": {"status": 200, "json": {"data": [{"id": "m", "owned_by": "vllm"}]}}}, "vllm", 1),
        ({"/v1/models": {"status": 200, "json": {"data": [{"id": "m", "owned_by": "sglang"}]}}}, "sglang", 1),
        ({"/v1/models": {"status": 200, "json": {"data": [{"id": "m", "owned_by": "library"}]}}}, "ollama", 1),
        (
            {"/v1/models": {"status": 200, "json": {"data": [{"id": "m", "owned_by": "organization_owner"}]}}},
            "lmstudio",
            1,
        ),
        # no models list that tells: the endpoints only one server has
        ({"/api/version": {"status": 200, "json": {"version": "0.12.3"}}}, "ollama", 3),
        ({"/get_server_info": {"status": 200, "json": {"model_path": "m", "version": "0.5"}}}, "sglang", 4),
        ({"/version": {"status": 200, "json": {"version": "0.33.0"}}}, "vllm", 5),
    ],
)
def test_each_server_is_told_by_the_answer_only_it_gives(
    answers: dict[str, dict[str, Any]], server: str, asked: int
) -> None:
    with answering(answers) as url:
        found = detect_server(url)
    assert found.server == server
    assert len(found.asked) == asked


def test_owners_of_two_kinds_tell_nothing() -> None:
    cards = [{"id": "a", "owned_by": "vllm"}, {"id": "b", "owned_by": "llamacpp"}]  # a router in front of both
    with answering({"/v1/models": {"status": 200, "json": {"data": cards}}}) as url:
        assert detect_server(url).server is None


def test_a_hosted_api_is_told_by_its_address_without_a_request() -> None:
    # api.openai.com cannot be reached from the tests; a request would be a TransportError
    found = detect_server("https://api.openai.com/v1")
    assert (found.server, found.asked) == ("openai", ())


def test_auto_counts_for_the_llama_server_it_wraps() -> None:
    assets.require_assets()
    decomposed = next(case for case in QWEN["cases"] if case["name"] == "nfd-latin")
    keeper = qwen_keeper(server="auto")
    assert keeper.server.name == "vllm"  # until it has asked
    assert keeper.counter.count(decomposed["messages"]) != decomposed["prompt_tokens"]
    with answering(LLAMA["answers"]) as url, warnings.catch_warnings():
        warnings.simplefilter("error")
        keeper.wrap(openai.OpenAI(base_url=url, api_key="secret", max_retries=0))
        asked = list(url.asked)
    assert keeper.server.name == "llama.cpp"
    assert keeper.counter.dialect.name == "llama.cpp"  # type: ignore[attr-defined]
    assert keeper.detection.evidence == "GET /v1/models: owned_by 'llamacpp'"
    assert asked == ["/v1/models"]
    # the count llama-server made of this NFD text (recorded), where vLLM's rules (NFC) count 13 fewer
    assert keeper.fit(decomposed["messages"]).report.tokens == decomposed["prompt_tokens"]


def test_auto_asks_once_and_a_named_server_never_asks() -> None:
    assets.require_assets()
    keeper, named = qwen_keeper(server="auto"), qwen_keeper(server="vllm")
    with answering(LLAMA["answers"]) as url:
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
        keeper.wrap(client)
        keeper.wrap(client)
        named.wrap(client)
        asked = list(url.asked)
    assert asked == ["/v1/models"]
    assert named.server.name == "vllm"


def test_a_server_that_tells_nothing_leaves_vllms_rules_with_a_warning() -> None:
    assets.require_assets()
    keeper = qwen_keeper(server="auto")
    with ChatServer(assets.tokenizer_dir("qwen2"), chat_template=assets.template(QWEN["template"])) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        with pytest.warns(
            ck.servers.DetectionWarning, match=r"could not tell.*asked /v1/models, /props.*Fix: ContextKeeper"
        ):
            wrapped = keeper.wrap(client)
        reply = wrapped.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "hi"}])
    assert keeper.server.name == "vllm"
    assert reply.usage.prompt_tokens == keeper.last_fit.report.tokens  # type: ignore[union-attr]


def test_an_unreachable_server_is_a_warning_not_a_failed_wrap() -> None:
    assets.require_assets()
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    keeper = qwen_keeper(server="auto")
    with pytest.warns(ck.servers.DetectionWarning, match=r"could not reach http://127\.0\.0\.1"):
        keeper.wrap(openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0))
    assert keeper.server.name == "vllm"


def test_auto_needs_a_counter_the_keeper_builds() -> None:
    assets.require_assets()
    counter = ck.load_counter(str(assets.tokenizer_dir("qwen2")))
    with pytest.raises(ConfigurationError, match="server= apply when the keeper builds the counter"):
        ck.ContextKeeper(tokenizer=counter, context_window=4096, server="auto")


def test_a_mistral_tokenizer_behind_llama_server_warns_and_counts_as_before() -> None:
    keeper = ck.ContextKeeper(tokenizer="mistral:tekken", context_window=4096, server="auto")
    before = keeper.counter
    warns = pytest.warns(ck.servers.DetectionWarning, match="found llama.cpp .* cannot count its way")
    with answering(LLAMA["answers"]) as url, warns:
        keeper.wrap(openai.OpenAI(base_url=url, api_key="x", max_retries=0))
    assert keeper.counter is before


@pytest.mark.server
def test_auto_against_a_live_llama_server_counts_what_it_counts() -> None:

    case = next(case for case in QWEN["cases"] if case["name"] == "developer")
    with live_llama_server("qwen2", 4096) as server:
        keeper = qwen_keeper(server="auto")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # neither a detection nor a drift warning
            client = keeper.wrap(openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0))
            reply = client.chat.completions.create(model="m", messages=case["messages"], max_tokens=1)
    assert keeper.server.name == "llama.cpp"
    assert reply.usage.prompt_tokens == keeper.last_fit.report.tokens  # type: ignore[union-attr]


@pytest.mark.server
def test_auto_and_calibrate_against_a_live_vllm_render_server() -> None:
    from vllm_render import VllmRender, tiny_model, vllm_python

    python = vllm_python()
    if python is None:
        pytest.skip("no vLLM environment: set CK_VLLM_PYTHON (see docs/dialects.md)")
    with VllmRender(python, tiny_model("qwen2")) as server:
        keeper = qwen_keeper(server="auto")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            keeper.wrap(openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0))
        assert (keeper.server.name, keeper.detection.evidence) == ("vllm", "GET /v1/models: owned_by 'vllm'")
        report = keeper.calibrate(server.url)  # vLLM's /tokenize with messages
        llama = qwen_keeper(server="llama.cpp").calibrate(server.url)
    assert report.differences == ()
    assert {r.probe for r in llama.differences} >= {"tool-strict", "decomposed-text", "final-assistant"}
    assert all(r.cause == r.rule for r in llama.differences)


def test_calibrate_names_the_endpoints_a_server_lacks() -> None:
    assets.require_assets()
    keeper = qwen_keeper()
    with ChatServer(assets.tokenizer_dir("qwen2"), chat_template=assets.template(QWEN["template"])) as server:
        message = r"counts no chat request on request \(asked: llama\.cpp /apply-template \+ /tokenize, vLLM or SGLang"
        with pytest.raises(ConfigurationError, match=message):
            keeper.calibrate(server.base_url)


def test_auto_outside_a_keeper_says_where_it_applies() -> None:
    with pytest.raises(ConfigurationError, match=r"'auto' is for ContextKeeper\(server='auto'\)"):
        ck.servers.dialect_of("auto")
