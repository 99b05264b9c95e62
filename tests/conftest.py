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


@pytest.fixture(scope="session")
def tokenizers_loader() -> Any:
    return hf_tokenizer
