"""The Postgres transcript across outages: Postgres stopped (cleanly, or SIGKILLed with every process it started)
for a few seconds under load, once or twice, while calls begin and end. Afterwards every reply a caller got back
is in the transcript with status ok, no entry of the live process reads "interrupted", and a process really killed
mid-call still does. Ends sent behind wait in a bounded outbox (past the bound: logged, and the call closed as
failed, saying so), flush() waits for them (bounded), reads see them.

One real Postgres per test (tests/engines.py): the tests stop and kill it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import contextkeeper as ck
from contextkeeper._exceptions import TranscriptUnavailable
from contextkeeper.calls.transcript import INTERRUPTED
from engines import PostgresServer

psycopg = pytest.importorskip("psycopg")
from contextkeeper.calls.transcript.postgres import PostgresTranscript  # noqa: E402  (needs psycopg)

WORKER = Path(__file__).resolve().parents[1] / "transcript_worker.py"
SRC = Path(ck.__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}


@pytest.fixture
def postgres() -> Iterator[PostgresServer]:
    with PostgresServer() as server:
        yield server


def wait_for(condition: Callable[[], bool], seconds: float = 15.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def kill(server: PostgresServer) -> None:
    """A crash: SIGKILL to the postmaster and every process it started (no shutdown, no checkpoint; the next
    start recovers from the WAL)."""
    assert server.process is not None
    postmaster = int((server.data / "postmaster.pid").read_text().split()[0])
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = (entry / "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == postmaster:
                    children.append(int(entry.name))
    for pid in (postmaster, *children):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    server.process.wait(timeout=30)
    server.process = None


@dataclass
class Load:
    """Callers making wrapped-call-shaped calls: begin, wait for the inputs, the upstream answers, end behind;
    a reply is acknowledged (the caller has it) once end() returned."""

    store: PostgresTranscript
    name: str  # its callers' conversations are NAME-0, NAME-1, ...
    latency: tuple[float, float]  # the upstream's answer time, seconds
    acknowledged: dict[int, dict[str, Any]] = field(default_factory=dict)
    refused: int = 0  # begins that failed (the database was down): the caller got the error, nothing was sent
    errors: list[BaseException] = field(default_factory=list)
    end_errors: list[Exception] = field(default_factory=list)  # end() must not raise into its caller
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def caller(self, name: str, seed: int) -> None:
        rng = random.Random(seed)
        chat: list[dict[str, Any]] = [{"role": "system", "content": f"You are {name}'s assistant."}]
        try:
            for turn in range(100_000):  # bounded; stopped by the test
                if self.stop.is_set():
                    return
                chat.append({"role": "user", "content": f"{name} asks {turn}: " + "why? " * rng.randint(1, 40)})
                try:
                    started = self.store.begin(chat, conversation=name).wait()
                except TranscriptUnavailable:
                    with self.lock:
                        self.refused += 1
                    chat.pop()  # the call failed: the caller asks again later
                    time.sleep(0.05)
                    continue
                time.sleep(rng.uniform(*self.latency))
                reply = {"role": "assistant", "content": f"{name} answer {turn}"}
                try:
                    self.store.end(started, None, wait=False, sent=chat, received=reply, usage={"prompt_tokens": turn})
                except Exception as exc:  # (the call loop logs it: the caller has its reply all the same)
                    self.end_errors.append(exc)
                with self.lock:
                    self.acknowledged[started.call] = reply
                chat.append(reply)
        except BaseException as exc:  # pragma: no cover - reported by the test
            self.errors.append(exc)

    def run(self, callers: int) -> list[threading.Thread]:
        threads = [threading.Thread(target=self.caller, args=(f"{self.name}-{i}", i)) for i in range(callers)]
        for each in threads:
            each.start()
        return threads


def _check(postgres: PostgresServer, schema: str, loads: list[Load]) -> dict[str, int]:
    """Every acknowledged reply is in the transcript, status ok, as a new reader sees it; nothing of this (live)
    process reads interrupted or pending; a failed entry is a begin whose answer the outage took."""
    reader = PostgresTranscript(postgres.url, schema=schema)
    try:
        entries = {e.call: e for e in reader.entries()}
    finally:
        reader.close()
    acknowledged = {call: reply for load in loads for call, reply in load.acknowledged.items()}
    missing = [call for call, reply in acknowledged.items() if call not in entries or entries[call].received != reply]
    assert not missing, f"{len(missing)} of {len(acknowledged)} acknowledged replies are not in the transcript"
    not_ok = [(c, entries[c].status, entries[c].error) for c in acknowledged if entries[c].status != "ok"]
    assert not not_ok, not_ok[:5]
    unfinished = [(e.call, e.status) for e in entries.values() if e.status in ("interrupted", "pending")]
    assert not unfinished, f"entries of this live process read {unfinished[:5]}"
    failed = [e for e in entries.values() if e.status == "failed"]
    assert all(e.call not in acknowledged and e.error and "not sent" in e.error for e in failed), failed[:3]
    return {
        "acknowledged": len(acknowledged),
        "refused begins": sum(load.refused for load in loads),
        "closed as failed": len(failed),
    }


@pytest.mark.parametrize(
    ("how", "outages", "latency"),
    [
        pytest.param("stop", (5.0,), (0.02, 0.15), id="stopped-5s-during-ends"),
        pytest.param("kill", (3.0,), (0.02, 0.15), id="sigkilled-3s-during-ends"),
        pytest.param("kill", (3.0,), (0.0, 0.003), id="sigkilled-3s-during-begins"),
        pytest.param("stop", (2.0, 2.0), (0.02, 0.1), id="stopped-twice"),
    ],
)
def test_no_acknowledged_reply_is_lost_across_an_outage(
    postgres: PostgresServer, how: str, outages: tuple[float, ...], latency: tuple[float, float]
) -> None:
    schema = f"outage_{how}_{len(outages)}_{int(latency[1] * 1000)}"
    # Two replicas of one schema (two sessions), as a proxy with two workers.
    loads = [
        Load(PostgresTranscript(postgres.url, schema=schema, connect_timeout=2), f"replica{n}", latency)
        for n in range(2)
    ]
    threads = [*loads[0].run(8), *loads[1].run(4)]
    queued = 0
    try:
        time.sleep(1.0)
        for n, seconds in enumerate(outages):
            (kill if how == "kill" else PostgresServer.stop)(postgres)
            time.sleep(seconds)
            queued = max(queued, *(len(getattr(load.store, "_outbox", ())) for load in loads))
            postgres.start()
            if n + 1 < len(outages):
                time.sleep(0.05)  # the next outage comes at once (see the next test for one mid-way, for sure)
        time.sleep(1.5)
    finally:
        for load in loads:
            load.stop.set()
        for each in threads:
            each.join(60)
    assert not any(each.is_alive() for each in threads)
    for load in loads:
        assert not load.errors, load.errors[:3]
    began = time.monotonic()
    for load in loads:
        load.store.flush()  # (bounded: connect_timeout + statement_timeout)
    drained = time.monotonic() - began
    figures = _check(postgres, schema, loads)
    for load in loads:
        assert not load.end_errors, load.end_errors[:3]
    for load in loads:
        load.store.close()
    print(f"\noutage {how} {outages}: {figures}, most ends waiting {queued}, flush after the run {drained:.2f} s")
    assert figures["acknowledged"] > 200
    if latency[1] >= 0.1:
        assert queued > 0  # the outage caught calls between their begin and their end


def test_a_second_outage_in_the_middle_of_sending_the_outbox_loses_nothing(postgres: PostgresServer) -> None:
    """Six ends wait in the outbox; Postgres comes back, and while the outbox is being sent (held up for sure at
    its fourth write: another session is inserting that end's reply, uncommitted) it goes down again. The three
    ends not sent stay in the outbox, in order, and are recorded after the second restart."""
    schema = "twice"
    store = PostgresTranscript(postgres.url, schema=schema, connect_timeout=2)
    started = [store.begin([{"role": "user", "content": f"q{i}"}], conversation="c").wait() for i in range(6)]
    replies = [{"role": "assistant", "content": f"a{entry.call}"} for entry in started]
    postgres.stop()
    for entry, reply in zip(started, replies, strict=True):
        store.end(entry, None, wait=False, sent=entry.inputs, received=reply)
    assert [item.call for item in store._outbox] == [e.call for e in started]
    text = json.dumps(replies[3], separators=(",", ":"))
    blob = hashlib.blake2b(text.encode(), digest_size=16).hexdigest()  # a blob's id is its content's hash
    with store._lock:  # (so that the outbox's thread sends nothing before the other session's insert)
        postgres.start()
        blocker = psycopg.connect(postgres.url, autocommit=True)
        blocker.execute("BEGIN")
        blocker.execute(f'INSERT INTO "{schema}".blobs (id, json) VALUES (%s, %s)', (blob, text))
    watcher = psycopg.connect(postgres.url, autocommit=True)

    def stuck() -> bool:
        waiting = watcher.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND application_name = "
            "'contextkeeper'"
        ).fetchone()
        return bool(waiting and waiting[0])

    assert wait_for(stuck, 20), "the outbox was not being sent"
    assert len(store._outbox) == 3  # three were recorded before the fourth waited
    postgres.stop()  # the second outage, mid-way
    blocker.close()
    watcher.close()
    assert [item.call for item in store._outbox] == [e.call for e in started[3:]]
    postgres.start()
    store.flush(timeout=30)
    reader = PostgresTranscript(postgres.url, schema=schema)
    assert [(e.status, e.received) for e in reader.entries("c")] == [("ok", reply) for reply in replies]
    reader.close()
    store.close()


def test_a_live_processs_calls_stay_pending_across_a_restart_and_a_killed_ones_read_interrupted(
    postgres: PostgresServer,
) -> None:
    """A call in flight here, and one in another process that is SIGKILLed while Postgres is down. After the
    restart a reader sees both pending for restart_grace seconds (either process may be reconnecting); this
    process's call is re-owned by its new session without any call of its own (the transcript watches its
    session), so it stays pending after the grace while the killed process's reads interrupted."""
    schema = "grace"
    store = PostgresTranscript(postgres.url, schema=schema, connect_timeout=2)
    mine = store.begin([{"role": "user", "content": "a long call, in flight here"}], conversation="here").wait()
    worker = subprocess.Popen(
        [sys.executable, str(WORKER), "begin", postgres.url, schema, "there"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        assert worker.stdout is not None
        ready, _, _ = select.select([worker.stdout], [], [], 60)
        assert ready, "the worker did not begin its call"
        theirs = int(worker.stdout.readline())
        postgres.stop()
        worker.send_signal(signal.SIGKILL)  # dies while the database is down: its session is gone already
        worker.communicate(timeout=30)
        postgres.start()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.communicate(timeout=30)
    reader = PostgresTranscript(postgres.url, schema=schema, restart_grace=4.0)
    assert reader.get(theirs).status == "pending"  # within the grace: its process may be reconnecting
    assert reader.get(mine.call).status == "pending"
    assert wait_for(lambda: reader.get(theirs).status == "interrupted", 20), reader.get(theirs)
    assert reader.get(theirs).error == INTERRUPTED
    assert reader.get(mine.call).status == "pending"  # re-owned: its process lives
    store.end(mine, None, wait=False, sent=mine.inputs, received={"role": "assistant", "content": "finally"})
    store.flush()
    assert reader.get(mine.call).status == "ok"
    assert reader.history("here")[-1] == {"role": "assistant", "content": "finally"}
    store.close()
    reader.close()


class Relay:
    """A loopback TCP relay in front of Postgres that can swallow what the server sends (``hold``) and cut every
    connection (:meth:`cut`): a network cut that takes the answer to a statement the server committed."""

    def __init__(self, port: int) -> None:
        self.port_to = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.port = int(self.listener.getsockname()[1])
        self.hold = threading.Event()
        self.closed = threading.Event()
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed.is_set():  # bounded by close()
            try:
                client, _ = self.listener.accept()
            except (TimeoutError, OSError):
                continue
            server = socket.create_connection(("127.0.0.1", self.port_to), timeout=5)
            self.sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, holdable: bool) -> None:
        source.settimeout(0.2)
        while not self.closed.is_set():  # bounded by close(), or either side closing
            try:
                data = source.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                return
            if holdable and self.hold.is_set():
                continue  # swallowed: it never reaches the client
            with contextlib.suppress(OSError):
                sink.sendall(data)

    def cut(self) -> None:
        for each in self.sockets:
            with contextlib.suppress(OSError):
                each.shutdown(socket.SHUT_RDWR)
            each.close()
        self.sockets = []

    def close(self) -> None:
        self.closed.set()
        self.cut()
        self.listener.close()


def test_a_begin_whose_answer_a_network_cut_took_reads_failed_not_interrupted(postgres: PostgresServer) -> None:
    """The server committed a begin's row, and the network went before the answer came: the caller gets
    TranscriptUnavailable (nothing is sent), and once the transcript is connected again (its own thread does it)
    the row is closed as failed, saying why; the call still in flight here is carried on by the new session."""
    relay = Relay(postgres.port)
    try:
        store = PostgresTranscript(f"postgresql://ck@127.0.0.1:{relay.port}/postgres", schema="cut", connect_timeout=2)
        in_flight = store.begin([{"role": "user", "content": "a call in flight"}], conversation="c").wait()
        relay.hold.set()
        lost = store.begin([{"role": "user", "content": "the answer to this write is lost"}], conversation="c")
        reader = PostgresTranscript(postgres.url, schema="cut")
        assert wait_for(lambda: len(reader.entries("c")) == 2)  # committed at the server
        relay.cut()
        relay.hold.clear()
        with pytest.raises(TranscriptUnavailable, match="cannot be reached"):
            lost.wait()
        assert wait_for(lambda: reader.last("c").status == "failed"), reader.last("c")  # type: ignore[union-attr]
        entry = reader.last("c")
        assert entry is not None
        assert entry.error is not None
        assert "was lost" in entry.error
        assert "not sent" in entry.error
        assert reader.get(in_flight.call).status == "pending"
        store.end(in_flight, None, wait=False, sent=in_flight.inputs, received={"role": "assistant", "content": "ok"})
        store.flush()
        assert reader.get(in_flight.call).status == "ok"
        reader.close()
        store.close()
    finally:
        relay.close()


@pytest.mark.parametrize("fast_writes", [True, False], ids=["fast", "reference"])
def test_the_outbox_is_bounded_and_what_it_cannot_hold_reads_failed(
    postgres: PostgresServer, fast_writes: bool, caplog: pytest.LogCaptureFixture
) -> None:
    store = PostgresTranscript(postgres.url, schema=f"bound_{fast_writes}", connect_timeout=2, outbox=4)
    store.fast_writes = fast_writes
    caplog.set_level(logging.INFO, logger="contextkeeper")
    started = [
        store.begin([{"role": "user", "content": f"question {i}"}], conversation=f"c{i % 3}").wait() for i in range(10)
    ]
    postgres.stop()
    slowest = 0.0
    for entry in started:
        began = time.monotonic()
        store.end(
            entry, None, wait=False, sent=entry.inputs, received={"role": "assistant", "content": f"{entry.call}"}
        )
        slowest = max(slowest, time.monotonic() - began)
    assert slowest < 2.5  # never blocked on the database (at most one connection attempt, connect_timeout=2)
    assert len(store._outbox) == 4
    full = [r for r in caplog.records if "outbox is full" in r.getMessage()]
    assert len(full) == 1  # loudly, and once (not once per end)
    assert "Fix:" in full[0].getMessage()
    began = time.monotonic()
    with pytest.raises(TranscriptUnavailable, match=r"4 write\(s\) of this process .* still wait") as waited:
        store.flush(timeout=1.0)
    assert time.monotonic() - began < 4
    assert "ck@127.0.0.1" in str(waited.value)
    postgres.start()
    # Reads of this process see its own ends (the outbox is sent before anything else).
    assert store.get(started[0].call).status == "ok"
    store.flush(timeout=30)
    statuses = [store.get(entry.call) for entry in started]
    assert [e.status for e in statuses] == ["ok"] * 4 + ["failed"] * 6
    assert [e.received for e in statuses[:4]] == [{"role": "assistant", "content": f"{e.call}"} for e in started[:4]]
    assert all(e.error and "the end of this call was not recorded" in e.error for e in statuses[4:])
    assert all(e.error and "outbox was full" in e.error for e in statuses[4:])
    store.close()


def test_ends_and_refusals_made_while_postgres_is_down_are_recorded_in_order_after_it_is_back(
    postgres: PostgresServer,
) -> None:
    store = PostgresTranscript(postgres.url, schema="order", connect_timeout=2)
    chat = [{"role": "user", "content": "hello"}]
    first = store.begin(chat, conversation="c").wait()
    refused = store.begin([*chat, {"role": "user", "content": "x" * 500_000}], conversation="c").wait()
    postgres.stop()
    store.end(first, None, wait=False, sent=chat, received={"role": "assistant", "content": "hi"})
    entry = store.refuse(refused, "RequestTooLarge: far too large")
    assert entry.status == "refused"
    with pytest.raises(TranscriptUnavailable):
        store.begin([*chat, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "again"}]).wait()
    postgres.start()
    assert wait_for(lambda: not store._outbox, 20)  # sent by the transcript's own thread, no call needed
    reader = PostgresTranscript(postgres.url, schema="order")
    assert [(e.call, e.status) for e in reader.entries("c")] == [(first.call, "ok"), (refused.call, "refused")]
    assert reader.history("c") == [*chat, {"role": "assistant", "content": "hi"}]
    with psycopg.connect(postgres.url, autocommit=True) as db:
        size = db.execute('SELECT coalesce(sum(length(json)), 0) FROM "order".blobs').fetchone()[0]
    assert size < 1000  # the refused payload is gone
    reader.close()
    store.close()


def test_close_waits_for_the_outbox_and_says_what_it_could_not_record(
    postgres: PostgresServer, caplog: pytest.LogCaptureFixture
) -> None:
    store = PostgresTranscript(postgres.url, schema="closing", connect_timeout=1, statement_timeout=1)
    started = store.begin([{"role": "user", "content": "hi"}]).wait()
    postgres.stop()
    store.end(started, None, wait=False, sent=started.inputs, received={"role": "assistant", "content": "hello"})
    began = time.monotonic()
    store.close()  # waits (bounded: connect_timeout + statement_timeout here), then says what is lost
    assert time.monotonic() - began < 6
    assert any("1 write(s) not recorded" in r.getMessage() for r in caplog.records)
