"""Fit benchmark against peers: the 2,000-message agent conversation fitted to a 32,768-token context.

The conversation of ``bench_counting.py`` (~600K tokens, five tool schemas) must fit a 32,768-token context with
2,048 tokens kept for the answer, through real chat templates (Qwen3 and Llama 3.3). Measured side by side, in
one run: contextkeeper's ``ContextKeeper.fit`` (cold, and per turn with the same keeper), LangChain's
``trim_messages`` (with an exact chat-template counter, and with the common per-message content counter),
LlamaIndex's ``ChatMemoryBuffer`` (on the last messages only: it recounts the whole window for every message
it drops) and LiteLLM's ``trim_messages``. Each result is converted back to OpenAI dicts and recounted the way
an OpenAI-compatible server (vLLM) renders it: the template with the tools and the generation prompt. It fits
when that count plus the answer tokens is at most the context window; "history use" compares it with the
longest suffix of whole turns (from a user message, system prompt kept) that fits, found by exact search.
Writes the results to docs/benchmarks.md (between markers) and prints them.

    python benchmarks/bench_fit.py [--turns 30] [--peer-turns 2] [--llamaindex-messages 300] [--quick] [--no-write]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]
# LiteLLM fetches its model price map from the network at import unless told to use the bundled copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from agent_conversation import TOOLS, build  # noqa: E402
from report import write_section  # noqa: E402

import contextkeeper as ck  # noqa: E402
from assets import template, tokenizer_dir  # noqa: E402

CONTEXT_WINDOW = 32_768
ANSWER_TOKENS = 2_048
BUDGET = CONTEXT_WINDOW - ANSWER_TOKENS  # what the prompt may use: 30,720
LITELLM_MODEL = "gpt-3.5-turbo"

CASES = [
    ("Qwen3-0.6B", "Qwen-Qwen3-0.6B", "qwen2"),
    ("Llama-3.3-70B-Instruct", "meta-llama-Llama-3.3-70B-Instruct", "llama-bpe"),
]

Messages = list[dict[str, Any]]


# --- the conversation ---------------------------------------------------------------------------------------


def _requests(messages: Messages, start: int) -> list[int]:
    """Prefix lengths at which the app calls the model (after a user message or the last tool result)."""
    ends = []
    for i in range(start, len(messages)):
        nxt = messages[i + 1]["role"] if i + 1 < len(messages) else "user"
        if messages[i]["role"] in ("user", "tool") and nxt != "tool":
            ends.append(i + 1)
    return ends


# --- the truth: what the server renders -----------------------------------------------------------------


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return {}
    return value if value is not None else {}


def server_dicts(messages: Messages, content_format: str = "string") -> Messages:
    """The messages as an OpenAI-compatible server (vLLM) hands them to the template.

    Written here, independently of contextkeeper, and without any validation (peers may return tool results
    without their call, which a server still renders): text content as one string (None -> ""), tool-call
    arguments parsed to objects, only the keys the server reads. With ``content_format="openai"`` (templates
    that loop over a message's content) the text is one ``{"type": "text"}`` part (None -> no parts), except a
    tool result's, which stays a string.
    """
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = "\n".join(
                part.get("text") or "" for part in content if isinstance(part, dict) and part.get("type") == "text"
            )
        text = content if isinstance(content, str) else ""
        body: str | list[dict[str, str]] = text
        if content_format == "openai" and message["role"] != "tool":
            body = [{"type": "text", "text": text}] if text or content is not None else []
        data: dict[str, Any] = {"role": message["role"], "content": body}
        for key in ("name", "tool_call_id"):
            if message.get(key) is not None:
                data[key] = message[key]
        if message.get("tool_calls"):
            data["tool_calls"] = [
                {
                    "id": call.get("id"),
                    "type": "function",
                    "function": {
                        "name": call["function"]["name"],
                        "arguments": _arguments(call["function"].get("arguments")),
                    },
                }
                for call in message["tool_calls"]
            ]
        out.append(data)
    return out


class Truth:
    """Exact prompt tokens of a list of OpenAI dicts: the real template, the tools, the generation prompt."""

    def __init__(self, tokenizer: Any, source: str | None, content_format: str = "string") -> None:
        self.tokenizer = tokenizer
        self.source = source
        self.content_format = content_format
        self._best: dict[tuple[int, int], tuple[int, int] | None] = {}

    def best(self, messages: Messages, start: int, stop: int) -> tuple[int, int] | None:
        """:meth:`best_suffix` of ``messages[:1] + messages[start:stop]``, remembered."""
        if (start, stop) not in self._best:
            self._best[start, stop] = self.best_suffix(messages[:1] + messages[start:stop])
        return self._best[start, stop]

    def count(self, messages: Messages) -> int:
        ids = self.tokenizer.apply_chat_template(
            server_dicts(messages, self.content_format),
            tools=TOOLS,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
            chat_template=self.source,
        )
        return len(ids)

    def best_suffix(self, messages: Messages) -> tuple[int, int] | None:
        """(messages, tokens) of the longest [system] + messages[i:] with messages[i] a user turn that fits.

        Galloping from the end, then bisection: exact as long as dropping whole turns never adds tokens.
        """
        starts = [i for i in range(1, len(messages)) if messages[i]["role"] == "user"]
        cache: dict[int, int] = {}

        def tokens(k: int) -> int:
            if k not in cache:
                cache[k] = self.count(messages[:1] + messages[starts[k] :])
            return cache[k]

        if not starts or tokens(len(starts) - 1) > BUDGET:
            return None
        good, step, bad = len(starts) - 1, 1, None
        while bad is None and good > 0:
            candidate = max(good - step, 0)
            if tokens(candidate) <= BUDGET:
                good, step = candidate, step * 2
            else:
                bad = candidate
        if bad is not None:
            while good - bad > 1:
                mid = (good + bad) // 2
                if tokens(mid) <= BUDGET:
                    good = mid
                else:
                    bad = mid
        return 1 + len(messages) - starts[good], tokens(good)


def well_formed(messages: Messages) -> str:
    """Say "yes", or what is wrong: contextkeeper's own pairing checks, or a first turn that is not a user's."""
    rest = [m for m in messages if m["role"] != "system"]
    if rest and rest[0]["role"] != "user":
        return f"no: starts with {rest[0]['role']}"
    try:
        ck.Conversation.from_messages(messages)
    except ck.ContextKeeperError as exc:
        return f"no: {type(exc).__name__}"
    return "yes"


def _key(message: dict[str, Any]) -> str:
    return json.dumps(server_dicts([message])[0], sort_keys=True)


# --- the methods ----------------------------------------------------------------------------------------------


@dataclass
class Call:
    """One call of a method: its output as OpenAI dicts, and what the method itself counted for it."""

    messages: Messages
    own_tokens: int | None
    seconds: float


@dataclass
class Method:
    name: str
    input_note: str
    # window(stop) -> (first message index of the input, after the system prompt). 1 = the whole conversation.
    window_start: Callable[[int], int]
    # run(stop) -> Call for messages[:stop] (stateful methods keep their state between calls).
    run: Callable[[int], Call]
    # reset() -> fresh state (a cold call follows).
    reset: Callable[[], None] = lambda: None
    state: dict[str, Any] = field(default_factory=dict)


@dataclass
class Row:
    template: str
    method: str
    input: str = ""
    skipped: str | None = None
    error: str | None = None
    input_messages: int | None = None
    cold_s: float | None = None
    per_turn_p50_ms: float | None = None
    per_turn_calls: int = 0
    per_turn_range_ms: list[float] = field(default_factory=list)
    kept_messages: int | None = None
    true_tokens: int | None = None
    own_tokens: int | None = None
    fits: bool | None = None
    fits_calls: str = ""
    best_messages: int | None = None
    best_tokens: int | None = None
    history_use: float | None = None
    edited: int | None = None
    well_formed: str = ""
    notes: list[str] = field(default_factory=list)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            b if isinstance(b, str) else (b.get("text") or "") for b in content if isinstance(b, (str, dict))
        )
    return ""


def contextkeeper_methods(tokenizer: str, source: str | None, messages: Messages) -> list[Method] | str:
    """The keeper on ``tokenizer`` (a tokenizer folder or ``mistral:<name>``) with ``source`` as its template."""
    keeper_class = getattr(ck, "ContextKeeper", None)
    if keeper_class is None:
        return "contextkeeper.ContextKeeper is not available in this checkout"
    state: dict[str, Any] = {}

    def make() -> Any:
        return keeper_class(tokenizer=tokenizer, chat_template=source, context_window=CONTEXT_WINDOW, policy="default")

    def reset() -> None:
        t0 = time.perf_counter()
        state["keeper"] = make()
        state["build_s"] = time.perf_counter() - t0

    def run(stop: int) -> Call:
        t0 = time.perf_counter()
        fit = state["keeper"].fit(messages[:stop], tools=TOOLS, max_tokens=ANSWER_TOKENS)
        seconds = time.perf_counter() - t0
        # The report's slots are counted when first read (no fit decision needs them): timed apart.
        t1 = time.perf_counter()
        _ = fit.report.slots
        state.setdefault("slots_s", []).append(time.perf_counter() - t1)
        out = [m.to_dict() if hasattr(m, "to_dict") else dict(m) for m in fit.messages]
        return Call(out, int(fit.tokens), seconds)

    return [Method("contextkeeper `ContextKeeper.fit`", "whole", lambda stop: 1, run, reset, state)]


def langchain_methods(tokenizer: Any, source: str | None, messages: Messages, last_stop: int) -> list[Method] | str:
    try:
        from langchain_core.messages import convert_to_messages, convert_to_openai_messages, trim_messages
    except ImportError as exc:
        return f"langchain-core not importable ({exc})"
    held = convert_to_messages(messages[:last_stop])  # an app using LangChain holds its history as messages

    def exact(msgs: list[Any]) -> int:
        dicts = convert_to_openai_messages(msgs)
        return len(
            tokenizer.apply_chat_template(
                dicts, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False, chat_template=source
            )
        )

    def per_message(msgs: list[Any]) -> int:
        return sum(len(tokenizer.encode(_text(m.content), add_special_tokens=False)) for m in msgs)

    def make(counter: Callable[[list[Any]], int], own: Callable[[list[Any]], int]) -> Callable[[int], Call]:
        def run(stop: int) -> Call:
            t0 = time.perf_counter()
            out = trim_messages(
                held[:stop],
                max_tokens=BUDGET,
                token_counter=counter,
                strategy="last",
                start_on="human",
                include_system=True,
            )
            seconds = time.perf_counter() - t0
            return Call(convert_to_openai_messages(out), own(out), seconds)

        return run

    def own_exact(out: list[Any]) -> int:
        # What trim_messages believed: the system prompt counted alone, plus the rest as it counts it (reversed).
        return exact(out[:1]) + exact(out[1:][::-1])

    return [
        Method("LangChain `trim_messages`, template counter", "whole", lambda stop: 1, make(exact, own_exact)),
        Method(
            "LangChain `trim_messages`, per-message counter", "whole", lambda stop: 1, make(per_message, per_message)
        ),
    ]


def llamaindex_methods(tokenizer: Any, messages: Messages, window: int) -> list[Method] | str:
    try:
        from llama_index.core.base.llms.types import ChatMessage
        from llama_index.core.memory import ChatMemoryBuffer
    except ImportError as exc:
        return f"llama-index-core not importable ({exc})"

    def tokenizer_fn(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    def to_llama(message: dict[str, Any]) -> Any:
        extra = {key: message[key] for key in ("tool_calls", "tool_call_id") if message.get(key)}
        return ChatMessage(role=message["role"], content=message.get("content"), additional_kwargs=extra)

    def to_openai(message: Any) -> dict[str, Any]:
        return {"role": message.role.value, "content": message.content, **message.additional_kwargs}

    system = messages[0]
    system_tokens = len(tokenizer_fn(system["content"]))
    state: dict[str, Any] = {}

    def reset() -> None:
        state.clear()

    def run(stop: int) -> Call:
        t0 = time.perf_counter()
        if "memory" not in state:
            history = [to_llama(m) for m in messages[max(1, stop - window) : stop]]
            state["memory"] = ChatMemoryBuffer.from_defaults(
                chat_history=history, token_limit=BUDGET, tokenizer_fn=tokenizer_fn
            )
        else:
            for message in messages[state["stop"] : stop]:
                state["memory"].put(to_llama(message))
        state["stop"] = stop
        # The system prompt is the agent's, outside the memory; its tokens are passed as initial_token_count.
        kept = state["memory"].get(initial_token_count=system_tokens)
        seconds = time.perf_counter() - t0
        own = system_tokens + len(tokenizer_fn(" ".join(str(m.content) for m in kept)))
        return Call([dict(system)] + [to_openai(m) for m in kept], own, seconds)

    return [Method("LlamaIndex `ChatMemoryBuffer`", f"last {window}", lambda stop: max(1, stop - window), run, reset)]


def litellm_methods(messages: Messages, window: int = 0) -> list[Method] | str:
    """LiteLLM's ``trim_messages``, on the whole conversation or (``window``) the system prompt and the last
    ``window`` messages before each call."""
    try:
        import litellm
        from litellm.utils import trim_messages
    except ImportError as exc:
        return f"litellm not importable ({exc})"
    litellm.telemetry = False

    def start(stop: int) -> int:
        return max(1, stop - window) if window else 1

    def run(stop: int) -> Call:
        t0 = time.perf_counter()
        given = messages[:stop] if not window else messages[:1] + messages[start(stop) : stop]
        out = trim_messages(given, model=LITELLM_MODEL, max_tokens=BUDGET)
        seconds = time.perf_counter() - t0
        return Call(out, litellm.token_counter(model=LITELLM_MODEL, messages=out), seconds)

    note = f"last {window}" if window else "whole"
    return [Method(f"LiteLLM `trim_messages` ({LITELLM_MODEL})", note, start, run)]


# --- measuring ----------------------------------------------------------------------------------------------


def measure(
    label: str, method: Method, messages: Messages, truth: Truth, first: int, later: list[int], repeats: int
) -> Row:
    row = Row(label, method.name, input=method.input_note)
    start = method.window_start(first)
    source = messages[:1] + messages[start:first]
    row.input_messages = len(source)
    colds, series_runs, calls = [], [], []
    try:
        for _ in range(repeats):
            method.reset()
            # Garbage left by what ran before (the truth's counts, other methods) is collected first, for every
            # method alike: a collection the call's own allocations set off still lands in its time.
            gc.collect()
            cold = method.run(first)
            colds.append(cold.seconds)
            series = []
            for stop in later:
                call = method.run(stop)
                series.append(call.seconds * 1000)
                calls.append((stop, call))
            series_runs.append(series)
    except Exception as exc:  # e.g. a template the method's counter renders rejects what it is given
        row.error = f"{type(exc).__name__}: {exc}"
        print(f"{label}: {method.name} raised {row.error}", file=sys.stderr)
        return row
    row.cold_s = round(statistics.median(colds), 3)
    if later:
        p50s = sorted(statistics.median(s) for s in series_runs)
        row.per_turn_p50_ms = round(statistics.median(p50s), 1)
        row.per_turn_range_ms = [round(p50s[0], 1), round(p50s[-1], 1)]
        row.per_turn_calls = len(later)
    build_s = method.state.get("build_s")
    if build_s is not None:
        row.notes.append(f"keeper built in {build_s:.2f} s (tokenizer loaded, template compiled; not part of cold)")
    slots_s = method.state.get("slots_s")
    if slots_s:
        row.notes.append(
            f"reading `fit.report.slots` (counted on first read) took {statistics.median(slots_s) * 1000:.1f} ms "
            "more per fit (median; not part of the fit times)"
        )

    # The cold call's output (deterministic across repeats), in full; every per-turn output checked for fit.
    out = cold.messages
    row.kept_messages = len(out)
    row.own_tokens = cold.own_tokens
    try:
        row.true_tokens = truth.count(out)
    except Exception as exc:  # a template may reject what a peer returns
        row.well_formed = f"template error: {type(exc).__name__}: {exc}"[:120]
        row.fits = False
        return row
    row.fits = row.true_tokens + ANSWER_TOKENS <= CONTEXT_WINDOW
    checked, fitting = 1, int(row.fits)
    seen: set[int] = set()
    for stop, call in calls:
        if stop in seen:
            continue
        seen.add(stop)
        checked += 1
        with contextlib.suppress(Exception):  # a template error counts as not fitting
            fitting += truth.count(call.messages) <= BUDGET
    row.fits_calls = f"{fitting}/{checked}"
    best = truth.best(messages, start, first)
    if best is not None:
        row.best_messages, row.best_tokens = best
        if row.fits:
            row.history_use = round(row.true_tokens / row.best_tokens, 3)
    originals = {_key(m) for m in source}
    row.edited = sum(_key(m) not in originals for m in out)
    row.well_formed = well_formed(out)
    return row


def run_case(label: str, template_name: str, vocab: str, args: argparse.Namespace) -> list[Row]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir(vocab))
    source = template(template_name)
    messages = build(2600)
    stops = _requests(messages, 2000)
    first = stops[0]
    truth = Truth(tokenizer, source)

    # The truth agrees with contextkeeper's exact counter on the best suffix (a cross-check of server_dicts).
    best = truth.best(messages, 1, first)
    assert best is not None
    counter = ck.HFChatTemplateCounter(tokenizer, chat_template=source, name=label)
    suffix = messages[:1] + messages[first - best[0] + 1 : first]
    if counter.count(suffix, tools=TOOLS) != best[1]:
        print(f"WARNING: {label}: HFChatTemplateCounter and the recount disagree on the best suffix", file=sys.stderr)

    groups: list[tuple[str, list[Method] | str, int, int]] = [
        ("contextkeeper", contextkeeper_methods(str(tokenizer_dir(vocab)), source, messages), args.turns, args.repeats),
        ("LangChain", langchain_methods(tokenizer, source, messages, stops[args.peer_turns]), args.peer_turns, 1),
        ("LlamaIndex", llamaindex_methods(tokenizer, messages, args.llamaindex_messages), args.peer_turns, 1),
        ("LiteLLM", litellm_methods(messages), args.peer_turns, 1),
    ]
    rows = []
    for group, methods, turns, repeats in groups:
        if isinstance(methods, str):
            print(f"NOTICE: {label}: skipping {group}: {methods}", file=sys.stderr)
            rows.append(Row(label, group, skipped=methods))
            continue
        for method in methods:
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                row = measure(label, method, messages, truth, first, stops[1 : turns + 1], repeats)
            print(
                f"{label}: {method.name}: cold {_ms(row.cold_s)}, {time.perf_counter() - t0:.1f} s with checks",
                file=sys.stderr,
            )
            rows.append(row)
    return rows


# --- reporting ------------------------------------------------------------------------------------------------


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1000:.0f} ms"


def table(rows: list[Row]) -> list[str]:
    lines = [
        "| template | method | input msgs | cold | per turn p50 (turns) | kept msgs | true tokens | own count "
        "| fits | history use | edited msgs | well-formed |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---|",
    ]
    for r in rows:
        if r.skipped:
            lines.append(f"| {r.template} | {r.method} | — | — | — | — | — | — | skipped: {r.skipped} | — | — | — |")
            continue
        if r.error:
            cells = f"| {r.template} | {r.method} | {r.input_messages:,} |"
            lines.append(cells + f" — | — | — | — | — | raised {r.error} | — | — | — |")
            continue
        window = "" if r.input == "whole" else f" ({r.input})"
        per_turn = "—"
        if r.per_turn_p50_ms is not None:
            per_turn = f"{_ms(r.per_turn_p50_ms / 1000)} ({r.per_turn_calls})"
        true = f"{r.true_tokens:,}" if r.true_tokens is not None else "—"
        own = f"{r.own_tokens:,}" if r.own_tokens is not None else "—"
        if r.true_tokens is None:
            fits = "—"
        elif r.fits:
            fits = "yes" if r.fits_calls.split("/")[0] == r.fits_calls.split("/")[1] else f"cold yes, {r.fits_calls}"
        else:
            fits = f"**NO** (+{r.true_tokens - BUDGET:,})"
            if r.fits_calls and r.fits_calls != "0/1":
                fits += f", {r.fits_calls} calls fit"
        use = f"{r.history_use:.1%}" if r.history_use is not None else "—"
        edited = str(r.edited) if r.edited is not None else "—"
        lines.append(
            f"| {r.template} | {r.method} | {r.input_messages:,}{window} | {_ms(r.cold_s)} | {per_turn} "
            f"| {r.kept_messages} | {true} | {own} | {fits} | {use} | {edited} | {r.well_formed} |"
        )
    return lines


def reading(rows: list[Row]) -> list[str]:
    out = []
    for label in dict.fromkeys(r.template for r in rows):
        mine = [r for r in rows if r.template == label and not r.skipped and r.true_tokens is not None]
        whole = next((r for r in mine if r.input == "whole" and r.best_tokens), None)
        if whole is None:
            continue
        parts = [
            f"**{label}**: the longest whole-turn suffix that fits is {whole.best_messages} messages, "
            f"{whole.best_tokens:,} tokens (of {BUDGET:,} allowed)."
        ]
        over = [r for r in mine if not r.fits]
        if over:
            parts.append(
                "Over the context: "
                + "; ".join(
                    f"{r.method} by {r.true_tokens - BUDGET:,} tokens (it counted {r.own_tokens:,})"
                    if r.own_tokens is not None
                    else f"{r.method} by {r.true_tokens - BUDGET:,} tokens"
                    for r in over
                )
                + "."
            )
        fitting = [r for r in mine if r.fits and r.history_use is not None]
        if fitting:
            parts.append(
                "Fitting: "
                + "; ".join(
                    f"{r.method} uses {r.history_use:.1%} of that suffix in {_ms(r.cold_s)}"
                    + (" (its own count exact)" if r.own_tokens == r.true_tokens else f" (it counted {r.own_tokens:,})")
                    for r in fitting
                )
                + "."
            )
        odd = [r for r in mine if r.well_formed != "yes"]
        if odd:
            parts.append("Not well-formed: " + "; ".join(f"{r.method} ({r.well_formed})" for r in odd) + ".")
        noted = [r for r in rows if r.template == label and r.notes]
        if noted:
            parts.append(" ".join(f"{r.method}: {'; '.join(r.notes)}." for r in noted))
        failed = [r for r in rows if r.template == label and r.error]
        if failed:
            parts.append("Raised: " + "; ".join(f"{r.method} (`{r.error}`)" for r in failed) + ".")
        out.append(" ".join(parts))
        out.append("")
    return out[:-1]


# Placeholders rather than an f-string: the text is wrapped for the values, not for their names.
DESCRIPTION = """\
The 2,000-message agent conversation of the counting benchmark (~600K tokens, five tool schemas), at the model
call after message 2,000, fitted to a {w:,}-token context with {a:,} tokens kept for the answer (at most
{b:,} prompt tokens), through real templates and vocabularies from the test assets. Each method's output is
converted back to OpenAI dicts and recounted as an OpenAI-compatible server renders it (the template with the
tools and the generation prompt): **true tokens**. It **fits** when true tokens + {a:,} ≤ {w:,}, checked on
the per-turn calls too ("a/b": how many checked calls fit). **History use** is true tokens over the longest
suffix of whole turns (from a user message, system prompt kept) that fits, found by exact search. **Own count**
is what the method itself counted for its output; **edited msgs** counts returned messages that are not one of
the input's (cut or rewritten); **well-formed**: every tool result follows its call and the history starts on a
user turn. Every method's cold call follows a full garbage collection, so none pays for what ran before it.

* contextkeeper: `ContextKeeper(tokenizer=..., chat_template=..., context_window={w}, policy="default")` and
  `fit(messages, tools=TOOLS, max_tokens={a})`: cold is a fresh keeper's first fit, per turn the same keeper
  fitting the conversation after each following model call;
* LangChain `trim_messages(strategy="last", start_on="human", include_system=True, max_tokens={b})` with a
  template counter (`len(tokenizer.apply_chat_template(openai_dicts, tools=TOOLS, add_generation_prompt=True,
  tokenize=True))`) and with a per-message counter (the sum of `tokenizer.encode(content)` lengths);
* LlamaIndex `ChatMemoryBuffer.from_defaults(token_limit={b}, tokenizer_fn=tokenizer.encode)`, the system
  prompt outside the memory and passed as `initial_token_count`; it recounts the whole window for every message
  it drops (quadratic), so it gets only the last messages;
* LiteLLM `trim_messages(model="{m}", max_tokens={b})` (it counts with that model's tokenizer and
  has no tools argument).

Peers keep no state between calls, so their per-turn time is that of another call (measured on a few turns);
LlamaIndex's per-turn calls `put` the new messages into the same memory and `get` again.""".format(  # noqa: UP032
    w=CONTEXT_WINDOW, a=ANSWER_TOKENS, b=BUDGET, m=LITELLM_MODEL
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=30, help="per-turn fits with contextkeeper's keeper")
    parser.add_argument("--peer-turns", type=int, default=2, help="per-turn calls of each peer")
    parser.add_argument("--repeats", type=int, default=3, help="contextkeeper runs (median reported)")
    parser.add_argument("--llamaindex-messages", type=int, default=300, help="LlamaIndex gets the last N messages")
    parser.add_argument("--quick", action="store_true", help="smoke run: --turns 5 --peer-turns 1 --repeats 1")
    parser.add_argument(
        "--template", action="append", choices=[case[0] for case in CASES], help="only these (repeatable)"
    )
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = parser.parse_args()
    if args.quick:
        args.turns, args.peer_turns, args.repeats = min(args.turns, 5), min(args.peer_turns, 1), 1
    started = time.perf_counter()
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    cases = [case for case in CASES if not args.template or case[0] in args.template]
    rows = [row for case in cases for row in run_case(*case, args=args)]
    print(json.dumps([asdict(r) for r in rows], indent=1))

    env = (
        f"Python {platform.python_version()}, transformers {_version('transformers')}, tokenizers "
        f"{_version('tokenizers')}, langchain-core {_version('langchain-core')}, llama-index-core "
        f"{_version('llama-index-core')}, litellm {_version('litellm')}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs"
    )
    if load_before is not None:
        # The machine may be shared: timings scale with the load (runnable processes per CPU).
        env += f", load average {load_before:.1f} at the start and {os.getloadavg()[0]:.1f} at the end"
    flags = []
    if args.turns != 30 or args.peer_turns != 2 or args.repeats != 3:
        flags.append(f"--turns {args.turns} --peer-turns {args.peer_turns} --repeats {args.repeats}")
    if args.template:
        flags.extend(f"--template {name}" for name in args.template)
    if args.llamaindex_messages != 300:
        flags.append(f"--llamaindex-messages {args.llamaindex_messages}")
    command = " ".join(["python benchmarks/bench_fit.py", *flags])
    lines = [
        "<!-- fit:start -->",
        DESCRIPTION,
        "",
        f"Command: `{command}` — {env}.",
        "",
        *table(rows),
        "",
        *reading(rows),
        "<!-- fit:end -->",
    ]
    block = "\n".join(lines)
    print(block)
    if not args.no_write:
        write_section("fit", block, heading="## Fitting a long conversation: contextkeeper vs peers")
    print(f"total {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
