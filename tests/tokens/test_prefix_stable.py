"""Keeping the prompt's prefix stable (issue 22): the shared prefix with the previous prompt measured exactly by
token ids (fast path = slow reference = ``apply_chat_template(..., tokenize=True)``), the cache-aware window
(hysteresis, the break-even rule, settings checked), the window start as portable session state, and a wrapped
200-turn chat against a server with vLLM's prefix cache whose reported ``cached_tokens`` match the prediction."""

from __future__ import annotations

import copy
import json
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import contextkeeper as ck
from assets import template, tokenizer_dir
from conftest import hf_tokenizer
from contextkeeper.calls.loop import cached_tokens_of
from contextkeeper.strategies._cache import CacheCost
from contextkeeper.strategies.policy import Policy, PolicyStep, resolve_policy
from contextkeeper.strategies.sliding_window import SlidingWindow
from contextkeeper.tokens.prefix import HFMeter, meter_for, shared_ids
from conversations import TOOLS
from openai_server import ChatServer, vllm_messages, vllm_tools
from strategy_state import check_invariants

# (template, vocabulary): byte-level BPE (Qwen, Llama 3), Gemma 4's, and a SentencePiece vocabulary whose first
# piece takes a prefix space (llama-spm, with a template that writes no special token first).
CASES = [
    ("Qwen-Qwen3-0.6B", "qwen2"),
    ("meta-llama-Llama-3.3-70B-Instruct", "llama-bpe"),
    ("google-gemma-4-31B-it", "gemma-4"),
    ("Qwen-Qwen2.5-7B-Instruct", "llama-spm"),
]

_COUNTERS: dict[tuple[str, str], ck.HFChatTemplateCounter] = {}


def counter_for(name: str, vocab: str) -> ck.HFChatTemplateCounter:
    if (name, vocab) not in _COUNTERS:
        _COUNTERS[name, vocab] = ck.HFChatTemplateCounter(hf_tokenizer(vocab), chat_template=template(name), name=name)
    return _COUNTERS[name, vocab]


def chat(turns: int, seed: int = 3, words: tuple[int, int] = (10, 90)) -> list[dict[str, Any]]:
    """A tool-using chat: user turns, 0-2 tool rounds each, assistant answers (text from a fixed word list)."""
    rng = random.Random(seed)
    vocabulary = ["latency", "error", "deploy", "rollback", "queue", "shard", "replica", "timeout", "disk", "cache"]

    def text(n: int) -> str:
        return " ".join(rng.choice(vocabulary) for _ in range(n)).capitalize() + "."

    out: list[dict[str, Any]] = [{"role": "system", "content": "You are an on-call assistant. Be precise."}]
    call = 0
    for _ in range(turns):
        out.append({"role": "user", "content": text(rng.randrange(5, 30))})
        for _ in range(rng.randrange(0, 3)):
            call += 1
            call_id = f"call{call:05d}"
            arguments = json.dumps({"sql": text(4)})
            out.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": call_id, "type": "function", "function": {"name": "run_sql", "arguments": arguments}}
                    ],
                }
            )
            rows = [{"id": rng.randrange(10**5), "state": rng.choice(vocabulary)} for _ in range(rng.randrange(*words))]
            out.append({"role": "tool", "tool_call_id": call_id, "content": json.dumps({"rows": rows})})
        out.append({"role": "assistant", "content": text(rng.randrange(10, 60))})
    out.append({"role": "user", "content": "And now?"})
    return out


def requests(messages: list[dict[str, Any]]) -> list[int]:
    """Where an app calls the model: after a user message or the last tool result of a round."""
    return [
        i + 1
        for i in range(1, len(messages))
        if messages[i]["role"] in ("user", "tool") and (i + 1 == len(messages) or messages[i + 1]["role"] != "tool")
    ]


