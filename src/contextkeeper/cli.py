"""The ``contextkeeper`` command line. ``--json`` prints one JSON object on stdout; without it, a table.

Every error is one line on stderr (``contextkeeper: <type>: <message>``) and exit status 2; with ``--json`` the
same error is also printed on stdout as ``{"error": {"type", "message", "fix"}}``. A plan that does not fit,
a recommendation without options and invalid policy files exit 1: they are answers, not errors.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from . import __version__
from ._exceptions import ConfigurationError, ContextKeeperError

__all__ = ["UsageError", "build_parser", "main"]


class UsageError(Exception):
    """The command line itself is wrong: an unknown option, a missing argument, a value of the wrong type."""

    def __init__(self, message: str, *, prog: str) -> None:
        self.prog = prog
        self.fix = f"see `{prog} --help`"
        super().__init__(message)

    def fix_text(self) -> str:
        return self.fix


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are exceptions, so that ``main`` reports them like any other."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message, prog=self.prog)


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Show "(default: X)" where a default is a real value, not where it is unset (None) or a flag's False."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text or not action.option_strings:
            return text
        return super()._get_help_string(action)


# ------------------------------------------------------------------------------------------------ inputs


def _read_text(path: str, what: str, setting: str) -> str:
    """The UTF-8 text of ``path``, or a ConfigurationError that says what is wrong with it."""
    file = Path(path)
    problem: str | None = None
    try:
        return file.read_text(encoding="utf-8")
    except FileNotFoundError:
        problem = "does not exist"
    except IsADirectoryError:
        problem = "is a folder, not a file"
    except PermissionError:
        problem = "cannot be read (permission denied)"
    except UnicodeDecodeError as exc:
        problem = f"is not UTF-8 text (byte {exc.start})"
    except OSError as exc:
        problem = f"cannot be read ({exc.strerror or exc})"
    if file.is_dir() and problem != "is a folder, not a file":  # Windows reports a folder as PermissionError
        problem = "is a folder, not a file"
    error = ConfigurationError(f"{what} file {path!r} {problem}. Fix: pass {setting} an existing UTF-8 {what} file")
    error.fix = f"pass {setting} an existing UTF-8 {what} file"
    raise error


def _read_json(path: str, what: str, setting: str) -> Any:
    text = _read_text(path, what, setting)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigurationError(
            f"{what} file {path!r} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}. "
            f"Fix: {setting} takes a JSON list"
        ) from None
    if not isinstance(data, list):
        raise ConfigurationError(
            f"{what} file {path!r} holds a JSON {type(data).__name__}, not a list. Fix: {setting} takes a JSON "
            f"list of {what}"
        )
    return data


def _template(args: argparse.Namespace) -> str | None:
    if not args.chat_template:
        return None
    return _read_text(args.chat_template, "chat template", "--chat-template")


def _plot_target(path: str | None) -> str | None:
    """Refuse a --plot path that cannot be written before anything is computed."""
    if path is None:
        return None
    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        raise ConfigurationError(f"--plot {path!r} is a folder. Fix: pass --plot a file name such as plan.png")
    if not folder.is_dir():
        raise ConfigurationError(
            f"--plot {path!r}: the folder {str(folder)!r} does not exist. Fix: create it, or pass --plot a path "
            "in an existing folder"
        )
    return path


def _ints(text: str | None, flag: str) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(part) for part in text.replace(" ", "").split(",") if part)
    except ValueError:
        raise ConfigurationError(
            f"{flag} expects comma-separated integers, got {text!r}. Fix: e.g. {flag} 128,256,512"
        ) from None


def _table(rows: Sequence[tuple[str, str]], title: str) -> str:
    width = max(len(k) for k, _ in rows)
    lines = [title, "-" * max(len(title), width + 12)]
    lines += [f"{k:<{width}}  {v:>10}" for k, v in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- commands


def _count(args: argparse.Namespace) -> int:
    from .tokens import breakdown, load_counter

    messages = _read_json(args.messages, "messages", "--messages")
    tools = _read_json(args.tools, "tools", "--tools") if args.tools else None
    counter = load_counter(args.tokenizer, chat_template=_template(args), view=args.view, server=args.server)
    parts = breakdown(counter, messages, tools=tools)
    if args.json:
        out = {"tokens": parts.tokens, "tokenizer": args.tokenizer, **parts.as_dict()}
        out["piece_counting"] = bool(getattr(counter, "piece_counting", False))
        print(json.dumps(out, ensure_ascii=False))
        return 0
    rows = [(slot, str(tokens)) for slot, tokens in parts.slots.items()]  # the slots `fit` names too
    rows.append(("total", f"{'~' if parts.estimated else ''}{parts.tokens}"))
    print(_table(rows, f"prompt tokens — {args.tokenizer} ({len(messages)} messages)"))
    for note in parts.notes:
        print(f"note: {note}")
    return 0


def _fit(args: argparse.Namespace) -> int:
    from .keeper import ContextKeeper

    messages = _read_json(args.messages, "messages", "--messages")
    tools = _read_json(args.tools, "tools", "--tools") if args.tools else None
    keeper = ContextKeeper(
        args.tokenizer,
        chat_template=_template(args),
        context_window=args.context,
        policy=args.policy,
        server=args.server,
    )
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
    from .strategies.policy import load_policy, validate_policy_files

    problems = {str(path): problem for path, problem in validate_policy_files(args.files)}
    results: list[dict[str, Any]] = []
    for path in args.files:
        if str(path) in problems:
            results.append({"path": str(path), "ok": False, "error": problems[str(path)]})
            continue
        policy = load_policy(path)
        steps = [step.strategy for step in policy.steps]
        results.append({"path": str(path), "ok": True, "policy": policy.name, "steps": steps})
    if args.json:
        print(json.dumps({"ok": not problems, "files": results}))
    for result in results:
        if not result["ok"]:
            print(f"invalid: {' '.join(result['error'].split())}", file=sys.stderr)
        elif not args.json:
            pipeline = " -> ".join(result["steps"]) or "(sliding window only)"
            print(f"ok: {result['path']}: policy {result['policy']!r}: {pipeline} -> sliding_window")
    return 1 if problems else 0


def _serve(args: argparse.Namespace) -> int:
    import gc
    import os

    from .proxy import Proxy, ProxyServer, default_config, load_config

    top = {
        "upstream": args.upstream,
        "api_key": args.api_key or os.environ.get("CONTEXTKEEPER_PROXY_API_KEY") or None,
        "upstream_api_key": args.upstream_api_key or os.environ.get("CONTEXTKEEPER_UPSTREAM_API_KEY") or None,
        "admin_key": args.admin_key or os.environ.get("CONTEXTKEEPER_ADMIN_KEY") or None,
        "allow_unauthenticated": True if args.allow_unauthenticated else None,
        "attempts": args.attempts,
    }
    if args.config:
        entry_flags = [
            flag
            for flag, value in (
                ("--tokenizer", args.tokenizer),
                ("--context-window", args.context_window),
                ("--chat-template", args.chat_template),
                ("--policy", args.policy),
                ("--server", args.server),
                ("--kv-capacity", args.kv_capacity),
            )
            if value is not None
        ]
        if entry_flags:
            raise ConfigurationError(
                f"serve: {', '.join(entry_flags)} describe a model entry, and --config has its own. Fix: put "
                "them in a [[models]] entry of the config file, or leave out --config"
            )
        config = load_config(args.config, **top)
    else:
        config = default_config(
            tokenizer=args.tokenizer,
            context_window=args.context_window,
            chat_template=args.chat_template,
            policy=args.policy,
            server=args.server,
            kv_capacity=args.kv_capacity,
            **top,
        )
    proxy = Proxy.from_config(config, host=args.host)
    server = ProxyServer(proxy, host=args.host, port=args.port, log_level=args.log_level, limits=config.server_limits())

    def ready(running: ProxyServer) -> None:
        # What start-up built (tokenizers, templates, imported modules: most of the heap) lives as long as this
        # process: keep it out of the collector's full passes, which otherwise walk it all and stall every request
        # for ~100 ms whenever a large request's allocations set one off.
        gc.collect()
        gc.freeze()
        entries = [route.name for route in proxy.routes]
        if args.json:
            listening = {"listening": running.base_url, "upstream": proxy.upstream, "models": entries}
            print(json.dumps(listening), flush=True)
        else:
            count = f"{len(entries)} model entr{'y' if len(entries) == 1 else 'ies'}"
            print(
                f"contextkeeper serve: listening on {running.base_url} -> {proxy.upstream} "
                f"({count}: {'; '.join(entries)})",
                flush=True,
            )

    server.on_ready = ready
    server.run()
    return 0


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
    return PlanSettings(**fields)  # validates every value (memory/limits.py)


def _plan(args: argparse.Namespace) -> int:
    from .memory import ModelSpec, plan
    from .memory.render import plan_table, plot_plan

    plot = _plot_target(args.plot)
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
    if plot:
        plot_plan(result, plot, model=model, max_context=model.max_context, **common)
    if args.json:
        print(json.dumps({**result.to_dict(), "plot": plot}))
    else:
        print(plan_table(result))
        if plot:
            print(f"plot written to {plot}")
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
        print(recommend_table(options, title, max_gpus=args.max_gpus))
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


def _profile(args: argparse.Namespace) -> int:
    from .diagnose import ProfileSettings, plot_profile, profile
    from .diagnose.profile import stderr_progress

    plot = _plot_target(args.plot)
    fields: dict[str, Any] = {}
    for name in ("lengths", "new_tokens", "batches"):
        value = _ints(getattr(args, name), "--" + name.replace("_", "-"))
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
    if plot:
        plot_profile(report, plot)
    if args.json:
        print(json.dumps({**report.to_dict(), "plot": plot}))
    else:
        print(report.table())
        if plot:
            print(f"plot written to {plot}")
    return 0


# ------------------------------------------------------------------------------------------------ parser

RUNTIME_CHOICES = "transformers | vllm | sglang | llama.cpp"
_DESCRIPTION = """\
Keep chat prompts inside the model's context and the GPU's memory: exact token counts, fitted prompts, KV-cache
plans and out-of-memory diagnostics. --json prints one JSON object on stdout; without it, a table.

