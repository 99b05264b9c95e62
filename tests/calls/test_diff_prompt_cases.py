"""diff_prompt's case analysis, case by case: one object twice in the caller's list, rewrites matched by tool call
ids, an acknowledgement that follows no summary, and the unread part of a summarised gap."""

from __future__ import annotations

from typing import Any

import pytest

from contextkeeper.calls.transcript import diff_prompt
from contextkeeper.strategies.summarize import ACKNOWLEDGEMENT, SUMMARY_PREFIX


def test_one_object_twice_in_the_inputs_is_matched_once_in_order() -> None:
    hi = {"role": "user", "content": "hi"}
    ok = {"role": "assistant", "content": "ok"}
    inputs = [{"role": "system", "content": "s"}, hi, ok, hi, ok, {"role": "user", "content": "go"}]
    assert diff_prompt(inputs, [inputs[0], hi, ok, inputs[5]]) == ((0, 1, 2, 5), (3, 4), ())
    # Out of order: the first identity anchor wins, the next must come after it.
    assert diff_prompt(inputs, [inputs[0], ok, hi, inputs[5]]) == ((0, 2, 3, 5), (1, 4), ())


def call(i: int, arguments: str) -> dict[str, Any]:
    return {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": arguments}}


def test_rewrites_are_matched_by_tool_call_ids_and_role() -> None:
    inputs = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u0"},
        {"role": "assistant", "content": None, "tool_calls": [call(1, '{"q": 1}')]},
        {"role": "tool", "tool_call_id": "c1", "content": "r1"},
        {"role": "assistant", "content": None, "tool_calls": [call(2, '{"q": 2}')]},
        {"role": "tool", "tool_call_id": "c2", "content": "r2"},
        {"role": "assistant", "content": ACKNOWLEDGEMENT},
        {"role": "user", "content": "go"},
    ]
    sent = [
        inputs[0],
        inputs[1],
        {"role": "assistant", "content": None, "tool_calls": [call(1, "{}")]},
        {"role": "tool", "tool_call_id": "c1", "content": "[cleared]"},
        inputs[4],
        {"role": "tool", "tool_call_id": "c9", "content": "another call's result"},  # stands for no input
        {"role": "assistant", "content": "changed"},  # no summary before it: a rewrite of the nearest assistant
        inputs[7],
    ]
    assert diff_prompt(inputs, sent) == ((0, 1, 4, 7), (5,), (2, 3, 6))


@pytest.mark.parametrize(
    ("unread", "expected"),
    [
        (0, ((5,), (4,), (0, 1, 2, 3))),
        (2, ((5,), (0, 1, 4), (2, 3))),
        (10, ((5,), (0, 1, 2, 4), (3,))),
        (-3, ((5,), (4,), (0, 1, 2, 3))),
    ],
)
def test_a_summarised_gap_leaves_out_only_what_was_never_read(
    unread: int, expected: tuple[tuple[int, ...], ...]
) -> None:
    inputs = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(6)]
    sent = [
        {"role": "assistant", "content": ACKNOWLEDGEMENT},  # first in the prompt: follows no summary
        {"role": "user", "content": SUMMARY_PREFIX + "m0 .. m4"},
        {"role": "assistant", "content": ACKNOWLEDGEMENT},
        inputs[5],
    ]
    assert diff_prompt(inputs, sent, unread=unread) == expected
