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
from typing import Any

import openai
import pytest

import contextkeeper as ck
from contextkeeper._exceptions import ConfigurationError
from contextkeeper.calls.ledger import AdmissionTimeout, Ledger
from contextkeeper.calls.redis_ledger import LedgerUnavailable, RedisLedger
from engines import RedisServer

WORKER = Path(__file__).resolve().parents[1] / "ledger_worker.py"


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
    with pytest.raises(ck.calls.ExceedsCapacity):
        other.acquire(1500)
    other.close()


def test_shrink_admits_what_is_free_in_the_pool(redis_server: RedisServer, pool: str) -> None:
    holder = RedisLedger(redis_server.url, 1000, pool=pool)
    shrinking = RedisLedger(redis_server.url, 1000, pool=pool, mode="shrink")
    with holder.admit(800), shrinking.admit(500, minimum=100) as ticket:
        assert (ticket.tokens, ticket.shrunk) == (200, True)
        ticket.resize(150)
        assert holder.available() == 50
        with pytest.raises(ck.calls.ExceedsCapacity):
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

    # 960 + 50 is over the capacity: once the big call is in, the small one waits for it to end, so the order
    # in which the two threads write down their admissions is the order of the admissions.
    first = threading.Thread(target=take, args=(big, 960, "big"))
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


@pytest.mark.parametrize("wait", [True, False], ids=["released", "released-behind"])
def test_a_stale_holder_cannot_release_what_the_pool_took_back(
    redis_server: RedisServer, pool: str, wait: bool
) -> None:
    frozen = RedisLedger(redis_server.url, 1000, pool=pool, lease=0.3)
    frozen._stop.set()  # a process that froze: no heartbeat
    stale = frozen.acquire(800)
    time.sleep(0.5)
    live = RedisLedger(redis_server.url, 1000, pool=pool)
    with live.admit(900) as ticket:  # the pool took the 800 back when their lease ran out
        stale.release(wait=wait)
        frozen.flush()  # (a release behind is sent now)
        assert stale.expired  # fenced: nothing given back twice
        assert live.available() == 100
        assert ticket.tokens == 900
    live.close()
    frozen.close()


def test_a_release_behind_goes_with_the_next_admission_or_on_its_own(redis_server: RedisServer, pool: str) -> None:
    ledger = RedisLedger(redis_server.url, 1000, pool=pool, poll=0.5)
    held = ledger.acquire(800)
    held.release(wait=False)
    assert held.released
    # The queued release goes with this admission's own script: its writer would send it only after `poll`.
    ticket = ledger.acquire(800, timeout=0.05)
    assert ticket.tokens == 800
    other = RedisLedger(redis_server.url, 1000, pool=pool)
    ticket.release(wait=False)  # and no admission of this ledger follows: its writer sends it within `poll`
    started = time.monotonic()
    with other.admit(1000, timeout=5):
        assert time.monotonic() - started < 0.5 + 0.5
    again = ledger.acquire(300)
    again.release(wait=False)
    assert ledger.available() == 1000  # this process's reads count its releases behind
    ledger.close()
    other.close()


def test_the_admission_reads_the_server_facts_stored_under_the_pool(redis_server: RedisServer, pool: str) -> None:
    ledger = RedisLedger(redis_server.url, 1000, pool=pool)
    key = ledger.facts_key("http://server.test/v1")
    assert key.startswith(f"{{ck:{pool}}}:")  # the pool's hash tag: one Cluster slot with the admission's keys
    with ledger.admit(10) as plain:
        assert plain.facts is None
    with ledger.admit(10) as none_yet:  # (through the same path as below, nothing stored)
        assert none_yet.facts is None
    ledger.client.hset(key, "replica-a", '{"limit":1024}')  # one field per writing replica
    ticket = ledger.acquire(10, facts="http://server.test/v1")
    assert ticket.facts == '[{"limit":1024}]'
    assert ledger.acquire(10, facts="http://other.test/v1").facts is None
    ledger.close()


def test_a_killed_process_gives_its_tokens_back_within_the_lease(redis_server: RedisServer, pool: str) -> None:
    command = [sys.executable, str(WORKER), "hold", redis_server.url, pool, "1000", "--tokens", "700", "--lease", "1"]
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


