"""Runtime rules are looked up by exact layer kind: every runtime covers every kind, and a kind without a rule
is a typed error instead of being sized as whichever older kind it resembles."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from typing import ClassVar

import pytest

import contextkeeper as ck
from contextkeeper.memory import ModelSpec, RuntimeSettings, dtype
from contextkeeper.memory import layers as layer_module
from contextkeeper.memory.layers import FullAttention, LayerSpec, NoCache, SlidingAttention
from contextkeeper.memory.runtimes import RUNTIMES, KVRules, LlamaCpp, Unsupported, unchanged
from memory_real import TINY

BUILT_IN = [
    cls
    for _, cls in inspect.getmembers(layer_module, inspect.isclass)
    if issubclass(cls, LayerSpec) and cls is not LayerSpec and cls.__module__ == layer_module.__name__
]


@dataclass(frozen=True, kw_only=True)
class BandedAttention(SlidingAttention):
    """A new kind built on an existing one: an isinstance ladder sized it as a sliding layer."""

    kind: ClassVar[str] = "banded"


@dataclass(frozen=True, kw_only=True)
class Xyz(LayerSpec):
    """A new kind straight from the base: a ladder's last branch passed it through unsized by any rule."""

    kind: ClassVar[str] = "xyz"

    def bytes_for(self, tokens: int) -> int:
        return 7 * tokens


@dataclass(frozen=True, kw_only=True)
class Impostor(LayerSpec):
    """Another class that calls itself "full": the rule for "full" was declared for FullAttention, not for it."""

    kind: ClassVar[str] = "full"

    def bytes_for(self, tokens: int) -> int:
        return 3 * tokens


def test_built_in_kinds_are_distinct() -> None:
    kinds = [cls.kind for cls in BUILT_IN]
    assert sorted(kinds) == ["chunked", "full", "mla", "none", "recurrent", "sliding"]


@pytest.mark.parametrize("runtime", sorted(RUNTIMES))
def test_every_runtime_has_a_rule_for_every_kind(runtime: str) -> None:
    rules = RUNTIMES[runtime]().rules
    assert rules.kinds == {cls.kind for cls in BUILT_IN}
    for cls in BUILT_IN:
        assert rules.covers(cls), (runtime, cls.__name__)
        rule = rules.entry(cls)
        assert callable(rule) or (isinstance(rule, Unsupported) and rule.why and rule.fix), (runtime, cls)
    assert rules.passed == {NoCache.kind}  # layers that hold nothing are declared pass-through, not defaulted


def test_llama_cpp_unified_pool_covers_every_kind() -> None:
    assert {cls.kind for cls in BUILT_IN} == LlamaCpp.unified_pool.kinds
    assert all(LlamaCpp.unified_pool.covers(cls) for cls in BUILT_IN)


@pytest.mark.parametrize("runtime", sorted(RUNTIMES))
@pytest.mark.parametrize("family", ["gemma3n_text", "llama4_text", "deepseek_v3", "qwen3_next"])
def test_rules_allocate_built_in_kinds_only(runtime: str, family: str) -> None:
    # Together these tiny configs hold every kind; what a runtime allocates must again be a kind it and the
    # pooling steps after it know, one layer out per layer in.
    model = ModelSpec.from_config(TINY[family])
    profile = RUNTIMES[runtime]()
    layers, _ = profile.layers(model, profile.auto_dtype(model)[0], RuntimeSettings())
    assert len(layers) == len(model.layers)
    assert {type(layer) for layer in layers} <= set(BUILT_IN)
    for before, after in zip(model.layers, layers, strict=True):
        if isinstance(before, NoCache):
            assert after is before


def _with_layer(extra: LayerSpec) -> ModelSpec:
    model = ModelSpec.from_config(TINY["gemma3_text"], name="tiny-gemma3")
    return replace(model, layers=(*model.layers[:-1], extra))


@pytest.mark.parametrize("runtime", sorted(RUNTIMES))
def test_a_kind_without_a_rule_is_a_typed_error(runtime: str) -> None:
    window = next(layer for layer in _with_layer(NoCache()).layers if isinstance(layer, SlidingAttention))
    banded = BandedAttention(
        kv_heads=window.kv_heads,
        head_dim=window.head_dim,
        v_head_dim=window.v_head_dim,
        dtype=window.dtype,
        window=window.window,
    )
    name = RUNTIMES[runtime].name
    for layer, cls in ((banded, "BandedAttention"), (Xyz(), "Xyz"), (Impostor(), "Impostor")):
        model = _with_layer(layer)
        with pytest.raises(ck.ConfigurationError) as caught:
            model.kv(1024, runtime=runtime)
        message = str(caught.value)
        assert message.startswith(f"{name} has no KV rule for {layer.kind!r} layers ({cls}, model tiny-gemma3)")
        assert caught.value.fix_text() == (
            f"add an entry for {cls} to the {name} rules in contextkeeper.memory.runtimes (one per layer kind)"
        )


def test_llama_cpp_unified_pool_refuses_a_kind_it_has_no_entry_for() -> None:
    settings = RuntimeSettings(kv_unified=True)
    with pytest.raises(ck.ConfigurationError, match=r"^llama\.cpp --kv-unified has no KV rule for 'xyz' layers"):
        LlamaCpp().kv_bytes([Xyz()], 1000, 4, settings)


def test_a_layer_class_must_declare_its_own_kind() -> None:
    with pytest.raises(TypeError, match=r"Inherits must declare its own layer kind.*inherit 'full'"):

        @dataclass(frozen=True, kw_only=True)
        class Inherits(FullAttention):
            pass


def test_a_kind_declared_unsupported_says_why_and_the_fix() -> None:
    rules: KVRules[ModelSpec] = KVRules(
        "tiny-runtime",
        {
            FullAttention: unchanged,
            SlidingAttention: unchanged,
            NoCache: unchanged,
            Xyz: Unsupported(why="it keeps no per-token rows", fix="use --runtime vllm"),
        },
    )
    assert rules.unsupported == {"xyz"}
    model = _with_layer(Xyz())
    with pytest.raises(ck.ConfigurationError) as caught:
        rules.apply(model, dtype("bf16"), RuntimeSettings(), model)
    assert str(caught.value) == (
        "tiny-runtime cannot hold 'xyz' layers (model tiny-gemma3: 1 of 6 layers): it keeps no per-token rows. "
        "Fix: use --runtime vllm"
    )
    assert caught.value.fix_text() == "use --runtime vllm"
    kept = rules.apply(_with_layer(NoCache()), dtype("bf16"), RuntimeSettings(), model)
    assert kept == list(_with_layer(NoCache()).layers)


def test_two_entries_for_one_kind_are_refused() -> None:
    with pytest.raises(TypeError, match="Impostor and FullAttention share kind 'full'"):
        KVRules("tiny-runtime", {FullAttention: unchanged, Impostor: unchanged})
