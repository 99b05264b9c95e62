"""What ``contextkeeper serve`` adds to a chat request, and what it carries, on loopback.

The upstream is tests/openai_server.py's ChatServer (an OpenAI-compatible server in Python that counts every prompt
with the real Qwen2 tokenizer and chat template, as vLLM does, and answers at once), in this script's process
with the clients. Each proxy is a real ``contextkeeper serve`` process (two model entries: the probes' without a
KV capacity, the load's with 16,384 tokens; a 1,024-token context, 64 tokens kept for each answer). Four runs:

* **idle**: no load; probe pairs one after another: what one request costs through the proxy;
* **paced, one proxy**: 200 concurrent chats (every second one streaming) with long histories that the proxy
  trims, each pausing a while between an answer and its next turn (4 s on average, as people read and type);
* **saturating, one proxy**: the same 200 chats without pauses, each sending its next turn as soon as its
  answer is in: the closed loop runs the machine flat out (throughput);
* **saturating, two proxies**: those chats sent to two serve processes in turn (a round-robin balancer), both
  admitting against one Redis ledger (a real ``redis-server`` on loopback).

A probe pair is one request sent straight to the upstream and the same request through the proxy, back to back,
the order alternating, plain and streamed in turn (a 9-message chat that fits as it is, so both prompts are the
same). "Added" is proxied minus direct per pair (to the answer's last byte); "less fit" also takes off the fit
time the proxy reports (``Server-Timing: fit;dur=``). Under saturating load the added time is mostly the probe
waiting its turn in a busy proxy, not work done for it. Throughput counts the load's chats through the proxies;
"proxy CPU" is the serve processes' CPU time per request (load and probes). Peak KV is the ledger's own peak of
tokens held (prompt plus answer reserve, every process), against the capacity.

    python benchmarks/bench_proxy.py [--chats 200] [--seconds 60] [--shared-seconds 20] [--idle-seconds 15]
                                     [--pause 4] [--quick] [--no-write]

Writes benchmarks/results/proxy.json and its section of docs/proxy.md (between markers), and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]

from report import write_section  # noqa: E402

from assets import require_assets, tokenizer_dir  # noqa: E402
from engines import RedisServer  # noqa: E402
from openai_server import ChatServer  # noqa: E402
from proxy_helpers import LoadRun, percentile, run_load, scrape, serve_processes, total, write_config  # noqa: E402

DOC = ROOT / "docs" / "proxy.md"
RESULTS = ROOT / "benchmarks" / "results" / "proxy.json"
CONTEXT = 1024
ANSWER = 64
CAPACITY = 16 * CONTEXT
LOAD_ENTRY = "models[1] (match '*')"
DEFAULTS = {"chats": 200, "seconds": 60.0, "shared_seconds": 20.0, "idle_seconds": 15.0, "pause": 4.0}


@dataclass
class Row:
    setup: str
    proxies: int
    chats: int
    seconds: float
    requests: int
    throughput: float  # load requests per second, all proxies
    errors: int
    probes: int
    direct_p50_ms: float
    added_p50_ms: float
    added_p99_ms: float
    added_less_fit_p50_ms: float
    probe_fit_p50_ms: float
    load_fit_p50_ms: float | None
    proxy_cpu_ms: float | None  # serve processes' CPU per request
    peak_tokens: int | None
    capacity: int | None
    first_error: str | None = None


def cpu_seconds(pid: int | None) -> float | None:
    """User plus system CPU seconds of a process so far (Linux /proc; None elsewhere)."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(
    setup: str, upstream: ChatServer, configs: list[Path], chats: int, seconds: float, probe_pause: float, pause: float
) -> Row:
    root = upstream.base_url.removesuffix("/v1")
    with serve_processes(configs, upstream.base_url) as processes:
        urls = [p.url for p in processes if p.url is not None]
        # Warm up (first requests import and build what later ones reuse), then start counting.
        asyncio.run(run_load(urls, root, chats=0, seconds=2, answer=ANSWER, probe_pause=0))
        pids = [p.process.pid if p.process is not None else None for p in processes]
        before = [cpu_seconds(pid) for pid in pids]
        run = asyncio.run(
            run_load(
                urls, root, chats=chats, seconds=seconds, answer=ANSWER, probe_pause=probe_pause, pause=pause, seed=1
            )
        )
        after = [cpu_seconds(pid) for pid in pids]
        time.sleep(1.0)  # the last streams' exchanges are observed just after their last event
        samples = [scrape(url) for url in urls]
    cpu = None
    if None not in before and None not in after:
        used = sum(a - b for a, b in zip(after, before, strict=True) if a is not None and b is not None)
        cpu = round(1000 * used / max(1, run.requests + 2 * len(run.probes)), 2)
    peaks = [total(s, "contextkeeper_kv_peak_tokens", entry=LOAD_ENTRY) for s in samples]
    return row(setup, len(configs), chats, run, cpu, int(max(peaks)) if chats else None)