def _worker(url: str, pool: str, capacity: int, seed: int, log: Path, *extra: str) -> subprocess.Popen[str]:
    command = [sys.executable, str(WORKER), "churn", url, pool, str(capacity), "--seed", str(seed), *extra]
    with log.open("w") as stderr:  # its warnings (Redis down) go to a file: a full pipe would block the worker
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True)


def _held(client: Any, pool: str) -> dict[bytes, int]:
    return {fence: int(tokens) for fence, tokens in client.hgetall(f"{{ck:{pool}}}:held").items()}


def test_processes_and_threads_never_hold_more_than_the_pool(pool: str, tmp_path: Path) -> None:
    """The soak: 4 processes x 8 threads admit and release for ~30 s against one pool. The server-side active tokens,
    sampled every 50 ms, never pass the capacity; one process SIGKILLed mid-call gives its tokens back within the
    lease; while Redis is down (stopped and started again on its port) calls raise LedgerUnavailable, then are
    admitted again; every call ends admitted or with a typed error, and no worker hangs."""
    import redis

    capacity, lease, seconds = 2000, 2.0, 30.0
    kill_at, stop_at, down_for = 6.0, 12.0, 4.0  # the restart leaves ~10 s of churn after it
    with RedisServer() as server:
        RedisLedger(server.url, capacity, pool=pool).close()
        churn = ("--seconds", str(seconds), "--threads", "8", "--lease", str(lease))
        logs = [tmp_path / f"worker-{seed}.log" for seed in range(4)]
        # Worker 0 is the one killed: odd token counts (the others ask for even ones) tell its tickets apart in
        # Redis, and its calls hold longer, so it is surely mid-call when it dies.
        workers = [_worker(server.url, pool, capacity, 0, logs[0], *churn, "--odd", "--hold", "0.05,0.2")]
        workers += [_worker(server.url, pool, capacity, seed, logs[seed], *churn) for seed in (1, 2, 3)]
        watcher = RedisLedger(server.url, capacity, pool=pool)
        raw = redis.Redis.from_url(server.url, socket_timeout=5)
        started = time.monotonic()
        samples, highest, peaks = 0, 0, []
        killed_tokens, killed_at, returned_after, still_held_early = 0, 0.0, None, False
        down_at = up_at = 0.0
        unavailable_samples = 0
        try:
            while any(worker.poll() is None for worker in workers) and time.monotonic() - started < seconds + 40:
                now = time.monotonic() - started
                try:
                    state = watcher.stats()
                    samples += 1
                    assert state["active"] <= capacity, state  # never more than the pool, on the server
                    highest = max(highest, state["active"])
                    if not killed_at and now >= kill_at and any(n % 2 for n in _held(raw, pool).values()):
                        os.kill(workers[0].pid, signal.SIGKILL)
                        killed_at = time.monotonic()
                        workers[0].wait(5)
                        killed_tokens = sum(n for n in _held(raw, pool).values() if n % 2)
                    elif killed_at and returned_after is None:
                        odd = sum(n for n in _held(raw, pool).values() if n % 2)
                        still_held_early |= bool(odd) and time.monotonic() - killed_at >= 0.5
                        if not odd:
                            returned_after = time.monotonic() - killed_at
                except LedgerUnavailable:
                    unavailable_samples += 1
                if not down_at and now >= stop_at:
                    peaks.append(watcher.stats()["peak"])  # the server's own high-water mark, lost with it
                    down_at = time.time()
                    server.stop()
                elif down_at and not up_at and time.time() - down_at >= down_for:
                    up_at = time.time()  # recovery is counted from here: Redis's own start included
                    server.start()
                time.sleep(0.05)
            outputs = [worker.communicate(timeout=60)[0] for worker in workers[1:]]
            final = watcher.stats()
            peaks.append(final["peak"])
        finally:
            for worker in workers:
                worker.kill()
                worker.wait(5)
            watcher.close()
            raw.close()
    results = [json.loads(output.strip().splitlines()[-1]) for output in outputs]
    admitted = sum(result["admitted"] for result in results)
    recovered = [min(result["recoveries"]) - up_at for result in results if result["recoveries"]] or [-1.0]
    first_refusal = min((r["unavailable_first"] for r in results if r["unavailable_first"]), default=down_at)
    print(
        f"\nsoak: {admitted:,} calls admitted by the 3 survivors in {seconds:.0f} s "
        f"({sum(r['timeouts'] for r in results)} AdmissionTimeout, {sum(r['unavailable'] for r in results)} "
        f"LedgerUnavailable); {samples} samples, peak {max(highest, *peaks):,} / {capacity:,} tokens; killed worker "
        f"held {killed_tokens:,} tokens, back after {returned_after or 0:.2f} s (lease {lease:.0f} s); Redis down "
        f"{up_at - down_at:.1f} s, LedgerUnavailable from +{first_refusal - down_at:.2f}"
        f" s; first admission {min(recovered):.2f} s after Redis was started again (its start included), every "
        f"worker by {max(recovered):.2f} s"
    )
    for result, log in zip(results, logs[1:], strict=True):
        assert (result["errors"], result["hung"]) == (0, 0), (result, log.read_text()[-2000:])
        assert result["unavailable"] > 0  # with ledger_unavailable="fail": a typed error while Redis is down
        assert down_at <= result["unavailable_first"]
        assert result["unavailable_last"] <= up_at + 6  # a call in redis-py's retries when Redis came back
        assert result["recoveries"]
        assert min(result["recoveries"]) - up_at < 5.0  # admitted again after the restart
        assert result["admitted"] > 100
    assert killed_tokens > 0  # it died mid-call
    assert still_held_early  # nobody gave them back: the lease did
    assert returned_after is not None
    assert returned_after <= lease + 1.0
    assert max(highest, *peaks) <= capacity
    assert highest > capacity // 2  # the pool was really contended
    assert final["active"] == 0
    assert unavailable_samples > 0


