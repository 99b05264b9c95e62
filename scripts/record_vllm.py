"""Record what vLLM's (or SGLang's) own chat preprocessing makes of the server corpus, into tests/fixtures/.

Run it with the Python of a separate environment that holds the server (never the project's; docs/dialects.md
lists the install commands), from the repository root::

    /work/vllm-venv/bin/python scripts/record_vllm.py [--only qwen2] [--check]
    /work/sglang-venv/bin/python scripts/record_vllm.py --server sglang [--only qwen2] [--check]
    python scripts/record_vllm.py --compare    # the project's environment: the recordings against each dialect

No engine and no GPU. vLLM: its GPU-less render server (``vllm launch render``) is built in-process from the same
command-line flags, and each case of tests/server_corpus.py goes through the code ``/v1/chat/completions`` runs
before the engine: the JSON body parsed by ``ChatCompletionRequest``, then ``ServingRender.render_chat_request``
(``/v1/chat/completions/render``), which calls ``OnlineRenderer.render_chat`` as ``OpenAIServingChat`` does.
SGLang: its tokenizer manager and ``OpenAIServingChat`` are built as ``sglang serve`` builds them (no scheduler),
and each case goes through ``_validate_request`` and ``_convert_to_internal_request``, the steps
``handle_request`` takes before it hands the ids to the scheduler. The length of the prompt's token ids and its
rendered text are stored beside each case, or ``null`` and the error where the server refuses the request: our
own recorded data. ``--check`` records again and compares with the stored fixtures instead of writing them.

Each tokenizer + template pair of scripts/record_llama_server.py gets a model folder in .cache/render-models/:
the tokenizer files and a one-layer text-model config.json (no weights: nothing is loaded or run).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import shutil
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests")]

import assets  # noqa: E402
import server_corpus  # noqa: E402

# vLLM picks its platform when it is first imported: the CPU one, as nothing needs an accelerator to render.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODELS = ROOT / ".cache" / "render-models"
FIXTURES = ROOT / "tests" / "fixtures"
CONTEXT = 16384
# The tokenizer + template pairs of scripts/record_llama_server.py (not imported: it needs the gguf package).
PAIRS = {
    "qwen2": "Qwen-Qwen3-0.6B",
    "llama-bpe": "meta-llama-Llama-3.3-70B-Instruct",
    "gemma-4": "google-gemma-4-31B-it",
    "phi-3": "microsoft-Phi-3.5-mini-instruct",
}
# A one-layer text model of each vocabulary's family (only its config is read), and the tool-call parser a vLLM
# deployment of that family serves tools with: without --enable-auto-tool-choice and a parser, vLLM refuses every
# request that has tools (the parser reads the model's output; it does not change the prompt).
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen2": {"config": "Qwen3Config", "architecture": "Qwen3ForCausalLM", "tool_parser": "hermes"},
    "llama-bpe": {"config": "LlamaConfig", "architecture": "LlamaForCausalLM", "tool_parser": "pythonic"},
    # One head size for every layer: a per-layer one is refused by SGLang's config reader.
    "gemma-4": {
        "config": "Gemma4TextConfig",
        "architecture": "Gemma4ForCausalLM",
        "tool_parser": "gemma4",
        "extra": {"global_head_dim": 32},
    },
    "phi-3": {"config": "Phi3Config", "architecture": "Phi3ForCausalLM", "tool_parser": "phi4_mini_json"},
}
SOURCES = {
    "vllm": (
        "ChatCompletionRequest.model_validate_json (the body, as FastAPI parses it) -> "
        "vllm/entrypoints/scale_out/render/serving.py: ServingRender.render_chat_request "
        "(/v1/chat/completions/render) -> vllm/renderers/online_renderer.py: OnlineRenderer.render_chat, which "
        "OpenAIServingChat.render_chat_request delegates to (tools: request.tools model_dump) -> preprocess_chat "
        "-> vllm/renderers/hf.py: HfRenderer.render_messages_async (parse_chat_messages, "
        "safe_apply_chat_template) -> vllm/renderers/base.py: tokenize_prompts (add_special_tokens=False)"
    ),
    "sglang": (
        "ChatCompletionRequest.model_validate_json (the body, as FastAPI parses it) -> "
        "sglang/srt/entrypoints/openai/serving_chat.py: OpenAIServingChat._validate_request, "
        "_convert_to_internal_request -> _process_messages (tools: request.tools model_dump) -> "
        "_apply_jinja_template -> _render_and_encode_chat_template (tokenizer.apply_chat_template, text; "
        "parallel_prompt_encode)"
    ),
}


def model_folder(vocab: str) -> Path:
    """``.cache/render-models/<vocab>``: the tokenizer files and a one-layer config.json of the family."""
    import transformers
    from transformers import AutoTokenizer

    folder = MODELS / vocab
    if (folder / "config.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(assets.tokenizer_dir(vocab) / name, folder / name)
    family = FAMILIES[vocab]
    config = getattr(transformers, family["config"])(
        vocab_size=len(AutoTokenizer.from_pretrained(str(folder))),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=CONTEXT,
        **family.get("extra", {}),
    )
    config.architectures = [family["architecture"]]
    config.save_pretrained(folder)
    return folder


def _template(vocab: str) -> str:
    return str(assets.ASSETS / "templates" / f"{PAIRS[vocab]}.jinja")


def _body(model: str, case: dict[str, Any]) -> str:
    """The request body a client sends for ``case``: JSON text, for the server's own request model to parse."""
    body: dict[str, Any] = {"model": model, "messages": case["messages"], "max_tokens": 1, "temperature": 0}
    if case["tools"]:
        body["tools"] = case["tools"]
    return json.dumps(body)


