"""Record what a real llama-server counts for the server corpus, into tests/fixtures/llama_server/.

Needs the binary from scripts/build_llama_server.sh and the assets from scripts/fetch_assets.py. For each
vocabulary + chat template pair, a tiny random-weight model is made around llama.cpp's own vocabulary file
(scripts/tiny_gguf.py), llama-server is started on a loopback port with ``--jinja --chat-template-file``, and every
case of tests/server_corpus.py is sent to ``/v1/chat/completions`` (``max_tokens: 1``) and ``/apply-template``.
The server's ``usage.prompt_tokens`` and prompt text are stored beside the case: our own recorded data.

    python scripts/record_llama_server.py [--only qwen2]
    python scripts/record_llama_server.py --more        # the corpus on MORE_PAIRS: tests/fixtures/llama_server_more/
    python scripts/record_llama_server.py --numbers     # number probes on every pair: tests/fixtures/llama_numbers.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "scripts")]

import assets  # noqa: E402
import server_corpus  # noqa: E402
from contextkeeper.servers.http import request_json  # noqa: E402
from tiny_gguf import tiny_model  # noqa: E402

BINARY = ROOT / ".cache" / "llama.cpp" / "build" / "bin" / "llama-server"
MODELS = ROOT / ".cache" / "llama.cpp" / "models"
FIXTURES = ROOT / "tests" / "fixtures" / "llama_server"
ANSWERS = ROOT / "tests" / "fixtures" / "detection" / "llama-server.json"
ENGINE = ROOT / "tests" / "fixtures" / "llama_engine.json"
CONTINUATION = ROOT / "tests" / "fixtures" / "llama_continuation.json"
NUMBERS = ROOT / "tests" / "fixtures" / "llama_numbers.json"
MORE_FIXTURES = ROOT / "tests" / "fixtures" / "llama_server_more"
# What server detection asks (src/contextkeeper/servers/detection.py SIGNS), recorded as the server answered.
ASKED = ("/v1/models", "/props", "/api/version", "/get_server_info", "/version")
# recording -> chat template; a recording is named by its vocabulary (tokenizer folder =
# tests/assets.tokenizer_dir(vocab)), and "<vocab>@<what>" for a second template over the same vocabulary.
PAIRS = {
    "qwen2": "Qwen-Qwen3-0.6B",
    "llama-bpe": "meta-llama-Llama-3.3-70B-Instruct",
    "gemma-4": "google-gemma-4-31B-it",
    "phi-3": "microsoft-Phi-3.5-mini-instruct",
}
# Recorded into tests/fixtures/llama_server_more/ (the vLLM and SGLang recordings follow PAIRS only).
MORE_PAIRS = {
    # Meta's original Llama 3 template: BOS written inside the message loop, on the first message.
    "llama-bpe@llama3-original": assets.PYTHON_TEMPLATES + "LLAMA3_INSTRUCT_CHAT_TEMPLATE",
}
ALL_PAIRS = {**PAIRS, **MORE_PAIRS}


def vocab_of(recording: str) -> str:
    """The vocabulary of a recording (its name up to any ``@``)."""
    return recording.partition("@")[0]


def template_path(recording: str) -> Path:
    """The file of a recording's chat template."""
    MODELS.mkdir(parents=True, exist_ok=True)
    return assets.template_file(ALL_PAIRS[recording], MODELS)


def model_path(recording: str) -> Path:
    """The tiny model around a recording's vocabulary, made on first use."""
    vocab = vocab_of(recording)
    model = MODELS / f"{vocab}.gguf"
    if not model.exists():
        MODELS.mkdir(parents=True, exist_ok=True)
        tiny_model(assets.gguf_file(vocab), model)
    return model


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    status, answer = request_json(url, body, timeout=60, purpose="recording")
    return status, answer if isinstance(answer, dict) else {}


