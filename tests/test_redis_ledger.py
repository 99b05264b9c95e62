"""The shared KV ledger on a real Redis (started by the tests): one pool for every process, leases, fencing."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

import contextkeeper as ck
from contextkeeper._exceptions import ConfigurationError
from contextkeeper.ledger import AdmissionTimeout, Ledger
from contextkeeper.redis_ledger import LedgerUnavailable, RedisLedger
from engines import RedisServer

WORKER = Path(__file__).parent / "ledger_worker.py"


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture
def pool(request: pytest.FixtureRequest) -> str:
    return f"t-{request.node.name[:40]}-{time.monotonic_ns()}"


def test_two_ledgers_of_one_pool_admit_against_one_capacity(redis_server: RedisServer, pool: str) -> None:
    first = RedisLedger(redis_server.url, 1000, pool=pool)
    second = RedisLedger(redis_server.url, 1000, pool=pool)
    with first.admit(700) as held:
        assert second.available() == 300
        with pytest.raises(AdmissionTimeout):
            second.acquire(400, timeout=0.2)
        with second.admit(300):
            assert first.available() == 0
        assert held.tokens == 700
    assert second.available() == 1000
    assert second.stats()["peak"] == 1000
    first.close()
    second.close()


def test_the_pool_keeps_the_first_capacity(
    redis_server: RedisServer, pool: str, caplog: pytest.LogCaptureFixture
) -> None:
    RedisLedger(redis_server.url, 1000, pool=pool).close()
    other = RedisLedger(redis_server.url, 5000, pool=pool)
    assert other.capacity == 1000
    assert "already has a capacity of 1,000 tokens" in caplog.text
    with pytest.raises(ck.ExceedsCapacity):
        other.acquire(1500)
    other.close()


def test_shrink_admits_what_is_free_in_the_pool(redis_server: RedisServer, pool: str) -> None:
    holder = RedisLedger(redis_server.url, 1000, pool=pool)
    shrinking = RedisLedger(redis_server.url, 1000, pool=pool, mode="shrink")
    with holder.admit(800), shrinking.admit(500, minimum=100) as ticket:
        assert (ticket.tokens, ticket.shrunk) == (200, True)
        ticket.resize(150)
        assert holder.available() == 50
        with pytest.raises(ck.ExceedsCapacity):
            ticket.resize(300)
    holder.close()
    shrinking.close()


def test_first_come_first_served_across_ledgers(redis_server: RedisServer, pool: str) -> None:
    # A large call waiting at the head is not overtaken by a small one that came later from another process.
    holder, big, small = (RedisLedger(redis_server.url, 1000, pool=pool, poll=0.01) for _ in range(3))
    order: list[str] = []
    held = holder.acquire(900)

    def take(ledger: RedisLedger, tokens: int, name: str) -> None:
        with ledger.admit(tokens, timeout=10):
            order.append(name)
            time.sleep(0.05)

    first = threading.Thread(target=take, args=(big, 500, "big"))
    first.start()
    time.sleep(0.2)  # the big call is queued first
    second = threading.Thread(target=take, args=(small, 50, "small"))
    second.start()
    time.sleep(0.2)
    assert order == []  # 100 tokens are free, but the small call waits behind the big one
    held.release()
    first.join(10)
    second.join(10)
    assert order == ["big", "small"]
    for ledger in (holder, big, small):
        ledger.close()


def test_async_admission_shares_the_pool(redis_server: RedisServer, pool: str) -> None:
    sync, other = RedisLedger(redis_server.url, 1000, pool=pool), RedisLedger(redis_server.url, 1000, pool=pool)

    async def main() -> list[int]:
        held = sync.acquire(600)
        waiting = asyncio.ensure_future(other.acquire_async(600, timeout=5))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        held.release()
        ticket = await waiting
        grants = [ticket.tokens, other.available() or 0]
        ticket.release()
        return grants

    assert asyncio.run(main()) == [600, 400]
    assert asyncio.run(main()) == [600, 400]  # a second event loop: the ledger makes its client there
    sync.close()
    other.close()


def test_a_stale_holder_cannot_release_what_the_pool_took_back(redis_server: RedisServer, pool: str) -> None:
    frozen = RedisLedger(redis_server.url, 1000, pool=pool, lease=0.3)
    frozen._stop.set()  # a process that froze: no heartbeat
    stale = frozen.acquire(800)
    time.sleep(0.5)
    live = RedisLedger(redis_server.url, 1000, pool=pool)
    with live.admit(900) as ticket:  # the pool took the 800 back when their lease ran out
        stale.release()  # fenced: gives nothing back twice
        assert stale.expired
        assert live.available() == 100
        assert ticket.tokens == 900
    live.close()
    frozen.close()


def test_a_killed_process_gives_its_tokens_back_within_the_lease(redis_server: RedisServer, pool: str) -> None:
    command = [sys.executable, str(WORKER), redis_server.url, pool, "1000", "hold", "700", "1.0"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "held"
        ledger = RedisLedger(redis_server.url, 1000, pool=pool)
        time.sleep(1.5)  # the heartbeat keeps a live process's tokens held past the lease
        assert ledger.available() == 300
        os.kill(process.pid, signal.SIGKILL)
        process.wait(5)
        killed = time.monotonic()
        with ledger.admit(1000, timeout=5):
            back = time.monotonic() - killed
        assert back < 1.0 + 0.5  # the lease, and the heartbeat's last renewal at most a third of it before
        ledger.close()
    finally:
        process.kill()
        process.wait(5)


def test_processes_and_threads_never_hold_more_than_the_pool(redis_server: RedisServer, pool: str) -> None:
    """4 processes x 8 threads admit and release for 8 s; the server-side peak never passes the capacity."""
    capacity = 2000
    RedisLedger(redis_server.url, capacity, pool=pool).close()
    workers = [
        subprocess.Popen(
            [sys.executable, str(WORKER), redis_server.url, pool, str(capacity), "8", "8", str(seed)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for seed in range(4)
    ]
    watcher = RedisLedger(redis_server.url, capacity, pool=pool)
    highest = 0
    while any(worker.poll() is None for worker in workers):
        highest = max(highest, watcher.stats()["active"])
        time.sleep(0.01)
    results = [json.loads(worker.communicate(timeout=30)[0].strip().splitlines()[-1]) for worker in workers]
    stats = watcher.stats()
    watcher.close()
    assert all(result["errors"] == 0 for result in results), results
    assert sum(result["admitted"] for result in results) > 200
    assert highest <= capacity
    assert stats["peak"] <= capacity  # the server's own high-water mark
    assert stats["active"] == 0
    assert stats["peak"] > capacity // 2  # the pool was really contended


def test_an_unreachable_redis_is_a_typed_error(redis_server: RedisServer) -> None:
    with pytest.raises(LedgerUnavailable, match="ledger_unavailable='local'"):
        RedisLedger("redis://127.0.0.1:9/0", 1000)


def test_a_redis_restart_is_an_error_then_the_pool_again(pool: str) -> None:
    with RedisServer() as server:
        ledger = RedisLedger(server.url, 1000, pool=pool)
        server.stop()
        started = time.monotonic()
        with pytest.raises(LedgerUnavailable):
            ledger.acquire(100, timeout=2)
        assert time.monotonic() - started < 15  # nothing hangs
        server.start()
        ticket = ledger.acquire(300)
        server.stop()
        ticket.release()  # a finished call is not turned into a failure: the lease gives the tokens back
        assert ticket.released
        server.start()  # back, empty: the pool's capacity is stored again by the next admission
        with ledger.admit(900) as ticket:
            assert ticket.tokens == 900
        ledger.close()


def test_the_keeper_admits_through_the_shared_ledger(redis_server: RedisServer, pool: str) -> None:
    import assets

    assets.require_assets()
    keeper = ck.ContextKeeper(
        str(assets.tokenizer_dir("qwen2")), context_window=4096, kv_capacity=5000, ledger=redis_server.url,
        ledger_pool=pool,
    )  # fmt: skip
    assert isinstance(keeper.ledger, RedisLedger)
    assert keeper.ledger.capacity == 5000
    from openai_server import ChatServer

    with ChatServer(assets.tokenizer_dir("qwen2")) as server:
        client = keeper.wrap(openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0))
        reply = client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "hi"}])
    assert reply.usage is not None
    stats = keeper.ledger.stats()
    assert (stats["active"], stats["admitted"]) == (0, 1)
    assert stats["peak"] >= reply.usage.prompt_tokens
    local = ck.ContextKeeper(
        str(assets.tokenizer_dir("qwen2")), context_window=4096, kv_capacity=5000, ledger="redis://127.0.0.1:9/0",
        ledger_unavailable="local",
    )  # fmt: skip
    with pytest.warns(UserWarning, match="admits per process"):
        assert type(local.ledger) is Ledger
    failing = ck.ContextKeeper(
        str(assets.tokenizer_dir("qwen2")), context_window=4096, kv_capacity=5000, ledger="redis://127.0.0.1:9/0"
    )
    with pytest.raises(LedgerUnavailable):
        _ = failing.ledger
    with pytest.raises(ConfigurationError, match="ledger_unavailable"):
        ck.ContextKeeper(str(assets.tokenizer_dir("qwen2")), context_window=4096, ledger_unavailable="maybe")
