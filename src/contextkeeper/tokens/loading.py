"""Turn a tokenizer spec into a counter: a folder, a ``.gguf`` file, a hub id, or ``mistral:<name>``.

Counting needs a tokenizer's ``tokenizers`` backend, chat template and special tokens, not transformers: importing
``AutoTokenizer`` imports torch (seconds and hundreds of MB held for the life of a server). So transformers loads a
tokenizer once, in a child process, and what it built (the backend as it left it, the template, the special
tokens) is kept under :func:`cache_dir`, keyed by the folder's files and the library versions; every later load
reads that with the ``tokenizers`` library alone. What transformers builds is kept rather than rebuilt from
tokenizer.json because its tokenizer classes may change the pipeline (Qwen2's adds NFC and its own pre-token
pattern), and counts must equal transformers' exactly.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import weakref
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

__all__ = ["LightTokenizer", "cache_dir", "load_counter", "load_hf_tokenizer", "load_light_tokenizer"]

logger = logging.getLogger("contextkeeper")

_FORMAT = 1  # of a resolved entry: bump when what it records changes
# Files of a model folder that no tokenizer reads (weights), left out of its key; any other file over
# _HASHED_BYTES is keyed by its size and time rather than read whole.
_WEIGHTS = frozenset({".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx", ".ckpt", ".npz"})
_HASHED_BYTES = 256 << 20
_INSTALL = "pip install 'contextkeeper[hf]'"


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


def _gguf_folder(path: Path) -> Path:
    """Where ``path``'s vocabulary is kept as a Hugging Face tokenizer folder once converted."""
    return cache_dir() / "gguf" / f"{path.stem}-{_gguf_key(path)}"


def _load_gguf(path: Path) -> Any:
    from transformers import AutoTokenizer

    target = _gguf_folder(path)
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


def _source(spec: str) -> Path | str:
    """``spec`` as a tokenizer folder or ``.gguf`` file (checked), or else as a hub id."""
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise TokenizerNotFound(f"GGUF file {spec!r} does not exist. Check the path.")
        return path
    if path.is_dir():
        if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
            raise TokenizerNotFound(
                f"folder {spec!r} holds no tokenizer (expected tokenizer.json, or tokenizer.model / vocab.json). "
                "Point --tokenizer at the model folder that contains them."
            )
        return path
    if path.exists():
        raise TokenizerNotFound(
            f"{spec!r} is a file but not a .gguf; pass its folder (with tokenizer.json and tokenizer_config.json)."
        )
    return spec


def load_hf_tokenizer(spec: str) -> Any:
    """Load a Hugging Face tokenizer from a folder, a ``.gguf`` file or a hub id (cached or reachable) with
    transformers (which imports torch); :func:`load_counter` reads a light copy instead."""
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise TokenizerNotFound(f"loading {spec!r} needs transformers: {_INSTALL}") from exc
    source = _source(spec)
    if isinstance(source, Path):
        return _load_gguf(source) if source.suffix == ".gguf" else AutoTokenizer.from_pretrained(source)
    try:
        return AutoTokenizer.from_pretrained(spec)
    except (OSError, ValueError) as exc:
        raise TokenizerNotFound(
            f"could not load tokenizer {spec!r}: it is not a local folder or .gguf file, and the hub id is neither "
            f"cached nor reachable ({type(exc).__name__}). Download the tokenizer files into a folder and pass "
            "that folder, or use mistral:<name> for a tokenizer mistral-common ships."
        ) from exc


# ------------------------------------------------------------------------------------------ the light tokenizer


