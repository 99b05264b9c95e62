"""The transcript: what each call was given, sent and received, what its prompt dropped or rewrote, recovery of
those originals, in memory and in a SQLite file that survives restarts and grows linearly with the chat."""

from __future__ import annotations

import copy
import json
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import contextkeeper as ck
from contextkeeper._exceptions import UnknownCall
from contextkeeper.calls.transcript import MemoryTranscript, SQLiteTranscript, Transcript, diff_prompt, open_transcript
from contextkeeper.messages import Message
from contextkeeper.strategies.policy import Policy, PolicyStep
from contextkeeper.strategies.summarize import ACKNOWLEDGEMENT, SUMMARY_PREFIX
from conversations import TOOLS


@pytest.fixture(scope="module")
def counter() -> Any:
    return ck.load_counter("mistral:tekken")  # offline: mistral-common ships it


def keeper(counter: Any, context: int, *steps: PolicyStep) -> ck.ContextKeeper:
    return ck.ContextKeeper(counter, context_window=context, policy=Policy(name="t", steps=steps, horizon=0))


def agent_chat(turns: int, result_words: int = 120) -> list[dict[str, Any]]:
    """system, then user -> assistant tool call -> tool result -> assistant answer, then a final request."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a travel agent."}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"Turn {t}: flights to city {t} under {100 + t} EUR?"})
        call_id = f"call{t:05d}"
        args = json.dumps({"city": f"city {t}"})
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": call_id, "type": "function", "function": {"name": "search", "arguments": args}}],
            }
        )
        rows = " ".join(f"flight F{t}{i} departs {i:02d}:15 costs {90 + i} EUR;" for i in range(result_words // 8))
        messages.append({"role": "tool", "tool_call_id": call_id, "content": rows})
        messages.append({"role": "assistant", "content": f"I found {result_words // 8} flights to city {t}."})
    messages.append({"role": "user", "content": "Book the cheapest one, please."})
    return messages


def check_partition(
    inputs: list[Any], sent: list[Any], kept: tuple[int, ...], dropped: tuple[int, ...], rw: tuple[int, ...]
) -> None:
    assert sorted([*kept, *dropped, *rw]) == list(range(len(inputs)))
    assert all(any(inputs[i] is s or inputs[i] == s for s in sent) for i in kept)
    assert len(kept) + sum(1 for s in sent if not any(s is inputs[i] for i in kept)) >= len(sent)


# ------------------------------------------------------------------------------------------------ diff


def test_diff_of_a_real_prune_names_the_rewritten_tool_results(counter: Any) -> None:
    k = keeper(counter, 6000, PolicyStep(strategy="prune_tool_results", keep_last=2, clear_at_least=500))
    messages = agent_chat(25)
    fit = k.fit(messages, tools=TOOLS, max_tokens=512)
    assert any(a.strategy == "prune_tool_results" for a in fit.report.actions)
    kept, dropped, rewritten = diff_prompt(messages, fit.messages)
    check_partition(messages, fit.messages, kept, dropped, rewritten)
    assert rewritten
    assert not dropped
    sent_by_id = {m.get("tool_call_id"): m for m in fit.messages if m["role"] == "tool"}
    for i in rewritten:
        assert messages[i]["role"] == "tool"
        replacement = sent_by_id[messages[i]["tool_call_id"]]
        assert replacement["content"] != messages[i]["content"]
    # Every untouched message came back as the caller's own object.
    assert all(any(messages[i] is s for s in fit.messages) for i in kept)


def test_diff_of_a_real_sliding_window_names_the_dropped_prefix(counter: Any) -> None:
    k = keeper(counter, 1500)
    messages = agent_chat(20)
    fit = k.fit(messages, tools=TOOLS, max_tokens=256)
    kept, dropped, rewritten = diff_prompt(messages, fit.messages, unread=fit.report.unread)
    check_partition(messages, fit.messages, kept, dropped, rewritten)
    assert not rewritten
    assert dropped == tuple(range(1, dropped[-1] + 1))  # one run after the system prompt: the oldest turns
    assert kept == (0, *range(dropped[-1] + 1, len(messages)))


def test_diff_of_truncate_and_window_together(counter: Any) -> None:
    k = keeper(counter, 2500, PolicyStep(strategy="truncate", max_tokens=60, when="always"))
    messages = agent_chat(40, result_words=400)
    fit = k.fit(messages, tools=TOOLS, max_tokens=256)
    strategies = {a.strategy for a in fit.report.actions}
    assert "truncate" in strategies
    kept, dropped, rewritten = diff_prompt(messages, fit.messages)
    check_partition(messages, fit.messages, kept, dropped, rewritten)
    assert rewritten
    assert dropped
    assert max(dropped) < min(rewritten)  # the window drops the oldest; the kept suffix holds the rewrites
    assert all(messages[i]["role"] == "tool" for i in rewritten)


def test_diff_of_message_objects_and_dedupe(counter: Any) -> None:
    k = keeper(counter, 32768, PolicyStep(strategy="dedupe", when="always", min_chars=10))
    repeated = "Please remember: my passport number is X1234567 and I prefer aisle seats."
    dicts = agent_chat(3)
    dicts[1:1] = [{"role": "user", "content": repeated}, {"role": "assistant", "content": "Noted."}]
    dicts[-1:-1] = [{"role": "user", "content": repeated}, {"role": "assistant", "content": "Noted again."}]
    messages = [Message.from_dict(m) for m in dicts]
    fit = k.fit(messages, tools=TOOLS, max_tokens=512)
    kept, dropped, rewritten = diff_prompt(messages, fit.messages)
    check_partition(messages, fit.messages, kept, dropped, rewritten)
    assert rewritten == (1,)
    assert not dropped


def test_diff_of_a_summary_counts_its_sources_as_rewritten() -> None:
    system = {"role": "system", "content": "s"}
    old = [
        {"role": "user", "content": "u0"},
        {"role": "assistant", "content": "a0"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"},
    ]
    recent = [{"role": "user", "content": "u2"}, {"role": "assistant", "content": "a2 " * 50}]
    request = {"role": "user", "content": "now?"}
    inputs = [system, *old, *recent, request]
    truncated = {"role": "assistant", "content": "a2 [cut]"}
    sent = [
        system,
        {"role": "user", "content": SUMMARY_PREFIX + "u0 a0 u1 a1"},
        {"role": "assistant", "content": ACKNOWLEDGEMENT},
        recent[0],
        truncated,
        request,
    ]
    kept, dropped, rewritten = diff_prompt(inputs, sent)
    assert kept == (0, 5, 7)
    assert rewritten == (1, 2, 3, 4, 6)
    assert dropped == ()
    # The oldest history beyond the fit's horizon was dropped unread, not summarised.
    kept, dropped, rewritten = diff_prompt(inputs, sent, unread=2)
    assert dropped == (1, 2)
    assert rewritten == (3, 4, 6)


def test_diff_matches_equal_copies_and_repeated_messages() -> None:
    ok = {"role": "assistant", "content": "OK."}
    inputs = [
        {"role": "user", "content": "a"},
        dict(ok),
        {"role": "user", "content": "b"},
        dict(ok),
        {"role": "user", "content": "c"},
    ]
    sent = copy.deepcopy(inputs[2:])  # equal, not identical: the window kept the last three
    kept, dropped, rewritten = diff_prompt(inputs, sent)
    assert (kept, dropped, rewritten) == ((2, 3, 4), (0, 1), ())


# ------------------------------------------------------------------------------------------- transcripts


@pytest.fixture(params=["memory", "sqlite"])
def transcript(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    store: Transcript = MemoryTranscript() if request.param == "memory" else SQLiteTranscript(tmp_path / "t.db")
    with store:
        yield store


def test_a_call_is_recorded_and_its_removed_messages_recovered(counter: Any, transcript: Transcript) -> None:
    k = keeper(counter, 2500, PolicyStep(strategy="prune_tool_results", keep_last=1, clear_at_least=200))
    messages = agent_chat(40)
    before = copy.deepcopy(messages)
    fit = k.fit(messages, tools=TOOLS, max_tokens=256)
    reply = {"role": "assistant", "content": "Booked F140 for 90 EUR."}
    entry = transcript.add(
        messages, fit, tools=TOOLS, received=reply, usage={"prompt_tokens": fit.tokens}, conversation="trip"
    )
    assert messages == before  # the caller's list and dicts are never changed
    assert entry.call == 1
    stored = transcript.get(1)
    assert stored.to_dict() == entry.to_dict()
    assert list(stored.inputs) == before
    assert list(stored.sent) == [dict(m) for m in fit.messages]
    assert stored.tools == tuple(TOOLS)
    assert stored.received == reply
    assert stored.report == fit.report.to_dict()
    assert [a["strategy"] for a in stored.actions] == [a.strategy for a in fit.report.actions]
    assert stored.dropped
    assert stored.rewritten
    recovered = transcript.recover(1)
    assert recovered == [before[i] for i in sorted({*stored.dropped, *stored.rewritten})]
    # Everything the prompt lacks is recoverable: the sent messages plus the recovered ones cover the inputs.
    assert all(m in recovered or m in stored.sent for m in before)
    assert transcript.history("trip") == [*before, reply]
    assert transcript.history("other") == []
    assert transcript.last("trip") == stored
    with pytest.raises(UnknownCall, match="no call 99"):
        transcript.recover(99)


def test_failed_calls_and_conversations(transcript: Transcript) -> None:
    a = [{"role": "user", "content": "hello"}]
    b = [{"role": "user", "content": "bonjour"}]
    transcript.add(a, None, error=TimeoutError("the server timed out"), attempts=4, conversation="a")
    transcript.add(b, None, sent=b, received={"role": "assistant", "content": "salut"}, conversation="b")
    failed = transcript.last("a")
    assert failed is not None
    assert (failed.received, failed.error, failed.attempts) == (None, "TimeoutError: the server timed out", 4)
    assert failed.sent == ()
    assert failed.dropped == ()
    assert transcript.history("a") == a
    assert [e.call for e in transcript.entries()] == [1, 2]
    assert [e.conversation for e in transcript.entries("b")] == ["b"]
    assert len(transcript) == 2


def test_a_dict_changed_in_place_is_recorded_as_it_was(transcript: Transcript) -> None:
    messages = [{"role": "user", "content": "first draft"}]
    transcript.add(messages, None, sent=messages)
    messages[0]["content"] = "second draft"  # the caller edits its own dict between calls
    transcript.add(messages, None, sent=messages)
    first, second = transcript.entries()
    assert first.inputs[0]["content"] == "first draft"
    assert second.inputs[0]["content"] == "second draft"


def test_sqlite_survives_a_restart_and_continues_numbering(tmp_path: Path) -> None:
    path = tmp_path / "chat.db"
    chat: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
    with open_transcript(path) as first:
        for turn in range(3):
            chat.append({"role": "user", "content": f"question {turn}"})
            first.add(chat, None, sent=chat[-2:], received={"role": "assistant", "content": f"answer {turn}"})
            chat.append({"role": "assistant", "content": f"answer {turn}"})
        written = [e.to_dict() for e in first.entries()]
    with open_transcript(str(path)) as again:
        assert isinstance(again, SQLiteTranscript)
        assert [e.to_dict() for e in again.entries()] == written
        assert again.history() == chat
        chat.append({"role": "user", "content": "question 3"})
        assert again.add(chat, None, sent=chat).call == 4
        assert again.recover(2) == chat[:2]  # call 2 sent only its last two messages
    with pytest.raises(ck.ContextKeeperError, match="closed"):
        again.entries()


def test_open_transcript_specs(tmp_path: Path) -> None:
    assert isinstance(open_transcript(None), MemoryTranscript)
    memory = MemoryTranscript()
    assert open_transcript(memory) is memory
    with open_transcript(tmp_path / "sub" / "x.db") as store:
        assert isinstance(store, SQLiteTranscript)
    with pytest.raises(ck.ConfigurationError, match="transcript=42"):
        open_transcript(42)  # type: ignore[arg-type]


def test_threads_record_into_one_sqlite_file(tmp_path: Path) -> None:
    store = SQLiteTranscript(tmp_path / "threads.db")
    errors: list[BaseException] = []

    def worker(name: str) -> None:
        chat: list[dict[str, Any]] = []
        try:
            for turn in range(20):
                chat.append({"role": "user", "content": f"{name} {turn}"})
                store.add(chat, None, sent=chat, conversation=name, received={"role": "assistant", "content": "ok"})
                chat.append({"role": "assistant", "content": "ok"})
        except BaseException as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(f"t{i}",)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors
    assert sorted(e.call for e in store.entries()) == list(range(1, 161))
    for i in range(8):
        history = store.history(f"t{i}")
        assert len(history) == 40
        assert history[-2] == {"role": "user", "content": f"t{i} 19"}
    store.close()


_WRITER = """
import sys
from contextkeeper.calls.transcript import SQLiteTranscript
path, name, turns = sys.argv[1], sys.argv[2], int(sys.argv[3])
store = SQLiteTranscript(path)
chat = [{"role": "system", "content": "You are a helpful assistant."}]
for turn in range(turns):
    chat.append({"role": "user", "content": f"hello {turn}"})  # the same chat in every process: the same trie nodes
    store.add(chat, None, conversation=name, received={"role": "assistant", "content": f"ok {turn}"})
    chat.append({"role": "assistant", "content": f"ok {turn}"})
