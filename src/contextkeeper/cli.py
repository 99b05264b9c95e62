"""The ``contextkeeper`` command line. ``--json`` prints one JSON object on stdout; without it, a table."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._exceptions import ContextKeeperError

__all__ = ["main"]


def _read_json(path: str, what: str) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise SystemExit(f"contextkeeper: {what} file {path!r} does not exist") from exc
    except json.JSONDecodeError as exc:
        raise SystemExit(f"contextkeeper: {what} file {path!r} is not valid JSON: {exc}") from exc


def _table(rows: Sequence[tuple[str, str]], title: str) -> str:
    width = max(len(k) for k, _ in rows)
    lines = [title, "-" * max(len(title), width + 12)]
    lines += [f"{k:<{width}}  {v:>10}" for k, v in rows]
    return "\n".join(lines)


def _count(args: argparse.Namespace) -> int:
    from .tokens import breakdown, load_counter

    messages = _read_json(args.messages, "messages")
    tools = _read_json(args.tools, "tools") if args.tools else None
    template = Path(args.chat_template).read_text(encoding="utf-8") if args.chat_template else None
    counter = load_counter(args.tokenizer, chat_template=template, view=args.view)
    parts = breakdown(counter, messages, tools=tools)
    if args.json:
        out = {"tokens": parts.tokens, "tokenizer": args.tokenizer, **parts.as_dict()}
        out["piece_counting"] = bool(getattr(counter, "piece_counting", False))
        print(json.dumps(out, ensure_ascii=False))
        return 0
    rows = [
        ("system", str(parts.system)),
        ("tools", str(parts.tools)),
        ("history", str(parts.history)),
        ("request", str(parts.request)),
        ("template overhead", str(parts.template_overhead)),
        ("total", f"{'~' if parts.estimated else ''}{parts.tokens}"),
    ]
    print(_table(rows, f"prompt tokens — {args.tokenizer} ({len(messages)} messages)"))
    for note in parts.notes:
        print(f"note: {note}")
    return 0


def _fit(args: argparse.Namespace) -> int:
    from .keeper import ContextKeeper

    messages = _read_json(args.messages, "messages")
    tools = _read_json(args.tools, "tools") if args.tools else None
    template = Path(args.chat_template).read_text(encoding="utf-8") if args.chat_template else None
    keeper = ContextKeeper(args.tokenizer, chat_template=template, context_window=args.context, policy=args.policy)
    fit = keeper.fit(messages, tools=tools, max_tokens=args.max_tokens)
    if args.json:
        print(json.dumps({"messages": fit.messages, "tokens": fit.tokens, "report": fit.report.to_dict()}))
        return 0
    report = fit.report
    rows = [(slot, str(tokens)) for slot, tokens in report.slots.items()]
    rows += [
        ("prompt", str(fit.tokens)),
        ("limit", f"{report.limit} ({report.limit_source})"),
        ("messages", f"{report.messages_before} -> {report.messages_after}"),
    ]
    if report.tokens_before is not None:
        rows.append(("prompt before", str(report.tokens_before)))
    print(_table(rows, f"fit — {args.tokenizer}, policy {report.policy}, {report.seconds * 1000:.0f} ms"))
    for action in report.actions:
        saved = f"saved {action.saved} tokens" if action.saved is not None else "the history before it was not counted"
        print(f"{action.strategy}: {action.detail} ({saved})")
    for note in report.notes:
        print(f"note: {note}")
    return 0


def _policy(args: argparse.Namespace) -> int:
    from .policy import load_policy, validate_policy_files

    problems = validate_policy_files(args.files)
    for _, problem in problems:
        print(f"invalid: {problem}", file=sys.stderr)
    for path in args.files:
        if all(str(path) != str(bad) for bad, _ in problems):
            policy = load_policy(path)
            steps = " -> ".join(step.strategy for step in policy.steps) or "(sliding window only)"
            print(f"ok: {path}: policy {policy.name!r}: {steps} -> sliding_window")
    return 1 if problems else 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_count_demo, run_demo

    if args.count:
        return run_count_demo(tokenizer=args.tokenizer, as_json=args.json)
    return run_demo(as_json=args.json)


def _runtime_settings(args: argparse.Namespace) -> dict[str, Any]:
    settings: dict[str, Any] = {}
    for name in ("block_size", "max_num_batched_tokens", "phase", "n_ubatch"):
        value = getattr(args, name, None)
        if value is not None:
            settings[name] = value
    if getattr(args, "no_hybrid_manager", False):
        settings["hybrid_manager"] = False
    if getattr(args, "swa_full", False):
        settings["swa_full"] = True
    if getattr(args, "kv_unified", False):
        settings["kv_unified"] = True
    return settings


def _kv(args: argparse.Namespace) -> int:
    from .memory import ModelSpec
    from .memory.render import kv_table

    model = ModelSpec.from_config(args.model)
    report = model.kv(
        args.tokens,
        args.sequences,
        runtime=args.runtime,
        kv_dtype=args.kv_dtype,
        tp=args.tp,
        **_runtime_settings(args),
    )
    if args.json:
        print(json.dumps({**report.to_dict(), "max_context": model.max_context, "source": model.source}))
    else:
        print(kv_table(report))
    return 0


def _plan_settings(args: argparse.Namespace) -> Any:
    from .memory import PlanSettings

    fields: dict[str, Any] = {}
    if args.gpu_memory_utilization is not None:
        fields["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.max_num_batched_tokens is not None:
        fields["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.attn_implementation is not None:
        fields["attn_implementation"] = args.attn_implementation
    return PlanSettings(**fields)


def _plan(args: argparse.Namespace) -> int:
    from .memory import ModelSpec, plan
    from .memory.render import plan_table, plot_plan

    model = ModelSpec.from_config(args.model)
    common: dict[str, Any] = {
        "gpu": args.gpu,
        "gpus": args.gpus,
        "runtime": args.runtime,
        "kv_dtype": args.kv_dtype,
        "weights_dtype": args.weights_dtype,
        "settings": _plan_settings(args),
        **_runtime_settings(args),
    }
    result = plan(model, context=args.context, concurrency=args.concurrency, **common)
    if args.plot:
        plot_plan(result, args.plot, model=model, max_context=model.max_context, **common)
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(plan_table(result))
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0 if result.fits else 1


def _recommend(args: argparse.Namespace) -> int:
    from .memory import ModelSpec, recommend
    from .memory.render import recommend_table

    model = ModelSpec.from_config(args.model)
    options = recommend(
        model,
        context=args.context,
        concurrency=args.concurrency,
        runtime=args.runtime,
        kv_dtype=args.kv_dtype,
        weights_dtype=args.weights_dtype,
        max_gpus=args.max_gpus,
        kinds=tuple(args.kind) if args.kind else None,
        settings=_plan_settings(args),
        **_runtime_settings(args),
    )
    if args.json:
        print(json.dumps({"model": model.name, "options": [o.to_dict() for o in options]}))
    else:
        title = (
            f"GPUs for {model.name}: {args.concurrency} × {args.context:,} tokens on {args.runtime}, "
            "cheapest first by total memory"
        )
        print(recommend_table(options, title))
    return 0 if options else 1


def _doctor(args: argparse.Namespace) -> int:
    from .diagnose import Facts, diagnose

    facts = Facts(
        model=args.model,
        gpu=args.gpu,
        gpus=args.gpus,
        context=args.context,
        concurrency=args.concurrency,
        runtime=args.runtime,
        kv_dtype=args.kv_dtype,
        weights_dtype=args.weights_dtype,
        attn_implementation=args.attn_implementation,
        gpu_memory_utilization=args.gpu_memory_utilization,
        detect=args.detect or (args.model is not None and args.gpu is None),  # a model alone: this machine's GPU
    )
    result = diagnose(args.symptom, facts)
    print(json.dumps(result.to_dict()) if args.json else result.table())
    return 0


def _ints(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(part) for part in text.replace(" ", "").split(",") if part)
    except ValueError as exc:
        raise SystemExit(f"contextkeeper: expected comma-separated integers, got {text!r}") from exc


def _profile(args: argparse.Namespace) -> int:
    from .diagnose import ProfileSettings, plot_profile, profile
    from .diagnose.profile import stderr_progress

    fields: dict[str, Any] = {}
    for name in ("lengths", "new_tokens", "batches"):
        value = _ints(getattr(args, name))
        if value is not None:
            fields[name] = value
    if args.batch_tokens is not None:
        fields["batch_tokens"] = args.batch_tokens
    if args.generate_prompt is not None:
        fields["generate_prompt"] = args.generate_prompt
    report = profile(
        args.model,
        settings=ProfileSettings(**fields),
        device=args.device,
        dtype=args.dtype,
        random_weights=args.random_weights,
        attn_implementation=args.attn_implementation,
        progress=None if (args.json or args.quiet) else stderr_progress(),
    )
    if args.plot:
        plot_profile(report, args.plot)
    if args.json:
        print(json.dumps({**report.to_dict(), "plot": args.plot}))
    else:
        print(report.table())
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0


def _memory_options(parser: argparse.ArgumentParser, *, gpu: bool) -> None:
    from .memory.dtypes import kv_dtype_names, weights_dtype_names

    parser.add_argument("--model", required=True, help="config.json file or folder, hub id, or catalog name")
    parser.add_argument(
        "--runtime", default="vllm" if gpu else "transformers", help="transformers | vllm | sglang | llama.cpp"
    )
    parser.add_argument("--kv-dtype", default="auto", help=f"one of: {', '.join(kv_dtype_names())}")
    parser.add_argument("--block-size", type=int, help="vLLM block size in tokens (default 16; MLA 64)")
    parser.add_argument("--max-num-batched-tokens", type=int, help="vLLM prefill chunk (default 8192)")
    parser.add_argument("--phase", choices=["plan", "steady"], help="vLLM sliding layers: while admitting or decoding")
    parser.add_argument("--no-hybrid-manager", action="store_true", help="vLLM with the hybrid KV manager off")
    parser.add_argument("--n-ubatch", type=int, help="llama.cpp micro-batch (default 512)")
    parser.add_argument("--swa-full", action="store_true", help="llama.cpp --swa-full")
    parser.add_argument("--kv-unified", action="store_true", help="llama.cpp --kv-unified (one pool for all slots)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    if gpu:
        parser.add_argument("--weights-dtype", default="auto", help=f"one of: {', '.join(weights_dtype_names())}")
        parser.add_argument("--context", type=int, required=True, help="tokens per sequence")
        parser.add_argument("--concurrency", type=int, default=1, help="sequences held at once")
        parser.add_argument("--gpu-memory-utilization", type=float, help="vLLM share of GPU memory (default 0.9)")
        parser.add_argument("--attn-implementation", help="transformers: sdpa (default), eager, flash_attention_2")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="contextkeeper", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    count = sub.add_parser("count", help="exact prompt tokens for a messages file, split by slot")
    count.add_argument("--tokenizer", required=True, help="folder, .gguf file, hub id, or mistral:<name>")
    count.add_argument("--chat-template", help="Jinja file overriding the tokenizer's chat template")
    count.add_argument("--messages", required=True, help="JSON list of OpenAI-format messages")
    count.add_argument("--tools", help="JSON list of OpenAI tool schemas")
    count.add_argument(
        "--view",
        choices=["server", "raw"],
        default="server",
        help="server: preprocess as vLLM does before templating (default); raw: as transformers takes them",
    )
    count.add_argument("--json", action="store_true", help="print one JSON object")
    count.set_defaults(func=_count)

    fit = sub.add_parser("fit", help="the prompt that fits: reserve request, answer and tools, then fit history")
    fit.add_argument("--tokenizer", required=True, help="folder, .gguf file, hub id, or mistral:<name>")
    fit.add_argument("--chat-template", help="Jinja file overriding the tokenizer's chat template")
    fit.add_argument("--messages", required=True, help="JSON list of OpenAI-format messages")
    fit.add_argument("--tools", help="JSON list of OpenAI tool schemas")
    fit.add_argument("--context", type=int, required=True, help="context window in tokens")
    fit.add_argument("--max-tokens", type=int, required=True, help="tokens reserved for the answer")
    fit.add_argument("--policy", default="default", help="built-in policy name, a .toml file, or auto")
    fit.add_argument("--json", action="store_true", help="print one JSON object")
    fit.set_defaults(func=_fit)

    policy = sub.add_parser("policy", help="policy files")
    policy_sub = policy.add_subparsers(dest="action", required=True)
    validate = policy_sub.add_parser("validate", help="check policy files (TOML); exit 1 on any error")
    validate.add_argument("files", nargs="+", help="policy .toml files")
    validate.set_defaults(func=_policy)

    kv = sub.add_parser("kv", help="KV cache bytes of a model for tokens × sequences on a runtime")
    _memory_options(kv, gpu=False)
    kv.add_argument("--tokens", type=int, required=True, help="tokens per sequence")
    kv.add_argument("--sequences", type=int, default=1, help="sequences (default 1)")
    kv.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs (vllm, sglang): bytes per GPU")
    kv.set_defaults(func=_kv)

    plan = sub.add_parser("plan", help="does this model at this context and concurrency fit this GPU?")
    _memory_options(plan, gpu=True)
    plan.add_argument("--gpu", required=True, help='GPU name ("RTX 4090", "H100", "A100 40GB") or a size ("48GB")')
    plan.add_argument("--gpus", type=int, default=1, help="GPU count (tensor parallel on vllm/sglang)")
    plan.add_argument("--plot", help="write a PNG: memory by part against context length")
    plan.set_defaults(func=_plan)

    rec = sub.add_parser("recommend", help="which GPUs (model × count) fit this workload, cheapest first")
    _memory_options(rec, gpu=True)
    rec.add_argument("--max-gpus", type=int, default=8, help="most cards per option (default 8)")
    rec.add_argument("--kind", action="append", help="only consumer / workstation / datacenter / apple (repeatable)")
    rec.set_defaults(func=_recommend)

    doctor = sub.add_parser("doctor", help="from a symptom to the memory pool that runs out, its causes and fixes")
    doctor.add_argument(
        "--symptom",
        required=True,
        help="load | long-prompt | generation | concurrent | grows-over-time | process-killed",
    )
    doctor.add_argument("--model", help="config.json file or folder, hub id, or catalog name (puts numbers on causes)")
    doctor.add_argument("--gpu", help="GPU name or size; without it, --model uses this machine's GPU")
    doctor.add_argument("--gpus", type=int, default=1, help="GPU count (default 1)")
    doctor.add_argument("--context", type=int, help="tokens per sequence (default: the model's limit)")
    doctor.add_argument("--concurrency", type=int, default=1, help="sequences held at once (default 1)")
    doctor.add_argument("--runtime", help="transformers | vllm | sglang | llama.cpp (default: all; numbers: vllm)")
    doctor.add_argument("--kv-dtype", default="auto", help="KV cache dtype (default auto)")
    doctor.add_argument("--weights-dtype", default="auto", help="weights dtype (default auto)")
    doctor.add_argument("--attn-implementation", help="transformers: sdpa, eager, flash_attention_2")
    doctor.add_argument("--gpu-memory-utilization", type=float, help="vLLM share of GPU memory (default 0.9)")
    doctor.add_argument("--detect", action="store_true", help="read this machine's GPU, RAM and container limit")
    doctor.add_argument("--json", action="store_true", help="print one JSON object")
    doctor.set_defaults(func=_doctor)

    prof = sub.add_parser("profile", help="measure the VRAM test sequence on a local transformers model")
    prof.add_argument("--model", required=True, help="model folder, cached hub id, config.json, or catalog name")
    prof.add_argument("--lengths", help="prompt lengths, comma-separated (default 128,256,512,1024,2048)")
    prof.add_argument("--new-tokens", help="generation lengths, comma-separated (default 16,64,128)")
    prof.add_argument("--batches", help="concurrency steps, comma-separated (default 1,2,4,8)")
    prof.add_argument(
        "--batch-tokens", type=int, help="prompt length of each sequence in a batch (default: first length)"
    )
    prof.add_argument("--generate-prompt", type=int, help="prompt length before generating (default: first length)")
    prof.add_argument("--device", default="auto", help="cuda, cuda:1, cpu (default: cuda when available)")
    prof.add_argument("--dtype", default="auto", help="auto (the config's), fp32, fp16, bf16")
    prof.add_argument("--attn-implementation", help="sdpa (default), eager, flash_attention_2")
    prof.add_argument("--random-weights", action="store_true", help="build random weights from the config")
    prof.add_argument("--plot", help="write a PNG of the measurements")
    prof.add_argument("--quiet", action="store_true", help="no progress bar")
    prof.add_argument("--json", action="store_true", help="print one JSON object (no progress bar)")
    prof.set_defaults(func=_profile)

    demo = sub.add_parser("demo", help="a wrapped chat fitted call by call, offline (--count: counting only)")
    demo.add_argument("--count", action="store_true", help="count the sample conversation turn by turn instead")
    demo.add_argument(
        "--tokenizer", default="mistral:tekken", help="tokenizer spec for --count (default: mistral:tekken)"
    )
    demo.add_argument("--json", action="store_true", help="print one JSON object")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``contextkeeper`` console script."""
    args = build_parser().parse_args(argv)
    try:
        result: int = args.func(args)
    except ContextKeeperError as exc:
        print(f"contextkeeper: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `contextkeeper recommend ... | head`: the reader left; that is not an error
        sys.stderr.close()
        return 0
    return result


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
