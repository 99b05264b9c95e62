"""Every cache keyed by object identity is an IdentityMemo in the one memo module: reported by ``cache_usage()``
under its name, held inside ``set_cache_bytes``, and never answering a new object that took an old one's id."""

from __future__ import annotations

import gc
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import contextkeeper as ck
from assets import template
from conftest import hf_tokenizer
from contextkeeper import Message
from contextkeeper._memo import IdentityMemo, cache_usage, set_cache_bytes
from contextkeeper.calls.transcript import MemoryTranscript, SQLiteTranscript
from contextkeeper.fit.engine import _new_dict
from contextkeeper.fit.session import Session
from contextkeeper.strategies import FitState, Item, Memory
from contextkeeper.strategies.base import _Rewrites, _unit_chars
from contextkeeper.strategies.policy import Policy, PolicyStep
from contextkeeper.testing.settings import BudgetSettings
from contextkeeper.tokens._sandbox import FROZEN_JSON
from conversations import TOOLS

QWEN = "Qwen-Qwen2.5-7B-Instruct"
_COUNTERS: list[ck.HFChatTemplateCounter] = []


def counter() -> ck.HFChatTemplateCounter:
    """A counter of its own (its own views cache); the tokenizer is loaded once."""
    return ck.HFChatTemplateCounter(hf_tokenizer("qwen2"), chat_template=template(QWEN), name=QWEN)


def shared_counter() -> ck.HFChatTemplateCounter:
    if not _COUNTERS:
        _COUNTERS.append(counter())
    return _COUNTERS[0]


POLICY = Policy(
    name="identity-caches",
    steps=(
        PolicyStep(strategy="dedupe", min_chars=20),
        PolicyStep(strategy="prune_tool_results", keep_last=1, clear_at_least=50),
        PolicyStep(strategy="truncate", max_tokens=60),
        PolicyStep(strategy="sliding_window"),
    ),
    horizon=0,
)


def keeper(context: int = 900, on: ck.HFChatTemplateCounter | None = None) -> ck.ContextKeeper:
    return ck.ContextKeeper(on or shared_counter(), context_window=context, policy=POLICY)


def agent_chat(seed: int, turns: int = 6) -> list[dict[str, Any]]:
    """Tool calls with long results (pruned, truncated), a repeated long message (de-duplicated), many turns
    (the window slides): every strategy cache is used. Text differs per ``seed``."""
    chat: list[dict[str, Any]] = [{"role": "system", "content": f"You are agent {seed}."}]
    for t in range(turns):
        chat.append({"role": "user", "content": f"Chat {seed} turn {t}: find flights to city {t}."})
        call_id = f"c{seed % 1000:03d}{t:05d}"
        arguments = json.dumps({"city": f"city {t}", "seed": seed})
        chat.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": call_id, "type": "function", "function": {"name": "search_flights", "arguments": arguments}}
                ],
            }
        )
        rows = " ".join(f"flight F{seed}-{t}-{i} departs {i:02d}:15 costs {90 + i} EUR;" for i in range(40))
        chat.append({"role": "tool", "tool_call_id": call_id, "content": rows})
        chat.append({"role": "assistant", "content": f"Chat {seed}: the same answer repeated here, as agents do."})
    chat.append({"role": "user", "content": f"Chat {seed}: book the cheapest one, please."})
    return chat


MOVED = (
    "keeper.dicts",
    "fit.rewrites",
    "fit.rewrite_roots",
    "hf.views",
    "sandbox.tojson",
    "transcript.seen",
    "transcript.blobs",
    "transcript.nodes",
    "transcript.created",
    "transcript.paths",
)


@pytest.fixture
def small_cache() -> Iterator[int]:
    limit = 512 * 1024
    set_cache_bytes(limit)
    try:
        yield limit
    finally:
        set_cache_bytes(None)


def recycled(make: Callable[[int], Any], use: Callable[[Any], None], tries: int = 2000) -> int:
    """Make an object, ``use`` it (``use`` checks its answer), drop it, then make and use new ones until one
    takes the dropped one's id (at most ``tries``). Returns how many took it."""
    first = make(-1)
    use(first)
    old = id(first)
    del first
    gc.collect()
    reused = 0
    for n in range(tries):
        obj = make(n)
        use(obj)
        if id(obj) == old:
            reused += 1
            break
        del obj
    return reused


