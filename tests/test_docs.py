"""The documentation stays true: the API reference is what the code generates, every relative link lands, and
the first-ten-minutes page runs with the output it shows.

docs/index.md's Python blocks run in order in one fresh interpreter from the repository root (so they share
names, as a reader's session would), against the fetched test assets. A block followed by a ``text`` block must
print exactly that text. A block whose first line starts with ``# needs a server`` runs against
tests/openai_server.py's ChatServer (the qwen2 vocabulary, Qwen2.5-7B-Instruct's template, a 4,096-token context)
with ``http://127.0.0.1:8000/v1`` replaced by its address; a block whose first line starts with ``# not run`` is
skipped.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from assets import require_assets

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
INDEX = DOCS / "index.md"
SERVER_MARKER = "# needs a server"
SKIP_MARKER = "# not run"
DOC_SERVER_URL = "http://127.0.0.1:8000/v1"

_FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_IMAGE = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
_HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def blocks(text: str) -> list[tuple[str, str, int]]:
    """Every fenced block: (language, body, line number of the fence)."""
    found: list[tuple[str, str, int]] = []
    fence: str | None = None
    language, start = "", 0
    body: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        match = _FENCE.match(line)
        if fence is None and match:
            fence, language, body, start = match.group(1), match.group(2), [], number
        elif fence is not None and line.strip().startswith(fence) and not line.strip().strip(fence[0]):
            found.append((language, "\n".join(body), start))
            fence = None
        elif fence is not None:
            body.append(line)
    return found


def prose_lines(text: str) -> list[tuple[int, str]]:
    """The lines outside fenced blocks, with inline code removed."""
    lines: list[tuple[int, str]] = []
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), 1):
        match = _FENCE.match(line)
        if fence is None and match:
            fence = match.group(1)
        elif fence is not None:
            if line.strip().startswith(fence) and not line.strip().strip(fence[0]):
                fence = None
        else:
            lines.append((number, _CODE_SPAN.sub("", line)))
    return lines


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for a page's headings (lower case, punctuation dropped, spaces as hyphens, ``-1``...
    after a repeat), plus explicit ``<a id=...>`` anchors."""
    text = path.read_text(encoding="utf-8")
    found: set[str] = set()
    used: dict[str, int] = {}
    for _, line in prose_lines(text.replace("`", "")):  # a heading's code spans count as text
        found.update(_HTML_ANCHOR.findall(line))
        match = _HEADING.match(line)
        if not match:
            continue
        heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", match.group(2))  # a link in a heading: its text
        base = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = used.get(base, 0)
        used[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def test_api_reference_is_generated() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "api_reference.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr or done.stdout


def broken_links(pages: list[Path]) -> tuple[int, list[str]]:
    """The relative links checked in ``pages``, and those whose file (or heading anchor, in a .md) is missing."""
    page_anchors: dict[Path, set[str]] = {}
    broken: list[str] = []
    checked = 0
    for page in pages:
        for number, line in prose_lines(page.read_text(encoding="utf-8")):
            for target in [*_LINK.findall(line), *_IMAGE.findall(line)]:
                if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:
                    continue
                checked += 1
                path_part, _, fragment = target.partition("#")
                where = f"{page.name}:{number}: {target}"
                destination = (page.parent / path_part).resolve() if path_part else page
                if not destination.exists():
                    broken.append(f"{where} (no such file)")
                elif (
                    fragment
                    and destination.suffix == ".md"
                    and fragment not in page_anchors.setdefault(destination, anchors(destination))
                ):
                    broken.append(f"{where} (no heading with that anchor)")
    return checked, broken


def test_relative_links_land() -> None:
    checked, broken = broken_links([REPO / "README.md", *sorted(DOCS.glob("*.md"))])
    assert checked > 100  # the pages link to one another a great deal; far fewer means the parser broke
    assert not broken, "broken links:\n" + "\n".join(broken)
    index_links = {link for _, line in prose_lines(INDEX.read_text(encoding="utf-8")) for link in _LINK.findall(line)}
    assert "api.md" in index_links


def test_link_check_catches_what_it_should(tmp_path: Path) -> None:
    (tmp_path / "b.md").write_text("# Title\n\n## The `fit` call\n\n## The fit call\n", encoding="utf-8")
    page = tmp_path / "a.md"
    page.write_text(
        "[ok](b.md#the-fit-call-1) [ok](b.md#title) [ok](#here) ![ok](b.md) [web](https://example.com/x.md)\n"
        "# Here\n"
        "[file](c.md) [anchor](b.md#nothing) `[in code](d.md)`\n"
        "```\n[in a block](e.md)\n```\n",
        encoding="utf-8",
    )
    checked, broken = broken_links([page])
    assert checked == 6
    assert broken == ["a.md:3: c.md (no such file)", "a.md:3: b.md#nothing (no heading with that anchor)"]


# Runs the blocks in one namespace; prints nothing itself; writes each block's output as JSON to argv[1].
_RUNNER = r"""
import contextlib, io, json, sys

sys.path.insert(0, "tests")
source = json.load(sys.stdin)
namespace = {"__name__": "__main__"}
outputs = []
server = None
try:
    for code, needs_server in source:
        if needs_server:
            if server is None:
                from assets import template, tokenizer_dir
                from openai_server import ChatServer

                server = ChatServer(
                    tokenizer_dir("qwen2"), chat_template=template("Qwen-Qwen2.5-7B-Instruct"), max_model_len=4096
                ).start()
            code = code.replace(URL, server.base_url)
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            exec(compile(code, f"<docs/index.md block {len(outputs) + 1}>", "exec"), namespace)
        outputs.append(buffer.getvalue())
finally:
    if server is not None:
        server.close()
with open(sys.argv[1], "w", encoding="utf-8") as out:
    json.dump(outputs, out)
"""


def index_examples() -> list[tuple[str, bool, str | None, int]]:
    """docs/index.md's Python blocks to run: (code, needs the server, the output shown or None, line)."""
    found = blocks(INDEX.read_text(encoding="utf-8"))
    examples: list[tuple[str, bool, str | None, int]] = []
    for index, (language, body, line) in enumerate(found):
        if language != "python" or body.lstrip().startswith(SKIP_MARKER):
            continue
        after = found[index + 1] if index + 1 < len(found) else None
        shown = after[1] if after is not None and after[0] == "text" else None
        examples.append((body, body.lstrip().startswith(SERVER_MARKER), shown, line))
    return examples


def test_index_examples_run_and_print_what_is_shown(tmp_path: Path) -> None:
    require_assets()
    examples = index_examples()
    assert len(examples) >= 4  # count, the same count by transformers, fit, wrap
    assert any(server for _, server, _, _ in examples)
    results = tmp_path / "outputs.json"
    done = subprocess.run(
        [sys.executable, "-c", _RUNNER.replace("URL", repr(DOC_SERVER_URL)), str(results)],
        input=json.dumps([(code, server) for code, server, _, _ in examples]),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    outputs: list[str] = json.loads(results.read_text(encoding="utf-8"))
    assert len(outputs) == len(examples)
    stale = [
        f"docs/index.md line {line}: the block now prints\n{printed.rstrip()}\n"
        for (_, _, shown, line), printed in zip(examples, outputs, strict=True)
        if shown is not None and printed.rstrip("\n") != shown.rstrip("\n")
    ]
    assert not stale, "paste the new output under each block:\n\n" + "\n".join(stale)
