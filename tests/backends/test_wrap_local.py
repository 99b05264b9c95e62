"""keeper.wrap for plain callables (sync and async) and a local transformers model, and the provider-error
parser against every server wording the test server knows."""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

import pytest

import contextkeeper as ck
from contextkeeper.calls import classify, parse_context_error
from openai_server import DIALECTS, context_error


@pytest.fixture(scope="module")
def keeper() -> ck.ContextKeeper:
    return ck.ContextKeeper("mistral:tekken", context_window=400)


def grow(turns: int) -> list[dict[str, Any]]:
    history: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
    for i in range(turns):
        history += [
            {"role": "user", "content": f"Question {i}: " + "word " * 30},
            {"role": "assistant", "content": f"Answer {i}."},
        ]
    return [*history, {"role": "user", "content": "And now?"}]


# ------------------------------------------------------------------------------------------------ parser
@pytest.mark.parametrize("name", sorted(DIALECTS))
@pytest.mark.parametrize(("prompt", "max_tokens"), [(5000, 100), (4000, 200), (3000, 5000)])
def test_parser_reads_every_dialect(name: str, prompt: int, max_tokens: int) -> None:
    outcome = context_error(name, prompt, max_tokens, 4096)
    if outcome.status != 400:
        return  # this server does not refuse this request (llama.cpp ignores max_tokens; Ollama truncates)
    failure = parse_context_error(json.dumps(outcome.body))
    assert failure is not None
    if failure.excess is not None:
        assert failure.excess == prompt - 4096
        return
    assert failure.limit == 4096
    if failure.prompt_tokens is not None:
        # vLLM's current wording caps the reported input at the largest allowed plus one.
        assert failure.prompt_tokens in (prompt, 4096 - max_tokens + 1)


def test_other_errors_are_not_context_errors() -> None:
    assert parse_context_error("Incorrect API key provided") is None
    assert classify(KeyError("x")).kind == "other"
    assert classify(TimeoutError("slow")).kind == "transport"
    assert classify(ValueError("This model's maximum context length is 8192 tokens.")).limit == 8192


@pytest.mark.parametrize(
    ("kind", "error"),
    [("context", ck.ContextLengthExceeded), ("oom", ck.OutOfMemory), ("transport", ck.TransportError)],
)
def test_every_failure_kind_is_worded_in_one_place_with_its_fix(kind: str, error: type[Exception]) -> None:
    from contextkeeper.calls.errors import Attempted, Failure, provider_error

    failure = Failure(kind=kind, message="server said no", limit=4096, prompt_tokens=5000)  # type: ignore[arg-type]
    made = provider_error(failure, Attempted(sent=4000, answer=100, answer_key="max_tokens", attempts=4))
    assert type(made) is error
    assert "after 4 attempt(s)" in str(made)
    assert made.fix_text()  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------------------------ callables
def test_sync_callable_keeps_its_shape(keeper: ck.ContextKeeper) -> None:
    seen: list[list[dict[str, Any]]] = []

    def bot(messages: list[dict[str, Any]], *, temperature: float = 0.0, max_tokens: int = 10) -> str:
        seen.append(messages)
        return f"{len(messages)} messages at {temperature}"

    chat = keeper.fresh().wrap(bot)
    history = grow(40)
    before = copy.deepcopy(history)
    assert chat(history, temperature=0.5, max_tokens=50).endswith("at 0.5")
    assert history == before
    assert seen[0][0] == history[0]
    assert seen[0][-1] == history[-1]
    assert len(seen[0]) < len(history)
    assert chat.__name__ == "bot"


def test_async_callable_and_async_summarizer() -> None:
    calls: list[int] = []

    async def summarize(request: Any) -> str:
        await asyncio.sleep(0)
        calls.append(len(request.messages))
        return "Summary: the user asked 40 questions."

    async def bot(messages: list[dict[str, Any]], max_tokens: int = 10) -> dict[str, Any]:
        await asyncio.sleep(0)
        return {"role": "assistant", "content": f"{len(messages)}"}

    keeper = ck.ContextKeeper("mistral:tekken", context_window=400, summarizer=summarize, policy="agent")
    chat = keeper.wrap(bot)
    reply = asyncio.run(chat(grow(40), max_tokens=50))
    assert reply["role"] == "assistant"
    assert keeper.last_call.attempts == 1


def test_callable_context_error_recovers(keeper: ck.ContextKeeper) -> None:
    def strict(messages: list[dict[str, Any]], max_tokens: int = 10) -> str:
        size = sum(len(m["content"]) for m in messages)
        if size > 800:  # a server that refuses in OpenAI's words, with its limit but not its count
            raise ValueError(f"This model's maximum context length is 300 tokens ({size} characters sent)")
        return "ok"

    fresh = keeper.fresh()
    chat = fresh.wrap(strict, backoff=0)
    assert chat(grow(40), max_tokens=50) == "ok"
    assert fresh.last_call.attempts > 1
    assert fresh.last_call.withheld >= 100  # the learned limit of 300 (and more) below the keeper's 400
    assert chat(grow(41), max_tokens=50) == "ok"