# ------------------------------------------------------------------------------------ (a) reported by name


def test_every_moved_cache_is_an_identity_memo_reported_by_name(tmp_path: Path) -> None:
    k = keeper()
    fit = k.fit(agent_chat(1), tools=TOOLS, max_tokens=200)
    names = {a.strategy for a in fit.report.actions}
    assert {"dedupe", "prune_tool_results", "truncate", "sliding_window"} <= names, names
    assert any(m not in agent_chat(1) for m in fit.messages)  # rewrites handed back as new dicts
    with SQLiteTranscript(tmp_path / "t.sqlite") as transcript:
        chat = agent_chat(2)
        transcript.add(chat, conversation="a")
        transcript.add([*chat, {"role": "user", "content": "more"}], conversation="a")
        by_name = cache_usage().by_name
        for name in MOVED:
            assert by_name.get(name, 0) > 0, (name, by_name.get(name))
        assert isinstance(transcript._seen, IdentityMemo)
    session = k._sessions.get("default")
    assert isinstance(session.dicts, IdentityMemo)
    rewrites = session.memory.get(_Rewrites)
    assert rewrites is not None
    assert isinstance(rewrites.made, IdentityMemo)
    assert isinstance(rewrites.roots, IdentityMemo)
    assert isinstance(shared_counter()._views, IdentityMemo)
    assert isinstance(FROZEN_JSON._outputs, IdentityMemo)


# ------------------------------------------------------------------------ (b) bounded, and still right


def test_fits_stay_inside_a_small_budget_and_equal_a_fresh_keepers(small_cache: int) -> None:
    k = keeper()
    reference = counter()
    for seed in range(30):
        chat = agent_chat(seed)
        fit = k.fit(chat, tools=TOOLS, max_tokens=200)
        assert cache_usage().held <= small_cache
        again = k.fit(chat, tools=TOOLS, max_tokens=200)  # answered from the caches that survived
        assert again.messages == fit.messages
        assert again.tokens == fit.tokens
        if seed % 10 == 0:
            fresh = keeper(on=reference).fit(json.loads(json.dumps(chat)), tools=TOOLS, max_tokens=200)
            assert fit.messages == fresh.messages
            assert fit.tokens == fresh.tokens == reference.reference_count(fit.messages, tools=TOOLS)
    by_name = cache_usage().by_name
    assert all(by_name.get(name, 0) <= small_cache for name in MOVED)


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_a_transcript_stays_inside_a_small_budget_and_reads_back_whole(
    small_cache: int, tmp_path: Path, kind: str
) -> None:
    transcript = MemoryTranscript() if kind == "memory" else SQLiteTranscript(tmp_path / "t.sqlite")
    with transcript:
        chats = {}
        for seed in range(120):
            name = f"chat {seed % 40}"
            chat = chats.setdefault(name, agent_chat(seed, turns=2))
            chat.append({"role": "user", "content": f"and again {seed} " + "padding " * 30})
            transcript.add(list(chat), conversation=name)
            assert cache_usage().held <= small_cache
        for name, chat in chats.items():
            assert transcript.history(name) == chat
        assert len(transcript.entries()) == 120
        if kind == "memory":
            # Each distinct message stored once, whatever the caches dropped.
            distinct = {json.dumps(m) for chat in chats.values() for m in chat}
            assert len(transcript._texts) == len(distinct)
        usage = cache_usage().by_name
        assert sum(usage.get(name, 0) for name in MOVED if name.startswith("transcript.")) <= small_cache


# --------------------------------------------------------------------- (c) a recycled id is never answered


def _message(n: int) -> Message:
    return Message.from_dict({"role": "tool", "tool_call_id": "abc123def", "content": f"result number {n}"})


def test_hf_views_never_answer_a_recycled_id() -> None:
    c = counter()

    def use(message: Message) -> None:
        assert c.count([message]) == c.reference_count([message.to_dict()])

    recycled(lambda n: Message.from_dict({"role": "user", "content": f"question {n} " * (n % 3 + 1)}), use)


