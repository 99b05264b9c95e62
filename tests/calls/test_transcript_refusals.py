"""Calls refused by our own checks before anything was sent (too large, invalid): the transcript records the
refusal, not the payload, in memory, in SQLite and in Postgres, and never deletes what another entry uses (a call of
the same conversation writing alongside keeps everything). The default in-memory transcript stays within its bound
under a flood of new conversations, evicting the least recently used ones whole.

Postgres runs for real (tests/engines.py); each test has its own schema.
"""

from __future__ import annotations

import gc
import json
import logging
import random
import sqlite3
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import contextkeeper as ck
import contextkeeper.calls.transcript as transcript_module
from contextkeeper._exceptions import MessageError, RequestTooLarge, UnknownCall
from contextkeeper._memo import set_cache_bytes
from contextkeeper.calls.transcript import MemoryTranscript, SQLiteTranscript, Transcript, open_transcript
from engines import PostgresServer

STORES = ["memory", "sqlite", "postgres"]
PAYLOAD = 2_000_000  # characters of the oversized message each refused call carries
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    with PostgresServer() as server:
        yield server


def _schema(request: pytest.FixtureRequest) -> str:
    name = request.node.name[:24].lower()
    return "r_" + "".join(c if c.isalnum() else "_" for c in name) + f"_{time.monotonic_ns() % 10**9}"


def _open(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Transcript:
    """A new handle on the test's store: memory, a SQLite file, or a Postgres schema (the same file or schema on
    every call within a test)."""
    if kind == "memory":
        return MemoryTranscript()
    if kind == "sqlite":
        return SQLiteTranscript(tmp_path / "t.sqlite")
    pytest.importorskip("psycopg")
    from contextkeeper.calls.transcript.postgres import PostgresTranscript

    server = request.getfixturevalue("postgres")
    schema = request.node.__dict__.setdefault("ck_schema", _schema(request))
    return PostgresTranscript(server.url, schema=schema)


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Transcript]:
    transcript = _open(request.param, request, tmp_path)
    yield transcript
    transcript.close()


