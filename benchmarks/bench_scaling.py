"""What sharing costs per wrapped call: admission and transcript in this process vs in Redis and Postgres.

A wrapped call writes the transcript ahead (``begin`` before its fit, waited for before the request leaves) and
admits its tokens (``acquire``); after the reply it records it (``end(wait=False)``) and gives the tokens back
(``release(wait=False)``), neither waited for. This measures exactly those operations per call, in that order, on
loopback, against a real ``redis-server`` and a real Postgres that the script starts
(tests/engines.py: temporary directories, free ports; Postgres with ``fsync=off``, so a commit costs no disk
flush), for

* **admission**: the in-process :class:`~contextkeeper.calls.ledger.Ledger` vs the shared
  :class:`~contextkeeper.calls.redis_ledger.RedisLedger` (``acquire`` + ``release``; the capacity never makes a call
  wait, so this is the cost of booking, not of queueing);
* **transcript**: ``MemoryTranscript``, ``SQLiteTranscript`` (a file in a temporary directory) and
  ``PostgresTranscript`` (its fast write path; the reference path through psycopg's adapters, which waits for
  every write; and the fast path with ``synchronous_commit=off`` set in the URL) ``begin`` + ``wait`` + ``end``;
* **both together**: in-process (Ledger + memory) vs shared (Redis + Postgres);
* **whole wrapped calls** (``keeper.wrap(fn)`` to a model that answers at once, the keeper's fit included):
  in-process vs ``ledger=`` Redis (``shared=`` too, by default) and ``transcript=`` Postgres, one thread, the
  conversations interleaved.

The workload: 20 conversations of 100 turns each, a growing chat (a 1 kB system prompt, questions of 100 to 600
characters, answers of 200 to 900), the conversations interleaved round-robin in one thread, and the same 2,000
calls from 4 threads at once (5 conversations each), back to back and then (the "both" rows) with a model call of
5 to 15 ms inside each call (``--model-ms 10``; slept, not timed), as threads of an app spend most of a call waiting
for the model. Each call's prompt is either the whole chat (a fit that had nothing to trim) or the system prompt
and the last 40 messages (a sliding window: a new list on every call, which the transcript records as the inputs
less what was dropped). Per-call figures are p50 and p99 over the 2,000 calls; "added" is the p50
above the in-process row of the same kind, prompt and threads.

    python benchmarks/bench_scaling.py [--conversations 20] [--turns 100] [--threads 4] [--model-ms 10] [--quick]

Writes benchmarks/results/scaling.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

from contextkeeper.calls.ledger import Ledger  # noqa: E402
from contextkeeper.calls.redis_ledger import RedisLedger  # noqa: E402
from contextkeeper.calls.transcript import MemoryTranscript, SQLiteTranscript, Transcript  # noqa: E402
from contextkeeper.calls.transcript.postgres import PostgresTranscript  # noqa: E402
from engines import PostgresServer, RedisServer  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "scaling.json"
#: What each call sends: the whole chat (a fit that did not need to trim: the prompt is the inputs, nothing new to
#: store for it), or the system prompt and the last 40 messages (a sliding window: every prompt is a list the
#: transcript has not seen, 41 new trie nodes a call).
PROMPTS: dict[str, int | None] = {"whole chat": None, "sliding window of 40": 40}

Messages = list[dict[str, Any]]


@dataclass
class Row:
    kind: str  # admission | transcript | both
    setup: str
    prompt: str  # a key of PROMPTS ("" for admission, which does not depend on it)
    threads: int
    model_ms: float = 0.0  # a model call of this long inside each call, not timed (0: back to back)
    calls: int = 0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    mean_ms: float = 0.0
    wall_s: float = 0.0
    added_p50_ms: float | None = None
    samples: list[float] = field(default_factory=list, repr=False)


@dataclass(frozen=True)
class Setup:
    """One way of doing a call's bookkeeping: ``make()`` -> (ledger or None, transcript or None), then closed."""

    kind: str
    name: str
    make: Callable[[], tuple[Ledger | None, Transcript | None]]


