"""Importing contextkeeper, counting, fitting and building the proxy import nothing heavy they do not use (issue 35).

Each entry point runs in a fresh interpreter, which prints every module it imported; torch (with what it pulls in),
transformers' tokenizer and model code and the scientific stack must not be among them. A Hugging Face tokenizer is
loaded with transformers once, in a child process, and cached (tokens/loading.py): the first load is checked too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from assets import require_assets, tokenizer_dir
from conftest import hf_tokenizer

# What none of the entry points use. torch pulls in sympy, networkx and torchgen; transformers' AutoTokenizer pulls
# in torch, its configuration and model code and its tokenizer classes.
HEAVY = frozenset(
    {
        "torch",
        "torchgen",
        "torchvision",
        "torchaudio",
        "triton",
        "sympy",
        "networkx",
        "tensorflow",
        "jax",
        "flax",
        "scipy",
        "sklearn",
        "pandas",
        "matplotlib",
        "safetensors",
        "accelerate",
        "sentence_transformers",
    }
)
HEAVY_TRANSFORMERS = (
    "transformers.models",
    "transformers.modeling_utils",
    "transformers.configuration_utils",
    "transformers.tokenization_utils_base",
    "transformers.tokenization_utils_tokenizers",
)
# The Hugging Face paths read the tokenizer with the tokenizers library and render templates in our own copy of
# transformers' Jinja environment: neither transformers nor another tokenizer library.
HF_EXTRA = frozenset({"transformers", "sentencepiece", "mistral_common", "tiktoken"})
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "How many tokens is this?"}]

# Runs in the fresh interpreter: the entry point, then one JSON line with every module imported.
PROBE = """
import json, sys
{setup}
print(json.dumps(sorted(sys.modules)))
"""


def imported(setup: str, cache: Path) -> list[str]:
    """The modules a fresh interpreter has imported once it has run ``setup``."""
    env = {**os.environ, "CONTEXTKEEPER_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(setup=setup)], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr[-4000:]
    modules: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return modules


def assert_light(modules: list[str], extra: frozenset[str] = frozenset()) -> None:
    """No module of ``modules`` is one no entry point should import (``extra``: top-level names besides HEAVY);
    the message lists them, then every third-party top-level module imported."""
    banned = HEAVY | extra

    def label(name: str) -> str | None:
        top = name.partition(".")[0]
        if top in banned:
            return top
        return next((p for p in HEAVY_TRANSFORMERS if name == p or name.startswith(p + ".")), None)

    found = sorted({found for name in modules if (found := label(name)) is not None})
    tops = sorted({m.partition(".")[0] for m in modules} - set(sys.stdlib_module_names))
    assert not found, f"imported {', '.join(found)}; every third-party module imported: {', '.join(tops)}"


@pytest.fixture(scope="module")
def qwen2() -> str:
    require_assets()
    return str(tokenizer_dir("qwen2"))


@pytest.fixture(scope="module")
def cold(tmp_path_factory: pytest.TempPathFactory, qwen2: str) -> tuple[Path, list[str]]:
    """A cache warmed by a first count (transformers loads the tokenizer in a child process), and what that
    count imported."""
    cache = tmp_path_factory.mktemp("cache")
    setup = f"import contextkeeper as ck\nck.load_counter({qwen2!r}).count({MESSAGES!r})"
    return cache, imported(setup, cache)


def test_import_contextkeeper_imports_only_the_standard_library(tmp_path: Path) -> None:
    bare = set(imported("", tmp_path))  # what the interpreter imports on its own (site hooks, .pth files)
    modules = imported("import contextkeeper", tmp_path)
    added = {m.partition(".")[0] for m in set(modules) - bare} - set(sys.stdlib_module_names)
    tops = sorted({m.partition(".")[0] for m in modules} - set(sys.stdlib_module_names))
    assert added == {"contextkeeper"}, f"imported {', '.join(sorted(added))}; all modules: {', '.join(tops)}"


def test_a_first_count_leaves_transformers_to_a_child_process(cold: tuple[Path, list[str]]) -> None:
    cache, modules = cold
    assert_light(modules, HF_EXTRA)
    assert list((cache / "tokenizers").glob("qwen2-*.tokenizer.json")), "the tokenizer was not cached"


def test_count(cold: tuple[Path, list[str]], qwen2: str) -> None:
    setup = f"import contextkeeper as ck\nassert ck.load_counter({qwen2!r}).count({MESSAGES!r}) > 0"
    modules = imported(setup, cold[0])
    assert_light(modules, HF_EXTRA)


def test_fit(cold: tuple[Path, list[str]], qwen2: str) -> None:
    setup = (
        "import contextkeeper as ck\n"
        f"keeper = ck.ContextKeeper({qwen2!r}, context_window=4096)\n"
        f"assert keeper.fit({MESSAGES!r}).tokens > 0"
    )
    modules = imported(setup, cold[0])
    assert_light(modules, HF_EXTRA)


def test_building_the_proxy(cold: tuple[Path, list[str]], qwen2: str, tmp_path: Path) -> None:
    from proxy_helpers import write_config

    config = write_config(tmp_path / "proxy.toml", Path(qwen2), 4096, {}, {"upstream": "http://127.0.0.1:9/v1"})
    setup = (
        "from contextkeeper.proxy import Proxy, ProxyServer, load_config\n"
        f"proxy = Proxy.from_config(load_config({str(config)!r}))\n"
        "ProxyServer(proxy, port=0)\n"
        "assert len(proxy.routes) == 2"
    )
    modules = imported(setup, cold[0])
    assert_light(modules, HF_EXTRA)


def test_mistral_count(tmp_path: Path) -> None:
    pytest.importorskip("mistral_common")
    setup = f"import contextkeeper as ck\nassert ck.load_counter('mistral:tekken').count({MESSAGES!r}) > 0"
    modules = imported(setup, tmp_path)
    assert_light(modules, frozenset({"transformers"}))


def test_a_light_tokenizer_counts_as_transformers_does(
    cold: tuple[Path, list[str]], qwen2: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Qwen2's tokenizer class adds NFC to tokenizer.json's pipeline: the cached copy is what transformers built.
    import contextkeeper as ck
    from contextkeeper.tokens.loading import LightTokenizer, load_light_tokenizer

    monkeypatch.setenv("CONTEXTKEEPER_CACHE", str(cold[0]))
    light = load_light_tokenizer(qwen2)
    assert isinstance(light, LightTokenizer)
    reference: Any = hf_tokenizer("qwen2")
    text = "Cafe\u0301 \u212b \ufb01 <|im_start|>x"  # NFC changes the first two
    assert light.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)
    assert light.backend_tokenizer.to_str() == reference.backend_tokenizer.to_str()
    counter = ck.HFChatTemplateCounter(light)
    assert counter.count(MESSAGES) == ck.HFChatTemplateCounter(reference).count(MESSAGES)
    assert counter.count(MESSAGES) == counter.reference_count(MESSAGES)
