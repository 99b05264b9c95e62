"""Record what a real llama-server counts for the server corpus, into tests/fixtures/llama_server/.

Needs the binary from scripts/build_llama_server.sh and the assets from scripts/fetch_assets.py. For each
vocabulary + chat template pair, a tiny random-weight model is made around llama.cpp's own vocabulary file
(scripts/tiny_gguf.py), llama-server is started on a loopback port with ``--jinja --chat-template-file``, and every
case of tests/server_corpus.py is sent to ``/v1/chat/completions`` (``max_tokens: 1``) and ``/apply-template``.
The server's ``usage.prompt_tokens`` and prompt text are stored beside the case: our own recorded data.

    python scripts/record_llama_server.py [--only qwen2]
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
# What server detection asks (src/contextkeeper/servers/detection.py SIGNS), recorded as the server answered.
ASKED = ("/v1/models", "/props", "/api/version", "/get_server_info", "/version")
# vocabulary -> chat template (tokenizer folder = tests/assets.tokenizer_dir(vocab))
PAIRS = {
    "qwen2": "Qwen-Qwen3-0.6B",
    "llama-bpe": "meta-llama-Llama-3.3-70B-Instruct",
    "gemma-4": "google-gemma-4-31B-it",
    "phi-3": "microsoft-Phi-3.5-mini-instruct",
}


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(PAIRS), action="append")
    parser.add_argument("--answers", action="store_true", help="record only what detection asks (first pair)")
    parser.add_argument("--engine", action="store_true", help="record only the engine probes (our own template)")
    parser.add_argument("--continuation", action="store_true", help="record only the reasoning continuations")
    args = parser.parse_args()
    if not BINARY.exists():
        sys.exit(f"{BINARY} is missing: run `bash scripts/build_llama_server.sh` first")
    MODELS.mkdir(parents=True, exist_ok=True)
    FIXTURES.mkdir(parents=True, exist_ok=True)
    if args.engine:
        record_engine()
        return
    continued: dict[str, Any] = {}
    for vocab in args.only or PAIRS:
        model = MODELS / f"{vocab}.gguf"
        if not model.exists():
            tiny_model(assets.gguf_file(vocab), model)
        template = assets.ASSETS / "templates" / f"{PAIRS[vocab]}.jinja"
        with LlamaServer(model, template) as server:
            if args.continuation:
                continued[vocab] = {
                    "template": PAIRS[vocab],
                    "cases": [server.record(case) for case in server_corpus.continuation_cases()],
                }
                continue
            if args.answers:
                ANSWERS.parent.mkdir(parents=True, exist_ok=True)
                answers = {"server": f"llama-server {version()}", "recorded": dt.date.today().isoformat()}
                answers["answers"] = server.answers()
                ANSWERS.write_text(json.dumps(answers, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
                print(f"{ANSWERS.relative_to(ROOT)}: {len(ASKED)} endpoints")
                return
            recorded = [server.record(case) for case in server_corpus.cases()]
        fixture = {
            "server": f"llama-server {version()}",
            "source": "llama-cpp-python 0.3.36 sdist, vendor/llama.cpp",
            "recorded": dt.date.today().isoformat(),
            "vocab": vocab,
            "template": PAIRS[vocab],
            "cases": recorded,
        }
        path = FIXTURES / f"{vocab}.json"
        path.write_text(json.dumps(fixture, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
        print(
            f"{path.relative_to(ROOT)}: {len(recorded)} cases, "
            f"{sum(case['prompt_tokens'] is None for case in recorded)} refused"
        )
    if continued:
        fixture = {"server": f"llama-server {version()}", "recorded": dt.date.today().isoformat(), "pairs": continued}
        CONTINUATION.write_text(json.dumps(fixture, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
        print(f"{CONTINUATION.relative_to(ROOT)}: {sum(len(p['cases']) for p in continued.values())} cases")


if __name__ == "__main__":
    main()
