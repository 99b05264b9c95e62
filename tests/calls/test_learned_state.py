"""Learned server state that is bounded, scoped and heals, and ``n`` / ``best_of`` admitted as that many answers
(issue 34, items 1 and 8).

Every request goes through the official openai SDK (``keeper.wrap(openai.OpenAI(...))``, or the proxy) to the
real test server (tests/openai_server.py), which renders ``documents``, ``chat_template_kwargs``, a per-request
``chat_template`` and media placeholders as vLLM does and counts them with the real qwen2 tokenizer; shared state
goes through a real Redis (tests/engines.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

import contextkeeper as ck
from assets import require_assets, template, tokenizer_dir
from conftest import hf_tokenizer
from contextkeeper.calls.shared import SharedState
from engines import RedisServer
from openai_server import ChatServer
from proxy_helpers import route, running_proxy

WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima")
LIMIT = 4096
GRANITE = "ibm-granite-granite-3.3-2B-Instruct"  # renders `documents`, and reads `thinking` from the kwargs

# A per-request template of a deployment that prepends a long operator policy: the server renders it, the keeper
# (counting its own template) cannot see it.
POLICY = " ".join(f"Rule {n}: " + " ".join(WORDS[(n + i) % len(WORDS)] for i in range(20)) + "." for n in range(60))
POLICY_TEMPLATE = (
    "<|im_start|>system\n" + POLICY + "<|im_end|>\n"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


def words(n: int, start: int = 0) -> str:
    return " ".join(WORDS[(start + i) % len(WORDS)] for i in range(n))


def history(turns: int, words_each: int, start: int = 0) -> list[dict[str, Any]]:
    """A chat of ``turns`` user/assistant pairs, ending with a user message (no system message)."""
    out: list[dict[str, Any]] = []
    for turn in range(turns):
        out += [
            {"role": "user", "content": f"Turn {start + turn}: {words(words_each, turn)}"},
            {"role": "assistant", "content": "Noted."},
        ]
    return [*out, {"role": "user", "content": f"Question {start}: what was said first?"}]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    require_assets()
    return hf_tokenizer("qwen2")


def sdk(server: ChatServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="test", max_retries=0)


def rules(**given: Any) -> Any:
    from contextkeeper.calls.loop import LearnRules

    return LearnRules(**given)


def call(keeper: ck.ContextKeeper, server: ChatServer, conversation: str, messages: Any, **kwargs: Any) -> Any:
    """One wrapped call in ``conversation``; its report."""
    client = keeper.wrap(sdk(server), conversation=conversation, backoff=0, attempts=kwargs.pop("attempts", 4))
    kwargs.setdefault("max_tokens", 64)
    client.chat.completions.create(model="m", messages=messages, **kwargs)
    report = keeper.last_call
    assert report is not None
    return report


# ------------------------------------------------------------------ what our count cannot see, charged to its scope

DOCUMENTS = [{"doc_id": n, "text": words(450, n)} for n in range(5)]  # ~3,700 tokens as Granite renders them

# variant: (server settings, the keeper's template, the first message's content, the request's extra fields)
VARIANTS: dict[str, tuple[dict[str, Any], str | None, Any, dict[str, Any]]] = {
    "documents": ({"chat_template": GRANITE}, GRANITE, "Summarise the documents.", {"documents": DOCUMENTS}),
    "chat_template_kwargs": (
        {"chat_template": GRANITE},
        GRANITE,
        "Think it through.",
        {"chat_template_kwargs": {"thinking": True}},
    ),
    "chat_template": ({}, None, "Follow the policy.", {"chat_template": POLICY_TEMPLATE}),
    "image": ({"media_tokens": 3000}, None, [{"type": "text", "text": "What is in it?"}, IMAGE], {}),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_what_one_request_adds_is_charged_to_its_conversation_not_to_everyone(tokenizer: Any, variant: str) -> None:
    """The finding: a request whose extra fields (or media) the server counts and we cannot see made every later
    request of every client keep its cost free, or fail with RequestTooLarge. Now other conversations are fitted to
    the real limit, and the same conversation's later requests with the same features reserve what was measured."""
    settings, keeper_template, content, extra = VARIANTS[variant]
    server_template = template(settings["chat_template"]) if "chat_template" in settings else None
    keeper = ck.ContextKeeper(
        tokenizer, context_window=LIMIT, chat_template=template(keeper_template) if keeper_template else None
    )
    with ChatServer(
        tokenizer_dir("qwen2"),
        max_model_len=LIMIT,
        dialect="vllm-validate",
        tokenizer=tokenizer,
        **{**settings, "chat_template": server_template},
    ) as server:
        first = call(keeper, server, "tenant-a", [{"role": "user", "content": content}], extra_body=extra)
        drift = first.drift
        assert drift is not None, first
        assert drift > 100, first
        if variant == "documents":
            assert drift > LIMIT - 512  # as in the report: alone it leaves no room for a 512-token answer

        # Other conversations, plain requests filling the context: all sent, fitted to the real limit.
        for n in range(3):
            report = call(keeper, server, f"tenant-b{n}", history(60, 40, start=n), max_tokens=512)
            assert report.attempts == 1, report
            assert report.withheld == 0, report
            assert (report.hidden, report.hidden_from) == (0, None)
            assert report.tokens + 512 > LIMIT - 200  # the window was not shrunk for someone else's documents
        # The same conversation, a plain request: its features are not its every request's.
        plain = call(keeper, server, "tenant-a", history(60, 40), max_tokens=512)
        assert (plain.withheld, plain.attempts) == (0, 1)

        # The same conversation with the same features: it keeps what was measured free, and is not refused.
        chat = [*history(30, 40)[:-1], {"role": "user", "content": content}]  # (a last message is never trimmed)
        again = call(keeper, server, "tenant-a", chat, extra_body=extra)
        assert (again.hidden, again.hidden_from) == (drift, "scope"), again
        assert again.attempts == 1
        assert again.tokens + 64 + drift <= LIMIT
        assert server.rejected == 0
        assert all(r.prompt_tokens is not None and r.prompt_tokens + 64 <= LIMIT for r in server.requests)
        assert first.features == (("image",) if variant == "image" else (variant,))


