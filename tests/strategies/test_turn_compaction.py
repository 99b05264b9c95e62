"""An agent loop whose current turn (one user message, many tool rounds) alone outgrows the context: its older
tool rounds give way, oldest first, and the user's message and the last round stay verbatim."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

import contextkeeper as ck

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_log",
            "description": "Read a service's log.",
            "parameters": {"type": "object", "properties": {"service": {"type": "string"}}},
        },
    }
]


def agent_turn(rounds: int, lines: int = 24) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are an on-call assistant."},
        {"role": "user", "content": "An earlier question."},
        {"role": "assistant", "content": "An earlier answer."},
        {"role": "user", "content": "Find the errors across all services."},
    ]
    for r in range(rounds):
        call_id = f"call{r:05d}"  # Mistral tokenizers need 9-character ids
        arguments = json.dumps({"service": f"svc{r}"})
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": call_id, "type": "function", "function": {"name": "read_log", "arguments": arguments}}
                ],
            }
        )
        log = "\n".join(
            f"svc{r} line {i} latency_ms={(i * 37) % 900} status={500 if i % 7 == 0 else 200}" for i in range(lines)
        )
        messages.append({"role": "tool", "tool_call_id": call_id, "content": log})
    return messages


@pytest.fixture(scope="module")
def keeper() -> ck.ContextKeeper:
    return ck.ContextKeeper("mistral:tekken", context_window=4096)


def test_a_turn_that_fits_is_left_alone(keeper: ck.ContextKeeper) -> None:
    messages = agent_turn(3)
    fit = keeper.fresh().fit(messages, tools=TOOLS, max_tokens=512)
    assert fit.messages[3:] == messages[3:]


def test_an_oversize_turn_clears_its_oldest_results(keeper: ck.ContextKeeper) -> None:
    messages = agent_turn(12)
    before = copy.deepcopy(messages)
    fit = keeper.fresh().fit(messages, tools=TOOLS, max_tokens=512)
    assert messages == before  # the caller's list is untouched
    assert fit.tokens + 512 <= 4096
    assert fit.tokens == keeper.counter.count(fit.messages, tools=TOOLS)
    user = next(i for i, m in enumerate(fit.messages) if m["content"] == "Find the errors across all services.")
    assert fit.messages[user] is messages[3]  # the user's request, verbatim
    assert fit.messages[-2:] == messages[-2:]  # the round the model must answer now, verbatim
    cleared = [m for m in fit.messages if m["role"] == "tool" and m["content"].startswith("[tool result cleared")]
    assert cleared
    # Every call keeps its result, in order.
    ids = [c["id"] for m in fit.messages if m["role"] == "assistant" for c in m.get("tool_calls") or ()]
    results = [m["tool_call_id"] for m in fit.messages if m["role"] == "tool"]
    assert ids == results
    assert any("current turn" in a.detail for a in fit.report.actions)


def test_a_very_long_turn_drops_whole_old_rounds(keeper: ck.ContextKeeper) -> None:
    messages = agent_turn(120, lines=4)
    fit = keeper.fresh().fit(messages, tools=TOOLS, max_tokens=512)
    assert fit.tokens + 512 <= 4096
    assert fit.messages[-2:] == messages[-2:]
    assert any("dropped" in a.detail for a in fit.report.actions)
    assert len(fit.messages) < len(messages)


def test_when_even_the_compacted_turn_is_too_large(keeper: ck.ContextKeeper) -> None:
    messages = agent_turn(2, lines=400)  # the last round alone is larger than the context
    with pytest.raises(ck.RequestTooLarge):
        keeper.fresh().fit(messages, tools=TOOLS, max_tokens=512)
