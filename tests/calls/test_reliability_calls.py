"""Wrapped calls that must lose nothing and say the right thing: cut and abandoned streams, fits that fail,
write-ahead records, refusals that overstate, key order, transcript settings, first-use races, stacked retries,
the numbers in RequestTooLarge, drift advice per server, and the ledger's wording.

Every test runs the real openai SDK against the real test server (tests/openai_server.py), real tokenizers and
templates from the fetched assets, and real SQLite files.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("openai")
pytest.importorskip("tenacity")

import openai

import contextkeeper as ck
from assets import require_assets, template, tokenizer_dir
from conftest import hf_tokenizer
from contextkeeper.calls import DriftWarning
from contextkeeper.calls.ledger import ExceedsCapacity, Ledger
from contextkeeper.calls.transcript import INTERRUPTED, MemoryTranscript, SQLiteTranscript
from contextkeeper.servers.kinds import kind_of_error, kind_of_reply, kind_of_url
from openai_server import DIALECTS, ChatServer

WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima")
QWEN25 = "Qwen-Qwen2.5-7B-Instruct"  # renders tools and tool-call arguments with tojson, in their key order


def words(n: int, start: int = 0) -> str:
    return " ".join(WORDS[(start + i) % len(WORDS)] for i in range(n))


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    require_assets()
    return hf_tokenizer("qwen2")


@pytest.fixture
def server(tokenizer: Any) -> Iterator[ChatServer]:
    with ChatServer(tokenizer_dir("qwen2"), max_model_len=4096, tokenizer=tokenizer) as running:
        yield running


def client_for(server: ChatServer, **kwargs: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="test", max_retries=kwargs.pop("max_retries", 0), **kwargs)


def stream_of(client: Any, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model="m", messages=messages, max_tokens=64, stream=True, stream_options={"include_usage": True}, **kwargs
    )


# ------------------------------------------------------------------------------------ streams cut mid-way


def test_a_stream_cut_midway_is_stream_interrupted_with_its_text_and_recorded_as_failed(
    server: ChatServer, tokenizer: Any
) -> None:
    keeper = ck.ContextKeeper(tokenizer, context_window=4096, kv_capacity=20_000)
    client = keeper.wrap(client_for(server), backoff=0.01)
    server.replies.append("One two three four five six seven eight nine ten.")
    server.fail_next("cut", after=4)  # the role chunk and three chunks of text, then the connection drops
    messages = [{"role": "user", "content": "Count to ten, please."}]
    received: list[str] = []

    def read() -> None:
        for chunk in stream_of(client, messages):
            received.append(chunk.choices[0].delta.content or "")

    with pytest.raises(ck.StreamInterrupted) as caught:
        read()
    error = caught.value
    assert isinstance(error, ck.TransportError)  # code that catches transport errors still catches it
    assert isinstance(error.__cause__, openai.APIConnectionError)
    sent = server.requests[-1].streamed
    assert sent == "One two three four five six "
    assert error.partial == sent == "".join(received)
    assert error.chunks == 4
    assert "Fix:" in str(error)
    assert len(server.requests) == 1  # chunks had reached the caller: not sent again
    entry = keeper.transcript.last()
    assert entry.status == "failed"
    assert entry.error.startswith("StreamInterrupted")
    assert entry.received["content"] == sent  # what arrived is kept, marked as a failure
    assert entry.inputs == tuple(messages)
    assert keeper.transcript.history() == messages  # the partial reply is no answer to resume from
    assert keeper.last_call.error.startswith("StreamInterrupted")
    assert keeper.ledger.active == 0


def test_a_stream_cut_before_its_first_chunk_is_retried(server: ChatServer, tokenizer: Any) -> None:
    keeper = ck.ContextKeeper(tokenizer, context_window=4096)
    client = keeper.wrap(client_for(server), backoff=0.01)
    server.fail_next("cut", after=0)  # headers, then nothing
    text = "".join(
        c.choices[0].delta.content or "" for c in stream_of(client, [{"role": "user", "content": "hi"}]) if c.choices
    )
    assert text == "Reply to request 2."
    assert [r.failure for r in server.requests] == ["cut", None]
    assert keeper.last_call.attempts == 2
    assert keeper.transcript.last().status == "ok"
    assert keeper.transcript.last().received["content"] == text


def test_an_async_stream_cut_midway_is_stream_interrupted(server: ChatServer, tokenizer: Any) -> None:
    keeper = ck.ContextKeeper(tokenizer, context_window=4096, kv_capacity=20_000)
    server.replies.append("Alpha bravo charlie delta echo foxtrot golf hotel.")
    server.fail_next("cut", after=3)

    async def main() -> tuple[list[str], BaseException | None]:
        raw = openai.AsyncOpenAI(base_url=server.base_url, api_key="test", max_retries=0)
        client = keeper.wrap(raw, backoff=0.01)
        got: list[str] = []
        try:
            stream = await stream_of(client, [{"role": "user", "content": "Spell."}])
            async for chunk in stream:
                got.append(chunk.choices[0].delta.content or "")
        except ck.StreamInterrupted as exc:
            return got, exc
        finally:
            await raw.close()
        return got, None

    got, error = asyncio.run(main())
    assert isinstance(error, ck.StreamInterrupted)
    assert error.partial == "".join(got) == server.requests[-1].streamed == "Alpha bravo charlie delta "
    assert keeper.transcript.last().status == "failed"
    assert keeper.ledger.active == 0


# -------------------------------------------------------------------------- streams nobody reads to the end


def test_a_stream_dropped_unread_gives_its_tokens_back(server: ChatServer, tokenizer: Any) -> None:
    keeper = ck.ContextKeeper(tokenizer, context_window=4096, kv_capacity=1600, admission_timeout=5)
    client = keeper.wrap(client_for(server))
    stream = stream_of(client, [{"role": "user", "content": words(600)}])
    assert keeper.ledger.active > 600
    del stream
    gc.collect()
    # The next big call needs most of the capacity: it is admitted once the dropped stream's call has ended.
    reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": words(900)}], max_tokens=64)
    assert reply.choices[0].message.content
    assert keeper.ledger.active == 0
    assert keeper.ledger.timeouts == 0
    first = keeper.transcript.entries()[0]
    assert first.status == "failed"
    assert "dropped after 0 chunk(s)" in first.error


def test_a_closed_stream_gives_its_tokens_back_at_once(server: ChatServer, tokenizer: Any) -> None:
    keeper = ck.ContextKeeper(tokenizer, context_window=4096, kv_capacity=20_000)
    client = keeper.wrap(client_for(server))
    server.replies.append("a b c d e f g h i j k l m n o p")
    with stream_of(client, [{"role": "user", "content": "letters"}]) as stream:
        next(stream)
        next(stream)
        assert keeper.ledger.active > 0
    assert keeper.ledger.active == 0
    entry = keeper.transcript.last()
    assert (entry.status, entry.error) == (
        "failed",
        "closed by the caller after 2 chunk(s), before the end of the stream",
    )


def test_a_stream_kept_but_never_read_loses_its_tokens_after_its_lease(server: ChatServer, tokenizer: Any) -> None:
    keeper = ck.ContextKeeper(tokenizer, context_window=4096, kv_capacity=1600, admission_timeout=5)
    client = keeper.wrap(client_for(server), lease=0.3)
    kept = stream_of(client, [{"role": "user", "content": words(600)}])
    started = time.monotonic()
    reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": words(900)}], max_tokens=64)
    assert reply.choices[0].message.content
    assert 0.25 < time.monotonic() - started < 4  # it waited for the lease, not for the admission timeout
    assert keeper.ledger.expired == 1
    kept.close()  # its tokens were already given back: closing gives nothing back twice
    assert keeper.ledger.active == 0


def test_a_ledger_lease_runs_out_and_renewing_keeps_it() -> None:
    ledger = Ledger(1000, timeout=5, lease=0.2)
    held = ledger.acquire(800, label="held")
    renewed = ledger.acquire(100, label="renewed", lease=10)
    started = time.monotonic()
    with ledger.admit(800, label="next") as ticket:
        assert ticket.tokens == 800
        assert 0.15 < time.monotonic() - started < 3
    assert held.expired
    assert held.released
    assert not renewed.expired
    renewed.renew()
    renewed.release()
    assert ledger.active == 0
    assert ledger.stats()["expired"] == 1
    with pytest.raises(ck.ConfigurationError, match="lease"):
        Ledger(10, lease=0)


# ------------------------------------------------------------------------ every call recorded, write ahead


def test_a_call_whose_fit_fails_is_recorded(tokenizer: Any) -> None:
    keeper = ck.ContextKeeper(tokenizer, context_window=256)
    sent: list[Any] = []
    chat = keeper.wrap(lambda messages, max_tokens=16: sent.append(messages) or "ok")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": words(400)}]
    with pytest.raises(ck.RequestTooLarge):
        chat(messages, max_tokens=16)
    assert sent == []  # nothing was sent
    entry = keeper.transcript.last()
    assert entry is not None
    # The refusal is recorded, not its payload: the caller still holds its messages, and a request too large for
    # the context must not stay in the transcript (nor grow it at every retry).
    assert entry.status == "refused"
    assert entry.error.startswith("RequestTooLarge")
    assert entry.inputs == ()
    assert entry.report["refused"]["messages"] == 2
    assert entry.sent == ()
    assert keeper.transcript.history() == []
    assert keeper.last_call.error.startswith("RequestTooLarge")


def test_the_inputs_are_committed_before_the_backend_is_called(tmp_path: Path, tokenizer: Any) -> None:
    path = tmp_path / "ahead.sqlite"
    seen: list[Any] = []

    def bot(messages: list[dict[str, Any]], max_tokens: int = 16) -> str:
        # Another connection (as another process would) already sees the call's inputs.
        with sqlite3.connect(path) as other:
            seen.append(other.execute("SELECT state, owner FROM calls ORDER BY call DESC LIMIT 1").fetchone())
        with SQLiteTranscript(path) as reader:
            entry = reader.last()
            assert entry is not None
            seen.append((entry.status, entry.inputs))
        return "ok"

    messages = [{"role": "user", "content": "Is this written down already?"}]
    with ck.ContextKeeper(tokenizer, context_window=1024, transcript=path) as keeper:
        keeper.wrap(bot)(messages, max_tokens=16)
        assert keeper.transcript.last().status == "ok"
    assert seen[0][0] == "begun"
    assert seen[1] == ("pending", tuple(messages))


def test_a_call_begun_by_a_process_that_was_killed_reads_as_interrupted(tmp_path: Path) -> None:
    path = tmp_path / "killed.sqlite"
    messages = [{"role": "user", "content": "in flight when the process died"}]
    child = (
        "import os, signal, sys\n"
        "from contextkeeper.calls.transcript import SQLiteTranscript\n"
        f"SQLiteTranscript(sys.argv[1]).start({messages!r}, conversation='c')\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(ck.__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-c", child, str(path)], env=env, capture_output=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()
    with SQLiteTranscript(path) as again:
        entry = again.last("c")
        assert entry is not None
        assert (entry.status, entry.error) == ("interrupted", INTERRUPTED)
        assert entry.inputs == tuple(messages)
        assert again.history("c") == messages  # the message in flight is where to resume


def test_a_transcript_file_from_before_the_status_column_opens(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    with sqlite3.connect(path) as db:  # the layout files had before calls were written ahead
        db.executescript(
            "CREATE TABLE blobs (id INTEGER PRIMARY KEY, digest TEXT NOT NULL UNIQUE, json TEXT NOT NULL);"
            "CREATE TABLE nodes (id INTEGER PRIMARY KEY, parent INTEGER NOT NULL, blob INTEGER NOT NULL,"
            " UNIQUE (parent, blob));"
            "CREATE TABLE calls (call INTEGER PRIMARY KEY AUTOINCREMENT, conversation TEXT NOT NULL,"
            " time REAL NOT NULL, inputs INTEGER NOT NULL, sent INTEGER NOT NULL, tools INTEGER, received INTEGER,"
            " dropped TEXT NOT NULL, rewritten TEXT NOT NULL, report TEXT NOT NULL, usage TEXT, error TEXT,"
            " attempts INTEGER NOT NULL);"
            'INSERT INTO blobs VALUES (1, \'x\', \'{"content":"old","role":"user"}\');'
            "INSERT INTO nodes VALUES (1, 0, 1);"
            "INSERT INTO calls VALUES (1, 'default', 0, 1, 1, NULL, NULL, '[]', '[]', '{}', NULL, NULL, 1);"
        )
    with SQLiteTranscript(path) as store:
        assert store.last().status == "ok"
        assert store.history() == [{"content": "old", "role": "user"}]
        assert store.add([{"role": "user", "content": "new"}], None).call == 2


# --------------------------------------------------------------------------- refusals that overstate


def chat_turns(n: int, words_each: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
    for turn in range(n):
        out += [{"role": "user", "content": words(words_each, turn)}, {"role": "assistant", "content": "Noted."}]
    return out


def test_a_refusal_that_overstates_the_prompt_heals(tokenizer: Any) -> None:
    with ChatServer(tokenizer_dir("qwen2"), max_model_len=2048, dialect="vllm-validate", tokenizer=tokenizer) as server:
        keeper = ck.ContextKeeper(tokenizer, context_window=2048)
        client = keeper.wrap(client_for(server))
        history: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
        server.fail_next("overstate", reported=2100)  # "your request has 2100 input tokens", whatever was sent
        reports = []
        for turn in range(12):
            history.append({"role": "user", "content": words(480, turn)})
            reply = client.chat.completions.create(model="m", messages=history, max_tokens=600)
            history.append({"role": "assistant", "content": reply.choices[0].message.content})
            reports.append(keeper.last_call)
        assert server.rejected == 1
        assert server.accepted == 12  # no later call was refused, or kept from being sent
        entries = keeper.transcript.entries()
        assert len(entries) == 12
        assert all(e.status == "ok" for e in entries)
        assert reports[0].attempts == 2
        assert "later calls keep at most 512 of it (25% of the limit)" in reports[0].recoveries[0]
        assert "sent without them once, to check them" in reports[0].recoveries[1]
        assert all(r.withheld == 0 and r.attempts == 1 for r in reports[1:])  # healed by the first reply's usage
        assert reports[-1].drift == 0


def test_a_hidden_prompt_the_check_confirms_is_refused_with_the_servers_numbers(tokenizer: Any) -> None:
    with ChatServer(
        tokenizer_dir("qwen2"), max_model_len=2048, dialect="vllm-validate", hidden_tokens=1500, tokenizer=tokenizer
    ) as server:
        keeper = ck.ContextKeeper(tokenizer, context_window=2048)
        client = keeper.wrap(client_for(server))
        messages = [{"role": "user", "content": words(480)}]
        with pytest.raises(ck.RequestTooLarge) as caught:
            client.chat.completions.create(model="m", messages=messages, max_tokens=600)
        # One refusal, one check without what it implied (refused too), then no more requests.
        assert len(server.requests) == 2
        assert server.rejected == 2
        text = str(caught.value)
        assert "tokens we cannot see" in text
        assert "raise context_window" not in (caught.value.fix_text() or "")
        assert caught.value.withheld > 0
        entry = keeper.transcript.last()
        assert entry.status == "failed"
        assert entry.inputs == tuple(messages)


# ----------------------------------------------------------------------------------------- key order


def tool_chat() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A tool call whose keys are not in sorted order anywhere (with these values, sorting them changes the
    Qwen 2.5 template's token count)."""
    messages = [
        {"content": "Weather in Paris?", "role": "user"},
        {
            "tool_calls": [
                {"type": "function", "id": "c1", "function": {"arguments": '{"zeta": "C.", "alpha": 1}', "name": "w"}}
            ],
            "role": "assistant",
            "content": None,
        },
        {"tool_call_id": "c1", "role": "tool", "content": "Sunny, 21 C"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    tools = [
        {
            "type": "function",
            "function": {
                "name": "w",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "zeta": {"type": "string", "default": "C."},
                        "alpha": {"type": "integer", "minimum": 1},
                    },
                },
                "description": "Weather for a city.",
            },
        }
    ]
    return messages, tools