class VLLMRenderer:
    """vLLM's render-server state for one model, built in-process as ``vllm launch render`` builds it."""

    def __init__(self, vocab: str) -> None:
        self.flags = ["--model", str(model_folder(vocab)), "--chat-template", _template(vocab)]
        self.flags += ["--max-model-len", str(CONTEXT), "--enable-auto-tool-choice"]
        self.flags += ["--tool-call-parser", FAMILIES[vocab]["tool_parser"]]
        self.state: Any = None
        self.model = ""

    async def start(self) -> VLLMRenderer:
        from starlette.datastructures import State
        from vllm import AsyncEngineArgs, envs
        from vllm.config import VllmConfig
        from vllm.entrypoints.common.cli_args import make_arg_parser, validate_parsed_serve_args
        from vllm.entrypoints.launchers.render.app_state import init_render_app_state
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        # The steps of vllm/entrypoints/launchers/render/entry.py: run_launch_fastapi, without the socket.
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(self.flags)
        validate_parsed_serve_args(args)
        engine_args = AsyncEngineArgs.from_cli_args(args)
        model_config = engine_args.create_model_config()
        model_config.quantization = None
        envs.VLLM_CPU_KVCACHE_SPACE = 0
        config = VllmConfig(
            model_config=model_config,
            logging_config=engine_args.create_logging_config(),
            structured_outputs_config=engine_args.create_structured_outputs_config(),
        )
        self.state = State()
        await init_render_app_state(config, self.state, args)
        self.model = args.model
        return self

    async def record(self, case: dict[str, Any]) -> dict[str, Any]:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        body = _body(self.model, case)
        out = {**case, "prompt_tokens": None, "prompt": None}
        try:
            rendered = await self.state.serving_render.render_chat_request(
                ChatCompletionRequest.model_validate_json(body)
            )
            if isinstance(rendered, ErrorResponse):
                out["error"] = {"type": rendered.error.type, "message": rendered.error.message[:300]}
                return out
            # The same preprocessing once more for the text: the render endpoint returns the ids only.
            _, inputs = await self.state.online_renderer.render_chat(ChatCompletionRequest.model_validate_json(body))
        except Exception as exc:  # what the server answers with a 400 (or 500) reply
            out["error"] = {"type": type(exc).__name__, "message": str(exc)[:300]}
            return out
        if list(inputs[0]["prompt_token_ids"]) != list(rendered.token_ids):
            raise RuntimeError(f"{case['name']}: the render endpoint and the renderer disagree")
        out["prompt_tokens"] = len(rendered.token_ids)
        out["prompt"] = inputs[0].get("prompt")
        return out