def server_ids(counter: ck.HFChatTemplateCounter, messages: list[dict[str, Any]], tools: Any) -> list[int]:
    """The ids an OpenAI-compatible server makes (the test server's own preprocessing, then transformers)."""
    ids = counter.tokenizer.apply_chat_template(
        vllm_messages(messages, counter.content_format),
        tools=vllm_tools(tools),
        chat_template=counter.template_for(tools),
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    return list(ids)


def cache_aware(hysteresis: float = 0.4, **window: Any) -> Policy:
    base = resolve_policy("default")
    step = PolicyStep(strategy="sliding_window", hysteresis=hysteresis, **window)
    return Policy(name="cache-aware", steps=(*base.steps, step))


# ------------------------------------------------------------------------------------------------ exact prefix


def _edit(messages: list[dict[str, Any]], kind: int, where: int, cut: int) -> list[dict[str, Any]]:
    """A following prompt: the chat grown, a window cut, an edited middle message, or an edited last one."""
    edited = copy.deepcopy(messages)
    users = [i for i, m in enumerate(edited) if m["role"] == "user"]
    if kind == 0:  # grew: an answer and a new question
        return [*edited, {"role": "assistant", "content": "Done."}, {"role": "user", "content": f"Next {where}?"}]
    if kind == 1:  # the oldest turns dropped
        start = users[min(cut, len(users) - 1)]
        return [edited[0], *edited[start:]]
    index = 1 + where % (len(edited) - 1) if kind == 2 else len(edited) - 1
    message = edited[index]
    if isinstance(message.get("content"), str):
        message["content"] = message["content"][: len(message["content"]) // 2] + " [edited]"
    else:
        message["content"] = "[cleared]"
    return edited


@settings(max_examples=24, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    case=st.sampled_from(CASES),
    turns=st.integers(2, 12),
    seed=st.integers(0, 10**6),
    kind=st.integers(0, 3),
    where=st.integers(0, 50),
    cut=st.integers(1, 6),
    tools=st.booleans(),
)
def test_the_fast_prefix_equals_the_reference_and_the_server_ids(
    case: tuple[str, str], turns: int, seed: int, kind: int, where: int, cut: int, tools: bool
) -> None:
    counter = counter_for(*case)
    schemas = TOOLS if tools else None
    old = chat(turns, seed)
    new = _edit(old, kind, where, cut)
    meter = meter_for(counter)
    assert isinstance(meter, HFMeter)
    assert meter.fast
    frozen = counter.freeze_tools(schemas)
    text_old = meter.text(ck.Conversation.from_messages(old), frozen)
    text_new = meter.text(ck.Conversation.from_messages(new), frozen)
    assert text_old is not None
    assert text_new is not None
    ids_old, ids_new = server_ids(counter, old, schemas), server_ids(counter, new, schemas)
    assert meter.ids(text_new) == ids_new  # the text the count tokenizes is the server's prompt
    truth = shared_ids(ids_new, ids_old)
    assert meter.reference(text_new, text_old) == truth
    assert meter.shared(text_new, text_old) == truth
    assert meter.shared(text_old, text_new) == truth  # the common prefix is symmetric


def test_the_reference_path_is_taken_where_the_piece_rules_are_off() -> None:
    counter = counter_for("Qwen-Qwen3-0.6B", "qwen2")
    meter = HFMeter(counter)
    meter.fast = False
    old = chat(6)
    new = _edit(old, 1, 0, 2)
    text_old = meter.text(ck.Conversation.from_messages(old), None)
    text_new = meter.text(ck.Conversation.from_messages(new), None)
    assert text_old is not None
    assert text_new is not None
    assert meter.shared(text_new, text_old) == shared_ids(
        server_ids(counter, new, None), server_ids(counter, old, None)
    )


def test_fit_report_prefix_tokens_is_exact_turn_after_turn() -> None:
    counter = counter_for("Qwen-Qwen3-0.6B", "qwen2")
    keeper = ck.ContextKeeper(counter, context_window=4096, policy=cache_aware())
    messages = chat(60)
    previous: list[int] | None = None
    kept: list[float] = []
    for stop in requests(messages)[-40:]:
        asked = messages[:stop]
        fit = keeper.fit(asked, tools=TOOLS, max_tokens=256)
        check_invariants(keeper, asked, fit, TOOLS, 256)
        ids = server_ids(counter, fit.messages, TOOLS)
        assert len(ids) == fit.tokens
        if previous is None:
            assert fit.report.prefix_tokens == 0  # the conversation's first prompt shares nothing
        else:
            assert fit.report.prefix_tokens == shared_ids(ids, previous)
            assert fit.report.prefill_tokens == fit.tokens - shared_ids(ids, previous)
            kept.append(shared_ids(ids, previous) / len(previous))
        assert fit.report.to_dict()["prefix_tokens"] == fit.report.prefix_tokens
        previous = ids
    assert sum(k == 1.0 for k in kept) >= 0.8 * len(kept)  # most turns keep the whole previous prompt


# ------------------------------------------------------------------------------------------------ the window


def test_hysteresis_cuts_to_the_low_water_mark_then_only_appends() -> None:
    counter = counter_for("Qwen-Qwen3-0.6B", "qwen2")
    budget = 4096 - 256
    messages = chat(80)
    broken: dict[str, int] = {}
    for name, policy in (("cache-aware", cache_aware(0.4)), ("default", resolve_policy("default"))):
        keeper = ck.ContextKeeper(counter, context_window=4096, policy=policy)
        previous = None
        broken[name] = 0
        for stop in requests(messages)[-60:]:
            fit = keeper.fit(messages[:stop], tools=TOOLS, max_tokens=256)
            windows = [a for a in fit.report.actions if a.strategy == "sliding_window"]
            assert len(windows) <= 1  # the policy's window step is the closing window, not a second one
            if name == "cache-aware" and windows and windows[0].units:
                fixed = fit.tokens - fit.report.history_after  # system prompt, tools, the request
                assert fit.tokens <= 0.6 * budget + 1 or fixed > 0.6 * budget  # cut to the low-water mark
            elif previous is not None and not fit.report.actions:
                assert fit.report.prefix_tokens == previous  # no edit: the whole previous prompt is the prefix
            if previous is not None and fit.report.prefix_tokens != previous:
                broken[name] += 1
            previous = fit.tokens
    assert 1 <= broken["cache-aware"] <= broken["default"] * 2 // 3, broken


def test_without_hysteresis_the_window_keeps_its_slack() -> None:
    window = SlidingWindow()
    assert not window.hysteretic
    assert window.low == pytest.approx(0.98)
    assert SlidingWindow(hysteresis=0.3).low == pytest.approx(0.7)
    assert SlidingWindow(low_water=0.5, high_water=0.9).low == 0.5
    assert SlidingWindow(high_water=0.99, hysteresis=0.49).low == pytest.approx(0.5)
    default = resolve_policy("default")
    assert not any(isinstance(strategy, SlidingWindow) for strategy, _ in default.pipeline())


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"hysteresis": 0.4, "low_water": 0.5}, "both set the low-water mark"),
        ({"slack": 0.1, "hysteresis": 0.4}, "slack = 0.1 with low_water or hysteresis"),
        ({"low_water": 0.9, "high_water": 0.8}, "must lie in (0, high_water = 0.8)"),
        ({"hysteresis": 0.9, "high_water": 0.5}, "lower hysteresis or low_water"),
        ({"hysteresis": 1.5}, "hysteresis = 1.5: out of range"),
        ({"cached_price": -1.0}, "cached_price = -1.0: out of range"),
        ({"hysteresis": "0.4"}, "wrong type"),
    ],
)
def test_window_settings_are_checked(settings: dict[str, Any], words: str) -> None:
    with pytest.raises(ck.ConfigurationError, match="sliding_window") as error:
        SlidingWindow(**settings)
    assert words in str(error.value)
    with pytest.raises(ck.PolicyError) as in_policy:
        Policy(name="bad", steps=(PolicyStep(strategy="sliding_window", **settings),))
    assert words in str(in_policy.value)