@pytest.mark.parametrize("store", ["memory", "sqlite"])
def test_the_transcript_keeps_the_callers_key_order(store: str, tmp_path: Path, tokenizer: Any) -> None:
    qwen25 = template(QWEN25)
    transcript = MemoryTranscript() if store == "memory" else SQLiteTranscript(tmp_path / "order.sqlite")
    with ChatServer(tokenizer_dir("qwen2"), chat_template=qwen25, tokenizer=tokenizer) as server:
        keeper = ck.ContextKeeper(tokenizer, context_window=4096, chat_template=qwen25, transcript=transcript)
        messages, tools = tool_chat()
        keeper.wrap(client_for(server)).chat.completions.create(model="m", messages=messages, tools=tools, max_tokens=8)
        sent = server.requests[-1].prompt_tokens
        entry = keeper.transcript.last()
        # Equal is not enough: every key, at every depth, comes back in the order the caller gave.
        assert json.dumps(list(entry.inputs)) == json.dumps(messages)
        assert json.dumps(list(entry.sent)) == json.dumps(messages)
        assert json.dumps(list(entry.tools)) == json.dumps(tools)
        # So the recorded prompt, replayed, counts what was sent (with its keys sorted it would count otherwise).
        raw = client_for(server)
        raw.chat.completions.create(model="m", messages=list(entry.sent), tools=list(entry.tools), max_tokens=8)
        assert server.requests[-1].prompt_tokens == sent
        assert server.count(*json.loads(json.dumps([messages, tools], sort_keys=True))) != sent


