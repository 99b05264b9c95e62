"""Acceptance: a wrapped chat that is SIGKILLed at random points loses nothing it was given.

A child process runs a chat through ``keeper.wrap(openai.OpenAI(...))`` against the test server (real HTTP, the
official SDK), with a SQLite transcript; the server is slow on purpose and cuts some streams mid-way. The child
is killed at a random moment, over and over, and restarted each time from ``transcript.history(...)``, as an app
resuming after a crash would. After every kill the file must pass ``PRAGMA integrity_check`` and hold every
message the app passed in: every one it wrote to its own log before a call (all but the last of each run, which
the kill may have caught before the call began), and every one the server received. A stream cut mid-way must be
recorded as failed, with what arrived, and never as a reply.

Children are forked from a "zygote" process that has imported everything and loaded the tokenizer once (this file,
run as ``python tests/calls/test_crash.py --zygote``), so a restart costs milliseconds, not the seconds an import takes.

Run with ``-s`` (or ``-rP``) to see the figures.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

KILLS = 25  # at least; up to twice as many while no kill has caught a call in flight or a cut stream recorded
CONVERSATION = "crash"


# ------------------------------------------------------------------------------------------ the child app


def _app(counter: Any, base_url: str, db: str, log: str, seed: int) -> None:
    """The app: resume from the transcript, then chat for ever (until killed)."""
    import openai

    import contextkeeper as ck

    rng = random.Random(seed)
    keeper = ck.ContextKeeper(counter, context_window=1024, transcript=db)
    raw = openai.OpenAI(base_url=base_url, api_key="test", timeout=10)
    client = keeper.wrap(raw, conversation=CONVERSATION, backoff=0.01)
    history: list[dict[str, Any]] = keeper.transcript.history(CONVERSATION)
    journal = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    for turn in range(10_000):
        if not history or history[-1]["role"] != "user":  # else: the last message got no answer, send it again
            message = {"role": "user", "content": f"message {seed}.{turn}: " + "lorem ipsum " * rng.randint(5, 60)}
            os.write(journal, (json.dumps(message) + "\n").encode())  # the app's own record, before the call
            history.append(message)
        try:
            if rng.random() < 0.5:
                stream = client.chat.completions.create(
                    model="m", messages=history, max_tokens=48, stream=True, stream_options={"include_usage": True}
                )
                text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            else:
                reply = client.chat.completions.create(model="m", messages=history, max_tokens=48)
                text = reply.choices[0].message.content or ""
        except ck.TransportError:  # a stream cut mid-way (StreamInterrupted), or retries that ran out
            continue
        history.append({"role": "assistant", "content": text})


def _zygote() -> None:
    """Load once, then fork an app per "run" line; "reap PID" waits for a killed one."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the tokenizer's thread pool does not survive a fork
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import openai  # imported before forking, like everything the app needs
    from transformers import AutoTokenizer

    import contextkeeper as ck
    from assets import tokenizer_dir

    # The counter (the qwen2 tokenizer and its chat template, as the server counts) is built once, here.
    warm = ck.ContextKeeper(AutoTokenizer.from_pretrained(str(tokenizer_dir("qwen2"))), context_window=1024)
    warm.fit([{"role": "user", "content": "warm up"}], max_tokens=8)
    wrapped = warm.wrap(openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="-"))
    assert callable(wrapped.chat.completions.create)  # the SDK imports its resources on first use
    print("ready", flush=True)
    for line in sys.stdin:
        command, *args = line.split()
        if command == "run":
            pid = os.fork()
            if pid == 0:
                devnull = os.open(os.devnull, os.O_RDWR)
                os.dup2(devnull, 0)
                os.dup2(devnull, 1)  # the parent reads this process's stdout: the app stays silent
                try:
                    _app(warm.counter, args[0], args[1], args[2], int(args[3]))
                finally:
                    os._exit(0)
            print(pid, flush=True)
        elif command == "reap":
            os.waitpid(int(args[0]), 0)
            print("reaped", flush=True)


# ------------------------------------------------------------------------------------------ the test


def _read(zygote: subprocess.Popen[str], timeout: float = 60.0) -> str:
    assert zygote.stdout is not None
    import select

    ready, _, _ = select.select([zygote.stdout], [], [], timeout)
    line = zygote.stdout.readline() if ready else ""
    if not line:
        zygote.kill()
        _, err = zygote.communicate(timeout=10)
        raise AssertionError(f"the zygote did not answer: {err[-3000:]}")
    return line.strip()


def _key(message: dict[str, Any]) -> str:
    return json.dumps(message, sort_keys=True)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks the app")
