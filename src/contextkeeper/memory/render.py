"""Readable tables and plots of KV reports and plans (for the CLI and the docs)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._exceptions import ConfigurationError
from .plan import Plan, Recommendation, plan
from .runtimes import KVReport

__all__ = ["human", "kv_table", "needs_matplotlib", "plan_table", "plot_plan", "recommend_table"]


def human(n: float) -> str:
    """Bytes as GiB / MiB / KiB with two decimals."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def needs_matplotlib() -> Any:
    """The matplotlib module, or a ConfigurationError that says how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigurationError(
            "plots need matplotlib, which is not installed. Fix: pip install 'contextkeeper[plot]'"
        ) from None
    return matplotlib


def _rows(rows: Sequence[tuple[str, str]], title: str) -> str:
    width = max(len(k) for k, _ in rows)
    value_width = max(len(v) for _, v in rows)
    lines = [title, "-" * max(len(title), width + value_width + 2)]
    lines += [f"{k:<{width}}  {v:>{value_width}}" for k, v in rows]
    return "\n".join(lines)


def kv_table(report: KVReport) -> str:
    rows = [
        ("tokens × sequences", f"{report.tokens:,} × {report.sequences}"),
        ("KV dtype", report.kv_dtype),
        ("layers", ", ".join(f"{n} {kind}" for kind, n in report.layers.items())),
        *((f"  {kind} layers", human(b)) for kind, b in report.by_kind.items()),
        ("per token (long context)", f"{report.bytes_per_token:,} B"),
        ("fixed per sequence", human(report.fixed_bytes)),
        ("KV cache", f"{human(report.bytes)} ({report.bytes:,} B)"),
    ]
    title = f"KV cache — {report.model} on {report.runtime}" + (f", tp={report.tp} (per GPU)" if report.tp > 1 else "")
    text = _rows(rows, title)
    return text + "".join(f"\nnote: {note}" for note in report.notes)


def plan_table(result: Plan) -> str:
    b = result.breakdown
    gpus = f"{result.gpus} × " if result.gpus > 1 else ""
    rows = [
        ("weights", human(b.weights)),
        (f"KV cache ({result.concurrency} × {result.context:,} tokens, {result.kv_dtype})", human(b.kv_cache)),
        ("overhead", human(b.overhead)),
        ("prefill peak", human(b.prefill_peak)),
        ("total", human(b.total)),
        ("capacity", human(b.capacity)),
        ("fits", "yes" if result.fits else f"NO (short by {human(b.total - b.capacity)})"),
        (f"max context at concurrency {result.concurrency}", f"{result.max_context:,}"),
        (f"max concurrency at {result.context:,} tokens", f"{result.max_concurrency:,}"),
    ]
    title = f"plan — {result.model} on {gpus}{result.gpu} with {result.runtime} (per GPU)"
    lines = [_rows(rows, title)]
    if result.advice:
        lines.append("\nfixes, cheapest first:")
        for number, advice in enumerate(result.advice, 1):
            lines.append(f"  {number}. [{advice.cost}] {advice.action} ({advice.setting}): {advice.effect}")
    lines += [f"note: {note}" for note in result.notes]
    return "\n".join(lines)


def recommend_table(options: Sequence[Recommendation], title: str, *, max_gpus: int = 8) -> str:
    if not options:
        return f"{title}\nno GPU in the catalog fits this workload with up to {max_gpus} cards"
    width = max(len(r.gpu) for r in options)
    head = f"{'GPU':<{width}} {'count':>5} {'memory':>11} {'max context':>12} {'max conc.':>9} {'headroom':>10}"
    lines = [title, head, "-" * len(head)]
    for r in options:
        lines.append(
            f"{r.gpu:<{width}} {r.count:>5} {human(r.total_memory):>11} {r.max_context:>12,} "
            f"{r.max_concurrency:>9,} {human(r.headroom):>10}"
        )
    return "\n".join(lines)


def plot_plan(result: Plan, path: str | Path, *, model: Any, **plan_args: Any) -> Path:
    """Memory by part against context length at the plan's concurrency, the capacity line, and the total at
    other concurrency steps. Needs matplotlib (``pip install contextkeeper[plot]``)."""
    matplotlib = needs_matplotlib()

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    top = max(result.context * 2, 1024)
    limit = plan_args.pop("max_context", None) or top
    xs = sorted({int(limit * f) for f in (i / 40 for i in range(1, 41))} | {result.context})
    xs = [x for x in xs if x >= 1]
    parts: dict[str, list[float]] = {"weights": [], "overhead": [], "prefill peak": [], "KV cache": []}
    for x in xs:
        b = plan(model, context=x, concurrency=result.concurrency, advise=False, **plan_args).breakdown
        parts["weights"].append(b.weights / 2**30)
        parts["overhead"].append(b.overhead / 2**30)
        parts["prefill peak"].append(b.prefill_peak / 2**30)
        parts["KV cache"].append(b.kv_cache / 2**30)
    figure, axis = plt.subplots(figsize=(11, 5.5))
    axis.stackplot(xs, *parts.values(), labels=list(parts), alpha=0.8)
    axis.axhline(result.breakdown.capacity / 2**30, color="black", linestyle="-", label="capacity")
    for steps in (2, 4, 8, 16):
        n = result.concurrency * steps
        totals = [plan(model, context=x, concurrency=n, advise=False, **plan_args).breakdown.total / 2**30 for x in xs]
        axis.plot(xs, totals, linestyle="--", linewidth=1, label=f"total at {n} sequences")
    axis.axvline(result.context, color="grey", linestyle=":", label=f"context {result.context:,}")
    axis.set_xlabel("context per sequence (tokens)")
    axis.set_ylabel("GiB per GPU")
    axis.set_ylim(0, max(result.breakdown.capacity / 2**30 * 1.6, max(parts["weights"]) * 1.2))
    axis.set_title(
        f"{result.model} on {result.gpus} × {result.gpu} ({result.runtime}, KV {result.kv_dtype}), "
        f"{result.concurrency} sequence(s)",
        fontsize=10,
    )
    axis.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    figure.tight_layout()
    out = Path(path)
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out
