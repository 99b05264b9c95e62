"""Honest clients of ``contextkeeper serve`` with and without hostile ones beside them (issue 34), on loopback.

Both runs put the same paced honest load through one real ``contextkeeper serve`` process (a SQLite transcript, a
4 MB body limit, a 16,384-token KV capacity): chats pausing about a second between turns, and probe pairs (one
request straight to the upstream, the same one through the proxy) that measure what the proxy adds. The second run
adds the hostile clients of tests/hostile_clients.py: bodies over the limit (a 64 MB Content-Length, endless
chunked bodies), 40 connections sending their heads a byte a second, a flood of new conversation ids, clients
that hang up before their answer, and bodies just under the limit (3 MB of history) parsed and fitted for real.

Reported per run: the honest requests and their errors, the probes' added latency (p50, p99), the serve process's
largest resident memory and its spread over the second half of the run, the most KV tokens held (sampled from
/metrics every 100 ms) against the capacity, the acknowledged replies found in the transcript, and what the
hostile clients were answered.

    python benchmarks/bench_hostile.py [--chats 40] [--seconds 30] [--no-write]

Writes benchmarks/results/hostile.json and its section of docs/proxy.md (between markers), and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
from proxy_helpers import percentile  # noqa: E402

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chats", type=int, default=40, help="concurrent honest chats")
    parser.add_argument("--seconds", type=float, default=30.0, help="each run's length")
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
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    flags = "".join(f" --{k} {v:g}" for k, v in (("chats", args.chats), ("seconds", args.seconds)))
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
        "<!-- proxy-hostile:end -->",
    ]
    block = "\n".join(lines)
    print(block)
    if not args.no_write:
        write_section("proxy-hostile", block, doc=DOC)
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps({"command": command, "rows": rows}, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {RESULTS.relative_to(ROOT)} and {DOC.relative_to(ROOT)}", file=sys.stderr)
    print(f"total {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