@pytest.mark.parametrize("store", ["memory", "sqlite"])
def test_equal_dicts_in_two_key_orders_come_back_each_in_its_own(store: str, tmp_path: Path) -> None:
    with MemoryTranscript() if store == "memory" else SQLiteTranscript(tmp_path / "two.sqlite") as transcript:
        one = {"role": "user", "content": "same"}
        two = {"content": "same", "role": "user"}
        transcript.add([one], None, sent=[one])
        transcript.add([two], None, sent=[two])
        first, second = transcript.entries()
        assert list(first.inputs[0]) == ["role", "content"]
        assert list(second.inputs[0]) == ["content", "role"]
        assert list(second.sent[0]) == ["content", "role"]


# ----------------------------------------------------------------------------------- transcript settings


@pytest.mark.parametrize("kind", ["int", "directory", "text file", "url"])
def test_a_bad_transcript_setting_fails_at_construction(kind: str, tmp_path: Path, tokenizer: Any) -> None:
    text_file = tmp_path / "notes.txt"
    text_file.write_text("my notes, not a database\n")
    value: Any = {"int": 42, "directory": tmp_path, "text file": text_file, "url": "mysql://db/chat"}[kind]
    with pytest.raises(ck.ConfigurationError) as caught:
        ck.ContextKeeper(tokenizer, context_window=1024, transcript=value)
    text = str(caught.value)
    assert f"transcript={str(value)!r}" in text or f"transcript={value!r}" in text
    assert caught.value.fix_text()
    assert text_file.read_text() == "my notes, not a database\n"  # nothing the caller had was touched


