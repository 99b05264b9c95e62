"""Processes writing and reading a Postgres transcript, for tests/calls/test_pg_transcript.py.

    python tests/transcript_worker.py write URL SCHEMA CONVERSATION TURNS   # record a chat; prints "done"
    python tests/transcript_worker.py read URL SCHEMA CONVERSATION CALL     # prints {"history", "recover", "status"}
    python tests/transcript_worker.py begin URL SCHEMA CONVERSATION         # start a call, print its number, wait
    python tests/transcript_worker.py zygote                                # fork wrapped-chat apps (see _zygote)

The zygote loads everything once, then forks one app per ``run BASE_URL TRANSCRIPT_URL LOG SEED CONVERSATION``
line (printing its pid) and reaps a killed one per ``reap PID`` line, so that a kill-and-restart costs
milliseconds.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _write(url: str, schema: str, conversation: str, turns: int) -> None:
    from contextkeeper.calls.transcript.postgres import PostgresTranscript

    with PostgresTranscript(url, schema=schema) as store:
        chat: list[dict[str, Any]] = [{"role": "system", "content": "You are a helpful assistant."}]
        for turn in range(turns):
            chat.append({"role": "user", "content": f"hello {turn}"})  # every writer: the same messages, the same rows
            started = store.start(chat, conversation=conversation)
            store.end(started, None, sent=chat, received={"role": "assistant", "content": f"ok {turn}"})
            chat.append({"role": "assistant", "content": f"ok {turn}"})
    print("done", flush=True)


def _read(url: str, schema: str, conversation: str, call: int) -> None:
    from contextkeeper.calls.transcript.postgres import PostgresTranscript

    with PostgresTranscript(url, schema=schema) as store:
        out = {
            "history": store.history(conversation),
            "recover": store.recover(call),
            "status": {e.call: e.status for e in store.entries(conversation)},
        }
    print(json.dumps(out), flush=True)


def _begin(url: str, schema: str, conversation: str) -> None:
    from contextkeeper.calls.transcript.postgres import PostgresTranscript

    store = PostgresTranscript(url, schema=schema)
    entry = store.start([{"role": "user", "content": "a call that never ends"}], conversation=conversation)
    print(entry.call, flush=True)
    time.sleep(60)  # until killed (bounded: the test kills it within seconds)


def _app(counter: Any, base_url: str, transcript: str, log: str, seed: int, conversation: str) -> None:
    """The app: resume from the transcript in Postgres, then chat for ever (until killed)."""
    import openai

    import contextkeeper as ck

    rng = random.Random(seed)
    keeper = ck.ContextKeeper(counter, context_window=1024, transcript=transcript)
    client = keeper.wrap(openai.OpenAI(base_url=base_url, api_key="test", timeout=10), conversation=conversation)
    history: list[dict[str, Any]] = keeper.transcript.history(conversation)
    journal = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    for turn in range(10_000):
        if not history or history[-1]["role"] != "user":  # else: the last message got no answer, send it again
            message = {"role": "user", "content": f"message {seed}.{turn}: " + "lorem ipsum " * rng.randint(5, 60)}
            os.write(journal, (json.dumps(message) + "\n").encode())  # the app's own record, before the call
            history.append(message)
        try:
            if rng.random() < 0.5:
                stream = client.chat.completions.create(model="m", messages=history, max_tokens=48, stream=True)
                text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            else:
                reply = client.chat.completions.create(model="m", messages=history, max_tokens=48)
                text = reply.choices[0].message.content or ""
        except ck.TransportError:  # a stream cut mid-way, or retries that ran out
            continue
        history.append({"role": "assistant", "content": text})


def _zygote() -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the tokenizer's thread pool does not survive a fork
    import openai  # everything the app needs, imported before forking
    import psycopg  # noqa: F401
    from transformers import AutoTokenizer

    import contextkeeper as ck
    import contextkeeper.calls.transcript.postgres
    from assets import tokenizer_dir

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
                    _app(warm.counter, args[0], args[1], args[2], int(args[3]), args[4])
                finally:
                    os._exit(0)
            print(pid, flush=True)
        elif command == "reap":
            os.waitpid(int(args[0]), 0)
            print("reaped", flush=True)


def main() -> None:
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "write":
        _write(args[0], args[1], args[2], int(args[3]))
    elif mode == "read":
        _read(args[0], args[1], args[2], int(args[3]))
    elif mode == "begin":
        _begin(args[0], args[1], args[2])
    elif mode == "zygote":
        _zygote()
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
