"""The runnable examples run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_count_conversation_example() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "count_conversation.py")], capture_output=True, text=True, check=True
    )
    assert "prompt tokens for 11 messages" in done.stdout
    assert "after one more turn" in done.stdout


def test_many_conversations_example() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "many_conversations.py")], capture_output=True, text=True, check=True
    )
    assert "turn 11 chen" in done.stdout
    assert "conversations remembered: ana, bo, chen" in done.stdout
    assert "after forget('bo'): ana, chen" in done.stdout


def test_plan_gpu_example() -> None:
    done = subprocess.run([sys.executable, str(EXAMPLES / "plan_gpu.py")], capture_output=True, text=True, check=True)
    assert "vllm" in done.stdout
    assert "RTX 4090, 4 × 32K on vLLM: does not fit" in done.stdout
    assert "cheapest GPU options" in done.stdout


def test_openai_chat_loop_example() -> None:
    from assets import require_assets, tokenizer_dir
    from openai_server import ChatServer

    require_assets()
    with ChatServer(tokenizer_dir("qwen2"), max_model_len=1024) as server:
        server.replies.extend(["Customs: check the EORI number and the T1 transit document. " * 4] * 20)
        done = subprocess.run(
            [
                sys.executable,
                str(EXAMPLES / "openai_chat_loop.py"),
                *("--base-url", server.base_url, "--tokenizer", str(tokenizer_dir("qwen2"))),
                *("--context", "1024", "--turns", "16", "--max-tokens", "64"),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        assert server.accepted == 16
        assert server.rejected == 0
    rows = [line.split() for line in done.stdout.splitlines()[1:17]]
    assert all(row[3] == row[4] for row in rows)  # our count is the server's, turn after turn
    assert "sliding_window" in done.stdout


def test_local_transformers_example() -> None:
    from assets import require_assets, tokenizer_dir

    require_assets()
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "local_transformers.py"), "--tokenizer", str(tokenizer_dir("qwen2"))],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = [line.split() for line in done.stdout.splitlines()[1:]]
    assert len(rows) == 8
    assert all(row[2] == row[3] for row in rows)  # the model was fed exactly the tokens we counted
    assert all(row[4] == row[5] for row in rows)  # the cache held exactly the predicted bytes


def test_agent_with_tools_example() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "agent_with_tools.py")], capture_output=True, text=True, check=True
    )
    assert "prune_tool_results: cleared" in done.stdout
    assert "0 dropped" in done.stdout  # old results became placeholders; no turn had to go
    prompts = [int(line.split()[3]) for line in done.stdout.splitlines()[1:21]]
    assert max(prompts) + 512 <= 8192


def test_diagnose_profile_example() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "diagnose_profile.py")], capture_output=True, text=True, check=True
    )
    assert "every step exact: True" in done.stdout
    assert "monitor: [leak]" in done.stdout


def test_proxy_tenants_example() -> None:
    from assets import require_assets, tokenizer_dir
    from openai_server import ChatServer

    require_assets()
    with ChatServer(tokenizer_dir("qwen2"), max_model_len=1024) as server:
        done = subprocess.run(
            [
                sys.executable,
                str(EXAMPLES / "proxy_tenants.py"),
                *("--base-url", server.base_url, "--tokenizer", str(tokenizer_dir("qwen2")), "--context", "1024"),
            ],
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        )
    assert "team-a sees: order-4411\n" in done.stdout
    assert "the admin key sees: team-a/order-4411, team-b/order-4411" in done.stdout
    for line in (
        "a 300 KB body: 413 body_too_large",
        "a rebound Host: 421 host_not_allowed",
        "a cross-site text/plain POST: 403 origin_not_allowed",
        "an upstream admin path: 404 route_not_forwarded",
        "no key: 401 invalid_api_key",
    ):
        assert line in done.stdout