# ------------------------------------------------------------------------------------ first-use race


def test_threads_that_wrap_at_once_share_one_call_state(tmp_path: Path, tokenizer: Any) -> None:
    # A SQLite transcript: opening it on first use lets other threads run (sqlite3 releases the GIL), as a
    # first use that imports modules does.
    keeper = ck.ContextKeeper(tokenizer, context_window=1024, transcript=tmp_path / "race.sqlite")
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            barrier.wait()
            chat = keeper.wrap(lambda messages, max_tokens=8: f"ok {n}")
            chat([{"role": "user", "content": f"thread {n}"}], max_tokens=8)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: the race shows when it exists
    try:
        threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    finally:
        sys.setswitchinterval(interval)
    assert not errors
    assert len(keeper.transcript) == 8
    assert keeper.ledger.admitted == 8  # one ledger saw every call: one shared state


# ----------------------------------------------------------------------------------- one retry policy


def test_a_persistent_500_is_sent_attempts_times_not_attempts_times_sdk_retries(
    server: ChatServer, tokenizer: Any
) -> None:
    raw = client_for(server, max_retries=2)  # the SDK's default: two retries of its own
    keeper = ck.ContextKeeper(tokenizer, context_window=4096)
    client = keeper.wrap(raw, attempts=4, backoff=0.01)
    server.fail_next("500", times=20)
    with pytest.raises(ck.TransportError) as caught:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    assert len(server.requests) == 4
    assert caught.value.attempts == 4
    assert raw.max_retries == 2  # the caller's client is unchanged
    server.clear()
    server.fail_next("500")
    raw.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    assert len(server.requests) == 2  # its own calls still retry as it was told (one 500, then a retry)


