"""Helpers for tests of ``contextkeeper serve``: an upstream that also records request headers, a proxy run
in-process by uvicorn on a thread or as real ``contextkeeper serve`` processes, and a bounded load generator
(loopback, ephemeral ports, bounded waits). benchmarks/bench_proxy.py runs the same load."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import json
import queue
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2

import contextkeeper as ck
from contextkeeper.proxy import ModelEntry, Proxy, ProxyServer, Route
from openai_server import ChatServer


class RecordingChatServer(ChatServer):
    """tests/openai_server.py's ChatServer, keeping each request's method, path and headers (lower-cased) too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[str, str, dict[str, str]]] = []

    def start(self) -> RecordingChatServer:
        super().start()
        httpd = self._httpd
        assert httpd is not None
        base: Any = httpd.RequestHandlerClass
        seen = self.seen

        class Recording(base):  # type: ignore[misc,valid-type]
            def _note(self) -> None:
                seen.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))

            def do_GET(self) -> None:
                self._note()
                super().do_GET()

            def do_POST(self) -> None:
                self._note()
                super().do_POST()

        # The server makes a handler per request from this attribute, so swapping it takes effect at once.
        httpd.RequestHandlerClass = Recording
        return self

    def chat_headers(self) -> list[dict[str, str]]:
        return [headers for method, path, headers in self.seen if path.endswith("/chat/completions")]


def route(keeper: ck.ContextKeeper, match: str = "*", name: str | None = None) -> Route:
    """A proxy route for a ready keeper (tests build keepers from an already loaded tokenizer)."""
    entry = ModelEntry(match=match, tokenizer=keeper.name or "tokenizer")
    return Route(name=name or f"models[0] (match {match!r})", entry=entry, keeper=keeper)


@contextlib.contextmanager
def running_proxy(routes: list[Route], upstream: str, **settings: Any) -> Iterator[ProxyServer]:
    """A started proxy for ``routes`` in front of ``upstream`` on 127.0.0.1 (an ephemeral port)."""
    settings.setdefault("backoff", 0.01)
    proxy = Proxy(routes, upstream=upstream, **settings)
    server = ProxyServer(proxy, port=0).start(timeout=20)
    try:
        yield server
    finally:
        server.close()


def debug(url: str, conversation: str | None = None, key: str | None = "client-key") -> httpx2.Response:
    """``GET /contextkeeper/conversations[/<conversation>]`` as the tenant of ``key`` (the bearer key its chats
    were sent with: each tenant sees its own conversations; None: the keyless tenant)."""
    path = f"{url}/contextkeeper/conversations" + (f"/{conversation}" if conversation is not None else "")
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx2.get(path, headers=headers, timeout=10)


