"""Where the real test assets are, as fetched by ``python scripts/fetch_assets.py``.

Standard library only: importing this costs nothing. The layout under ``ASSETS``::

    templates/<name>.jinja           chat templates vendored by llama.cpp (llama-cpp-python sdist)
    gguf/ggml-vocab-<vocab>.gguf     llama.cpp's vocabulary-only GGUF files
    tokenizers/<vocab>/              Hugging Face tokenizer folders (AutoTokenizer.from_pretrained)
    manifest.json                    versions, hashes, templates, tokenizer folders (bos/eos, sizes)

GGUF vocabularies: llama-bpe, qwen2, qwen35, phi-3, gemma-4, llama-spm, deepseek-llm; tokenizer folders:
those, plus deepseek-v4 and harmony-on-qwen2 (qwen2 + the harmony special tokens, a stand-in).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
FETCH_COMMAND = "python scripts/fetch_assets.py"


def _default_assets() -> Path:
    # Same rule as scripts/fetch_assets.py.
    env = os.environ.get("CONTEXTKEEPER_ASSETS", "").strip()
    return Path(env).expanduser().resolve() if env else REPO_ROOT / ".cache" / "assets"


ASSETS: Path = _default_assets()
MANIFEST: Path = ASSETS / "manifest.json"


def manifest() -> dict[str, Any]:
    """The parsed manifest; RuntimeError (with the command to run) if it is missing."""
    require_assets()
    data: dict[str, Any] = json.loads(MANIFEST.read_text(encoding="utf-8"))
    return data


def require_assets() -> None:
    """Raise RuntimeError naming the command to run unless the assets have been fetched completely."""
    try:
        data = json.loads(MANIFEST.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RuntimeError(
            f"test assets are missing ({MANIFEST} not found); run `{FETCH_COMMAND}` from the repository root"
        ) from None
    except (OSError, ValueError) as exc:
        raise RuntimeError(f"cannot read {MANIFEST} ({exc}); run `{FETCH_COMMAND}`") from None
    if not isinstance(data, dict) or not data.get("complete"):
        problems = data.get("problems") if isinstance(data, dict) else None
        detail = f": {'; '.join(problems)}" if problems else ""
        raise RuntimeError(f"test assets in {ASSETS} are incomplete{detail}; run `{FETCH_COMMAND}`")


def template(name: str) -> str:
    """The text of ``templates/<name>.jinja`` (``name`` with or without the ``.jinja`` suffix)."""
    path = ASSETS / "templates" / (name if name.endswith(".jinja") else f"{name}.jinja")
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        require_assets()
        raise FileNotFoundError(f"no chat template {name!r} in {path.parent}") from None


def tokenizer_dir(vocab: str) -> Path:
    """The Hugging Face tokenizer folder for ``vocab`` (e.g. ``"llama-bpe"``, ``"deepseek-v4"``)."""
    return ASSETS / "tokenizers" / vocab


def gguf_file(vocab: str) -> Path:
    """llama.cpp's vocabulary-only GGUF for ``vocab`` (e.g. ``"qwen2"`` -> ``gguf/ggml-vocab-qwen2.gguf``)."""
    return ASSETS / "gguf" / (vocab if vocab.endswith(".gguf") else f"ggml-vocab-{vocab}.gguf")