class LightTokenizer:
    """What a counter reads of a Hugging Face tokenizer, as transformers built it, loaded with the ``tokenizers``
    library alone: the backend (``backend_tokenizer``), ``chat_template``, ``special_tokens_map`` and the BOS and
    EOS tokens. ``apply_chat_template`` is transformers' own (for references and audits: it loads transformers)."""

    def __init__(self, name: str, backend: Any, meta: Mapping[str, Any]) -> None:
        self.name_or_path = name
        self._tokenizer = backend
        self.chat_template: str | dict[str, str] | None = meta["chat_template"]
        self.special_tokens_map: dict[str, Any] = dict(meta["special_tokens_map"])
        self.bos_token: str | None = meta["bos_token"]
        self.bos_token_id: int | None = meta["bos_token_id"]
        self.eos_token: str | None = meta["eos_token"]
        self.eos_token_id: int | None = meta["eos_token_id"]
        self._plain: tuple[Any, Any] | None = None
        self._reference: tuple[Any, Any] | None = None

    def __repr__(self) -> str:
        return f"LightTokenizer({self.name_or_path!r}, vocabulary={self._tokenizer.get_vocab_size()})"

    @property
    def backend_tokenizer(self) -> Any:
        """The ``tokenizers.Tokenizer`` (transformers' name for it)."""
        return self._tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, as transformers' ``encode`` makes them (no padding, no truncation)."""
        backend = self._tokenizer
        if backend.padding is not None or backend.truncation is not None:
            # transformers switches both off for an encode; a private copy does, leaving the caller's alone.
            if self._plain is None or self._plain[0] is not backend:
                plain = copy.deepcopy(backend)
                plain.no_padding()
                plain.no_truncation()
                self._plain = (backend, plain)
            backend = self._plain[1]
        return list(backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        """transformers' ``apply_chat_template`` with this tokenizer's backend (loads transformers once)."""
        if self._reference is None or self._reference[0] is not self._tokenizer:
            reference = copy.copy(load_hf_tokenizer(self.name_or_path))
            reference._tokenizer = self._tokenizer  # a counter may have changed it (see hf._without_unicode_forms)
            self._reference = (self._tokenizer, reference)
        return self._reference[1].apply_chat_template(*args, **kwargs)


@functools.cache
def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"transformers {version('transformers')}, tokenizers {version('tokenizers')}"
    except PackageNotFoundError as exc:
        raise TokenizerNotFound(f"loading Hugging Face tokenizers needs transformers: {_INSTALL}") from exc


def _folder_key(folder: Path) -> str:
    """A digest of what transformers reads from ``folder`` (every file but weights) and of the versions."""
    digest = hashlib.sha256(f"{_FORMAT} {_versions()}".encode())
    extra = folder / "additional_chat_templates"
    files = [*folder.iterdir(), *(extra.iterdir() if extra.is_dir() else ())]
    for file in sorted(f for f in files if f.suffix not in _WEIGHTS and f.is_file()):
        stat = file.stat()
        digest.update(f"\0{file.relative_to(folder).as_posix()}\0{stat.st_size}\0".encode())
        if stat.st_size > _HASHED_BYTES:
            digest.update(str(stat.st_mtime_ns).encode())
            continue
        with file.open("rb") as handle:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()[:24]


def _entry(folder: Path) -> Path:
    """Where ``folder``'s resolved tokenizer is kept: ``<entry>.json`` (the rest) beside ``<entry>.tokenizer.json``
    (the backend)."""
    return cache_dir() / "tokenizers" / f"{folder.resolve().name}-{_folder_key(folder)}.json"


def _backend_file(entry: Path) -> Path:
    return entry.with_suffix(".tokenizer.json")


def _survives_json(value: Any) -> bool:
    try:
        return bool(json.loads(json.dumps(value)) == value)
    except (TypeError, ValueError):
        return False


def _write_entry(entry: Path, tokenizer: Any) -> None:
    """Record at ``entry`` what a counter reads of ``tokenizer``, or that a light copy could count differently (a
    tokenizer without a ``tokenizers`` backend, or values that JSON or the backend's serialisation would change)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    meta: dict[str, Any] = {
        "format": _FORMAT,
        "class": type(tokenizer).__name__,
        "chat_template": getattr(tokenizer, "chat_template", None),
        "special_tokens_map": dict(getattr(tokenizer, "special_tokens_map", {})),
        **{name: getattr(tokenizer, name, None) for name in ("bos_token", "bos_token_id", "eos_token", "eos_token_id")},
        "encode_special_tokens": bool(getattr(backend, "encode_special_tokens", False)),  # not in to_str()
    }
    text = backend.to_str() if backend is not None and _survives_json(meta) else None
    if text is not None:
        from tokenizers import Tokenizer

        text = text if Tokenizer.from_str(text).to_str() == text else None
    entry.parent.mkdir(parents=True, exist_ok=True)
    if text is None:
        _replace(entry, json.dumps({"format": _FORMAT, "class": meta["class"], "light": False}))
        return
    _replace(_backend_file(entry), text)
    _replace(entry, json.dumps(meta))  # last: its presence says the entry is whole


def _replace(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all (another process may be reading or writing the same entry)."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    partial.write_text(text, encoding="utf-8")
    partial.replace(path)


def _resolve(spec: str, scratch: Path) -> Path:
    """Load ``spec`` with transformers and record it; returns the entry: in the cache, keyed by the folder's files,
    or under ``scratch`` for a hub id (whose files may change on the hub) or where the cache cannot be written."""
    source = _source(spec)
    tokenizer = load_hf_tokenizer(spec)
    if isinstance(source, Path):
        entry = _entry(_gguf_folder(source) if source.suffix == ".gguf" else source)
        try:
            _write_entry(entry, tokenizer)
            return entry
        except OSError as exc:
            logger.info("contextkeeper: cannot cache %s in %s (%s); loading it anew next time", spec, entry, exc)
    entry = scratch / "entry.json"
    _write_entry(entry, tokenizer)
    return entry


def _resolve_main(argv: list[str]) -> int:
    """The child process: resolve ``argv[0]`` (scratch folder ``argv[1]``); the last line of stdout says where
    the entry is, or the TokenizerNotFound to raise."""
    try:
        entry = _resolve(argv[0], Path(argv[1]))
    except TokenizerNotFound as exc:
        print(json.dumps({"error": str(exc), "fix": exc.fix}))
        return 0
    print(json.dumps({"entry": str(entry)}))
    return 0


_CHILD = (
    "import sys\n"
    "if sys.argv[1] not in sys.path:\n"
    "    sys.path.insert(0, sys.argv[1])\n"
    "from contextkeeper.tokens.loading import _resolve_main\n"
    "sys.exit(_resolve_main(sys.argv[2:]))\n"
)


def _child(spec: str, scratch: Path) -> dict[str, Any]:
    """What the child process resolving ``spec`` answered; ``{"failed": why}`` where it answered nothing."""
    root = str(Path(__file__).resolve().parents[2])  # where this contextkeeper is imported from
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, root, spec, str(scratch)],
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except OSError as exc:
        return {"failed": f"{type(exc).__name__}: {exc}"}
    lines = done.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else None
    except ValueError:
        answer = None
    if isinstance(answer, dict) and ("entry" in answer or "error" in answer):
        return answer
    return {"failed": f"exit status {done.returncode}: {done.stderr.strip()[-500:]}"}


def _resolve_apart(spec: str, scratch: Path) -> Path:
    """:func:`_resolve` in a child process, so that this one never imports transformers and torch; in this
    process where they are imported already, or where the child fails (it then fails here the same way)."""
    if "transformers.models.auto.tokenization_auto" in sys.modules or not sys.executable:
        return _resolve(spec, scratch)
    answer = _child(spec, scratch)
    if "error" in answer:
        error = TokenizerNotFound(answer["error"])
        error.fix = answer.get("fix")
        raise error
    if "entry" not in answer:
        logger.info("contextkeeper: %s: the child process failed (%s); loading here", spec, answer.get("failed"))
        return _resolve(spec, scratch)
    return Path(answer["entry"])


def _read(entry: Path, spec: str) -> LightTokenizer | bool | None:
    """The light tokenizer recorded at ``entry``; False where none would count exactly; None where there is no such
    entry, or none this version reads (then ``spec`` is resolved again)."""
    try:
        meta = json.loads(entry.read_text(encoding="utf-8"))
        if meta.get("format") != _FORMAT:
            return None
        if meta.get("light") is False:
            return False
        from tokenizers import Tokenizer

        backend = Tokenizer.from_file(str(_backend_file(entry)))
        backend.encode_special_tokens = meta["encode_special_tokens"]
        return LightTokenizer(spec, backend, meta)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # missing, half-written, another layout
        return None
    except Exception:  # tokenizers' own error for a file it cannot read: resolve again
        logger.info("contextkeeper: cannot read %s; loading %s again", entry, spec, exc_info=True)
        return None


def _cached_entry(spec: str) -> Path | None:
    """The cache entry ``spec`` has, where that is known without loading it (not for a hub id, nor for a GGUF file
    not converted yet)."""
    source = _source(spec)
    if isinstance(source, str):
        return None
    if source.suffix == ".gguf":
        source = _gguf_folder(source)
        if not (source / "tokenizer.json").is_file():
            return None
    return _entry(source)


def _resolved(spec: str) -> LightTokenizer | bool | None:
    """:func:`_resolve_apart`, then read what it recorded."""
    try:
        scratch = Path(tempfile.mkdtemp(prefix="contextkeeper-"))
    except OSError:
        return None
    try:
        entry = _resolve_apart(spec, scratch)
        return _read(entry, spec) if scratch in entry.parents else _read_shared(entry, spec)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# Light tokenizers by entry while in use: counters of one tokenizer (a proxy's entries for one model) share its
# backend, some 80 MB for a 150K vocabulary, as a counter's forks do.
_LOADED: weakref.WeakValueDictionary[Path, LightTokenizer] = weakref.WeakValueDictionary()
_LOADED_LOCK = threading.Lock()


def _read_shared(entry: Path, spec: str) -> LightTokenizer | bool | None:
    with _LOADED_LOCK:
        found = _LOADED.get(entry)
    if found is None:
        read = _read(entry, spec)
        if not isinstance(read, LightTokenizer):
            return read
        with _LOADED_LOCK:
            found = _LOADED.setdefault(entry, read)
    return found


def load_light_tokenizer(spec: str) -> Any:
    """A :class:`LightTokenizer` for ``spec`` (a folder, ``.gguf`` file or hub id): read from the cache, or loaded
    once with transformers in a child process and cached; the transformers tokenizer itself (loaded here) where
    a light copy would not count the same."""
    entry = _cached_entry(spec)
    found = _read_shared(entry, spec) if entry is not None else None
    if found is None:
        if entry is not None:
            logger.info("contextkeeper: reading %s with transformers once (cached in %s)", spec, entry.parent)
        found = _resolved(spec)
    return found if isinstance(found, LightTokenizer) else load_hf_tokenizer(spec)


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
    renders (see :class:`TemplateLimits`; mistral-common encoders run no template and take none). A Hugging Face
    tokenizer is read light (see :func:`load_light_tokenizer`): counting does not import transformers' tokenizers
    or torch.
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
    tokenizer = load_light_tokenizer(spec)
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
