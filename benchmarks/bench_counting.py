"""Counting benchmark: a 2,000-message agent conversation through real chat templates.

Measures, on one machine in one run: the cold count (fresh counter, empty caches), the count after each
appended turn (warm counter), and the obvious exact alternative — a full ``apply_chat_template`` recount.
Writes the results to docs/benchmarks.md (between markers) and prints them.

    python benchmarks/bench_counting.py [--turns 40] [--recounts 3] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]

from agent_conversation import TOOLS, build  # noqa: E402
from report import write_section  # noqa: E402

import contextkeeper as ck  # noqa: E402
from assets import template, tokenizer_dir  # noqa: E402

CASES = [
    ("Qwen2.5-7B-Instruct", "Qwen-Qwen2.5-7B-Instruct", "qwen2"),
    ("Llama-3.3-70B-Instruct", "meta-llama-Llama-3.3-70B-Instruct", "llama-bpe"),
    # Qwen3 strips reasoning from turns before the last user query, so a new user turn changes what the loop
    # body sees for every message: its outputs cannot be reused across such turns.
    ("Qwen3-0.6B", "Qwen-Qwen3-0.6B", "qwen2"),
]


def _requests(messages: list[dict[str, Any]], start: int) -> list[int]:
    """Prefix lengths at which the app calls the model (after a user message or the last tool result)."""
    ends = []
    for i in range(start, len(messages)):
        nxt = messages[i + 1]["role"] if i + 1 < len(messages) else "user"
        if messages[i]["role"] in ("user", "tool") and nxt != "tool":
            ends.append(i + 1)
    return ends


def _from_user(messages: list[dict[str, Any]], start: int, stop: int) -> list[dict[str, Any]]:
    """messages[start:stop], moved forward to begin on a user turn (whole units only)."""
    while messages[start]["role"] != "user":
        start += 1
    return messages[start:stop]


def run_case(label: str, template_name: str, vocab: str, turns: int, recounts: int, repeats: int = 3) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir(vocab))
    source = template(template_name)
    messages = build(2600)
    stops = _requests(messages, 2000)
    first, later = stops[0], stops[1 : turns + 1]

    # The machine's speed drifts by a third between minutes, so the cold count and the per-turn series are
    # measured ``repeats`` times, each with a fresh counter, and the median run is reported (with the range).
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        counter = ck.HFChatTemplateCounter(tokenizer, chat_template=source, name=label)
        build_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        cold_tokens = counter.count(messages[:first], tools=TOOLS)
        cold_s = time.perf_counter() - t0
        series = []
        for stop in later:
            t0 = time.perf_counter()
            counter.count(messages[:stop], tools=TOOLS)
            series.append((time.perf_counter() - t0) * 1000)
        runs.append((cold_s, series))
    p50s = sorted(statistics.median(series) for _, series in runs)
    per_turn = [ms for _, series in runs for ms in series]
    cold_s = statistics.median(cold for cold, _ in runs)

    # What the fit engine counts once history exceeds the context: the system prompt plus a recent window.
    window_ms = []
    for stop in later:
        window = messages[:1] + _from_user(messages, stop - 400, stop)
        t0 = time.perf_counter()
        window_tokens = counter.count(window, tools=TOOLS)
        window_ms.append((time.perf_counter() - t0) * 1000)

    full = []
    checked = []
    for stop in [first, *later][:recounts]:
        plain, _ = ck.server_view(ck.Conversation.from_messages(messages[:stop]), content_format=counter.content_format)
        t0 = time.perf_counter()
        ids = tokenizer.apply_chat_template(
            plain, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False, chat_template=source
        )
        full.append(time.perf_counter() - t0)
        checked.append(len(ids) == counter.count(messages[:stop], tools=TOOLS))

    p50 = statistics.median(p50s)
    p95 = sorted(per_turn)[int(0.95 * (len(per_turn) - 1))]
    full_s = statistics.median(full)
    return {
        "case": label,
        "messages": first,
        "tokens": cold_tokens,
        "counter_build_s": round(build_s, 3),
        "cold_s": round(cold_s, 3),
        "turns": len(per_turn),
        "per_turn_p50_ms": round(p50, 2),
        "per_turn_p50_range_ms": [round(p50s[0], 2), round(p50s[-1], 2)],
        "per_turn_p95_ms": round(p95, 2),
        "window_messages": 400,
        "window_tokens": window_tokens,
        "window_p50_ms": round(statistics.median(window_ms), 2),
        "full_recount_s": round(full_s, 3),
        "speedup_per_turn": round(full_s * 1000 / p50, 1),
        "cold_vs_recount": round(cold_s / full_s, 2),
        "exact": all(checked),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--turns", type=int, default=40)
    parser.add_argument("--recounts", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    results = [run_case(*case, turns=args.turns, recounts=args.recounts, repeats=args.repeats) for case in CASES]
    print(json.dumps(results, indent=1))
    import tokenizers
    import transformers

    env = (
        f"Python {platform.python_version()}, transformers {transformers.__version__}, tokenizers "
        f"{tokenizers.__version__}, {platform.machine()}, {__import__('os').cpu_count()} CPUs"
    )
    lines = [
        "<!-- counting:start -->",
        f"Command: `python benchmarks/bench_counting.py` — {env}.",
        "",
        "| template | messages | tokens | cold count | per turn p50 (range) | per turn p95 | full recount "
        "| per-turn speed-up | cold / recount | exact |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['case']} | {r['messages']} | {r['tokens']:,} | {r['cold_s']:.2f} s | {r['per_turn_p50_ms']:.1f} ms "
            f"({r['per_turn_p50_range_ms'][0]:.1f}–{r['per_turn_p50_range_ms'][1]:.1f}) "
            f"| {r['per_turn_p95_ms']:.1f} ms | {r['full_recount_s']:.2f} s | {r['speedup_per_turn']:.0f}× "
            f"| {r['cold_vs_recount']:.2f} | {'yes' if r['exact'] else 'NO'} |"
        )
    lines += [
        "",
        "A recent window (system prompt + the last ~400 messages: what the fit engine counts once history exceeds "
        "the context), counted after each turn with the same counter:",
        "",
        "| template | window tokens | window count p50 |",
        "|---|---:|---:|",
    ]
    for r in results:
        lines.append(f"| {r['case']} | {r['window_tokens']:,} | {r['window_p50_ms']:.1f} ms |")
    lines.append("<!-- counting:end -->")
    block = "\n".join(lines)
    print(block)
    if not args.no_write:
        write_section("counting", block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
