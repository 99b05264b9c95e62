"""The KV ledger: concurrent threads and asyncio tasks never hold more than the capacity, waits and shrinks
happen when they should, and every failure says what to change."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from contextkeeper import ContextKeeperError
from contextkeeper.calls.ledger import AdmissionTimeout, ExceedsCapacity, Ledger, capacity_from_plan
from contextkeeper.memory import plan

CAPACITY = 1000


class Watch:
    """An independent count of the tokens held inside admit blocks (not the ledger's own)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.held = 0
        self.max = 0
        self.over: list[int] = []

    def enter(self, tokens: int) -> None:
        with self.lock:
            self.held += tokens
            self.max = max(self.max, self.held)
            if self.held > CAPACITY:
                self.over.append(self.held)

    def exit(self, tokens: int) -> None:
        with self.lock:
            self.held -= tokens


def thread_worker(ledger: Ledger, watch: Watch, seed: int, calls: int, errors: list[BaseException]) -> None:
    rng = random.Random(seed)
    try:
        for _ in range(calls):
            with ledger.admit(rng.randint(50, 600), label=f"thread {seed}") as ticket:
                watch.enter(ticket.tokens)
                time.sleep(rng.random() * 0.002)
                watch.exit(ticket.tokens)
    except BaseException as exc:  # pragma: no cover - reported by the test
        errors.append(exc)


async def task_worker(ledger: Ledger, watch: Watch, seed: int, calls: int) -> None:
    rng = random.Random(seed)
    for _ in range(calls):
        async with ledger.admit_async(rng.randint(50, 600), label=f"task {seed}") as ticket:
            watch.enter(ticket.tokens)
            await asyncio.sleep(rng.random() * 0.002)
            watch.exit(ticket.tokens)


def check(ledger: Ledger, watch: Watch, calls: int) -> None:
    assert not watch.over, f"held more than the capacity: {watch.over[:5]}"
    assert watch.max <= CAPACITY
    assert ledger.peak <= CAPACITY
    assert ledger.peak >= watch.max
    assert ledger.active == 0
    assert ledger.in_flight == 0
    assert ledger.admitted == calls
    assert ledger.waits > 0  # 16 callers of up to 600 tokens into 1000: some had to wait
    assert ledger.timeouts == 0


def run_threads(ledger: Ledger, watch: Watch, count: int, calls: int) -> list[threading.Thread]:
    errors: list[BaseException] = []
    threads = [
        threading.Thread(target=thread_worker, args=(ledger, watch, seed, calls, errors), daemon=True)
        for seed in range(count)
    ]
    for thread in threads:
        thread.start()
    return threads


def join(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.join(timeout=20)
        assert not thread.is_alive(), "a thread is stuck: deadlock"


def test_sixteen_threads_never_exceed_the_capacity() -> None:
    ledger = Ledger(CAPACITY, timeout=10)
    watch = Watch()
    join(run_threads(ledger, watch, 16, 25))
    check(ledger, watch, 16 * 25)


def test_sixteen_asyncio_tasks_never_exceed_the_capacity() -> None:
    ledger = Ledger(CAPACITY, timeout=10)
    watch = Watch()

    async def main() -> None:
        await asyncio.wait_for(asyncio.gather(*(task_worker(ledger, watch, s, 25) for s in range(16))), 20)

    asyncio.run(main())
    check(ledger, watch, 16 * 25)


def test_threads_and_tasks_on_two_loops_share_one_ledger() -> None:
    ledger = Ledger(CAPACITY, timeout=10)
    watch = Watch()

    async def tasks(first: int) -> None:
        await asyncio.wait_for(
            asyncio.gather(*(task_worker(ledger, watch, s, 20) for s in range(first, first + 8))), 20
        )

    threads = run_threads(ledger, watch, 8, 20)
    other_loop = threading.Thread(target=lambda: asyncio.run(tasks(100)), daemon=True)
    other_loop.start()
    asyncio.run(tasks(200))
    join([*threads, other_loop])
    check(ledger, watch, 24 * 20)


def test_the_event_loop_keeps_running_while_a_task_waits() -> None:
    ledger = Ledger(CAPACITY, timeout=5)
    ticks = 0

    async def ticker(stop: asyncio.Event) -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0.005)

    async def main() -> float:
        stop = asyncio.Event()
        tick = asyncio.create_task(ticker(stop))
        holder = ledger.acquire(800)
        threading.Timer(0.2, holder.release).start()  # released from another thread
        async with ledger.admit_async(500) as ticket:
            waited = ticket.waited
        stop.set()
        await tick
        return waited

    waited = asyncio.run(main())
    assert 0.15 < waited < 2
    assert ticks >= 10  # the loop ran other tasks during the wait
    assert ledger.waits == 1


def test_wait_then_timeout_says_what_and_how_to_fix() -> None:
    ledger = Ledger(CAPACITY, timeout=0.2)
    with ledger.admit(700, label="chat 1"):
        started = time.monotonic()
        with pytest.raises(AdmissionTimeout) as info, ledger.admit(600, label="chat 2"):
            pass  # pragma: no cover
        assert 0.15 < time.monotonic() - started < 2
    error = info.value
    assert isinstance(error, ContextKeeperError)
    assert (error.requested, error.active, error.capacity) == (600, 700, 1000)
    assert error.waited >= 0.15
    text = str(error)
    for needle in ("600", "700", "1,000", "chat 2", "concurrency=", "admission_timeout=", "bigger GPU", "kv_dtype"):
        assert needle in text
    assert ledger.timeouts == 1
    assert ledger.active == 0
    with ledger.admit(600):  # the timed-out call left the queue
        pass


def test_async_timeout_and_cancellation_leave_the_queue() -> None:
    ledger = Ledger(CAPACITY, timeout=0.1)

    async def main() -> None:
        holder = ledger.acquire(900)
        with pytest.raises(AdmissionTimeout, match="waited"):
            await ledger.acquire_async(500)
        task = asyncio.create_task(ledger.acquire_async(500, timeout=10))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        holder.release()
        async with ledger.admit_async(1000, timeout=0.5) as ticket:
            assert ticket.tokens == 1000

    asyncio.run(main())
    assert ledger.stats()["queued"] == 0
    assert ledger.active == 0


def test_a_request_larger_than_the_capacity_fails_at_once() -> None:
    ledger = Ledger(CAPACITY, timeout=30)
    started = time.monotonic()
    with pytest.raises(ExceedsCapacity) as info, ledger.admit(1500, label="huge"):
        pass  # pragma: no cover
    assert time.monotonic() - started < 0.5
    assert not isinstance(info.value, AdmissionTimeout)
    assert "1,500" in str(info.value)
    assert "500 more than the capacity of 1,000" in str(info.value)
    assert "max_tokens" in str(info.value)

    async def main() -> None:
        with pytest.raises(ExceedsCapacity):
            await ledger.acquire_async(1001)

    asyncio.run(main())
    with pytest.raises(ExceedsCapacity):  # mode "wait" never shrinks: a minimum does not make it fit
        ledger.acquire(1500, minimum=500)
    # In shrink mode a request over the capacity is admitted with what fits, if that meets its minimum.
    shrink = Ledger(CAPACITY, mode="shrink")
    with shrink.admit(1500, minimum=800) as ticket:
        assert (ticket.tokens, ticket.shrunk, ticket.requested) == (1000, True, 1500)
    with pytest.raises(ExceedsCapacity, match="needs at least 1,200"):
        shrink.acquire(1500, minimum=1200)


def test_shrink_mode_admits_at_once_with_what_is_free() -> None:
    ledger = Ledger(CAPACITY, mode="shrink", timeout=0.2)
    with ledger.admit(700) as first:
        assert not first.shrunk
        assert ledger.available() == 300
        started = time.monotonic()
        with ledger.admit(600, minimum=200) as second:
            assert time.monotonic() - started < 0.1
            assert (second.tokens, second.shrunk, second.waited) == (300, True, 0.0)
            assert ledger.active == 1000
        # Below its minimum: it waits like mode "wait", then times out.
        with pytest.raises(AdmissionTimeout), ledger.admit(600, minimum=400):
            pass  # pragma: no cover
    assert ledger.shrinks == 1
    assert ledger.peak == 1000


def test_shrink_mode_under_concurrency_stays_within_capacity() -> None:
    ledger = Ledger(CAPACITY, mode="shrink", timeout=10)
    watch = Watch()
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(25):
                wanted = rng.randint(200, 900)
                with ledger.admit(wanted, minimum=wanted // 4) as ticket:
                    assert wanted // 4 <= ticket.tokens <= wanted
                    watch.enter(ticket.tokens)
                    time.sleep(rng.random() * 0.002)
                    watch.exit(ticket.tokens)
        except BaseException as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,), daemon=True) for s in range(16)]
    for thread in threads:
        thread.start()
    join(threads)
    assert not errors
    assert not watch.over
    assert ledger.peak <= CAPACITY
    assert ledger.shrinks > 0
    assert ledger.active == 0


