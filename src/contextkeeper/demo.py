"""The offline demo: count a sample agent conversation turn by turn with a tokenizer a package ships."""

from __future__ import annotations

import json
import time
from importlib import resources
from typing import Any

from .messages import Conversation
from .tokens import breakdown, load_counter

__all__ = ["load_sample", "run_demo"]


def load_sample() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The bundled sample agent conversation: ``(messages, tools)``."""
    text = resources.files("contextkeeper").joinpath("data/sample_agent.json").read_text(encoding="utf-8")
    data = json.loads(text)
    return data["messages"], data["tools"]


def run_demo(*, tokenizer: str = "mistral:tekken", as_json: bool = False) -> int:
    """Replay the sample conversation one turn at a time and print the exact prompt size at each request."""
    messages, tools = load_sample()
    started = time.perf_counter()
    counter = load_counter(tokenizer)
    load_s = time.perf_counter() - started
    units = Conversation.from_messages(messages).units()
    rows: list[dict[str, Any]] = []
    previous = 0
    for unit in units:
        # The app calls the model whenever the last message is the user's or a tool result.
        if unit.kind == "system" or (unit.kind == "assistant" and unit.messages[-1].role != "tool"):
            continue
        prompt = messages[: unit.stop]
        t0 = time.perf_counter()
        parts = breakdown(counter, prompt, tools=tools)
        elapsed_ms = (time.perf_counter() - t0) * 1000
        rows.append(
            {
                "request": len(rows) + 1,
                "messages": len(prompt),
                "last": unit.messages[-1].role,
                "tokens": parts.tokens,
                "added": parts.tokens - previous,
                "system": parts.system,
                "tools": parts.tools,
                "history": parts.history,
                "request_tokens": parts.request,
                "overhead": parts.template_overhead,
                "ms": round(elapsed_ms, 2),
            }
        )
        previous = parts.tokens
    if as_json:
        print(json.dumps({"tokenizer": tokenizer, "load_s": round(load_s, 3), "turns": rows}))
        return 0
    print(f"contextkeeper demo — sample travel-agent conversation, tokenizer {tokenizer} (loaded in {load_s:.2f} s)")
    print("Exact prompt tokens at each model call, split by slot (marginal cost in prompt order):\n")
    header = f"{'call':>4} {'msgs':>4} {'last':<9} {'total':>6} {'+new':>5} {'system':>6} {'tools':>5} "
    header += f"{'history':>7} {'request':>7} {'overhead':>8} {'ms':>6}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['request']:>4} {r['messages']:>4} {r['last']:<9} {r['tokens']:>6} {r['added']:>5} {r['system']:>6} "
            f"{r['tools']:>5} {r['history']:>7} {r['request_tokens']:>7} {r['overhead']:>8} {r['ms']:>6.1f}"
        )
    print("\nEvery figure is the length of the token ids the model's own chat encoder produces (mistral-common")
    print("for Mistral tokenizers, the Jinja chat template for Hugging Face ones) — no estimates.")
    return 0
