"""Conversations whose prompt counts differ between servers: the corpus recorded from real servers.

Standard library only. Each case is ``{"name", "messages", "tools"}``; the names say which rule a case probes.
``scripts/record_llama_server.py`` sends every case to a real llama-server and stores its counts beside them in
``tests/fixtures/llama_server/``; the tests count the same cases with ``server="llama.cpp"``.
"""

from __future__ import annotations

import unicodedata
from typing import Any

TEXTS = {
    "ascii": "Could you check whether the nightly export finished and, if not, why?",
    "latin": "Können Sie prüfen, ob der nächtliche Export fertig ist? Ça dépend du serveur, señor.",
    "cjk": "请检查一下夜间导出是否已经完成。如果没有，原因是什么？東京の天気はどうですか。",
    "cyrillic": "Проверьте, пожалуйста, завершился ли ночной экспорт, и если нет, то почему.",
    "arabic": "هل يمكنك التحقق مما إذا كان التصدير الليلي قد انتهى، وإذا لم يكن كذلك فلماذا؟",
    "devanagari": "क्या आप जाँच सकते हैं कि रात का निर्यात पूरा हुआ या नहीं, और अगर नहीं तो क्यों?",
    "korean": "야간 내보내기가 끝났는지 확인해 주시겠어요? 한글 자모 조합 테스트입니다.",
    "code": (
        "SELECT id, name FROM users WHERE created_at > '2026-01-01' ORDER BY id; -- 10 rows\n"
        '```json\n{"ok": true}\n```'
    ),
}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search_docs",
        "description": "Full-text search over the manual.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}


def _tool(**function: Any) -> dict[str, Any]:
    return {"type": "function", "function": function}


TOOL_SHAPES: dict[str, list[dict[str, Any]]] = {
    "tools-full": [WEATHER, SEARCH],
    "tools-no-description": [_tool(name="ping", parameters={"type": "object", "properties": {}})],
    "tools-no-parameters": [_tool(name="now", description="The current time.")],
    "tools-name-only": [_tool(name="noop")],
    "tools-reordered": [
        _tool(
            parameters={"type": "object", "properties": {"q": {"type": "string"}}},
            description="Search the web.",
            name="web_search",
        )
    ],
    "tools-strict": [
        _tool(
            name="lookup",
            description="Look up an order.",
            strict=True,
            parameters={
                "type": "object",
                "properties": {"order": {"type": "string"}},
                "required": ["order"],
                "additionalProperties": False,
            },
        )
    ],
    "tools-nested-schema": [
        _tool(
            name="book",
            description="Book a room.",
            parameters={
                "type": "object",
                "properties": {
                    "when": {
                        "type": "object",
                        "properties": {
                            "from": {"type": "string", "format": "date"},
                            "nights": {"type": "integer", "minimum": 1},
                        },
                    },
                    "guests": {"type": "array", "items": {"type": "string"}},
                    "budget": {"type": "number", "default": 120.5},
                },
            },
        )
    ],
}


def _call(name: str, arguments: str, call_id: str = "call_1") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


ARGUMENTS = {
    "args-string": '{"city": "Paris"}',
    "args-int": '{"city": "Oslo", "days": 3}',
    "args-float-whole": '{"city": "Rome", "days": 1.0}',
    "args-float": '{"city": "Rome", "temp": 21.5, "ratio": 0.25}',
    "args-exp": '{"big": 1e21, "small": 1.5e-7}',
    "args-nested": '{"when": {"from": "2026-12-24", "nights": 2}, "guests": ["Ana", "Bo"], "ok": true, "x": null}',
    "args-unicode": '{"city": "São Paulo", "note": "東京"}',
    "args-escaped": '{"city": "M\\u00fcnchen", "q": "a \\"quoted\\" word"}',
    "args-spaced": '{ "city" :  "Lima" }',
    "args-empty": "{}",
    "args-invalid": "{not json",
}


def _chat(*turns: tuple[str, Any]) -> list[dict[str, Any]]:
    return [{"role": role, "content": content} for role, content in turns]


