"""Hostile input to the public API: the only outcomes are a valid result or a typed contextkeeper error, each in
bounded time, and nothing the caller passed in is changed.

Random malformed messages (roles, contents, tool calls, text no encoder takes, deep nesting), keeper settings,
policy files and memory-planning numbers go through ``fit``, ``count``, ``ContextKeeper(...)``, ``load_policy``,
``plan`` and ``kv_report``. A fit that succeeds must keep its guarantees: the prompt plus the answer fits the
limit, and its count is the template's own (transformers' ``apply_chat_template``). The default run takes a
fixed set of 2,000+ examples (derandomised, so CI is repeatable); ``pytest -m slow`` runs fresh random ones.
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import contextkeeper as ck
from assets import template
from conftest import hf_tokenizer
from contextkeeper.memory import kv_report

BOUND_SECONDS = 2.0  # every call answers within this, whatever its input

_FIXED = {"derandomize": True, "deadline": None, "database": None}
_CHECKS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]


def _settings(examples: int) -> Callable[[Any], Any]:
    return settings(max_examples=examples, suppress_health_check=_CHECKS, **_FIXED)


def _random(examples: int) -> Callable[[Any], Any]:
    return settings(max_examples=examples, deadline=None, suppress_health_check=_CHECKS)


@functools.cache
def _counter() -> ck.HFChatTemplateCounter:
    return ck.HFChatTemplateCounter(hf_tokenizer("qwen2"), chat_template=template("Qwen-Qwen3-0.6B"), name="qwen3")


@contextmanager
def _bounded(what: str) -> Iterator[None]:
    started = time.perf_counter()
    yield
    took = time.perf_counter() - started
    assert took < BOUND_SECONDS, f"{what} took {took:.2f} s"


def _outcome(call: Callable[[], Any], what: str) -> Any:
    """``call()``'s value, or the contextkeeper error it raised; anything else fails the test."""
    with _bounded(what):
        try:
            value = call()
        except ck.ContextKeeperError as exc:
            error = exc
        else:
            event(f"{what}: ok")  # --hypothesis-show-statistics shows how the outcomes split
            return value
    event(f"{what}: {type(error).__name__}")
    assert str(error), f"{type(error).__name__} without a message"
    return error


# ------------------------------------------------------------------------------------------------ messages

garbage = st.one_of(
    st.integers(-10, 10**13),
    st.floats(allow_nan=True, allow_infinity=True),
    st.none(),
    st.booleans(),
    st.text(max_size=8),
    st.sampled_from(["4096", "0.5GB", "1e9", [], {}]),
)


def sometimes(valid: st.SearchStrategy[Any], odds: int = 4, other: st.SearchStrategy[Any] | None = None) -> Any:
    """``valid``, except one time in ``odds`` ``other`` (default: garbage): both outcomes are exercised."""
    worse = garbage if other is None else other
    return st.integers(1, odds).flatmap(lambda pick: worse if pick == 1 else valid)


numbers = garbage


_ODD = ["\ud800", "\udfff", "x\udc80y", "\x00", "\u202e", "\ufeff", "e\u0301", "😀", "<|im_start|>", "{{ x }}", "\r\n"]
texts = st.one_of(
    st.text(max_size=30),
    st.lists(st.sampled_from([*_ODD, "a", " ", "word", "日本", "слово"]), max_size=8).map("".join),
)
roles = st.sampled_from(["system", "user", "assistant", "tool", "developer", "function", "bogus", "", "USER"])
scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**12), st.floats(allow_nan=False), texts)


@dataclass(frozen=True)
class Deep:
    """A value nested ``depth`` levels deep, built by :func:`_built` just before the call: the examples Hypothesis
    keeps (and prints) stay shallow, where its own printer would recurse through thousands of levels."""

    depth: int
    leaf: Any
    as_list: bool

    def build(self) -> Any:
        value = self.leaf
        for _ in range(self.depth):
            value = [value] if self.as_list else {"k": value}
        return value


