"""Writing a benchmark's section of docs/benchmarks.md (or another page), between its ``<!-- NAME:start -->`` and
``<!-- NAME:end -->`` markers, so each script refreshes its own section and leaves the rest of the page alone."""

from __future__ import annotations

from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


def write_section(name: str, block: str, *, heading: str | None = None, doc: Path = DOC) -> None:
    """Replace section ``name`` of ``doc`` with ``block`` (which carries its own markers), or append it, under
    ``heading`` when given, if the page has no such section yet."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    text = doc.read_text(encoding="utf-8") if doc.exists() else ""
    if start in text:
        head, rest = text.split(start, 1)
        text = head + block + rest.split(end, 1)[1]
    elif heading is not None:
        text = text.rstrip("\n") + "\n\n" + heading + "\n\n" + block + "\n"
    else:
        text += ("\n" if text else "") + block + "\n"
    doc.write_text(text, encoding="utf-8")