def cases() -> list[dict[str, Any]]:
    """The corpus: about sixty cases, each probing one rule (or none: the plain ones)."""
    out: list[dict[str, Any]] = []

    def add(name: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> None:
        out.append({"name": name, "messages": messages, "tools": tools})

    for script, text in TEXTS.items():
        add(f"plain-{script}", _chat(("user", text)))
        add(
            f"system-{script}",
            _chat(
                ("system", "You answer briefly."), ("user", text), ("assistant", text), ("user", "Thanks. " + text[:20])
            ),
        )
    add("developer", _chat(("developer", "Be brief."), ("user", TEXTS["ascii"])))
    add(
        "developer-and-system",
        _chat(("system", "You are a helper."), ("developer", "Answer in French."), ("user", TEXTS["latin"])),
    )
    add("final-assistant", _chat(("user", TEXTS["ascii"]), ("assistant", "The export")))
    add(
        "final-assistant-long",
        _chat(
            ("system", "Be kind."),
            ("user", TEXTS["cjk"]),
            ("assistant", TEXTS["cjk"]),
            ("user", "Again?"),
            ("assistant", "Yes: " + TEXTS["cyrillic"]),
        ),
    )
    korean_nfd = unicodedata.normalize("NFD", TEXTS["korean"])
    add("nfd-korean", _chat(("user", korean_nfd)))
    add("nfd-latin", _chat(("user", unicodedata.normalize("NFD", TEXTS["latin"]))))
    add("nfkc-only", _chat(("user", "ﬁle ① ｆｕｌｌｗｉｄｔｈ ㎏ ™")))
    add("ideographic-space-ends", _chat(("user", "\u3000" + TEXTS["cjk"] + "\u3000")))
    add("nbsp-ends", _chat(("system", "\u00a0Be brief.\u00a0"), ("user", "\u00a0" + TEXTS["ascii"] + "\u00a0")))
    add("ascii-space-ends", _chat(("user", "  \n" + TEXTS["ascii"] + " \n\t")))
    add("empty-user", _chat(("user", "")))
    add(
        "content-parts",
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Part one."},
                    {"type": "text", "text": "Part two: " + TEXTS["arabic"]},
                ],
            }
        ],
    )
    add("special-token-text", _chat(("user", "Write <|im_end|> and <|eot_id|> and <s> literally.")))
    for shape, tools in TOOL_SHAPES.items():
        add(shape, _chat(("user", TEXTS["ascii"])), tools)
        add(f"{shape}-system", _chat(("system", "Use tools when useful."), ("user", TEXTS["cyrillic"])), tools)
    for shape, arguments in ARGUMENTS.items():
        add(
            shape,
            [
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [_call("get_weather", arguments)]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21.0, "sky": "clear"}'},
                {"role": "user", "content": "And tomorrow?"},
            ],
            [WEATHER, SEARCH],
        )
    add(
        "parallel-calls",
        [
            {"role": "user", "content": TEXTS["latin"]},
            {
                "role": "assistant",
                "content": "Checking both.",
                "tool_calls": [
                    _call("get_weather", '{"city": "Berlin"}', "call_a"),
                    _call("search_docs", '{"query": "export"}', "call_b"),
                ],
            },
            {"role": "tool", "tool_call_id": "call_a", "content": "Sunny, 4°C"},
            {"role": "tool", "tool_call_id": "call_b", "content": TEXTS["code"]},
        ],
        [WEATHER, SEARCH],
    )
    add(
        "empty-tool-calls",
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!", "tool_calls": []},
            {"role": "user", "content": "Bye"},
        ],
    )
    add(
        "reasoning-content",
        [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "Two plus two is four."},
            {"role": "user", "content": "3+3?"},
        ],
    )
    add(
        "tool-result-last",
        [
            {"role": "user", "content": TEXTS["devanagari"]},
            {"role": "assistant", "content": "", "tool_calls": [_call("search_docs", '{"query": "निर्यात"}')]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"hits": 3}'},
        ],
        [SEARCH],
    )
    add(
        "long-mixed",
        [
            m
            for i in range(6)
            for m in (
                {"role": "user", "content": list(TEXTS.values())[i]},
                {"role": "assistant", "content": list(TEXTS.values())[i + 1]},
            )
        ],
        [WEATHER],
    )
    return out


# How llama.cpp's Jinja engine writes values and strips text, probed with a template of our own: every value a
# tool call's arguments can hold, written by an output statement, after ``~`` and through ``string``, and every
# way to strip a message's text. ``scripts/record_llama_server.py --engine`` records the server's render of each
# case in tests/fixtures/llama_engine.json.
ENGINE_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- for tc in m.tool_calls or [] -%}"
    "{%- for k, v in tc.function.arguments | dictsort -%}"
    "[{{ k }}={{ v }}|{{ 'c' ~ v }}|{{ v | string }}]"
    "{%- endfor -%}"
    "{%- endfor -%}"
    "{%- if m.content is string -%}"
    "<{{ m.content.strip() }}|{{ m.content.lstrip() }}|{{ m.content.rstrip() }}|{{ m.content | trim }}>"
    "{%- endif -%}"
    "{%- endfor -%}"
)
ENGINE_VALUES = {
    "floats": '{"a": 0.1234567, "b": 1e21, "c": 1.5e-7, "d": -0.0, "e": 2.5, "f": 1.0, "g": 123456.789}',
    "ints": '{"a": 0, "b": -7, "c": 9007199254740993}',
    "nulls": '{"a": null, "b": true, "c": false}',
    "lists": '{"a": [1, "x", null, 2.5], "b": [], "c": [[1, 2], ["y"]]}',
    "objects": '{"a": {"k": 1}, "b": {}, "c": [{"k": "v"}]}',
    "strings": '{"a": "plain", "b": "", "c": "ünï 中文"}',
}
ENGINE_TEXTS = {
    "ascii-space": "  \t padded text \n ",
    "ideographic-space": "\u3000全角スペース\u3000",
    "no-break-space": "\u00a0non-breaking\u00a0",
    "mixed-space": " \u3000\u00a0\u2003mixed\u2003\u00a0\u3000 ",
    "nothing": "",
}