class Chat:
    """One conversation: its messages so far, grown by one question and one answer per call."""

    def __init__(self, index: int) -> None:
        self.name = f"chat-{index}"
        self.rng = random.Random(index)
        words = ("the", "model", "keeps", "every", "message", "the", "app", "sent", "while", "it", "fits")
        self.text = lambda n: " ".join(self.rng.choice(words) for _ in range(n // 6))
        self.messages: Messages = [{"role": "system", "content": f"You are assistant {index}. " + self.text(1000)}]

    def ask(self, turn: int, window: int | None) -> tuple[Messages, Messages, dict[str, Any]]:
        """The call's inputs, its prompt (the system prompt and the last messages) and the reply."""
        self.messages.append({"role": "user", "content": f"question {turn}: " + self.text(self.rng.randint(100, 600))})
        prompt = self.messages if window is None else [self.messages[0], *self.messages[1:][-window:]]
        reply = {"role": "assistant", "content": f"answer {turn}: " + self.text(self.rng.randint(200, 900))}
        return self.messages, prompt, reply


def one_call(
    ledger: Ledger | None, store: Transcript | None, chat: Chat, turn: int, window: int | None, model: float = 0.0
) -> float:
    """The bookkeeping of one wrapped call, timed; the call itself (the model) is not. In a wrapped call's order:
    the inputs written ahead (``begin``), the tokens admitted, the inputs waited for (durable before the request
    leaves); then the reply recorded and the tokens given back without waiting (``wait=False``)."""
    inputs, prompt, reply = chat.ask(turn, window)
    tokens = 200 + 3 * len(inputs)
    t0 = time.perf_counter()
    begun = store.begin(inputs, conversation=chat.name) if store is not None else None
    ticket = ledger.acquire(tokens) if ledger is not None else None
    started = begun.wait() if begun is not None else None
    if model:  # the model's time, not timed: the thread waits as for a reply (0.5 to 1.5 times `model`, so that
        # the threads do not stay in step)
        before = time.perf_counter() - t0
        time.sleep(model * chat.rng.uniform(0.5, 1.5))
        t0 = time.perf_counter() - before
    if store is not None and started is not None:
        store.end(started, None, wait=False, sent=prompt, received=reply, usage={"prompt_tokens": tokens})
    if ticket is not None:
        ticket.release(wait=False)
    seconds = time.perf_counter() - t0
    chat.messages.append(reply)
    return seconds


def measure(setup: Setup, prompt: str, conversations: int, turns: int, threads: int, model_ms: float = 0.0) -> Row:
    ledger, store = setup.make()
    row = Row(setup.kind, setup.name, "" if setup.kind == "admission" else prompt, threads, model_ms=model_ms)
    window = PROMPTS[prompt]
    try:
        warm = Chat(10_000)
        for turn in range(10):  # prepared statements, scripts loaded, first connections
            one_call(ledger, store, warm, turn, window)
        chats = [Chat(i) for i in range(conversations)]
        groups = [chats[i::threads] for i in range(threads)]
        samples: list[list[float]] = [[] for _ in range(threads)]
        errors: list[BaseException] = []
        barrier = threading.Barrier(threads)

        def work(index: int) -> None:
            try:
                barrier.wait(timeout=60)
                for turn in range(turns):
                    for chat in groups[index]:  # interleaved: each conversation's turn follows the others'
                        samples[index].append(one_call(ledger, store, chat, turn, window, model_ms / 1000))
            except BaseException as exc:  # reported below
                errors.append(exc)

        started = time.perf_counter()
        pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join(timeout=1200)
        row.wall_s = round(time.perf_counter() - started, 2)
        if errors:
            raise errors[0]
    finally:
        if ledger is not None and hasattr(ledger, "close"):
            ledger.close()
        if store is not None:
            store.close()
    ms = sorted(s * 1000 for part in samples for s in part)
    row.samples = ms
    row.calls = len(ms)
    row.p50_ms = round(statistics.median(ms), 3)
    row.p99_ms = round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 3)
    row.mean_ms = round(statistics.fmean(ms), 3)
    return row


def wrapped(name: str, settings: dict[str, Any], conversations: int, turns: int) -> Row:
    """Whole wrapped calls (``keeper.wrap(fn)``: shared facts read, inputs written ahead, the fit, admission, the
    reply recorded) to a model that answers at once, so everything but the model is timed: what a call costs the
    app in each setup. The keeper's own fit is in both rows; only the difference is sharing's."""
    import contextkeeper as ck

    keeper = ck.ContextKeeper("mistral:tekken", context_window=32768, kv_capacity=10**12, **settings)
    replies: dict[str, dict[str, Any]] = {}

    def model(messages: Messages, **_: Any) -> dict[str, Any]:
        return replies[messages[0]["content"]]

    row = Row("wrapped call", name, "the keeper's fit", 1)
    try:
        chats = [Chat(i) for i in range(conversations)]
        clients = {chat.name: keeper.wrap(model, conversation=chat.name) for chat in chats}
        samples: list[float] = []
        for turn in range(turns):
            for chat in chats:
                inputs, _, reply = chat.ask(turn, None)
                replies[inputs[0]["content"]] = reply
                t0 = time.perf_counter()
                clients[chat.name](inputs, max_tokens=512)
                if turn >= 2:  # the first turns load the counter's caches and open the connections
                    samples.append(time.perf_counter() - t0)
                chat.messages.append(reply)
    finally:
        keeper.close()
    ms = sorted(s * 1000 for s in samples)
    row.calls, row.samples = len(ms), ms
    row.p50_ms = round(statistics.median(ms), 3)
    row.p99_ms = round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 3)
    row.mean_ms = round(statistics.fmean(ms), 3)
    return row


