"""vLLM's GPU-less render server (``vllm launch render``) on a loopback port, for the live ``-m server`` tests.

It serves the real preprocessing endpoints (``/v1/models``, ``/version``, ``/tokenize``,
``/v1/chat/completions/render``) for a model folder without an engine. vLLM lives in a separate environment
(``CK_VLLM_PYTHON``, default /work/vllm-venv/bin/python; see docs/dialects.md for how it is made).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def vllm_python() -> Path | None:
    """The Python of the environment that holds vLLM, or None."""
    given = os.environ.get("CK_VLLM_PYTHON", "").strip()
    python = Path(given) if given else Path("/work/vllm-venv/bin/python")
    return python if python.exists() else None


def tiny_model(vocab: str) -> Path:
    """A model folder (config, random weights, tokenizer, chat template) vLLM can load: the one
    scripts/record_transformers_serve.py builds."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from record_transformers_serve import tiny_model as build  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return Path(build(vocab))


class VllmRender:
    """``with VllmRender(folder) as server:`` starts vLLM's render server; ``server.url`` is its root."""

    def __init__(self, python: Path, model: Path) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = int(sock.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = str(model)
        vllm = python.parent / "vllm"
        env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        self.log = (model / "vllm-render.log").open("w")
        self.process = subprocess.Popen(
            [str(vllm), "launch", "render", self.model, "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
        )

    def __enter__(self) -> VllmRender:
        for _ in range(480):  # bounded: 120 s
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm launch render exited with {self.process.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.25)
        self.__exit__()
        raise RuntimeError("vllm launch render did not answer within 120 s")

    def __exit__(self, *exc: object) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)
        self.log.close()

    def answers(self, paths: tuple[str, ...]) -> dict[str, Any]:
        """Each path's status and JSON, as the server answered a GET."""
        out = {}
        for path in paths:
            try:
                with urllib.request.urlopen(self.url + path, timeout=10) as response:
                    status, raw = response.status, response.read()
            except urllib.error.HTTPError as error:
                status, raw = error.code, error.read()
            try:
                out[path] = {"status": status, "json": json.loads(raw or b"{}")}
            except ValueError:
                out[path] = {"status": status, "body": raw.decode("utf-8", "replace")}
        return out