def _built(value: Any) -> Any:
    """``value`` with every :class:`Deep` in it built (the rest is shallow, so recursion is fine here)."""
    if isinstance(value, Deep):
        return value.build()
    if isinstance(value, list):
        return [_built(v) for v in value]
    if isinstance(value, dict):
        return {k: _built(v) for k, v in value.items()}
    return value


deep = st.builds(Deep, st.integers(10, 3000), scalars, st.booleans())
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3), max_leaves=8
)
parts = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
    st.fixed_dictionaries({"type": st.sampled_from(["image_url", "input_audio", "bogus", "text"])}),
    st.fixed_dictionaries(
        {"type": st.just("image_url"), "image_url": st.one_of(texts, st.fixed_dictionaries({"url": texts}))}
    ),
    json_values,
)
contents = st.one_of(texts, st.none(), st.integers(), st.lists(parts, max_size=4), deep, json_values)
call_ids = st.one_of(st.sampled_from(["call_1", "call_2", "abc123XYZ"]), texts, st.integers(), st.none())
tool_calls = st.lists(
    st.one_of(
        st.fixed_dictionaries(
            {
                "id": call_ids,
                "type": st.sampled_from(["function", "bogus"]),
                "function": st.one_of(
                    st.fixed_dictionaries(
                        {
                            "name": st.one_of(st.sampled_from(["search", "get_weather"]), texts),
                            "arguments": st.one_of(texts, st.just('{"a": 1}'), json_values, deep),
                        }
                    ),
                    json_values,
                ),
            }
        ),
        json_values,
    ),
    max_size=3,
)


@st.composite
def messages_(draw: st.DrawFn) -> dict[str, Any]:
    message: dict[str, Any] = {"role": draw(roles)}
    if draw(st.booleans()):
        message["content"] = draw(contents)
    if message["role"] == "assistant" and draw(st.booleans()):
        message["tool_calls"] = draw(tool_calls)
    if message["role"] == "tool" or draw(st.integers(0, 9)) == 0:
        message["tool_call_id"] = draw(call_ids)
    if draw(st.integers(0, 9)) == 0:
        message[draw(st.sampled_from(["name", "metadata", "reasoning_content", "extra"]))] = draw(
            st.one_of(json_values, deep)
        )
    return message