def test_wrap_options_are_checked(server: ChatServer, tokenizer: Any) -> None:
    keeper = ck.ContextKeeper(tokenizer, context_window=4096)
    with pytest.raises(ck.ConfigurationError, match="attemps"):
        keeper.wrap(client_for(server), attemps=3)
    with pytest.raises(ck.ConfigurationError, match="attempts must be an integer >= 1"):
        keeper.wrap(client_for(server), attempts=0)


# ----------------------------------------------------------------------------- RequestTooLarge numbers


def test_request_too_large_after_a_refusal_names_the_servers_limit(tokenizer: Any) -> None:
    with ChatServer(tokenizer_dir("qwen2"), max_model_len=2048, tokenizer=tokenizer) as server:
        keeper = ck.ContextKeeper(tokenizer, context_window=8192)
        client = keeper.wrap(client_for(server))
        messages = [{"role": "user", "content": words(1890)}]
        tokens = keeper.count(messages)
        assert 2900 < tokens < 3100
        with pytest.raises(ck.RequestTooLarge) as caught:
            client.chat.completions.create(model="m", messages=messages, max_tokens=8)
        error = caught.value
        text = str(error)
        assert "plus 8 reserved for the answer" in text
        assert f"{tokens + 8 - 2048:,} over the limit of 2,048" in text
        assert "the server's own limit is 2,048" in text
        assert "raise context_window" not in (error.fix_text() or "")
        assert "--max-model-len" in (error.fix_text() or "")
        assert (error.limit, error.needed, error.withheld) == (2048, tokens + 8, 8192 - 2048)
        assert len(server.requests) == 1  # the one refusal that taught the limit
        assert keeper.transcript.last().status == "failed"


