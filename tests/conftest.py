"""Shared fixtures: real tokenizers and chat templates fetched by scripts/fetch_assets.py."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from assets import require_assets, tokenizer_dir


@functools.cache
def hf_tokenizer(vocab: str) -> Any:
    """A Hugging Face tokenizer from the fetched assets (loaded once per test session)."""
    require_assets()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir(vocab))


@functools.cache
def raw_backend(vocab: str) -> Any:
    """The vocabulary's own tokenizer.json as the tokenizers library loads it (transformers may add a
    normaliser: Qwen's gets NFC)."""
    require_assets()
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_dir(vocab) / "tokenizer.json"))


@functools.cache
def verified_pieces(vocab: str) -> Any:
    """One verified piece counter per vocabulary (``name-raw``: its own tokenizer.json), kept warm across
    examples: its caches are part of what is tested."""
    from contextkeeper.tokens.pieces import PieceCounter

    backend = (
        raw_backend(vocab.removesuffix("-raw")) if vocab.endswith("-raw") else hf_tokenizer(vocab).backend_tokenizer
    )
    pieces = PieceCounter(backend)
    assert pieces.verify()
    return pieces


@functools.cache
def _built_pieces(vocab: str) -> Any:
    from contextkeeper.tokens.pieces import PieceCounter

    return PieceCounter(hf_tokenizer(vocab).backend_tokenizer)


def fresh_pieces(vocab: str) -> Any:
    """An unverified piece counter with resume state of its own, sharing the piece caches of one counter built per
    vocabulary (building one for Gemma's 262K tokens takes ~0.4 s, which per example was most of these runs)."""
    return _built_pieces(vocab).fork()


def assert_counts_like_the_tokenizer(
    pieces: Any, rule: Any, texts: list[str], specials: list[str] | None = None
) -> None:
    """Each text counts as the tokenizer encodes it, by ``rule`` where it takes the text and alone; and the texts
    joined by added tokens (``specials``, default: the tokenizer's first three) count alike as one prompt and as
    two segments."""
    for text in texts:
        whole = pieces.full(text)
        if rule.takes(text):
            assert rule.count([text], pieces._tokenizer) == [whole]
        assert pieces.alone(text) == whole
    # Inside a prompt: pieces between added tokens, counted after one.
    specials = specials or [t.content for t in pieces._tokenizer.added[:3]]
    prompt = "".join(f"{specials[i % len(specials)]}{text}" for i, text in enumerate(texts))
    assert pieces.count(prompt) == pieces.full(prompt)
    half = len(prompt) // 2
    assert pieces.count_segments([prompt[:half], prompt[half:]]) == pieces.full(prompt)


def assert_switched_off(pieces: Any, name: str, left: set[str]) -> None:
    """The rule ``name``, which the settings allow, was disproved by the tokenizer, said so, and only ``left``
    stayed on."""
    assert name in pieces.rules.on  # the settings allow it: only the tokenizer can say it is false
    assert pieces.verify()
    why = pieces.rules.why_off(name)
    assert why is not None
    assert "disagreed with the tokenizer" in why
    assert set(pieces.rules.on) == left


@pytest.fixture(scope="session")
def tokenizers_loader() -> Any:
    return hf_tokenizer
