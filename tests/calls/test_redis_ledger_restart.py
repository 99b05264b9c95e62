"""The shared KV ledger keeps its capacity when Redis loses the pool (issue 34, item 4), on a real Redis.

Holders (this process, and a real separate process) hold tickets; Redis restarts empty, is flushed, or fails over to
a replica that lacks the latest bookings; new admissions race the holders' heartbeats. The truth is what every
holder believes it holds (its calls are in flight upstream): it never passes the capacity, and once everyone has
released, the pool is back at 0 with nothing leaked. Also: a cancelled waiter leaves the queue at once.

Run as a script, this file is the separate holder process:
``python tests/calls/test_redis_ledger_restart.py URL POOL CAPACITY TOKENS LEASE`` holds TOKENS, prints "held", then
releases on a "release" line of stdin (and prints "released").
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from contextkeeper.calls.ledger import AdmissionTimeout
from contextkeeper.calls.redis_ledger import LedgerUnavailable, RedisLedger

CAPACITY = 8192


class Truth:
    """The tokens the holders believe they hold now, and every moment that was over the capacity."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lock = threading.Lock()
        self.now = self.most = 0
        self.over: list[tuple[float, int]] = []

    def hold(self, tokens: int) -> None:
        """After an admission: its call is in flight from here."""
        with self.lock:
            self.now += tokens
            self.most = max(self.most, self.now)
            if self.now > self.capacity:
                self.over.append((time.monotonic(), self.now))

    def drop(self, tokens: int) -> None:
        """Before a release: its call has ended."""
        with self.lock:
            self.now -= tokens