def tenant(key: str | None = "client-key") -> str:
    """The tenant a keyless proxy gives a client that sends ``key`` (None: the anonymous tenant)."""
    from contextkeeper.proxy.access import ANONYMOUS, Access

    caller = Access().caller(f"Bearer {key}" if key is not None else None, {}, None)
    return caller.tenant if caller is not None else ANONYMOUS


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Samples:
    """A proxy's ``/metrics``, parsed: ``{(sample name, labels): value}``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx2.get(f"{url}/metrics", timeout=10).text
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(value for (key, got), value in samples.items() if key == name and want <= got)


class Sampler:
    """Reads a figure every ``interval`` seconds on a thread while the load runs; keeps every reading."""

    def __init__(self, read: Callable[[], float], interval: float) -> None:
        self.read = read
        self.interval = interval
        self.values: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.values.append(self.read())
            except Exception as exc:  # reported by the test, not lost on the thread
                self.failures.append(f"{type(exc).__name__}: {exc}")

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


# ------------------------------------------------------------------------------------ real serve processes


class ServeProcess:
    """``contextkeeper serve --config FILE --port 0 --json`` in a subprocess: the real CLI, its own interpreter.

    ``start()`` launches it (several can start at once), ``ready()`` waits for its one JSON line and returns its
    URL; ``close()`` stops it with SIGTERM (a clean shutdown) or, past ``timeout``, SIGKILL. Its stderr is kept
    (the last lines) for failure messages, drained on a thread so that a chatty proxy never blocks on the pipe.
    """

    def __init__(self, config: Path, upstream: str) -> None:
        self.command = [sys.executable, "-m", "contextkeeper", "serve", "--upstream", upstream]
        self.command += ["--config", str(config), "--port", "0", "--json"]
        self.process: subprocess.Popen[str] | None = None
        self.url: str | None = None
        self.stderr: collections.deque[str] = collections.deque(maxlen=40)
        self._lines: queue.Queue[str] = queue.Queue()

    def start(self) -> ServeProcess:
        self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = self.process.stdout, self.process.stderr
        assert out is not None
        assert err is not None
        threading.Thread(target=lambda: [self._lines.put(line) for line in out], daemon=True).start()
        threading.Thread(target=lambda: [self.stderr.append(line.rstrip()) for line in err], daemon=True).start()
        return self

    def ready(self, timeout: float = 90.0) -> str:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"contextkeeper serve did not listen within {timeout:.0f} s: {self.log()}") from None
        self.url = str(json.loads(line)["listening"]).removesuffix("/v1")
        return self.url

    def log(self) -> str:
        return " | ".join(self.stderr) or "(nothing on stderr)"

    def close(self, timeout: float = 20.0) -> int | None:
        """Stop it; its exit status (0: a clean shutdown)."""
        if self.process is None:
            return None
        self.process.terminate()
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=timeout)
            return None
        finally:
            self.process = None


@contextlib.contextmanager
def serve_processes(configs: list[Path], upstream: str) -> Iterator[list[ServeProcess]]:
    """One started ``contextkeeper serve`` per config file (started together), stopped at the end."""
    processes = [ServeProcess(config, upstream) for config in configs]
    try:
        for process in processes:
            process.start()
        for process in processes:
            process.ready()
        yield processes
    finally:
        for process in processes:
            process.close()


# ----------------------------------------------------------------------------------------------- load


WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima")


def load_turn(turn: int, words: int = 40) -> str:
    return f"Turn {turn}: " + " ".join(WORDS[(turn * 7 + i) % len(WORDS)] for i in range(words)) + "?"


def load_history(turns: int, system: str = "You are a terse assistant.") -> list[dict[str, Any]]:
    """A chat of ``turns`` exchanges and a new question."""
    history: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for turn in range(turns):
        history.append({"role": "user", "content": load_turn(turn)})
        history.append({"role": "assistant", "content": f"Answer {turn}: " + " ".join(WORDS[:20])})
    history.append({"role": "user", "content": load_turn(turns)})
    return history


@dataclass
class Answer:
    """One chat request's outcome as the client saw it."""

    seconds: float  # from sending to the last byte of the answer
    content: str
    prompt_tokens: int | None  # the proxy's X-Contextkeeper-Prompt-Tokens (None: sent to the upstream directly)
    dropped: int | None
    fit_ms: float | None  # from the proxy's Server-Timing header


@dataclass
class LoadRun:
    """What a load run produced, as the clients saw it."""

    seconds: float = 0.0  # from the first request to the last answer
    chats: int = 0
    answers: list[tuple[bool, Answer]] = dataclasses.field(default_factory=list)  # (streamed, answer), through proxies
    per_proxy: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    errors: list[str] = dataclasses.field(default_factory=list)
    probes: list[tuple[bool, Answer, Answer]] = dataclasses.field(default_factory=list)  # (streamed, direct, proxied)

    @property
    def requests(self) -> int:
        return len(self.answers)

    def added_ms(self, *, less_fit: bool = False) -> list[float]:
        """Per probe pair: proxied minus direct milliseconds (``less_fit``: the proxy's fit time taken off too)."""
        return [
            (proxied.seconds - direct.seconds) * 1000 - ((proxied.fit_ms or 0.0) if less_fit else 0.0)
            for _, direct, proxied in self.probes
        ]


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest rank."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


async def chat_once(client: httpx2.AsyncClient, base: str, body: dict[str, Any], headers: dict[str, str]) -> Answer:
    """One chat request (``body["stream"]``: read as server-sent events to ``[DONE]``); a RuntimeError says
    what was wrong with the answer."""
    started = time.perf_counter()
    url = base + "/v1/chat/completions"
    if body.get("stream"):
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                await response.aread()
                raise RuntimeError(f"{response.status_code}: {response.text[:300]}")
            events = [line async for line in response.aiter_lines() if line]
        seconds = time.perf_counter() - started
        if not events or events[-1] != "data: [DONE]":
            raise RuntimeError(f"a stream without its [DONE]: {events[-2:]}")
        chunks = [json.loads(line.removeprefix("data: ")) for line in events[:-1]]
        broken = [c["error"] for c in chunks if "error" in c]
        if broken:
            raise RuntimeError(f"an error event in the stream: {broken[0]}")
        content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    else:
        response = await client.post(url, json=body, headers=headers)
        seconds = time.perf_counter() - started
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {response.text[:300]}")
        content = response.json()["choices"][0]["message"]["content"] or ""
    header = response.headers.get("x-contextkeeper-prompt-tokens")
    dropped = response.headers.get("x-contextkeeper-messages-dropped")
    timing = response.headers.get("server-timing", "")
    fit = next((part.split("dur=")[1] for part in timing.split(",") if part.strip().startswith("fit;")), None)
    return Answer(
        seconds=seconds,
        content=content,
        prompt_tokens=int(header) if header is not None else None,
        dropped=int(dropped) if dropped is not None else None,
        fit_ms=float(fit) if fit is not None else None,
    )


