"""A keeper's typed configuration (contextkeeper.config): the objects check themselves once, the old keywords fill
the same objects, and giving both at once is refused."""

from __future__ import annotations

import dataclasses
import sqlite3
from pathlib import Path

import pytest

import contextkeeper as ck
from assets import tokenizer_dir
from contextkeeper.config import Admission, Limit, Recording, Sharing

CHAT = [{"role": "user", "content": "Which flights leave Lisbon for Porto after six tonight?"}]


def keeper(**settings: object) -> ck.ContextKeeper:
    return ck.ContextKeeper(str(tokenizer_dir("qwen2")), **settings)  # type: ignore[arg-type]


def test_the_objects_and_the_keywords_make_the_same_keeper() -> None:
    by_keywords = keeper(
        context_window=4096, model="qwen2.5-7b", gpu="RTX 4090", concurrency=8, admission="shrink", kv_capacity=9000
    )
    by_objects = keeper(
        limit=Limit(context_window=4096, model="qwen2.5-7b", gpu="RTX 4090", concurrency=8),
        admission=Admission(mode="shrink", capacity=9000),
    )
    for made in (by_keywords, by_objects):
        assert made.limit_config == Limit(context_window=4096, model="qwen2.5-7b", gpu="RTX 4090", concurrency=8)
        assert made.admission_config == Admission(mode="shrink", capacity=9000)
    assert (by_keywords.limit, by_keywords.limit_source) == (by_objects.limit, by_objects.limit_source)
    assert (by_objects.ledger.capacity, by_objects.ledger.mode) == (9000, "shrink")
    assert by_keywords.fit(CHAT, max_tokens=256).tokens == by_objects.fit(CHAT, max_tokens=256).tokens


def test_an_object_and_a_keyword_for_the_same_part_are_refused() -> None:
    with pytest.raises(ck.ConfigurationError, match=r"limit=Limit\(\.\.\.\) and context_window= both given"):
        keeper(limit=Limit(context_window=4096), context_window=8192)
    with pytest.raises(ck.ConfigurationError, match=r"admission_timeout=, kv_capacity= both given"):
        keeper(context_window=4096, admission=Admission(), admission_timeout=5.0, kv_capacity=100)
    # a keyword left at its default is no clash
    assert keeper(limit=Limit(context_window=4096), concurrency=1).limit == 4096
    with pytest.raises(ck.ConfigurationError, match=r"limit must be a contextkeeper\.config\.Limit"):
        keeper(limit={"context_window": 4096})


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: Limit(context_window=0), "context_window must be a positive integer"),
        (lambda: Limit(context_window=True), "context_window must be a positive integer"),
        (lambda: Limit(), "set context_window=N"),
        (lambda: Limit(context_window=10, gpu="RTX 4090"), "gpu=... needs model=..."),
        (lambda: Admission(mode="later"), "admission must be 'wait'"),  # type: ignore[arg-type]
        (lambda: Admission(timeout=-1), "admission_timeout must be a number of seconds >= 0"),
        (lambda: Admission(ledger="http://localhost:6379"), "ledger must be a Redis URL"),
        (lambda: Admission(unavailable="maybe"), "ledger_unavailable must be 'fail'"),  # type: ignore[arg-type]
        (lambda: Sharing(state="memcached://x"), "shared must be a Redis URL"),
        (lambda: Sharing(unavailable="later"), "shared_unavailable must be 'fail'"),  # type: ignore[arg-type]
        (lambda: Recording(transcript=3), "transcript"),
    ],
)
def test_each_object_checks_itself_when_made(make: object, words: str) -> None:
    with pytest.raises(ck.ConfigurationError, match=words):
        make()  # type: ignore[operator]


def test_the_objects_are_frozen_and_keyword_only() -> None:
    limit = Limit(context_window=4096)
    with pytest.raises(dataclasses.FrozenInstanceError):
        limit.context_window = 8192  # type: ignore[misc]
    with pytest.raises(TypeError):
        Limit(4096)  # type: ignore[misc]


def test_sharing_follows_the_ledger_unless_told() -> None:
    ledger = Admission(ledger="redis://127.0.0.1:1/0", unavailable="local")
    assert Sharing().resolved(ledger) == Sharing(state="redis://127.0.0.1:1/0", unavailable="local")
    assert Sharing(state=False).resolved(ledger) == Sharing(state=None, unavailable="local")
    assert Sharing(unavailable="fail").resolved(Admission()) == Sharing(state=None, unavailable="fail")


def test_recording_takes_the_transcript_a_wrapped_call_writes(tmp_path: Path) -> None:
    path = tmp_path / "calls.sqlite"
    made = keeper(context_window=4096, recording=Recording(transcript=str(path)))
    client = made.wrap(lambda messages, **kwargs: "Two: 18:40 and 19:55.")
    assert client(CHAT, max_tokens=64) == "Two: 18:40 and 19:55."
    made.close()
    with sqlite3.connect(path) as db:
        assert db.execute("select count(*) from calls").fetchone()[0] == 1