Exit status: 0 answered; 1 the answer is no (a plan that does not fit, no GPU recommended, an invalid policy
file); 2 an error, printed as one line on stderr (and as {"error": {"type", "message", "fix"}} on stdout with
--json). `contextkeeper COMMAND --help` describes each command."""


def _server_option(parser: argparse.ArgumentParser) -> None:
    from .servers.dialects import DIALECTS

    parser.add_argument(
        "--server",
        choices=list(DIALECTS),
        default=None,
        help="the server whose preprocessing the count follows (default vllm; see docs/dialects.md)",
    )


def _json_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout (errors too)")


def _memory_options(parser: argparse.ArgumentParser, *, gpu: bool) -> None:
    from .memory.dtypes import kv_dtype_names, weights_dtype_names

    parser.add_argument("--model", required=True, help="config.json file or folder, hub id, or catalog name")
    parser.add_argument("--runtime", default="vllm" if gpu else "transformers", help=RUNTIME_CHOICES)
    parser.add_argument("--kv-dtype", default="auto", help=f"one of: {', '.join(kv_dtype_names())}")
    parser.add_argument("--block-size", type=int, help="vLLM block size in tokens (default: 16; MLA 64)")
    parser.add_argument("--max-num-batched-tokens", type=int, help="vLLM prefill chunk in tokens (default: 8192)")
    parser.add_argument(
        "--phase",
        choices=["plan", "steady"],
        help="vLLM sliding layers: while admitting (plan) or decoding (steady) (default: plan)",
    )
    parser.add_argument("--no-hybrid-manager", action="store_true", help="vLLM with the hybrid KV manager off")
    parser.add_argument("--n-ubatch", type=int, help="llama.cpp micro-batch (default: 512)")
    parser.add_argument("--swa-full", action="store_true", help="llama.cpp --swa-full")
    parser.add_argument("--kv-unified", action="store_true", help="llama.cpp --kv-unified (one pool for all slots)")
    _json_option(parser)
    if gpu:
        parser.add_argument("--weights-dtype", default="auto", help=f"one of: {', '.join(weights_dtype_names())}")
        parser.add_argument("--context", type=int, required=True, help="tokens per sequence")
        parser.add_argument("--concurrency", type=int, default=1, help="sequences held at once")
        parser.add_argument(
            "--gpu-memory-utilization", type=float, help="vLLM share of GPU memory, in (0, 1] (default: 0.9)"
        )
        parser.add_argument(
            "--attn-implementation", help="transformers: sdpa, eager or flash_attention_2 (default: sdpa)"
        )


def _command(sub: Any, name: str, summary: str, description: str) -> argparse.ArgumentParser:
    heading = summary[:1].upper() + summary[1:] + ("" if summary.endswith(("?", ".")) else ".")
    parser: argparse.ArgumentParser = sub.add_parser(
        name, help=summary, description=f"{heading} {description}", formatter_class=_Help
    )
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="contextkeeper", description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"contextkeeper {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    count = _command(
        sub,
        "count",
        "exact prompt tokens for a messages file, split by slot",
        "The count is the length of the token ids the model's chat template produces for these messages and "
        "tools, after the preprocessing an OpenAI-compatible server applies (--view server).",
    )
    count.add_argument("--tokenizer", required=True, help="folder, .gguf file, hub id, or mistral:<name>")
    count.add_argument("--chat-template", help="Jinja file overriding the tokenizer's chat template")
    count.add_argument("--messages", required=True, help="JSON list of OpenAI-format messages")
    count.add_argument("--tools", help="JSON list of OpenAI tool schemas")
    count.add_argument(
        "--view",
        choices=["server", "raw"],
        default="server",
        help="server: preprocess as vLLM does before templating; raw: as transformers takes them",
    )
    _server_option(count)
    _json_option(count)
    count.set_defaults(func=_count)

    fit = _command(
        sub,
        "fit",
        "the prompt that fits: reserve request, answer and tools, then fit history",
        "Prints the fitted messages (with --json), their exact token count and what each strategy did.",
    )
    fit.add_argument("--tokenizer", required=True, help="folder, .gguf file, hub id, or mistral:<name>")
    fit.add_argument("--chat-template", help="Jinja file overriding the tokenizer's chat template")
    fit.add_argument("--messages", required=True, help="JSON list of OpenAI-format messages")
    fit.add_argument("--tools", help="JSON list of OpenAI tool schemas")
    fit.add_argument("--context", type=int, required=True, help="context window in tokens")
    fit.add_argument("--max-tokens", type=int, required=True, help="tokens reserved for the answer")
    fit.add_argument("--policy", default="default", help="built-in policy name, a .toml file, or auto")
    _server_option(fit)
    _json_option(fit)
    fit.set_defaults(func=_fit)

    policy = _command(sub, "policy", "policy files", "Check the TOML files that declare a fitting pipeline.")
    policy_sub = policy.add_subparsers(dest="action", required=True, metavar="ACTION")
    validate = _command(
        policy_sub,
        "validate",
        "check policy files (TOML)",
        "Prints each file's pipeline; exit status 1 when any file is invalid (each problem on stderr).",
    )
    validate.add_argument("files", nargs="+", help="policy .toml files")
    _json_option(validate)
    validate.set_defaults(func=_policy)

    kv = _command(
        sub,
        "kv",
        "KV cache bytes of a model for tokens × sequences on a runtime",
        "Derived from the model config, per layer kind, with the runtime's block rounding, window accounting and "
        "KV dtype; per GPU under tensor parallelism.",
    )
    _memory_options(kv, gpu=False)
    kv.add_argument("--tokens", type=int, required=True, help="tokens per sequence")
    kv.add_argument("--sequences", type=int, default=1, help="sequences")
    kv.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs (vllm, sglang): bytes per GPU")
    kv.set_defaults(func=_kv)

    plan = _command(
        sub,
        "plan",
        "does this model at this context and concurrency fit this GPU?",
        "Adds weights, KV cache, runtime overhead and the prefill peak, finds the longest context and the most "
        "sequences that fit, and ranks the fixes. Exit status 1 when it does not fit.",
    )
    _memory_options(plan, gpu=True)
    plan.add_argument("--gpu", required=True, help='GPU name ("RTX 4090", "H100", "A100 40GB") or a size ("48GB")')
    plan.add_argument("--gpus", type=int, default=1, help="GPU count (tensor parallel on vllm/sglang)")
    plan.add_argument("--plot", help="write a PNG: memory by part against context length")
    plan.set_defaults(func=_plan)

    rec = _command(
        sub,
        "recommend",
        "which GPUs (model × count) fit this workload, cheapest first",
        "Plans the workload on every catalog GPU with 1, 2, 4, ... cards. Exit status 1 when none fits.",
    )
    _memory_options(rec, gpu=True)
    rec.add_argument("--max-gpus", type=int, default=8, help="most cards per option")
    rec.add_argument(
        "--kind", action="append", help="only consumer / workstation / datacenter / apple (repeatable; default: all)"
    )
    rec.set_defaults(func=_recommend)

    doctor = _command(
        sub,
        "doctor",
        "from a symptom to the memory pool that runs out, its causes and fixes",
        "With --model and --gpu (or a detected GPU) the causes get numbers from plan, the overflowing pool comes "
        "first, and fixes that alone make it fit come before those that do not.",
    )
    doctor.add_argument(
        "--symptom",
        required=True,
        help="load | long-prompt | generation | concurrent | grows-over-time | process-killed",
    )
    doctor.add_argument("--model", help="config.json file or folder, hub id, or catalog name (puts numbers on causes)")
    doctor.add_argument("--gpu", help="GPU name or size (default: with --model, this machine's GPU)")
    doctor.add_argument("--gpus", type=int, default=1, help="GPU count")
    doctor.add_argument("--context", type=int, help="tokens per sequence (default: the model's limit)")
    doctor.add_argument("--concurrency", type=int, default=1, help="sequences held at once")
    doctor.add_argument("--runtime", help=f"{RUNTIME_CHOICES} (default: all; numbers assume vllm)")
    doctor.add_argument("--kv-dtype", default="auto", help="KV cache dtype")
    doctor.add_argument("--weights-dtype", default="auto", help="weights dtype")
    doctor.add_argument("--attn-implementation", help="transformers: sdpa, eager, flash_attention_2 (default: sdpa)")
    doctor.add_argument(
        "--gpu-memory-utilization", type=float, help="vLLM share of GPU memory, in (0, 1] (default: 0.9)"
    )
    doctor.add_argument("--detect", action="store_true", help="read this machine's GPU, RAM and container limit")
    _json_option(doctor)
    doctor.set_defaults(func=_doctor)

    prof = _command(
        sub,
        "profile",
        "measure the VRAM test sequence on a local transformers model",
        "Baseline, prompts of growing length, generation and concurrency steps, each measured next to the "
        "predicted cache bytes.",
    )
    prof.add_argument("--model", required=True, help="model folder, cached hub id, config.json, or catalog name")
    prof.add_argument("--lengths", help="prompt lengths, comma-separated (default: 128,256,512,1024,2048)")
    prof.add_argument("--new-tokens", help="generation lengths, comma-separated (default: 16,64,128)")
    prof.add_argument("--batches", help="concurrency steps, comma-separated (default: 1,2,4,8)")
    prof.add_argument(
        "--batch-tokens", type=int, help="prompt length of each sequence in a batch (default: the first length)"
    )
    prof.add_argument("--generate-prompt", type=int, help="prompt length before generating (default: the first length)")
    prof.add_argument("--device", default="auto", help="cuda, cuda:1, cpu (auto: cuda when available)")
    prof.add_argument("--dtype", default="auto", help="auto (the config's), fp32, fp16, bf16")
    prof.add_argument("--attn-implementation", help="sdpa, eager, flash_attention_2 (default: sdpa)")
    prof.add_argument("--random-weights", action="store_true", help="build random weights from the config")
    prof.add_argument("--plot", help="write a PNG of the measurements")
    prof.add_argument("--quiet", action="store_true", help="no progress bar")
    prof.add_argument("--json", action="store_true", help="print one JSON object on stdout (no progress bar)")
    prof.set_defaults(func=_profile)

    serve = _command(
        sub,
        "serve",
        "an OpenAI-compatible proxy that fits every chat request",
        "Listens for /v1/chat/completions (streams included), fits each request with its own tools and "
        "max_tokens, admits it against the KV capacity and forwards it to --upstream, recovering refusals for "
        "length and retrying transport errors; the other OpenAI-compatible client routes are forwarded unchanged. "
        "Model entries come from "
        "--config (a TOML file of [[models]]) or from --tokenizer and --context-window (one entry for every model). "
        "See docs/proxy.md.",
    )
    serve.add_argument("--upstream", help="the server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
    serve.add_argument("--config", help="proxy TOML file: [[models]] entries, keys, retry bounds")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8100, help="port to listen on (0: any free port)")
    serve.add_argument("--tokenizer", help="without --config: folder, .gguf file, hub id, or mistral:<name>")
    serve.add_argument("--context-window", type=int, help="without --config: context window in tokens")
    serve.add_argument("--chat-template", help="without --config: Jinja file overriding the tokenizer's template")
    serve.add_argument("--policy", help="without --config: built-in policy name, a .toml file, or auto")
    serve.add_argument(
        "--server", help="without --config: the dialect counts follow (vllm, llama.cpp, ollama, ... or auto)"
    )
    serve.add_argument("--kv-capacity", type=int, help="without --config: the server's KV cache size in tokens")
    serve.add_argument(
        "--api-key", help="the proxy's own key (clients send it as Bearer); default $CONTEXTKEEPER_PROXY_API_KEY"
    )
    serve.add_argument(
        "--upstream-api-key", help="the key sent upstream with --api-key; default $CONTEXTKEEPER_UPSTREAM_API_KEY"
    )
    serve.add_argument(
        "--admin-key", help="reads every tenant's debug views and the metrics; default $CONTEXTKEEPER_ADMIN_KEY"
    )
    serve.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="listen beyond loopback without a proxy key (something in front authenticates)",
    )
    serve.add_argument("--attempts", type=int, help="calls per chat request, the first included (default: 4)")
    serve.add_argument(
        "--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"], help="uvicorn's"
    )
    _json_option(serve)
    serve.set_defaults(func=_serve)

    demo = _command(
        sub,
        "demo",
        "a wrapped chat fitted call by call, offline",
        "Runs a sample conversation through a keeper with an embedded tokenizer (--count: counting only).",
    )
    demo.add_argument("--count", action="store_true", help="count the sample conversation turn by turn instead")
    demo.add_argument("--tokenizer", default="mistral:tekken", help="tokenizer spec for --count")
    _json_option(demo)
    demo.set_defaults(func=_demo)
    return parser


# ------------------------------------------------------------------------------------------------ errors


def _report(exc: BaseException, *, as_json: bool) -> int:
    """One line on stderr (and the JSON error object on stdout with --json); exit status 2."""
    kind = type(exc).__name__
    message = " ".join(str(exc).split()) or kind
    fix: str | None = None
    if isinstance(exc, (ContextKeeperError, UsageError)):
        fix = exc.fix_text()
    if isinstance(exc, UsageError):
        where = exc.prog.removeprefix("contextkeeper").strip()  # "plan", "policy validate"; "" at the top level
        message = f"{where}: {message}" if where else message
    line = message if not fix or fix in message else f"{message.rstrip('.')}. Fix: {fix}"
    if as_json:
        print(json.dumps({"error": {"type": kind, "message": message, "fix": fix}}, ensure_ascii=False))
    print(f"contextkeeper: {kind}: {line}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``contextkeeper`` console script."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in arguments
    try:
        args = build_parser().parse_args(arguments)
        result: int = args.func(args)
    except BrokenPipeError:  # `contextkeeper recommend ... | head`: the reader left; that is not an error
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print("contextkeeper: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # ours or a library's: one line, never a traceback
        return _report(exc, as_json=as_json)
    return result


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
