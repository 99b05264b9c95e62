"""The offline demos.

``run_demo`` (the README's first command): a travel agent's long chat through a wrapped local backend, on the
embedded default — the Tekken tokenizer mistral-common ships, Mistral Nemo 12B from the built-in catalog, an L40S
from the GPU catalog serving 16 conversations at once. The per-sequence limit comes from the GPU; every call is
fitted, and the table shows each call's tokens per slot, what the strategies did, and the KV cache it takes.

``run_count_demo``: the sample conversation counted turn by turn, split by slot.
"""

from __future__ import annotations

import dataclasses
import json
import time
from importlib import resources
from typing import Any

from .messages import Conversation
from .tokens import breakdown, load_counter

__all__ = ["load_sample", "run_count_demo", "run_demo"]


def load_sample() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The bundled sample agent conversation: ``(messages, tools)``."""
    text = resources.files("contextkeeper").joinpath("data/sample_agent.json").read_text(encoding="utf-8")
    data = json.loads(text)
    return data["messages"], data["tools"]


def run_count_demo(*, tokenizer: str = "mistral:tekken", as_json: bool = False) -> int:
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


# The embedded default: a tokenizer a registry package ships, a catalog model that uses it, a catalog GPU.
DEMO_MODEL = "mistralai/Mistral-Nemo-Instruct-2407"
DEMO_GPU = "L40S"
DEMO_CONCURRENCY = 16
DEMO_TRIPS = (("Tokyo", "NRT", "AF27"), ("Osaka", "KIX", "JL41"), ("Seoul", "ICN", "KE90"), ("Taipei", "TPE", "CI92"))
DEMO_CONTEXT = 32768  # what the server is configured for; the GPU allows less per conversation


def demo_script(trips: int = len(DEMO_TRIPS)) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A longer session made from the sample: the same travel agent planning several trips in one chat.
    Returns ``(messages, tools)``; each trip's last user question gets a scripted answer."""
    sample, tools = load_sample()
    system, body = sample[0], sample[1:]
    text = json.dumps(body, ensure_ascii=False)
    messages = [system]
    for k, (city, airport, flights) in enumerate(DEMO_TRIPS[:trips]):
        trip = text.replace("Tokyo", city).replace("NRT", airport).replace("AF27", flights)
        trip = trip.replace('"id": "', f'"id": "t{k}').replace('"tool_call_id": "', f'"tool_call_id": "t{k}')
        messages += json.loads(trip)
        messages.append(
            {"role": "assistant", "content": f"Economy on {flights}0 includes one 23 kg bag; I have placed the hold."}
        )
    return messages, tools


class ScriptedAgent:
    """The local backend: answers each call with the recorded assistant message that follows the prompt's
    newest message (no network, no model). It reads the fitted prompt only to find its place."""

    def __init__(self, script: list[dict[str, Any]]) -> None:
        self.script = script
        self.calls = 0

    def __call__(self, messages: list[dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
        self.calls += 1
        last = messages[-1]
        index = next(i for i, m in enumerate(self.script) if m is last)  # untouched messages come back as given
        return dict(self.script[index + 1])


def _short(actions: Any) -> str:
    names = {"prune_tool_results": "pruned", "sliding_window": "window", "dedupe": "dedupe", "truncate": "cut"}
    parts = []
    for action in actions:
        saved = f" -{action.saved:,}" if action.saved else ""
        parts.append(f"{names.get(action.strategy, action.strategy)}{saved}")
    return ", ".join(parts) or "-"


def run_demo(*, as_json: bool = False, max_tokens: int = 512) -> int:
    """The wrapped-chat demo on the embedded default (see the module docstring)."""
    from .keeper import ContextKeeper

    started = time.perf_counter()
    script, tools = demo_script()
    keeper = ContextKeeper(
        "mistral:tekken",
        context_window=DEMO_CONTEXT,
        model=DEMO_MODEL,
        gpu=DEMO_GPU,
        concurrency=DEMO_CONCURRENCY,
        runtime="vllm",
    )
    agent = ScriptedAgent(script)
    chat = keeper.wrap(agent)
    rows: list[dict[str, Any]] = []
    history: list[dict[str, Any]] = [script[0]]
    for message in script[1:]:
        if message["role"] == "assistant":
            # The app calls the model when the newest message is the user's or a tool result.
            reply = chat(history, tools=tools, max_tokens=max_tokens)
            assert reply == message, "the scripted agent lost its place"
            fit, call = keeper.last_fit, keeper.last_call
            assert fit is not None
            assert call is not None
            slots = fit.report.slots
            rows.append(
                {
                    "call": len(rows) + 1,
                    "messages": len(history),
                    "sent": len(fit.messages),
                    "tokens": fit.tokens,
                    "system": slots["system"],
                    "tools": slots["tools"],
                    "history": slots["history"],
                    "request": slots["request"],
                    "answer": slots["answer"],
                    "actions": [dataclasses.asdict(a) for a in fit.report.actions],
                    "kv_bytes": call.kv_bytes,
                    "gpu_share": call.kv_share,
                    "ms": round(fit.report.seconds * 1000, 2),
                    "_actions": _short(fit.report.actions),
                }
            )
        history.append(message)
    transcript = keeper.transcript
    removed = sum(len(e.removed) for e in transcript.entries())
    summary = {
        "tokenizer": "mistral:tekken",
        "model": DEMO_MODEL,
        "gpu": DEMO_GPU,
        "concurrency": DEMO_CONCURRENCY,
        "limit": keeper.limit,
        "limit_source": keeper.limit_source,
        "kv_capacity_tokens": keeper.ledger.capacity,
        "calls": len(rows),
        "messages": len(history),
        "removed_from_prompts": removed,
        "seconds": round(time.perf_counter() - started, 2),
    }
    if as_json:
        print(json.dumps({**summary, "turns": [{k: v for k, v in r.items() if k[0] != "_"} for r in rows]}))
        return 0
    print(f"contextkeeper demo — a travel agent's chat through keeper.wrap(), offline ({summary['seconds']} s)")
    print(
        f"{DEMO_MODEL} on one {DEMO_GPU} serving {DEMO_CONCURRENCY} conversations (vLLM): each may use "
        f"{keeper.limit:,} tokens ({keeper.limit_source}); the KV pool holds {keeper.ledger.capacity:,} tokens."
    )
    print(
        f"Every call reserves the request, {max_tokens} answer tokens and the tool schemas first; "
        "history gets the rest.\n"
    )
    header = (
        f"{'call':>4} {'msgs':>9} {'prompt':>6} {'system':>6} {'tools':>5} {'history':>7} {'request':>7} "
        f"{'answer':>6}  {'KV cache':>9} {'of GPU':>6}  actions"
    )
    print(header)
    print("-" * (len(header) + 12))
    for r in rows:
        kv = f"{r['kv_bytes'] / 2**20:,.0f} MiB"
        share = f"{100 * r['gpu_share']:.2f}%"
        print(
            f"{r['call']:>4} {r['sent']:>4}/{r['messages']:<4} {r['tokens']:>6} {r['system']:>6} {r['tools']:>5} "
            f"{r['history']:>7} {r['request']:>7} {r['answer']:>6}  {kv:>9} {share:>6}  {r['_actions']}"
        )
    print(
        f"\n{len(rows)} calls, {len(history)} messages. msgs = sent / in the app's history; "
        "prompt = exact tokens sent. "
        f"{removed} message slots left out of prompts stay recoverable from keeper.transcript."
    )
    return 0
