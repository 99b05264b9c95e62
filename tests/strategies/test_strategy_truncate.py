"""The truncate strategy: an oversize message is cut to an exact token cap, and says how much it cut."""

from __future__ import annotations

from contextkeeper.strategies.policy import PolicyStep
from conversations import TOOLS
from strategy_state import agent_chat, check_invariants, keeper


def test_truncate_cuts_to_an_exact_cap() -> None:
    k = keeper(32768, PolicyStep(strategy="truncate", max_tokens=200, when="always"))
    messages = agent_chat(2, result_words=2000)
    fit = k.fit(messages, tools=TOOLS, max_tokens=512)
    check_invariants(k, messages, fit, TOOLS, 512)
    tool_texts = [m["content"] for m in fit.messages if m["role"] == "tool"]
    counter = k.counter
    assert all(counter.text_tokens(t) <= 200 for t in tool_texts)  # type: ignore[attr-defined]
    assert all("characters cut" in t for t in tool_texts)
    assert max(counter.text_tokens(t) for t in tool_texts) >= 190  # type: ignore[attr-defined]  # as long as the cap allows
