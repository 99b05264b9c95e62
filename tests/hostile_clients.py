"""Hostile and careless clients of a proxy, run beside an honest load (tests/proxy_helpers.py ``run_load``): each
kind loops until the deadline and counts what the proxy answered it. Every socket is on loopback; every loop is
bounded by the deadline and a step count.

- ``oversized``: a request head announcing a 64 MB body, a few KB of it, then waits for the refusal; and chunked
  bodies that run past a 4 MB limit and never end;
- ``slow``: connections that send their head one byte per second (re-opened when the proxy closes them);
- ``flood``: small chats, each under a conversation id never seen before;
- ``abandoned``: chats whose clients hang up after a fraction of a second, before the answer;
- ``bulky``: bodies just under the body limit (a long history), parsed and fitted for real.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from assets import tokenizer_dir
from openai_server import ChatServer
from proxy_helpers import LoadRun, Sampler, load_history, run_load, scrape, serve_processes, total, write_config

# The honest load's proxy: a 1,024-token context, 16 prompts' worth of KV, 64 tokens kept for each answer.
CONTEXT = 1024
CAPACITY = 16 * CONTEXT
ANSWER = 64
LOAD = "models[1] (match '*')"

KINDS = ("oversized", "slow", "flood", "abandoned", "bulky")


@dataclass
class HostileMix:
    """How many of each hostile client run at once."""

    oversized: int = 2
    slow: int = 40
    flood: int = 4
    abandoned: int = 4
    bulky: int = 1
    bulky_bytes: int = 3 * 2**20


@dataclass
class HostileRun:
    """What the hostile clients saw: answers by kind and status (``"reset"``: the connection closed without one)."""

    answers: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)

    def count(self, kind: str, status: str) -> None:
        self.answers[(kind, status)] += 1

    def of(self, kind: str) -> dict[str, int]:
        return {status: n for (k, status), n in sorted(self.answers.items()) if k == kind}


async def _status(reader: asyncio.StreamReader, seconds: float) -> str:
    try:
        line = await asyncio.wait_for(reader.readline(), seconds)
    except (asyncio.TimeoutError, ConnectionError):
        return "reset"
    parts = line.split(b" ", 2)
    return parts[1].decode("latin-1") if len(parts) > 1 else "reset"


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(asyncio.TimeoutError, ConnectionError, OSError):
        await asyncio.wait_for(writer.wait_closed(), 2)


def _head(host: str, port: int, path: str, extra: str) -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n{extra}\r\n".encode()


async def _oversized(host: str, port: int, deadline: float, run: HostileRun, number: int) -> None:
    for step in range(100_000):
        if time.perf_counter() >= deadline:
            return
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            run.count("oversized", "refused-connect")
            await asyncio.sleep(0.1)
            continue
        try:
            if step % 2 == 0:
                writer.write(_head(host, port, "/v1/chat/completions", f"Content-Length: {64 * 2**20}\r\n"))
                writer.write(b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * 4096)
            else:
                writer.write(_head(host, port, "/v1/chat/completions", "Transfer-Encoding: chunked\r\n"))
                piece = b"y" * 65536
                for _ in range(80):  # 5 MB of a body that never ends, past a 4 MB limit
                    writer.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                    await writer.drain()
            await writer.drain()
            run.count("oversized", await _status(reader, 10))
        except (ConnectionError, OSError):
            run.count("oversized", "reset")
        finally:
            await _close(writer)
        await asyncio.sleep(0.05 * (number + 1))


async def _slow(host: str, port: int, deadline: float, run: HostileRun) -> None:
    head = _head(host, port, "/v1/chat/completions", "Content-Length: 2\r\n") + b"{}"
    for _ in range(10_000):
        if time.perf_counter() >= deadline:
            return
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            run.count("slow", "refused-connect")
            await asyncio.sleep(1)
            continue
        try:
            for byte in head:
                if time.perf_counter() >= deadline:
                    break
                writer.write(bytes([byte]))
                await writer.drain()
                if reader.at_eof():
                    break
                try:  # one byte a second, watching for the proxy's answer meanwhile
                    line = await asyncio.wait_for(reader.readline(), 1.0)
                except asyncio.TimeoutError:
                    continue
                parts = line.split(b" ", 2)
                run.count("slow", parts[1].decode("latin-1") if len(parts) > 1 else "reset")
                break
            else:
                run.count("slow", await _status(reader, 5))
        except (ConnectionError, OSError):
            run.count("slow", "reset")
        finally:
            await _close(writer)


async def _post(host: str, port: int, body: dict[str, Any], headers: dict[str, str], wait: float) -> str:
    """POST a chat and wait ``wait`` seconds at most for the status line; then hang up."""
    data = json.dumps(body).encode()
    extra = "".join(f"{key}: {value}\r\n" for key, value in headers.items()) + f"Content-Length: {len(data)}\r\n"
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(_head(host, port, "/v1/chat/completions", extra) + data)
        await writer.drain()
        try:
            line = await asyncio.wait_for(reader.readline(), wait)
        except asyncio.TimeoutError:
            return "left"
        parts = line.split(b" ", 2)
        status = parts[1].decode("latin-1") if len(parts) > 1 else "reset"
        if status == "200":  # read the rest, so the proxy finishes the exchange
            await asyncio.wait_for(reader.read(), 30)
        return status
    finally:
        await _close(writer)


async def _flood(host: str, port: int, deadline: float, run: HostileRun, answer: int) -> None:
    for _ in range(100_000):
        if time.perf_counter() >= deadline:
            return
        body = {"model": "flood", "messages": load_history(1, f"Flood {uuid.uuid4()}"), "max_tokens": answer}
        try:
            status = await _post(host, port, body, {"X-Conversation-Id": f"flood-{uuid.uuid4()}"}, 60)
        except (ConnectionError, OSError, asyncio.TimeoutError):
            status = "reset"
        run.count("flood", status)


async def _abandoned(host: str, port: int, deadline: float, run: HostileRun, answer: int, number: int) -> None:
    for step in range(100_000):
        if time.perf_counter() >= deadline:
            return
        body = {"model": "abandoned", "messages": load_history(20, f"Abandoned {number}"), "max_tokens": answer}
        wait = 0.05 + 0.1 * (step % 5)
        try:
            status = await _post(host, port, body, {"X-Conversation-Id": f"gone-{number}"}, wait)
        except (ConnectionError, OSError):
            status = "reset"
        run.count("abandoned", status)


async def _bulky(host: str, port: int, deadline: float, run: HostileRun, answer: int, size: int) -> None:
    turns = max(1, size // 700)  # each exchange of load_history is about 700 bytes of JSON
    history = load_history(turns, "Bulky.")
    for _ in range(10_000):
        if time.perf_counter() >= deadline:
            return
        body = {"model": "bulky", "messages": history, "max_tokens": answer}
        try:
            status = await _post(host, port, body, {"X-Conversation-Id": "bulky"}, 60)
        except (ConnectionError, OSError, asyncio.TimeoutError):
            status = "reset"
        run.count("bulky", status)
        await asyncio.sleep(0.5)


async def run_hostile(url: str, seconds: float, mix: HostileMix, *, answer: int = 64) -> HostileRun:
    """The hostile clients of ``mix`` against the proxy at ``url`` for ``seconds``."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    deadline = time.perf_counter() + seconds
    run = HostileRun()
    tasks = [
        *(_oversized(host, port, deadline, run, n) for n in range(mix.oversized)),
        *(_slow(host, port, deadline, run) for _ in range(mix.slow)),
        *(_flood(host, port, deadline, run, answer) for _ in range(mix.flood)),
        *(_abandoned(host, port, deadline, run, answer, n) for n in range(mix.abandoned)),
        *(_bulky(host, port, deadline, run, answer, mix.bulky_bytes) for _ in range(mix.bulky)),
    ]
    await asyncio.wait_for(asyncio.gather(*tasks), seconds + 120)
    return run


