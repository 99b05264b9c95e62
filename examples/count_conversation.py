"""Count a conversation exactly, slot by slot, with a tokenizer that mistral-common ships (offline).

    python examples/count_conversation.py [tokenizer-spec]

Any spec works: a tokenizer folder, a .gguf file, a hub id, or mistral:<name>.
"""

from __future__ import annotations

import sys

import contextkeeper as ck
from contextkeeper.demo import load_sample


def main() -> None:
    spec = sys.argv[1] if len(sys.argv) > 1 else "mistral:tekken"
    messages, tools = load_sample()
    counter = ck.load_counter(spec)

    parts = ck.breakdown(counter, messages, tools=tools)
    print(f"{spec}: {parts.tokens} prompt tokens for {len(messages)} messages and {len(tools)} tools")
    for slot in ("system", "tools", "history", "request", "template_overhead"):
        print(f"  {slot:<18} {getattr(parts, slot):>6}")

    # A new turn: only its own text is new to the counter.
    follow_up = [*messages, {"role": "assistant", "content": "Economy: 23 kg checked, 12 kg cabin."}]
    follow_up.append({"role": "user", "content": "Great, hold it."})
    print(f"after one more turn: {counter.count(follow_up, tools=tools)} tokens")


if __name__ == "__main__":
    main()