class SGLangRenderer:
    """SGLang's tokenizer manager and chat handler for one model, built in-process as ``sglang serve`` builds
    them, without the scheduler and detokenizer processes (nothing is generated)."""

    def __init__(self, vocab: str) -> None:
        self.flags = ["--model-path", str(model_folder(vocab)), "--chat-template", _template(vocab)]
        self.flags += ["--context-length", str(CONTEXT), "--device", "cpu"]
        self.texts: list[str] = []
        self.chat: Any = None
        self.model = ""

    async def start(self) -> SGLangRenderer:
        _import_only_torchvision()
        from sglang.srt.entrypoints import engine
        from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
        from sglang.srt.runtime_context import publish
        from sglang.srt.server_args import PortArgs, prepare_server_args

        # The steps of sglang/srt/entrypoints/engine.py: Engine._launch_subprocesses up to the tokenizer manager.
        server_args = prepare_server_args(self.flags)
        server_args.resolve_once()
        server_args.check_server_args()
        engine.resolve_auto_parsers(server_args)
        publish(server_args, role="tokenizer")
        manager, templates = engine.init_tokenizer_manager(server_args, PortArgs.init_new(server_args))
        manager.max_req_input_len = CONTEXT
        self.chat = OpenAIServingChat(manager, templates)
        # The rendered text never leaves the handler: keep what apply_chat_template returns as text (the call
        # itself goes through unchanged).
        tokenizer = manager.tokenizer
        apply = tokenizer.apply_chat_template

        def kept(*args: Any, **kwargs: Any) -> Any:
            result = apply(*args, **kwargs)
            if kwargs.get("tokenize") is False and isinstance(result, str):
                self.texts.append(result)
            return result

        tokenizer.apply_chat_template = kept
        self.model = str(server_args.model_path)
        return self

    async def record(self, case: dict[str, Any]) -> dict[str, Any]:
        from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

        out = {**case, "prompt_tokens": None, "prompt": None}
        self.texts.clear()
        try:
            request = ChatCompletionRequest.model_validate_json(_body(self.model, case))
            # OpenAIServingBase.handle_request: validate, then convert (template applied, prompt tokenized).
            error = self.chat._validate_request(request)
            if error:
                out["error"] = {"type": "BadRequest", "message": error[:300]}
                return out
            adapted, _ = self.chat._convert_to_internal_request(request, None)
        except ValueError as exc:  # handle_request answers these with a 400 BadRequest
            out["error"] = {"type": type(exc).__name__, "message": str(exc)[:300]}
            return out
        out["prompt_tokens"] = len(adapted.input_ids)
        out["prompt"] = self.texts[-1] if self.texts else None
        return out


# torchvision for SGLang's imports only: names resolve, calling anything raises (text chat calls nothing).
_STAND_IN = """\"\"\"Not torchvision: an import-only stand-in written by contextkeeper's scripts/record_vllm.py.\"\"\"
import enum
import sys
import types

__version__ = "0+import-only"
InterpolationMode = enum.Enum("InterpolationMode", "NEAREST NEAREST_EXACT BILINEAR BICUBIC BOX HAMMING LANCZOS")


class _Unavailable(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "InterpolationMode":
            return InterpolationMode

        def unavailable(*args, **kwargs):
            raise RuntimeError(f"{self.__name__}.{name} is not available (import-only stand-in)")

        return unavailable


for _name in ("transforms", "transforms.functional", "transforms.v2", "io", "ops", "datasets", "models", "utils"):
    sys.modules[f"torchvision.{_name}"] = _Unavailable(f"torchvision.{_name}")
transforms = sys.modules["torchvision.transforms"]
transforms.functional = sys.modules["torchvision.transforms.functional"]
"""


def _import_only_torchvision() -> None:
    """SGLang imports torchvision at module level, for image models only, and the torchvision wheels here are CUDA
    builds that do not load against the CPU torch. transformers is asked first (its answer, no torchvision, is
    cached), then an import-only stand-in (``<venv>/import-only/torchvision``) goes on the path for SGLang."""
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()
    import_utils.is_torchvision_v2_available()
    stand_in = Path(sys.prefix) / "import-only"
    (stand_in / "torchvision").mkdir(parents=True, exist_ok=True)
    (stand_in / "torchvision" / "__init__.py").write_text(_STAND_IN, encoding="utf-8")
    sys.path.append(str(stand_in))


RENDERERS: dict[str, Any] = {"vllm": VLLMRenderer, "sglang": SGLangRenderer}