# ------------------------------------------------------------------------------------------------ transformers
@pytest.fixture(scope="module")
def tiny() -> tuple[Any, Any]:
    pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    from conftest import hf_tokenizer

    tokenizer = hf_tokenizer("qwen2")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    import torch

    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval(), tokenizer


def test_transformers_backend_measures_the_real_cache(tiny: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    spec = ck.ModelSpec.from_config(model.config.to_dict())
    keeper = ck.ContextKeeper(tokenizer, context_window=512, model=spec, runtime="transformers")
    chat = keeper.wrap(model, tokenizer=tokenizer)
    history = grow(20)
    reply = chat(history, max_new_tokens=6)
    assert reply["role"] == "assistant"
    call = keeper.last_call
    assert call.server_prompt_tokens == keeper.last_fit.tokens  # our count is what the model was fed
    assert call.drift == 0
    # The cache holds the prompt and all generated tokens but the last; the memory model predicts it exactly.
    from contextkeeper.memory import kv_report

    held = call.server_prompt_tokens + 6 - 1
    assert call.cache_bytes == kv_report(spec, held, runtime="transformers").bytes


def test_transformers_out_of_memory_shrinks_and_retries(tiny: tuple[Any, Any]) -> None:
    import torch

    model, tokenizer = tiny
    ceiling = 200

    def refuse_long(module: Any, args: Any, kwargs: Any) -> None:
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[-1] > ceiling:
            raise torch.OutOfMemoryError(f"CUDA out of memory (planted at {ids.shape[-1]} tokens)")

    handle = model.register_forward_pre_hook(refuse_long, with_kwargs=True)
    try:
        keeper = ck.ContextKeeper(tokenizer, context_window=512)
        chat = keeper.wrap(model, tokenizer=tokenizer)
        reply = chat(grow(20), max_new_tokens=4)
    finally:
        handle.remove()
    assert reply["role"] == "assistant"
    call = keeper.last_call
    assert call.attempts > 1
    assert "out of memory" in call.recoveries[0]
    assert call.server_prompt_tokens is not None
    assert call.server_prompt_tokens <= ceiling


def test_too_large_names_the_argument_that_set_the_answer(tiny: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    keeper = ck.ContextKeeper(tokenizer, context_window=512)
    chat = keeper.wrap(model, tokenizer=tokenizer)
    with pytest.raises(ck.RequestTooLarge, match="Fix: lower max_new_tokens,"):
        chat(grow(2), max_new_tokens=600)
    assert keeper.transcript.last().status == "refused"  # recorded, its payload not kept


def test_pipeline_shape(tiny: tuple[Any, Any]) -> None:
    from transformers import pipeline

    model, tokenizer = tiny
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    keeper = ck.ContextKeeper(tokenizer, context_window=512)
    out = keeper.wrap(pipe)(grow(3), max_new_tokens=3)
    assert out[0]["generated_text"][-1]["role"] == "assistant"


def test_threads_share_one_ledger_in_shrink_mode() -> None:
    import threading
    import time

    capacity = 900
    keeper = ck.ContextKeeper("mistral:tekken", context_window=400, kv_capacity=capacity, admission="shrink")
    in_flight = 0
    most = 0
    lock = threading.Condition()

    def slow(messages: list[dict[str, Any]], max_tokens: int = 10) -> str:
        nonlocal in_flight, most
        with lock:
            in_flight += 1
            most = max(most, in_flight)
            lock.notify_all()
            # Each call asks for 367 of the 900 tokens: the first calls wait (a second at most) until a third is
            # in flight, which the ledger can only have admitted shrunk, so the test does not hang on timing.
            lock.wait_for(lambda: most >= 3, timeout=1.0)
        time.sleep(0.005)
        with lock:
            in_flight -= 1
        return "ok"

    chat = keeper.wrap(slow)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for _ in range(5):
                chat(grow(40), max_tokens=50)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    ledger = keeper.ledger
    assert ledger.peak <= capacity
    assert ledger.active == 0
    assert ledger.shrinks > 0  # some calls were fitted into less than they asked for
    assert most > 1  # the calls really overlapped
    entries = keeper.transcript.entries()
    assert len(entries) == 40
    assert any(e.report["slots"].get("withheld") for e in entries)


def test_monitor_is_sampled_after_every_call() -> None:
    from contextkeeper.diagnose import MemoryMonitor

    with MemoryMonitor() as monitor:
        keeper = ck.ContextKeeper("mistral:tekken", context_window=400, monitor=monitor)
        chat = keeper.wrap(lambda messages, max_tokens=10: "ok")
        for turns in range(3, 8):
            chat(grow(turns), max_tokens=50)
    requests = [s for s in monitor.report().samples if s.kind == "request"]
    assert len(requests) == 5
