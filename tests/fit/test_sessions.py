"""One keeper, many conversations: each has its own session, so interleaving chats (or fitting them on threads)
gives every chat the fits it would get from a keeper of its own."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest

import contextkeeper as ck
from assets import template
from conftest import hf_tokenizer
from contextkeeper.keeper import ContextKeeper
from contextkeeper.strategies.policy import Policy, PolicyStep

QWEN = "Qwen-Qwen2.5-7B-Instruct"
WORDS = {
    "en": "flight departs at noon and costs ninety euros",
    "zh": "航班中午起飞票价九十欧元",
    "ru": "рейс вылетает в полдень и стоит девяносто евро",
    "ar": "الرحلة تغادر ظهرا وتكلف تسعين يورو",
}


@pytest.fixture(scope="module")
def counter() -> ck.HFChatTemplateCounter:
    return ck.HFChatTemplateCounter(hf_tokenizer("qwen2"), chat_template=template(QWEN), name=QWEN)


def make(counter: ck.HFChatTemplateCounter, **kwargs: Any) -> ContextKeeper:
    policy = Policy(
        name="sessions",
        steps=(PolicyStep(strategy="prune_tool_results", keep_last=2, clear_at_least=100),),
        horizon=0,
    )
    return ContextKeeper(counter, context_window=1500, policy=policy, **kwargs)


def chat(language: str, turns: int) -> list[dict[str, Any]]:
    """An agent chat in one language that outgrows the window after a few turns."""
    words = WORDS[language]
    messages: list[dict[str, Any]] = [{"role": "system", "content": f"Travel agent ({language})."}]
    for t in range(turns):
        call_id = f"call{t:05d}"
        messages += [
            {"role": "user", "content": f"{t}: {words}?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": "search", "arguments": json.dumps({"q": f"{words} {t}"})},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call_id, "content": " ".join([words] * 12)},
            {"role": "assistant", "content": f"{t}. {words}."},
        ]
    return [*messages, {"role": "user", "content": f"{words}!"}]


def outcome(fit: ck.Fit) -> tuple[Any, ...]:
    return fit.messages, fit.tokens, [a.strategy for a in fit.report.actions]


def test_interleaved_conversations_fit_as_they_would_alone(counter: ck.HFChatTemplateCounter) -> None:
    shared = make(counter)
    alone = {language: make(counter) for language in WORDS}
    for turn in range(1, 14):
        for language in WORDS:  # every turn of one chat comes between turns of the three others
            messages = chat(language, turn)
            together = shared.fit(messages, max_tokens=200, conversation=language)
            assert outcome(together) == outcome(alone[language].fit(messages, max_tokens=200))
            # The count is the real one, from a counter that fitted nothing before.
            assert together.tokens == counter.fork().count(together.messages)
    assert any(a.strategy == "prune_tool_results" for a in together.report.actions)
    assert shared.last_fit is together


def test_threads_fit_different_conversations_side_by_side(counter: ck.HFChatTemplateCounter) -> None:
    shared = make(counter)
    names = [f"{language}-{i}" for language in WORDS for i in range(2)]  # 8 threads
    expected = {
        name: [outcome(fit) for fit in _turns(make(counter), name[:2], None)] for name in names
    }  # one keeper per chat, one after another
    got: dict[str, list[tuple[Any, ...]]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(names))

    def worker(name: str) -> None:
        try:
            start.wait(timeout=30)
            got[name] = [outcome(fit) for fit in _turns(shared, name[:2], name)]
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(name,)) for name in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors
    assert got == expected
    assert sorted(shared.sessions()) == sorted(names)


def _turns(keeper: ContextKeeper, language: str, conversation: str | None) -> list[ck.Fit]:
    return [keeper.fit(chat(language, turn), max_tokens=200, conversation=conversation) for turn in range(1, 10)]


def test_a_conversation_forgotten_or_evicted_is_fitted_again_from_scratch(counter: ck.HFChatTemplateCounter) -> None:
    shared = make(counter, conversations=2)
    fresh = make(counter)
    for name in ("a", "b", "c"):
        shared.fit(chat("en", 6), max_tokens=200, conversation=name)
    assert shared.sessions() == ["b", "c"]  # the least recently used went first
    again = shared.fit(chat("en", 7), max_tokens=200, conversation="a")
    assert outcome(again) == outcome(fresh.fit(chat("en", 7), max_tokens=200))
    assert shared.sessions() == ["c", "a"]
    assert shared.forget("c") is True
    assert shared.forget("c") is False
    assert shared.sessions() == ["a"]
    # The default conversation is one like any other.
    shared.fit(chat("ru", 3), max_tokens=200)
    assert "default" in shared.sessions()
    assert shared.forget() is True


def test_each_conversation_counts_its_own_turns(counter: ck.HFChatTemplateCounter) -> None:
    """Per-turn state (a strategy's turn number, the summarizer's calls per turn) is per conversation."""
    keeper = make(counter)
    for turn in (8, 9, 10):
        keeper.fit(chat("en", turn), max_tokens=200, conversation="en")
    keeper.fit(chat("ru", 8), max_tokens=200, conversation="ru")
    assert [keeper._sessions.get(name).turn for name in ("en", "ru")] == [3, 1]


@pytest.mark.parametrize("bad", ["", 5, b"chat"])
def test_a_conversation_is_a_non_empty_string(counter: ck.HFChatTemplateCounter, bad: Any) -> None:
    with pytest.raises(ck.ConfigurationError, match="conversation must be a non-empty string") as error:
        make(counter).fit(chat("en", 1), conversation=bad)
    assert "conversation='user-42'" in str(error.value)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "10"])
def test_the_number_of_conversations_is_checked(counter: ck.HFChatTemplateCounter, bad: Any) -> None:
    with pytest.raises(ck.ConfigurationError, match="conversations must be a whole number >= 1"):
        make(counter, conversations=bad)


def test_fresh_keeps_no_conversation(counter: ck.HFChatTemplateCounter) -> None:
    keeper = make(counter)
    keeper.fit(chat("zh", 2), max_tokens=200, conversation="x")
    assert keeper.fresh().sessions() == []
    assert keeper.sessions() == ["x"]


class CountOnly:
    """A custom counter with the one required method (a real tokenizer underneath)."""

    def __init__(self, inner: ck.HFChatTemplateCounter) -> None:
        self.inner = inner

    def count(self, messages: Any, *, tools: Any = None, add_generation_prompt: bool = True) -> int:
        return self.inner.count(messages, tools=tools, add_generation_prompt=add_generation_prompt)


class Able(CountOnly):
    """The same, declaring two optional abilities: each conversation gets a fork, snippets are counted directly."""

    forks = 0

    def fork(self) -> Able:
        Able.forks += 1
        return Able(self.inner.fork())

    def text_tokens(self, text: str) -> int:
        return self.inner.text_tokens(text)


def test_a_custom_counter_needs_only_count_and_opts_into_each_ability(counter: ck.HFChatTemplateCounter) -> None:
    from contextkeeper.tokens import Forking, TextCounting, TokenCounter

    bare, able = CountOnly(counter.fork()), Able(counter.fork())
    assert isinstance(bare, TokenCounter)
    assert not isinstance(bare, (Forking, TextCounting))
    assert isinstance(able, Forking)
    assert isinstance(able, TextCounting)
    expected = make(counter).fit(chat("ar", 9), max_tokens=200)
    for custom in (bare, able):
        keeper = ContextKeeper(custom, context_window=1500, policy=make(counter).policy)
        got = keeper.fit(chat("ar", 9), max_tokens=200, conversation="x")
        assert outcome(got) == outcome(expected)
        session = keeper._sessions.get("x")
        # Snippets: the counter's own method, or two prompt counts when it has none.
        assert session.text_tokens("مرحبا") == counter.text_tokens("مرحبا")
    assert Able.forks == 2  # the conversation's counter and its side counter


@pytest.mark.parametrize("where", ["request", "system"])
def test_a_refused_fit_leaves_nothing_of_its_inputs_in_the_session(
    counter: ck.HFChatTemplateCounter, where: str
) -> None:
    # A proxy keeps up to `conversations` sessions; each must not keep its last refused (oversize) request alive
    # until its next fit. The shared memo budget (its own bound) is made small so that only what the session and
    # its counters hold is measured.
    import gc
    import tracemalloc

    from contextkeeper._memo import cache_bytes, set_cache_bytes

    keeper = make(counter)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    keeper.fit(chat, max_tokens=64, conversation="big")
    budget = cache_bytes()
    set_cache_bytes(2**20)
    try:
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        huge = "word " * 1_000_000  # 5 MB, far over the 1,500-token window
        refused = [
            {"role": "system", "content": huge if where == "system" else "Be brief."},
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "hi"},
            {"role": "user", "content": huge if where == "request" else "and now?"},
        ]
        with pytest.raises(ck.RequestTooLarge):
            keeper.fit(refused, max_tokens=64, conversation="big")
        del refused, huge
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
    finally:
        set_cache_bytes(budget)
    assert kept < 3 * 2**20  # the memo's 1 MiB and change, not the 5 MB input nor its render
    # The conversation goes on as before.
    assert keeper.fit([*chat, {"role": "assistant", "content": "hi"}], max_tokens=64, conversation="big").tokens > 0
