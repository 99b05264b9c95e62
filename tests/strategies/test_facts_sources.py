"""extract() pass by pass: what each kind a Source allows yields from one text, the spans identifiers claim (their
digits never read as numbers or dates, whatever kinds are asked for), and how facts of several sources merge."""

from __future__ import annotations

import pytest

from contextkeeper.strategies._facts import Source, extract

TEXT = (
    "See https://example.com/v2/items/42, mail ops.team@example.org or open /var/log/app-7.log; build v1.2.3 "
    "(not 1.234.567) fixed ORD-4471 on 2026-03-14 at 3pm. We paid 1,250 EUR.\n"
    "```\nORD-9999 costs 77\n```\n"
    "Ann told Omar in Oslo: you must never ship before 10:30. TODO: send the invoice. Is Oslo ready?"
)
URL = ("url", "https://example.com/v2/items/42", "example.com/v2/items/42")
EMAIL = ("email", "ops.team@example.org", "ops.team@example.org")
PATH = ("path", "/var/log/app-7.log", "/var/log/app-7.log")
IDS = [URL, EMAIL, PATH, ("id", "v1.2.3", "v1.2.3"), ("id", "ORD-4471", "ord-4471")]
DATE = ("date", "2026-03-14", "2026-03-14")
TIMES = [("time", "3pm", "15:00"), ("time", "10:30", "10:30")]
NUMBERS = [("number", "1.234.567", "1234567"), ("number", "1,250", "1250")]
CONSTRAINT = (
    "constraint",
    "Ann told Omar in Oslo: you must never ship before 10:30.",
    "ann told omar in oslo: you must never ship before 10:30.",
)
TASK = ("task", "TODO: send the invoice.", "todo: send the invoice.")
NAMES = [("name", "Oslo", "oslo"), ("name", "EUR", "eur"), ("name", "Omar", "omar")]


@pytest.mark.parametrize(
    ("kinds", "expected"),
    [
        ({"numbers"}, [DATE, *TIMES, *NUMBERS]),
        ({"ids"}, IDS),
        ({"names"}, NAMES),
        ({"constraints", "tasks"}, [CONSTRAINT, TASK]),
        ({"questions"}, [("task", "Is Oslo ready?", "is oslo ready?")]),
        (set(), []),
    ],
)
def test_a_source_yields_only_its_kinds(kinds: set[str], expected: list[tuple[str, str, str]]) -> None:
    facts = extract([Source(TEXT, frozenset(kinds))])
    assert [(fact.kind, fact.text, fact.key) for fact in facts] == expected


def test_a_plain_string_yields_every_kind_in_order_of_the_passes() -> None:
    facts = extract([TEXT])
    assert [(fact.kind, fact.text, fact.key) for fact in facts] == [
        URL,
        EMAIL,
        PATH,
        DATE,
        *TIMES,
        *IDS[3:],
        *NUMBERS,
        CONSTRAINT,
        TASK,
        *NAMES,
    ]


def test_facts_of_several_sources_are_merged_by_first_appearance() -> None:
    facts = extract(
        [
            Source("Dana called Reno about ORD-4471 at 3 pm.", frozenset({"names", "numbers"})),
            "Dana and Reno: ORD-4471 at 15:00, then Dana again.",
            "   ",
            Source("Nothing of ORD-1234 here", frozenset()),
        ],
        max_names=1,
    )
    assert [(fact.kind, fact.text, fact.key) for fact in facts] == [
        ("time", "3 pm", "15:00"),
        ("id", "ORD-4471", "ord-4471"),
        ("name", "Dana", "dana"),
    ]