async def run_load(
    proxies: list[str],
    upstream: str,
    *,
    chats: int,
    seconds: float,
    answer: int,
    model: str = "load",
    probe_model: str = "probe",
    probe_pause: float = 0.05,
    pause: float = 0.0,
    seed: int = 0,
    probe_delay: float = 0.0,
) -> LoadRun:
    """``chats`` concurrent conversations (every second one streaming) for ``seconds``, each request sent to the
    next of ``proxies`` in turn (a round-robin balancer); ``pause``: the mean seconds a chat waits between an
    answer and its next turn (0: none, a closed loop that saturates the machine). Meanwhile probe pairs measure
    what a proxy adds: one request sent straight to ``upstream`` (the server's root URL) and through the proxy
    back to back, the order alternating, plain and streamed in turn. Every chat ends its request in flight and
    stops by the deadline. ``probe_delay``: seconds before the first probe (past the chats' cold first turns)."""
    run = LoadRun(chats=chats)
    limits = httpx2.Limits(max_connections=chats + 16, max_keepalive_connections=chats + 16)
    turn_counter = itertools.count()
    async with httpx2.AsyncClient(timeout=httpx2.Timeout(180.0), limits=limits) as client:
        started = time.perf_counter()
        deadline = started + seconds

        async def chat(number: int) -> None:
            rng = random.Random(seed * 100_003 + number)
            streamed = number % 2 == 1
            history = load_history(rng.randint(0, 24), f"You help user {number}. Be brief.")
            headers = {"X-Conversation-Id": f"load-{number}"}
            turns = len(history) // 2
            for _ in range(10_000):  # bounded; the deadline ends it long before
                if time.perf_counter() >= deadline:
                    return
                body: dict[str, Any] = {"model": model, "messages": history, "max_tokens": answer}
                if streamed:
                    body.update(stream=True, stream_options={"include_usage": True})
                base = proxies[next(turn_counter) % len(proxies)]
                try:
                    got = await chat_once(client, base, body, headers)
                except Exception as exc:
                    run.errors.append(f"chat {number} via {base}: {type(exc).__name__}: {exc}")
                    return
                run.answers.append((streamed, got))
                run.per_proxy[base] += 1
                turns += 1
                history = [*history, {"role": "assistant", "content": got.content}]
                history.append({"role": "user", "content": load_turn(turns)})
                if pause:
                    await asyncio.sleep(min(rng.uniform(0, 2 * pause), max(0.0, deadline - time.perf_counter())))

        async def probe() -> None:
            body = {"model": probe_model, "messages": load_history(4, "You answer probes."), "max_tokens": answer}
            await asyncio.sleep(probe_delay)
            for number in range(100_000):  # bounded; the deadline ends it long before
                if time.perf_counter() >= deadline:
                    return
                streamed = number % 2 == 1
                sent = {**body, "stream": True, "stream_options": {"include_usage": True}} if streamed else body
                base = proxies[number % len(proxies)]
                headers = {"X-Conversation-Id": f"probe-{number % len(proxies)}"}
                try:
                    if number % 4 < 2:
                        direct = await chat_once(client, upstream, sent, headers)
                        proxied = await chat_once(client, base, sent, headers)
                    else:
                        proxied = await chat_once(client, base, sent, headers)
                        direct = await chat_once(client, upstream, sent, headers)
                except Exception as exc:
                    run.errors.append(f"probe {number} via {base}: {type(exc).__name__}: {exc}")
                    return
                run.probes.append((streamed, direct, proxied))
                await asyncio.sleep(probe_pause)

        await asyncio.wait_for(asyncio.gather(probe(), *(chat(n) for n in range(chats))), seconds + 240)
        run.seconds = time.perf_counter() - started
    return run


def write_config(
    path: Path, tokenizer: Path, context: int, load: dict[str, Any], top: dict[str, Any] | None = None
) -> Path:
    """A proxy config: a ``probe*`` entry with no KV capacity (probes never queue behind the load), and a
    catch-all entry for the load with ``load``'s keys (kv_capacity, ledger, ...); ``top``: top-level keys (a dict
    value is written as an inline table: ``limits = {body_bytes = 4194304}``)."""

    def value(v: Any) -> str:
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + "}"
        return json.dumps(v)  # TOML strings, numbers and booleans are written as JSON writes them

    lines = ["attempts = 2", *(f"{k} = {value(v)}" for k, v in (top or {}).items()), ""]
    for match, extra in (("probe*", {}), ("*", load)):
        lines += ["[[models]]", f"match = {value(match)}", f"tokenizer = {value(str(tokenizer))}"]
        lines += [f"context_window = {context}", *(f"{k} = {value(v)}" for k, v in extra.items()), ""]
    path.write_text("\n".join(lines), encoding="utf-8")
    return path