@contextlib.contextmanager
def engines() -> Iterator[tuple[RedisServer, PostgresServer]]:
    with RedisServer() as redis_server, PostgresServer() as postgres:  # each stopped at the end
        yield redis_server, postgres


def setups(redis_url: str, postgres_url: str, folder: Path) -> list[Setup]:
    capacity = 10**12  # never waits: the cost of booking, not of queueing
    count = iter(range(10**6))

    def sqlite() -> SQLiteTranscript:
        return SQLiteTranscript(folder / f"t{next(count)}.sqlite")

    def postgres(fast: bool = True, options: str = "") -> PostgresTranscript:
        store = PostgresTranscript(postgres_url + options, schema=f"bench_{next(count)}")
        store.fast_writes = fast
        return store

    nowait = "?options=-csynchronous_commit%3Doff"  # the commit does not wait for the WAL to reach the disk

    def redis() -> RedisLedger:
        return RedisLedger(redis_url, capacity, pool=f"bench-{next(count)}")

    return [
        Setup("admission", "in-process Ledger", lambda: (Ledger(capacity), None)),
        Setup("admission", "RedisLedger", lambda: (redis(), None)),
        Setup("transcript", "MemoryTranscript", lambda: (None, MemoryTranscript())),
        Setup("transcript", "SQLiteTranscript", lambda: (None, sqlite())),
        Setup("transcript", "PostgresTranscript", lambda: (None, postgres())),
        Setup("transcript", "PostgresTranscript (reference path)", lambda: (None, postgres(fast=False))),
        Setup("transcript", "PostgresTranscript, synchronous_commit=off", lambda: (None, postgres(options=nowait))),
        Setup("both", "in-process (Ledger + memory)", lambda: (Ledger(capacity), MemoryTranscript())),
        Setup("both", "shared (Redis + Postgres)", lambda: (redis(), postgres())),
    ]


