"""Record what a real ``transformers serve`` counts for the server corpus, into tests/fixtures/transformers_serve/.

Needs the serving extras (fastapi, uvicorn; ``pip install -e '.[dev]'``) and the assets from
scripts/fetch_assets.py. For each vocabulary + chat template pair, a tiny random-weight model (one layer, width 64)
is built from a config with transformers and saved with the vocabulary's tokenizer files and the chat template
into the git-ignored ``.cache/transformers_serve/<vocab>/``. ``transformers serve <folder>`` is started on a
loopback port, and every case of tests/server_corpus.py is sent to ``/v1/chat/completions`` (``max_tokens: 1``).
The server's ``usage.prompt_tokens`` (the length of the ids it generated from) is stored beside the case, with the
prompt text the server's own preprocessing renders: ``BaseHandler.get_processor_inputs_from_messages`` and
``apply_chat_template`` of the tokenizer the server loads, called here in-process, and checked to tokenize to
the count the server reported. Our own recorded data.

    python scripts/record_transformers_serve.py [--only qwen2]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
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

MODELS = ROOT / ".cache" / "transformers_serve"
FIXTURES = ROOT / "tests" / "fixtures" / "transformers_serve"
ANSWERS = FIXTURES / "answers" / "transformers-serve.json"
# vocabulary -> (chat template, model type of the tiny model); the same pairs as the llama-server recordings.
PAIRS = {
    "qwen2": ("Qwen-Qwen3-0.6B", "qwen3"),
    "llama-bpe": ("meta-llama-Llama-3.3-70B-Instruct", "llama"),
    "gemma-4": ("google-gemma-4-31B-it", "gemma3_text"),
    "phi-3": ("microsoft-Phi-3.5-mini-instruct", "phi3"),
}
SOURCE_FUNCTIONS = (
    "transformers/cli/serving/chat_completion.py: ChatCompletionHandler.handle_request",
    "transformers/cli/serving/utils.py: BaseHandler.get_processor_inputs_from_messages",
    "transformers/tokenization_utils_base.py: PreTrainedTokenizerBase.apply_chat_template",
)
# Offline and quiet: no hub look-ups, no update check.
SERVER_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1"}


def tiny_model(vocab: str, folder: Path | None = None) -> Path:
    """A folder holding a tiny random-weight model for ``vocab`` (made once, then cached): the vocabulary's own
    tokenizer files, the chat template of ``PAIRS[vocab]`` as chat_template.jinja, and a one-layer model of width
    64 built from a config. The weights do not matter to a count; the tokenizer and template are the real ones."""
    folder = folder or MODELS / vocab
    if (folder / "config.json").exists() and (folder / "chat_template.jinja").exists():
        return folder
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    template, model_type = PAIRS[vocab]
    folder.mkdir(parents=True, exist_ok=True)
    source = assets.tokenizer_dir(vocab)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(source / name, folder / name)
    (folder / "chat_template.jinja").write_text(assets.template(template), encoding="utf-8")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=16384,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config.architectures = [AutoModelForCausalLM._model_mapping[type(config)].__name__]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        raw = error.read().decode("utf-8", "replace")
        try:
            return error.code, json.loads(raw)
        except ValueError:
            return error.code, raw  # FastAPI answers an uncaught exception with plain "Internal Server Error"


class TransformersServer:
    """``transformers serve <folder>`` on a loopback port (CPU), stopped on exit."""

    def __init__(self, model: Path, *, wait_s: float = 150) -> None:
        self.model = model
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.wait_s = wait_s
        self.log = (model.parent / f"{model.name}.server.log").open("w")
        self.command = [
            sys.executable,
            "-m",
            "transformers.cli.transformers",
            "serve",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--device",
            "cpu",
        ]
        self.process = subprocess.Popen(
            self.command, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **SERVER_ENV}
        )

    def __enter__(self) -> TransformersServer:
        deadline = time.monotonic() + self.wait_s  # bounded: importing torch and loading the model
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.log.flush()
                raise RuntimeError(f"transformers serve exited with {self.process.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"transformers serve did not answer /health within {self.wait_s:.0f} s; see {self.log.name}")

    def __exit__(self, *exc: object) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=15)
        self.log.close()

    def complete(self, case: dict[str, Any]) -> tuple[int, Any]:
        body: dict[str, Any] = {
            "model": str(self.model),
            "messages": case["messages"],
            "max_tokens": 1,
            "temperature": 0,
        }
        if case["tools"]:
            body["tools"] = case["tools"]
        return _post(f"{self.url}/v1/chat/completions", body)

    def record(self, case: dict[str, Any]) -> dict[str, Any]:
        """``case`` with the server's ``prompt_tokens`` (None: refused, with the error)."""
        status, reply = self.complete(case)
        out = dict(case)
        if status == 200:
            out["prompt_tokens"] = reply["usage"]["prompt_tokens"]
        else:
            out["prompt_tokens"] = None
            message = reply.get("detail", reply.get("error", reply)) if isinstance(reply, dict) else reply
            out["error"] = {"status": status, "message": str(message)[:300]}
        return out