def test_request_too_large_names_the_setting_that_made_the_answer_reserve(tokenizer: Any) -> None:
    keeper = ck.ContextKeeper(tokenizer, context_window=1024)
    messages = [{"role": "user", "content": words(900)}]
    with pytest.raises(ck.RequestTooLarge) as by_policy:
        keeper.fit(messages)
    assert "lower answer_tokens in the policy ('default')" in str(by_policy.value)
    assert f"plus {keeper.policy.answer_tokens:,} reserved" in str(by_policy.value)
    with pytest.raises(ck.RequestTooLarge) as by_argument:
        keeper.fit(messages, max_tokens=900)
    assert "Fix: lower max_tokens," in str(by_argument.value)
    assert "raise context_window" in (by_argument.value.fix_text() or "")  # here the keeper's own limit binds


# ------------------------------------------------------------------------------- drift advice per server


def test_llamacpp_counting_fewer_for_a_known_reason_is_not_called_a_cut(tokenizer: Any) -> None:
    qwen25 = template(QWEN25)
    with ChatServer(tokenizer_dir("qwen2"), chat_template=qwen25, dialect="llamacpp", tokenizer=tokenizer) as server:
        keeper = ck.ContextKeeper(tokenizer, context_window=4096, chat_template=qwen25)
        client = keeper.wrap(client_for(server))
        _, tools = tool_chat()
        tools[0]["function"]["strict"] = True
        messages = [
            {"role": "user", "content": "Start your answer with 'The weather'."},
            {"role": "assistant", "content": "The weather"},  # a prefill llama.cpp continues
        ]
        with pytest.warns(DriftWarning) as caught:
            client.chat.completions.create(model="m", messages=messages, tools=tools, max_tokens=16)
        text = str(caught[0].message)
        assert keeper.last_call.drift is not None
        assert keeper.last_call.drift < 0
        assert keeper.last_call.server_kind == "llama.cpp"
        assert "known difference" in text
        assert "continues" in text
        assert '"strict"' in text
        assert "cut" not in text.replace("cuts a prompt without saying so", "")


