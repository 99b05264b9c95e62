"""Tokenizer loading: folders (template in the config, in chat_template.jinja, or overridden), GGUF files
(converted once, then cached), hub ids, and mistral:<name>."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import contextkeeper as ck
from assets import gguf_file, template, tokenizer_dir
from conversations import TOOLS, tool_round


def _folder_without_template(tmp_path: Path, vocab: str) -> Path:
    target = tmp_path / vocab
    shutil.copytree(tokenizer_dir(vocab), target)
    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    (target / "chat_template.jinja").unlink(missing_ok=True)
    return target


def test_folder_with_template_in_tokenizer_config(tmp_path: Path) -> None:
    folder = _folder_without_template(tmp_path, "qwen2")
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template("Qwen-Qwen2.5-7B-Instruct")
    config_path.write_text(json.dumps(config))
    counter = ck.load_counter(str(folder))
    explicit = ck.load_counter(str(tokenizer_dir("qwen2")), chat_template=template("Qwen-Qwen2.5-7B-Instruct"))
    assert counter.count(tool_round(), tools=TOOLS) == explicit.count(tool_round(), tools=TOOLS)


def test_folder_with_chat_template_jinja(tmp_path: Path) -> None:
    folder = _folder_without_template(tmp_path, "llama-bpe")
    (folder / "chat_template.jinja").write_text(template("meta-llama-Llama-3.3-70B-Instruct"))
    counter = ck.load_counter(str(folder))
    assert isinstance(counter, ck.HFChatTemplateCounter)
    assert "<|start_header_id|>" in counter.render(tool_round())


def test_explicit_template_overrides_the_folders(tmp_path: Path) -> None:
    folder = _folder_without_template(tmp_path, "qwen2")
    (folder / "chat_template.jinja").write_text(template("Qwen-Qwen2.5-7B-Instruct"))
    counter = ck.load_counter(str(folder), chat_template="{% for m in messages %}[{{ m.role }}]{% endfor %}")
    assert counter.render(tool_round()) == "[system][user][assistant][tool][assistant][user]"


def test_folder_without_any_template_is_a_clear_error(tmp_path: Path) -> None:
    folder = _folder_without_template(tmp_path, "qwen2")
    with pytest.raises(ck.ChatTemplateError, match="has no chat template"):
        ck.load_counter(str(folder))


def test_folder_without_tokenizer_files(tmp_path: Path) -> None:
    with pytest.raises(ck.TokenizerNotFound, match=r"tokenizer\.json"):
        ck.load_counter(str(tmp_path))


def test_gguf_file_is_converted_once_then_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONTEXTKEEPER_CACHE", str(tmp_path / "cache"))
    source = template("microsoft-Phi-3.5-mini-instruct")
    started = time.perf_counter()
    first = ck.load_counter(str(gguf_file("phi-3")), chat_template=source)
    converted_s = time.perf_counter() - started
    cached = list((tmp_path / "cache" / "gguf").iterdir())
    assert len(cached) == 1
    assert (cached[0] / "tokenizer.json").is_file()
    started = time.perf_counter()
    second = ck.load_counter(str(gguf_file("phi-3")), chat_template=source)
    assert time.perf_counter() - started < converted_s
    reference = ck.load_counter(str(tokenizer_dir("phi-3")), chat_template=source)
    assert first.count(tool_round()) == second.count(tool_round()) == reference.count(tool_round())


def test_gguf_whose_model_config_fails_still_loads_its_vocabulary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Gemma 4's GGUF makes AutoTokenizer fail while building the model config (after ~45 s); inject that
    # failure on a small GGUF so the generic vocabulary-only path runs for real.
    import transformers

    def refuse(*args: object, **kwargs: object) -> None:
        raise TypeError("num_key_value_heads: expected int, got list")

    monkeypatch.setenv("CONTEXTKEEPER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    counter = ck.load_counter(str(gguf_file("phi-3")), chat_template=template("microsoft-Phi-3.5-mini-instruct"))
    monkeypatch.undo()
    reference = ck.load_counter(str(tokenizer_dir("phi-3")), chat_template=template("microsoft-Phi-3.5-mini-instruct"))
    assert counter.count(tool_round()) == reference.count(tool_round())


def test_missing_gguf_file() -> None:
    with pytest.raises(ck.TokenizerNotFound, match="does not exist"):
        ck.load_counter("/nonexistent/model.gguf")


def test_unreachable_hub_id_says_what_to_do(tmp_path: Path) -> None:
    # The hub's offline switch is read when huggingface_hub is imported, so check in a fresh interpreter.
    script = (
        "import contextkeeper as ck\n"
        "try:\n"
        "    ck.load_counter('some-org/some-model-that-is-not-cached')\n"
        "except ck.TokenizerNotFound as exc:\n"
        "    print(exc)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    assert "neither cached nor reachable" in done.stdout, done.stdout + done.stderr


def test_mistral_spec_rejects_a_chat_template() -> None:
    with pytest.raises(ck.TokenizerNotFound, match="mistral-common"):
        ck.load_counter("mistral:tekken", chat_template="{{ messages }}")