def held(store: Transcript) -> tuple[int, int, int]:
    """What the store holds: (messages and tools lists, their JSON characters, trie nodes). SQLite keeps the newest
    deleted row of a table as an empty tombstone (its id is not given out again): not counted."""
    if isinstance(store, MemoryTranscript):
        return len(store._texts), sum(map(len, store._texts.values())), len(store._node_of)
    if isinstance(store, SQLiteTranscript):
        db = store.db
        blobs = db.execute("SELECT count(*), coalesce(sum(length(json)), 0) FROM blobs WHERE digest < '~'").fetchone()
        nodes = db.execute("SELECT count(*) FROM nodes WHERE parent >= 0").fetchone()[0]
        return int(blobs[0]), int(blobs[1]), int(nodes)
    import psycopg

    url, schema = store.url, store.schema  # type: ignore[attr-defined]
    with psycopg.connect(url, autocommit=True) as db:
        row = db.execute(
            f'SELECT (SELECT count(*) FROM "{schema}".blobs), (SELECT coalesce(sum(length(json)), 0) FROM '
            f'"{schema}".blobs), (SELECT count(*) FROM "{schema}".nodes)'
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


def honest_chat(store: Transcript, conversation: str, turns: int = 3) -> list[dict[str, Any]]:
    """A chat recorded as wrapped calls write it (begun, waited for, ended behind); the whole history."""
    chat: list[dict[str, Any]] = [{"role": "system", "content": "You answer briefly."}]
    for turn in range(turns):
        chat.append({"role": "user", "content": f"{conversation}: question {turn}"})
        started = store.begin(chat, conversation=conversation, tools=TOOLS).wait()
        reply = {"role": "assistant", "content": f"{conversation}: answer {turn}"}
        store.end(started, None, wait=False, sent=chat, received=reply)
        chat.append(reply)
    return chat


def too_large(size: int) -> RequestTooLarge:
    return RequestTooLarge(
        f"the new request alone is {size:,} tokens, over the limit of 32,768", needed=size, limit=32768
    )


# ----------------------------------------------------------------------------------- refused: the payload goes


def test_refused_calls_keep_their_refusal_and_none_of_their_payload(store: Transcript) -> None:
    chat = honest_chat(store, "c")
    store.flush()
    before = held(store)
    gc.collect()
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        for i in range(5):
            oversized = [*chat, {"role": "user", "content": f"{i} " + "x" * PAYLOAD}]
            # Its own tools list (stored once, by this call alone) goes too.
            tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": "y" * 50_000}}]
            started = store.begin(oversized, conversation="c", tools=tools).wait()
            assert held(store)[1] >= before[1] + PAYLOAD  # written ahead, as every call is
            entry = store.refuse(started, too_large(PAYLOAD // 4))
            assert (entry.call, entry.status, entry.inputs, entry.tools) == (started.call, "refused", (), None)
            sizes = entry.report["refused"]
            assert (sizes["messages"], sizes["tools"]) == (len(oversized), 1)
            assert sizes["bytes"] >= PAYLOAD
            assert sizes["tools_bytes"] >= 50_000
            assert held(store) == before, f"refusal {i}: what only the refused call used is still stored"
            del oversized, tools, started
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - baseline
    finally:
        tracemalloc.stop()
    # 5 payloads of 2 MB passed through: none is held by the transcript (store or caches) afterwards.
    assert kept < PAYLOAD // 2, f"{kept:,} bytes still held after 5 refusals of {PAYLOAD:,} characters"
    entries = store.entries("c")
    refused = [e for e in entries if e.status == "refused"]
    assert len(refused) == 5
    assert all(e.inputs == () and e.sent == () and e.received is None for e in refused)
    assert all(e.error is not None and e.error.startswith("RequestTooLarge: the new request alone") for e in refused)
    last = store.last("c")
    assert last is not None
    assert last.status == "refused"
    assert store.history("c") == chat  # the refused inputs were never part of the conversation
    assert [e.status for e in entries if e.status != "refused"] == ["ok"] * 3
    again = store.get(refused[0].call)
    assert again.to_dict() == refused[0].to_dict()


def test_a_sqlite_file_does_not_grow_with_refused_payloads(tmp_path: Path) -> None:
    path = tmp_path / "refused.sqlite"
    store = SQLiteTranscript(path)
    chat = honest_chat(store, "c")

    def size() -> int:
        with sqlite3.connect(path) as db:
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return path.stat().st_size

    sizes = []
    for i in range(8):
        started = store.begin([*chat, {"role": "user", "content": f"{i} " + "z" * PAYLOAD}], conversation="c").wait()
        store.refuse(started, MessageError("message 4: content is not valid"))
        sizes.append(size())
    # The first refusal's pages are free afterwards, and every later payload reuses them: 8 refused payloads of
    # 2 MB (16 MB) leave the file at about one payload, not eight.
    assert sizes[-1] - sizes[0] < PAYLOAD // 4, sizes
    assert sizes[-1] < 1.5 * PAYLOAD
    store.close()


def test_a_call_refused_before_anything_was_written_records_its_counts(store: Transcript) -> None:
    hostile: list[Any] = [{"role": "user", "content": "a" * 1000}] * 3
    entry = store.refuse(None, MessageError("nested 1,000 levels deep"), conversation="h", inputs=hostile)
    assert entry.call >= 1
    stored = store.get(entry.call)
    assert (stored.status, stored.conversation, stored.inputs) == ("refused", "h", ())
    assert stored.report["refused"] == {"messages": 3, "tools": 0}
    assert stored.error == "MessageError: nested 1,000 levels deep"
    assert store.history("h") == []
    assert held(store)[0] == 0


def test_only_a_call_in_flight_can_be_refused(store: Transcript) -> None:
    started = store.start([{"role": "user", "content": "hi"}], conversation="c")
    store.end(started, None, sent=started.inputs, received={"role": "assistant", "content": "hello"})
    with pytest.raises(UnknownCall, match="in flight"):
        store.refuse(started, "too late: it was answered")
    assert store.get(started.call).status == "ok"
    assert store.history("c")[-1] == {"role": "assistant", "content": "hello"}


# --------------------------------------------------------------- what another entry uses is never deleted


@pytest.mark.parametrize("when", ["after the honest call ended", "while the honest call is in flight"])
def test_a_call_of_the_same_conversation_keeps_what_it_shares_with_refused_ones(store: Transcript, when: str) -> None:
    """Two refused calls wrote first, so every row the honest call uses was written by one of them: its inputs
    are a prefix of the first's, its tools the same new list, its prompt (rewritten, stored as a path of its own)
    the second's first two messages, and its reply equal to a message only the first carried. One payload is
    in both refused calls."""
    chat = honest_chat(store, "c", turns=2)
    question = {"role": "user", "content": "the honest question " + "q" * 300}
    shortened = {"role": "user", "content": "the honest question (shortened)"}
    reply = {"role": "assistant", "content": "the honest reply"}
    tools = [{"type": "function", "function": {"name": "only_these_calls", "parameters": {"type": "object"}}}]
    payload = {"role": "user", "content": "p" * PAYLOAD}
    first = store.begin([*chat, question, reply, payload], conversation="c", tools=tools).wait()
    second = store.begin([chat[0], shortened, payload], conversation="c").wait()
    honest = store.begin([*chat, question], conversation="c", tools=tools).wait()
    prompt = [chat[0], shortened]
    if when == "after the honest call ended":
        store.end(honest, None, wait=False, sent=prompt, received=reply, usage={"prompt_tokens": 12})
    store.refuse(first, too_large(PAYLOAD))
    assert held(store)[1] > PAYLOAD  # the second still uses the payload
    store.refuse(second, MessageError("invalid"))
    if when == "while the honest call is in flight":
        store.end(honest, None, wait=False, sent=prompt, received=reply, usage={"prompt_tokens": 12})
    entry = store.get(honest.call)
    assert entry.status == "ok"
    assert list(entry.inputs) == [*chat, question]
    assert list(entry.sent) == prompt
    assert entry.rewritten  # (so the prompt is a path of its own in every store)
    assert entry.tools == tuple(tools)
    assert entry.received == reply
    assert store.history("c") == [*chat, question, reply]
    assert held(store)[1] < PAYLOAD  # the payload itself is gone
    # The next turn (through this transcript's caches) reads back whole, here and from a new handle.
    chat = [*chat, question, reply, {"role": "user", "content": "and then?"}]
    following = store.begin(chat, conversation="c", tools=tools).wait()
    store.end(following, None, wait=False, sent=prompt + chat[-1:], received={"role": "assistant", "content": "so"})
    assert store.history("c") == [*chat, {"role": "assistant", "content": "so"}]
    assert [e.status for e in store.entries("c")] == ["ok", "ok", "refused", "refused", "ok", "ok"]


@pytest.mark.parametrize("kind", STORES)
def test_refusals_and_honest_calls_of_one_conversation_at_once_lose_nothing(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Threads on two handles of one store (two connections: two replicas of one Postgres schema, two writers of
    one SQLite file) make honest calls and refused calls of the same conversation at once; each refused call's
    inputs start with the honest call's. Every honest entry reads back whole, and no payload is left."""
    stores = [_open(kind, request, tmp_path)]
    stores.append(stores[0] if kind == "memory" else _open(kind, request, tmp_path))
    chat = honest_chat(stores[0], "c", turns=2)
    stores[0].flush()
    answered: dict[int, tuple[list[dict[str, Any]], dict[str, Any]]] = {}
    errors: list[BaseException] = []
    lock = threading.Lock()

    def caller(k: int) -> None:
        rng = random.Random(k)
        try:
            for i in range(12):
                question = {"role": "user", "content": f"caller {k} question {i}"}
                reply = {"role": "assistant", "content": f"caller {k} answer {i}"}
                oversized = [*chat, question, reply, {"role": "user", "content": f"{k}.{i} " + "w" * 200_000}]
                here, there = rng.sample(stores, 2) if len(stores) == 2 and stores[0] is not stores[1] else stores
                honest_inputs = [*chat, question]
                if rng.random() < 0.5:  # the refused call writes first, or second
                    refused = here.begin(oversized, conversation="c", tools=TOOLS).wait()
                    honest = there.begin(honest_inputs, conversation="c", tools=TOOLS).wait()
                else:
                    honest = there.begin(honest_inputs, conversation="c", tools=TOOLS).wait()
                    refused = here.begin(oversized, conversation="c", tools=TOOLS).wait()
                if rng.random() < 0.5:
                    here.refuse(refused, too_large(200_000))
                    there.end(honest, None, wait=False, sent=honest.inputs, received=reply)
                else:
                    there.end(honest, None, wait=False, sent=honest.inputs, received=reply)
                    here.refuse(refused, too_large(200_000))
                with lock:
                    answered[honest.call] = ([*chat, question], reply)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(6)]
    for each in threads:
        each.start()
    for each in threads:
        each.join(120)
    assert not errors, errors[:3]
    assert not any(each.is_alive() for each in threads)
    for each in stores:
        each.flush()
    reader = stores[1]
    entries = {e.call: e for e in reader.entries("c")}
    assert len(answered) == 6 * 12
    for call, (inputs, reply) in answered.items():
        entry = entries[call]
        assert (entry.status, list(entry.inputs), entry.received, entry.tools) == ("ok", inputs, reply, tuple(TOOLS))
    assert sum(e.status == "refused" for e in entries.values()) == 6 * 12
    assert held(stores[0])[1] < 200_000  # no payload left
    for each in dict.fromkeys(stores):
        each.close()


# ---------------------------------------------------------------------------------- the default's bound


def test_the_default_transcript_is_bounded_and_explicit_stores_are_not(tmp_path: Path) -> None:
    default = open_transcript(None)
    assert isinstance(default, MemoryTranscript)
    assert default.max_bytes == transcript_module.DEFAULT_MEMORY_BYTES == 256 * 1024 * 1024
    assert MemoryTranscript().max_bytes is None
    keeper = ck.ContextKeeper(ck.load_counter("mistral:tekken"), context_window=4096)
    assert keeper.transcript.max_bytes == transcript_module.DEFAULT_MEMORY_BYTES
    for bad in (0, -1, 1.5, True, "1GB"):
        with pytest.raises(ck.ConfigurationError, match="max_bytes"):
            MemoryTranscript(max_bytes=bad)  # type: ignore[arg-type]


@pytest.fixture
def small_cache() -> Iterator[int]:
    limit = 1024 * 1024
    set_cache_bytes(limit)
    try:
        yield limit
    finally:
        set_cache_bytes(None)


def test_a_flood_of_new_conversations_keeps_the_memory_transcript_within_its_bound(
    caplog: pytest.LogCaptureFixture, small_cache: int
) -> None:
    bound = 4 * 1024 * 1024
    store = MemoryTranscript(max_bytes=bound)
    busy = store.begin([{"role": "user", "content": "a long call, in flight all along"}], conversation="busy").wait()
    kept_warm = honest_chat(store, "warm")
    caplog.set_level(logging.WARNING, logger="contextkeeper")
    gc.collect()
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        peak = 0
        total = 0
        for n in range(3000):  # ~12 MB of chats under new ids: three times the bound
            chat = [
                {"role": "system", "content": f"tenant {n}"},
                {"role": "user", "content": f"{n}: " + "lorem ipsum dolor " * 200},
            ]
            total += len(json.dumps(chat))
            started = store.begin(chat, conversation=f"flood-{n}").wait()
            store.end(started, None, wait=False, sent=chat, received={"role": "assistant", "content": f"ok {n}"})
            assert store.nbytes <= bound
            if n % 100 == 0:
                assert store.history("warm") == kept_warm  # read: used, so never the least recently used
                peak = max(peak, tracemalloc.get_traced_memory()[0] - baseline)
        del chat, started
        gc.collect()
        now = tracemalloc.get_traced_memory()[0] - baseline
    finally:
        tracemalloc.stop()
    assert total > 2.5 * bound
    assert store.evicted > 1000
    # What the process holds follows the bound: the store's, plus the caches' own (the shared cache budget).
    assert now < 1.5 * bound + small_cache, f"{now:,} bytes held after {total:,} bytes of chats, max_bytes={bound:,}"
    assert peak < 1.5 * bound + small_cache
    assert store.history("flood-2999")[-1] == {"role": "assistant", "content": "ok 2999"}
    assert store.history("flood-0") == []  # evicted whole
    assert store.history("warm") == kept_warm
    store.end(busy, None, sent=busy.inputs, received={"role": "assistant", "content": "done at last"})
    assert store.history("busy")[-1] == {"role": "assistant", "content": "done at last"}  # never evicted
    warnings = [r for r in caplog.records if "max_bytes" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]  # once per burst of evictions
    assert "Fix:" in warnings[0].getMessage()
    # Every entry still held reads back whole.
    for entry in store.entries():
        assert entry.inputs
    assert len(store) < 3000


def test_an_evicted_conversation_that_comes_back_is_stored_again_whole() -> None:
    store = MemoryTranscript(max_bytes=64 * 1024)
    shared = {"role": "system", "content": "the same system prompt in every conversation " * 20}
    for n in range(200):
        chat = [shared, {"role": "user", "content": f"conversation {n} " + "text " * 100}]
        store.add(chat, None, sent=chat, conversation=f"c{n % 50}", received={"role": "assistant", "content": "ok"})
        assert store.nbytes <= 64 * 1024
        assert store.last(f"c{n % 50}") is not None
        assert store.history(f"c{n % 50}") == [*chat, {"role": "assistant", "content": "ok"}]
    assert store.evicted > 0
    for entry in store.entries():
        assert entry.inputs[0] == shared
