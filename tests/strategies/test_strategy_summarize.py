"""The verified summarize strategy, on real prompts counted exactly by mistral-common (``mistral:tekken``).

The summarizer backend is a plain Python function standing in for the model: it reads the LLMCall it gets and
returns text, so every path (verification, retries, backend errors, caching, roll-forward, both drivers) runs
the strategy's real code against a real token counter.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Callable, Sequence
from typing import Any

import pytest

import contextkeeper
import strategy_state
from contextkeeper import Conversation
from contextkeeper._exceptions import ConfigurationError
from contextkeeper.strategies._facts import Fact, Source, extract, missing, normalize
from contextkeeper.strategies.base import STRATEGIES, FitState, Item, Items, LLMCall, Memory, run_async, run_sync
from contextkeeper.strategies.summarize import ACKNOWLEDGEMENT, SUMMARY_PREFIX, Summarize, _Summaries

# ------------------------------------------------------------------------------------------- fixtures

SYSTEM = {"role": "system", "content": "You are the support assistant of Acme Outfitters. Be brief."}


def _call(call_id: str, name: str, **arguments: Any) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


TRACKING = json.dumps(
    {
        "order_id": "ORD-4471",
        "status": "in_transit",
        "items": 3,
        "total_usd": 1250.0,
        "carrier": "DHL",
        "tracking": "JD014600006281",
        "events": [
            {"at": f"2026-03-{day:02d}T{hour:02d}:15", "where": f"hub-{day}{hour}", "note": "scanned " * 6}
            for day in range(1, 5)
            for hour in range(0, 24, 2)
        ],
    }
)

# units 0..11: the strategy (keep_recent=4) summarises units 0..6 and keeps 7..11, starting at a user unit.
HISTORY: list[dict[str, Any]] = [
    {
        "role": "user",
        "content": "Hi, I'm Dana Whitfield. My order ORD-4471 hasn't arrived. It was supposed to come on 2026-03-02.",
    },
    {"role": "assistant", "content": None, "tool_calls": [_call("a1b2c3d4e", "lookup_order", order_id="ORD-4471")]},
    {"role": "tool", "tool_call_id": "a1b2c3d4e", "content": TRACKING},
    {
        "role": "assistant",
        "content": "Your order ORD-4471 (3 items, $1,250.00) shipped from our Reno warehouse via DHL with tracking "
        "number JD014600006281. It has been stuck at the Leipzig hub since March 4.",
    },
    {
        "role": "user",
        "content": "Please don't send a replacement to my office. It must only go to my home address, "
        "18 Elm Street, Portland. And never call me before 9am.",
    },
    {
        "role": "assistant",
        "content": "Noted: the replacement goes only to 18 Elm Street, Portland, and nobody will call before 9am. "
        "I've opened claim CLM-20931 with DHL.",
    },
    {
        "role": "user",
        "content": "How long does a claim usually take? Also, can I get the 15% loyalty discount on the replacement?",
    },
    {
        "role": "assistant",
        "content": "Claims usually take 5 to 7 business days. The 15% loyalty discount applies; I'll add it to the "
        "replacement order. TODO on my side: confirm the new delivery date with the warehouse.",
    },
    {"role": "user", "content": "OK. Email the confirmation to dana.w@acme-mail.com please."},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [_call("e5f6g7h8i", "send_email", to="dana.w@acme-mail.com", template="claim_opened")],
    },
    {"role": "tool", "tool_call_id": "e5f6g7h8i", "content": "sent"},
    {"role": "assistant", "content": "Done: the confirmation for claim CLM-20931 went to dana.w@acme-mail.com."},
    {"role": "user", "content": "Thanks. Is the warehouse check done yet?"},
    {"role": "assistant", "content": "Not yet; I will tell you as soon as the warehouse answers."},
]
REQUEST = {"role": "user", "content": "Any update on the delivery date?"}

FAITHFUL = """\
- Customer: Dana Whitfield. Order ORD-4471 (3 items, $1,250.00) was due on 2026-03-02 but has not arrived. It \
shipped from the Reno warehouse via DHL (tracking JD014600006281) and has been stuck at the Leipzig hub since \
March 4.
- Constraints: do not send the replacement to Dana's office; it must only go to her home address, 18 Elm Street, \
Portland. Never call her before 9am.
- The assistant opened DHL claim CLM-20931; claims usually take 5 to 7 business days.
- The 15% loyalty discount applies and will be added to the replacement order.
- Open task (TODO): confirm the new delivery date with the warehouse."""


@pytest.fixture(scope="module")
def counter() -> Any:
    return contextkeeper.load_counter("mistral:tekken")


def _units(messages: Sequence[dict[str, Any]]) -> tuple[Items, ...]:
    conversation = Conversation.from_messages(list(messages))
    return tuple(
        tuple(Item(message, origin=index) for index, message in zip(unit.indices, unit.messages, strict=True))
        for unit in conversation.units()
    )


def _dicts(units: Sequence[Items]) -> list[dict[str, Any]]:
    return [item.message.to_dict() for unit in units for item in unit]


def make_state(
    counter: Any,
    history: Sequence[dict[str, Any]] | tuple[Items, ...] = HISTORY,
    *,
    limit: int = 100_000,
    memory: Memory | None = None,
) -> FitState:
    """SYSTEM, ``history`` (message dicts, or units from an earlier result) and REQUEST, counted by ``counter``."""
    return strategy_state.make_state(counter, SYSTEM, history, REQUEST, limit=limit, memory=memory)


class Model:
    """A summarizer backend: answers each call with the next reply (or raises it), and records the calls."""

    def __init__(self, *replies: str | BaseException | Callable[[LLMCall], str]) -> None:
        self.replies = list(replies)
        self.calls: list[LLMCall] = []

    def __call__(self, call: LLMCall) -> str:
        self.calls.append(call)
        reply = self.replies[min(len(self.calls), len(self.replies)) - 1]
        if isinstance(reply, BaseException):
            raise reply
        return reply(call) if callable(reply) else reply


def _transcript(call: LLMCall) -> str:
    return str(call.messages[1]["content"])


# --------------------------------------------------------------------------------------------- success


def test_faithful_summary_replaces_the_oldest_units_and_saves_exact_tokens(counter: Any) -> None:
    state = make_state(counter)
    model = Model(FAITHFUL)
    before = state.tokens()

    result = run_sync(Summarize(), state, model)

    assert len(model.calls) == 1
    # Units 0..6 (the last full exchange before unit 7, a user unit) became the summary pair.
    summary, ack, *kept = result.history
    assert summary[0].message.to_dict() == {"role": "user", "content": SUMMARY_PREFIX + FAITHFUL}
    assert ack[0].message.to_dict() == {"role": "assistant", "content": ACKNOWLEDGEMENT}
    assert summary[0].origin is None
    assert ack[0].origin is None
    assert tuple(kept) == state.history[7:]
    assert kept[0][0].role == "user"  # the first kept unit is a user turn: roles alternate
    assert all(kept_unit is original for kept_unit, original in zip(kept, state.history[7:], strict=True))
    (action,) = result.actions
    after = counter.count([SYSTEM, *_dicts(result.history), REQUEST])
    assert action.strategy == "summarize"
    assert action.units == 7
    assert action.saved == before - after > 1000
    assert "verified on attempt 1 of 3" in action.detail
    assert result.tokens() == after


def test_prompt_asks_for_the_facts_and_renders_tools_compactly(counter: Any) -> None:
    model = Model(FAITHFUL)
    run_sync(Summarize(max_summary_tokens=300), make_state(counter), model)

    (call,) = model.calls
    assert call.max_tokens == 300
    system, user = call.messages
    assert system["role"] == "system"
    assert user["role"] == "user"
    for wanted in ("numbers", "identifiers", "names", "decisions", "constraint", "must, never", "unresolved"):
        assert wanted in system["content"]
    assert "language of the transcript" in system["content"]
    transcript = user["content"]
    assert "User: Hi, I'm Dana Whitfield." in transcript
    assert 'Assistant called lookup_order({"order_id": "ORD-4471"})' in transcript
    assert "Tool result (lookup_order): " in transcript
    assert "characters omitted" in transcript  # the long tracking result is clipped in the middle
    assert len(TRACKING) > 5000
    assert len(transcript) < len(TRACKING)
    assert "Email the confirmation" not in transcript  # unit 7 onwards is kept, not summarised


def test_few_units_do_nothing_and_make_no_call(counter: Any) -> None:
    assert inspect.isgeneratorfunction(Summarize.apply)
    state = make_state(counter, HISTORY[:4])  # three units, of which one may be summarised
    result = run_sync(Summarize(keep_recent=2), state, None)
    assert result is state
    assert result.actions == ()


# --------------------------------------------------------------------------------------------- retries


@pytest.mark.parametrize(("dropped", "named"), [("$1,250.00", "$1,250.00"), ("ORD-4471", "ORD-4471")])
def test_a_dropped_fact_is_named_in_the_retry_and_the_fixed_summary_passes(
    counter: Any, dropped: str, named: str
) -> None:
    lossy = FAITHFUL.replace(f" {dropped}", "")
    assert lossy != FAITHFUL
    model = Model(lossy, FAITHFUL)

    result = run_sync(Summarize(), make_state(counter), model)

    assert len(model.calls) == 2
    retry = model.calls[1].messages
    assert [message["role"] for message in retry] == ["system", "user", "assistant", "user"]
    assert retry[2]["content"] == lossy
    assert named in retry[3]["content"]
    assert "leaves out" in retry[3]["content"]
    assert retry[:2] == model.calls[0].messages
    assert result.history[0][0].text() == SUMMARY_PREFIX + FAITHFUL
    assert "verified on attempt 2 of 3" in result.actions[0].detail


def test_a_summary_that_drops_a_constraint_fails_verification(counter: Any) -> None:
    weakened = FAITHFUL.replace("Never call her before 9am.", "Call her at 9am.")
    model = Model(weakened, FAITHFUL)
    run_sync(Summarize(), make_state(counter), model)
    assert len(model.calls) == 2
    assert "never call me before 9am" in model.calls[1].messages[3]["content"].casefold()


def test_a_hallucinating_summarizer_leaves_history_unchanged(counter: Any) -> None:
    state = make_state(counter)
    model = Model("The user asked about a delayed laptop order, which arrived safely in Berlin on Monday.")

    result = run_sync(Summarize(), state, model)

    assert len(model.calls) == 3  # the first attempt and two retries, then it stops
    assert result.history == state.history
    assert all(a is b for a, b in zip(result.history, state.history, strict=True))
    (action,) = result.actions
    assert action.saved == 0
    assert action.units == 0
    assert "failed verification after 3 attempts" in action.detail
    assert "'ORD-4471'" in action.detail
    assert "history unchanged" in action.detail
    assert not state.memory.get(_Summaries)  # nothing unverified is cached


def test_retries_setting_bounds_the_attempts(counter: Any) -> None:
    model = Model("Nothing of note happened.")
    result = run_sync(Summarize(retries=0), make_state(counter), model)
    assert len(model.calls) == 1
    assert "after 1 attempts" in result.actions[0].detail


@pytest.mark.parametrize("error", [RuntimeError("backend returned HTTP 500"), TimeoutError("timed out after 30 s")])
def test_backend_errors_leave_history_unchanged(counter: Any, error: Exception) -> None:
    state = make_state(counter)
    model = Model(error)

    result = run_sync(Summarize(), state, model)

    assert len(model.calls) == 3
    assert result.history == state.history
    (action,) = result.actions
    assert action.saved == 0
    assert type(error).__name__ in action.detail
    assert "history unchanged" in action.detail


def test_a_timeout_then_a_faithful_reply_passes(counter: Any) -> None:
    model = Model(TimeoutError("slow"), FAITHFUL)
    result = run_sync(Summarize(), make_state(counter), model)
    assert len(model.calls) == 2
    assert model.calls[1].messages == model.calls[0].messages  # a failed call leaves the prompt as it was
    assert "verified on attempt 2 of 3" in result.actions[0].detail


def test_an_empty_reply_is_a_failed_attempt(counter: Any) -> None:
    model = Model("   ", FAITHFUL)
    result = run_sync(Summarize(), make_state(counter), model)
    assert len(model.calls) == 2
    assert "empty" in model.calls[1].messages[3]["content"]
    assert result.actions[0].units == 7


def test_a_question_no_assistant_answered_must_stay_open(counter: Any) -> None:
    chat = [
        {"role": "user", "content": "Where is parcel JD014600006281 right now?"},
        {"role": "assistant", "content": None, "tool_calls": [_call("t1r2a3c4k", "track", id="JD014600006281")]},
        {"role": "tool", "tool_call_id": "t1r2a3c4k", "content": TRACKING},
        {"role": "user", "content": "Hello? Also, my address is 18 Elm Street, Portland."},
        {"role": "assistant", "content": "Thanks, I have noted 18 Elm Street, Portland."},
        {"role": "user", "content": "Good."},
        {"role": "assistant", "content": "Anything else?"},
    ]
    noted = "Parcel JD014600006281 was tracked. The user's address is 18 Elm Street, Portland."
    kept = noted + " Open question: where parcel JD014600006281 is right now."
    model = Model(noted, kept)

    result = run_sync(Summarize(keep_recent=2), make_state(counter, chat), model)

    assert len(model.calls) == 2
    assert (
        "the open task or question “Where is parcel JD014600006281 right now?”" in model.calls[1].messages[3]["content"]
    )
    assert result.history[0][0].text() == SUMMARY_PREFIX + kept


# ---------------------------------------------------------------------------------------------- caching


def test_a_cached_summary_makes_no_second_call(counter: Any) -> None:
    memory = Memory()
    first = run_sync(Summarize(), make_state(counter, memory=memory), Model(FAITHFUL))
    assert [entry.summary for entry in memory.slot(_Summaries).values()] == [FAITHFUL]

    model = Model(AssertionError("the cache should have answered"))
    second = run_sync(Summarize(), make_state(counter, memory=memory), model)

    assert model.calls == []
    assert _dicts(second.history) == _dicts(first.history)
    assert second.actions[0].saved == first.actions[0].saved
    assert "reused the cached summary" in second.actions[0].detail
    # The very same message objects: the counter's identity-keyed caches keep working across fits.
    assert second.history[0] is first.history[0]
    assert second.history[1] is first.history[1]


def test_a_grown_history_reuses_the_cached_prefix_when_that_fits(counter: Any) -> None:
    memory = Memory()
    run_sync(Summarize(), make_state(counter, memory=memory), Model(FAITHFUL))
    grown = [*HISTORY, REQUEST, {"role": "assistant", "content": "The warehouse has not answered yet."}]

    model = Model(AssertionError("the cached prefix fits"))
    result = run_sync(Summarize(), make_state(counter, grown, memory=memory), model)

    assert model.calls == []
    assert result.history[0][0].text() == SUMMARY_PREFIX + FAITHFUL
    assert result.actions[0].units == 7


def test_a_grown_history_that_does_not_fit_rolls_the_cached_summary_forward(counter: Any) -> None:
    memory = Memory()
    run_sync(Summarize(), make_state(counter, memory=memory), Model(FAITHFUL))
    grown = [*HISTORY, REQUEST, {"role": "assistant", "content": "The warehouse has not answered yet."}]
    rolled = FAITHFUL + (
        "\n- Dana asked for the confirmation to go to dana.w@acme-mail.com; it was sent for claim CLM-20931."
    )
    model = Model(rolled)

    result = run_sync(Summarize(), make_state(counter, grown, limit=300, memory=memory), model)

    (call,) = model.calls
    transcript = _transcript(call)
    assert "Previous summary:\n" + FAITHFUL in transcript
    assert "Email the confirmation" in transcript
    assert "Hi, I'm Dana" not in transcript
    assert result.history[0][0].text() == SUMMARY_PREFIX + rolled
    assert result.actions[0].units == 10  # units 0..9, up to the user unit 10


# ------------------------------------------------------------------------------------------ roll-forward


def test_a_previous_summary_in_the_history_is_a_source_of_the_next(counter: Any) -> None:
    first = run_sync(Summarize(), make_state(counter), Model(FAITHFUL))
    later = [
        {"role": "user", "content": "Did DHL reply about the claim?"},
        {"role": "assistant", "content": "Yes: DHL approved claim CLM-20931 and refunds $89.90 shipping."},
        {"role": "user", "content": "Great."},
        {"role": "assistant", "content": "Anything else?"},
    ]
    history = first.history + _units(later)
    rolled = FAITHFUL + (
        "\n- The confirmation went to dana.w@acme-mail.com. The warehouse check is not done yet: the assistant will "
        "tell Dana as soon as the warehouse answers.\n- DHL approved claim CLM-20931 and refunds $89.90 shipping."
    )
    without_old_fact = rolled.replace("ORD-4471 (3 items, $1,250.00)", "(3 items, $1,250.00)")
    model = Model(without_old_fact, rolled)

    result = run_sync(Summarize(keep_recent=2), make_state(counter, history), model)

    transcript = _transcript(model.calls[0])
    assert "<transcript>\nPrevious summary:\n" + FAITHFUL in transcript
    assert "User: Summary of the earlier conversation" not in transcript
    assert "ORD-4471" in model.calls[1].messages[3]["content"]  # the old summary's facts are required too
    assert len(model.calls) == 2
    summary, ack, *kept = result.history
    assert summary[0].text() == SUMMARY_PREFIX + rolled
    assert ack[0].text() == ACKNOWLEDGEMENT
    assert _dicts(kept) == later[2:]
    assert result.actions[0].units == len(history) - 2


def test_an_agent_run_without_a_user_boundary_gets_a_single_summary_message(counter: Any) -> None:
    steps: list[dict[str, Any]] = [{"role": "user", "content": "Find order ORD-4471 and email Dana about it."}]
    for n, (tool, result) in enumerate(
        [("lookup_order", TRACKING), ("lookup_customer", "Dana Whitfield, dana.w@acme-mail.com")]
        + [("check_stock", f"SKU-77{n} in stock: {n + 10}") for n in range(3)]
    ):
        call_id = f"c{n}d{n}e{n}f{n}g"
        steps += [
            {"role": "assistant", "content": None, "tool_calls": [_call(call_id, tool, ref="ORD-4471")]},
            {"role": "tool", "tool_call_id": call_id, "content": result},
        ]
    steps.append({"role": "assistant", "content": "Order ORD-4471 is at the Leipzig hub; I will email Dana now."})
    state = make_state(counter, steps)

    def summarise(call: LLMCall) -> str:
        return (
            "The user asked to find order ORD-4471 and email Dana about it. Lookups done: lookup_order, "
            "lookup_customer and three stock checks."
        )

    model = Model(summarise)
    result = run_sync(Summarize(keep_recent=2), state, model)

    roles = [unit[0].role for unit in result.history]
    assert roles == ["user", "assistant", "assistant"]  # no acknowledgement: an assistant unit follows
    assert result.history[0][0].text().startswith(SUMMARY_PREFIX)
    assert result.actions[0].saved > 0
    assert counter.count([SYSTEM, *_dicts(result.history), REQUEST]) == result.tokens()


def test_a_summary_that_saves_nothing_is_not_applied(counter: Any) -> None:
    chat = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "how are you"},
        {"role": "assistant", "content": "fine"},
    ]
    state = make_state(counter, chat)
    wordy = "The user said hi and the assistant said hello; the user asked how it was, and it said fine. " * 12
    result = run_sync(Summarize(keep_recent=0), state, Model(wordy))
    assert result.history == state.history
    assert "would not save tokens" in result.actions[0].detail
    assert result.actions[0].saved == 0


# ----------------------------------------------------------------------------------------------- drivers


def test_run_async_with_an_async_backend_matches_run_sync(counter: Any) -> None:
    replies = ["A vague summary.", FAITHFUL]
    calls: list[LLMCall] = []

    async def backend(call: LLMCall) -> str:
        calls.append(call)
        await asyncio.sleep(0)
        if len(calls) == 1:
            raise TimeoutError("slow")
        return replies[len(calls) - 2]

    async_result = asyncio.run(run_async(Summarize(), make_state(counter), backend))
    sync_model = Model(TimeoutError("slow"), *replies)
    sync_result = run_sync(Summarize(), make_state(counter), sync_model)

    assert [call.messages for call in calls] == [call.messages for call in sync_model.calls]
    assert _dicts(async_result.history) == _dicts(sync_result.history)
    assert async_result.actions == sync_result.actions
    assert "verified on attempt 3 of 3" in async_result.actions[0].detail


# ---------------------------------------------------------------------------------------------- settings


def test_registered_with_defaults_and_checked_settings() -> None:
    assert STRATEGIES["summarize"] is Summarize
    assert Summarize.name == "summarize"
    default = Summarize()
    assert (default.keep_recent, default.max_summary_tokens, default.retries, default.min_units) == (4, 512, 2, 2)
    assert (default.similarity_threshold, default.embedding_model) == (0.35, None)
    with pytest.raises(ConfigurationError, match="retries"):
        Summarize(retries=-1)
    with pytest.raises(ConfigurationError, match="keep_recent"):
        Summarize(keep_recent=-2)
    with pytest.raises(ConfigurationError, match="keyword arguments"):
        Summarize(4)  # type: ignore[misc]


def test_min_units_setting(counter: Any) -> None:
    state = make_state(counter)
    assert run_sync(Summarize(min_units=9), state, None) is state  # keep_recent=4 leaves 8 of the 12 units
    result = run_sync(Summarize(min_units=7), state, Model(FAITHFUL))
    assert result.actions[0].units == 7  # the user boundary before unit 7
    state = make_state(counter)  # a fresh memory: no cached summary
    # No user boundary leaves 8 units: cut before the assistant unit 8, with the summary alone (no "Understood.").
    confirmed = FAITHFUL + "\n- Dana asked for the confirmation to go to dana.w@acme-mail.com."
    result = run_sync(Summarize(min_units=8), state, Model(confirmed))
    assert result.actions[0].units == 8
    assert [unit[0].role for unit in result.history[:2]] == ["user", "assistant"]
    assert result.history[1] is state.history[8]


def test_similarity_gate_with_a_real_embedding_model(counter: Any) -> None:
    try:
        from contextkeeper.strategies._embeddings import get_embedder
    except ImportError:
        pytest.skip("contextkeeper.strategies._embeddings is not available")
    if get_embedder(None) is None:
        pytest.skip("no embedding model loads here")
    plain = run_sync(Summarize(), make_state(counter), Model(FAITHFUL))
    assert "similarity" not in plain.actions[0].detail  # no meaning check unless the step asks for it
    passed = run_sync(Summarize(embeddings=True), make_state(counter), Model(FAITHFUL))
    assert "similarity" in passed.actions[0].detail
    state = make_state(counter)
    strict = run_sync(Summarize(embeddings=True, similarity_threshold=1.0), state, Model(FAITHFUL))
    assert strict.history == state.history
    assert "similarity" in strict.actions[0].detail


# ---------------------------------------------------------------------------------------------- extraction


def _kinds(text: str | Source) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for fact in extract([text]):
        out.setdefault(fact.kind, []).append(fact.text)
    return out


def test_numbers_match_across_separators_scales_and_words() -> None:
    facts = extract(["The invoice is $1,250.00 for 1,000 units, 15% off, about €1.2M a year; 3 sites."])
    assert {fact.key for fact in facts if fact.kind == "number"} == {"1250", "1000", "15", "1.2", "3"}
    assert missing(facts, "Invoice $1250 for 1000 units at 15 percent off, €1,200,000 yearly, three sites.") == ()
    assert missing(facts, "Invoice 1 250 $ for 1 000 units (15 %), 1.2 million euros a year, 3 sites.") == ()
    lacking = missing(facts, "Invoice $1,205 for 1,000 units, 15% off, €1.2M a year, 3 sites.")
    assert [fact.text for fact in lacking] == ["$1,250.00"]
    european = extract(["Le total est de 1 250,50 € (TVA 20 %) et 12.500 clients."])
    assert {fact.key for fact in european if fact.kind == "number"} == {"1250.5", "20", "12500"}
    assert normalize("1,000  Units\u00a0") == "1000 units"


def test_list_markers_and_numbers_inside_identifiers_are_not_numbers() -> None:
    kinds = _kinds("Steps:\n1. Restart node H200-b7.\n2. Check v2 of the API.")
    assert kinds.get("number") is None
    assert kinds["id"] == ["H200-b7"]


def test_identifiers_emails_urls_and_paths() -> None:
    text = (
        "Ticket ORD-4471 (uuid 123e4567-e89b-12d3-a456-426614174000) on A350-900, build 3.11.4, field user_id. "
        "Mail dana.w@acme-mail.com, see https://acme.example.com/orders/4471. Logs in /var/log/acme/app.log, "
        "code in src/acme/cli.py and settings.yaml. A follow-up on the well-known COVID-19 rules."
    )
    kinds = _kinds(text)
    assert set(kinds["id"]) == {
        "ORD-4471",
        "123e4567-e89b-12d3-a456-426614174000",
        "A350-900",
        "3.11.4",
        "user_id",
        "COVID-19",
    }
    assert kinds["email"] == ["dana.w@acme-mail.com"]
    assert kinds["url"] == ["https://acme.example.com/orders/4471"]  # the sentence's full stop is not part of it
    assert set(kinds["path"]) == {"/var/log/acme/app.log", "src/acme/cli.py", "settings.yaml"}
    facts = extract([text])
    summary = (
        "ord-4471 (123E4567-E89B-12D3-A456-426614174000), A350‑900, 3.11.4, user_id, DANA.W@acme-mail.com, "
        "acme.example.com/orders/4471/, /var/log/acme/app.log, src/acme/cli.py, settings.yaml, COVID-19."
    )
    assert [fact for fact in missing(facts, summary) if fact.kind in ("id", "email", "url", "path")] == []
    lacking = missing(facts, summary.replace("ord-4471", "ord-4417"))
    assert [fact.text for fact in lacking if fact.kind in ("id", "email", "url", "path")] == ["ORD-4471"]


def test_dates_and_times_match_in_other_formats() -> None:
    facts = extract(["Delivery on 2026-03-14 at 3pm, or 14/03/2026 at 10:30; the meeting is March 20."])
    dates = [fact for fact in facts if fact.kind in ("date", "time")]
    assert [fact.key for fact in dates] == ["2026-03-14", "--03-20", "15:00", "10:30"]  # one date, two spellings
    assert missing(dates, "Delivery 14 March 2026 at 15:00 or 10:30 am; meeting on 20 March.") == ()
    assert missing(dates, "Delivery 03/14/2026 at 3 p.m. or 10:30; meeting 20th of March.") == ()
    lacking = missing(dates, "Delivery 2026-03-15 at 4 pm or 10:30; meeting March 20.")
    assert [fact.text for fact in lacking] == ["2026-03-14", "3pm"]


def test_names_are_capitalised_words_not_at_sentence_start_and_bounded() -> None:
    text = (
        "Yesterday Dana Whitfield met Omar at the Leipzig office. Later, Dana called DHL. The parcel left Reno. "
        "Parcels are slow. Omar and Dana agreed."
    )
    names = [fact.text for fact in extract([text]) if fact.kind == "name"]
    assert names[:2] == ["Dana Whitfield", "Omar"]
    assert set(names) == {"Dana Whitfield", "Omar", "Leipzig", "DHL", "Reno"}  # not Yesterday, Later, Parcels
    crowd = " ".join(f"We met {name} there." for name in ("Ann", "Bo", "Cy", "Di", "Ed", "Flo", "Gus", "Hal", "Ivy"))
    assert len([fact for fact in extract([crowd + " We met Ann again."]) if fact.kind == "name"]) == 8
    facts = [fact for fact in extract([text]) if fact.kind == "name"]
    assert missing(facts, "Dana met Omar in Leipzig; Dana called DHL about the parcel from Reno.") == ()


def test_constraint_sentences_need_their_modal_word_and_most_content_words() -> None:
    text = (
        "You must never ship to P.O. boxes. We only deliver within the EU. Please don't call the customer after "
        "6pm. The weather was nice. Invoices are required for every refund."
    )
    constraints = [fact for fact in extract([text]) if fact.kind == "constraint"]
    assert [fact.text for fact in constraints] == [
        "You must never ship to P.O. boxes.",
        "We only deliver within the EU.",
        "Please don't call the customer after 6pm.",
        "Invoices are required for every refund.",
    ]
    faithful = (
        "Never ship to P.O. boxes. Delivery only within the EU. Do not call the customer after 6pm. "
        "Every refund requires an invoice."
    )
    assert missing(constraints, faithful) == ()
    weakened = faithful.replace("Never ship", "Shipping").replace("only within", "within")
    assert [fact.text for fact in missing(constraints, weakened)] == [
        "You must never ship to P.O. boxes.",
        "We only deliver within the EU.",
    ]
    assert len(missing(constraints, "The customer has some delivery preferences.")) == 4


def test_open_tasks_and_unanswered_questions() -> None:
    tasks = extract(["TODO: send the revised invoice. The refund is still pending approval. Lunch was great."])
    assert [fact.text for fact in tasks if fact.kind == "task"] == [
        "TODO: send the revised invoice.",
        "The refund is still pending approval.",
    ]
    assert missing(tasks, "Open: send the revised invoice; the refund still awaits approval (pending).") == ()
    question = "Can you check whether the Leipzig hub has my parcel? Thanks!"
    assert [f.kind for f in extract([Source(question, frozenset({"questions"}))])] == ["task"]
    assert extract([Source(question, frozenset())]) == ()
    assert [fact.kind for fact in extract([Source(question, frozenset({"tasks"}))])] == []
    (fact,) = extract([Source(question, frozenset({"questions"}))])
    assert missing([fact], "Unanswered: whether the Leipzig hub has the parcel.") == ()
    assert missing([fact], "The user said thanks.") == (fact,)


def test_code_blocks_are_not_mined_for_facts() -> None:
    text = "Use this:\n```python\nuser_id = 4471\nprint(user_id, 'ORD-9')\n```\nIt prints 2 values."
    assert {fact.text for fact in extract([text])} == {"2"}


def test_a_faithful_summary_of_the_shipped_sample_agent_passes() -> None:
    from importlib import resources

    sample = json.loads(resources.files("contextkeeper").joinpath("data/sample_agent.json").read_text("utf-8"))
    sources = [
        Source(m["content"]) if m["role"] == "user" else Source(m["content"], frozenset({"numbers", "ids", "names"}))
        for m in sample["messages"][1:-1]
        if m["role"] in ("user", "assistant") and m.get("content")
    ]
    facts = extract(sources)
    summary = (
        "The user wants to fly from Paris CDG to Tokyo NRT on 14 December 2026 with at most one stop.\n"
        "- The assistant found 14 flights. Cheapest direct: AF270 (departs 10:05, A350-900) at €812, about "
        "¥131,844 (JPY).\n- One-stop alternative: AF271 at €849.\n"
        "- Tokyo weather: 11°C and clear on arrival, rain on the 16th.\n"
        "- The assistant offered to hold AF270 and will not book without the user's confirmation."
    )
    assert len(facts) >= 15
    assert missing(facts, summary) == ()
    assert {fact.text for fact in missing(facts, summary.replace("at most one stop", "one stop"))} == {
        "I want to fly from Paris CDG to Tokyo NRT on 2026-12-14, at most one stop."
    }


def test_fact_is_a_frozen_value() -> None:
    fact = Fact("id", "ORD-4471", "ord-4471")
    assert str(fact) == "ORD-4471"
    with pytest.raises(AttributeError):
        fact.text = "x"  # type: ignore[misc]
