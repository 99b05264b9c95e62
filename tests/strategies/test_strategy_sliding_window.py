"""The sliding_window strategy: it drops whole turns from the front of history, keeps the longest suffix that
fits, and leaves the slack free once it has cut."""

from __future__ import annotations

import copy
from typing import Any

import contextkeeper as ck
from contextkeeper.fit.engine import assemble
from contextkeeper.strategies import FitState, Item
from contextkeeper.strategies.sliding_window import SlidingWindow
from conversations import TOOLS
from strategy_state import agent_chat, check_invariants, keeper


def test_sliding_window_keeps_the_longest_suffix_of_whole_turns() -> None:
    k = keeper(4096)
    messages = agent_chat(30)
    original = copy.deepcopy(messages)
    fit = k.fit(messages, tools=TOOLS, max_tokens=512)
    assert messages == original  # the caller's list is never mutated
    check_invariants(k, messages, fit, TOOLS, 512)
    assert fit.messages[1]["role"] == "user"  # history starts on a user turn
    assert [a.strategy for a in fit.report.actions] == ["sliding_window"]
    # The best whole-turn suffix: one more turn would not fit.
    dropped = messages.index(fit.messages[1])
    previous_user = max(i for i in range(1, dropped) if messages[i]["role"] == "user")
    longer = [messages[0], *messages[previous_user:]]
    assert k.count(longer, tools=TOOLS) + 512 > k.limit


def test_the_window_leaves_the_slack_free_and_stops_within_the_tolerance() -> None:
    # When units must go the kept prompt ends at most at limit * (1 - slack), and either within ``tolerance`` of
    # that mark or as the longest suffix under it (one more user turn would cross the mark).
    window = SlidingWindow()
    for turns, context in ((30, 4096), (60, 6000), (90, 3000)):
        k = keeper(context)
        messages = agent_chat(turns)
        fit = k.fit(messages, tools=TOOLS, max_tokens=512)
        check_invariants(k, messages, fit, TOOLS, 512)
        assert [a.strategy for a in fit.report.actions] == ["sliding_window"]
        budget = k.limit - 512
        mark = int(budget * (1 - window.slack))
        assert fit.tokens <= mark
        if fit.tokens < mark - int(budget * window.tolerance):
            dropped = messages.index(fit.messages[1])
            previous_user = max(i for i in range(1, dropped) if messages[i]["role"] == "user")
            assert k.count([messages[0], *messages[previous_user:]], tools=TOOLS) > mark


def test_after_a_cut_the_window_leaves_the_slack_free_even_when_the_history_fits() -> None:
    counter = keeper(4096).counter
    conversation = ck.Conversation.from_messages(agent_chat(12))
    units = [tuple(Item(m, i) for i, m in zip(u.indices, u.messages, strict=True)) for u in conversation.units()]
    system, *history, request = units

    def count(kept: Any) -> int:
        return counter.count(assemble((system, *kept, request)), tools=TOOLS)

    mark = 1 - SlidingWindow().slack
    limit = int(count(history) / (1 + mark) * 2)  # the history fits, above the mark
    state = FitState(system=system, history=tuple(history), request=request, limit=limit, count=count)
    assert SlidingWindow().apply(state) is state
    cut = SlidingWindow(after_cut=True).apply(state)
    assert [a.strategy for a in cut.actions] == ["sliding_window"]
    assert cut.tokens() <= mark * limit
    assert cut.history == state.history[len(state.history) - len(cut.history) :]
