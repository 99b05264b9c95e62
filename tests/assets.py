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


# Templates llama-cpp-python's own Python code holds (llama_cpp/llama_chat_format.py), read from the sdist the
# assets come from: "llama-cpp-python:LLAMA3_INSTRUCT_CHAT_TEMPLATE" is Meta's original Llama 3 template (BOS
# written inside the message loop).
PYTHON_TEMPLATES = "llama-cpp-python:"
_PYTHON_TEMPLATE_CACHE: dict[str, str] = {}


def _python_template(constant: str) -> str:
    if constant not in _PYTHON_TEMPLATE_CACHE:
        import ast
        import tarfile

        sdists = sorted((ASSETS / "downloads").glob("llama_cpp_python-*.tar.gz"))
        if not sdists:
            require_assets()
            raise FileNotFoundError(f"no llama-cpp-python sdist in {ASSETS / 'downloads'}; run `{FETCH_COMMAND}`")
        with tarfile.open(sdists[-1], "r:gz") as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith("/llama_cpp/llama_chat_format.py"))
            source = tar.extractfile(member)
            assert source is not None
            tree = ast.parse(source.read().decode("utf-8"))
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == constant for t in node.targets):
                assert isinstance(node.value, ast.Constant)
                _PYTHON_TEMPLATE_CACHE[constant] = str(node.value.value)
                break
        else:
            raise FileNotFoundError(f"llama_chat_format.py in {sdists[-1].name} has no {constant}")
    return _PYTHON_TEMPLATE_CACHE[constant]


def template_file(name: str, folder: Path) -> Path:
    """A file holding template ``name``: its asset file, or (for a llama-cpp-python one) a copy written in
    ``folder``."""
    if not name.startswith(PYTHON_TEMPLATES):
        return ASSETS / "templates" / (name if name.endswith(".jinja") else f"{name}.jinja")
    path = folder / f"{name.removeprefix(PYTHON_TEMPLATES)}.jinja"
    path.write_text(template(name), encoding="utf-8")
    return path


def template(name: str) -> str:
    """The text of ``templates/<name>.jinja`` (``name`` with or without the ``.jinja`` suffix), or of a template
    llama-cpp-python's code holds (``"llama-cpp-python:<CONSTANT>"``)."""
    if name.startswith(PYTHON_TEMPLATES):
        return _python_template(name.removeprefix(PYTHON_TEMPLATES))
    path = ASSETS / "templates" / (name if name.endswith(".jinja") else f"{name}.jinja")
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        require_assets()
        raise FileNotFoundError(f"no chat template {name!r} in {path.parent}") from None


def tokenizer_dir(vocab: str) -> Path:
    """The Hugging Face tokenizer folder for ``vocab`` (e.g. ``"llama-bpe"``, ``"deepseek-v4"``)."""
    return ASSETS / "tokenizers" / vocab


def bos_adding_tokenizer(vocab: str, dest: Path) -> Path:
    """A copy of ``vocab``'s tokenizer folder in ``dest`` whose post-processor puts the BOS before every text, as
    Meta's Llama 3.1 tokenizer.json does (the folders converted from llama.cpp's GGUF files add none; llama.cpp
    itself adds it at tokenization, from the GGUF's ``add_bos_token``)."""
    source = tokenizer_dir(vocab)
    folder = dest / f"{vocab}-bos"
    folder.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["add_bos_token"] = True
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    data = json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))
    bos = config["bos_token"]
    bos_id = next(t["id"] for t in data["added_tokens"] if t["content"] == bos)
    data["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [
            {"SpecialToken": {"id": bos, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": bos, "type_id": 1}},
            {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
    }
    (folder / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return folder


def gguf_file(vocab: str) -> Path:
    """llama.cpp's vocabulary-only GGUF for ``vocab`` (e.g. ``"qwen2"`` -> ``gguf/ggml-vocab-qwen2.gguf``)."""
    return ASSETS / "gguf" / (vocab if vocab.endswith(".gguf") else f"ggml-vocab-{vocab}.gguf")
