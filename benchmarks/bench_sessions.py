"""Many conversations on one keeper: per-turn fit time with 1, 2 and 50 conversations interleaved, and 8 threads.

Each conversation is a different 2,000-message agent conversation of the counting benchmark (its own seed), its
model calls from message 2,000 on fitted to a 32,768-token context with 2,048 tokens kept for the answer
(Qwen3's template, the five tool schemas, ``policy="default"``). The conversations take turns: one fit of each in
round-robin order, so every turn of one chat comes after a turn of every other. Measured in one run:

* **own keeper**: each conversation on a keeper of its own (the reference: what a turn costs alone);
* **one keeper, ``conversation=``**: one keeper, each chat fitted with its own ``conversation`` id;
* **one keeper, no id**: one keeper, every chat fitted as its single default conversation (what an app that
  does not name its chats gets: correct fits, but each turn sees a different chat than the last and is cold);
* **8 threads**: one keeper, eight threads each fitting its own conversation with its own id, all at once.

The first fit of each conversation is reported apart ("first fit": cold for the keeper, though the token counts
of piece text that forks of one counter share may be warm); the per-turn figures are over the later fits, pooled
over the repeats (fresh keepers each time, the setups in alternating order). "Wall" is one pass over all the
fits of a row; "of it in GC" the part Python's garbage collector ran (its own callbacks timed it).
Writes docs/benchmarks.md (between markers) and prints the results.

    python benchmarks/bench_sessions.py [--turns 12] [--many 50] [--repeats 3] [--quick] [--no-write]
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]

from agent_conversation import TOOLS, build  # noqa: E402
from bench_fit import ANSWER_TOKENS, CONTEXT_WINDOW, _requests  # noqa: E402
from report import write_section  # noqa: E402

import contextkeeper as ck  # noqa: E402
from assets import template, tokenizer_dir  # noqa: E402

Messages = list[dict[str, Any]]
Fitter = Callable[[int, Messages], ck.Fit]  # (conversation index, messages) -> fit


@dataclass
class Row:
    setup: str
    conversations: int
    fits: int = 0
    cold_ms: float = 0.0
    p50_ms: float = 0.0
    p90_ms: float = 0.0
    max_ms: float = 0.0
    wall_s: float = 0.0
    overflows: int = 0
    gc_s: float = 0.0  # wall seconds the garbage collector ran during the row's fits
    notes: list[str] = field(default_factory=list)
    cold: list[float] = field(default_factory=list)  # seconds of each conversation's first fit
    later: list[float] = field(default_factory=list)  # seconds of the fits after it


class Chats:
    """The conversations and the message counts at which each calls the model."""

    def __init__(self, count: int, turns: int) -> None:
        self.messages = [build(2000 + 4 * turns + 40, seed=7 + i) for i in range(count)]
        self.stops = [_requests(m, 2000)[: turns + 1] for m in self.messages]


class _Collections:
    """Wall seconds spent in garbage collection, from the collector's own start and stop callbacks."""

    def __init__(self) -> None:
        self.total = 0.0
        self._started = 0.0
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict[str, Any]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._started = now
        else:
            self.total += now - self._started


COLLECTIONS = _Collections()


def keeper(counter: ck.HFChatTemplateCounter) -> ck.ContextKeeper:
    return ck.ContextKeeper(counter, context_window=CONTEXT_WINDOW, policy="default")


def _fit(target: ck.ContextKeeper, messages: Messages, conversation: str | None) -> tuple[ck.Fit, float]:
    t0 = time.perf_counter()
    fit = target.fit(messages, tools=TOOLS, max_tokens=ANSWER_TOKENS, conversation=conversation)
    return fit, time.perf_counter() - t0


def round_robin(chats: Chats, count: int, pick: Callable[[int], tuple[ck.ContextKeeper, str | None]]) -> Row:
    """Every conversation's turns, one fit of each conversation in turn."""
    row = Row("", count)
    started, collected = time.perf_counter(), COLLECTIONS.total
    for turn in range(len(chats.stops[0])):
        for i in range(count):
            target, name = pick(i)
            fit, seconds = _fit(target, chats.messages[i][: chats.stops[i][turn]], name)
            (row.cold if turn == 0 else row.later).append(seconds)
            row.overflows += fit.tokens + ANSWER_TOKENS > CONTEXT_WINDOW
    row.wall_s = time.perf_counter() - started
    row.gc_s = COLLECTIONS.total - collected
    return row


