"""Metrics and traces: the proxy's ``/metrics`` scraped after real proxied requests, and the OpenTelemetry spans
of wrapped openai calls (sync, async, streamed) caught by the SDK's in-memory exporter.

The upstream is tests/openai_server.py's ChatServer (counting with transformers, as vLLM does), with hidden tokens
so that a long conversation is refused for length once and recovered: the numbers scraped must equal what the
requests produced (the upstream's own records and the proxy's debug endpoint).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("prometheus_client")
pytest.importorskip("opentelemetry.sdk")

import openai
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.util._once import Once

import contextkeeper as ck
from assets import require_assets, tokenizer_dir
from conftest import hf_tokenizer
from contextkeeper.calls import tracing
from contextkeeper.proxy import Proxy
from openai_server import ChatServer
from proxy_helpers import route, running_proxy, scrape, tenant, total

WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima")
CONTEXT = 1024
ANSWER = 64
HIDDEN = 200  # what the upstream counts beyond what it is sent: the first long prompt is refused for length
pytestmark = pytest.mark.filterwarnings("ignore::contextkeeper.calls.loop.DriftWarning")  # the hidden tokens
PROMPT_SLOTS = ("system", "tools", "history", "request", "template_overhead")


def history(turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a terse assistant."}]
    for turn in range(turns):
        text = " ".join(WORDS[(turn * 7 + i) % len(WORDS)] for i in range(40))
        messages.append({"role": "user", "content": f"Turn {turn}: {text}?"})
        messages.append({"role": "assistant", "content": f"Answer {turn}: " + " ".join(WORDS[:20])})
    messages.append({"role": "user", "content": f"Turn {turns}: and now?"})
    return messages


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    require_assets()
    return hf_tokenizer("qwen2")


@pytest.fixture
def upstream(tokenizer: Any) -> Iterator[ChatServer]:
    with ChatServer(tokenizer_dir("qwen2"), max_model_len=CONTEXT, tokenizer=tokenizer, hidden_tokens=HIDDEN) as up:
        yield up


# ---------------------------------------------------------------------------------------------------- metrics


def test_metrics_count_what_the_requests_did(tokenizer: Any, upstream: ChatServer) -> None:
    keeper = ck.ContextKeeper(tokenizer, context_window=CONTEXT, kv_capacity=8 * CONTEXT)
    with running_proxy([route(keeper)], upstream.base_url) as proxy:
        client = openai.OpenAI(base_url=proxy.base_url, api_key="k", max_retries=0, timeout=20)
        ids = ["long", "short", "streamed"]
        client.chat.completions.create(
            model="m", messages=history(30), max_tokens=ANSWER, extra_headers={"X-Conversation-Id": "long"}
        )
        client.chat.completions.create(
            model="m", messages=history(2), max_tokens=ANSWER, extra_headers={"X-Conversation-Id": "short"}
        )
        chunks = client.chat.completions.create(
            model="m",
            messages=history(3),
            max_tokens=ANSWER,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"X-Conversation-Id": "streamed"},
        )
        assert sum(1 for _ in chunks) > 1
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="m", messages=history(1), max_tokens=0)
        deadline = time.monotonic() + 10
        while proxy.proxy.debug.get(tenant("k"), "streamed") is None and time.monotonic() < deadline:
            time.sleep(0.02)  # the stream's exchange is observed once its last event went out
        exchanges = [proxy.proxy.debug.get(tenant("k"), c) for c in ids]
        samples = scrape(proxy.url)

    entry = route(keeper).name
    assert all(e is not None and e.fit is not None and e.call is not None for e in exchanges)
    fits = [e.fit.report for e in exchanges if e is not None and e.fit is not None]
    calls = [e.call for e in exchanges if e is not None and e.call is not None]
    accepted = [r for r in upstream.requests if r.accepted]
    assert len(accepted) == 3
    assert len(upstream.requests) == 4
    sent = [r.prompt_tokens - HIDDEN for r in accepted if r.prompt_tokens is not None]
    assert len(sent) == 3

    # Prompt tokens summed: our exact count of every prompt the upstream took.
    assert total(samples, "contextkeeper_prompt_tokens_sum", entry=entry) == sum(sent)
    assert total(samples, "contextkeeper_prompt_tokens_count", entry=entry) == 3
    prompt_slots = sum(total(samples, "contextkeeper_slot_tokens_total", slot=s) for s in PROMPT_SLOTS)
    assert prompt_slots == sum(sent)
    assert total(samples, "contextkeeper_slot_tokens_total", slot="answer") == 3 * ANSWER
    withheld = sum(r.slots.get("withheld", 0) for r in fits)
    assert withheld >= HIDDEN  # the prompts after the refusal keep tokens free for what the server adds
    assert total(samples, "contextkeeper_slot_tokens_total", slot="withheld") == withheld

    # Requests by entry and outcome; the refusal recovered; attempts as the upstream saw them.
    assert total(samples, "contextkeeper_requests_total", entry=entry, outcome="ok") == 3
    assert total(samples, "contextkeeper_requests_total", outcome="ok", stream="true") == 1
    assert total(samples, "contextkeeper_requests_total", entry="none", outcome="invalid_max_tokens") == 1
    assert total(samples, "contextkeeper_recoveries_total", entry=entry, kind="context_length") == 1
    assert total(samples, "contextkeeper_upstream_attempts_total", entry=entry) == len(upstream.requests)
    assert total(samples, "contextkeeper_fit_seconds_count", entry=entry) == 4  # the refused prompt was refitted
    assert total(samples, "contextkeeper_upstream_seconds_count", entry=entry) == 3

    # Actions and tokens saved per strategy: what the fits reported.
    actions: dict[str, int] = {}
    saved: dict[str, int] = {}
    for report in fits:
        for action in report.actions:
            actions[action.strategy] = actions.get(action.strategy, 0) + 1
            saved[action.strategy] = saved.get(action.strategy, 0) + (action.saved or 0)
    assert actions.get("sliding_window")
    for strategy, count in actions.items():
        assert total(samples, "contextkeeper_strategy_actions_total", strategy=strategy) == count
        assert total(samples, "contextkeeper_strategy_saved_tokens_total", strategy=strategy) == saved[strategy]
    dropped = sum(r.messages_before - r.messages_after for r in fits)
    assert total(samples, "contextkeeper_messages_dropped_total") == dropped > 0

    # Drift: the server counts HIDDEN more than we do, on every reply that reported its usage.
    drifts = [c.drift for c in calls if c.drift is not None]
    assert drifts == [HIDDEN] * 3
    assert total(samples, "contextkeeper_drift_tokens_count") == 3
    assert total(samples, "contextkeeper_drift_tokens_bucket", le="256.0") == 3  # in (64, 256]
    assert total(samples, "contextkeeper_drift_tokens_bucket", le="64.0") == 0
    assert total(samples, "contextkeeper_drift_last_tokens", entry=entry) == HIDDEN
    assert total(samples, "contextkeeper_server_prompt_tokens_total") == sum(r.prompt_tokens or 0 for r in accepted)

    # The ledger, read at scrape time: nothing in flight, the capacity, every attempt admitted.
    assert total(samples, "contextkeeper_kv_capacity_tokens", entry=entry) == 8 * CONTEXT
    assert total(samples, "contextkeeper_kv_active_tokens", entry=entry) == 0
    assert total(samples, "contextkeeper_kv_peak_tokens", entry=entry) >= max(sent) + ANSWER
    assert total(samples, "contextkeeper_admission_admitted_total", entry=entry) == len(upstream.requests)
    assert total(samples, "contextkeeper_admission_waits_total", entry=entry) == 0


def test_two_proxies_in_one_process_have_their_own_registries(tokenizer: Any) -> None:
    keeper = ck.ContextKeeper(tokenizer, context_window=CONTEXT)
    first = Proxy([route(keeper)], upstream="http://127.0.0.1:9/v1")
    second = Proxy([route(keeper)], upstream="http://127.0.0.1:9/v1")
    assert first.metrics is not None
    assert second.metrics is not None
    assert first.metrics.registry is not second.metrics.registry
    names = {name for name, _, _ in first.metrics.samples()}
    assert "contextkeeper_kv_active_tokens" in names
    assert all(name.startswith("contextkeeper_") for name in names)


# ----------------------------------------------------------------------------------------------------- traces


@contextlib.contextmanager
def provider(exporter: InMemorySpanExporter | None) -> Iterator[None]:
    """The global tracer provider set to one exporting to ``exporter`` (None: no provider), then unset again.
    The API lets a process set it once; like OpenTelemetry's own test utilities, reset its guard around it."""

    def reset() -> None:
        trace._TRACER_PROVIDER_SET_ONCE = Once()
        trace._TRACER_PROVIDER = None

    reset()
    if exporter is not None:
        sdk = TracerProvider()
        sdk.add_span_processor(SimpleSpanProcessor(exporter))
        trace.set_tracer_provider(sdk)
    try:
        yield
    finally:
        reset()


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    with provider(exporter):
        yield exporter