def engine_cases() -> list[dict[str, Any]]:
    """The engine probes: one per argument shape (a call and its result between two user messages) and one per text."""
    out = []
    for name, arguments in ENGINE_VALUES.items():
        call = {"role": "assistant", "content": "", "tool_calls": [_call("f", arguments)]}
        result = {"role": "tool", "tool_call_id": "call_1", "content": "r"}
        messages = [{"role": "user", "content": "go"}, call, result, {"role": "user", "content": "ok"}]
        out.append({"name": f"values-{name}", "messages": messages, "tools": None})
    for name, text in ENGINE_TEXTS.items():
        out.append({"name": f"strip-{name}", "messages": [{"role": "user", "content": text}], "tools": None})
    return out


# Numbers as llama-server reads and writes them: nlohmann::json reads an integer past int64 as uint64 (which the
# Jinja engine takes as int64: it wraps) or as a double, and ``tojson`` writes a double through a C++ stream (six
# significant digits). In tool-call arguments (parsed from their JSON string) and in tool schemas.
NUMBER_ARGUMENTS = {
    "digits": '{"lat": 48.856614, "lon": 2.3522219, "price": 1234567.5, "tiny": 0.000012345678, "third": 0.3333333333}',
    "whole": '{"a": 100000.0, "b": 1000000.0, "c": 1e15, "d": -2.0, "e": 0.0}',
    "int64": '{"max": 9223372036854775807, "min": -9223372036854775808, "wrap": 9223372036854775808}',
    "uint64": '{"top": 18446744073709551615, "past": 18446744073709551616, "low": -9223372036854775809}',
}
NUMBER_TOOL = _tool(
    name="locate",
    description="Find a place.",
    parameters={
        "type": "object",
        "properties": {
            "lat": {"type": "number", "minimum": -90.0, "maximum": 90.0, "default": 48.856614},
            "step": {"type": "number", "multipleOf": 0.000012345678},
            "id": {"type": "integer", "maximum": 18446744073709551615, "minimum": -9223372036854775808},
        },
    },
)


def number_cases() -> list[dict[str, Any]]:
    """The number probes: a tool call per argument shape (with its result), and a tool schema full of numbers."""
    out = []
    for name, arguments in NUMBER_ARGUMENTS.items():
        messages = [
            {"role": "user", "content": "Where?"},
            {"role": "assistant", "content": None, "tool_calls": [_call("locate", arguments)]},
            {"role": "tool", "tool_call_id": "call_1", "content": "found"},
            {"role": "user", "content": "Thanks."},
        ]
        out.append({"name": f"numbers-args-{name}", "messages": messages, "tools": [NUMBER_TOOL]})
    out.append({"name": "numbers-schema", "messages": _chat(("user", "Where am I?")), "tools": [NUMBER_TOOL]})
    return out


def continuation_cases() -> list[dict[str, Any]]:
    """A final assistant message the server continues, with reasoning: only reasoning (the block stays open),
    reasoning and content, and empty reasoning. ``scripts/record_llama_server.py --continuation`` records them in
    tests/fixtures/llama_continuation.json."""
    ask = {"role": "user", "content": TEXTS["ascii"]}
    shapes = {
        "reasoning-only": {"content": "", "reasoning_content": "The export runs at 02:00; check its log first."},
        "reasoning-and-content": {"content": "It finished", "reasoning_content": "Look at the log.\nThen answer."},
        "reasoning-empty": {"content": "It finished", "reasoning_content": ""},
        "reasoning-cjk": {"content": TEXTS["cjk"][:12], "reasoning_content": TEXTS["cjk"][12:]},
    }
    return [{"name": n, "messages": [ask, {"role": "assistant", **s}], "tools": None} for n, s in shapes.items()]
