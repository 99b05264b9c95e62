"""The dedupe strategy: earlier copies of a repeated message are replaced by a marker; the latest copy stays."""

from __future__ import annotations

from contextkeeper.strategies.policy import PolicyStep
from conversations import TOOLS
from strategy_state import agent_chat, check_invariants, keeper


def test_dedupe_marks_earlier_copies() -> None:
    k = keeper(32768, PolicyStep(strategy="dedupe", when="always", min_chars=10))
    messages = agent_chat(3)
    repeated = "Please remember: my passport number is X1234567 and I prefer aisle seats."
    messages.insert(1, {"role": "user", "content": repeated})
    messages.insert(2, {"role": "assistant", "content": "Noted."})
    messages.insert(-1, {"role": "user", "content": repeated})
    messages.insert(-1, {"role": "assistant", "content": "Noted again."})
    fit = k.fit(messages, tools=TOOLS, max_tokens=512)
    check_invariants(k, messages, fit, TOOLS, 512)
    texts = [m.get("content") for m in fit.messages]
    assert texts.count(repeated) == 1
    assert texts.index(repeated) > texts.index("[repeated later in the conversation]")
