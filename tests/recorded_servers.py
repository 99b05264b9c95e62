"""What servers answered, recorded, and the servers that answer it again: the llama-server recordings
(tests/fixtures/llama_server/), detection answers (tests/fixtures/detection/) served by a loopback HTTP server, a
keeper on the recorded Qwen template, and a live llama-server (``-m server``) on a tiny model."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

import assets
import contextkeeper as ck

ROOT = Path(__file__).resolve().parents[1]

FIXTURES = Path(__file__).resolve().parent / "fixtures"
LLAMA = json.loads((FIXTURES / "detection" / "llama-server.json").read_text(encoding="utf-8"))
VLLM = json.loads((FIXTURES / "detection" / "vllm.json").read_text(encoding="utf-8"))
SERVE = json.loads(
    (FIXTURES / "transformers_serve" / "answers" / "transformers-serve.json").read_text(encoding="utf-8")
)
QWEN = json.loads((FIXTURES / "llama_server" / "qwen2.json").read_text(encoding="utf-8"))
RECORDED = {
    path.stem: json.loads(path.read_text(encoding="utf-8"))
    for path in sorted((FIXTURES / "llama_server").glob("*.json"))
}
# The corpus on templates beyond the four pairs the vLLM and SGLang recordings share (Meta's original Llama 3).
RECORDED_MORE = {
    path.stem: json.loads(path.read_text(encoding="utf-8"))
    for path in sorted((FIXTURES / "llama_server_more").glob("*.json"))
}


class Answering(str):
    """The base URL (``.../v1``) of a server answering recorded answers, and the paths it was asked."""

    asked: list[str]


@contextmanager
def answering(answers: Mapping[str, dict[str, Any]]) -> Iterator[Answering]:
    """A loopback HTTP server that answers GETs from ``answers`` (path -> status and JSON), 404 elsewhere."""
    asked: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.path)
            answer = answers.get(self.path, {"status": 404, "json": {"error": "not found"}})
            data = json.dumps(answer["json"]).encode() if "json" in answer else answer["body"].encode()
            self.send_response(answer["status"])
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = Answering(f"http://127.0.0.1:{server.server_address[1]}/v1")
        url.asked = asked
        yield url
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def qwen_keeper(**settings: Any) -> ck.ContextKeeper:
    return ck.ContextKeeper(
        tokenizer=str(assets.tokenizer_dir("qwen2")),
        chat_template=assets.template(QWEN["template"]),
        context_window=4096,
        **settings,
    )


def llama_server_binary() -> Path:
    return ROOT / ".cache" / "llama.cpp" / "build" / "bin" / "llama-server"


def vocab_of(recording: str) -> str:
    """The vocabulary of a llama-server recording (its name up to any ``@``: "llama-bpe@llama3-original")."""
    return recording.partition("@")[0]


def live_llama_server(recording: str, context: int = 16384) -> Any:
    """A llama-server (context manager) on a tiny model around a recording's vocabulary, with its template."""
    if not llama_server_binary().exists():
        pytest.skip("llama-server is not built: bash scripts/build_llama_server.sh")
    sys.path.insert(0, str(ROOT / "scripts"))
    from record_llama_server import LlamaServer, model_path, template_path  # type: ignore[import-not-found]

    return LlamaServer(model_path(recording), template_path(recording), context=context)