def test_a_ticket_from_before_a_restart_cannot_release_one_from_after_it(pool: str) -> None:
    # Redis restarted empty forgets which ids it gave; ticket ids are the calls' own random ids, so fencing holds.
    with RedisServer() as server:
        old = RedisLedger(server.url, 1000, pool=pool)
        old._stop.set()  # frozen: no heartbeat books its ticket again after the restart (test_redis_ledger_restart)
        stale = old.acquire(300)
        server.stop()
        server.start()
        fresh = RedisLedger(server.url, 1000, pool=pool)
        with fresh.admit(800):
            stale.release()
            assert stale.expired  # nothing of the new pool was given back
            assert fresh.available() == 200
        old.close()
        fresh.close()


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


def wrapped_call_through(url: str, pool: str, **settings: Any) -> tuple[ck.ContextKeeper, dict[str, Any]]:
    """One wrapped call (the project's test server, the openai SDK) by a keeper whose ledger is at ``url``: the
    keeper, and its ledger's stats after the call (checked: nothing held, one admission, the prompt booked)."""
    import assets
    from openai_server import ChatServer

    assets.require_assets()
    keeper = ck.ContextKeeper(
        str(assets.tokenizer_dir("qwen2")), context_window=4096, kv_capacity=5000, ledger=url, ledger_pool=pool,
        **settings,
    )  # fmt: skip
    assert isinstance(keeper.ledger, RedisLedger)
    assert keeper.ledger.capacity == 5000
    with ChatServer(assets.tokenizer_dir("qwen2")) as server:
        client = keeper.wrap(openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0))
        reply = client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "hi"}])
    assert reply.usage is not None
    stats = keeper.ledger.stats()
    assert (stats["active"], stats["admitted"]) == (0, 1)
    assert stats["peak"] >= reply.usage.prompt_tokens
    return keeper, stats


def test_the_keeper_admits_through_the_shared_ledger(redis_server: RedisServer, pool: str) -> None:
    import assets

    wrapped_call_through(redis_server.url, pool)
    local = ck.ContextKeeper(
        str(assets.tokenizer_dir("qwen2")), context_window=4096, kv_capacity=5000, ledger="redis://127.0.0.1:9/0",
        ledger_unavailable="local", shared=False,
    )  # fmt: skip
    with pytest.warns(UserWarning, match="admits per process"):
        assert type(local.ledger) is Ledger
    failing = ck.ContextKeeper(
        str(assets.tokenizer_dir("qwen2")), context_window=4096, kv_capacity=5000, ledger="redis://127.0.0.1:9/0",
        shared=False,
    )  # fmt: skip
    with pytest.raises(LedgerUnavailable):
        _ = failing.ledger
    with pytest.raises(ConfigurationError, match="ledger_unavailable"):
        ck.ContextKeeper(str(assets.tokenizer_dir("qwen2")), context_window=4096, ledger_unavailable="maybe")