# ------------------------------------------------------------------------------ one measured run


def rss_of(pid: int) -> float:
    """A process's resident memory in MB (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def hostile_run(tokenizer: Any, folder: Path, *, hostile: bool, seconds: float, chats: int) -> dict[str, Any]:
    """One paced honest load through a real serve process (SQLite transcript, 4 MB body limit), with or without
    the hostile clients of tests/hostile_clients.py beside it: what the honest clients saw, what the proxy held,
    and what its transcript kept."""
    from contextkeeper.calls.transcript import SQLiteTranscript

    transcript = folder / "chats.sqlite"
    config = write_config(
        folder / "proxy.toml",
        tokenizer_dir("qwen2"),
        CONTEXT,
        {"kv_capacity": CAPACITY, "admission_timeout": 120, "transcript": str(transcript)},
        top={"limits": {"body_bytes": 4 * 2**20}},
    )
    with (
        ChatServer(tokenizer_dir("qwen2"), max_model_len=CONTEXT, tokenizer=tokenizer) as upstream,
        serve_processes([config], upstream.base_url) as (proxy,),
    ):
        assert proxy.url is not None
        assert proxy.process is not None
        url, pid = proxy.url, proxy.process.pid
        # Warm up: the first requests of each entry build what later ones reuse (a cold fit, compiled templates).
        asyncio.run(run_load([url], upstream.base_url.removesuffix("/v1"), chats=0, seconds=2, answer=ANSWER))
        with (
            Sampler(lambda: total(scrape(url), "contextkeeper_kv_active_tokens", entry=LOAD), 0.1) as active,
            Sampler(lambda: rss_of(pid), 0.25) as rss,
        ):

            async def both() -> tuple[LoadRun, HostileRun]:
                honest = run_load(
                    [url],
                    upstream.base_url.removesuffix("/v1"),
                    chats=chats,
                    seconds=seconds,
                    answer=ANSWER,
                    pause=1.0,
                    probe_pause=0.1,
                    probe_delay=1.0,  # the steady state: past the chats' cold first turns
                )
                if not hostile:
                    return await honest, HostileRun()
                mix = HostileMix(bulky_bytes=3 * 2**20)
                run, bad = await asyncio.gather(honest, run_hostile(url, seconds, mix, answer=ANSWER))
                return run, bad

            run, bad = asyncio.run(both())
        assert proxy.close() == 0, proxy.log()
    with SQLiteTranscript(transcript) as kept:
        entries = [e for e in kept.entries() if e.conversation.startswith("anonymous/load-")]
    kept_replies = sorted(str((e.received or {}).get("content") or "") for e in entries if e.status == "ok")
    return {
        "run": run,
        "hostile": bad,
        "active": active,
        "rss": rss.values,
        "replies": sorted(a.content for _, a in run.answers),
        "kept": kept_replies,
    }