def test_the_features_of_a_request_are_known_fields_and_media_only() -> None:
    from contextkeeper.calls.loop import request_features

    params = {
        "model": "m",
        "temperature": 0.2,
        "made_up_field": [1, 2, 3],  # unknown extra fields are not features: a client cannot grow the state
        "extra_body": {"documents": [{"text": "x"}], "chat_template_kwargs": {}, "another_invention": True},
    }
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "input_audio"}]}]
    assert request_features(messages, params) == frozenset({"documents", "audio"})
    assert request_features([], {"add_generation_prompt": True, "continue_final_message": False}) == frozenset()
    assert request_features([], {"extra_body": {"continue_final_message": True}}) == {"continue_final_message"}
    assert request_features([{"role": "user", "content": "plain"}], {"documents": None}) == frozenset()


# ------------------------------------------------------------------------------- plain requests: agreement


def test_one_outlier_does_not_move_the_plain_offset_three_agreeing_replies_do_and_it_decays(tokenizer: Any) -> None:
    keeper = ck.ContextKeeper(tokenizer, context_window=LIMIT)
    with ChatServer(tokenizer_dir("qwen2"), max_model_len=LIMIT, tokenizer=tokenizer) as server:

        def withheld(hidden: int) -> int:
            server.hidden_tokens = hidden
            report = call(keeper, server, "default", history(4, 20))
            assert report.drift == hidden
            return int(report.withheld)

        assert [withheld(0) for _ in range(3)] == [0, 0, 0]
        assert withheld(300) == 0  # one reply that counted 300 more: an outlier, not agreement
        assert withheld(300) == 0
        assert withheld(300) == 300  # the third agreeing reply: now it is kept free
        # The drift is no longer seen: it rolls out of the window of the last 8 drifts.
        assert withheld(0) == 300
        assert keeper.last_call is not None
        assert (keeper.last_call.hidden, keeper.last_call.hidden_from) == (300, "agreed")  # as it was sent
        assert [withheld(0) for _ in range(5)] == [300, 300, 300, 300, 0]

        # ... or out of its time to live, with nothing else seen.
        keeper.calls.rules = rules(ttl=0.5)
        assert [withheld(300) for _ in range(6)][-1] == 300
        time.sleep(0.6)
        assert withheld(0) == 0


