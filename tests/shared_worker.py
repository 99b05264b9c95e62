"""A process of a replicated app sharing learned state through Redis, for tests/calls/test_shared_state.py.

    python tests/shared_worker.py learn REDIS_URL|off BASE_URL TOKENIZER_DIR          # one wrapped call
    python tests/shared_worker.py summarize REDIS_URL TOKENIZER_DIR READY_DIR CONV    # one fit, when 4 are ready

Prints one JSON line: what the call or the fit did.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import openai

import contextkeeper as ck
from contextkeeper.strategies.base import LLMCall
from contextkeeper.strategies.policy import Policy, PolicyStep

sys.path.insert(0, str(Path(__file__).parent))
from strategy_state import plain_chat


def learn(url: str, base_url: str, tokenizer: str) -> dict[str, object]:
    shared = False if url == "off" else url
    with ck.ContextKeeper(tokenizer, context_window=4096, shared=shared) as keeper:
        client = keeper.wrap(openai.OpenAI(base_url=base_url, api_key="test", max_retries=0), backoff=0)
        client.chat.completions.create(model="test-model", messages=plain_chat(30), max_tokens=64)
        report = keeper.last_call
        return {"attempts": report.attempts, "withheld": report.withheld, "recoveries": list(report.recoveries)}


def summarize(url: str, tokenizer: str, ready: Path, conversation: str) -> dict[str, object]:
    calls: list[float] = []

    def squares(call: LLMCall) -> str:
        """A faithful summarizer of plain_chat (every "N squared is M"), slow enough for the others to arrive."""
        calls.append(time.time())
        time.sleep(1.0)
        pairs = dict.fromkeys(re.findall(r"(\d+) squared is (\d+)", str(call.messages[1]["content"])))
        return "Answered: " + "; ".join(f"{n} squared is {m}" for n, m in pairs) + "."

    policy = Policy(name="s", steps=(PolicyStep(strategy="summarize", keep_recent=2),), horizon=0)
    with ck.ContextKeeper(tokenizer, context_window=1500, policy=policy, summarizer=squares, shared=url) as keeper:
        messages = plain_chat(12)
        keeper.count(messages)  # load everything before the common start
        (ready / str(os.getpid())).touch()
        deadline = time.monotonic() + 60
        while len(list(ready.iterdir())) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        fit = keeper.fit(messages, max_tokens=128, conversation=conversation)
        details = [a.detail for a in fit.report.actions if a.strategy == "summarize"]
        return {"calls": len(calls), "summarize": details, "tokens": fit.tokens}


def main() -> None:
    mode = sys.argv[1]
    if mode == "learn":
        result = learn(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        result = summarize(sys.argv[2], sys.argv[3], Path(sys.argv[4]), sys.argv[5])
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
