"""The fit benchmark for every script, template and conversation count, against the goals.

The agent conversation of ``bench_fit.py`` (five tool schemas, tool results of up to a few thousand tokens), at
the model call after message 2,000, fitted to a 32,768-token context with 2,048 tokens kept for the answer:

* **scripts**: Qwen3's template and vocabulary, for the ASCII conversation and the same conversation written in
  each script of ``agent_conversation.SCRIPTS`` (Latin with diacritics, CJK, Cyrillic, Arabic, Devanagari, Greek,
  code, and six scripts mixed in one chat);
* **templates**: the mixed-script and the ASCII conversation through Llama 3.3, gpt-oss, Gemma 4, DeepSeek V3.1
  and Mistral's Tekken (mistral-common's own request encoding, the one vLLM uses for Mistral models);
* **many conversations**: 50 different conversations (every script, their own seeds, ~600 messages each)
  interleaved on one keeper with ``conversation=`` ids, and 8 threads fitting them on one keeper at once.

Each row is measured side by side with the peers of ``bench_fit.py`` and recounted the same way ("true
tokens", "fits", "history use"), next to the physical floor: one batch encode of the kept window's prompt
text and one plain render of its template. Writes the results as JSON to benchmarks/results/languages.json,
prints the markdown section, and with ``--write`` puts it in docs/benchmarks.md (between markers).

    python benchmarks/bench_languages.py [--rows PATTERN ...] [--no-peers] [--turns 20] [--quick] [--write]
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import os
import platform
import re
import shlex
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network fetch at LiteLLM's import

from agent_conversation import SCRIPTS, TOOLS, build, build_script, mistral_call_ids  # noqa: E402
from bench_fit import (  # noqa: E402
    ANSWER_TOKENS,
    BUDGET,
    CONTEXT_WINDOW,
    LITELLM_MODEL,
    Call,
    Method,
    Row,
    Truth,
    _ms,
    _requests,
    _version,
    contextkeeper_methods,
    langchain_methods,
    litellm_methods,
    llamaindex_methods,
    measure,
    server_dicts,
    table,
)
from bench_sessions import COLLECTIONS  # noqa: E402
from report import write_section  # noqa: E402

import contextkeeper as ck  # noqa: E402
from assets import template, tokenizer_dir  # noqa: E402
from contextkeeper.tokens.hf import detect_content_format  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "languages.json"
Messages = list[dict[str, Any]]

# The goals each row is held to.
GOAL_COLD_S = 0.080
GOAL_TURN_MS = 5.0
GOAL_VS_LANGCHAIN = 45.0
GOAL_HISTORY_USE = 0.95


# --- what is measured -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Model:
    key: str  # the first part of a row id
    label: str
    template: str | None  # a file in the assets' templates/; None: the tokenizer brings its own encoding
    vocab: str  # a tokenizer folder in the assets, or mistral:<name>

    @property
    def mistral(self) -> bool:
        return self.vocab.startswith("mistral:")


MODELS = {
    m.key: m
    for m in (
        Model("qwen3", "Qwen3-0.6B", "Qwen-Qwen3-0.6B", "qwen2"),
        Model("llama3.3", "Llama-3.3-70B-Instruct", "meta-llama-Llama-3.3-70B-Instruct", "llama-bpe"),
        Model("gpt-oss", "gpt-oss-120b", "openai-gpt-oss-120b", "harmony-on-qwen2"),
        Model("gemma4", "gemma-4-31B-it", "google-gemma-4-31B-it", "gemma-4"),
        Model("deepseek3.1", "DeepSeek-V3.1", "deepseek-ai-DeepSeek-V3.1", "deepseek-v4"),
        Model("tekken", "Mistral Tekken", None, "mistral:tekken"),
    )
}
CONVERSATIONS = ("ascii", *SCRIPTS)  # "ascii" is build(), the others build_script(name)


@dataclass(frozen=True)
class Case:
    group: str  # "scripts" or "templates"
    model: Model
    conversation: str

    @property
    def id(self) -> str:
        return f"{self.model.key}/{self.conversation}"


# Qwen3 on the mixed and the ASCII conversation are rows of both parts; they are measured once, as scripts.
CASES = [Case("scripts", MODELS["qwen3"], name) for name in CONVERSATIONS] + [
    Case("templates", model, name) for model in MODELS.values() if model.key != "qwen3" for name in ("mixed", "ascii")
]


def conversation(name: str, messages: int, seed: int = 7) -> Messages:
    return build(messages, seed=seed) if name == "ascii" else build_script(name, messages, seed=seed)


class MistralEncoding:
    """mistral-common's request encoding behind the two tokenizer calls the truth and the peers make.

    ``apply_chat_template`` encodes the messages as vLLM does for Mistral models: an OpenAI request through
    ``ChatCompletionRequest.from_openai`` and ``encode_chat_completion`` (tool-call ids cut to their last 9
    characters first, as vLLM does); ``encode`` is the Tekken tokenizer on a text alone.
    """

    def __init__(self, name: str) -> None:
        from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

        from contextkeeper.tokens.mistral import _resolve

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            self.tokenizer = MistralTokenizer.from_file(str(_resolve(name)))
        self.raw = self.tokenizer.instruct_tokenizer.tokenizer

    def apply_chat_template(self, messages: Messages, *, tools: Any = None, **_: Any) -> list[int]:
        from mistral_common.protocol.instruct.request import ChatCompletionRequest

        plain = []
        for message in messages:
            message = dict(message)
            if message.get("tool_calls"):
                message["tool_calls"] = [{**c, "id": str(c.get("id"))[-9:]} for c in message["tool_calls"]]
            if isinstance(message.get("tool_call_id"), str):
                message["tool_call_id"] = message["tool_call_id"][-9:]
            plain.append(message)
        request = ChatCompletionRequest.from_openai(messages=plain, tools=tools)
        return list(self.tokenizer.encode_chat_completion(request).tokens)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.raw.encode(text, bos=add_special_tokens, eos=False))


@dataclass
class Vocabulary:
    """A model's tokenizer (or Mistral encoding), template, content format and the keeper's tokenizer spec."""

    model: Model
    tokenizer: Any
    source: str | None
    content_format: str
    spec: str


def load(model: Model) -> Vocabulary:
    if model.mistral:
        return Vocabulary(model, MistralEncoding(model.vocab.split(":", 1)[1]), None, "string", model.vocab)
    from transformers import AutoTokenizer

    assert model.template is not None
    source = template(model.template)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir(model.vocab))
    # The content shape vLLM's "auto" picks for this template (a list of parts where it loops over content).
    return Vocabulary(model, tokenizer, source, detect_content_format(source), str(tokenizer_dir(model.vocab)))


# --- the physical floor ---------------------------------------------------------------------------------------


@dataclass
class Floor:
    encode_ms: float | None = None
    render_ms: float | None = None
    floor_ms: float | None = None
    pieces: int = 0
    what: str = ""
    check: str = ""  # whether the floor's own token count is the true count


def _median_ms(call: Any, repeats: int) -> tuple[float, Any]:
    result = call()  # warm: the template compiled, the tokenizer's caches as a server would have them
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = call()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times), result


def physical_floor(vocab: Vocabulary, kept: Messages, true_tokens: int | None, repeats: int = 5) -> Floor:
    """The least any exact count of ``kept`` costs here: one plain render and one batch encode of its text."""
    floor = Floor()
    if vocab.model.mistral:
        encoding: MistralEncoding = vocab.tokenizer
        texts = [m["content"] for m in kept if isinstance(m.get("content"), str) and m["content"]]
        texts += [c["function"]["arguments"] for m in kept for c in m.get("tool_calls") or ()]
        model = getattr(encoding.raw, "_model", None)  # Tekken's tiktoken core (batch encoder)
        if model is not None and hasattr(model, "encode_ordinary_batch"):
            floor.encode_ms, _ = _median_ms(lambda: model.encode_ordinary_batch(texts), repeats)
            how = "tiktoken `encode_ordinary_batch`"
        else:
            floor.encode_ms, _ = _median_ms(
                lambda: [encoding.raw.encode(t, bos=False, eos=False) for t in texts], repeats
            )
            how = "Tekken `encode`, one text at a time"
        dicts = server_dicts(kept)
        floor.render_ms, ids = _median_ms(lambda: encoding.apply_chat_template(dicts, tools=TOOLS), repeats)
        floor.floor_ms = floor.render_ms  # mistral-common renders and encodes in one pass: that pass is the floor
        floor.pieces = len(texts)
        floor.what = (
            f"encode: {how} of the message texts and arguments; render: mistral-common "
            "`encode_chat_completion` of the window (it writes the ids directly, so it is the floor alone)"
        )
        floor.check = "yes" if len(ids) == true_tokens else f"no ({len(ids) - (true_tokens or 0):+d})"
        return floor
    tokenizer, dicts = vocab.tokenizer, server_dicts(kept, vocab.content_format)

    def render() -> str:
        return str(
            tokenizer.apply_chat_template(
                dicts, tools=TOOLS, add_generation_prompt=True, tokenize=False, chat_template=vocab.source
            )
        )

    floor.render_ms, text = _median_ms(render, repeats)
    # The tokenizer cuts its input at added tokens first; the text between them is what it has to encode.
    added = sorted({t.content for t in tokenizer.added_tokens_decoder.values()}, key=len, reverse=True)
    parts = re.split("(" + "|".join(map(re.escape, added)) + ")", text) if added else [text]
    specials = sum(1 for i, p in enumerate(parts) if i % 2 == 1 and added)
    texts = [p for i, p in enumerate(parts) if i % 2 == 0 and p]
    backend = tokenizer.backend_tokenizer
    floor.encode_ms, encodings = _median_ms(lambda: backend.encode_batch_fast(texts, add_special_tokens=False), repeats)
    floor.floor_ms = floor.encode_ms + floor.render_ms
    floor.pieces = len(texts)
    floor.what = (
        "render: transformers `apply_chat_template(..., tokenize=False)`; encode: tokenizers `encode_batch_fast` "
        "of the rendered prompt cut at added tokens"
    )
    total = specials + sum(len(e.ids) for e in encodings)
    floor.check = "yes" if total == true_tokens else f"no ({total - (true_tokens or 0):+d})"
    return floor


# --- one row ----------------------------------------------------------------------------------------------------


@dataclass
class CaseResult:
    id: str
    group: str
    model: str
    conversation: str
    tokenizer: str
    content_format: str
    rows: list[Row] = field(default_factory=list)
    floor: Floor | None = None
    conversation_tokens: int | None = None  # the whole conversation at the first call, as the server counts it
    keeper_build_s: float | None = None  # building the keeper (tokenizer loaded, template compiled)
    slots_ms: float | None = None  # reading fit.report.slots, counted on first read (median per fit)


def _llamaindex_window(vocab: Vocabulary, messages: Messages, first: int, tokens: int) -> int:
    """The most messages before ``first`` whose contents hold at most ``tokens`` tokens (LlamaIndex's own count):
    its cost grows with the tokens it recounts for every message it drops, so scripts get comparable work."""
    total, window = 0, 0
    for message in reversed(messages[1:first]):
        total += len(vocab.tokenizer.encode(str(message.get("content") or ""), add_special_tokens=False))
        if total > tokens:
            break
        window += 1
    return max(window, 1)


def _keeping(run: Callable[[int], Call], first: int, into: list[Messages]) -> Callable[[int], Call]:
    """``run``, remembering the output of its first call at ``first`` (the cold fit's window)."""

    def call(stop: int) -> Call:
        out = run(stop)
        if stop == first and not into:
            into.append(out.messages)
        return out

    return call


def run_case(case: Case, vocab: Vocabulary, args: argparse.Namespace) -> CaseResult:
    result = CaseResult(
        case.id, case.group, vocab.model.label, case.conversation, vocab.model.vocab, vocab.content_format
    )
    messages = conversation(case.conversation, args.messages + 40 * (args.turns + 2))
    if vocab.model.mistral:
        messages = mistral_call_ids(messages)
    stops = _requests(messages, args.messages)
    first = stops[0]
    truth = Truth(vocab.tokenizer, vocab.source, vocab.content_format)
    kept: list[Messages] = []  # the cold fit's output: the window the floor is measured on
    groups: list[tuple[str, list[Method] | str, int, int]] = [
        ("contextkeeper", contextkeeper_methods(vocab.spec, vocab.source, messages), args.turns, args.repeats)
    ]
    if not args.no_peers:
        window = _llamaindex_window(vocab, messages, first, args.llamaindex_tokens)
        groups += [
            (
                "LangChain",
                langchain_methods(vocab.tokenizer, vocab.source, messages, stops[args.peer_turns]),
                args.peer_turns,
                1,
            ),
            ("LlamaIndex", llamaindex_methods(vocab.tokenizer, messages, window), args.peer_turns, 1),
            ("LiteLLM", litellm_methods(messages, args.litellm_messages), args.litellm_turns, 1),
        ]
    for group, methods, turns, repeats in groups:
        if isinstance(methods, str):
            print(f"NOTICE: {case.id}: skipping {group}: {methods}", file=sys.stderr)
            result.rows.append(Row(case.id, group, skipped=methods))
            continue
        for method in methods:
            if group == "contextkeeper":
                method = replace(method, run=_keeping(method.run, first, kept))
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                row = measure(case.id, method, messages, truth, first, stops[1 : turns + 1], repeats)
            print(
                f"{case.id}: {method.name}: cold {_ms(row.cold_s)}, {time.perf_counter() - t0:.1f} s with checks",
                file=sys.stderr,
            )
            result.rows.append(row)
            if group == "contextkeeper":
                result.keeper_build_s = method.state.get("build_s")
                if method.state.get("slots_s"):
                    result.slots_ms = round(statistics.median(method.state["slots_s"]) * 1000, 2)
                if row.true_tokens is not None and kept:
                    result.floor = physical_floor(vocab, kept[0], row.true_tokens, args.floor_repeats)
    with contextlib.suppress(Exception):  # a template may refuse the whole history; the size is only context
        result.conversation_tokens = truth.count(messages[:first])
    return result


# --- many conversations ---------------------------------------------------------------------------------------


@dataclass
class ManyRow:
    setup: str
    conversations: int
    threads: int
    fits: int = 0
    first_fit_p50_ms: float = 0.0
    turn_p50_ms: float = 0.0
    turn_p95_ms: float = 0.0
    wall_s: float = 0.0
    gc_s: float = 0.0
    fits_per_s: float = 0.0
    wall_per_fit_ms: float = 0.0  # the run's wall time over its fits: what a fit costs the machine
    mean_latency_ms: float = 0.0
    overflows: int = 0  # fits whose own count plus the answer exceeds the window
    recounted: int = 0
    recount_overflows: int = 0  # recounted fits over the window by the truth
    recount_exact: int = 0  # recounted fits whose own count is the true count
    notes: list[str] = field(default_factory=list)


class Chats:
    """``count`` different conversations (scripts in turn, seeds of their own) and their model calls."""

    def __init__(self, count: int, messages: int, turns: int) -> None:
        kinds = [CONVERSATIONS[i % len(CONVERSATIONS)] for i in range(count)]
        self.kinds = kinds
        self.messages = [conversation(kind, messages + 6 * turns + 40, seed=100 + i) for i, kind in enumerate(kinds)]
        self.stops = [_requests(m, messages)[: turns + 1] for m in self.messages]
        if min(map(len, self.stops)) < turns + 1:
            raise ValueError(f"a conversation has fewer than {turns + 1} model calls after message {messages}")


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


class _Fits:
    """Fit times and a sample of outputs for the recount (kept apart so the recount runs after the timing)."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.first: list[float] = []
        self.later: list[float] = []
        self.overflows = 0
        self.sample: list[tuple[Messages, int]] = []
        self.lock = threading.Lock()

    def add(self, turn: int, fit: Any, seconds: float) -> None:
        with self.lock:
            (self.first if turn == 0 else self.later).append(seconds)
            self.overflows += fit.tokens + ANSWER_TOKENS > CONTEXT_WINDOW
            if (len(self.first) + len(self.later)) % self.every == 0:
                self.sample.append((list(fit.messages), int(fit.tokens)))

    def row(self, setup: str, conversations: int, threads: int, wall: float, gc_s: float, truth: Truth) -> ManyRow:
        later_ms = [s * 1000 for s in self.later]
        row = ManyRow(setup, conversations, threads, fits=len(self.first) + len(self.later))
        row.first_fit_p50_ms = round(statistics.median(self.first) * 1000, 1)
        row.turn_p50_ms = round(statistics.median(later_ms), 2)
        row.turn_p95_ms = round(_p(later_ms, 0.95), 2)
        row.wall_s, row.gc_s = round(wall, 2), round(gc_s, 2)
        row.fits_per_s = round(row.fits / wall, 1)
        row.wall_per_fit_ms = round(wall * 1000 / row.fits, 2)
        row.mean_latency_ms = round(statistics.fmean([*self.first, *self.later]) * 1000, 2)
        row.overflows = self.overflows
        for messages, own in self.sample:
            true = truth.count(messages)
            row.recounted += 1
            row.recount_overflows += true > BUDGET
            row.recount_exact += true == own
        return row


def many_conversations(vocab: Vocabulary, chats: Chats, args: argparse.Namespace, *, threaded: bool) -> ManyRow:
    """The chats interleaved on one keeper (one fit of each in turn), or split over ``args.threads`` threads."""
    truth = Truth(vocab.tokenizer, vocab.source, vocab.content_format)
    keeper = ck.ContextKeeper(
        tokenizer=vocab.spec, chat_template=vocab.source, context_window=CONTEXT_WINDOW, policy="default"
    )
    fits = _Fits(max(1, args.many * (args.many_turns + 1) // args.recounts))
    turns = len(chats.stops[0])

    def fit(i: int, turn: int) -> None:
        messages = chats.messages[i][: chats.stops[i][turn]]
        t0 = time.perf_counter()
        out = keeper.fit(messages, tools=TOOLS, max_tokens=ANSWER_TOKENS, conversation=f"chat-{i}")
        fits.add(turn, out, time.perf_counter() - t0)

    started, collected = time.perf_counter(), COLLECTIONS.total
    if not threaded:
        for turn in range(turns):
            for i in range(args.many):
                fit(i, turn)
        wall = time.perf_counter() - started
        setup = "one keeper, interleaved, `conversation=` each"
        return fits.row(setup, args.many, 1, wall, COLLECTIONS.total - collected, truth)
    errors: list[BaseException] = []
    barrier = threading.Barrier(args.threads)

    def worker(k: int) -> None:
        try:
            barrier.wait(timeout=120)
            for turn in range(turns):
                for i in range(k, args.many, args.threads):
                    fit(i, turn)
        except BaseException as exc:  # re-raised below, on the main thread
            errors.append(exc)

    pool = [threading.Thread(target=worker, args=(k,)) for k in range(args.threads)]
    started = time.perf_counter()
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    wall = time.perf_counter() - started
    if errors:
        raise errors[0]
    setup = f"one keeper, {args.threads} threads, `conversation=` each"
    row = fits.row(setup, args.many, args.threads, wall, COLLECTIONS.total - collected, truth)
    row.notes.append(
        f"each thread fits every {args.threads}th chat in turn, one fit after another: {args.threads} fits are always "
        f"in flight, so the mean latency is {args.threads} × the wall per fit (Little's law), "
        f"{args.threads * row.wall_per_fit_ms:.1f} ms here"
    )
    return row


# --- reporting --------------------------------------------------------------------------------------------------


def _ck(result: CaseResult) -> Row | None:
    return next((r for r in result.rows if r.method.startswith("contextkeeper") and not r.skipped), None)


def _langchain_exact(result: CaseResult) -> Row | None:
    return next((r for r in result.rows if "template counter" in r.method), None)


def _overflows(row: Row) -> int | None:
    if not row.fits_calls:
        return None if row.true_tokens is None else int(not row.fits)
    fitting, checked = (int(x) for x in row.fits_calls.split("/"))
    return checked - fitting


def _goal(met: bool | None, text: str) -> str:
    if met is None:
        return text
    return f"met: {text}" if met else f"**not met**: {text}"


def goals_table(results: list[CaseResult]) -> list[str]:
    lines = [
        "| row | cold ≤ 80 ms | turn p50 ≤ 5 ms | ≥ 45× LangChain exact | history use ≥ 95% | 0 overflows "
        "| kept msgs | true tokens | fits | floor: encode | floor: render | cold / floor |",
        "|---|---|---|---|---|---|---:|---:|---|---:|---:|---:|",
    ]
    for result in results:
        row = _ck(result)
        if row is None or row.error or row.cold_s is None:
            error = row.error if row is not None else "not measured"
            lines.append(f"| {result.id} | raised {error} |  |  |  |  |  |  |  |  |  |  |")
            continue
        cold = _goal(row.cold_s <= GOAL_COLD_S, _ms(row.cold_s))
        turn = "—"
        if row.per_turn_p50_ms is not None:
            turn = _goal(row.per_turn_p50_ms <= GOAL_TURN_MS, f"{row.per_turn_p50_ms:.1f} ms")
        peer, vs = _langchain_exact(result), "— (no peers)"
        if peer is not None and peer.cold_s is not None:
            ratio = peer.cold_s / row.cold_s
            vs = _goal(ratio >= GOAL_VS_LANGCHAIN, f"{ratio:.0f}× ({_ms(peer.cold_s)})")
        elif peer is not None and peer.error:
            vs = "LangChain raised"
        use = "—" if row.history_use is None else _goal(row.history_use >= GOAL_HISTORY_USE, f"{row.history_use:.1%}")
        over = _overflows(row)
        overflows = "—" if over is None else _goal(over == 0, f"{over} of {row.fits_calls.split('/')[-1]}")
        floor = result.floor
        enc = ren = ratio_text = "—"
        if floor is not None and floor.floor_ms:
            enc, ren = f"{floor.encode_ms:.1f} ms", f"{floor.render_ms:.1f} ms"
            ratio_text = f"{row.cold_s * 1000 / floor.floor_ms:.1f}×"
        true = f"{row.true_tokens:,}" if row.true_tokens is not None else "—"
        lines.append(
            f"| {result.id} | {cold} | {turn} | {vs} | {use} | {overflows} | {row.kept_messages} | {true} "
            f"| {row.fits_calls} | {enc} | {ren} | {ratio_text} |"
        )
    return lines


def many_table(rows: list[ManyRow]) -> list[str]:
    lines = [
        "| setup | conversations | fits | first fit p50 | turn p50 | turn p95 | mean latency | wall per fit | wall "
        "| of it in GC | fits/s | overflows (own count) | recounted: over / exact | notes |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        over = _goal(r.overflows == 0 and r.recount_overflows == 0, str(r.overflows))
        turn = _goal(r.turn_p50_ms <= GOAL_TURN_MS, f"{r.turn_p50_ms:.1f} ms")
        lines.append(
            f"| {r.setup} | {r.conversations} | {r.fits} | {r.first_fit_p50_ms:.0f} ms | {turn} "
            f"| {r.turn_p95_ms:.1f} ms | {r.mean_latency_ms:.1f} ms | {r.wall_per_fit_ms:.2f} ms | {r.wall_s:.2f} s "
            f"| {r.gc_s:.2f} s | {r.fits_per_s:.0f} | {over} "
            f"| {r.recount_overflows} / {r.recount_exact} of {r.recounted} | {'; '.join(r.notes)} |"
        )
    return lines


def _versions() -> dict[str, str]:
    names = ("contextkeeper", "transformers", "tokenizers", "jinja2", "mistral-common")
    peers = ("langchain-core", "llama-index-core", "litellm")
    return {name: _version(name) for name in (*names, *peers)}


DESCRIPTION = """\
Each row is a conversation at the model call after message {n:,}, fitted to a {w:,}-token context with {a:,}
tokens kept for the answer (at most {b:,} prompt tokens), with the five tool schemas. Rows are named
*model/conversation*. `ascii` is the English agent conversation of the fit benchmark above; the others are the
same conversation written in one script: `latin` (French, German, Spanish, Polish and Vietnamese), `cjk`
(Chinese and Japanese), `cyrillic`, `arabic`, `devanagari`, `greek`, `code` (English prose, tool results of
code, SQL and indented JSON) and `mixed` (Chinese, Russian, Japanese, Arabic, Hindi and Greek in one chat).
`qwen3` is Qwen3-0.6B's template on the qwen2 vocabulary, `llama3.3` Llama 3.3 70B Instruct's on llama-bpe,
`gpt-oss` gpt-oss-120b's on qwen2 with the harmony tokens, `gemma4` Gemma 4 31B it's on its own vocabulary,
`deepseek3.1` DeepSeek V3.1's on the DeepSeek V4 tokenizer, and `tekken` mistral-common's Tekken encoding
(`ContextKeeper(tokenizer="mistral:tekken")`; its conversations carry 9-character tool-call ids, as Mistral
models require).

Every output is recounted as an OpenAI-compatible server counts it: **true tokens**. That is the template with
the tools and the generation prompt, as in the fit benchmark above, with content shaped the way vLLM's `auto`
content format picks for the template; for Tekken it is mistral-common's `encode_chat_completion` of the
request, which vLLM uses for Mistral models. **Fits** is how many of the checked calls (the cold one and each
per-turn one) fit; **overflows** are the others. **History use** is true tokens over the longest whole-turn
suffix that fits (above 100% where the strategies shorten old tool results instead of dropping their turns).
Cold is a fresh keeper's first fit, after a full garbage collection (for every method alike, so none pays for
what ran before it); turn p50 is the median of the same keeper's next {t} fits (the median over {r} run(s),
each with a fresh keeper). Each peer gets {p} more call(s) after its cold one, LiteLLM {lt}: LangChain's
`trim_messages` with the template counter and with the per-message counter, LlamaIndex's `ChatMemoryBuffer` on
the last messages that hold at most {li:,} content tokens (it recounts its window for every message it drops),
and LiteLLM's `trim_messages` (model `{m}`) on {lm}. **≥ 45× LangChain exact** is LangChain's cold time with the
template counter over contextkeeper's.