def test_release_on_exception() -> None:
    ledger = Ledger(CAPACITY)
    with pytest.raises(RuntimeError), ledger.admit(900):
        raise RuntimeError("the server failed")
    assert ledger.active == 0
    assert ledger.in_flight == 0

    async def main() -> None:
        with pytest.raises(RuntimeError):
            async with ledger.admit_async(900):
                raise RuntimeError("the server failed")

    asyncio.run(main())
    assert ledger.active == 0
    ticket = ledger.acquire(10)
    ticket.release()
    ticket.release()  # idempotent
    assert ledger.active == 0


def test_resize_after_the_fit_wakes_waiters() -> None:
    ledger = Ledger(CAPACITY, timeout=5)
    admitted = threading.Event()

    def waiter() -> None:
        with ledger.admit(500):
            admitted.set()

    with ledger.admit(900) as ticket:
        thread = threading.Thread(target=waiter, daemon=True)
        thread.start()
        time.sleep(0.05)
        assert not admitted.is_set()
        ticket.resize(400)  # the real prompt was smaller than the reservation
        assert admitted.wait(1)
        thread.join(1)
        assert ledger.active == 400
        with pytest.raises(ExceedsCapacity):
            ticket.resize(1200)
        ticket.resize(1000)
        assert ledger.active == 1000
    assert ledger.active == 0