def tree(exporter: InMemorySpanExporter) -> tuple[ReadableSpan, list[ReadableSpan], list[ReadableSpan]]:
    """The one call span, its fit spans and its upstream spans (checked to be its children)."""
    finished = list(exporter.get_finished_spans())
    roots = [s for s in finished if s.parent is None]
    assert len(roots) == 1, [s.name for s in finished]
    root = roots[0]
    assert root.context is not None
    children = [s for s in finished if s is not root]
    for child in children:
        assert child.parent is not None
        assert child.parent.span_id == root.context.span_id
        assert child.context is not None
        assert child.context.trace_id == root.context.trace_id
    fits = [s for s in children if s.name == "contextkeeper.fit"]
    sent = [s for s in children if s.name == "contextkeeper.upstream"]
    assert len(fits) + len(sent) == len(children)
    return root, fits, sent


def check_budget(attributes: Any, fit: ck.Fit) -> None:
    report = fit.report
    assert attributes["contextkeeper.limit"] == report.limit
    assert attributes["contextkeeper.prompt_tokens"] == fit.tokens
    assert attributes["contextkeeper.max_tokens"] == report.max_tokens
    for slot, tokens in report.slots.items():
        assert attributes[f"contextkeeper.slot.{slot}"] == tokens
    assert sum(attributes[f"contextkeeper.slot.{s}"] for s in PROMPT_SLOTS) == fit.tokens
    assert list(attributes["contextkeeper.actions"]) == [f"{a.strategy}:{a.saved}" for a in report.actions]


