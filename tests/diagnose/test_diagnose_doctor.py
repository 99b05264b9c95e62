"""doctor: every symptom answers, with and without facts; numbers from plan() re-rank the causes."""

from __future__ import annotations

import json

import pytest

from contextkeeper._exceptions import ConfigurationError
from contextkeeper.diagnose import Facts, HostMemory, UnknownSymptom, diagnose, symptoms
from contextkeeper.diagnose.doctor import COSTS, _load_tree, _tree

SEED_SYMPTOMS = ["load", "long-prompt", "generation", "concurrent", "grows-over-time", "process-killed"]
GiB = 2**30


def test_the_seed_symptoms_in_order() -> None:
    assert list(symptoms()) == SEED_SYMPTOMS


@pytest.mark.parametrize("symptom", SEED_SYMPTOMS)
def test_every_symptom_answers_without_facts(symptom: str) -> None:
    result = diagnose(symptom)
    data = result.to_dict()
    json.dumps(data)
    assert data["causes"], symptom
    assert data["facts"] is None
    for cause in data["causes"]:
        assert cause["cause"]
        assert cause["why"]
        assert cause["fixes"]
        assert cause["evidence"] is None
        assert cause["over"] is None
        costs = [COSTS.index(fix["cost"]) for fix in cause["fixes"]]
        assert costs == sorted(costs), f"{cause['key']}: no-cost settings first, then model, then hardware"
    # without facts the tree's order stands: the likeliest cause first
    assert [c.key for c in result.causes] == list(symptoms()[symptom].causes)
    assert result.table().startswith("doctor — ")


@pytest.mark.parametrize("symptom", SEED_SYMPTOMS)
def test_every_symptom_answers_with_facts(symptom: str) -> None:
    result = diagnose(symptom, model="llama-3.1-8b", gpu="RTX 4090", context=32768, concurrency=4, runtime="vllm")
    data = result.to_dict()
    json.dumps(data)
    assert data["facts"]["gpu"] == "NVIDIA GeForce RTX 4090 24GB"
    assert data["breakdown"]["capacity"] > 0
    quantified = {key for key, rule in _tree().causes.items() if rule.quantify not in (None, "leak", "fragmentation")}
    for cause in result.causes:
        if cause.key in quantified and cause.key not in ("startup-reservation", "container-limit"):
            assert cause.evidence, cause.key  # these need only the plan, which the facts give
        assert all(fix.setting for fix in cause.fixes)


def test_the_issue_example_kv_for_four_sequences_overflows() -> None:
    """ "your KV for 4 × 32K is 16 GiB; the card has 24 GiB and the weights take 15 GiB" — and it is ranked first."""
    result = diagnose(
        "concurrent", Facts(model="llama-3.1-8b", gpu="RTX 4090", context=32768, concurrency=4, runtime="vllm")
    )
    first = result.causes[0]
    assert first.key == "kv-concurrency"
    assert first.over is True
    assert "your KV for 4 × 32,768 tokens is 16.00 GiB" in (first.evidence or "")
    assert "the weights take 14.96 GiB" in (first.evidence or "")
    # vLLM spellings, and plan()'s numbers on the fixes it can compute
    settings = [fix.setting for fix in first.fixes]
    # not even one 32K sequence fits, so fewer sequences is not enough alone: a shorter context that fits leads
    assert settings[0].startswith("--max-model-len")
    assert first.fixes[0].fits is True
    seqs = next(fix for fix in first.fixes if fix.setting.startswith("--max-num-seqs"))
    assert seqs.fits is False
    assert (seqs.effect or "").startswith("not enough alone")
    context_fix = next(fix for fix in first.fixes if fix.setting.startswith("--max-model-len"))
    assert context_fix.setting != "--max-model-len N"  # the number plan() found
    assert context_fix.effect
    assert "fits" in context_fix.effect
    # transformers-only causes are left out for vLLM
    assert "padding" not in [c.key for c in result.causes]


def test_weights_that_do_not_fit_come_first_at_load() -> None:
    result = diagnose("load", model="llama-3.1-70b", gpu="RTX 4090", context=8192, runtime="vllm")
    assert result.causes[0].key == "weights"
    assert result.causes[0].over is True
    assert "the weights take" in (result.causes[0].evidence or "")
    kv = next(c for c in result.causes if c.key == "max-model-len")
    assert kv.over is False  # the weights overflow first; the KV pool is not the one to fix


def test_fixes_that_are_not_enough_alone_come_after_those_that_are() -> None:
    """doctor listed first the fixes its own numbers called "not enough alone": --max-num-seqs for 16 × 32K on a
    24 GB card, "free the GPU" for a 70B model on a 24 GB card. Rank: fits alone, unknown, not enough; then cost."""
    rank = {True: 0, None: 1, False: 2}
    concurrent = diagnose("concurrent", model="llama-3.1-8b", gpu="RTX 4090", context=32768, concurrency=16)
    for cause in concurrent.causes:
        keys = [(rank[fix.fits], COSTS.index(fix.cost)) for fix in cause.fixes]
        assert keys == sorted(keys), cause.key
    first = concurrent.causes[0]
    assert first.fixes[0].fits is True
    assert first.fixes[0].setting.startswith("--max-model-len")
    seqs = next(fix for fix in first.fixes if fix.setting.startswith("--max-num-seqs"))
    assert seqs.fits is False
    assert first.fixes.index(seqs) > 0
    load = diagnose("load", model="llama-3.1-70b", gpu="RTX 4090", runtime="vllm")
    weights = load.causes[0]
    assert weights.key == "weights"
    free = next(fix for fix in weights.fixes if fix.action.startswith("free the GPU"))
    assert free.fits is False
    assert (free.effect or "").startswith("not enough alone: the numbers already count the whole card as free")
    assert weights.fixes[0].fits is None  # "choose a smaller model": the facts cannot rule it out
    assert weights.fixes.index(free) > 0
    assert all(fix.fits is False for fix in weights.fixes[weights.fixes.index(free) :])
    # When the workload fits an empty card, only a reading of free memory can tell whether freeing it helps.
    fits = diagnose("load", model="qwen2.5-7b", gpu="H100", context=8192, runtime="vllm")
    weights = next(cause for cause in fits.causes if cause.key == "weights")
    assert next(fix for fix in weights.fixes if fix.action.startswith("free the GPU")).fits is None