def test_keeper_dicts_never_answer_a_recycled_id() -> None:
    session = Session.of("test", shared_counter(), fork=False)

    def use(message: Message) -> None:
        assert _new_dict(session, message) == message.to_dict()
        assert _new_dict(session, message) == message.to_dict()  # from the memo

    recycled(_message, use)
    assert len(session.dict_memo()) > 0


def _state() -> FitState:
    return FitState(system=(), history=(), request=(), limit=1000, count=lambda history: 0, memory=Memory())


def test_unit_chars_are_each_items_own_and_never_a_recycled_ids() -> None:
    state = _state()

    def use(unit: tuple[Item, ...]) -> None:
        assert state.unit_chars([unit]) == [_unit_chars(unit)]
        assert state.unit_chars([unit]) == [_unit_chars(unit)]  # counted once, then read from the items
        assert all(item._chars == _unit_chars((item,)) for item in unit)

    recycled(lambda n: (Item(_message(n)), Item(_message(n * 7))), use)
    assert state.memory.kinds() == []  # unit sizes live on the items, not in the conversation's memory


def test_rewrites_and_their_roots_never_answer_a_recycled_id() -> None:
    state = _state()

    def use(source: Message) -> None:
        def build() -> Message:
            return Message.from_dict({**source.to_dict(), "content": f"cut: {source.content}"})

        item = state.reuse(source, ("cut",), build)
        assert item.message.content == f"cut: {source.content}"
        assert item.source is source  # its own root, not an earlier rewrite's
        assert state.reuse(source, ("cut",), build).message is item.message  # the same rewrite while kept
        again = state.reuse(item.message, ("clear",), lambda: Message.from_dict({**source.to_dict(), "content": ""}))
        assert again.source is source  # a chain of rewrites leads back to the caller's message

    recycled(_message, use)


def test_a_rewrite_per_key_is_kept_and_a_changing_key_cannot_pile_up() -> None:
    state = _state()
    source = _message(1)
    made = [state.reuse(source, ("prune", n), lambda n=n: _message(1000 + n)).message for n in range(20)]
    assert len({id(m) for m in made}) == 20
    assert state.reuse(source, ("prune", 19), lambda: _message(0)).message is made[19]
    assert len(state.memory.slot(_Rewrites).made.get(source)) <= 8


def test_tojson_of_tool_schemas_never_answers_a_recycled_id() -> None:
    c = counter()
    chat = [{"role": "user", "content": "which tool?"}]

    def make(n: int) -> list[dict[str, Any]]:
        tool = json.loads(json.dumps(TOOLS[0]))
        tool["function"]["description"] = f"tool version {n}"
        return [tool]

    def use(tools: list[dict[str, Any]]) -> None:
        # The counter registers its own copy of the schemas and unregisters the last one: freed, its ids free.
        assert c.count(chat, tools=tools) == c.reference_count(chat, tools=tools)

    recycled(make, use, tries=300)


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_the_transcript_never_answers_a_recycled_id(tmp_path: Path, kind: str) -> None:
    transcript = MemoryTranscript() if kind == "memory" else SQLiteTranscript(tmp_path / "t.sqlite")

    def use(message: dict[str, Any]) -> None:
        entry = transcript.add([message])
        assert transcript.get(entry.call).inputs == (message,)

    with transcript:
        recycled(lambda n: {"role": "user", "content": f"message {n}"}, use, tries=300)


def test_pytest_plugin_keeper_keys_never_match_a_recycled_id() -> None:
    """The plugin caches keepers by their settings' key; an object in the settings is part of the key by
    identity, so the key must hold it: else a new object that took a dropped one's id finds its keeper."""
    keys: dict[tuple[Any, ...], str] = {}

    def settings(obj: object) -> BudgetSettings:
        return BudgetSettings(values={"tokenizer": obj, "context_window": 100}, sources={})

    def use(obj: object) -> None:
        key = settings(obj).key()
        assert key == settings(obj).key()  # the same object: the same keeper
        assert keys.get(key, repr(obj)) == repr(obj)  # another object: never another's keeper
        keys[key] = repr(obj)

    class Tokenizer:
        def __init__(self, n: int) -> None:
            self.n = n

        def __repr__(self) -> str:
            return f"Tokenizer({self.n})"

    recycled(Tokenizer, use)
