"""Realistic conversations for exactness tests: tools, parallel calls, reasoning, unicode, code, empty and long
contents. Each builder returns OpenAI-format message dicts; ids are Mistral-compatible (9 letters/digits)."""

from __future__ import annotations

import json
from typing import Any

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_sql",
            "description": "Run a read-only SQL query.",
            "parameters": {"type": "object", "properties": {"sql": {"type": "string"}}, "required": ["sql"]},
        },
    },
]

SYSTEM = {"role": "system", "content": "You are a careful assistant. Never invent numbers."}


def call(call_id: str, name: str, **arguments: Any) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def simple() -> list[dict[str, Any]]:
    return [SYSTEM, {"role": "user", "content": "Hello! What can you do?"}]


def multi_turn() -> list[dict[str, Any]]:
    return [
        SYSTEM,
        {"role": "user", "content": "Écris une fonction Python qui inverse une chaîne — avec des émojis 🙂."},
        {"role": "assistant", "content": "```python\ndef reverse(s: str) -> str:\n    return s[::-1]\n```\n"},
        {"role": "user", "content": "  Now in Rust,\nplease.\n\n"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "中文也可以吗？ 谢谢"},
    ]


def no_system() -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "What's 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?"},
    ]


def tool_round() -> list[dict[str, Any]]:
    return [
        SYSTEM,
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call("a1b2c3d4e", "get_weather", city="Paris")]},
        {"role": "tool", "tool_call_id": "a1b2c3d4e", "content": json.dumps({"temp_c": 18, "sky": "clear"})},
        {"role": "assistant", "content": "It is 18 °C and clear in Paris."},
        {"role": "user", "content": "Thanks. And in Oslo?"},
    ]


def pending_tool_result() -> list[dict[str, Any]]:
    return tool_round()[:4]


def parallel_calls() -> list[dict[str, Any]]:
    return [
        SYSTEM,
        {"role": "user", "content": "Compare Paris and Tokyo, and count our orders."},
        {
            "role": "assistant",
            "content": "Checking both cities and the database.",
            "tool_calls": [
                call("p4r1s0001", "get_weather", city="Paris"),
                call("t0ky00002", "get_weather", city="Tokyo", unit="celsius"),
                call("sq1000003", "run_sql", sql="SELECT count(*) FROM orders WHERE status = 'open'"),
            ],
        },
        {"role": "tool", "tool_call_id": "p4r1s0001", "content": "18C clear"},
        {"role": "tool", "tool_call_id": "t0ky00002", "content": "11C rain"},
        {"role": "tool", "tool_call_id": "sq1000003", "content": json.dumps([{"count": 4211}])},
    ]


def reasoning() -> list[dict[str, Any]]:
    return [
        SYSTEM,
        {"role": "user", "content": "Is 91 prime?"},
        {"role": "assistant", "content": "No: 91 = 7 × 13.", "reasoning_content": "Try 7: 7*13 = 91. Not prime."},
        {"role": "user", "content": "Is 97 prime?"},
        {
            "role": "assistant",
            "content": "Yes, 97 is prime.",
            "reasoning_content": "Check 2,3,5,7: none divide 97; sqrt(97) < 10.",
        },
        {"role": "user", "content": "And 221?"},
    ]


def long_tool_result() -> list[dict[str, Any]]:
    rows = [{"id": i, "name": f"item-{i}", "price": round(i * 1.37, 2), "tags": ["a", "β", "🙂"]} for i in range(600)]
    return [
        SYSTEM,
        {"role": "user", "content": "List the catalogue."},
        {"role": "assistant", "content": None, "tool_calls": [call("c4t4l0g00", "run_sql", sql="SELECT * FROM items")]},
        {"role": "tool", "tool_call_id": "c4t4l0g00", "content": json.dumps(rows)},
        {"role": "assistant", "content": "There are 600 items."},
        {"role": "user", "content": "Which is the most expensive?"},
    ]


def text_parts() -> list[dict[str, Any]]:
    return [
        SYSTEM,
        {"role": "user", "content": [{"type": "text", "text": "First part."}, {"type": "text", "text": "Second."}]},
    ]


CONVERSATIONS = {
    "simple": simple,
    "multi_turn": multi_turn,
    "no_system": no_system,
    "tool_round": tool_round,
    "pending_tool_result": pending_tool_result,
    "parallel_calls": parallel_calls,
    "reasoning": reasoning,
    "long_tool_result": long_tool_result,
    "text_parts": text_parts,
}