store.close()
"""


def test_processes_that_write_the_same_chats_into_one_file_all_succeed(tmp_path: Path) -> None:
    """Worker processes sharing one transcript file (``uvicorn --workers 4``) store the same messages under the
    same trie nodes at the same moments: each takes the row another stored first instead of failing."""
    import subprocess
    import sys

    path, workers, turns = tmp_path / "shared.db", 4, 500
    procs = [
        subprocess.Popen([sys.executable, "-c", _WRITER, str(path), f"w{i}", str(turns)], stderr=subprocess.PIPE)
        for i in range(workers)
    ]
    errors = [proc.communicate(timeout=120)[1].decode() for proc in procs]
    assert [proc.returncode for proc in procs] == [0] * workers, errors
    store = SQLiteTranscript(path)
    for i in range(workers):
        history = store.history(f"w{i}")
        assert len(history) == 1 + 2 * turns
        assert history[-2:] == [
            {"role": "user", "content": f"hello {turns - 1}"},
            {"role": "assistant", "content": f"ok {turns - 1}"},
        ]
    assert store.db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    assert store.db.execute("SELECT count(*) FROM nodes").fetchone() == (2 * turns,)  # each message stored once
    store.close()


def _size(path: Path) -> int:
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return path.stat().st_size


def test_a_500_call_chat_grows_linearly_on_disk(tmp_path: Path) -> None:
    path = tmp_path / "long.db"
    store = SQLiteTranscript(path)
    chat: list[dict[str, Any]] = [{"role": "system", "content": "You are a helpful assistant. " * 10}]
    text = 0
    sizes: dict[int, int] = {}
    for call in range(1, 501):
        chat.append({"role": "user", "content": f"Question {call}: " + "why is the sky blue? " * 10})
        # A sliding window: the system prompt and the last 40 messages are sent.
        sent = [chat[0], *chat[-40:]] if len(chat) > 41 else chat
        reply = {"role": "assistant", "content": f"Answer {call}: " + "Rayleigh scattering. " * 10}
        store.add(chat, None, sent=sent, received=reply, usage={"prompt_tokens": 1000 + call})
        chat.append(reply)
        text += len(json.dumps(chat[-2])) + len(json.dumps(reply))
        if call in (125, 250, 500):
            sizes[call] = _size(path)
    entry = store.last()
    assert entry is not None
    assert entry.call == 500
    assert list(entry.inputs) == chat[:-1]
    assert entry.dropped == tuple(range(1, len(chat) - 41))
    store.close()
    # Quadratic storage would quadruple from 250 to 500 calls; linear doubles.
    assert sizes[500] - sizes[250] < 1.3 * (sizes[250] - sizes[125]) * 2
    assert sizes[500] / sizes[250] < 2.4
    assert sizes[500] < 4 * text  # each message stored once (plus indexes and per-call rows)


# Messages drawn as a client sends them: plain dicts, text of every kind, some repeated (a growing chat), some
# nested parts.
_TEXT = st.text(max_size=30)
_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"])},
    optional={"content": st.one_of(_TEXT, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _TEXT})))},
)


@settings(max_examples=60, deadline=None)
@given(first=st.lists(_MESSAGE, max_size=6), grown=st.lists(_MESSAGE, max_size=4))
def test_messages_serialized_ahead_of_the_lock_are_stored_as_under_it(
    first: list[dict[str, Any]], grown: list[dict[str, Any]]
) -> None:
    # The fast path (serialized before the lock, MemoryTranscript.begin) and the reference (everything under the
    # lock, as record() writes) store the same blobs under the same trie nodes, turn after turn.
    fast, slow = MemoryTranscript(), MemoryTranscript()
    for messages in (first, first + grown, copy.deepcopy(first + grown)):
        ahead = fast._serialize_ahead(messages, "lane")
        assert fast._node(messages, lane="lane", prepared=ahead) == slow._node(messages, lane="lane")
    assert fast._texts == slow._texts
    assert fast._node_of == slow._node_of
