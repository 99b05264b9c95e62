"""The transcript in a real Postgres (started by the tests): the transcript's behaviour, replicas and processes
sharing it, its schema and migrations, a database that goes away, and a wrapped chat SIGKILLed over and over.

Each test has its own schema (or, for the wrapped chat, its own database) in one server per module.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import os
import random
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_crash import _key
from test_crash import _read as _read_line
from test_transcript import test_a_call_is_recorded_and_its_removed_messages_recovered as _recorded_and_recovered
from test_transcript import test_a_dict_changed_in_place_is_recorded_as_it_was as _edited_in_place
from test_transcript import test_failed_calls_and_conversations as _failed_and_conversations

import contextkeeper as ck
from contextkeeper._exceptions import TranscriptUnavailable, TransportError, UnknownCall
from contextkeeper.calls.transcript import INTERRUPTED, SQLiteTranscript, Transcript, check_transcript, open_transcript
from contextkeeper.calls.transcript.postgres import MIGRATIONS, PostgresTranscript
from engines import PostgresServer, _free_port

psycopg = pytest.importorskip("psycopg")

WORKER = Path(__file__).resolve().parents[1] / "transcript_worker.py"
SRC = Path(ck.__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    with PostgresServer() as server:
        yield server


@pytest.fixture
def schema(request: pytest.FixtureRequest) -> str:
    return f"t_{request.node.name[:30]}_{time.monotonic_ns() % 10**9}".lower().replace("[", "_").replace("]", "")


@pytest.fixture
def store(postgres: PostgresServer, schema: str) -> Iterator[PostgresTranscript]:
    with PostgresTranscript(postgres.url, schema=schema) as transcript:
        yield transcript


@pytest.fixture(scope="module")
def counter() -> Any:
    return ck.load_counter("mistral:tekken")


def sql(postgres: PostgresServer, query: str, params: Any = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(postgres.url, autocommit=True) as db:
        cursor = db.execute(query, params)
        return cursor.fetchall() if cursor.description else []


def worker(*args: str, timeout: float = 60) -> str:
    done = subprocess.run(
        [sys.executable, str(WORKER), *args], capture_output=True, text=True, timeout=timeout, env=ENV, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def wait_for(condition: Callable[[], bool], seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


# ------------------------------------------------------------------------------------ what every transcript does


@pytest.mark.parametrize(
    "check",
    [_recorded_and_recovered, _failed_and_conversations, _edited_in_place],
    ids=lambda check: check.__name__.removeprefix("test_"),
)
def test_the_transcript_checks_hold_on_postgres(check: Callable[..., None], store: Transcript, counter: Any) -> None:
    """The checks tests/calls/test_transcript.py makes of memory and SQLite, on Postgres."""
    given = {"transcript": store, "counter": counter}
    check(**{name: given[name] for name in inspect.signature(check).parameters})


def _script(store: Transcript) -> None:
    """One run of everything a transcript is asked to do: started and ended calls, a failed one, a recorded one,
    two conversations, a tools list, a call whose end never came."""
    chat: list[dict[str, Any]] = [{"role": "system", "content": 'Quotes " and \\ backslashes, ü, \u2603.'}]
    tools = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
    for turn in range(6):
        chat.append({"role": "user", "content": f'question {turn} {{braces}} "q" \\n'})
        if turn % 2:  # as a wrapped call writes: begun, waited for, ended without waiting
            begun = store.begin(chat, conversation="a", tools=tools, time=1000.0 + turn)
            started = begun.wait()
        else:
            started = store.start(chat, conversation="a", time=1000.0 + turn)
        reply = {"role": "assistant", "content": f"answer {turn}"}
        if turn == 3:
            store.end(started, None, wait=False, error=TimeoutError("slow"), attempts=3)
        else:
            sent = chat if turn == 4 else [chat[0], *chat[-3:]]  # the whole chat, or a window of it
            store.end(started, None, wait=turn != 5, sent=sent, received=reply, usage={"prompt_tokens": turn})
        chat.append(reply)
        store.add(chat[-2:], None, sent=chat[-1:], conversation="b", time=2000.0 + turn)
    store.start([*chat, {"role": "user", "content": "never answered"}], conversation="a", time=3000.0)


def test_postgres_holds_what_sqlite_holds_and_both_write_paths_store_the_same_rows(
    postgres: PostgresServer, schema: str, tmp_path: Path
) -> None:
    fast = PostgresTranscript(postgres.url, schema=schema + "_fast")
    reference = PostgresTranscript(postgres.url, schema=schema + "_ref")
    reference.fast_writes = False
    lite = SQLiteTranscript(tmp_path / "same.db")
    for store in (fast, reference, lite):
        _script(store)
    expected = [e.to_dict() for e in lite.entries()]
    # The begun call is this process's (pending) in each; everything else equal, numbering included.
    assert [e.to_dict() for e in fast.entries()] == expected
    assert [e.to_dict() for e in reference.entries()] == expected
    assert fast.history("a") == lite.history("a")
    for table, order in (("blobs", "id"), ("nodes", "id"), ("calls", "call")):
        columns = "*" if table != "calls" else "call, conversation, time, inputs, sent, tools, received, dropped, "
        if table == "calls":
            columns += "rewritten, report, usage, error, attempts, state"
        rows = [
            sql(postgres, f'SELECT {columns} FROM "{name}".{table} ORDER BY {order}')
            for name in (fast.schema, reference.schema)
        ]
        assert rows[0] == rows[1], table
        assert rows[0]
    for store in (fast, reference, lite):
        store.close()


def test_writes_left_in_flight_land_before_anything_reads_and_a_failed_one_is_logged(
    postgres: PostgresServer, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = PostgresTranscript(postgres.url, schema=schema)
    other = PostgresTranscript(postgres.url, schema=schema)  # another replica
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    begun = store.begin(chat, conversation="c")
    started = begun.wait()
    assert begun.wait() is started  # waited once
    assert other.get(started.call).status == "pending"  # durable, and its writer's session is alive
    store.end(started, None, wait=False, sent=chat, received={"role": "assistant", "content": "hello"})
    assert store.history("c")[-1] == {"role": "assistant", "content": "hello"}  # this process reads its own end
    store.flush()
    assert other.get(started.call).status == "ok"
    # An end whose call is unknown: logged when its answer is read (by the next use), not raised into the caller.
    ghost = dataclasses.replace(started, call=10_000)
    store.end(ghost, None, wait=False, sent=chat, received={"role": "assistant", "content": "lost"})
    assert len(store) == 1
    assert "could not complete call 10000" in caplog.text
    again = store.start([*chat, {"role": "user", "content": "again"}], conversation="c")
    assert again.call == 2
    store.close()
    other.close()


def test_a_prompt_that_is_the_inputs_less_the_dropped_ones_stores_no_path_of_its_own(
    postgres: PostgresServer, schema: str
) -> None:
    store = PostgresTranscript(postgres.url, schema=schema)
    chat = [{"role": "system", "content": "Be brief."}] + [
        {"role": "user" if i % 2 else "assistant", "content": f"message {i}"} for i in range(1, 12)
    ]
    started = store.start(chat, conversation="w")
    nodes = sql(postgres, f'SELECT count(*) FROM "{schema}".nodes')[0][0]
    window = [chat[0], *chat[-4:]]
    store.end(started, None, sent=window, received={"role": "assistant", "content": "ok"})
    assert sql(postgres, f'SELECT count(*) FROM "{schema}".nodes')[0][0] == nodes  # the window is not stored again
    assert sql(postgres, f'SELECT sent FROM "{schema}".calls') == [(None,)]
    entry = store.get(started.call)
    assert entry.sent == tuple(window)
    assert entry.dropped == tuple(range(1, 8))
    # A prompt with a message of its own (a rewrite) is stored as its own path.
    rewritten = [chat[0], {"role": "user", "content": "message 1, shortened"}, *chat[-2:]]
    started = store.start(chat, conversation="w")
    store.end(started, None, sent=rewritten, received={"role": "assistant", "content": "ok"})
    assert store.get(started.call).sent == tuple(rewritten)
    assert sql(postgres, f'SELECT count(*) FROM "{schema}".nodes')[0][0] > nodes
    store.close()


def test_a_reopened_transcript_continues_and_a_closed_one_says_so(postgres: PostgresServer, schema: str) -> None:
    chat: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
    with PostgresTranscript(postgres.url, schema=schema) as first:
        for turn in range(3):
            chat.append({"role": "user", "content": f"question {turn}"})
            first.add(chat, None, sent=chat[-2:], received={"role": "assistant", "content": f"answer {turn}"})
            chat.append({"role": "assistant", "content": f"answer {turn}"})
        written = [e.to_dict() for e in first.entries()]
    with open_transcript(postgres.url.replace("postgresql://", "postgres://")) as default_schema:
        assert isinstance(default_schema, PostgresTranscript)
        assert default_schema.schema == "contextkeeper"
    again = PostgresTranscript(postgres.url, schema=schema)
    assert [e.to_dict() for e in again.entries()] == written
    assert again.history() == chat
    chat.append({"role": "user", "content": "question 3"})
    assert again.add(chat, None, sent=chat).call == 4
    assert again.recover(2) == chat[:2]
    assert len(again) == 4
    with pytest.raises(UnknownCall, match="no call 99"):
        again.get(99)
    again.close()
    with pytest.raises(ck.ContextKeeperError, match="closed"):
        again.entries()


def test_two_replicas_carry_one_conversation_between_them(postgres: PostgresServer, schema: str) -> None:
    """A conversation that moves between replicas on every turn: each resumes from the history the other wrote."""
    replicas = [PostgresTranscript(postgres.url, schema=schema) for _ in range(2)]
    for turn in range(10):
        here = replicas[turn % 2]
        chat = here.history("moving")
        chat.append({"role": "user", "content": f"turn {turn}"})
        started = here.start(chat, conversation="moving")
        assert replicas[(turn + 1) % 2].get(started.call).status == "pending"  # seen from the other replica
        here.end(started, None, sent=chat, received={"role": "assistant", "content": f"reply {turn}"})
    whole = [m for t in range(10) for m in ({"role": "user", "content": f"turn {t}"},)]
    for replica in replicas:
        history = replica.history("moving")
        assert [m for m in history if m["role"] == "user"] == whole
        assert [e.call for e in replica.entries("moving")] == list(range(1, 11))
        assert all(e.status == "ok" for e in replica.entries("moving"))
    # Each message once: 19 trie nodes (10 questions, the 9 answers before the last), whoever wrote them.
    assert sql(postgres, f'SELECT count(*) FROM "{schema}".nodes') == [(19,)]
    for replica in replicas:
        replica.close()


def test_threads_and_processes_write_one_transcript(postgres: PostgresServer, schema: str) -> None:
    """Threads of one transcript, and processes writing the very same chats (the same rows at the same moments:
    no unique violation, no deadlock); then another process reads a history and recovers a call."""
    store = PostgresTranscript(postgres.url, schema=schema)
    errors: list[BaseException] = []

    def thread(name: str) -> None:
        chat: list[dict[str, Any]] = []
        try:
            for turn in range(10):
                chat.append({"role": "user", "content": f"{name} {turn}"})
                store.add(chat, None, sent=chat, conversation=name, received={"role": "assistant", "content": "ok"})
                chat.append({"role": "assistant", "content": "ok"})
        except BaseException as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=thread, args=(f"t{i}",)) for i in range(4)]
    for each in threads:
        each.start()
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), "write", postgres.url, schema, f"w{i}", "150"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
        )
        for i in range(3)
    ]
    outputs = [proc.communicate(timeout=120) for proc in procs]
    for each in threads:
        each.join(30)
    assert not errors
    assert [proc.returncode for proc in procs] == [0, 0, 0], [err[-2000:] for _, err in outputs]
    assert sorted(e.call for e in store.entries()) == list(range(1, 40 + 3 * 150 + 1))
    for i in range(3):
        history = store.history(f"w{i}")
        assert len(history) == 1 + 2 * 150
        assert history[-1] == {"role": "assistant", "content": "ok 149"}
    # The three processes' chats are one chat: 300 trie nodes (system, 150 questions, 149 answers); each thread's
    # chat 19 more. Every node's message is stored.
    assert sql(postgres, f"SELECT count(*) FROM {schema}.nodes") == [(300 + 4 * 19,)]
    orphans = (
        f"SELECT count(*) FROM {schema}.nodes n WHERE NOT EXISTS (SELECT FROM {schema}.blobs b WHERE b.id = n.blob)"
    )
    assert sql(postgres, orphans) == [(0,)]
    read = json.loads(worker("read", postgres.url, schema, "t2", str(store.entries("t2")[4].call)))
    assert read["history"] == store.history("t2")
    assert read["recover"] == store.recover(store.entries("t2")[4].call)
    assert set(read["status"].values()) == {"ok"}
    store.close()


def test_a_call_of_a_killed_process_reads_interrupted_from_any_replica(postgres: PostgresServer, schema: str) -> None:
    """The owner of a begun call is its writer's database session: pending while that session lives, interrupted
    once the process is gone (the kill closes its connection), whoever reads."""
    reader = PostgresTranscript(postgres.url, schema=schema)
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), "begin", postgres.url, schema, "killed"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "the writer did not start a call"
        call = int(proc.stdout.readline())
        entry = reader.get(call)
        assert (entry.status, entry.error) == ("pending", None)
        mine = reader.start([{"role": "user", "content": "in flight here"}], conversation="alive")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
    assert wait_for(lambda: reader.get(call).status == "interrupted"), reader.get(call)
    assert reader.get(call).error == INTERRUPTED
    assert reader.history("killed") == [{"role": "user", "content": "a call that never ends"}]
    assert reader.get(mine.call).status == "pending"  # this process's call: its session lives
    other = PostgresTranscript(postgres.url, schema=schema)
    assert (other.get(call).status, other.get(mine.call).status) == ("interrupted", "pending")
    reader.close()  # this process's session ends: its call is interrupted too
    assert wait_for(lambda: other.get(mine.call).status == "interrupted")
    other.close()


# ------------------------------------------------------------------------------------------ schema and migrations

_V1 = """
CREATE SCHEMA {s};
CREATE TABLE {s}.meta (key text PRIMARY KEY, value text NOT NULL);
INSERT INTO {s}.meta VALUES ('version', '1');
CREATE TABLE {s}.blobs (id uuid PRIMARY KEY, json text NOT NULL);
CREATE TABLE {s}.nodes (id uuid PRIMARY KEY, parent uuid NOT NULL, blob uuid NOT NULL);
CREATE TABLE {s}.calls (
    call bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, conversation text NOT NULL, time double precision NOT NULL,
    inputs uuid NOT NULL, sent uuid NOT NULL, tools uuid, received uuid, dropped text NOT NULL,
    rewritten text NOT NULL, report text NOT NULL, usage text, error text, attempts integer NOT NULL
);
CREATE INDEX calls_by_conversation ON {s}.calls (conversation, call);
"""


def test_a_version_1_schema_is_migrated_and_keeps_its_calls(postgres: PostgresServer, schema: str) -> None:
    """A schema written by the first version (made here by hand, no write-ahead columns), with one call in it."""
    import hashlib

    def digest(text: str) -> str:
        return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()

    with psycopg.connect(postgres.url, autocommit=True) as db:
        db.execute(_V1.replace("{s}", schema))
        question, answer = '{"role":"user","content":"hi"}', '{"role":"assistant","content":"hello"}'
        db.execute(
            f"INSERT INTO {schema}.blobs VALUES (%s, %s), (%s, %s)",
            (digest(question), question, digest(answer), answer),
        )
        # A node's id: the hash of its parent's id and its message's id (here the root, 0).
        data = (0).to_bytes(16, "big") + bytes.fromhex(digest(question))
        node = int(hashlib.blake2b(data, digest_size=16, person=b"ck.trie.node").hexdigest(), 16)
        db.execute(f"INSERT INTO {schema}.nodes VALUES (%s, %s, %s)", (f"{node:032x}", f"{0:032x}", digest(question)))
        db.execute(
            f"INSERT INTO {schema}.calls (conversation, time, inputs, sent, received, dropped, rewritten, report, "
            "attempts) VALUES ('old', 1.5, %s, %s, %s, '[]', '[]', '{}', 1)",
            (f"{node:032x}", f"{node:032x}", digest(answer)),
        )
    store = PostgresTranscript(postgres.url, schema=schema)
    assert sql(postgres, f"SELECT value FROM {schema}.meta WHERE key = 'version'") == [(str(len(MIGRATIONS)),)]
    old = store.get(1)
    assert (old.status, old.inputs, old.received) == ("ok", ({"role": "user", "content": "hi"},), json.loads(answer))
    assert store.history("old") == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    started = store.start([*store.history("old"), {"role": "user", "content": "again"}], conversation="old")
    assert (started.call, store.get(2).status) == (2, "pending")
    store.close()
    assert len(PostgresTranscript(postgres.url, schema=schema)) == 2  # opened again: nothing to migrate


def test_a_schema_newer_than_this_code_is_refused(postgres: PostgresServer, schema: str) -> None:
    PostgresTranscript(postgres.url, schema=schema).close()
    sql(postgres, f"UPDATE {schema}.meta SET value = '99' WHERE key = 'version'")
    newest = len(MIGRATIONS)
    with pytest.raises(ck.ConfigurationError, match=rf"version 99, newer.*up to {newest}\).*upgrade contextkeeper"):
        PostgresTranscript(postgres.url, schema=schema)


def test_replicas_starting_together_migrate_once(postgres: PostgresServer, schema: str) -> None:
    barrier = threading.Barrier(6)
    opened: list[PostgresTranscript] = []
    errors: list[BaseException] = []

    def start() -> None:
        try:
            barrier.wait(10)
            opened.append(PostgresTranscript(postgres.url, schema=schema))
        except BaseException as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(6)]
    for each in threads:
        each.start()
    for each in threads:
        each.join(60)
    assert not errors
    assert len(opened) == 6
    for i, store in enumerate(opened):
        store.add([{"role": "user", "content": f"replica {i}"}], None, conversation="x")
    assert sorted(e.call for e in opened[0].entries()) == list(range(1, 7))
    assert sql(postgres, f"SELECT count(*) FROM {schema}.meta") == [(1,)]
    for store in opened:
        store.close()


# ------------------------------------------------------------------------------------------ URLs and availability


def test_postgres_urls_are_checked_without_connecting(counter: Any) -> None:
    nowhere = f"postgresql://ck:s3cret@127.0.0.1:{_free_port()}/db"
    assert check_transcript(nowhere) == nowhere
    assert check_transcript("postgres://app@db.internal/chat?sslmode=require") == (
        "postgres://app@db.internal/chat?sslmode=require"
    )
    keeper = ck.ContextKeeper(counter, context_window=4096, transcript=nowhere)  # nothing connects until used
    with pytest.raises(ck.ConfigurationError, match=r"scheme 'mysql'.*postgresql://, postgres://") as refused:
        check_transcript("mysql://root:hunter2@127.0.0.1/db")
    assert "hunter2" not in str(refused.value)
    with pytest.raises(ck.ConfigurationError, match="'notaport', not a port number"):
        check_transcript("postgresql://ck:s3cret@127.0.0.1:notaport/db")
    with pytest.raises(ck.ConfigurationError, match="not a Postgres URL libpq can read") as bad:
        check_transcript("postgresql://ck:s3cret%zz@127.0.0.1/db")  # libpq's message quotes the password part
    assert "s3cret" not in str(bad.value)
    with pytest.raises(ck.ConfigurationError, match="schema="):
        PostgresTranscript(nowhere, schema="")
    with pytest.raises(TranscriptUnavailable) as unreachable:
        keeper.transcript  # noqa: B018  (the first use opens it)
    assert isinstance(unreachable.value, TransportError)
    message = str(unreachable.value)
    assert "s3cret" not in message
    assert nowhere.replace("s3cret", "***") in message
    assert "Fix:" in message
    assert unreachable.value.__cause__ is None  # the libpq error (which might quote the URL) is not chained


def test_a_restarted_postgres_is_reconnected(postgres: PostgresServer, schema: str) -> None:
    """Down: each use is a TranscriptUnavailable, at once; back: the next use reconnects, and a call begun on the
    lost session is carried on by the new one."""
    store = PostgresTranscript(postgres.url, schema=schema, connect_timeout=2)
    chat = [{"role": "user", "content": "before"}]
    store.add(chat, None, sent=chat, received={"role": "assistant", "content": "ok"})
    in_flight = store.start([*chat, {"role": "user", "content": "during"}])
    postgres.stop()
    try:
        for _ in range(2):
            began = time.monotonic()
            with pytest.raises(TranscriptUnavailable, match="cannot be reached"):
                store.start([{"role": "user", "content": "while down"}])
            assert time.monotonic() - began < 5
        with pytest.raises(TranscriptUnavailable):
            store.history()
    finally:
        postgres.start()
    assert store.get(in_flight.call).status == "pending"  # re-owned by the new session
    store.end(in_flight, None, sent=in_flight.inputs, received={"role": "assistant", "content": "after"})
    assert store.history()[-1] == {"role": "assistant", "content": "after"}
    # Restarted while idle: the next call notices the closed session and goes to a new one, without an error.
    postgres.stop()
    postgres.start()
    assert store.add(chat, None, sent=chat).call > in_flight.call
    store.close()


# ------------------------------------------------------------------------------------------ a wrapped chat, killed


def _settled(store: Transcript, conversation: str) -> bool:
    return all(e.status != "pending" for e in store.entries(conversation))


def _seed(message: dict[str, Any]) -> int:
    """The run that wrote an app's message ("message SEED.TURN: ..."; SEED // 100 is the app's slot)."""
    return int(message["content"].split(":", 1)[0].split()[1].split(".")[0])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks the app")
def test_a_wrapped_chat_sigkilled_in_two_processes_loses_no_message(postgres: PostgresServer, tmp_path: Path) -> None:
    """Two app processes (``transcript="postgresql://..."``, the official SDK, the project's test server) chat at
    once and are SIGKILLed in turn at random moments, then restarted from ``history()``. After every kill: nothing
    of the killed app's reads "pending" (its session ended with it), and every message it sent or logged before
    a call is in the transcript."""
    pytest.importorskip("openai")
    from assets import require_assets, tokenizer_dir
    from conftest import hf_tokenizer
    from openai_server import ChatServer

    require_assets()
    sql(postgres, "CREATE DATABASE crash")
    url = postgres.url.rsplit("/", 1)[0] + "/crash"
    zygote = subprocess.Popen(
        [sys.executable, str(WORKER), "zygote"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    rng = random.Random(20)
    started = time.monotonic()
    server = ChatServer(
        tokenizer_dir("qwen2"), max_model_len=2048, tokenizer=hf_tokenizer("qwen2"), response_delay=0.03,
        chunk_delay=0.01, stream_chunk_words=1,
    )  # fmt: skip
    logs = [tmp_path / f"app{slot}.log" for slot in range(2)]
    runs = [0, 0]
    figures = {"kills": 0, "interrupted calls": 0}
    checked = [0, 0]  # messages each app logged, all checked after its latest kill
    try:
        server.start()
        server.random_failures({"cut": 0.2, "500": 0.05}, seed=3, after=(0, 4))
        assert _read_line(zygote, timeout=180) == "ready"
        assert zygote.stdin is not None

        def run(slot: int) -> int:
            assert zygote.stdin is not None
            seed = 100 * slot + runs[slot]
            runs[slot] += 1
            zygote.stdin.write(f"run {server.base_url} {url} {logs[slot]} {seed} chat{slot}\n")
            zygote.stdin.flush()
            return int(_read_line(zygote))

        store = PostgresTranscript(url)  # (it creates the schema if the apps have not yet)
        pids = [run(0), run(1)]
        for kill in range(22):
            slot = kill % 2
            time.sleep(rng.uniform(0.15, 0.6))
            os.kill(pids[slot], signal.SIGKILL)
            zygote.stdin.write(f"reap {pids[slot]}\n")
            zygote.stdin.flush()
            assert _read_line(zygote) == "reaped"
            figures["kills"] += 1
            conversation = f"chat{slot}"
            settled = functools.partial(_settled, store, conversation)
            assert wait_for(settled), f"after kill {kill + 1}: a call of the killed app still reads pending"
            entries = store.entries(conversation)
            assert all(e.error == INTERRUPTED for e in entries if e.status == "interrupted")
            recorded = {_key(m) for m in store.history(conversation)}
            # 1. (a true loss) Every message of this app the server received was recorded before it was sent.
            seen = {
                _key(m)
                for r in server.requests
                for m in r.body.get("messages", [])
                if m.get("role") == "user" and _seed(m) // 100 == slot
            }
            lost = seen - recorded
            assert not lost, f"after kill {kill + 1}: the server saw {len(lost)} message(s) history() lacks"
            # 2. Every message the app logged before a call, but each run's last, which the kill may have caught
            # before its call began (never passed in: the next run resumes without it).
            logged = []
            for line in logs[slot].read_text().splitlines() if logs[slot].exists() else []:
                try:
                    logged.append(json.loads(line))
                except ValueError:
                    break  # torn by the kill
            last_of_run = {_seed(m): _key(m) for m in logged}
            missing = [m for m in logged if _key(m) not in recorded and _key(m) not in last_of_run.values()]
            assert not missing, f"after kill {kill + 1}: {len(missing)} logged message(s) lost: {missing[:2]}"
            checked[slot] = len(logged)
            pids[slot] = run(slot)
        for slot in range(2):
            os.kill(pids[slot], signal.SIGKILL)
            zygote.stdin.write(f"reap {pids[slot]}\n")
            zygote.stdin.flush()
            assert _read_line(zygote) == "reaped"
        assert wait_for(lambda: _settled(store, "chat0") and _settled(store, "chat1"))
        everything = [e for slot in range(2) for e in store.entries(f"chat{slot}")]
        cut = {r.streamed for r in server.requests if r.failure == "cut" and r.body.get("stream")} - {None, ""}
        assert not cut & {e.received["content"] for e in everything if e.status == "ok" and e.received}
        figures["interrupted calls"] = sum(e.status == "interrupted" for e in everything)
        figures["calls recorded"] = len(everything)
        figures["messages checked"] = sum(checked)
        figures["requests served"] = len(server.requests)
        figures["seconds"] = round(time.monotonic() - started)
        store.close()
    finally:
        server.close()
        if zygote.poll() is None:
            zygote.kill()
        zygote.communicate(timeout=30)
    print("\npostgres crash test: " + ", ".join(f"{name} {value}" for name, value in figures.items()))
    assert figures["kills"] >= 20
    assert figures["interrupted calls"] >= 1