def test_the_break_even_rule() -> None:
    cost = CacheCost(0.1)
    assert cost.turn(1000, 900) == pytest.approx(100 + 90)
    # A prompt near the high-water mark whose prefix broke early: cutting on to the low-water mark pays.
    assert cost.cut_pays(total=7000, broken=800, low=4300, base=600, high=7168, growth=250)
    # A prompt far below the mark, broken late: keeping it pays.
    assert not cost.cut_pays(total=4500, broken=4400, low=4300, base=600, high=7168, growth=250)
    # Without a cache discount, carrying fewer tokens always pays.
    assert CacheCost(1.0).cut_pays(total=5000, broken=5000, low=4300, base=600, high=7168, growth=250)


# ------------------------------------------------------------------------------------------------ session state


def test_the_window_state_moves_to_another_keeper() -> None:
    counter = counter_for("Qwen-Qwen3-0.6B", "qwen2")
    messages = chat(70)
    stops = requests(messages)[-30:]
    first = ck.ContextKeeper(counter, context_window=6144, policy=cache_aware())
    for stop in stops[:-1]:
        first.fit(messages[:stop], tools=TOOLS, max_tokens=256, conversation="c1")
    session = first._sessions.get("c1")
    state = session.window_state()
    assert state is not None
    assert state.start > 1  # history was cut
    assert state.cleared  # and tool results cleared
    wire = json.loads(json.dumps(state.to_dict()))  # as it would travel through shared state
    # Another process: its own keeper and counter, the caller's messages as new objects.
    other_counter = ck.HFChatTemplateCounter(hf_tokenizer("qwen2"), chat_template=template("Qwen-Qwen3-0.6B"))
    second = ck.ContextKeeper(other_counter, context_window=6144, policy=cache_aware())
    second._sessions.get("c1").adopt(wire)
    asked = copy.deepcopy(messages[: stops[-1]])
    there = second.fit(asked, tools=TOOLS, max_tokens=256, conversation="c1")
    here = first.fit(messages[: stops[-1]], tools=TOOLS, max_tokens=256, conversation="c1")
    assert there.messages == here.messages  # the same boundary, the same cleared results: the same prompt
    assert there.tokens == here.tokens
    check_invariants(second, asked, there, TOOLS, 256)
    # A list that no longer matches the state (another conversation) is fitted from scratch.
    third = ck.ContextKeeper(other_counter, context_window=6144, policy=cache_aware())
    third._sessions.get("c1").adopt(wire)
    other = chat(70, seed=99)
    fit = third.fit(other, tools=TOOLS, max_tokens=256, conversation="c1")
    check_invariants(third, other, fit, TOOLS, 256)