def table(rows: list[Row]) -> list[str]:
    out = [
        "| what | setup | prompt | threads | model call | calls | p50 | p99 | mean | added p50 | wall |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        added = "" if r.added_p50_ms is None else f"{r.added_p50_ms:+.3f} ms"
        model = f"{r.model_ms:g} ms" if r.model_ms else ""
        out.append(
            f"| {r.kind} | {r.setup} | {r.prompt} | {r.threads} | {model} | {r.calls:,} | {r.p50_ms:.3f} ms "
            f"| {r.p99_ms:.3f} ms | {r.mean_ms:.3f} ms | {added} | {r.wall_s:.1f} s |"
        )
    return out


def versions(redis_url: str, postgres_url: str) -> dict[str, str]:
    import psycopg
    import redis

    with psycopg.connect(postgres_url) as db:
        found = db.execute("SHOW server_version").fetchone()
        server = str(found[0]) if found else "?"
    client = redis.Redis.from_url(redis_url)
    redis_version = str(client.info("server")["redis_version"])
    client.close()
    return {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": str(os.cpu_count()),
        "postgres": server,
        "psycopg": f"{psycopg.__version__} ({psycopg.pq.__impl__} implementation, libpq {psycopg.pq.version()})",
        "redis-server": redis_version,
        "redis-py": redis.__version__,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=20)
    parser.add_argument("--turns", type=int, default=100, help="calls per conversation")
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument(
        "--model-ms", type=float, default=10.0, help="the model call inside each call of the last rows (not timed)"
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: 4 conversations of 10 turns")
    parser.add_argument("--no-write", action="store_true", help="print only; leave the results file alone")
    args = parser.parse_args()
    if args.quick:
        args.conversations, args.turns = 4, 10
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    started = time.perf_counter()
    rows: list[Row] = []
    with engines() as (redis_server, postgres), tempfile.TemporaryDirectory(prefix="ck-bench-") as folder:
        env = versions(redis_server.url, postgres.url)
        runs = [(1, 0.0), (args.threads, 0.0), (args.threads, args.model_ms)]
        for threads, model_ms in runs:
            for prompt in PROMPTS:
                base: dict[str, float] = {}
                for setup in setups(redis_server.url, postgres.url, Path(folder)):
                    if setup.kind == "admission" and prompt != next(iter(PROMPTS)):
                        continue  # (admission does not depend on the prompt)
                    if model_ms and setup.kind != "both":
                        continue  # (with a model call: the whole bookkeeping, in process and shared)
                    row = measure(setup, prompt, args.conversations, args.turns, threads, model_ms)
                    if row.kind in base:  # each kind's first setup is the in-process one
                        row.added_p50_ms = round(row.p50_ms - base[row.kind], 3)
                    else:
                        base[row.kind] = row.p50_ms
                    rows.append(row)
                    print(
                        f"{row.kind}: {row.setup}, {prompt}, {threads} thread(s), model {model_ms:g} ms: "
                        f"p50 {row.p50_ms:.3f} ms",
                        file=sys.stderr,
                    )
        local = wrapped("in-process (ledger, memory transcript)", {}, args.conversations, args.turns)
        shared = wrapped(
            "shared (Redis ledger and shared state, Postgres transcript)",
            {"ledger": redis_server.url, "transcript": postgres.url},
            args.conversations,
            args.turns,
        )
        shared.added_p50_ms = round(shared.p50_ms - local.p50_ms, 3)
        rows += [local, shared]
        print(f"wrapped call: p50 {local.p50_ms:.3f} ms in-process, {shared.p50_ms:.3f} ms shared", file=sys.stderr)
    given = (args.conversations, args.turns, args.threads, args.model_ms)
    flags = (
        ""
        if given == (20, 100, 4, 10.0)
        else " --conversations {} --turns {} --threads {} --model-ms {:g}".format(*given)
    )
    if load is not None:
        env["load average"] = f"{load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    lines = [
        f"Command: `python benchmarks/bench_scaling.py{flags}` — "
        + ", ".join(f"{name} {value}" for name, value in env.items())
        + ".",
        "",
        *table(rows),
    ]
    print("\n".join(lines))
    if not args.no_write:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        results = {
            "command": f"python benchmarks/bench_scaling.py{flags}",
            "environment": env,
            "workload": {"conversations": args.conversations, "turns": args.turns, "prompts": PROMPTS},
            "rows": [{k: v for k, v in asdict(r).items() if k != "samples"} for r in rows],
        }
        RESULTS.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {RESULTS.relative_to(ROOT)}", file=sys.stderr)
    print(f"total {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
