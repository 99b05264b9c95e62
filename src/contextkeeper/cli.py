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


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(tokenizer=args.tokenizer, as_json=args.json)


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

    demo = sub.add_parser("demo", help="count a sample agent conversation offline, turn by turn")
    demo.add_argument("--tokenizer", default="mistral:tekken", help="tokenizer spec (default: mistral:tekken)")
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
    return result


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
