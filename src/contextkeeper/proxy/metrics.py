"""The proxy's Prometheus metrics (``GET /metrics``), fed from the one observation point (:meth:`Proxy.observe`).

Each proxy has a registry of its own (two proxies in one process do not collide). Counters and histograms are
updated once per finished exchange; the KV ledger's gauges and admission counters are read from each entry's
ledger at scrape time (a Redis ledger: the pool's, across replicas, and this process's own counters). Labels are
bounded: the model entry, the strategy, the slot, the outcome, the recovery kind, never a conversation id.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from .config import Route
    from .observe import Exchange

__all__ = ["ProxyMetrics", "outcome_of", "recovery_kind"]

log = logging.getLogger("contextkeeper.proxy")

NO_ENTRY = "none"  # the entry label of a request refused before an entry took it

_SECONDS_FIT = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_SECONDS_UPSTREAM = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_TOKENS = tuple(float(2**n) for n in range(7, 19))  # 128 ... 262,144
_DRIFT = (-256.0, -64.0, -16.0, -4.0, -1.0, 0.0, 1.0, 4.0, 16.0, 64.0, 256.0)

# What a recovery note of the wrapped call starts with (calls/loop.py words them), and its label.
_RECOVERY_KINDS = (
    ("refused for length", "context_length"),
    ("out of memory", "out_of_memory"),
    ("transport error", "transport"),
    ("the ", "check"),  # "the N tokens that refusals implied left no room ...: sent without them once"
)


def outcome_of(exchange: Exchange) -> str:
    """``ok``, or the error's code (``request_too_large``, ``upstream_unavailable``, ``client_gone``, ...): the
    codes the proxy answers with, a fixed set."""
    if exchange.error is None:
        return "ok"
    code = exchange.error.partition(":")[0].strip()
    return code if code and code.replace("_", "").isalnum() else "error"


def recovery_kind(note: str) -> str:
    """The bounded kind of one recovery note of a wrapped call."""
    return next((kind for prefix, kind in _RECOVERY_KINDS if note.startswith(prefix)), "other")


class _Ledgers(Collector):
    """Each entry's KV ledger, read at scrape time: active tokens against the capacity, and admission."""

    def __init__(self, routes: Sequence[Route]) -> None:
        self.routes = list(routes)

    def describe(self) -> Iterable[Metric]:
        return list(self._families().values())

    def collect(self) -> Iterable[Metric]:
        families = self._families()
        for route in self.routes:
            try:
                stats = route.keeper.ledger.stats()
            except Exception:  # a Redis ledger that cannot be reached: the scrape goes on without it
                log.warning("cannot read the KV ledger of %s for /metrics", route.name, exc_info=True)
                continue
            for key, family in families.items():
                value = stats.get(key)
                if value is not None:
                    family.add_metric([route.name], float(value))
        return list(families.values())

    @staticmethod
    def _families() -> dict[str, Any]:
        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"contextkeeper_{name}", doc, labels=["entry"])

        def counter(name: str, doc: str) -> CounterMetricFamily:
            return CounterMetricFamily(f"contextkeeper_{name}", doc, labels=["entry"])

        return {
            "active": gauge("kv_active_tokens", "KV tokens held by calls in flight (prompt plus answer reserve)"),
            "capacity": gauge("kv_capacity_tokens", "KV tokens the ledger admits at once (absent: unlimited)"),
            "peak": gauge("kv_peak_tokens", "The most KV tokens held at once since start"),
            "in_flight": gauge("admission_in_flight", "Calls holding an admission now"),
            "queued": gauge("admission_queued", "Calls waiting for KV room now"),
            "admitted": counter("admission_admitted", "Calls admitted (this process)"),
            "waits": counter("admission_waits", "Admissions that had to wait for KV room (this process)"),
            "shrinks": counter("admission_shrinks", "Admissions granted less than asked, the prompt refitted"),
            "timeouts": counter("admission_timeouts", "Calls that found no KV room within admission_timeout"),
            "expired": counter("admission_expired", "Stream admissions whose lease ran out unread"),
            "rebooked": counter(
                "kv_rebooked_tickets", "Live admissions booked again after the shared ledger's Redis lost the pool"
            ),
            "rebooked_tokens": counter("kv_rebooked_tokens", "KV tokens of those admissions"),
        }


