"""A chat loop against any OpenAI-compatible server (vLLM, SGLang, llama.cpp's server, Ollama, OpenAI), with
every call fitted by contextkeeper first.

    python examples/openai_chat_loop.py --base-url http://localhost:8000/v1 --model Qwen/Qwen2.5-7B-Instruct \
        --tokenizer ./qwen2.5-7b --context 8192 --turns 50

The keeper counts with the model's own tokenizer and template (a folder, .gguf file or hub id), keeps the
answer's max_tokens free, learns the server's real limit and hidden tokens from its refusals and from
usage.prompt_tokens, and keeps a transcript of everything trimmed (``--transcript chat.sqlite`` keeps it on disk).
"""

from __future__ import annotations

import argparse
import logging

import openai

import contextkeeper as ck


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", default="default")
    parser.add_argument("--tokenizer", required=True, help="tokenizer folder, .gguf file, hub id or mistral:<name>")
    parser.add_argument("--context", type=int, default=8192, help="the server's context length (max_model_len)")
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--transcript", default=None, help="a SQLite file for the transcript (default: memory)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    with ck.ContextKeeper(args.tokenizer, context_window=args.context, transcript=args.transcript) as keeper:
        client = keeper.wrap(openai.OpenAI(base_url=args.base_url, api_key="not-needed", max_retries=0))
        history = [{"role": "system", "content": "You are a concise assistant for a logistics team."}]
        print(f"{'turn':>4} {'history':>7} {'sent':>5} {'tokens':>6} {'server':>6} {'attempts':>8}  actions")
        for turn in range(1, args.turns + 1):
            history.append(
                {
                    "role": "user",
                    "content": f"Shipment {turn}: 40 pallets from Rotterdam to Lyon, due in {turn % 9 + 2} days. "
                    "Summarise the risks, the customs steps and the cheapest carrier option in detail.",
                }
            )
            reply = client.chat.completions.create(model=args.model, messages=history, max_tokens=args.max_tokens)
            history.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
            fit, call = keeper.last_fit, keeper.last_call
            actions = ", ".join(a.strategy for a in fit.report.actions) or "-"
            print(
                f"{turn:>4} {len(history) - 1:>7} {len(fit.messages):>5} {fit.tokens:>6} "
                f"{call.server_prompt_tokens!s:>6} {call.attempts:>8}  {actions}"
            )
        entries = keeper.transcript.entries()
        print(
            f"\n{len(entries)} calls; {sum(len(e.removed) for e in entries)} message slots left out of prompts, "
            f"all recoverable with keeper.transcript.recover(call); server offset learned: {call.withheld} tokens"
        )


if __name__ == "__main__":
    main()