class Holder:
    """A real separate process holding ``tokens`` of the pool (this file run as a script)."""

    def __init__(self, url: str, pool: str, tokens: int, lease: float, log: Path) -> None:
        command = [sys.executable, __file__, url, pool, str(CAPACITY), str(tokens), str(lease)]
        with log.open("w") as stderr:  # its warnings (Redis down) go to a file: a full pipe would block it
            self.process = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True
            )
        self.tokens = tokens
        assert self._line() == "held"

    def _line(self) -> str:
        assert self.process.stdout is not None
        reading: list[str] = []
        thread = threading.Thread(target=lambda: reading.append(self.process.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        thread.start()
        thread.join(30)
        assert reading, "the holder process did not answer within 30 s"
        return reading[0].strip()

    def release(self, truth: Truth) -> None:
        truth.drop(self.tokens)
        assert self.process.stdin is not None
        self.process.stdin.write("release\n")
        self.process.stdin.flush()
        assert self._line() == "released"

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(10)

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


class Racers:
    """Threads, each with a ledger of its own, asking for 100-4,000 tokens again and again (0.3 s timeout), holding
    each grant ``hold`` seconds (drawn); every grant is checked against the truth when it is made."""

    def __init__(
        self, ledgers: list[RedisLedger], truth: Truth, seed: int, hold: tuple[float, float] = (0.01, 0.08)
    ) -> None:
        self.truth, self.stop, self.hold = truth, threading.Event(), hold
        self.lock = threading.Lock()
        self.asked: list[float] = []  # when each answered ask was made
        self.admitted: list[float] = []  # when each grant came
        self.errors: list[str] = []
        self.threads = [
            threading.Thread(target=self._run, args=(ledger, random.Random(seed * 10 + i)), daemon=True)
            for i, ledger in enumerate(ledgers)
        ]

    def add(self, ledger: RedisLedger, seed: int) -> None:
        thread = threading.Thread(target=self._run, args=(ledger, random.Random(seed)), daemon=True)
        self.threads.append(thread)
        thread.start()

    def _run(self, ledger: RedisLedger, rng: random.Random) -> None:
        while not self.stop.is_set():
            asked = time.monotonic()
            try:
                ticket = ledger.acquire(rng.randint(100, 4000), timeout=0.3)
            except AdmissionTimeout:
                with self.lock:
                    self.asked.append(asked)
                continue
            except LedgerUnavailable:
                time.sleep(0.05)  # Redis is down (restarting): as an app would, do not spin
                continue
            except Exception as error:  # every other failure is a test failure
                with self.lock:
                    self.errors.append(repr(error)[:300])
                return
            self.truth.hold(ticket.tokens)
            with self.lock:
                self.asked.append(asked)
                self.admitted.append(time.monotonic())
            time.sleep(rng.uniform(*self.hold))
            self.truth.drop(ticket.tokens)
            ticket.release()

    def __enter__(self) -> Racers:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(15)
        assert not any(thread.is_alive() for thread in self.threads), "a racer hung"

    def count(self, since: float, until: float, what: str = "asked") -> int:
        with self.lock:
            return sum(since <= moment < until for moment in getattr(self, what))


@pytest.fixture
def pool(request: pytest.FixtureRequest) -> str:
    return f"r-{request.node.name[:40]}-{time.monotonic_ns()}"


@pytest.fixture
def closing() -> Iterator[Callable[[Any], Any]]:
    """Closes what a test registers, also when it fails."""
    opened: list[Any] = []
    yield lambda thing: opened.append(thing) or thing
    for thing in reversed(opened):
        thing.close()


def _redis_server() -> Any:
    from engines import RedisServer

    return RedisServer()


def _empty(ledger: RedisLedger) -> dict[str, Any]:
    state = ledger.stats()
    assert (state["active"], state["in_flight"], state["queued"]) == (0, 0, 0), state
    return state


def _wait_until(check: Callable[[], bool], seconds: float) -> float:
    """Seconds until ``check()`` held (polled every 20 ms), or fail after ``seconds``."""
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < seconds, f"not within {seconds} s"
        time.sleep(0.02)
    return time.monotonic() - started


# ------------------------------------------------------------------------- restarted empty, flushed
def _losing(loss: str, pool: str, closing: Callable[[Any], Any]) -> tuple[str, Callable[[], None]]:
    """A Redis for ``pool`` (its URL), and how it loses the pool: one server restarted empty or flushed, or the
    Redis Cluster node that serves the pool's slot restarted empty."""
    import redis

    if loss == "cluster-node-restart":
        from contextkeeper.calls.redis_client import connect
        from engines import RedisCluster

        cluster = closing(RedisCluster())
        cluster.start()
        client = connect(cluster.url)
        port = client.get_node_from_key(f"{{ck:{pool}}}:held").port
        client.close()
        node = next(node for node in cluster.nodes if node.port == port)

        def restart_node() -> None:
            node.restart()
            cluster.wait_ok()

        return cluster.url, restart_node
    server = closing(_redis_server())
    server.start()
    if loss == "restart":
        return server.url, server.restart
    raw = closing(redis.Redis.from_url(server.url, socket_timeout=5))
    return server.url, raw.flushall


@pytest.mark.parametrize("loss", ["restart", "flushall", "cluster-node-restart"])
def test_live_tickets_are_booked_again_when_redis_loses_the_pool(
    loss: str, pool: str, tmp_path: Path, closing: Callable[[Any], Any]
) -> None:
    """The finding: 8,000 of 8,192 tokens held by this process and another when Redis restarts empty (or is
    flushed, or the cluster node serving the pool restarts empty). Racing admissions of four other ledgers (and,
    after a restart, one started after it) are never given the holders' room; the holders book their tickets again
    within a heartbeat; after the holders release, the pool is admitting again and ends at 0."""
    url, lose = _losing(loss, pool, closing)
    truth = Truth(CAPACITY)
    other = Holder(url, pool, 5000, 5.0, tmp_path / "holder.log")
    closing(other)
    truth.hold(5000)
    here = closing(RedisLedger(url, CAPACITY, pool=pool, lease=5.0))
    mine = [here.acquire(2000), here.acquire(1000)]
    for ticket in mine:
        truth.hold(ticket.tokens)
    racing = [closing(RedisLedger(url, CAPACITY, pool=pool, lease=5.0, poll=0.02)) for _ in range(4)]
    with Racers(racing, truth, seed=1) as racers:
        time.sleep(0.5)  # the racers ask; 192 tokens are free
        wall = time.time()
        lose()
        back, back_wall = time.monotonic(), time.time()
        if loss != "flushall":
            racers.add(closing(RedisLedger(url, CAPACITY, pool=pool, lease=5.0, poll=0.02)), seed=99)
        time.sleep(4.0)  # the race: racers against the holders' heartbeats, and the pool settling
        assert truth.most <= CAPACITY, truth.over[:3]
        assert racers.count(back, back + 2.0) > 0  # the racers did ask while the holders' room was not booked again
        for ticket in mine:
            truth.drop(ticket.tokens)
            ticket.release()
        other.release(truth)
        released = time.monotonic()
        time.sleep(1.0)
        assert racers.count(released, released + 1.0, "admitted") > 0  # the pool admits again
    assert not racers.errors, racers.errors
    assert truth.most <= CAPACITY, truth.over[:3]
    state = _empty(here)
    assert (state["rebooked"], state["rebooked_tokens"]) == (2, 3000)  # this process's two tickets, once each
    assert wall <= state["rebooked_at"] <= back_wall + 2.0  # within a heartbeat (and a reconnection) of Redis back
    assert state["pool_rebooked"] == 3  # and the other process's one
    assert state["generation"] != ""


# ------------------------------------------------------------------------------------------- variants
@pytest.mark.parametrize("loss", ["restart", "flushall"])
def test_a_waiter_queued_across_a_restart_keeps_its_place_and_gets_no_room_the_holders_need(
    loss: str, pool: str, tmp_path: Path, closing: Callable[[Any], Any]
) -> None:
    """A call waits for 3,000 tokens (8,000 held) when Redis restarts (or is flushed); one for 200 (192 are free)
    queued behind it. After the loss neither is admitted into the holders' room; once this process's holder
    releases, the first is admitted first: it kept its place. (A waiter whose call fell into the outage, after
    redis-py's retries, raised LedgerUnavailable and asked again from the back: then no order is expected.)"""
    url, lose = _losing(loss, pool, closing)
    truth = Truth(CAPACITY)
    other = Holder(url, pool, 5000, 5.0, tmp_path / "holder.log")
    closing(other)
    truth.hold(5000)
    here = closing(RedisLedger(url, CAPACITY, pool=pool, lease=5.0))
    held = here.acquire(3000)
    truth.hold(3000)
    order: list[tuple[str, float]] = []
    again: dict[str, int] = {"big": 0, "small": 0}

    def wait_for(name: str, tokens: int) -> None:
        ledger = closing(RedisLedger(url, CAPACITY, pool=pool, lease=5.0, poll=0.02))
        while True:
            try:
                ticket = ledger.acquire(tokens, timeout=20)
                break
            except LedgerUnavailable:
                again[name] += 1
                time.sleep(0.05)
        truth.hold(ticket.tokens)
        order.append((name, time.monotonic()))
        time.sleep(0.2)
        truth.drop(ticket.tokens)
        ticket.release()

    big = threading.Thread(target=wait_for, args=("big", 3000), daemon=True)
    big.start()
    time.sleep(0.3)
    small = threading.Thread(target=wait_for, args=("small", 200), daemon=True)
    small.start()
    time.sleep(0.3)
    assert order == []
    lose()
    time.sleep(4.0)
    assert order == []  # the holders' 8,000 are booked again: neither fits beside them
    truth.drop(3000)
    held.release()
    released = time.monotonic()
    big.join(10)
    small.join(10)
    assert len(order) == 2
    assert min(moment for _, moment in order) - released < 1.0
    if loss == "flushall":
        assert again == {"big": 0, "small": 0}  # no outage
    if not again["big"]:
        assert [name for name, _ in order] == ["big", "small"]
    assert truth.most <= CAPACITY, truth.over[:3]
    other.release(truth)
    assert here.stats()["rebooked"] == 1
    _empty(here)


def test_a_stream_renewed_across_a_restart_keeps_its_room_and_runs_out_once_unread(
    pool: str, closing: Callable[[Any], Any]
) -> None:
    """A stream holds 6,000 tokens under its own 1.5 s lease, renewed with each chunk, while Redis restarts: it is
    booked again and keeps its room against racing admissions; once nobody reads it, its lease runs out here and
    the pool gets its tokens back."""
    server = closing(_redis_server())
    server.start()
    truth = Truth(CAPACITY)
    here = closing(RedisLedger(server.url, CAPACITY, pool=pool, lease=3.0))
    stream = here.acquire(6000, lease=1.5)
    truth.hold(6000)
    reading = threading.Event()
    reading.set()

    def read() -> None:  # a chunk every 100 ms renews the stream's lease, as a wrapped stream does
        while reading.is_set():
            stream.renew()
            time.sleep(0.1)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    racing = [closing(RedisLedger(server.url, CAPACITY, pool=pool, lease=3.0, poll=0.02)) for _ in range(3)]
    with Racers(racing, truth, seed=2):
        time.sleep(0.3)
        server.restart()
        time.sleep(4.0)
        assert truth.most <= CAPACITY, truth.over[:3]
        assert not stream.expired  # read all along: held, and booked again
        assert not stream.released
        assert here.stats()["rebooked"] == 1
    reading.clear()  # nobody reads it any more: its tokens are still in flight until its lease runs out
    reader.join(5)
    stopped = time.monotonic()
    came_back = _wait_until(lambda: stream.expired, 5.0)
    truth.drop(6000)
    assert stream.released
    assert came_back <= 1.5 + 0.5 + 0.5  # its lease, a heartbeat, and slack
    assert time.monotonic() - stopped >= 1.4
    assert truth.most <= CAPACITY, truth.over[:3]
    _empty(here)


def test_a_holder_that_died_during_the_outage_leaves_its_room_and_no_more(
    pool: str, tmp_path: Path, closing: Callable[[Any], Any]
) -> None:
    """Redis is down; a holder process of 5,000 tokens is killed meanwhile; Redis comes back empty. Only the living
    holder's 2,000 are booked again: once the pool has settled, 6,192 tokens are admitted and 6,193 are not."""
    server = closing(_redis_server())
    server.start()
    dead = Holder(server.url, pool, 5000, 2.0, tmp_path / "holder.log")
    closing(dead)
    here = closing(RedisLedger(server.url, CAPACITY, pool=pool, lease=2.0))
    alive = here.acquire(2000)
    other = closing(RedisLedger(server.url, CAPACITY, pool=pool, lease=2.0, poll=0.02))
    server.stop()
    dead.kill()
    time.sleep(1.0)
    server.start()
    back = time.monotonic()

    def admitted(tokens: int, timeout: float) -> bool:
        try:
            other.acquire(tokens, timeout=timeout).release()
            return True
        except AdmissionTimeout:
            return False

    assert not admitted(6193, 4.0)  # not while settling, nor after: the living holder's 2,000 are back
    assert admitted(6192, 2.0)
    assert time.monotonic() - back < 4.0 + 2.0 + 1.0
    assert here.stats()["rebooked"] == 1
    alive.release()
    assert admitted(CAPACITY, 2.0)
    _empty(here)


# ------------------------------------------------------------------------------------------ failover
def test_a_failover_to_a_replica_without_the_latest_bookings_books_them_again(
    pool: str, tmp_path: Path, closing: Callable[[Any], Any]
) -> None:
    """Through Sentinel: this process holds 2,000 (replicated) and 1,500 booked after the replica was cut off; a
    holder process of 3,000 (replicated) dies with the master. The promoted replica lacks the 1,500: they are booked
    again before racing admissions get their room; the dead holder's 3,000 come back with its lease (nobody renews
    them)."""
    import redis

    from engines import RedisSentinel

    servers = closing(RedisSentinel(replicas=1))
    servers.start()
    master = redis.Redis(port=servers.master.port, socket_timeout=5)
    replica = redis.Redis(port=servers.replicas[0].port, socket_timeout=5)
    truth = Truth(CAPACITY)
    dead = Holder(servers.url, pool, 3000, 3.0, tmp_path / "holder.log")
    closing(dead)
    here = closing(RedisLedger(servers.url, CAPACITY, pool=pool, lease=3.0))
    first = here.acquire(2000)
    truth.hold(2000)
    _wait_until(lambda: replica.hlen(f"{{ck:{pool}}}:held") == 2, 5.0)  # both replicated
    # Cut the replica off: it may not sync again (its PSYNC is refused), and its link is dropped.
    master.execute_command("ACL", "SETUSER", "default", "-psync", "-sync")
    master.client_kill_filter(_type="replica")
    second = here.acquire(1500)
    truth.hold(1500)
    time.sleep(0.1)
    assert replica.hlen(f"{{ck:{pool}}}:held") == 2  # the replica lacks the latest booking
    master.close()
    racing = [closing(RedisLedger(servers.url, CAPACITY, pool=pool, lease=3.0, poll=0.02)) for _ in range(4)]
    with Racers(racing, truth, seed=3, hold=(0.05, 0.3)) as racers:
        time.sleep(0.3)
        servers.master.kill()
        dead.kill()
        killed = time.monotonic()
        truth.drop(3000)
        servers.wait_master(servers.replicas[0].port, seconds=20)
        promoted = time.monotonic()
        # The race goes on past the dead holder's lease (3 s from its last renewal): its replicated booking, which
        # nobody renews, runs out, and its room is given again.
        time.sleep(max(3.0, killed + 3.0 + 2.5 - time.monotonic()))
    assert not racers.errors, racers.errors
    assert truth.most <= CAPACITY, truth.over[:3]
    assert racers.count(promoted + 3.0, time.monotonic(), "admitted") > 0
    back = _wait_until(lambda: here.available() == CAPACITY - 3500, 5.0)  # the dead holder's 3,000 are free
    replica.close()
    print(
        f"\nfailover: promoted {promoted - killed:.1f} s after the master died; its holder's room free at +{back:.1f} s"
    )
    state = here.stats()
    # The 1,500 the replica lacked; and the 2,000 too when their replicated deadline (renewals after the cut were
    # not replicated) ran out before the promoted replica was first asked.
    assert (state["rebooked"], state["rebooked_tokens"]) in ((1, 1500), (2, 3500))
    assert state["pool_rebooked"] == state["rebooked"]
    for ticket in (first, second):
        truth.drop(ticket.tokens)
        ticket.release()
        assert not ticket.expired
    _empty(here)


# ----------------------------------------------------------------------------------------- cancelled
def test_a_cancelled_waiter_leaves_the_queue_at_once_and_holds_nothing(
    pool: str, closing: Callable[[Any], Any]
) -> None:
    """A waiting ``acquire_async`` cancelled the way Starlette cancels a request whose client went away (an anyio
    cancel scope, which cancels again at every await) leaves the queue at once: the call queued behind it is
    admitted within a poll or two, not after the waiter's life in the queue (1 s), and the pool ends empty."""
    import anyio

    server = closing(_redis_server())
    server.start()
    holder = closing(RedisLedger(server.url, 1000, pool=pool))
    waiting = closing(RedisLedger(server.url, 1000, pool=pool, poll=0.02))
    behind = closing(RedisLedger(server.url, 1000, pool=pool, poll=0.02))
    held = holder.acquire(900)

    async def main() -> float:
        async def gone() -> None:
            with anyio.move_on_after(0.4):
                await waiting.acquire_async(500, timeout=20)
                raise AssertionError("admitted")  # (not reached: the scope ends the wait)

        first = asyncio.ensure_future(gone())
        await asyncio.sleep(0.15)
        second = asyncio.ensure_future(behind.acquire_async(50, timeout=20))
        await asyncio.sleep(0.45)  # the first was cancelled at 0.4 s
        cancelled = time.monotonic()
        await first
        ticket = await asyncio.wait_for(second, 5)
        took = time.monotonic() - cancelled
        ticket.release()
        return took

    took = asyncio.run(main())
    assert took < 0.3  # at once: the alive deadline would be 1 s
    held.release()
    state = _empty(holder)
    assert state["admitted"] == 1
    assert waiting.stats()["admitted"] == 0


# --------------------------------------------------------------------------------- the holder process
def _hold(url: str, pool: str, capacity: int, tokens: int, lease: float) -> None:
    ledger = RedisLedger(url, capacity, pool=pool, lease=lease)
    ticket = ledger.acquire(tokens, timeout=20)
    print("held", flush=True)
    for line in sys.stdin:  # until stdin closes
        if line.strip() == "release":
            ticket.release()
            print("released", flush=True)
    ledger.close()


if __name__ == "__main__":
    _hold(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))
