"""Learned state shared through a real Redis (started by the tests): server facts, detections, summaries."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

import assets
import contextkeeper as ck
from contextkeeper._exceptions import ConfigurationError
from contextkeeper.calls.shared import ServerFacts, SharedState, SharedUnavailable, SummaryClaim
from engines import RedisCluster, RedisServer
from openai_server import ChatServer
from recorded_servers import LLAMA, answering, qwen_keeper
from strategy_state import plain_chat

WORKER = Path(__file__).resolve().parents[1] / "shared_worker.py"


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


def _start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(WORKER), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _result(worker: subprocess.Popen[str], timeout: float = 120) -> dict[str, object]:
    out, err = worker.communicate(timeout=timeout)
    assert worker.returncode == 0, err[-2000:]
    return dict(json.loads(out.strip().splitlines()[-1]))


def _run(*args: str) -> dict[str, object]:
    return _result(_start(*args))


def test_server_facts_round_trip_and_expire(redis_server: RedisServer) -> None:
    shared = SharedState(redis_server.url, ttl=0.3)
    facts = ServerFacts(limit=1024, hidden=40, measured=40, confirmed=False, kind="vllm")
    shared.learn_server("http://example.test/v1", facts)
    shared.flush()
    assert SharedState(redis_server.url).server("http://example.test/v1") == facts
    time.sleep(0.5)
    assert shared.server("http://example.test/v1") is None  # a cache: it runs out
    shared.close()


def test_a_second_process_is_never_refused_for_what_the_first_learned(redis_server: RedisServer) -> None:
    assets.require_assets()
    tokenizer = str(assets.tokenizer_dir("qwen2"))
    url = f"redis://127.0.0.1:{redis_server.port}/1"  # a database of its own: no facts from other tests
    with ChatServer(tokenizer, max_model_len=1024, hidden_tokens=40) as server:
        first = _run("learn", url, server.base_url, tokenizer)
        assert first["attempts"] == 2, first  # refused once: it learned the limit and the hidden tokens
        assert server.rejected == 1
        # The second process, and beside it one without shared state (the control: it is refused again).
        workers = _start("learn", url, server.base_url, tokenizer), _start("learn", "off", server.base_url, tokenizer)
        second, alone = (_result(worker) for worker in workers)
        assert second["attempts"] == 1, second  # the second process was never refused
        assert second["withheld"] == first["withheld"] == 4096 - 1024 + 40
        assert alone["attempts"] == 2, alone
        assert server.rejected == 2
        assert all(r.prompt_tokens <= 1024 for r in server.requests if r.status == 200)


def test_a_running_replica_takes_what_another_learned_with_its_admission(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replicas with ``ledger=`` on the shared state's Redis: once a replica has read the server's facts, each later
    call gets them with its admission (no read of its own), and is not refused for what another replica learned
    meanwhile."""

    assets.require_assets()
    tokenizer = str(assets.tokenizer_dir("qwen2"))
    url = f"redis://127.0.0.1:{redis_server.port}/2"
    pool = f"facts-{time.monotonic_ns()}"
    chat = plain_chat(30)
    with ChatServer(tokenizer, max_model_len=1024, hidden_tokens=40) as server:
        keepers = [ck.ContextKeeper(tokenizer, context_window=4096, ledger=url, ledger_pool=pool) for _ in range(2)]
        running, learning = (
            keeper.wrap(openai.OpenAI(base_url=server.base_url, api_key="t", max_retries=0), backoff=0)
            for keeper in keepers
        )
        running.chat.completions.create(model="m", messages=chat[:3], max_tokens=64)  # short: nothing to learn
        assert keepers[0].calls.facts_ledger is keepers[0].ledger
        learning.chat.completions.create(model="m", messages=chat, max_tokens=64)
        assert keepers[1].last_call is not None
        assert keepers[1].last_call.attempts == 2  # refused once: it learned
        keepers[1].shared.flush()
        shared, reads = keepers[0].shared, []
        monkeypatch.setattr(shared, "server", lambda name: reads.append(name) or SharedState.server(shared, name))
        running.chat.completions.create(model="m", messages=chat, max_tokens=64)
        report = keepers[0].last_call
        assert report is not None
        assert report.attempts == 1, report  # never refused
        assert report.withheld == 4096 - 1024 + 40
        assert reads == []  # the facts came with the admission: no read of their own
        assert server.rejected == 1
        for keeper in keepers:
            keeper.close()