def test_first_come_first_served_a_large_call_is_not_starved() -> None:
    ledger = Ledger(CAPACITY, timeout=5)
    order: list[str] = []
    holder = ledger.acquire(600)

    def call(name: str, tokens: int) -> None:
        with ledger.admit(tokens):
            order.append(name)
            time.sleep(0.01)

    large = threading.Thread(target=call, args=("large", 900), daemon=True)
    large.start()
    time.sleep(0.05)
    small = threading.Thread(target=call, args=("small", 100), daemon=True)
    small.start()  # 100 would fit beside the holder, but the large call queued first
    time.sleep(0.05)
    assert order == []
    holder.release()
    join([large, small])
    assert order == ["large", "small"]


def test_unlimited_capacity_still_tracks() -> None:
    ledger = Ledger(None)
    with ledger.admit(10**9) as a, ledger.admit(10**9) as b:
        assert not a.shrunk
        assert not b.shrunk
        assert ledger.active == 2 * 10**9
        assert ledger.available() is None
    assert ledger.peak == 2 * 10**9
    assert ledger.active == 0


def test_settings_are_checked() -> None:
    with pytest.raises(ContextKeeperError, match="mode"):
        Ledger(10, mode="drop")  # type: ignore[arg-type]
    with pytest.raises(ContextKeeperError, match="capacity_tokens"):
        Ledger(-1)
    with pytest.raises(ContextKeeperError, match="tokens"):
        Ledger(10).acquire(-5)


def test_capacity_from_plan_is_the_kv_pool_after_weights_and_overhead() -> None:
    tokens = capacity_from_plan("qwen2.5-7b", "H100")
    full = plan("qwen2.5-7b", "H100", context=4096, advise=False)
    b = full.breakdown
    free = b.capacity - b.weights - b.overhead - b.prefill_peak
    per_token = full.kv.bytes_per_token
    # The whole pool, not the model's own 32k maximum context: about free / bytes per token.
    assert tokens > 10 * full.max_context
    assert abs(tokens - free // per_token) <= 0.02 * tokens
    # Every token of it fits, one more block does not.
    one_seq = plan("qwen2.5-7b", "H100", context=tokens, advise=False)
    assert one_seq.breakdown.kv_cache + b.weights + b.overhead <= b.capacity
    # fp8 doubles it; splitting it over 8 sequences loses at most block rounding.
    assert capacity_from_plan("qwen2.5-7b", "H100", kv_dtype="fp8") == pytest.approx(2 * tokens, rel=0.03)
    eight = capacity_from_plan("qwen2.5-7b", "H100", concurrency=8)
    assert eight % 8 == 0
    assert eight == pytest.approx(tokens, rel=0.03)
    with pytest.raises(ContextKeeperError, match="no room for a KV cache"):
        capacity_from_plan("llama-3.1-70b", "RTX 4090")


def test_an_asyncio_waiter_is_admitted_when_a_lease_runs_out() -> None:
    ledger = Ledger(CAPACITY, timeout=5)
    forgotten = ledger.acquire(900, label="a stream nobody reads", lease=0.2)

    async def main() -> float:
        started = time.monotonic()
        async with ledger.admit_async(500, label="next") as ticket:
            assert ticket.tokens == 500
        return time.monotonic() - started

    waited = asyncio.run(main())
    assert 0.15 < waited < 3  # woken by the lease running out, not by the timeout
    assert forgotten.expired
    forgotten.release()  # already given back: nothing twice
    assert ledger.active == 0
    assert ledger.expired == 1