def server_prompt(tokenizer: Any, case: dict[str, Any]) -> tuple[str | None, int | None, str | None]:
    """The prompt text and its token count by the server's own functions, or what they raised."""
    from transformers.cli.serving.utils import BaseHandler, Modality

    try:
        messages = BaseHandler.get_processor_inputs_from_messages(case["messages"], Modality.LLM)
        kwargs: dict[str, Any] = {"add_generation_prompt": True, "tools": case["tools"]}
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)["input_ids"]
    except Exception as exc:  # what the server's handler raises for this case: a 500 there
        return None, None, f"{type(exc).__name__}: {exc}"[:300]
    return str(text), len(ids), None


# What server detection asks (src/contextkeeper/servers/detection.py), recorded as transformers serve answered.
ASKED = ("/v1/models", "/health", "/props", "/api/version", "/get_server_info", "/version")


def answers(server: TransformersServer) -> dict[str, Any]:
    """Every endpoint detection asks, and one chat completion, as the server answered (the local model path, which
    the server uses as the model's id, written as <folder>)."""
    out: dict[str, Any] = {}
    for path in ASKED:
        try:
            with urllib.request.urlopen(server.url + path, timeout=10) as response:
                out[path] = {"status": response.status, "json": json.loads(response.read())}
        except urllib.error.HTTPError as error:
            out[path] = {"status": error.code, "body": error.read().decode("utf-8", "replace")[:300]}
    status, reply = server.complete(server_corpus.cases()[0])
    out["/v1/chat/completions"] = {"status": status, "json": reply}
    named: dict[str, Any] = json.loads(json.dumps(out).replace(json.dumps(str(server.model))[1:-1], "<folder>"))
    return named


def version() -> str:
    import transformers

    return str(transformers.__version__)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(PAIRS), action="append")
    args = parser.parse_args()
    from transformers import AutoProcessor
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        sys.exit("transformers serve needs fastapi and uvicorn: pip install -e '.[dev]'")
    os.environ.update(SERVER_ENV)
    ANSWERS.parent.mkdir(parents=True, exist_ok=True)
    for vocab in args.only or PAIRS:
        model = tiny_model(vocab)
        tokenizer = AutoProcessor.from_pretrained(model)  # what the server loads (a tokenizer for a text model)
        with TransformersServer(model) as server:
            if vocab == (args.only or list(PAIRS))[0]:
                seen = {"server": f"transformers serve {version()}", "recorded": dt.date.today().isoformat()}
                shown = " ".join(server.command[2:]).replace(str(model), "<folder>")
                seen["command"] = shown.replace(f"--port {server.port}", "--port <free port>")
                seen["answers"] = answers(server)
                ANSWERS.write_text(json.dumps(seen, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
            recorded = [server.record(case) for case in server_corpus.cases()]
        for case in recorded:
            prompt, count, raised = server_prompt(tokenizer, case)
            if count != case["prompt_tokens"]:
                raise RuntimeError(
                    f"{vocab} {case['name']}: the server counted {case['prompt_tokens']}, its preprocessing here "
                    f"{count} ({raised}): the in-process prompt is not the server's"
                )
            case["prompt"] = prompt
            if raised:
                case["error"]["raised"] = raised  # the server's own exception behind its 500
        fixture = {
            "server": f"transformers serve {version()}",
            "source": f"transformers {version()}: " + "; ".join(SOURCE_FUNCTIONS),
            "recorded": dt.date.today().isoformat(),
            "vocab": vocab,
            "template": PAIRS[vocab][0],
            "model": {"type": PAIRS[vocab][1], "layers": 1, "hidden_size": 64, "random_weights": True},
            "cases": recorded,
        }
        path = FIXTURES / f"{vocab}.json"
        path.write_text(json.dumps(fixture, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
        print(
            f"{path.relative_to(ROOT)}: {len(recorded)} cases, "
            f"{sum(case['prompt_tokens'] is None for case in recorded)} refused"
        )


if __name__ == "__main__":
    main()