**The floor** is the least any exact count of the kept window costs here: (a) one `encode_batch_fast`
(tokenizers) of the kept window's rendered prompt, cut at the tokenizer's added tokens, since the tokenizer
encodes only the text between them (for Tekken: tiktoken's batch encode of the message texts and arguments),
and (b) one plain render of the kept window (`apply_chat_template(..., tokenize=False)` in transformers, compiled
and warm; for Tekken: mistral-common's `encode_chat_completion`, which renders and encodes in one pass and so is
the floor alone). Both are the median of {fr} calls after a warm-up. **cold / floor** is contextkeeper's cold fit
over (a) + (b)."""


LITTLE = """\
With {n} threads that each start their next fit as soon as one returns, {n} fits are always in flight, and the
mean latency is {n} × the wall time per fit whatever the code does (Little's law: in flight = throughput ×
latency). A {goal:g} ms p50 there needs a fit to cost the machine at most about {most:.2f} ms of wall time, on
{cores} CPU(s): no Python fit of a 600-message chat is that cheap, and the interpreter runs one thread's Python
at a time. The threaded row is held to the same goal as the others and is not met; what threads can change is
the wall per fit, which stays close to the interleaved row's (the tokenizer releases the interpreter while it
encodes, and fits of different conversations hold no common lock for longer than a look-up in the keeper's
registry of conversations or in the shared cache budget)."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    groups = "scripts, templates, many, threads"
    parser.add_argument(
        "--rows", action="append", metavar="PATTERN", help=f"rows to run: {groups}, or ids like 'qwen3/cjk', 'gemma4/*'"
    )
    parser.add_argument("--list", action="store_true", help="print the row ids and exit")
    parser.add_argument("--no-peers", action="store_true", help="contextkeeper and the floor only")
    parser.add_argument("--messages", type=int, default=2000, help="the first model call comes after this many")
    parser.add_argument("--turns", type=int, default=20, help="per-turn fits with contextkeeper's keeper")
    parser.add_argument("--repeats", type=int, default=3, help="contextkeeper runs (median reported)")
    parser.add_argument("--peer-turns", type=int, default=1, help="per-turn calls of LangChain and LlamaIndex")
    parser.add_argument("--litellm-turns", type=int, default=1, help="per-turn calls of LiteLLM")
    parser.add_argument(
        "--litellm-messages", type=int, default=300, help="LiteLLM gets the last this many messages (0: all)"
    )
    parser.add_argument("--llamaindex-tokens", type=int, default=90_000, help="LlamaIndex gets this many tokens")
    parser.add_argument("--many", type=int, default=50, help="conversations on one keeper")
    parser.add_argument("--many-messages", type=int, default=600, help="messages of each at its first fit")
    parser.add_argument("--many-turns", type=int, default=12, help="fits of each conversation after its first")
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--recounts", type=int, default=40, help="fits of each many-conversation row recounted")
    parser.add_argument("--floor-repeats", type=int, default=5, help="timed calls of each floor step (median)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: --messages 600 --turns 3 --repeats 1 --peer-turns 0 --litellm-turns 0 "
        "--llamaindex-tokens 45000 --many 10 --many-turns 3 --recounts 10 --floor-repeats 3",
    )
    parser.add_argument("--write", action="store_true", help="write the section into docs/benchmarks.md")
    args = parser.parse_args()
    command = shlex.join(["python", "benchmarks/bench_languages.py", *sys.argv[1:]])
    if args.quick:
        args.messages, args.turns, args.repeats = min(args.messages, 600), min(args.turns, 3), 1
        args.peer_turns, args.litellm_turns = 0, 0
        args.llamaindex_tokens = min(args.llamaindex_tokens, 45_000)
        args.many, args.many_turns, args.recounts = min(args.many, 10), min(args.many_turns, 3), 10
        args.floor_repeats = min(args.floor_repeats, 3)
    patterns = args.rows or ["*"]

    def chosen(*names: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for name in names for p in patterns)

    cases = [c for c in CASES if chosen(c.id, c.group)]
    if args.list:
        print("\n".join([f"{c.group}: {c.id}" for c in CASES] + ["many", "threads"]))
        return 0
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    started = time.perf_counter()
    vocabularies: dict[str, Vocabulary] = {}
    results = []
    for case in cases:
        if case.model.key not in vocabularies:
            vocabularies[case.model.key] = load(case.model)
        results.append(run_case(case, vocabularies[case.model.key], args))
    many: list[ManyRow] = []
    chats: Chats | None = None
    for name, threaded in (("many", False), ("threads", True)):
        if chosen(name):
            qwen = vocabularies.get("qwen3") or load(MODELS["qwen3"])
            vocabularies["qwen3"] = qwen
            chats = chats or Chats(args.many, args.many_messages, args.many_turns)
            many.append(many_conversations(qwen, chats, args, threaded=threaded))
            print(f"{name}: {many[-1].fits} fits in {many[-1].wall_s:.1f} s", file=sys.stderr)
    load_after = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    duration = time.perf_counter() - started

    versions = _versions()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "command": command,
        "args": vars(args),
        "versions": versions,
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "load_average": [load_before, load_after],
        "duration_s": round(duration, 1),
        "cases": [asdict(r) for r in results],
        "many": [asdict(r) for r in many],
    }
    RESULTS.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")

    env = f"Python {platform.python_version()}, " + ", ".join(f"{k} {v}" for k, v in versions.items())
    env += f", {platform.machine()}, {os.cpu_count()} CPUs"
    if load_before is not None and load_after is not None:
        # The machine may be shared: timings scale with the load (runnable processes per CPU).
        env += f", load average {load_before:.1f} at the start and {load_after:.1f} at the end"
    description = DESCRIPTION.format(
        n=args.messages,
        w=CONTEXT_WINDOW,
        a=ANSWER_TOKENS,
        b=BUDGET,
        t=args.turns,
        r=args.repeats,
        p=args.peer_turns,
        lt=args.litellm_turns,
        li=args.llamaindex_tokens,
        lm=f"the last {args.litellm_messages} messages (on the whole conversation it takes a minute or more a call)"
        if args.litellm_messages
        else "the whole conversation",
        m=LITELLM_MODEL,
        fr=args.floor_repeats,
    )
    lines = ["<!-- languages:start -->", description, "", f"Command: `{command}` — {env}; {duration:.0f} s.", ""]
    if results:
        lines += ["### Against the goals", "", *goals_table(results), ""]
        sizes = ", ".join(f"{r.id} {r.conversation_tokens:,}" for r in results if r.conversation_tokens is not None)
        if sizes:
            lines += [f"Tokens of the whole conversation at the first call (as the server counts it): {sizes}.", ""]
        if any(r.id in ("qwen3/mixed", "qwen3/ascii") for r in results):
            lines += ["`qwen3/mixed` and `qwen3/ascii` are also Qwen3's rows of the template comparison.", ""]
        floors = [r.floor for r in results if r.floor is not None]
        checks = [f"{r.id} {r.floor.check}" for r in results if r.floor is not None and r.floor.check != "yes"]
        if floors:
            lines += [
                "The floor's own token count (the ids of its pieces plus the added tokens between them; for Tekken "
                "the ids mistral-common wrote) equals the true count"
                + (f" except: {', '.join(checks)}." if checks else " on every row."),
                "",
            ]
        builds = [r.keeper_build_s for r in results if r.keeper_build_s is not None]
        slots = [r.slots_ms for r in results if r.slots_ms is not None]
        if builds and slots:
            lines += [
                f"Not part of the fit times: building a keeper (tokenizer loaded, template compiled) took "
                f"{min(builds):.2f}–{max(builds):.2f} s, and reading `fit.report.slots` (counted on first read) "
                f"{min(slots):.1f}–{max(slots):.1f} ms more per fit (medians).",
                "",
            ]
        rows = [row for r in results for row in r.rows]
        detail = table(rows)
        detail[0] = detail[0].replace("| template |", "| row |", 1)
        lines += ["### Every method", "", *detail, ""]
    if many:
        lines += [
            "### Many conversations on one keeper",
            "",
            f"{args.many} different conversations ({', '.join(CONVERSATIONS)} in turn, each with its own seed), "
            f"from their model call after message {args.many_messages:,} on, {args.many_turns} fits each after "
            "the first, Qwen3's template, one keeper with a `conversation=` id per chat; fresh keepers for the "
            "interleaved run (one fit of each chat in turn) and the threaded one. Turn p50/p95 are over the fits "
            f"after each chat's first; overflows are counted on every fit's own count, and {args.recounts} fits "
            "of each row are recounted as the server counts them (over the window / exactly the fit's count). "
            "**Wall per fit** is the run's wall time over its fits (what a fit costs the machine, waits included); "
            "**mean latency** is the mean time from a fit's call to its return.",
            "",
            *many_table(many),
            "",
            LITTLE.format(n=args.threads, cores=os.cpu_count(), goal=GOAL_TURN_MS, most=GOAL_TURN_MS / args.threads),
            "",
        ]
    lines.append("<!-- languages:end -->")
    block = "\n".join(lines)
    print(block)
    if args.write:
        write_section("languages", block, heading="## Every script, template and conversation count")
    print(f"total {duration:.0f} s; results in {RESULTS.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