def test_a_server_hiding_more_than_the_share_is_recovered_by_refusals_not_refused_locally(tokenizer: Any) -> None:
    """A server that really counts 1,200 tokens more than we do (59% of its context): what later calls keep free
    stays within 25% of the limit, and each call that needs more recovers on its own refusal, at once."""
    context = 2048
    keeper = ck.ContextKeeper(tokenizer, context_window=context)
    with ChatServer(
        tokenizer_dir("qwen2"), max_model_len=context, dialect="vllm-validate", hidden_tokens=1200, tokenizer=tokenizer
    ) as server:
        for n in range(4):
            report = call(keeper, server, f"c{n}", history(40, 30, start=n), max_tokens=128, attempts=3)
            assert report.error is None
            assert report.attempts == 2, report  # refused once, then fitted under what the refusal said
            assert "refused for length" in report.recoveries[0]
            assert (report.hidden, report.hidden_from) == (1200, "refusal")  # the retry kept all of it free
            assert report.withheld == context // 4  # what persists is bounded: 512
        assert server.accepted == 4
        assert server.rejected == 4
        # A short request is never refused, locally or by the server.
        short = call(keeper, server, "short", [{"role": "user", "content": "hi"}], max_tokens=128)
        assert short.attempts == 1


# ------------------------------------------------------------------------------------------------- the probe


def test_a_conversation_refused_by_its_own_measured_offset_is_probed_and_recovers(tokenizer: Any) -> None:
    granite = template(GRANITE)
    keeper = ck.ContextKeeper(tokenizer, context_window=LIMIT, chat_template=granite)
    with ChatServer(
        tokenizer_dir("qwen2"), granite, max_model_len=LIMIT, dialect="vllm-validate", tokenizer=tokenizer
    ) as server:
        big = {"documents": [{"doc_id": n, "text": words(400, n)} for n in range(5)]}
        first = call(keeper, server, "rag", [{"role": "user", "content": "Summarise."}], extra_body=big)
        assert first.drift is not None
        assert first.drift > 2000
        # The conversation now sends one short document and a long question: under the ~2,400 tokens measured for
        # its documents it cannot fit, so our own check would refuse it; it is sent once without them.
        small = {"documents": [{"doc_id": 0, "text": "A short note."}]}
        question = [{"role": "user", "content": words(1500)}]
        probed = call(keeper, server, "rag", question, extra_body=small, max_tokens=512)
        assert probed.attempts == 1
        assert probed.hidden_from == "probe"
        assert "sent without them once, to check them" in probed.recoveries[0]
        assert probed.drift is not None
        assert 0 < probed.drift < 200
        # Learned: the next such request fits under the new measurement, with no probe.
        after = call(keeper, server, "rag", [*question, {"role": "assistant", "content": "Ok."}, *question],
                     extra_body=small, max_tokens=512)  # fmt: skip
        assert (after.hidden, after.hidden_from, after.recoveries) == (probed.drift, "scope", ())
        assert server.rejected == 0


