"""A deterministic, realistic agent conversation for benchmarks: user turns, assistant text, tool calls and
tool results of up to a few thousand tokens, with five tool schemas."""

from __future__ import annotations

import json
import random
from typing import Any

_WORDS = [
    "the",
    "request",
    "failed",
    "because",
    "the",
    "upstream",
    "service",
    "returned",
    "an",
    "error",
    "after",
    "the",
    "timeout",
    "was",
    "reached",
    "and",
    "the",
    "retry",
    "budget",
    "ran",
    "out",
    "so",
    "we",
    "rolled",
    "back",
    "the",
    "deployment",
    "to",
    "version",
    "checked",
    "logs",
    "metrics",
    "latency",
    "p99",
    "database",
    "index",
    "migration",
    "cache",
    "invalidation",
    "customer",
    "invoice",
    "shipment",
    "warehouse",
    "order",
    "status",
    "pending",
    "approved",
    "rejected",
    "refund",
    "policy",
    "quarterly",
    "revenue",
    "forecast",
    "growth",
    "region",
    "europe",
    "asia",
    "america",
    "total",
    "average",
    "median",
    "percentile",
    "budget",
    "headcount",
    "hiring",
    "plan",
    "roadmap",
    "milestone",
    "release",
    "candidate",
    "regression",
]

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {
                    key: {"type": kind, "description": f"The {key.replace('_', ' ')}."} for key, kind in params
                },
                "required": [params[0][0]],
            },
        },
    }
    for name, description, params in [
        ("search_logs", "Search service logs in a time range.", [("query", "string"), ("hours", "integer")]),
        ("run_sql", "Run a read-only SQL query on the warehouse.", [("sql", "string"), ("limit", "integer")]),
        ("read_file", "Read a file from the repository.", [("path", "string"), ("max_bytes", "integer")]),
        ("http_get", "Fetch a URL from the internal API.", [("url", "string"), ("timeout_s", "number")]),
        ("create_ticket", "Open an incident ticket.", [("title", "string"), ("severity", "string")]),
    ]
]


def _sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words)).capitalize() + "."


def _tool_result(rng: random.Random, size_words: int) -> str:
    kind = rng.randrange(3)
    if kind == 0:  # JSON rows
        rows = [
            {
                "id": rng.randrange(10**6),
                "status": rng.choice(_WORDS),
                "amount": round(rng.uniform(1, 9999), 2),
            }
            for _ in range(max(1, size_words // 9))
        ]
        return json.dumps({"rows": rows})
    if kind == 1:  # log lines
        return "\n".join(
            f"2026-11-{rng.randrange(1, 29):02d}T{rng.randrange(24):02d}:{rng.randrange(60):02d}:00Z "
            f"{rng.choice(['INFO', 'WARN', 'ERROR'])} {_sentence(rng, 10)}"
            for _ in range(max(1, size_words // 14))
        )
    lines = [f"def handler_{i}(event, context):\n    return {{'ok': {i % 2 == 0}}}" for i in range(size_words // 12)]
    return "```python\n" + "\n\n".join(lines) + "\n```"


def build(messages: int = 2000, seed: int = 7) -> list[dict[str, Any]]:
    """An agent conversation of exactly ``messages`` messages (system first; ends on a user or tool turn)."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = [{"role": "system", "content": "You are an on-call SRE assistant. " * 8}]
    call = 0
    while len(out) < messages:
        out.append({"role": "user", "content": _sentence(rng, rng.randrange(8, 60))})
        for _ in range(rng.randrange(0, 3)):
            tool = rng.choice(TOOLS)["function"]["name"]
            call += 1
            call_id = f"call_{call:06d}"
            out.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": call_id,
                            "type": "function",
                            "function": {"name": tool, "arguments": json.dumps({"query": _sentence(rng, 6)})},
                        }
                    ],
                }
            )
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": call_id,
                    "content": _tool_result(rng, rng.randrange(30, 1000)),
                }
            )
        out.append({"role": "assistant", "content": _sentence(rng, rng.randrange(20, 160))})
    out = out[:messages]
    # End on a request: drop trailing assistant text, keep whole units.
    while out[-1]["role"] == "assistant":
        out.pop()
    return out
