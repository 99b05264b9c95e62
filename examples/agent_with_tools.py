"""A tool-using on-call assistant: large tool results pile up turn after turn, and contextkeeper clears the old
ones (keeping each call paired with its result) before it drops a turn. Offline: mistral-common's Tekken
tokenizer and a scripted model standing in for the LLM.

    python examples/agent_with_tools.py
"""

from __future__ import annotations

import json
from typing import Any

import contextkeeper as ck

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_log",
            "description": "Read the last lines of a service's log.",
            "parameters": {
                "type": "object",
                "properties": {"service": {"type": "string"}, "lines": {"type": "integer"}},
                "required": ["service"],
            },
        },
    }
]
SERVICES = ["api", "auth", "billing", "search", "queue", "mailer", "scheduler", "cache", "gateway", "reports"]


def read_log(service: str, lines: int = 24) -> str:
    """The tool: a long, realistic-looking log excerpt (about 1,300 tokens)."""
    rows = [
        f"2026-11-30T01:{i:02d}:07Z {service} worker-{i % 4} request_id=r{i:05d} latency_ms={(i * 37) % 900} "
        f"status={'500' if i % 17 == 0 else '200'} path=/v2/{service}/items/{i * 13}"
        for i in range(lines)
    ]
    return "\n".join(rows)


def scripted_model(messages: list[dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
    """Stands in for the LLM: reads the log of the service the user asked about, then answers."""
    last = messages[-1]
    if last["role"] == "user":
        service = last["content"].split()[1]
        call = {"id": f"call{len(messages):05d}", "type": "function"}  # Mistral needs 9-character ids
        call["function"] = {"name": "read_log", "arguments": json.dumps({"service": service})}
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    errors = last["content"].count("status=500")
    return {"role": "assistant", "content": f"{errors} errors, every 17th request; latency peaks at 899 ms."}


def main() -> None:
    # A policy in code (the same as a TOML file in strategies/): keep the last two tool results whole, and clear
    # older ones in batches of at least 1,024 tokens so the prompt prefix stays stable between batches.
    policy = ck.Policy.model_validate(
        {
            "name": "on-call",
            "steps": [
                {"strategy": "prune_tool_results", "keep_last": 2, "clear_at_least": 1024},
                {"strategy": "dedupe"},
            ],
        }
    )
    keeper = ck.ContextKeeper("mistral:tekken", context_window=8192, policy=policy)
    model = keeper.wrap(scripted_model)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are an on-call assistant. Use read_log to inspect services."}
    ]
    print(f"{'call':>4} {'messages':>8} {'sent':>4} {'prompt':>6}  actions")
    calls = 0
    for service in SERVICES:
        messages.append({"role": "user", "content": f"Check {service} for errors."})
        while True:
            reply = model(messages, tools=TOOLS, max_tokens=512)
            messages.append(reply)
            calls += 1
            fit = keeper.last_fit
            actions = "; ".join(f"{a.strategy}: {a.detail}" for a in fit.report.actions) or "-"
            print(f"{calls:>4} {len(messages) - 1:>8} {len(fit.messages):>4} {fit.tokens:>6}  {actions}")
            if not reply.get("tool_calls"):
                break
            for call in reply["tool_calls"]:
                args = json.loads(call["function"]["arguments"])
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": read_log(**args)})
    last = keeper.transcript.last()
    print(f"\nlast call: {len(last.rewritten)} old tool results sent as placeholders, {len(last.dropped)} dropped;")
    print(f"each one recoverable: keeper.transcript.recover({last.call}) returns the originals.")


if __name__ == "__main__":
    main()