class LlamaServer:
    """A llama-server process on a loopback port, stopped on exit."""

    def __init__(self, model: Path, template: Path, *, context: int = 16384) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = (MODELS / f"{model.stem}.server.log").open("w")
        self.process = subprocess.Popen(
            [
                str(BINARY),
                "-m",
                str(model),
                "--jinja",
                "--chat-template-file",
                str(template),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "-c",
                str(context),
                "-np",
                "1",
                "-t",
                "2",
                "--no-webui",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def __enter__(self) -> LlamaServer:
        for _ in range(240):  # bounded: 60 s
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.process.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.25)
        raise RuntimeError("llama-server did not become healthy within 60 s")

    def __exit__(self, *exc: object) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()

    def record(self, case: dict[str, Any]) -> dict[str, Any]:
        body: dict[str, Any] = {"messages": case["messages"], "max_tokens": 1, "temperature": 0}
        if case["tools"]:
            body["tools"] = case["tools"]
        status, reply = _post(f"{self.url}/v1/chat/completions", body)
        out = dict(case)
        if status == 200:
            out["prompt_tokens"] = reply["usage"]["prompt_tokens"]
        else:
            out["prompt_tokens"] = None
            out["error"] = {"status": status, "message": str(reply.get("error", {}).get("message", reply))[:300]}
        status, applied = _post(f"{self.url}/apply-template", {k: v for k, v in body.items() if k != "max_tokens"})
        out["prompt"] = applied.get("prompt") if status == 200 else None
        return out

    def answers(self) -> dict[str, Any]:
        """Every endpoint server detection asks, with the status and JSON the server answered."""
        out = {}
        for path in ASKED:
            status, answer = request_json(self.url + path, None, timeout=10, purpose="recording")
            out[path] = {"status": status, "json": answer}
        return out


def version() -> str:
    done = subprocess.run([str(BINARY), "--version"], capture_output=True, text=True, check=False)
    return next((line for line in (done.stdout + done.stderr).splitlines() if line.startswith("version")), "?")


def record_engine() -> None:
    """The server's render of every engine probe (server_corpus.ENGINE_TEMPLATE), with the qwen2 vocabulary."""
    model = MODELS / "qwen2.gguf"
    if not model.exists():
        tiny_model(assets.gguf_file("qwen2"), model)
    template = MODELS / "engine.jinja"
    template.write_text(server_corpus.ENGINE_TEMPLATE, encoding="utf-8")
    recorded = []
    with LlamaServer(model, template, context=2048) as server:
        for case in server_corpus.engine_cases():
            status, applied = _post(f"{server.url}/apply-template", {"messages": case["messages"]})
            recorded.append({**case, "prompt": applied.get("prompt") if status == 200 else None})
    fixture = {
        "server": f"llama-server {version()}",
        "recorded": dt.date.today().isoformat(),
        "vocab": "qwen2",
        "cases": recorded,
    }
    ENGINE.write_text(json.dumps(fixture, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"{ENGINE.relative_to(ROOT)}: {len(recorded)} cases")


def _write(path: Path, fixture: dict[str, Any], what: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(fixture, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"{path.relative_to(ROOT)}: {what}")


def _stamp() -> dict[str, Any]:
    return {"server": f"llama-server {version()}", "recorded": dt.date.today().isoformat()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(ALL_PAIRS), action="append")
    parser.add_argument("--answers", action="store_true", help="record only what detection asks (first pair)")
    parser.add_argument("--engine", action="store_true", help="record only the engine probes (our own template)")
    parser.add_argument("--continuation", action="store_true", help="record only the reasoning continuations")
    parser.add_argument("--numbers", action="store_true", help="record only the number probes, on every pair")
    parser.add_argument("--more", action="store_true", help="record the corpus on the pairs beyond the main four")
    args = parser.parse_args()
    if not BINARY.exists():
        sys.exit(f"{BINARY} is missing: run `bash scripts/build_llama_server.sh` first")
    MODELS.mkdir(parents=True, exist_ok=True)
    if args.engine:
        record_engine()
        return
    chosen = args.only or (ALL_PAIRS if args.numbers else MORE_PAIRS if args.more else PAIRS)
    by_pair: dict[str, Any] = {}
    for recording in chosen:
        with LlamaServer(model_path(recording), template_path(recording)) as server:
            if args.answers:
                _write(ANSWERS, {**_stamp(), "answers": server.answers()}, f"{len(ASKED)} endpoints")
                return
            probes = (
                server_corpus.continuation_cases()
                if args.continuation
                else server_corpus.number_cases()
                if args.numbers
                else server_corpus.cases()
            )
            recorded = [server.record(case) for case in probes]
        if args.continuation or args.numbers:
            by_pair[recording] = {"template": ALL_PAIRS[recording], "cases": recorded}
            continue
        fixture = {
            **_stamp(),
            "source": "llama-cpp-python 0.3.36 sdist, vendor/llama.cpp",
            "vocab": vocab_of(recording),
            "template": ALL_PAIRS[recording],
            "cases": recorded,
        }
        folder = FIXTURES if recording in PAIRS else MORE_FIXTURES
        refused = sum(case["prompt_tokens"] is None for case in recorded)
        _write(folder / f"{recording}.json", fixture, f"{len(recorded)} cases, {refused} refused")
    if by_pair:
        path = CONTINUATION if args.continuation else NUMBERS
        _write(path, {**_stamp(), "pairs": by_pair}, f"{sum(len(p['cases']) for p in by_pair.values())} cases")


if __name__ == "__main__":
    main()