def row(setup: str, proxies: int, chats: int, run: LoadRun, cpu: float | None, peak: int | None) -> Row:
    added = run.added_ms()
    load_fits = [a.fit_ms for _, a in run.answers if a.fit_ms is not None]
    return Row(
        setup=setup,
        proxies=proxies,
        chats=chats,
        seconds=round(run.seconds, 1),
        requests=run.requests,
        throughput=round(run.requests / run.seconds, 1),
        errors=len(run.errors),
        probes=len(run.probes),
        direct_p50_ms=round(statistics.median(d.seconds * 1000 for _, d, _ in run.probes), 2),
        added_p50_ms=round(percentile(added, 0.5), 2),
        added_p99_ms=round(percentile(added, 0.99), 2),
        added_less_fit_p50_ms=round(percentile(run.added_ms(less_fit=True), 0.5), 2),
        probe_fit_p50_ms=round(statistics.median(p.fit_ms or 0.0 for _, _, p in run.probes), 2),
        load_fit_p50_ms=round(statistics.median(load_fits), 2) if load_fits else None,
        proxy_cpu_ms=cpu,
        peak_tokens=peak,
        capacity=CAPACITY if chats else None,
        first_error=run.errors[0][:400] if run.errors else None,
    )


def environment(redis_url: str) -> dict[str, str]:
    import redis

    def version(package: str) -> str:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    server = str(redis.Redis.from_url(redis_url).info("server")["redis_version"])
    model = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        model = next(
            (line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if "model name" in line), ""
        )
    return {
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs" + (f" ({model})" if model else ""),
        "uvicorn": version("uvicorn"),
        "starlette": version("starlette"),
        "httpx2": version("httpx2"),
        "openai": version("openai"),
        "uvloop": version("uvloop"),
        "httptools": version("httptools"),
        "redis-server": server,
    }