def test_sigkill_at_random_points_loses_no_message(tmp_path: Path) -> None:
    pytest.importorskip("openai")
    from assets import require_assets, tokenizer_dir
    from conftest import hf_tokenizer
    from contextkeeper.calls.transcript import INTERRUPTED, SQLiteTranscript
    from openai_server import ChatServer

    require_assets()
    db, log = tmp_path / "chat.sqlite", tmp_path / "app.log"
    src = Path(__import__("contextkeeper").__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])}
    zygote = subprocess.Popen(
        [sys.executable, __file__, "--zygote"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    rng = random.Random(20240611)
    started = time.monotonic()
    server = ChatServer(
        tokenizer_dir("qwen2"),
        max_model_len=2048,
        tokenizer=hf_tokenizer("qwen2"),
        response_delay=0.04,
        chunk_delay=0.01,
        stream_chunk_words=1,
    )
    figures: dict[str, int] = {"kills": 0, "messages checked": 0, "server-seen messages checked": 0}
    entries: list[Any] = []
    try:
        server.start()
        server.random_failures({"cut": 0.3, "500": 0.05}, seed=7, after=(0, 4))
        assert _read(zygote, timeout=180) == "ready"
        assert zygote.stdin is not None
        for kill in range(2 * KILLS):
            caught = any(e.status == "interrupted" for e in entries) and any(
                (e.error or "").startswith("StreamInterrupted") for e in entries
            )
            if kill >= KILLS and caught:
                break  # (a slow machine runs fewer calls per kill: it takes more kills to see both)
            zygote.stdin.write(f"run {server.base_url} {db} {log} {kill}\n")
            zygote.stdin.flush()
            pid = int(_read(zygote))
            time.sleep(rng.uniform(0.05, 0.6))
            os.kill(pid, signal.SIGKILL)
            zygote.stdin.write(f"reap {pid}\n")
            zygote.stdin.flush()
            assert _read(zygote) == "reaped"
            figures["kills"] += 1
            if not db.exists():
                continue  # killed before the transcript was opened
            # 1. The file is sound.
            with sqlite3.connect(db) as check:
                assert check.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
            with SQLiteTranscript(db) as transcript:
                entries = transcript.entries(CONVERSATION)
            assert all(e.status != "pending" for e in entries)  # its process is gone: interrupted, not pending
            assert all(e.error == INTERRUPTED for e in entries if e.status == "interrupted")
            recorded = {_key(m) for e in entries for m in e.inputs}
            # 2. Every message the app logged before a call is recorded.
            logged = []
            for line in log.read_text().splitlines() if log.exists() else []:
                try:
                    logged.append(json.loads(line))
                except ValueError:
                    break  # torn by the kill: never passed in
            # 3. (checked first: a true loss) Every message the server received was recorded before it was sent.
            seen = {_key(m) for r in server.requests for m in r.body.get("messages", []) if m.get("role") == "user"}
            lost = seen - recorded
            assert not lost, f"after kill {kill + 1}: the server saw {len(lost)} message(s) the transcript lacks"
            # Each run's last logged message may be one the kill caught before the call began: never passed in,
            # so never recorded (the next run resumes without it, as an app that lost it from memory would).
            last_of_run = {m["content"].split(":", 1)[0].split(".")[0]: _key(m) for m in logged}
            missing = [m for m in logged if _key(m) not in recorded and _key(m) not in last_of_run.values()]
            assert not missing, f"after kill {kill + 1}: {len(missing)} logged message(s) lost: {missing[:2]}"
            figures["caught before the call"] = sum(k not in recorded for k in last_of_run.values())
            figures["messages checked"] = len(logged)
            figures["server-seen messages checked"] = len(seen)
        # 4. Cut streams: recorded as failed with what arrived, never as a reply.
        cut = {r.streamed for r in server.requests if r.failure == "cut" and r.body.get("stream")} - {None}
        replies = {e.received["content"] for e in entries if e.status == "ok" and e.received}
        assert not (cut - {""}) & replies, "a stream cut mid-way was recorded as a reply"
        broken = [e for e in entries if e.status == "failed" and (e.error or "").startswith("StreamInterrupted")]
        assert broken, "no cut stream was recorded as failed"
        assert all(e.received is not None and (e.received["content"] or "") in cut for e in broken)
        figures.update(
            {
                "calls recorded": len(entries),
                "calls interrupted by a kill": sum(e.status == "interrupted" for e in entries),
                "cut streams recorded as failed": len(broken),
                "requests served": len(server.requests),
                "seconds": round(time.monotonic() - started),
            }
        )
    finally:
        server.close()
        if zygote.poll() is None:
            zygote.kill()
        zygote.communicate(timeout=30)
    print("\ncrash test: " + ", ".join(f"{name} {value}" for name, value in figures.items()))
    assert figures["kills"] >= 20
    assert figures["calls interrupted by a kill"] >= 1


if __name__ == "__main__" and sys.argv[1:] == ["--zygote"]:
    _zygote()