def test_a_measured_plain_offset_is_probed_at_most_once_per_interval(tokenizer: Any) -> None:
    keeper = ck.ContextKeeper(tokenizer, context_window=LIMIT)
    with ChatServer(tokenizer_dir("qwen2"), max_model_len=LIMIT, tokenizer=tokenizer) as server:
        server.hidden_tokens = 800  # measured three times: agreed
        for n in range(3):
            call(keeper, server, f"c{n}", history(4, 20, start=n))
        server.hidden_tokens = 0  # then it is gone (an operator shortened its system prompt)
        large = [{"role": "user", "content": words(1800)}]  # ~2,900 tokens + 512 + 800 > 4,096
        probed = call(keeper, server, "large-1", large, max_tokens=512)
        assert (probed.attempts, probed.drift) == (1, 0)
        assert probed.hidden_from == "probe"
        keeper.calls.rules = rules(probe_every=1.0)  # (the default: 30 s)
        started = time.monotonic()
        with pytest.raises(ck.RequestTooLarge, match="the next may go in"):  # probed a moment ago
            call(keeper, server, "large-2", [{"role": "user", "content": words(1800, 1)}], max_tokens=512)
        time.sleep(max(0.0, 1.05 - (time.monotonic() - started)))
        again = call(keeper, server, "large-3", [{"role": "user", "content": words(1800, 2)}], max_tokens=512)
        assert (again.attempts, again.hidden_from) == (1, "probe")
        assert server.rejected == 0
        assert len(server.requests) == 5  # the refused request never left


# -------------------------------------------------------------------------------------------- shared state


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as running:
        yield running


@pytest.mark.parametrize("path", ["read", "facts-ledger"])
def test_one_poisoned_replica_cannot_raise_another_replicas_offset(
    tokenizer: Any, redis_server: RedisServer, path: str
) -> None:
    """Two replicas on one Redis: one learns that the server counts 900 more (three agreeing replies: for it, not
    an outlier); the other, which measured 0, keeps its own, and a third that measured nothing takes the lower
    median of the two. A stale writer's facts are ignored. ``facts-ledger``: the facts come back with each
    admission (ledger= on the same Redis)."""
    url = f"redis://127.0.0.1:{redis_server.port}/3"
    settings: dict[str, Any] = {"shared": url}
    if path == "facts-ledger":
        settings = {"ledger": url, "ledger_pool": f"learned-{time.monotonic_ns()}", "kv_capacity": 1_000_000}
    first, second, third = (ck.ContextKeeper(tokenizer, context_window=LIMIT, **settings) for _ in range(3))
    with ChatServer(tokenizer_dir("qwen2"), max_model_len=LIMIT, tokenizer=tokenizer) as server:
        name = server.base_url + "/"
        for n in range(3):
            assert call(first, server, f"a{n}", history(4, 20, start=n)).withheld == 0
        first.shared.flush()
        server.hidden_tokens = 900
        poisoned = [call(second, server, f"b{n}", history(4, 20, start=n)) for n in range(3)]
        assert all(r.drift == 900 for r in poisoned)
        second.shared.flush()
        server.hidden_tokens = 0

        report = call(first, server, "a-next", history(60, 40), max_tokens=512)
        assert report.tokens + 512 > LIMIT - 200, report  # fitted to the real limit: nothing kept free for 900
        assert (report.withheld, report.attempts, report.hidden_from) == (0, 1, None), report
        fresh = call(third, server, "c", history(60, 40), max_tokens=512)
        assert fresh.tokens + 512 > LIMIT - 200, fresh
        assert (fresh.withheld, fresh.attempts, fresh.hidden_from) == (0, 1, None), fresh

        # A writer whose facts are older than the TTL: ignored (with it, the median of three would be 900, and
        # its limit would bind).
        stale = {"limit": 500, "hidden": 3000, "samples": 8, "writer": "gone", "at": time.time() - 2 * 86_400}
        for key in (SharedState.facts_key(name), *([first.ledger.facts_key(name)] if path != "read" else [])):
            first.shared.client.hset(key, "gone", json.dumps(stale))
        later = call(first, server, "a-later", history(60, 40, start=1), max_tokens=512)
        assert later.tokens + 512 > LIMIT - 200, later
        assert (later.withheld, later.attempts, later.hidden_from) == (0, 1, None), later
        if path == "facts-ledger":
            assert first.calls.facts_ledger is first.ledger
        own = second.calls.servers[name].facts(rules(), time.monotonic())
        assert (own.hidden, own.samples) == (900, 3)  # what the poisoned replica itself shares
        combined = SharedState(url).server(name)
        assert combined is not None
        assert (combined.hidden, combined.limit) == (0, None)  # the lower median of 0 and 900
        assert server.rejected == 0
    for keeper in (first, second, third):
        keeper.close()


