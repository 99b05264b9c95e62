"""Turn a tokenizer spec into a counter: a folder, a ``.gguf`` file, a hub id, or ``mistral:<name>``."""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .._exceptions import ConfigurationError, TokenizerNotFound
from ..servers.dialects import Dialect, dialect_of
from ._sandbox import TemplateLimits
from .hf import ContentFormat, HFChatTemplateCounter, View
from .media import MediaCost
from .mistral import MistralCounter

# Servers whose Mistral mode encodes with mistral-common, as MistralCounter does.
MISTRAL_DIALECTS = frozenset({"vllm", "sglang", "openai"})

__all__ = ["cache_dir", "load_counter", "load_hf_tokenizer"]

logger = logging.getLogger("contextkeeper")


def cache_dir() -> Path:
    """Where converted tokenizers are kept (``CONTEXTKEEPER_CACHE`` or ``~/.cache/contextkeeper``)."""
    explicit = os.environ.get("CONTEXTKEEPER_CACHE")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "contextkeeper"


def _gguf_key(path: Path) -> str:
    # Model GGUFs run to many GB: key on size plus the first and last MiB rather than hashing it all.
    digest = hashlib.sha256()
    size = path.stat().st_size
    digest.update(str(size).encode())
    with path.open("rb") as handle:
        digest.update(handle.read(1 << 20))
        if size > 2 << 20:
            handle.seek(-(1 << 20), os.SEEK_END)
            digest.update(handle.read())
    return digest.hexdigest()[:24]


def _load_gguf(path: Path) -> Any:
    from transformers import AutoTokenizer

    target = cache_dir() / "gguf" / f"{path.stem}-{_gguf_key(path)}"
    if (target / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(target)
    logger.info("contextkeeper: converting %s to a Hugging Face tokenizer once (cached in %s)", path, target)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as exc:  # any failure of the model-specific path gets the generic retry
        # AutoTokenizer also builds the model's config from the GGUF, which fails for some architectures
        # (Gemma 4's per-layer KV-head lists in transformers 5.x) although the vocabulary itself is fine.
        from transformers import TokenizersBackend

        logger.info("contextkeeper: %s: AutoTokenizer failed (%s); loading the vocabulary alone", path, exc)
        tokenizer = TokenizersBackend.from_pretrained(path.parent, gguf_file=path.name)
    partial = target.with_name(target.name + ".partial")
    tokenizer.save_pretrained(partial)
    partial.replace(target)
    return tokenizer


def load_hf_tokenizer(spec: str) -> Any:
    """Load a Hugging Face tokenizer from a folder, a ``.gguf`` file or a hub id (cached or reachable)."""
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise TokenizerNotFound(f"loading {spec!r} needs transformers: pip install 'contextkeeper[hf]'") from exc
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise TokenizerNotFound(f"GGUF file {spec!r} does not exist. Check the path.")
        return _load_gguf(path)
    if path.is_dir():
        if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
            raise TokenizerNotFound(
                f"folder {spec!r} holds no tokenizer (expected tokenizer.json, or tokenizer.model / vocab.json). "
                "Point --tokenizer at the model folder that contains them."
            )
        return AutoTokenizer.from_pretrained(path)
    if path.exists():
        raise TokenizerNotFound(
            f"{spec!r} is a file but not a .gguf; pass its folder (with tokenizer.json and tokenizer_config.json)."
        )
    try:
        return AutoTokenizer.from_pretrained(spec)
    except (OSError, ValueError) as exc:
        raise TokenizerNotFound(
            f"could not load tokenizer {spec!r}: it is not a local folder or .gguf file, and the hub id is neither "
            f"cached nor reachable ({type(exc).__name__}). Download the tokenizer files into a folder and pass "
            "that folder, or use mistral:<name> for a tokenizer mistral-common ships."
        ) from exc


def load_counter(
    spec: str,
    *,
    chat_template: str | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    view: View = "server",
    content_format: ContentFormat = "auto",
    media_cost: MediaCost | None = None,
    template_limits: TemplateLimits | None = None,
    server: str | Dialect | None = None,
) -> HFChatTemplateCounter | MistralCounter:
    """A counter for ``spec``: ``mistral:<name>``, a tokenizer folder, a ``.gguf`` file, or a hub id.

    ``chat_template`` (Jinja source) overrides the tokenizer's own template; ``template_limits`` bounds its
    renders (see :class:`TemplateLimits`; mistral-common encoders run no template and take none).
    """
    if spec.startswith("mistral:"):
        if chat_template is not None:
            raise TokenizerNotFound(
                "mistral:<name> tokenizers encode with mistral-common's own chat encoder and take no chat_template; "
                "drop chat_template, or load the model's Hugging Face tokenizer folder instead."
            )
        if dialect_of(server).name not in MISTRAL_DIALECTS:
            raise ConfigurationError(
                f"mistral:<name> tokenizers count what mistral-common encodes (vLLM's and SGLang's Mistral mode); "
                f"server={server!r} prepares prompts with a chat template. Fix: drop server=, or load the model's "
                "Hugging Face tokenizer folder or GGUF file with server=..."
            )
        return MistralCounter(spec.removeprefix("mistral:"), media_cost=media_cost)
    tokenizer = load_hf_tokenizer(spec)
    return HFChatTemplateCounter(
        tokenizer,
        chat_template=chat_template,
        template_kwargs=template_kwargs,
        view=view,
        content_format=content_format,
        media_cost=media_cost,
        name=spec,
        template_limits=template_limits,
        server=server,
    )
