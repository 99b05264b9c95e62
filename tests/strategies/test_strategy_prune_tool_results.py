"""The prune_tool_results strategy: old tool results are cleared in batches, pairs are kept, excluded tools are
never cleared, and what was cleared stays cleared on the next turn."""

from __future__ import annotations

from contextkeeper.strategies.policy import PolicyStep
from conversations import TOOLS
from strategy_state import agent_chat, check_invariants, keeper


def test_prune_clears_old_results_in_batches_and_keeps_pairs() -> None:
    k = keeper(6000, PolicyStep(strategy="prune_tool_results", keep_last=2, clear_at_least=500))
    messages = agent_chat(25)
    fit = k.fit(messages, tools=TOOLS, max_tokens=512)
    check_invariants(k, messages, fit, TOOLS, 512)
    cleared = [m for m in fit.messages if m["role"] == "tool" and str(m["content"]).startswith("[tool result cleared")]
    kept = [m for m in fit.messages if m["role"] == "tool" and not str(m["content"]).startswith("[tool result")]
    assert cleared
    assert len(kept) >= 2
    prune = next(a for a in fit.report.actions if a.strategy == "prune_tool_results")
    assert prune.saved > 0
    # Cleared results stay cleared next turn (stable prefix), even though the new turn alone is below the batch.
    messages2 = [*messages, {"role": "assistant", "content": "Booked."}, {"role": "user", "content": "Thanks!"}]
    fit2 = k.fit(messages2, tools=TOOLS, max_tokens=512)
    cleared2 = [
        m for m in fit2.messages if m["role"] == "tool" and str(m["content"]).startswith("[tool result cleared")
    ]
    assert {m["tool_call_id"] for m in cleared} <= {m["tool_call_id"] for m in cleared2} | {
        m["tool_call_id"] for m in messages if m not in fit2.messages and m["role"] == "tool"
    }


def test_prune_excluded_tools_are_never_cleared() -> None:
    k = keeper(
        6000,
        PolicyStep(strategy="prune_tool_results", keep_last=0, clear_at_least=0, exclude_tools=("search_flights",)),
    )
    fit = k.fit(agent_chat(25), tools=TOOLS, max_tokens=512)
    assert not any(str(m.get("content")).startswith("[tool result cleared") for m in fit.messages)