def test_vllm_counting_fewer_points_at_the_template(tokenizer: Any) -> None:
    plain = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with ChatServer(tokenizer_dir("qwen2"), chat_template=plain, tokenizer=tokenizer) as server:
        keeper = ck.ContextKeeper(tokenizer, context_window=4096)
        client = keeper.wrap(client_for(server))
        with pytest.warns(DriftWarning, match="vLLM never cuts a prompt") as caught:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi there"}], max_tokens=8)
        assert "chat template" in str(caught[0].message)
        assert keeper.last_call.server_kind == "vllm"


def test_servers_are_recognised_by_their_answers_wording_and_address(server: ChatServer) -> None:
    for dialect, kind in (
        ("vllm", "vllm"),
        ("llamacpp", "llama.cpp"),
        ("ollama-error", "ollama"),
        ("openai", "openai"),
    ):
        assert kind_of_error(json.dumps(DIALECTS[dialect].check(10_000, 10, "max_tokens", 4096).body)) == kind
    response = client_for(server).chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert kind_of_reply(response) == "vllm"
    assert kind_of_url("http://127.0.0.1:11434/v1") == "ollama"
    assert kind_of_url("https://api.openai.com/v1") == "openai"
    assert kind_of_url(server.base_url) is None


# ------------------------------------------------------------------------------------ ledger wording


def test_exceeds_capacity_names_the_real_setting_and_source(tokenizer: Any) -> None:
    keeper = ck.ContextKeeper(tokenizer, context_window=4096, kv_capacity=500)
    chat = keeper.wrap(lambda messages, max_tokens=8: "ok")
    with pytest.raises(ExceedsCapacity) as caught:
        chat([{"role": "user", "content": words(700)}], max_tokens=8)
    text = str(caught.value)
    assert "mode='shrink'" not in text
    assert "the GPU holds" not in text
    assert "set by kv_capacity" in text
    assert "raise kv_capacity" in text
    # A long history over a short request: fitted into what is free, it would fit, so shrinking is the advice.
    long_chat = [*chat_turns(12, 60), {"role": "user", "content": "Now?"}]
    with pytest.raises(ExceedsCapacity, match="admission='shrink'"):
        chat(long_chat, max_tokens=8)
    planned = Ledger(1000, source="planned")
    with pytest.raises(ExceedsCapacity, match="the GPU holds"):
        planned.acquire(2000, minimum=500)
    with pytest.raises(ExceedsCapacity, match="admission='shrink'"):
        planned.acquire(2000, minimum=500)
