"""param_count's whole breakdown (embedding, linear, other, experts, active), pinned for every catalog model,
one tiny config per family and a few family quirks the catalog lacks. The values are what the ``model_type``
ladder computed before it became the ``FAMILIES`` registry (issue 35); test_memory_weights.py checks the totals
against transformers."""

from __future__ import annotations

from typing import Any

import pytest

from contextkeeper.memory import ModelSpec, param_count
from contextkeeper.memory import catalog as model_catalog
from memory_real import TINY

_LLAMA = TINY["llama"]
EXTRA: dict[str, dict[str, Any]] = {
    # Mamba's mixer layers have no MLP; the config lists its layer kinds.
    "mamba": {
        "model_type": "mamba",
        "vocab_size": 128,
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "state_size": 8,
        "conv_kernel": 4,
        "expand": 2,
        "layer_types": ["mamba"] * 3,
    },
    # Qwen2-MoE: q, k, v biases and a gate on the shared expert.
    "qwen2_moe": {
        "model_type": "qwen2_moe",
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "olmo2": {**_LLAMA, "model_type": "olmo2"},  # q and k norms
    "gpt_neox": {**_LLAMA, "model_type": "gpt_neox"},  # ungated MLP, LayerNorm
    "llama_qk_norm_bias": {**_LLAMA, "qk_norm": True, "attention_bias": True},  # the config's own switches
    "llama4": {**TINY["llama4_text"], "model_type": "llama4"},
}

# (embedding, linear, other, experts, active)
CATALOG: dict[str, tuple[int, int, int, int, int]] = {
    "meta-llama/Llama-3.1-8B-Instruct": (1050673152, 6979321856, 266240, 0, 8030261248),
    "meta-llama/Llama-3.1-70B-Instruct": (2101346304, 68451041280, 1318912, 0, 70553706496),
    "meta-llama/Llama-3.1-405B-Instruct": (4202692608, 401646551040, 4145152, 0, 405853388800),
    "meta-llama/Llama-3.2-1B-Instruct": (262668288, 973078528, 67584, 0, 1235814400),
    "meta-llama/Llama-3.2-3B-Instruct": (394002432, 2818572288, 175104, 0, 3212749824),
    "meta-llama/Llama-3.3-70B-Instruct": (2101346304, 68451041280, 1318912, 0, 70553706496),
    "meta-llama/Llama-4-Scout-17B-16E-Instruct": (2068971520, 105696460800, 4428800, 96636764160, 17172894720),
    "meta-llama/Llama-4-Maverick-17B-128E-Instruct": (2068971520, 398626652160, 16225280, 386547056640, 17184691200),
    "Qwen/Qwen2.5-0.5B-Instruct": (136134656, 357826560, 71552, 0, 494032768),
    "Qwen/Qwen2.5-1.5B-Instruct": (233373696, 1310195712, 144896, 0, 1543714304),
    "Qwen/Qwen2.5-3B-Instruct": (311164928, 2774532096, 241664, 0, 3085938688),
    "Qwen/Qwen2.5-7B-Instruct": (1089994752, 6525288448, 333312, 0, 7615616512),
    "Qwen/Qwen2.5-14B-Instruct": (1557135360, 13212057600, 840704, 0, 14770033664),
    "Qwen/Qwen2.5-32B-Instruct": (1557135360, 31205621760, 1119232, 0, 32763876352),
    "Qwen/Qwen2.5-72B-Instruct": (2491416576, 70212648960, 2138112, 0, 72706203648),
    "Qwen/Qwen3-0.6B": (155582464, 440401920, 65536, 0, 596049920),
    "Qwen/Qwen3-1.7B": (311164928, 1409286144, 123904, 0, 1720574976),
    "Qwen/Qwen3-4B": (388956160, 3633315840, 196096, 0, 4022468096),
    "Qwen/Qwen3-8B": (1244659712, 6945767424, 308224, 0, 8190735360),
    "Qwen/Qwen3-14B": (1555824640, 13212057600, 424960, 0, 14768307200),
    "Qwen/Qwen3-32B": (1555824640, 31205621760, 676864, 0, 32762123264),
    "Qwen/Qwen3-30B-A3B": (622329856, 29896998912, 12793856, 28991029248, 3353032704),
    "Qwen/Qwen3-235B-A22B": (1244659712, 233798893568, 50081280, 227096395776, 22190763520),
    "Qwen/Qwen3-Next-80B-A3B-Instruct": (622329856, 79000240128, 51821312, 77309411328, 3874929408),
    "mistralai/Mistral-7B-Instruct-v0.1": (262144000, 6979321856, 266240, 0, 7241732096),
    "mistralai/Mistral-7B-Instruct-v0.3": (268435456, 6979321856, 266240, 0, 7248023552),
    "mistralai/Mistral-Nemo-Instruct-2407": (1342177280, 10905190400, 414720, 0, 12247782400),
    "mistralai/Mistral-Small-24B-Instruct-2501": (1342177280, 22229811200, 414720, 0, 23572403200),
    "mistralai/Mixtral-8x7B-Instruct-v0.1": (262144000, 46439333888, 1314816, 45097156608, 12879925248),
    "google/gemma-2-2b-it": (589824000, 2024275968, 241920, 0, 2614341888),
    "google/gemma-2-9b-it": (917504000, 8323596288, 605696, 0, 9241705984),
    "google/gemma-2-27b-it": (1179648000, 26046627840, 852480, 0, 27227128320),
    "google/gemma-3-1b-it": (301989888, 697761792, 134272, 0, 999885952),
    "google/gemma-3-4b-it": (671252480, 3208642560, 368128, 0, 3880263168),
    "google/gemma-3-12b-it": (1006878720, 10758389760, 765696, 0, 11766034176),
    "google/gemma-3-27b-it": (1409630208, 25598361600, 1354496, 0, 27009346304),
    "deepseek-ai/DeepSeek-V3": (1853358080, 669065609216, 107437056, 653908770816, 37552282624),
    "deepseek-ai/DeepSeek-R1": (1853358080, 669065609216, 107437056, 653908770816, 37552282624),
    "openai/gpt-oss-20b": (1158266880, 19747307520, 9182784, 19110297600, 4193246784),
    "openai/gpt-oss-120b": (1158266880, 115617300480, 53589312, 114661785600, 5750551872),
    "microsoft/Phi-3-mini-4k-instruct": (197001216, 3623878656, 199680, 0, 3821079552),
    "microsoft/Phi-3-mini-128k-instruct": (197001216, 3623878656, 199680, 0, 3821079552),
    "microsoft/Phi-3.5-mini-instruct": (197001216, 3623878656, 199680, 0, 3821079552),
    "microsoft/phi-4": (1027604480, 13631488000, 414720, 0, 14659507200),
    "tiiuae/falcon-7b-instruct": (295469056, 6625951744, 299904, 0, 6921720704),
    "openai-community/gpt2": (39383808, 84934656, 121344, 0, 124439808),
    "ai21labs/Jamba-v0.1": (536870912, 51026853888, 6598528, 45097156608, 12110311296),
}

TINY_COUNTS: dict[str, tuple[int, int, int, int, int]] = {
    "llama": (32768, 262144, 1152, 0, 296064),
    "qwen3": (16384, 110592, 640, 0, 127616),
    "falcon_mqa": (16384, 129024, 512, 0, 145920),
    "falcon_new": (16384, 129024, 896, 0, 146304),
    "gpt2": (40960, 147456, 2624, 0, 191040),
    "phi3": (16384, 86016, 448, 0, 102848),
    "phi3_sliding": (16384, 86016, 448, 0, 102848),
    "mistral": (16384, 73728, 448, 0, 90560),
    "qwen2_nosliding": (16384, 73728, 832, 0, 90944),
    "qwen2_sliding": (16384, 73728, 832, 0, 90944),
    "gemma2": (16384, 98304, 1088, 0, 115776),
    "gemma3_text": (16384, 135168, 1792, 0, 153344),
    "cohere2": (16384, 98304, 576, 0, 115264),
    "gpt_oss": (16384, 147456, 4448, 98304, 119136),
    "deepseek_v3": (16384, 93696, 1200, 24576, 98992),
    "llama4_text": (16384, 122880, 1088, 49152, 115776),
    "qwen3_next": (16384, 113152, 2908, 49152, 107868),
    "jamba": (16384, 168960, 6652, 49152, 167420),
    "gemma3n_text": (16384, 155648, 832, 0, 172864),
    "mpt": (16384, 147456, 896, 0, 164736),
}

EXTRA_COUNTS: dict[str, tuple[int, int, int, int, int]] = {
    "mamba": (16384, 82944, 6208, 0, 105536),
    "qwen2_moe": (16384, 61440, 1216, 24576, 66752),
    "olmo2": (32768, 262144, 1280, 0, 296192),
    "gpt_neox": (32768, 229376, 2304, 0, 264448),
    "llama_qk_norm_bias": (32768, 262144, 2048, 0, 296960),
    "llama4": (16384, 122880, 1088, 49152, 115776),
}


def _breakdown(config: dict[str, Any]) -> tuple[int, int, int, int, int]:
    counts = param_count(ModelSpec.from_config(config))
    return counts.embedding, counts.linear, counts.other, counts.experts, counts.active


@pytest.mark.parametrize("entry", model_catalog.models(), ids=lambda e: e.name)
def test_catalog_breakdown(entry: model_catalog.CatalogModel) -> None:
    assert _breakdown(entry.config) == CATALOG[entry.name]


def test_every_catalog_model_is_pinned() -> None:
    assert set(CATALOG) == {entry.name for entry in model_catalog.models()}


@pytest.mark.parametrize("family", sorted(TINY_COUNTS))
def test_tiny_family_breakdown(family: str) -> None:
    assert _breakdown(TINY[family]) == TINY_COUNTS[family]


@pytest.mark.parametrize("name", sorted(EXTRA_COUNTS))
def test_family_quirk_breakdown(name: str) -> None:
    assert _breakdown(EXTRA[name]) == EXTRA_COUNTS[name]
