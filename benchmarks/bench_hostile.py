"""Honest clients of ``contextkeeper serve`` with and without hostile ones beside them (issue 34), on loopback.

Both runs put the same paced honest load through one real ``contextkeeper serve`` process (a SQLite transcript, a
4 MB body limit, a 16,384-token KV capacity): chats pausing about a second between turns, and probe pairs (one
request straight to the upstream, the same one through the proxy) that measure what the proxy adds. The second run
adds the hostile clients of tests/hostile_clients.py: bodies over the limit (a 64 MB Content-Length, endless
chunked bodies), 40 connections sending their heads a byte a second, a flood of new conversation ids, clients
that hang up before their answer, and bodies just under the limit (3 MB of history) parsed and fitted for real.

A second table: one honest client sending a small chat every 20 ms through a serve process, alone and beside
another client (curl, its own process) sending one body of 6.6 MB or 12.4 MB (a long history, a new conversation
each time, so the proxy parses, checks, records and fits all of it) every second: what one large request costs the
other clients.

Reported per run: the honest requests and their errors, the probes' added latency (p50, p99), the serve process's
largest resident memory and its spread over the second half of the run, the most KV tokens held (sampled from
/metrics every 100 ms) against the capacity, the acknowledged replies found in the transcript, and what the
hostile clients were answered.

    python benchmarks/bench_hostile.py [--chats 40] [--seconds 30] [--large-seconds 8] [--no-write]

Writes benchmarks/results/hostile.json and its section of docs/proxy.md (between markers), and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]

from report import write_section  # noqa: E402

from assets import require_assets, tokenizer_dir  # noqa: E402
from hostile_clients import CAPACITY, hostile_run  # noqa: E402
from openai_server import ChatServer  # noqa: E402
from proxy_helpers import load_turn, percentile, serve_processes, write_config  # noqa: E402

DOC = ROOT / "docs" / "proxy.md"
RESULTS = ROOT / "benchmarks" / "results" / "hostile.json"


def summary(name: str, outcome: dict[str, Any]) -> dict[str, Any]:
    run = outcome["run"]
    rss = outcome["rss"]
    half = rss[len(rss) // 2 :] or rss
    return {
        "run": name,
        "requests": run.requests,
        "seconds": round(run.seconds, 1),
        "errors": len(run.errors),
        "probes": len(run.probes),
        "added_p50_ms": round(percentile(run.added_ms(), 0.5), 2),
        "added_p99_ms": round(percentile(run.added_ms(), 0.99), 2),
        "rss_max_mb": round(max(rss)),
        "rss_spread_second_half_mb": round(max(half) - min(half)),
        "peak_kv": int(max(outcome["active"].values)),
        "acknowledged": len(outcome["replies"]),
        "kept": sum(1 for reply in outcome["replies"] if reply in outcome["kept"]),
        "lost": len(outcome["replies"]) - len(outcome["kept"]),
        "hostile": {f"{kind} {status}": n for (kind, status), n in sorted(outcome["hostile"].answers.items())},
    }


def table(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        "| run | honest requests | errors | probe pairs | added p50 | added p99 | RSS max (spread, 2nd half) "
        "| peak KV / capacity | replies kept / acknowledged |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['run']} | {r['requests']:,} in {r['seconds']:.0f} s | {r['errors']} | {r['probes']} "
            f"| {r['added_p50_ms']:.2f} ms | {r['added_p99_ms']:.2f} ms "
            f"| {r['rss_max_mb']} MB ({r['rss_spread_second_half_mb']} MB) | {r['peak_kv']:,} / {CAPACITY:,} "
            f"| {r['kept']:,} / {r['acknowledged']:,} |"
        )
    return out


def large_history(megabytes: float) -> list[dict[str, Any]]:
    """A chat of about ``megabytes`` of JSON: long user turns (about 6 KB each) and short answers."""
    history: list[dict[str, Any]] = [{"role": "system", "content": "You answer briefly."}]
    for turn in range(int(megabytes * 2**20 / 6000)):
        history.append({"role": "user", "content": load_turn(turn, 800)})
        history.append({"role": "assistant", "content": f"Answer {turn}."})
    history.append({"role": "user", "content": load_turn(0)})
    return history


async def _honest(client: Any, url: str, seconds: float) -> list[float]:
    body = {"model": "m", "messages": [{"role": "user", "content": load_turn(1)}], "max_tokens": 8}
    took: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        started = time.perf_counter()
        response = await client.post(url, json=body, headers={"X-Conversation-Id": "honest"})
        if response.status_code != 200:
            raise RuntimeError(f"an honest request failed: {response.status_code} {response.text[:200]}")
        took.append((time.perf_counter() - started) * 1000)
        await asyncio.sleep(0.02)
    return took


async def _large(url: str, path: Path, seconds: float) -> tuple[int, float]:
    """One large body a second, sent by curl (its own process, so the honest client's loop is not the one busy)."""
    sent, busy = 0, 0.0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        started = time.perf_counter()
        process = await asyncio.create_subprocess_exec(
            "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", url, "-H", "Content-Type: application/json",
            "-H", f"X-Conversation-Id: large-{sent}", "--data-binary", f"@{path}", stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, _ = await process.communicate()
        if out != b"200":
            raise RuntimeError(f"a large request failed: {out!r}")
        busy += time.perf_counter() - started
        sent += 1
        await asyncio.sleep(1.0)
    return sent, busy / max(1, sent)


def large_bodies(tokenizer: Any, folder: Path, seconds: float) -> list[dict[str, Any]]:
    """The second table's rows: honest latency alone, then beside one large body a second of each size."""
    import httpx2

    config = write_config(folder / "large.toml", tokenizer_dir("qwen2"), 1024, {})
    rows = []
    with (
        ChatServer(tokenizer_dir("qwen2"), max_model_len=1024, tokenizer=tokenizer) as upstream,
        serve_processes([config], upstream.base_url) as (proxy,),
    ):
        url = f"{proxy.url}/v1/chat/completions"

        async def measure(size: float | None) -> dict[str, Any]:
            async with httpx2.AsyncClient(timeout=120) as client:
                await _honest(client, url, 1.0)  # warm up
                if size is None:
                    took, sent, each = await _honest(client, url, seconds), 0, 0.0
                    name, body_mb = "alone", 0.0
                else:
                    path = folder / f"large-{size}.json"
                    path.write_bytes(
                        json.dumps({"model": "m", "messages": large_history(size), "max_tokens": 8}).encode()
                    )
                    body_mb = path.stat().st_size / 2**20
                    took, (sent, each) = await asyncio.gather(_honest(client, url, seconds), _large(url, path, seconds))
                    name = f"beside one {body_mb:.1f} MB body a second"
            ordered = sorted(took)
            return {
                "run": name,
                "body_mb": round(body_mb, 1),
                "large_requests": sent,
                "large_ms": round(each * 1000),
                "honest": len(took),
                "p50_ms": round(statistics.median(took), 1),
                "p99_ms": round(ordered[int(0.99 * (len(ordered) - 1))], 1),
                "max_ms": round(ordered[-1], 1),
            }

        for size in (None, 6.6, 12.4):
            rows.append(asyncio.run(measure(size)))
            print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chats", type=int, default=40, help="concurrent honest chats")
    parser.add_argument("--seconds", type=float, default=30.0, help="each run's length")
    parser.add_argument("--large-seconds", type=float, default=8.0, help="each large-body run's length")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs and results alone")
    args = parser.parse_args()
    require_assets()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir("qwen2")))
    load = os.getloadavg()[0]
    started = time.perf_counter()
    folder = Path(tempfile.mkdtemp(prefix="ck-bench-hostile-"))
    rows = []
    try:
        for name, hostile in (("honest clients alone", False), ("beside hostile clients", True)):
            (folder / name).mkdir()
            outcome = hostile_run(tokenizer, folder / name, hostile=hostile, seconds=args.seconds, chats=args.chats)
            rows.append(summary(name, outcome))
            print(json.dumps(rows[-1]), file=sys.stderr)
        large = large_bodies(tokenizer, folder, args.large_seconds)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    given = (("chats", args.chats), ("seconds", args.seconds), ("large-seconds", args.large_seconds))
    flags = "".join(f" --{k} {v:g}" for k, v in given)
    command = f"python benchmarks/bench_hostile.py{flags}"
    ratio = rows[1]["added_p99_ms"] / max(rows[0]["added_p99_ms"], 1e-9)
    answered = ", ".join(f"{key}: {n:,}" for key, n in rows[1]["hostile"].items())
    lines = [
        "<!-- proxy-hostile:start -->",
        f"Command: `{command}` — {os.cpu_count()} CPUs, load average {load:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end.",
        "",
        *table(rows),
        "",
        f"Honest p99 added beside the hostile clients: {ratio:.2f}x the run without them. What the hostile clients "
        f"were answered: {answered}.",
        "",
        "| honest client (a small chat every 20 ms) | large requests (time each, to its answer) | honest requests "
        "| p50 | p99 | max |",
        "|---|---:|---:|---:|---:|---:|",
        *(
            f"| {r['run']} | {r['large_requests']} ({r['large_ms']} ms) | {r['honest']} | {r['p50_ms']:.1f} ms "
            f"| {r['p99_ms']:.1f} ms | {r['max_ms']:.1f} ms |"
            for r in large
        ),
        "<!-- proxy-hostile:end -->",
    ]
    block = "\n".join(lines)
    print(block)
    if not args.no_write:
        write_section("proxy-hostile", block, doc=DOC)
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        results = {"command": command, "rows": rows, "large_bodies": large}
        RESULTS.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {RESULTS.relative_to(ROOT)} and {DOC.relative_to(ROOT)}", file=sys.stderr)
    print(f"total {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