class ProxyMetrics:
    """The metrics of one proxy: an observer of its exchanges (``proxy.observe(metrics)``) and its registry."""

    def __init__(self, routes: Sequence[Route]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        entry = ["entry"]
        self.requests = Counter(
            "contextkeeper_requests",
            "Chat requests by entry, outcome and streaming",
            [*entry, "outcome", "stream"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "contextkeeper_request_seconds",
            "From a chat request's arrival to its answer's end (a stream: its last chunk)",
            entry,
            buckets=_SECONDS_UPSTREAM,
            registry=r,
        )
        self.prompt_tokens = Histogram(
            "contextkeeper_prompt_tokens",
            "Prompt tokens sent upstream per request, our exact count (_sum: all prompt tokens sent)",
            entry,
            buckets=_TOKENS,
            registry=r,
        )
        self.slot_tokens = Counter(
            "contextkeeper_slot_tokens",
            "Tokens per slot of the prompts sent (system, tools, history, request, template_overhead), the answer "
            "reserve (answer) and the tokens withheld below the limit (withheld)",
            [*entry, "slot"],
            registry=r,
        )
        self.dropped = Counter(
            "contextkeeper_messages_dropped", "Messages left out of the prompts sent", entry, registry=r
        )
        self.actions = Counter(
            "contextkeeper_strategy_actions", "Strategy actions in the fits sent", [*entry, "strategy"], registry=r
        )
        self.saved = Counter(
            "contextkeeper_strategy_saved_tokens",
            "Tokens the strategies saved in the fits sent (actions whose saving was not counted add nothing)",
            [*entry, "strategy"],
            registry=r,
        )
        self.recoveries = Counter(
            "contextkeeper_recoveries",
            "Failures a chat request recovered from and then succeeded: refusals for length (context_length), "
            "out of memory, transport errors, and checks of what refusals implied (check)",
            [*entry, "kind"],
            registry=r,
        )
        self.attempts = Counter(
            "contextkeeper_upstream_attempts", "Requests sent upstream (retries included)", entry, registry=r
        )
        self.drift = Histogram(
            "contextkeeper_drift_tokens",
            "The server's prompt count minus ours, per reply that reported its usage (no _sum: it can be negative)",
            entry,
            buckets=_DRIFT,
            registry=r,
        )
        self.last_drift = Gauge(
            "contextkeeper_drift_last_tokens", "The latest reply's drift (server count minus ours)", entry, registry=r
        )
        self.server_prompt = Counter(
            "contextkeeper_server_prompt_tokens", "Prompt tokens as the server counted them", entry, registry=r
        )
        self.completion = Counter(
            "contextkeeper_completion_tokens", "Answer tokens the server reported", entry, registry=r
        )
        self.cached = Counter(
            "contextkeeper_cached_prompt_tokens",
            "Prompt tokens the server reported reused from its prefix cache",
            entry,
            registry=r,
        )
        self.fit_seconds = Histogram(
            "contextkeeper_fit_seconds",
            "Seconds per fit (every fit of a request)",
            entry,
            buckets=_SECONDS_FIT,
            registry=r,
        )
        self.upstream_seconds = Histogram(
            "contextkeeper_upstream_seconds",
            "Seconds a request spent upstream, attempts together (a stream: to its end)",
            [*entry, "stream"],
            buckets=_SECONDS_UPSTREAM,
            registry=r,
        )
        self.registry.register(_Ledgers(routes))

    def __call__(self, exchange: Exchange) -> None:
        """Count one finished exchange."""
        entry = exchange.route or NO_ENTRY
        stream = "true" if exchange.stream else "false"
        outcome = outcome_of(exchange)
        self.requests.labels(entry, outcome, stream).inc()
        self.request_seconds.labels(entry).observe(exchange.seconds)
        for seconds in exchange.fit_seconds:
            self.fit_seconds.labels(entry).observe(seconds)
        if exchange.upstream_seconds is not None:
            self.upstream_seconds.labels(entry, stream).observe(exchange.upstream_seconds)
        call = exchange.call
        if exchange.sent:
            self.attempts.labels(entry).inc(exchange.sent)
        if call is not None:
            if call.error is None:
                for note in call.recoveries:
                    self.recoveries.labels(entry, recovery_kind(note)).inc()
            if call.drift is not None:
                self.drift.labels(entry).observe(call.drift)
                self.last_drift.labels(entry).set(call.drift)
            for counter, value in (
                (self.server_prompt, call.server_prompt_tokens),
                (self.completion, call.completion_tokens),
                (self.cached, call.cached_tokens),
            ):
                if value:
                    counter.labels(entry).inc(value)
        fit = exchange.fit
        if fit is None or call is None or exchange.sent == 0:
            return  # nothing was sent
        report = fit.report
        self.prompt_tokens.labels(entry).observe(fit.tokens)
        for slot, tokens in report.slots.items():
            if tokens:
                self.slot_tokens.labels(entry, slot).inc(tokens)
        dropped = report.messages_before - report.messages_after
        if dropped > 0:
            self.dropped.labels(entry).inc(dropped)
        for action in report.actions:
            self.actions.labels(entry, action.strategy).inc()
            if action.saved:
                self.saved.labels(entry, action.strategy).inc(max(0, action.saved))

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """The scrape's body and content type (OpenMetrics when ``accept`` asks for it)."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type

    def samples(self) -> Iterator[tuple[str, dict[str, str], float]]:
        """Every sample now, as ``(name, labels, value)`` (for tests and reports)."""
        for family in self.registry.collect():
            for sample in family.samples:
                yield sample.name, dict(sample.labels), sample.value