@st.composite
def valid_chats(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Well-formed chats of random shape and size, many longer than the window they are fitted to."""
    chat: list[dict[str, Any]] = []
    if draw(st.booleans()):
        chat.append({"role": "system", "content": draw(texts.filter(_encodable))})
    for turn in range(draw(st.integers(0, 12))):
        chat.append({"role": "user", "content": draw(texts.filter(_encodable)) + " " + "question " * turn})
        if draw(st.booleans()):
            call = f"call{turn:05d}"
            arguments = json.dumps({"q": draw(texts.filter(_encodable))})
            chat.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": call, "type": "function", "function": {"name": "search", "arguments": arguments}}
                    ],
                }
            )
            chat.append({"role": "tool", "tool_call_id": call, "content": "result " * draw(st.integers(0, 400))})
        chat.append({"role": "assistant", "content": "answer " * draw(st.integers(0, 200))})
    chat.append({"role": "user", "content": draw(texts.filter(_encodable)) or "go on"})
    return chat


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the docs.",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
        },
    }
]
tool_lists = st.one_of(
    st.none(),
    st.just(TOOLS),
    st.none(),
    st.just(TOOLS),
    st.lists(
        st.one_of(json_values, st.fixed_dictionaries({"type": st.just("function"), "function": json_values})),
        max_size=2,
    ),
    deep.map(lambda value: [{"type": "function", "function": {"name": "f", "parameters": value}}]),
)
_odd_lists = st.one_of(
    st.lists(messages_(), max_size=6),
    valid_chats(),
    valid_chats().flatmap(
        lambda chat: st.lists(messages_(), max_size=2).map(lambda extra: chat[:-1] + extra + chat[-1:])
    ),
    scalars,
    st.dictionaries(texts, scalars, max_size=2),
)
message_lists = sometimes(valid_chats(), odds=2, other=_odd_lists)  # half are chats a fit must take


def _snapshot(value: Any) -> list[Any]:
    """A flat, order-true record of ``value`` taken without recursion (values nest thousands deep here):
    containers by type, length, keys and identity, leaves by type and value."""
    out: list[Any] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            out.append(("dict", id(item), tuple(item)))
            stack.extend(reversed(list(item.values())))
        elif isinstance(item, (list, tuple)):
            out.append((type(item).__name__, id(item), len(item)))
            stack.extend(reversed(item))
        else:
            out.append((type(item).__name__, repr(item)))
    return out


def _check_fit(keeper: ck.ContextKeeper, messages: Any, tools: Any, max_tokens: Any) -> None:
    before = _snapshot(messages) + _snapshot(tools)
    result = _outcome(lambda: keeper.fit(messages, tools=tools, max_tokens=max_tokens), "fit")
    assert _snapshot(messages) + _snapshot(tools) == before, "the caller's input was changed"
    if isinstance(result, ck.ContextKeeperError):
        return
    assert result.tokens + max_tokens <= keeper.limit
    counter = _counter()
    assert result.tokens == counter.reference_count(result.messages, tools=tools)
    assert sum(v for k, v in result.report.slots.items() if k != "answer") == result.tokens


@_settings(900)
@given(messages=message_lists, tools=tool_lists, window=st.integers(64, 4096), answer=st.integers(1, 512))
def test_fit_gives_a_valid_fit_or_a_typed_error(messages: Any, tools: Any, window: int, answer: int) -> None:
    keeper = ck.ContextKeeper(_counter(), context_window=window)
    _check_fit(keeper, _built(messages), _built(tools), answer)


@_settings(300)
@given(messages=message_lists, tools=tool_lists)
def test_count_gives_a_number_or_a_typed_error(messages: Any, tools: Any) -> None:
    messages, tools = _built(messages), _built(tools)
    before = _snapshot(messages) + _snapshot(tools)
    result = _outcome(lambda: _counter().count(messages, tools=tools), "count")
    assert _snapshot(messages) + _snapshot(tools) == before
    if not isinstance(result, ck.ContextKeeperError):
        assert result == _counter().reference_count(messages, tools=tools)


@_settings(120)
@given(chats=st.lists(valid_chats(), min_size=2, max_size=4), window=st.integers(256, 4096))
def test_one_keeper_across_many_fits_stays_exact(chats: list[list[dict[str, Any]]], window: int) -> None:
    """A keeper's memory of earlier fits (sticky windows, caches) never leaks a wrong count into a later one."""
    keeper = ck.ContextKeeper(_counter(), context_window=window)
    grown: list[dict[str, Any]] = []
    for chat in chats:
        grown = [*grown, *chat]
        _check_fit(keeper, grown, TOOLS, 64)
        _check_fit(keeper, chat, None, 32)


# ------------------------------------------------------------------------------------------------ settings

templates_ = st.one_of(
    st.none(),
    st.sampled_from(
        [
            "{% for m in messages %}",
            "{{ raise_exception('no') }}",
            "{% for m in messages %}{{ m.content }}{% endfor %}",
            "{{ messages[0].content * 3 }}",
            "{% macro r(n) %}{{ r(n) }}{% endmacro %}{{ r(1) }}",
            "{{ 'x' * 10**9 }}",
            "{% for i in range(10**9) %}{% endfor %}",
            "{{ messages.__class__ }}",
            "{{ (messages|first).content.__class__.__mro__ }}",
            "",
        ]
    ),
    texts,
)


@_settings(300)
@given(
    window=sometimes(st.integers(128, 65536)),
    answer=sometimes(st.integers(1, 256)),
    chat_template=sometimes(st.none(), odds=2, other=templates_),
    policy=sometimes(
        st.sampled_from(["default", "agent", "auto"]),
        odds=2,
        other=st.sampled_from(["default", "agent", "auto", "nope", "", "strategies", "/", "pyproject.toml"]) | numbers,
    ),
    concurrency=sometimes(st.integers(1, 64), odds=8),
    kv_capacity=sometimes(st.none() | st.integers(1024, 10**7)),
    admission=st.one_of(st.sampled_from(["wait", "shrink"]), texts),
    admission_timeout=sometimes(st.floats(0.01, 60)),
)
def test_keeper_settings_give_a_keeper_or_a_typed_error(
    window: Any,
    answer: Any,
    chat_template: Any,
    policy: Any,
    concurrency: Any,
    kv_capacity: Any,
    admission: Any,
    admission_timeout: Any,
) -> None:
    tokenizer = hf_tokenizer("qwen2")
    options = {
        "context_window": window,
        "chat_template": chat_template if chat_template is not None else template("Qwen-Qwen3-0.6B"),
        "policy": policy,
        "concurrency": concurrency,
        "kv_capacity": kv_capacity,
        "admission": admission,
        "admission_timeout": admission_timeout,
    }
    keeper = _outcome(lambda: ck.ContextKeeper(tokenizer, **options), "ContextKeeper()")
    if isinstance(keeper, ck.ContextKeeperError):
        return
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello " * 20}]
    result = _outcome(lambda: keeper.fit(chat, tools=TOOLS, max_tokens=answer), "fit")
    if not isinstance(result, ck.ContextKeeperError):
        assert result.tokens + result.report.max_tokens <= keeper.limit


# ------------------------------------------------------------------------------------------------ policies

_STEP_KEYS = {
    "strategy": st.sampled_from(
        ["prune_tool_results", "dedupe", "truncate", "retrieval", "summarize", "sliding_window", "bogus", ""]
    ),
    "when": st.one_of(
        st.sampled_from(["over_budget", "always", "over:0.9", "every:3", "every:0", "over:-1", "over:nan", "x|y", "&"]),
        texts,
    ),
    "keep_last": numbers,
    "clear_at_least": numbers,
    "max_tokens": numbers,
    "keep_recent": numbers,
    "retries": numbers,
    "min_chars": numbers,
    "exclude_tools": st.one_of(st.lists(texts, max_size=2), numbers),
    "unknown_key": numbers,
}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return json.dumps("" if value is None else str(value))  # a lone surrogate stays an escape TOML refuses


@st.composite
def policy_texts(draw: st.DrawFn) -> bytes:
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return draw(st.binary(max_size=64))
    if kind == 1:
        return draw(texts).encode("utf-8", "surrogatepass")
    lines = []
    for key in draw(
        st.lists(
            st.sampled_from(["answer_tokens", "horizon", "match", "description", "steps", "name", "x"]),
            max_size=3,
            unique=True,
        )
    ):
        lines.append(f"{key} = {_toml_value(draw(numbers if key != 'match' else st.lists(texts, max_size=2)))}")
    for _ in range(draw(st.integers(0, 4))):
        lines.append("[[steps]]")
        for key in draw(st.lists(st.sampled_from(sorted(_STEP_KEYS)), max_size=4, unique=True)):
            lines.append(f"{key} = {_toml_value(draw(_STEP_KEYS[key]))}")
    return "\n".join(lines).encode("utf-8", "surrogatepass")


@_settings(300)
@given(body=policy_texts())
def test_policy_files_load_or_give_a_policy_error(body: bytes, tmp_path_factory: pytest.TempPathFactory) -> None:
    path = tmp_path_factory.mktemp("policy") / "mine.toml"
    path.write_bytes(body)
    policy = _outcome(lambda: ck.load_policy(path), "load_policy")
    if isinstance(policy, ck.ContextKeeperError):
        assert isinstance(policy, ck.PolicyError), type(policy)
        assert str(path) in str(policy)
        return
    counter = _counter()  # loaded once per session, outside the timed call
    keeper = _outcome(lambda: ck.ContextKeeper(counter, context_window=512, policy=policy), "ContextKeeper()")
    if not isinstance(keeper, ck.ContextKeeperError):
        chat = [{"role": "user", "content": "long question " * 30}] * 1 + [{"role": "assistant", "content": "a " * 300}]
        _check_fit(keeper, [*chat * 4, {"role": "user", "content": "and now?"}], None, 64)


def test_a_folder_or_a_binary_file_as_a_policy_is_a_policy_error(tmp_path: Path) -> None:
    binary = tmp_path / "policy.toml"
    binary.write_bytes(bytes(range(256)))
    for path in (tmp_path, binary):
        with pytest.raises(ck.PolicyError, match=str(path)):
            ck.load_policy(path)


# ------------------------------------------------------------------------------------------------ memory

_NAMES = st.sampled_from(["llama-3.1-8b", "qwen2.5-32b", "mistral-nemo-12b", "no-such-model", ""])
models = st.one_of(
    _NAMES,
    _NAMES,
    st.fixed_dictionaries(
        {
            "architectures": st.just(["LlamaForCausalLM"]),
            "num_hidden_layers": sometimes(st.integers(1, 128), odds=12),
            "hidden_size": sometimes(st.sampled_from([512, 2048, 4096, 8192]), odds=12),
            "num_attention_heads": sometimes(st.sampled_from([8, 32, 64]), odds=12),
            "num_key_value_heads": sometimes(st.sampled_from([1, 8]), odds=12),
            "intermediate_size": sometimes(st.integers(1024, 32768), odds=12),
            "vocab_size": sometimes(st.integers(1000, 200_000), odds=12),
            "max_position_embeddings": sometimes(st.integers(2048, 1 << 20), odds=12),
        }
    ),
    json_values,
)
gpus_ = sometimes(
    st.sampled_from(["H100", "RTX 4090", "48GB", "0.5GB", "-1GB", "nanGB", "", "no such gpu", "H200", "L40S"])
)


@functools.cache
def _warm_memory() -> None:
    """First calls import and load what every later call reuses (the catalogs, a runtime's own package to read
    its version): seconds once per process, not a property of any input."""
    for runtime in ("vllm", "sglang", "transformers", "llama.cpp"):
        ck.plan("llama-3.1-8b", "H100", context=4096, concurrency=1, runtime=runtime)


@_settings(300)
@given(
    model=models,
    gpu=gpus_,
    context=sometimes(st.integers(1, 1 << 20), odds=8),
    concurrency=sometimes(st.integers(1, 256), odds=8),
    count=sometimes(st.integers(1, 8), odds=8),
    utilization=sometimes(st.floats(0.05, 1.0), odds=8),
    runtime=st.sampled_from(["vllm", "sglang", "transformers", "llama.cpp", "bogus"]),
)
def test_memory_planning_gives_a_plan_or_a_typed_error(
    model: Any, gpu: Any, context: Any, concurrency: Any, count: Any, utilization: Any, runtime: str
) -> None:
    _warm_memory()
    settings_ = _outcome(lambda: ck.memory.PlanSettings(gpu_memory_utilization=utilization), "PlanSettings()")
    options: dict[str, Any] = {"runtime": runtime}
    if not isinstance(settings_, ck.ContextKeeperError):
        options["settings"] = settings_
    result = _outcome(
        lambda: ck.plan(model, gpu, context=context, concurrency=concurrency, gpus=count, **options), "plan"
    )
    if not isinstance(result, ck.ContextKeeperError):
        breakdown = result.breakdown
        # It does not fit when the memory does not, or when the model accepts fewer tokens than asked for.
        beyond = any("accepts at most" in note for note in result.notes)
        assert result.fits == (breakdown.total <= breakdown.capacity and not beyond)
        assert min(breakdown.weights, breakdown.kv_cache, breakdown.overhead, breakdown.total) >= 0
        assert 0 < breakdown.capacity <= ck.find_gpu(gpu).memory_bytes  # bytes per GPU, never more than it has
    spec = _outcome(lambda: ck.ModelSpec.from_config(model), "ModelSpec.from_config")
    if not isinstance(spec, ck.ContextKeeperError):
        report = _outcome(lambda: kv_report(spec, context, concurrency, runtime=runtime), "kv_report")
        if not isinstance(report, ck.ContextKeeperError):
            assert report.bytes >= 0


# ------------------------------------------------------------------------------------------------ fresh runs


@pytest.mark.slow
@_random(10_000)
@given(messages=message_lists, tools=tool_lists, window=st.integers(64, 4096), answer=st.integers(1, 512))
def test_fit_random_run(messages: Any, tools: Any, window: int, answer: int) -> None:
    _check_fit(ck.ContextKeeper(_counter(), context_window=window), _built(messages), _built(tools), answer)
