"""A local transformers model wrapped by contextkeeper: every call fitted, the real KV cache measured.

    python examples/local_transformers.py --tokenizer ./qwen2.5-0.5b                # tiny random model, CPU
    python examples/local_transformers.py --model ./qwen2.5-0.5b --context 4096     # a real checkpoint

Without ``--model`` a tiny random-weight Llama is built from a config (no download), so the example runs
anywhere; its replies are noise, but the fitting and the cache measurement are real. The KV bytes the memory
model predicts for the transformers runtime are printed next to the bytes the cache really held.
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

import contextkeeper as ck
from contextkeeper.memory import kv_report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a local model folder (default: a tiny random model)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype="auto")
    else:
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
        )
        model = LlamaForCausalLM(config)
    model.eval()
    spec = ck.ModelSpec.from_config(model.config.to_dict())
    keeper = ck.ContextKeeper(tokenizer, context_window=args.context, model=spec, runtime="transformers")
    chat = keeper.wrap(model, tokenizer=tokenizer)

    history = [{"role": "system", "content": "You answer questions about the team's deployment runbook."}]
    print(f"{'turn':>4} {'sent':>4}/{'all':<4} {'prompt':>6} {'fed':>5} {'cache held':>10} {'predicted':>10}")
    for turn in range(1, args.turns + 1):
        history.append({"role": "user", "content": f"Step {turn}: what do we check before rolling out node {turn}?"})
        reply = chat(history, max_new_tokens=args.max_new_tokens)
        history.append(reply)
        call = keeper.last_call
        # The cache holds the prompt and every generated token but the last (it was never fed back).
        held = call.server_prompt_tokens + call.completion_tokens - 1
        predicted = kv_report(spec, held, runtime="transformers").bytes
        print(
            f"{turn:>4} {len(keeper.last_fit.messages):>4}/{len(history) - 1:<4} {keeper.last_fit.tokens:>6} "
            f"{call.server_prompt_tokens:>5} {call.cache_bytes:>10,} {predicted:>10,}"
        )


if __name__ == "__main__":
    main()
