"""One keeper serving several users: each chat is fitted as its own conversation (offline tokenizer).

    python examples/many_conversations.py [tokenizer-spec]

A web app keeps one keeper per model and names each chat with ``conversation=``: every chat keeps its own
window, rewrites and turn count, and a turn costs what it costs alone, whatever other chats came in between.
"""

from __future__ import annotations

import sys
import time

import contextkeeper as ck

USERS = {
    "ana": "Which documents do I need to export wine to Canada?",
    "bo": "Summarise the incident timeline for the 03:00 outage.",
    "chen": "把这份合同的付款条款翻译成英文。",  # users write in every language
}


def main() -> None:
    spec = sys.argv[1] if len(sys.argv) > 1 else "mistral:tekken"
    keeper = ck.ContextKeeper(spec, context_window=600)
    chats = {user: [{"role": "system", "content": "You are a concise assistant."}] for user in USERS}
    for turn in range(12):
        for user, question in USERS.items():  # requests from the three users arrive interleaved
            chat = chats[user]
            chat.append({"role": "user", "content": f"{question} (follow-up {turn})"})
            started = time.perf_counter()
            fit = keeper.fit(chat, max_tokens=120, conversation=user)
            took = (time.perf_counter() - started) * 1000
            if turn in (0, 11):
                print(
                    f"turn {turn:>2} {user:<5} {len(fit.messages):>2} of {len(chat):>2} messages, {fit.tokens} tokens"
                    f" ({took:.1f} ms)"
                )
            chat.append({"role": "assistant", "content": f"Answer {turn} for {user}: " + "details " * 20})
    print("conversations remembered:", ", ".join(keeper.sessions()))
    keeper.forget("bo")  # a chat that ended: its session goes (the least recently used also go past 1,024)
    print("after forget('bo'):", ", ".join(keeper.sessions()))


if __name__ == "__main__":
    main()
