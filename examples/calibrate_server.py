"""Which preprocessing does your server apply? Calibrate a keeper against a running llama-server.

    python examples/calibrate_server.py --url http://127.0.0.1:8080 --tokenizer DIR_OR_GGUF [--chat-template FILE]

First asks the server which it is (``server="auto"``, as ``keeper.wrap`` does), then prints each probe's count by
the keeper and by the server, once for the default dialect (vLLM's) and once for llama.cpp's, with the rule that
explains each difference (docs/dialects.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import openai

import contextkeeper as ck


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the server's address, e.g. http://127.0.0.1:8080")
    parser.add_argument("--tokenizer", required=True, help="tokenizer folder or .gguf file of the served model")
    parser.add_argument("--chat-template", help="the Jinja file the server was started with, if any")
    args = parser.parse_args()
    template = Path(args.chat_template).read_text(encoding="utf-8") if args.chat_template else None
    auto = ck.ContextKeeper(args.tokenizer, chat_template=template, context_window=4096, server="auto")
    auto.wrap(openai.OpenAI(base_url=f"{args.url.rstrip('/')}/v1", api_key="none", max_retries=0))
    print(f"server='auto': counts as {auto.server.name} ({auto.detection.evidence})")
    for server in (None, "llama.cpp"):
        keeper = ck.ContextKeeper(args.tokenizer, chat_template=template, context_window=4096, server=server)
        report = keeper.calibrate(args.url)
        agree = len(report.results) - len(report.differences)
        print(f"server={server!r}: dialect {report.dialect}, {agree}/{len(report.results)} probes agree")
        for result in report.results:
            print(f"  {result.probe:26} ours={result.ours!s:5} server={result.server!s:5} {result.cause}")


if __name__ == "__main__":
    main()