def test_a_wrapped_call_is_traced(tokenizer: Any, upstream: ChatServer, spans: InMemorySpanExporter) -> None:
    keeper = ck.ContextKeeper(tokenizer, context_window=CONTEXT)
    client = keeper.wrap(openai.OpenAI(base_url=upstream.base_url, api_key="k", timeout=20), conversation="c-1")
    reply = client.chat.completions.create(model="test-model", messages=history(30), max_tokens=ANSWER)
    root, fits, sent = tree(spans)
    assert root.name == "chat test-model"
    assert root.kind is SpanKind.CLIENT
    assert root.instrumentation_scope is not None
    assert root.instrumentation_scope.name == "contextkeeper"
    a = root.attributes
    assert a is not None
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.provider.name"] == a["gen_ai.system"]
    assert a["gen_ai.request.model"] == "test-model"
    assert a["gen_ai.request.max_tokens"] == ANSWER
    assert a["gen_ai.conversation.id"] == "c-1"
    assert reply.usage is not None
    assert a["gen_ai.usage.input_tokens"] == reply.usage.prompt_tokens == upstream.requests[-1].prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == reply.usage.completion_tokens
    assert list(a["gen_ai.response.finish_reasons"]) == [c.finish_reason for c in reply.choices]
    assert a["gen_ai.response.id"] == reply.id
    assert a["server.address"] == "127.0.0.1"
    assert a["server.port"] == upstream.port
    assert keeper.last_fit is not None
    assert keeper.last_call is not None
    check_budget(a, keeper.last_fit)
    assert a["contextkeeper.withheld"] == keeper.last_fit.report.slots["withheld"] > 0  # learned from the refusal
    assert a["contextkeeper.attempts"] == 2
    assert a["contextkeeper.drift"] == HIDDEN
    assert any(r.startswith("refused for length") for r in a["contextkeeper.recoveries"])
    assert root.status.status_code is StatusCode.UNSET

    # Refused, refitted, resent: two fits, two upstream attempts, the first one failed.
    assert len(fits) == 2
    assert len(sent) == 2
    first, second = sorted(sent, key=lambda s: s.start_time or 0)
    assert first.status.status_code is StatusCode.ERROR
    assert first.attributes is not None
    assert first.attributes["contextkeeper.failure"] == "context"
    assert first.attributes["error.type"] == "BadRequestError"
    assert second.attributes is not None
    assert second.attributes["contextkeeper.attempt"] == 2
    assert second.attributes["gen_ai.usage.input_tokens"] == reply.usage.prompt_tokens
    assert second.kind is SpanKind.CLIENT
    last_fit = max(fits, key=lambda s: s.start_time or 0)
    assert last_fit.attributes is not None
    check_budget(last_fit.attributes, keeper.last_fit)


