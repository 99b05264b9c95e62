"""Compare the recorded llama-server counts with our counts under the vllm and llama.cpp dialects (a table).

python scripts/compare_llama_server.py      # reads tests/fixtures/llama_server/*.json
"""

from __future__ import annotations

import datetime as dt
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import assets  # noqa: E402
from contextkeeper import ContextKeeperError, load_counter  # noqa: E402


def main() -> None:
    print("| vocabulary + template | cases | server refused | equal, vllm dialect | equal, llama.cpp dialect |")
    print("|---|---|---|---|---|")
    total = [0, 0, 0, 0]
    for path in sorted((ROOT / "tests" / "fixtures" / "llama_server").glob("*.json")):
        fixture = json.loads(path.read_text(encoding="utf-8"))
        day = dt.datetime.strptime(fixture["recorded"], "%Y-%m-%d")
        context = {"date_string": day.strftime("%d %b %Y"), "datetime": day.strftime("%b %d %Y")}
        equal = []
        for server in ("vllm", "llama.cpp"):
            counter = load_counter(
                str(assets.tokenizer_dir(fixture["vocab"])),
                chat_template=assets.template(fixture["template"]),
                server=server,
                template_kwargs=context,
            )
            same = 0
            for case in fixture["cases"]:
                try:
                    count: int | None = counter.count(case["messages"], tools=case["tools"])
                except ContextKeeperError:
                    count = None  # refused, as the server may have
                same += count == case["prompt_tokens"]
            equal.append(same)
        cases = len(fixture["cases"])
        refused = sum(case["prompt_tokens"] is None for case in fixture["cases"])
        total = [total[0] + cases, total[1] + refused, total[2] + equal[0], total[3] + equal[1]]
        print(f"| {fixture['vocab']} + {fixture['template']} | {cases} | {refused} | {equal[0]} | {equal[1]} |")
    print(f"| all | {total[0]} | {total[1]} | {total[2]} | {total[3]} |")


if __name__ == "__main__":
    main()