def test_one_conversation_fitted_by_four_processes_is_summarised_once(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    assets.require_assets()
    tokenizer = str(assets.tokenizer_dir("qwen2"))
    conversation = f"conv-{time.monotonic_ns()}"
    # Each process marks itself ready in tmp_path and starts fitting when all four are.
    args = ["summarize", redis_server.url, tokenizer, str(tmp_path), conversation]
    workers = [_start(*args) for _ in range(4)]
    results = [_result(worker) for worker in workers]
    assert sum(int(r["calls"]) for r in results) == 1, results  # exactly one summary call for these sources
    for result in results:
        (detail,) = result["summarize"]
        assert detail.startswith("replaced"), result
    assert len({r["tokens"] for r in results}) == 1  # every process sent the same prompt
    waited = [r for r in results if not r["calls"]]
    assert any("written by another process" in r["summarize"][0] for r in waited), results


def test_a_busy_conversation_is_waited_for_then_left_to_the_window(redis_server: RedisServer) -> None:
    shared = SharedState(redis_server.url, summary_wait=0.3)
    share = shared.conversation(f"busy-{time.monotonic_ns()}")
    claim = share.claim("sources-a")
    assert claim is not None
    assert not isinstance(claim, str)
    started = time.monotonic()
    assert share.claim("sources-a") is None  # another holder: waited, then gave up
    assert 0.3 <= time.monotonic() - started < 2
    share.store("sources-a", "the summary")
    claim.release()
    assert share.claim("sources-a") == "the summary"
    assert share.find(["sources-a", "sources-b"]) == {"sources-a": "the summary"}
    shared.close()


def test_a_detection_is_asked_once_for_every_replica(redis_server: RedisServer) -> None:
    assets.require_assets()
    url = f"redis://127.0.0.1:{redis_server.port}/2"
    SharedState(url).client.flushdb()
    first, second = qwen_keeper(server="auto", shared=url), qwen_keeper(server="auto", shared=url)
    with answering(LLAMA["answers"]) as base:
        first.wrap(openai.OpenAI(base_url=base, api_key="x", max_retries=0))
        second.wrap(openai.OpenAI(base_url=base, api_key="x", max_retries=0))
        asked = list(base.asked)
    assert asked == ["/v1/models"]  # the second replica read the answer from Redis
    assert second.server.name == first.server.name == "llama.cpp"
    assert second.detection == first.detection


def test_an_unreachable_redis_fails_loudly_or_is_a_warning(redis_server: RedisServer) -> None:
    redis_server.port  # noqa: B018 - the module's server stays up; this URL points where nothing listens
    dead = "redis://127.0.0.1:9/0"
    keeper = ck.ContextKeeper("mistral:tekken", context_window=4000, shared=dead, summarizer=lambda call: "x")
    with pytest.raises(SharedUnavailable, match=r"shared state at redis://127\.0\.0\.1:9/0 cannot be reached"):
        keeper.fit([{"role": "user", "content": "hi"}])
    local = ck.ContextKeeper(
        "mistral:tekken", context_window=4000, shared=dead, shared_unavailable="local", summarizer=lambda call: "x"
    )
    with pytest.warns(UserWarning, match="shared_unavailable='local'"):
        assert local.fit([{"role": "user", "content": "hi"}]).tokens > 0
    assert local.shared is None


def test_bad_shared_settings_are_typed_errors() -> None:
    with pytest.raises(ConfigurationError, match="shared must be a Redis URL"):
        ck.ContextKeeper("mistral:tekken", context_window=4000, shared="postgresql://x/y")
    with pytest.raises(ConfigurationError, match="shared_unavailable must be"):
        ck.ContextKeeper("mistral:tekken", context_window=4000, shared_unavailable="ignore")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="summary_wait must be a positive number"):
        SharedState("redis://127.0.0.1:9/0", summary_wait=0)


def test_a_redis_ledger_shares_learned_state_by_default(redis_server: RedisServer) -> None:
    keeper = ck.ContextKeeper("mistral:tekken", context_window=4000, ledger=redis_server.url)
    assert isinstance(keeper.shared, SharedState)
    assert keeper.shared.url == redis_server.url
    off = ck.ContextKeeper("mistral:tekken", context_window=4000, ledger=redis_server.url, shared=False)
    assert off.shared is None
    keeper.close()


def test_shared_state_on_a_redis_cluster() -> None:
    with RedisCluster() as cluster:
        shared = SharedState(cluster.url)
        facts = ServerFacts(limit=2048, hidden=12, measured=12)
        shared.learn_server("http://a.test/v1", facts)
        shared.flush()
        assert SharedState(cluster.url).server("http://a.test/v1") == facts
        share = shared.conversation("user-42")
        claim = share.claim("src")
        assert isinstance(claim, SummaryClaim)  # a script and keys of one slot: the lease works on a cluster
        share.store("src", "summary of src")
        claim.release()
        assert share.find(["src", "other"]) == {"src": "summary of src"}
        assert share.claim("src") == "summary of src"
        shared.close()