def table(rows: list[Row]) -> list[str]:
    def ms(value: float | None) -> str:
        return "" if value is None else f"{value:.2f} ms"

    out = [
        "| run | requests | throughput | errors | probe pairs | direct p50 | added p50 | added p99 "
        "| added less fit p50 | fit p50 (probe / load) | proxy CPU per request | peak KV / capacity |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        load_fit = f" / {r.load_fit_p50_ms:.2f} ms" if r.load_fit_p50_ms is not None else ""
        peak = f"{r.peak_tokens:,} / {r.capacity:,}" if r.peak_tokens is not None and r.capacity else ""
        out.append(
            f"| {r.setup} | {r.requests:,} in {r.seconds:.0f} s | {r.throughput:.1f}/s | {r.errors} | {r.probes:,} "
            f"| {ms(r.direct_p50_ms)} | {ms(r.added_p50_ms)} | {ms(r.added_p99_ms)} | {ms(r.added_less_fit_p50_ms)} "
            f"| {r.probe_fit_p50_ms:.2f} ms{load_fit} | {ms(r.proxy_cpu_ms)} | {peak} |"
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chats", type=int, default=DEFAULTS["chats"], help="concurrent chats under load")
    parser.add_argument("--seconds", type=float, default=DEFAULTS["seconds"], help="the one-proxy load's length")
    parser.add_argument("--shared-seconds", type=float, default=DEFAULTS["shared_seconds"], help="two proxies'")
    parser.add_argument("--idle-seconds", type=float, default=DEFAULTS["idle_seconds"], help="the idle probes'")
    parser.add_argument("--pause", type=float, default=DEFAULTS["pause"], help="the paced chats' mean pause, s")
    parser.add_argument("--quick", action="store_true", help="smoke run: 40 chats, 8 s each, 1 s pauses")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs and results alone")
    args = parser.parse_args()
    if args.quick:
        args.chats, args.seconds, args.shared_seconds, args.idle_seconds, args.pause = 40, 8.0, 8.0, 4.0, 1.0
    require_assets()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir("qwen2")))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    started = time.perf_counter()
    rows: list[Row] = []
    folder = Path(tempfile.mkdtemp(prefix="ck-bench-proxy-"))
    try:
        with RedisServer() as redis_server:
            env = environment(redis_server.url)
            one = write_config(folder / "one.toml", tokenizer_dir("qwen2"), CONTEXT, {"kv_capacity": CAPACITY})
            shared = {"kv_capacity": CAPACITY, "ledger": redis_server.url, "ledger_pool": f"bench-{time.time_ns()}"}
            two = [write_config(folder / f"two-{n}.toml", tokenizer_dir("qwen2"), CONTEXT, shared) for n in range(2)]
            runs = (
                ("idle, one proxy", [one], 0, args.idle_seconds, 0.005, 0.0),
                (f"{args.chats} chats paced, one proxy", [one], args.chats, args.seconds, 0.05, args.pause),
                (f"{args.chats} chats saturating, one proxy", [one], args.chats, args.seconds, 0.05, 0.0),
                (f"{args.chats} chats saturating, two proxies", two, args.chats, args.shared_seconds, 0.05, 0.0),
            )
            for setup, configs, chats, seconds, probe_pause, pause in runs:
                with ChatServer(tokenizer_dir("qwen2"), max_model_len=CONTEXT, tokenizer=tokenizer) as upstream:
                    result = measure(setup, upstream, configs, chats, seconds, probe_pause, pause)
                rows.append(result)
                print(f"{setup}: {json.dumps(asdict(result))}", file=sys.stderr)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    given = {"chats": args.chats, "seconds": args.seconds, "shared_seconds": args.shared_seconds}
    given.update(idle_seconds=args.idle_seconds, pause=args.pause)
    flags = "".join(f" --{k.replace('_', '-')} {v:g}" for k, v in given.items() if v != DEFAULTS[k])
    command = f"python benchmarks/bench_proxy.py{flags}"
    if load is not None:
        env["load average"] = f"{load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    errors = [f"{r.setup}: {r.first_error}" for r in rows if r.first_error]
    lines = [
        "<!-- proxy-load:start -->",
        f"Command: `{command}` — " + ", ".join(f"{name} {value}" for name, value in env.items()) + ".",
        "",
        *table(rows),
        *(["", "First error of each run that had errors:", "", *(f"- `{e}`" for e in errors)] if errors else []),
        "<!-- proxy-load:end -->",
    ]
    block = "\n".join(lines)
    print(block)
    if not args.no_write:
        write_section("proxy-load", block, doc=DOC)
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        results = {"command": command, "environment": env, "context": CONTEXT, "answer": ANSWER}
        results["rows"] = [asdict(r) for r in rows]
        RESULTS.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {RESULTS.relative_to(ROOT)} and {DOC.relative_to(ROOT)}", file=sys.stderr)
    print(f"total {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
