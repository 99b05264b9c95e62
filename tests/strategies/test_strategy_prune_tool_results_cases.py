"""prune_tool_results on a hand-made state, case by case: which results it picks (newest kept, excluded tools,
placeholders, the batch threshold, results cleared before), what ``clear_inputs`` does to the calls' arguments
(text or object), and that units it leaves alone stay the very same tuples."""

from __future__ import annotations

import json
from typing import Any

import strategy_state
from contextkeeper import Message
from contextkeeper.strategies import FitState, Memory
from contextkeeper.strategies.prune_tool_results import Cleared, PruneToolResults


class CharCounter:
    """A token per 4 characters of the messages' JSON: enough to see what a clearing saves."""

    def count(self, messages: list[Message]) -> int:
        return sum(len(json.dumps(message.to_dict())) for message in messages) // 4


def call(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def result(call_id: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def make_state(memory: Memory | None = None) -> FitState:
    history = [
        [{"role": "user", "content": "Look these up, then book."}],
        [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [call("c1", "search", '{"q": "x"}'), call("c2", "book", {"seat": "12A"})],
            },
            result("c1", "x" * 400),
            result("c2", "y" * 400),
        ],
        [{"role": "assistant", "content": None, "tool_calls": [call("c3", "search", '{"q": "z"}')]}, result("c3", "")],
        [
            {"role": "assistant", "content": None, "tool_calls": [call("c5", "lookup", '{"k": 1}')]},
            result("c5", "w" * 400),
        ],
        [
            {"role": "assistant", "content": None, "tool_calls": [call("c4", "weather", '{"at": "Oslo"}')]},
            result("c4", "z" * 400),
        ],
    ]
    history[2][1]["content"] = "[tool result cleared: search, 5 characters]"  # cleared in an earlier fit
    return strategy_state.make_state(
        CharCounter(),
        {"role": "system", "content": "s"},
        history,
        {"role": "user", "content": "go"},
        limit=10**6,
        memory=memory if memory is not None else Memory(),
    )


def contents(state: FitState) -> list[list[Any]]:
    return [[item.message.to_dict().get("content") for item in unit] for unit in state.history]


def arguments(state: FitState) -> dict[str, Any]:
    return {
        call["id"]: call["function"]["arguments"]
        for unit in state.history
        for item in unit
        for call in item.message.to_dict().get("tool_calls") or ()
    }


def test_old_results_are_cleared_with_their_calls_arguments() -> None:
    strategy = PruneToolResults(keep_last=1, exclude_tools=("lookup",), clear_at_least=0, clear_inputs=True)
    state = make_state()
    cleared = strategy.apply(state)
    assert contents(cleared) == [
        ["Look these up, then book."],
        [None, "[tool result cleared: search, 400 characters]", "[tool result cleared: book, 400 characters]"],
        [None, "[tool result cleared: search, 5 characters]"],
        [None, "w" * 400],
        [None, "z" * 400],
    ]
    assert arguments(cleared) == {
        "c1": "{}",  # (text stays text, an object an object)
        "c2": {},
        "c3": '{"q": "z"}',
        "c5": '{"k": 1}',
        "c4": '{"at": "Oslo"}',
    }
    assert [new is old for new, old in zip(cleared.history, state.history, strict=True)] == [
        True,
        False,
        True,
        True,
        True,
    ]
    assert cleared.memory.slot(Cleared) == {"c1", "c2"}
    (action,) = cleared.actions
    assert (action.strategy, action.units) == ("prune_tool_results", 2)
    assert action.detail == "cleared 2 old tool result(s), kept the newest 1"
    assert action.saved is not None
    assert action.saved > 0


def test_the_batch_threshold_holds_back_only_results_not_cleared_before() -> None:
    strategy = PruneToolResults(keep_last=1, clear_at_least=10_000, placeholder="CLEARED {tool}")
    state = make_state()
    assert strategy.apply(state) is state  # 300 estimated tokens: below the batch
    memory = Memory()
    memory.put(Cleared({"c2"}))
    state = make_state(memory)
    cleared = strategy.apply(state)
    assert contents(cleared)[1] == [None, "x" * 400, "CLEARED book"]
    assert arguments(cleared)["c2"] == {"seat": "12A"}  # (clear_inputs is off)
    assert cleared.memory.slot(Cleared) == {"c2"}
    # A result that starts like this placeholder is never cleared again, whatever the memory says.
    again = strategy.apply(cleared)
    assert contents(again) == contents(cleared)


def test_reapply_clears_again_only_what_was_cleared_before() -> None:
    strategy = PruneToolResults(keep_last=0, clear_at_least=0)
    memory = Memory()
    memory.put(Cleared({"c5"}))
    state = make_state(memory)
    cleared = strategy.reapply(state)
    assert contents(cleared) == [
        ["Look these up, then book."],
        [None, "x" * 400, "y" * 400],
        [None, "[tool result cleared: search, 5 characters]"],
        [None, "[tool result cleared: lookup, 400 characters]"],
        [None, "z" * 400],
    ]
    fresh = make_state()
    assert strategy.reapply(fresh) is fresh