def test_an_async_call_is_traced(tokenizer: Any, upstream: ChatServer, spans: InMemorySpanExporter) -> None:
    keeper = ck.ContextKeeper(tokenizer, context_window=CONTEXT)

    async def run() -> Any:
        async with openai.AsyncOpenAI(base_url=upstream.base_url, api_key="k", timeout=20) as sdk:
            return await keeper.wrap(sdk).chat.completions.create(model="m", messages=history(2), max_tokens=ANSWER)

    reply = asyncio.run(run())
    root, fits, sent = tree(spans)
    assert len(fits) == len(sent) == 1
    a = root.attributes
    assert a is not None
    assert reply.usage is not None
    assert a["gen_ai.request.model"] == "m"
    assert a["gen_ai.conversation.id"] == "default"
    assert a["gen_ai.usage.input_tokens"] == reply.usage.prompt_tokens
    assert keeper.last_fit is not None
    check_budget(a, keeper.last_fit)
    assert keeper.last_call is not None
    assert a["contextkeeper.admission"] == keeper.last_call.admission


def test_a_stream_is_traced_to_its_end(tokenizer: Any, upstream: ChatServer, spans: InMemorySpanExporter) -> None:
    keeper = ck.ContextKeeper(tokenizer, context_window=CONTEXT)
    client = keeper.wrap(openai.OpenAI(base_url=upstream.base_url, api_key="k", timeout=20))
    stream = client.chat.completions.create(
        model="m", messages=history(2), max_tokens=ANSWER, stream=True, stream_options={"include_usage": True}
    )
    names = [s.name for s in spans.get_finished_spans()]
    assert names == ["contextkeeper.fit"]  # the call and its upstream attempt are open while the stream is
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text
    root, fits, sent = tree(spans)
    assert len(fits) == len(sent) == 1
    a = root.attributes
    assert a is not None
    assert a["contextkeeper.stream"] is True
    assert keeper.last_call is not None
    assert (
        a["gen_ai.usage.input_tokens"] == keeper.last_call.server_prompt_tokens == upstream.requests[-1].prompt_tokens
    )
    assert a["gen_ai.usage.output_tokens"] == keeper.last_call.completion_tokens
    assert "gen_ai.response.finish_reasons" not in a  # not read from streams


def test_the_proxy_gets_the_same_spans(tokenizer: Any, upstream: ChatServer, spans: InMemorySpanExporter) -> None:
    keeper = ck.ContextKeeper(tokenizer, context_window=CONTEXT)
    with running_proxy([route(keeper)], upstream.base_url) as proxy:
        client = openai.OpenAI(base_url=proxy.base_url, api_key="k", max_retries=0, timeout=20)
        client.chat.completions.create(
            model="m", messages=history(2), max_tokens=ANSWER, extra_headers={"X-Conversation-Id": "p-1"}
        )
    root, fits, sent = tree(spans)
    assert root.attributes is not None
    assert root.attributes["gen_ai.conversation.id"] == f"{tenant('k')}/p-1"  # the tenant-scoped key
    assert len(fits) == len(sent) == 1


def test_no_provider_no_spans_no_errors(tokenizer: Any, upstream: ChatServer) -> None:
    exporter = InMemorySpanExporter()
    with provider(None):
        keeper = ck.ContextKeeper(tokenizer, context_window=CONTEXT)
        client = keeper.wrap(openai.OpenAI(base_url=upstream.base_url, api_key="k", timeout=20))
        reply = client.chat.completions.create(model="m", messages=history(30), max_tokens=ANSWER)
        assert reply.choices[0].message.content
        assert keeper.last_call is not None
        assert keeper.last_call.attempts == 2
        assert tracing._tracer() is None
        started = time.perf_counter()
        for _ in range(10_000):
            tracing._tracer()
        per_call = (time.perf_counter() - started) / 10_000
    assert per_call < 20e-6  # the whole cost of tracing a call nobody traces
    assert exporter.get_finished_spans() == ()