# ------------------------------------------------------------------------------------------------ the server


def test_cached_tokens_are_read_where_servers_report_them() -> None:
    assert cached_tokens_of({"usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 5}}}) == 5
    assert cached_tokens_of({"usage": {"prompt_tokens": 9}, "timings": {"cache_n": 7}}) == 7  # llama-server
    assert cached_tokens_of({"usage": {"prompt_tokens": 9, "prompt_tokens_details": None}}) is None
    assert cached_tokens_of(None) is None
    openai = pytest.importorskip("openai")
    usage = openai.types.CompletionUsage(
        prompt_tokens=9, completion_tokens=1, total_tokens=10, prompt_tokens_details={"cached_tokens": 3}
    )
    assert cached_tokens_of(type("Response", (), {"usage": usage})()) == 3


def test_the_test_server_caches_whole_blocks_as_vllm_does() -> None:
    with ChatServer(
        tokenizer_dir("qwen2"), tokenizer=hf_tokenizer("qwen2"), prefix_cache=True, block_size=16
    ) as server:
        ids = list(range(1000, 1040))
        assert server.cache_prompt(ids) == 0  # nothing cached yet
        assert server.cache_prompt(ids) == 32  # 39 tokens may hit: two whole blocks
        assert server.cache_prompt(ids[:32]) == 16  # the last token is always computed again
        assert server.cache_prompt([*ids[:20], 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]) == 16
        server.reset_prefix_cache()
        assert server.cache_prompt(ids) == 0


def test_a_200_turn_wrapped_chat_reports_cached_tokens_beside_the_prediction() -> None:
    openai = pytest.importorskip("openai")
    tokenizer = hf_tokenizer("qwen2")
    source = template("Qwen-Qwen3-0.6B")
    messages = chat(140)
    stops = requests(messages)[:200]
    assert len(stops) == 200
    keeper = ck.ContextKeeper(counter_for("Qwen-Qwen3-0.6B", "qwen2"), context_window=4096, policy=cache_aware())
    with ChatServer(
        tokenizer_dir("qwen2"), chat_template=source, max_model_len=4096, tokenizer=tokenizer, prefix_cache=True
    ) as server:
        client = keeper.wrap(openai.OpenAI(base_url=server.base_url, api_key="test", max_retries=0))
        predicted = reported = 0
        for turn, stop in enumerate(stops):
            stream = turn % 50 == 49  # streams report their usage (and cache hits) in the last chunk
            extra: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
            reply = client.chat.completions.create(
                model="m", messages=messages[:stop], tools=TOOLS, max_tokens=128, **extra
            )
            if stream:
                for _ in reply:
                    pass
            call = keeper.last_call
            assert call is not None
            assert call.server_prompt_tokens == keeper.last_fit.tokens
            assert call.cached_tokens == server.requests[-1].cached_tokens
            assert call.prefix_tokens is not None
            assert call.cached_tokens is not None
            # The previous prompt's whole blocks are in the cache: at least those hit (vLLM's rule).
            assert call.cached_tokens >= min(call.prefix_tokens, call.tokens - 1) // 16 * 16
            predicted += call.prefix_tokens
            reported += call.cached_tokens
    assert abs(reported - predicted) <= 0.01 * predicted