async def record_pair(server: str, vocab: str) -> dict[str, Any]:
    renderer = await RENDERERS[server](vocab).start()
    recorded = [await renderer.record(case) for case in server_corpus.cases()]
    return {
        "server": f"{server} {version(server)} ("
        + ", ".join(f"{name} {version(name)}" for name in ("transformers", "tokenizers", "jinja2", "torch"))
        + ")",
        "source": SOURCES[server],
        "flags": [str(Path(f).relative_to(ROOT)) if f.startswith(str(ROOT)) else f for f in renderer.flags],
        "recorded": dt.date.today().isoformat(),
        "vocab": vocab,
        "template": PAIRS[vocab],
        "cases": recorded,
    }


def differences(stored: dict[str, Any], fresh: dict[str, Any]) -> list[str]:
    """What a fresh recording says differently from a stored one: a count, a text or a refusal."""
    out = []
    old = {case["name"]: case for case in stored["cases"]}
    for case in fresh["cases"]:
        before = old.get(case["name"])
        if before is None:
            out.append(f"{case['name']}: not in the stored fixture")
            continue
        for key in ("prompt_tokens", "prompt"):
            if before.get(key) != case.get(key):
                out.append(f"{case['name']}: {key} {str(before.get(key))[:60]!r} -> {str(case.get(key))[:60]!r}")
        if (before.get("error") or {}).get("type") != (case.get("error") or {}).get("type"):
            out.append(f"{case['name']}: error {before.get('error')} -> {case.get('error')}")
    return out


COMPARED = ("vllm", "sglang", "llama.cpp", "transformers")


def compare() -> None:
    """A table per server: how many recorded cases each dialect counts and renders as the server did (a refusal
    agrees with a refusal)."""
    from contextkeeper import ContextKeeperError, load_counter

    for server in RENDERERS:
        print(f"\n{server}:\n")
        print(
            "| vocabulary + template | cases | refused | " + " | ".join(f"equal, {d} dialect" for d in COMPARED) + " |"
        )
        print("|---|---|---|" + "---|" * len(COMPARED))
        total = [0] * (2 + len(COMPARED))
        for path in sorted((FIXTURES / server).glob("*.json")):
            fixture = json.loads(path.read_text(encoding="utf-8"))
            row = [len(fixture["cases"]), sum(case["prompt_tokens"] is None for case in fixture["cases"])]
            for dialect in COMPARED:
                counter = load_counter(
                    str(assets.tokenizer_dir(fixture["vocab"])),
                    chat_template=assets.template(fixture["template"]),
                    server=dialect,
                )
                same = 0
                for case in fixture["cases"]:
                    try:
                        seen = (
                            counter.count(case["messages"], tools=case["tools"]),
                            counter.render(case["messages"], tools=case["tools"]),
                        )
                    except ContextKeeperError:
                        seen = (None, None)  # refused
                    same += seen == (case["prompt_tokens"], case["prompt"] if case["prompt_tokens"] else None)
                row.append(same)
            total = [a + b for a, b in zip(total, row, strict=True)]
            print(f"| {fixture['vocab']} + {fixture['template']} | " + " | ".join(map(str, row)) + " |")
        print("| all | " + " | ".join(map(str, total)) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--server", choices=sorted(RENDERERS), default="vllm")
    parser.add_argument("--only", choices=sorted(PAIRS), action="append")
    parser.add_argument("--check", action="store_true", help="compare with the stored fixtures, write nothing")
    parser.add_argument("--compare", action="store_true", help="the recordings against each dialect (a table)")
    args = parser.parse_args()
    assets.require_assets()
    if args.compare:
        compare()
        return
    folder = FIXTURES / args.server
    folder.mkdir(parents=True, exist_ok=True)
    differ = 0
    for vocab in args.only or PAIRS:
        fixture = asyncio.run(record_pair(args.server, vocab))
        path = folder / f"{vocab}.json"
        if args.check:
            found = differences(json.loads(path.read_text(encoding="utf-8")), fixture)
            differ += len(found)
            print(f"{path.relative_to(ROOT)}: {len(fixture['cases'])} cases, {len(found)} differ")
            for line in found:
                print(f"  {line}")
            continue
        path.write_text(json.dumps(fixture, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
        refused = sum(case["prompt_tokens"] is None for case in fixture["cases"])
        print(f"{path.relative_to(ROOT)}: {len(fixture['cases'])} cases, {refused} refused")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
