"""One proxy, two tenants: each sees its own conversations, the admin key sees both, hostile requests get 4xx.

    python examples/proxy_tenants.py --base-url http://127.0.0.1:8000/v1 --tokenizer ./qwen2.5-7b [--context 4096]

Starts ``contextkeeper serve``'s app on a free loopback port in this process (in front of the OpenAI-compatible
server at ``--base-url``), with named keys for two teams, an admin key and a 256 KB body limit, then sends what
clients and attackers send (docs/proxy.md, "Security").
"""

from __future__ import annotations

import argparse

import httpx2
import openai

from contextkeeper.proxy import InputLimits, Proxy, ProxyServer, default_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", required=True, help="the upstream's OpenAI base URL")
    parser.add_argument("--tokenizer", required=True, help="the served model's tokenizer (folder, .gguf, mistral:...)")
    parser.add_argument("--context", type=int, default=4096)
    args = parser.parse_args()

    config = default_config(
        tokenizer=args.tokenizer,
        context_window=args.context,
        upstream=args.base_url,
        api_keys={"team-a": "sk-team-a", "team-b": "sk-team-b"},
        admin_key="sk-admin",
        limits={"body_bytes": 256 * 1024},
    )
    proxy = Proxy.from_config(config)
    assert proxy.limits == InputLimits(body_bytes=256 * 1024)
    with ProxyServer(proxy, port=0) as server:
        for team in ("a", "b"):
            client = openai.OpenAI(base_url=server.base_url, api_key=f"sk-team-{team}", max_retries=0)
            raw = client.chat.completions.with_raw_response.create(
                model="any",
                messages=[{"role": "user", "content": f"Team {team.upper()}: where is order 4411?"}],
                max_tokens=16,
                extra_headers={"X-Conversation-Id": "order-4411"},
            )
            print(f"team-{team}: {raw.headers['x-contextkeeper-prompt-tokens']} prompt tokens, conversation "
                  f"{raw.headers['x-contextkeeper-conversation']}")  # fmt: skip

        def listing(key: str) -> list[str]:
            headers = {"Authorization": f"Bearer {key}"}
            return list(
                httpx2.get(f"{server.url}/contextkeeper/conversations", headers=headers).json()["conversations"]
            )

        print("team-a sees:", ", ".join(listing("sk-team-a")))
        print("the admin key sees:", ", ".join(listing("sk-admin")))

        refusals = {
            "a 300 KB body": httpx2.post(
                f"{server.base_url}/chat/completions",
                json={"model": "any", "messages": [{"role": "user", "content": "x" * 300_000}]},
                headers={"Authorization": "Bearer sk-team-a"},
            ),
            "a rebound Host": httpx2.get(f"{server.url}/metrics", headers={"Host": "evil.example"}),
            "a cross-site text/plain POST": httpx2.post(
                f"{server.base_url}/chat/completions",
                content=b"{}",
                headers={"Origin": "https://evil.example", "Content-Type": "text/plain"},
            ),
            "an upstream admin path": httpx2.post(
                f"{server.url}/reset_prefix_cache", headers={"Authorization": "Bearer sk-team-a"}
            ),
            "no key": httpx2.get(f"{server.base_url}/models"),
        }
        for what, response in refusals.items():
            print(f"{what}: {response.status_code} {response.json()['error']['code']}")


if __name__ == "__main__":
    main()