def threads(chats: Chats, count: int, counter: ck.HFChatTemplateCounter) -> Row:
    shared = keeper(counter)
    row = Row("one keeper, 8 threads, `conversation=` each", count)
    lock = threading.Lock()
    barrier = threading.Barrier(count)
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            barrier.wait(timeout=60)
            for turn, stop in enumerate(chats.stops[i]):
                fit, seconds = _fit(shared, chats.messages[i][:stop], f"chat-{i}")
                with lock:
                    (row.cold if turn == 0 else row.later).append(seconds)
                    row.overflows += fit.tokens + ANSWER_TOKENS > CONTEXT_WINDOW
        except BaseException as exc:  # reported below
            errors.append(exc)

    started, collected = time.perf_counter(), COLLECTIONS.total
    pool = [threading.Thread(target=worker, args=(i,)) for i in range(count)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join(timeout=600)
    row.wall_s = time.perf_counter() - started
    row.gc_s = COLLECTIONS.total - collected
    if errors:
        raise errors[0]
    row.notes.append(
        "latency per fit includes waiting for the GIL while the other threads fit: on "
        f"{os.cpu_count()} CPUs the work is shared, compare the wall time with the sequential rows"
    )
    return _times(row)


def _times(row: Row) -> Row:
    ms = sorted(s * 1000 for s in row.later)
    row.fits = len(row.cold) + len(row.later)
    row.cold_ms = round(statistics.median(row.cold) * 1000, 1)
    row.p50_ms = round(statistics.median(ms), 2)
    row.p90_ms = round(ms[int(0.9 * (len(ms) - 1))], 2)
    row.max_ms = round(ms[-1], 1)
    return row


SETUPS = (
    ("own keeper per conversation", "own"),
    ("one keeper, `conversation=` each", "named"),
    ("one keeper, no id (one default conversation)", "single"),
)


def run(args: argparse.Namespace) -> list[Row]:
    counter = ck.load_counter(str(tokenizer_dir("qwen2")), chat_template=template("Qwen-Qwen3-0.6B"))
    chats = Chats(max(args.many, 8), args.turns)
    rows: list[Row] = []
    for count in (1, 2, args.many):
        setups = [s for s in SETUPS if count > 1 or s[1] != "single"]
        pooled = {kind: Row(label, count) for label, kind in setups}
        # Each repeat builds fresh keepers, the setups in alternating order, so no setup always runs on warm
        # caches (forks share the token counts of piece text) or always first on a quiet machine.
        for repeat in range(args.repeats):
            for _, kind in setups if repeat % 2 == 0 else setups[::-1]:
                if kind == "own":
                    own = [keeper(counter.fork()) for _ in range(count)]
                    row = round_robin(chats, count, lambda i, own=own: (own[i], None))
                else:
                    shared = keeper(counter.fork())
                    name = (lambda i: f"chat-{i}") if kind == "named" else (lambda i: None)
                    row = round_robin(chats, count, lambda i, k=shared, name=name: (k, name(i)))
                into = pooled[kind]
                into.cold += row.cold
                into.later += row.later
                into.overflows += row.overflows
                into.wall_s += row.wall_s / args.repeats
                into.gc_s += row.gc_s / args.repeats
        alone = _times(pooled["own"])
        rows.append(alone)
        for _, kind in setups[1:]:
            rows.append(_times(pooled[kind]))
            rows[-1].notes.append(f"{rows[-1].p50_ms / alone.p50_ms:.2f}× own keeper's p50")
    rows.append(threads(chats, 8, counter))
    return rows


def table(rows: list[Row]) -> list[str]:
    out = [
        "| setup | conversations | fits | first fit p50 | turn p50 | turn p90 | turn max | wall | of it in GC "
        "| overflows | notes |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        out.append(
            f"| {r.setup} | {r.conversations} | {r.fits} | {r.cold_ms:.0f} ms | {r.p50_ms:.1f} ms | {r.p90_ms:.1f} ms "
            f"| {r.max_ms:.0f} ms | {r.wall_s:.2f} s | {r.gc_s:.2f} s | {r.overflows} | {'; '.join(r.notes)} |"
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=12, help="fits per conversation after its cold one")
    parser.add_argument("--many", type=int, default=50, help="the large number of interleaved conversations")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each setup (fits pooled)")
    parser.add_argument("--quick", action="store_true", help="smoke run: --turns 3 --many 8 --repeats 1")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = parser.parse_args()
    if args.quick:
        args.turns, args.many, args.repeats = min(args.turns, 3), min(args.many, 8), 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    started = time.perf_counter()
    rows = run(args)
    given = (args.turns, args.many, args.repeats)
    flags = "" if given == (12, 50, 3) else " --turns {} --many {} --repeats {}".format(*given)
    env = f"Python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPUs"
    if load is not None:
        env += f", load average {load:.1f} at the start and {os.getloadavg()[0]:.1f} at the end"
    doc = (__doc__ or "").split("\n\n")
    lines = [
        "<!-- sessions:start -->",
        "\n\n".join(doc[1:3]),
        "",
        f"Command: `python benchmarks/bench_sessions.py{flags}` — {env}.",
        "",
        *table(rows),
        "<!-- sessions:end -->",
    ]
    block = "\n".join(lines)
    print(block)
    if not args.no_write:
        write_section("sessions", block, heading="## Many conversations on one keeper")
    print(f"total {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