def test_a_workload_that_fits_flags_no_pool() -> None:
    result = diagnose("long-prompt", model="qwen2.5-7b", gpu="H100", context=8192, runtime="vllm")
    assert result.facts is not None
    assert result.facts["fits"] is True
    assert not any(c.over for c in result.causes)


def test_long_prompt_kv_over_and_model_default_context() -> None:
    # no --context: vLLM's default max_model_len is the model's limit (131,072 for Llama 3.1 = 16 GiB of KV)
    result = diagnose("long-prompt", model="llama-3.1-8b", gpu="RTX 4090", runtime="vllm")
    assert result.facts is not None
    assert result.facts["context"] == 131072
    assert result.causes[0].key == "kv-context"
    assert result.causes[0].over is True
    assert any("model's limit" in note for note in result.notes)


def test_eager_attention_is_a_transformers_cause() -> None:
    facts = Facts(model="llama-3.1-8b", gpu="H100", context=16384, runtime="transformers", attn_implementation="eager")
    result = diagnose("long-prompt", facts)
    eager = next(c for c in result.causes if c.key == "eager-attention")
    assert eager.over is True
    assert result.causes[0].key == "eager-attention"
    assert "attn_implementation='sdpa'" in eager.fixes[0].setting
    vllm = diagnose("long-prompt", model="llama-3.1-8b", gpu="H100", context=16384, runtime="vllm")
    assert "eager-attention" not in [c.key for c in vllm.causes]


def test_runtime_spellings_without_facts() -> None:
    every = diagnose("concurrent").causes[0].fixes[0].setting
    assert "vllm: --max-num-seqs N" in every
    assert "llama.cpp: -np N" in every
    llama = diagnose("concurrent", runtime="llama.cpp").causes[0].fixes[0].setting
    assert llama == "-np N"


def test_process_killed_uses_host_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    from contextkeeper.diagnose import monitor

    host = HostMemory(total_bytes=16 * GiB, available_bytes=12 * GiB, cgroup_limit_bytes=8 * GiB, rss_bytes=None)
    monkeypatch.setattr(monitor, "host_memory", lambda: host)
    result = diagnose("process-killed", model="llama-3.1-8b", gpu="RTX 4090", runtime="transformers", detect=True)
    by_key = {c.key: c for c in result.causes}
    assert by_key["host-ram"].over is True  # 14.96 GiB of weights > the 8 GiB the container allows
    assert "the container allows 8.00 GiB" in (by_key["host-ram"].evidence or "")
    assert by_key["container-limit"].over is True
    assert by_key["cpu-offload"].over is False  # the weights fit the 24 GiB card
    assert result.causes[0].over is True


def test_detection_alone_reads_the_container_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    from contextkeeper.diagnose import monitor

    host = HostMemory(total_bytes=64 * GiB, available_bytes=60 * GiB, cgroup_limit_bytes=None, rss_bytes=None)
    monkeypatch.setattr(monitor, "host_memory", lambda: host)
    result = diagnose("process-killed", detect=True)
    limit = next(c for c in result.causes if c.key == "container-limit")
    assert limit.evidence == "this process runs under no container memory limit"
    assert limit.over is False
    assert result.causes[-1].key == "container-limit"  # ruled out: ranked last


def test_unknown_symptom_is_a_typed_error_listing_the_valid_ones() -> None:
    with pytest.raises(UnknownSymptom) as caught:
        diagnose("concurent")
    assert isinstance(caught.value, ConfigurationError)
    message = str(caught.value)
    for name in SEED_SYMPTOMS:
        assert name in message
    assert caught.value.matches[0] == "concurrent"


def test_symptom_spelling_is_forgiving() -> None:
    assert diagnose("long_prompt").symptom == "long-prompt"
    assert diagnose("Grows Over Time").symptom == "grows-over-time"


def test_the_tree_is_checked_when_loaded() -> None:
    good = """
[symptoms.x]
title = "t"
pool = "p"
summary = "s"
causes = ["c"]

[causes.c]
title = "t"
pool = "p"
why = "w"
fixes = [
  { cost = "none", action = "a", setting = "s" },
  { cost = "hardware", action = "b", setting = "s" },
]
"""
    assert list(_load_tree(good).symptoms) == ["x"]
    with pytest.raises(ValueError, match="no-cost settings to model to hardware"):
        _load_tree(good.replace('"none"', '"model2"').replace('"hardware"', '"none"').replace('"model2"', '"hardware"'))
    with pytest.raises(ValueError, match="unknown causes"):
        _load_tree(good.replace('causes = ["c"]', 'causes = ["missing"]'))
    with pytest.raises(ValueError, match="unknown quantifier"):
        _load_tree(good.replace('why = "w"', 'why = "w"\nquantify = "nope"'))
    with pytest.raises(ValueError, match="unknown judge"):
        _load_tree(good.replace('action = "a", setting = "s"', 'action = "a", setting = "s", judge = "nope"'))