# ---------------------------------------------------------------------------------------------- n, best_of


def test_n_answers_are_admitted_as_that_many_answers(tokenizer: Any) -> None:
    keeper = ck.ContextKeeper(tokenizer, context_window=LIMIT, kv_capacity=100_000, admission_timeout=0.5)
    with ChatServer(tokenizer_dir("qwen2"), max_model_len=LIMIT, tokenizer=tokenizer) as server:
        client = keeper.wrap(sdk(server))
        streams, prompts = [], 0
        for n in range(6):
            messages = [{"role": "user", "content": f"Write poem {n}."}]
            streams.append(
                client.chat.completions.create(model="m", messages=messages, max_tokens=1000, n=16, stream=True)
            )
            prompts += keeper.count(messages)
        assert keeper.ledger.active == prompts + 6 * 16 * 1000  # 96,000 answer tokens, as the server may make
        with pytest.raises(ck.calls.AdmissionTimeout):  # a seventh waits for room
            client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "One more."}], max_tokens=1000, n=16
            )
        streams[0].close()
        reply = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "One more."}], max_tokens=1000, n=16
        )
        assert len(reply.choices) == 16
        assert keeper.last_call is not None
        assert keeper.last_call.sequences == 16
        for stream in streams[1:]:
            stream.close()
        assert keeper.ledger.active == 0

        # vLLM's best_of generates that many: admitted so, through extra_body.
        held = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Best of."}], max_tokens=500, stream=True,
            extra_body={"best_of": 8},
        )  # fmt: skip
        assert keeper.ledger.active == keeper.count([{"role": "user", "content": "Best of."}]) + 8 * 500
        held.close()


@pytest.mark.parametrize(
    ("given", "name"),
    [({"n": 0}, "n"), ({"n": True}, "n"), ({"n": "2"}, "n"), ({"extra_body": {"best_of": 2.5}}, "best_of")],
)
def test_n_and_best_of_that_are_not_whole_numbers_are_typed_errors(
    tokenizer: Any, given: dict[str, Any], name: str
) -> None:
    keeper = ck.ContextKeeper(tokenizer, context_window=LIMIT, kv_capacity=100_000)
    with ChatServer(tokenizer_dir("qwen2"), max_model_len=LIMIT, tokenizer=tokenizer) as server:
        client = keeper.wrap(sdk(server))
        with pytest.raises(ck.ConfigurationError, match=f"{name} must be a whole number >= 1"):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], **given)
        assert server.requests == []  # nothing sent
        assert keeper.transcript.entries() == []  # nor kept
    from contextkeeper.calls.loop import sequences_of

    assert sequences_of({"n": 3, "extra_body": {"best_of": 5}}) == 5


def test_the_proxy_admits_n_answers_and_refuses_a_bad_n(tokenizer: Any) -> None:
    keeper = ck.ContextKeeper(tokenizer, context_window=LIMIT, kv_capacity=100_000)
    with (
        # A slow stream: it is still open (its admission held) when the test reads the ledger.
        ChatServer(
            tokenizer_dir("qwen2"), max_model_len=LIMIT, tokenizer=tokenizer, stream_chunk_words=1, chunk_delay=0.2
        ) as upstream,
        running_proxy([route(keeper)], upstream.base_url) as proxy,
    ):
        client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="client-key", max_retries=0)
        messages = [{"role": "user", "content": "Four answers, please."}]
        stream = client.chat.completions.create(model="m", messages=messages, max_tokens=700, n=4, stream=True)
        assert keeper.ledger.active == keeper.count(messages) + 4 * 700
        stream.close()
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="m", messages=messages, max_tokens=10, n=0)
        assert "n must be a whole number >= 1" in str(refused.value)
        assert len(upstream.requests) == 1
