"""Prefix benchmark: how much of each prompt a server's prefix cache can reuse, turn after turn of a long agent chat.

Long agent chats (the tool-using conversation of ``agent_conversation.py``, with results of 30–300 words: a turn
adds a few hundred tokens) are fitted at every model call, after each user message and each last tool result,
through real chat templates and vocabularies from the test assets, to context windows of 4,096, 8,192 and 32,768
tokens (512, 1,024 and 2,048 kept for the answer). Every method's output is converted back to OpenAI dicts and
tokenized the way an OpenAI-compatible server renders it (``apply_chat_template(..., tokenize=True)`` with the
tools and the generation prompt): the token ids a server sees. Per call after the first:

* **prefix kept**: the length of the common prefix of this prompt's ids and the previous prompt's, over the
  previous prompt's length (100%: the previous prompt is a prefix of this one; a prefix cache reuses all of it);
* **prefill**: the tokens of this prompt beyond that prefix (what the server computes again);
* **new**: the tokens the untrimmed chat grew by since the previous call (the new messages, counted exactly);
* **history use**: this prompt's tokens over the prompt budget (context minus answer).

Methods, in the same run: contextkeeper's ``policy="default"``; the same pipeline with the cache-aware window
(``[[steps]] strategy = "sliding_window"`` with ``hysteresis``: cut to the low-water mark, then append); and
LangChain's ``trim_messages(strategy="last", start_on="human", include_system=True)`` with an exact template
counter (the server's token ids for the tools and the messages). A sweep of the hysteresis (contextkeeper's own
``fit.report.prefix_tokens``, which the tests hold equal to these ids) draws the trade-off curve. Writes
docs/benchmarks.md (between markers) and benchmarks/results/prefix.json, and prints them.

    python benchmarks/bench_prefix.py [--turns 300] [--quick] [--no-write]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]

from agent_conversation import TOOLS, _sentence, _tool_result  # noqa: E402
from bench_fit import server_dicts  # noqa: E402
from report import write_section  # noqa: E402

import contextkeeper as ck  # noqa: E402
from assets import template, tokenizer_dir  # noqa: E402
from contextkeeper.strategies.policy import Policy, PolicyStep, resolve_policy  # noqa: E402
from contextkeeper.strategies.sliding_window import SlidingWindow  # noqa: E402

CASES = [
    ("Qwen3-0.6B", "Qwen-Qwen3-0.6B", "qwen2"),
    ("Llama-3.3-70B-Instruct", "meta-llama-Llama-3.3-70B-Instruct", "llama-bpe"),
    ("Gemma-4-31B-it", "google-gemma-4-31B-it", "gemma-4"),
]
BUDGETS = [(4096, 512), (8192, 1024), (32768, 2048)]  # (context window, answer)
HYSTERESIS = 0.45  # the cache-aware setting measured in the main table (chosen from the sweep below)
SWEEP = (None, 0.1, 0.2, 0.3, 0.35, 0.4, 0.45, 0.5, 0.6)  # None: the default window (its slack)
CACHED_PRICE = 0.02  # a reused token's cost beside a prefilled one (a self-hosted server's prefill time)
# Cases LangChain is not run on: its exact counter renders the whole window about ten times a call.
SLOW = {
    ("Gemma-4-31B-it", 32768): "not run: Gemma 4's template takes ~0.7 s to render a 32K prompt, and trim_messages "
    "renders about ten per call (see the 8K row)",
}
GOALS = {"kept": 0.95, "p10": 0.80, "ratio": 2.0, "use": 0.75}

Messages = list[dict[str, Any]]


# --- the conversation -----------------------------------------------------------------------------------------


def chat(messages: int = 1500, seed: int = 11, words: tuple[int, int] = (30, 300)) -> Messages:
    """A tool-using agent chat of ``messages`` messages (system first, ends on a request): user turns, 0–2 tool
    rounds each with results of ``words`` words (JSON rows, log lines or code), assistant answers."""
    rng = random.Random(seed)
    out: Messages = [{"role": "system", "content": "You are an on-call SRE assistant. " * 8}]
    call = 0
    while len(out) < messages:
        out.append({"role": "user", "content": _sentence(rng, rng.randrange(8, 60))})
        for _ in range(rng.randrange(0, 3)):
            call += 1
            call_id = f"call_{call:06d}"
            name = rng.choice(TOOLS)["function"]["name"]
            arguments = json.dumps({"query": _sentence(rng, 6)})
            function = {"name": name, "arguments": arguments}
            out.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": call_id, "type": "function", "function": function}],
                }
            )
            out.append({"role": "tool", "tool_call_id": call_id, "content": _tool_result(rng, rng.randrange(*words))})
        out.append({"role": "assistant", "content": _sentence(rng, rng.randrange(20, 120))})
    out = out[:messages]
    while out[-1]["role"] == "assistant":
        out.pop()
    return out


def requests(messages: Messages) -> list[int]:
    """Prefix lengths at which the app calls the model (after a user message or the last tool result)."""
    ends = []
    for i in range(1, len(messages)):
        nxt = messages[i + 1]["role"] if i + 1 < len(messages) else "user"
        if messages[i]["role"] in ("user", "tool") and nxt != "tool":
            ends.append(i + 1)
    return ends


# --- measuring ------------------------------------------------------------------------------------------------


class Server:
    """The token ids an OpenAI-compatible server (vLLM) makes of a list of OpenAI dicts."""

    def __init__(self, tokenizer: Any, source: str) -> None:
        self.tokenizer, self.source = tokenizer, source

    def ids(self, messages: Messages) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            server_dicts(messages),
            tools=TOOLS,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
            chat_template=self.source,
        )
        return list(ids)


def shared(a: list[int], b: list[int]) -> int:
    limit = min(len(a), len(b))
    return next((i for i in range(limit) if a[i] != b[i]), limit)


@dataclass
class Series:
    """One method over the turns of one case."""

    template: str
    context: int
    method: str
    kept: list[float] = field(default_factory=list)
    prefill: list[int] = field(default_factory=list)
    new: list[int] = field(default_factory=list)
    use: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None

    def summary(self) -> dict[str, Any]:
        if not self.kept:
            return {"template": self.template, "context": self.context, "method": self.method, "error": self.error}
        kept = sorted(self.kept)
        prefill, new = statistics.mean(self.prefill), statistics.mean(self.new)
        reused = [t - p for t, p in zip(self.tokens, self.prefill, strict=True)]
        cost = statistics.mean(p + CACHED_PRICE * r for p, r in zip(self.prefill, reused, strict=True))
        return {
            "template": self.template,
            "context": self.context,
            "method": self.method,
            "turns": len(kept),
            "kept": statistics.mean(kept),
            "p10": kept[len(kept) // 10],
            "below_half": sum(k < 0.5 for k in kept),
            "prefill": prefill,
            "new": new,
            "ratio": sum(self.prefill) / max(1, sum(self.new)),
            "use": statistics.mean(self.use),
            "cost": cost,
            "seconds": self.seconds,
        }


def meets(row: dict[str, Any]) -> dict[str, bool]:
    return {
        "kept": row["kept"] >= GOALS["kept"],
        "p10": row["p10"] >= GOALS["p10"],
        "ratio": row["ratio"] <= GOALS["ratio"],
        "use": row["use"] >= GOALS["use"],
    }


def keeper_method(tokenizer_path: str, source: str, context: int, policy: Policy) -> Callable[[Messages], Messages]:
    keeper = ck.ContextKeeper(tokenizer=tokenizer_path, chat_template=source, context_window=context, policy=policy)
    answer = dict(BUDGETS)[context]

    def run(messages: Messages) -> Messages:
        fit = keeper.fit(messages, tools=TOOLS, max_tokens=answer)
        return [m if isinstance(m, dict) else m.to_dict() for m in fit.messages]

    return run


def keeper_series(
    tokenizer_path: str, source: str, context: int, policy: Policy, messages: Messages, stops: list[int], new: list[int]
) -> Series:
    """The sweep's series: the keeper's own exact prefix (``fit.report.prefix_tokens``)."""
    keeper = ck.ContextKeeper(tokenizer=tokenizer_path, chat_template=source, context_window=context, policy=policy)
    answer = dict(BUDGETS)[context]
    series = Series("", context, policy.name)
    previous: int | None = None
    started = time.perf_counter()
    for turn, stop in enumerate(stops):
        fit = keeper.fit(messages[:stop], tools=TOOLS, max_tokens=answer)
        prefix = fit.report.prefix_tokens
        assert prefix is not None
        if previous is not None:
            series.kept.append(prefix / previous)
            series.prefill.append(fit.tokens - prefix)
            series.tokens.append(fit.tokens)
            series.new.append(new[turn])
            series.use.append(fit.tokens / (context - answer))
        previous = fit.tokens
    series.seconds = time.perf_counter() - started
    return series


def langchain_method(tokenizer: Any, source: str, context: int) -> Callable[[Messages], Messages] | str:
    try:
        from langchain_core.messages import convert_to_messages, convert_to_openai_messages, trim_messages
    except ImportError as exc:
        return f"langchain-core not importable ({exc})"
    budget = context - dict(BUDGETS)[context]

    def ids(dicts: Messages) -> int:
        found = tokenizer.apply_chat_template(
            dicts, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False, chat_template=source
        )
        return len(found)

    def exact(msgs: list[Any]) -> int:
        # As the server will count them (its preprocessing: Gemma's template refuses a None content, say).
        dicts = server_dicts(convert_to_openai_messages(msgs))
        try:
            return ids(dicts)
        except Exception:
            # trim_messages(strategy="last") hands its counter partial lists in reverse order (a tool result
            # before its call), which templates that read the order refuse (Llama 3's needs a user message first
            # for its tools, Gemma 4's a call before each result): those are counted in conversation order, from
            # their first message that is not a tool result, after an empty user message.
            rest = list(itertools.dropwhile(lambda m: m["role"] == "tool", reversed(dicts)))
            return ids([{"role": "user", "content": ""}, *rest])

    def run(messages: Messages) -> Messages:
        # trim_messages counts the whole list it is given, many times over: give it the system prompt and a tail
        # long enough to hold more than fits (8 characters per budget token), doubled until the cut falls inside
        # it, so the result is the one the whole list gives.
        chars = 8 * budget
        while True:
            size, start = 0, len(messages)
            while start > 1 and size < chars:
                start -= 1
                size += len(str(messages[start].get("content") or ""))
            held = convert_to_messages(messages[:1] + messages[start:])
            out = trim_messages(
                held, max_tokens=budget, token_counter=exact, strategy="last", start_on="human", include_system=True
            )
            if start <= 1 or len(out) < len(held) - 1 or chars > 64 * budget:
                return list(convert_to_openai_messages(out))
            chars *= 2

    return run


def measured_series(
    label: str,
    context: int,
    name: str,
    run: Callable[[Messages], Messages],
    server: Server,
    messages: Messages,
    stops: list[int],
    new: list[int],
) -> Series:
    answer = dict(BUDGETS)[context]
    series = Series(label, context, name)
    previous: list[int] | None = None
    started = time.perf_counter()
    try:
        for turn, stop in enumerate(stops):
            ids = server.ids(run(messages[:stop]))
            if previous is not None:
                prefix = shared(ids, previous)
                series.kept.append(prefix / len(previous))
                series.prefill.append(len(ids) - prefix)
                series.tokens.append(len(ids))
                series.new.append(new[turn])
                series.use.append(len(ids) / (context - answer))
            previous = ids
    except Exception as exc:  # a method may fail on a case: say so in the table
        series.error = f"{type(exc).__name__}: {exc}"[:200]
        print(f"{label} {context}: {name} raised {series.error}", file=sys.stderr)
    series.seconds = time.perf_counter() - started
    return series


def with_window(hysteresis: float | None) -> Policy:
    """The default pipeline, closed by a window with this hysteresis (None: today's default window)."""
    base = resolve_policy("default")
    if hysteresis is None:
        return base
    step = PolicyStep(strategy="sliding_window", hysteresis=hysteresis, cached_price=CACHED_PRICE)
    return Policy(name=f"default + hysteresis {hysteresis:g}", steps=(*base.steps, step))


def run_case(label: str, template_name: str, vocab: str, args: argparse.Namespace) -> tuple[list[Series], list[Series]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir(vocab))
    source = template(template_name)
    path = str(tokenizer_dir(vocab))
    messages = chat(args.messages)
    stops = requests(messages)[-(args.turns + 1) :]
    # The new messages' tokens per call: what the untrimmed chat grew by (contextkeeper's exact count).
    counter = ck.ContextKeeper(tokenizer=path, chat_template=source, context_window=10**8).counter
    grown = [counter.count(messages[:stop], tools=TOOLS) for stop in stops]
    new = [0, *(b - a for a, b in itertools.pairwise(grown))]
    server = Server(tokenizer, source)
    main: list[Series] = []
    sweep: list[Series] = []
    for context, _ in BUDGETS:
        methods: list[tuple[str, Callable[[Messages], Messages] | str]] = [
            ("contextkeeper default", keeper_method(path, source, context, with_window(None))),
            (
                f"contextkeeper cache-aware (hysteresis {HYSTERESIS:g})",
                keeper_method(path, source, context, with_window(HYSTERESIS)),
            ),
            ('contextkeeper policy="agent"', keeper_method(path, source, context, resolve_policy("agent"))),
            (
                "LangChain trim_messages",
                langchain_method(tokenizer, source, context) if (label, context) not in SLOW else SLOW[label, context],
            ),
        ]
        for name, run in methods:
            if isinstance(run, str):
                main.append(Series(label, context, name, error=run))
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                series = measured_series(label, context, name, run, server, messages, stops, new)
            main.append(series)
            print(f"{label} {context}: {name}: {series.seconds:.1f} s", file=sys.stderr)
        if label == CASES[0][0] and not args.no_sweep:
            for hysteresis in SWEEP:
                series = keeper_series(path, source, context, with_window(hysteresis), messages, stops, new)
                series.template = label
                series.method = (
                    f"slack {SlidingWindow().slack:g} (default)" if hysteresis is None else f"hysteresis {hysteresis:g}"
                )
                sweep.append(series)
    return main, sweep


# --- reporting ------------------------------------------------------------------------------------------------


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def _mark(ok: bool) -> str:
    return "" if ok else " ✗"


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| template | context | method | prefix kept (mean) | p10 | turns < 50% | prefill / turn | new / turn "
        "| prefill ÷ new | history use | cost / turn |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        if "kept" not in row:
            lines.append(f"| {row['template']} | {row['context']:,} | {row['method']} | {row.get('error')} |||||||")
            continue
        ok = meets(row)
        lines.append(
            f"| {row['template']} | {row['context']:,} | {row['method']} | {_pct(row['kept'])}{_mark(ok['kept'])} "
            f"| {_pct(row['p10'])}{_mark(ok['p10'])} | {row['below_half']} of {row['turns']} | {row['prefill']:,.0f} "
            f"| {row['new']:,.0f} | {row['ratio']:.2f}{_mark(ok['ratio'])} | {_pct(row['use'])}{_mark(ok['use'])} "
            f"| {row['cost']:,.0f} |"
        )
    return lines


def sweep_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| context | window | prefix kept (mean) | p10 | prefill ÷ new | history use | cost / turn | goals met |",
        "|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        ok = meets(row)
        met = ", ".join(name for name, good in ok.items() if good) or "none"
        lines.append(
            f"| {row['context']:,} | {row['method']} | {_pct(row['kept'])} | {_pct(row['p10'])} | {row['ratio']:.2f} "
            f"| {_pct(row['use'])} | {row['cost']:,.0f} | {met} |"
        )
    return lines


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


DESCRIPTION = """\
Long agent chats (`bench_prefix.chat`: user turns, 0–2 tool rounds each with results of 30–300 words of JSON
rows, logs or code, assistant answers, five tool schemas; a model call adds {new} tokens on average) fitted at
each of {turns} consecutive model calls deep into the chat, to 4,096-, 8,192- and 32,768-token contexts (512,
1,024 and 2,048 tokens kept for the answer), through real templates and vocabularies. Each prompt is tokenized
as an OpenAI-compatible server does (`apply_chat_template(..., tokenize=True)` on the OpenAI dicts, tools and
generation prompt). **Prefix kept**: the common prefix of a prompt's token ids and the previous prompt's, over the
previous prompt's length (mean over the calls, and its 10th percentile); **prefill**: the prompt's tokens beyond
that prefix; **new**: the tokens the untrimmed chat grew by; **history use**: prompt tokens over the prompt budget;
**cost**: prefill plus {price:g} × reused tokens per call (a reused token's cost beside a prefilled one on a
self-hosted server; hosted prompt caching bills about 0.1). Goals:
prefix kept ≥ 95%, p10 ≥ 80%, prefill ≤ 2 × new, history use ≥ 75%; ✗ marks a goal missed.

* contextkeeper default: `policy="default"` (its window leaves {slack:.0%} of the budget free after a cut);
* contextkeeper cache-aware: the same steps closed by `[[steps]] strategy = "sliding_window"`,
  `hysteresis = {h:g}`, `cached_price = {price:g}` (cut to {low:.0%} of the budget, append until it is full);
* contextkeeper `policy="agent"` (strategies/agent.toml: pruning at 80% of the budget in large batches,
  dedupe over the budget, a cache-aware window with `hysteresis = 0.4`);
* LangChain `trim_messages(strategy="last", start_on="human", include_system=True)`, exact template counter (the
  server's ids; `strategy="last"` hands the counter partial lists in reverse order, which Llama 3's and Gemma 4's
  templates refuse: those are counted in order, from their first message that is not a tool result, after an
  empty user message)."""


CURVE = """\
Reading the curve. A window that drops the oldest turns breaks the prefix just after the system prompt and the
tools each time it cuts, so what counts is how often it cuts: once per `hysteresis × budget` tokens the history
grows. With the history growing `g` tokens a call, a cut leaving `L` of the budget `B` and the next one at `H`:
prefix kept ≈ 1 − (1 − s)·g / ((H − L)·B) (`s`: the share of the system prompt and tools), prefill ≈ new +
g·L / (H − L), history use ≈ (H + L) / 2. Use ≥ 75% with `H = 1` needs `L ≥ 0.5`, and prefill ≤ 2 × new then
needs `L ≤ 0.5` where the history grows by what the call adds (pruning makes it grow by less, which is why the
measured ratios are lower); at `L = 0.5` the mean prefix kept reaches 95% only for budgets of about 40 × g or
more. So on these chats every goal is met at 32K; at 8K the prefix kept stays a point or two short of 95% at
≥ 75% use, and at 4K a cut every few calls puts the 10th percentile at the cut turns. More hysteresis buys prefix
and prefill for history: the rows above show the exchange, and the cost column (prefill plus reused tokens at
their price) falls all the way down the table. The default window (`slack`, {slack:.0%}) cuts on most calls once the
chat is full at 4K and 8K, and each of its cuts re-prefills nearly the whole budget.

A bound no trimming escapes. A prompt shares with the previous one only what comes before its first change, so a
call can take out at most the previous prompt's tokens after that point: at most (1 − kept) × `B` of them. Once
the chat is full, the calls must take out on average what each adds (`g` tokens, after any shortening of the new
messages themselves), so the mean prefix kept is at most 1 − g/B, whatever the strategy. On these chats `g` is
218–243 tokens: at 4,096 (`B` = 3,584) the bound is 93.2–93.9%, under the 95% goal for every method; at 8,192
(`B` = 7,168) it is 96.6–97.0%, and a window, which cuts right after the system prompt and the tools, keeps
94–95% there at about 75% history use."""


def reading(main: list[dict[str, Any]], sweep: list[dict[str, Any]]) -> list[str]:
    lines = []
    by = {(r["template"], r["context"], r["method"].split(" (")[0]): r for r in main if "kept" in r}
    for (template_name, context, method), row in sorted(by.items()):
        if method != "contextkeeper cache-aware":
            continue
        ok = meets(row)
        missed = [name for name, good in ok.items() if not good]
        peer = by.get((template_name, context, "LangChain trim_messages"))
        lines.append(
            f"* {template_name}, {context:,}: cache-aware keeps {_pct(row['kept'])} of the previous prompt "
            f"(default {_pct(by[template_name, context, 'contextkeeper default']['kept'])}, LangChain "
            f"{_pct(peer['kept']) if peer else 'not run'}); "
            + ("every goal met." if not missed else f"missed: {', '.join(missed)}.")
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=300, help="model calls measured per case")
    parser.add_argument("--messages", type=int, default=1500, help="messages in the chat")
    parser.add_argument("--quick", action="store_true", help="smoke run: 20 calls, first template only")
    parser.add_argument("--no-sweep", action="store_true", help="skip the hysteresis sweep")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs and results alone")
    args = parser.parse_args()
    cases = CASES
    if args.quick:
        args.turns, cases = 20, CASES[:1]
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    main_series: list[Series] = []
    sweep_series: list[Series] = []
    for case in cases:
        got, swept = run_case(*case, args=args)
        main_series += got
        sweep_series += swept
    rows = [s.summary() for s in main_series]
    swept_rows = [s.summary() for s in sweep_series]
    results = {"main": rows, "sweep": swept_rows}
    print(json.dumps(results, indent=1))
    env = (
        f"Python {platform.python_version()}, transformers {_version('transformers')}, langchain-core "
        f"{_version('langchain-core')}, {platform.machine()}, {os.cpu_count()} CPUs, load average {load_before:.1f} at "
        f"the start and {os.getloadavg()[0]:.1f} at the end, {time.perf_counter() - started:.0f} s"
    )
    flags = [f"--turns {args.turns}"] if args.turns != 300 else []
    command = " ".join(["python benchmarks/bench_prefix.py", *flags])
    new = statistics.mean(r["new"] for r in rows if "new" in r) if rows else 0
    lines = [
        "<!-- prefix:start -->",
        DESCRIPTION.format(
            new=f"{new:,.0f}",
            turns=args.turns,
            price=CACHED_PRICE,
            h=HYSTERESIS,
            low=1 - HYSTERESIS,
            slack=SlidingWindow().slack,
        ),
        "",
        f"Command: `{command}` — {env}.",
        "",
        *table(rows),
        "",
        *reading(rows, swept_rows),
        "",
        "The trade-off (Qwen3, contextkeeper's own `fit.report.prefix_tokens`; the window's hysteresis is the share of",
        "the budget freed by a cut):",
        "",
        *sweep_table(swept_rows),
        "",
        CURVE.format(slack=SlidingWindow().slack),
        "<!-- prefix:end -->",
    ]
    block = "\n".join(lines)
    print(block)
    if not args.no_write:
        write_section("prefix", block, heading="## Keeping the prompt's prefix: prefix caches and trimming")
        out = ROOT / "benchmarks" / "results" / "prefix.json"
        out.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    print(f"total {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
