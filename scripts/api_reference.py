#!/usr/bin/env python3
"""Write docs/api.md, the API reference, from the package's public surface.

    python scripts/api_reference.py            # (re)write docs/api.md
    python scripts/api_reference.py --check    # exit 1 when docs/api.md is not what this would write

What it reads: ``contextkeeper.__all__``, grouped by subject (by the package of the module that defines each
name), then the ``__all__`` of every public subpackage that has one. Each name gets its kind, its signature
(``inspect.signature``; one line, or one parameter a line past 100 characters), the first paragraph of its
docstring (for a constant or a type alias: the comment above its assignment) and the module that defines it. A
name a subpackage shares with the top level (or with a subpackage before it) is linked, not repeated.

Only imports: no GPU, no network, no model files. ``contextkeeper.proxy`` needs the ``proxy`` extra
(``pip install -e '.[proxy]'``); the optional heavy dependencies (transformers, torch, mistral-common) are not
imported, since contextkeeper loads them on first use. Addresses in reprs (``at 0x...``) are removed, so the
output depends only on the code.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import importlib
import inspect
import os
import pkgutil
import re
import sys
import types
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
OUTPUT = REPO_ROOT / "docs" / "api.md"
COMMAND = "python scripts/api_reference.py"
WIDTH = 100  # a signature longer than this is written one parameter a line

# contextkeeper.__all__ by subject: the first package of the defining module (relative to contextkeeper) picks the
# group; "" is the package itself (__version__). A name from a package not listed here stops the script.
GROUPS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("Keeper and fit", "The composition root and what a fit returns.", ("", "keeper", "fit")),
    ("Messages", "The validated OpenAI-format message model and its two views.", ("messages",)),
    (
        "Counting",
        "Counters, a prompt's tokens by slot, what each server counts (dialects, detection, calibration), and the "
        "byte-bounded caches counting keeps.",
        ("tokens", "servers", "_memo"),
    ),
    ("Strategies and policies", "Policy files and their loading.", ("strategies",)),
    ("Memory planning", "KV cache, weights, GPUs and plans: pure numbers.", ("memory",)),
    ("Diagnostics", "`doctor`, `profile` and `MemoryMonitor`.", ("diagnose",)),
    (
        "Wrapped calls and shared state",
        "What a wrapped call reports, KV admission, state shared across replicas, the transcript.",
        ("calls", "backends", "proxy"),
    ),
    ("Errors and warnings", "The error tree and the warnings (see [errors.md](errors.md)).", ("_exceptions",)),
)
# Public subpackages in this order; any other one with an __all__ follows, by name.
SUBPACKAGES = ("calls", "strategies", "tokens", "memory", "diagnose", "messages", "proxy", "backends", "testing")

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_MODULE_PATH = re.compile(r"\b(?:[a-z_][a-z0-9_]*\.)+(?=[A-Za-z_])")
_QUOTED = re.compile(r"('[^']*'|\"[^\"]*\")")
_ROLE = re.compile(r":[a-z]+:`~?\.?([^`]+)`")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One public name: where it is exported, what it is, how it is called, what it says it does."""

    qualified: str  # contextkeeper.tokens.Breakdown
    name: str
    kind: str
    module: str  # the module that defines it
    signature: str | None
    summary: str


class _Raw(str):
    """Text that ``inspect`` writes as it is (its repr is itself)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return str(self)


# -- reading a name ----------------------------------------------------------------------------------------------


def kind_of(value: Any) -> str:
    if inspect.isclass(value):
        if issubclass(value, Warning):
            return "warning"
        if issubclass(value, BaseException):
            return "exception"
        if issubclass(value, enum.Enum):
            return "enum"
        if getattr(value, "_is_protocol", False):
            return "protocol"
        return "class"
    if is_type_alias(value):
        return "type alias"
    if inspect.iscoroutinefunction(value):
        return "async function"
    if inspect.isroutine(value) or (callable(value) and hasattr(value, "__wrapped__")):
        return "function"
    return "constant"


def is_type_alias(value: Any) -> bool:
    if isinstance(value, (types.GenericAlias, types.UnionType)):
        return True
    type_alias = getattr(types, "TypeAliasType", None) or getattr(sys.modules.get("typing"), "TypeAliasType", None)
    if type_alias is not None and isinstance(value, type_alias):
        return True
    return type(value).__module__ == "typing" and not inspect.isclass(value)


def clean_annotation(annotation: Any) -> str:
    """An annotation as short text: source text as written, else without module paths."""
    if isinstance(annotation, str):
        return annotation
    text = inspect.formatannotation(annotation)
    # Module paths go (typing., collections.abc., contextkeeper.messages.models.); quoted literals stay as they are.
    return "".join(
        part if _QUOTED.fullmatch(part) else _MODULE_PATH.sub("", part) for part in _QUOTED.split(text) if part
    )


def clean_value(value: Any, limit: int = 160) -> str:
    if inspect.isclass(value) or inspect.isroutine(value):
        text = value.__qualname__
    elif isinstance(value, enum.Enum):
        text = f"{type(value).__name__}.{value.name}"
    elif is_type_alias(value):
        text = clean_annotation(value)
    elif isinstance(value, Mapping):
        items = sorted(value.items(), key=lambda item: repr(item[0]))
        text = "{" + ", ".join(f"{key!r}: {clean_value(item, 60)}" for key, item in items) + "}"
    else:
        text = _ADDRESS.sub("", repr(value))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def signature_of(name: str, value: Any, kind: str) -> str | None:
    if kind in ("constant", "type alias", "enum", "protocol"):
        return None
    try:
        signature = inspect.signature(value)
    except (TypeError, ValueError):
        return None
    parts: list[str] = []
    previous: inspect._ParameterKind | None = None
    for parameter in signature.parameters.values():
        if parameter.name.startswith("_"):  # private (a dataclass's internal fields)
            continue
        if previous == inspect.Parameter.POSITIONAL_ONLY and parameter.kind != previous:
            parts.append("/")
        if parameter.kind == inspect.Parameter.KEYWORD_ONLY and previous not in (
            inspect.Parameter.KEYWORD_ONLY,
            inspect.Parameter.VAR_POSITIONAL,
        ):
            parts.append("*")
        shown = parameter.replace(
            annotation=parameter.empty
            if parameter.annotation is parameter.empty
            else _Raw(clean_annotation(parameter.annotation)),
            default=parameter.empty if parameter.default is parameter.empty else _Raw(clean_value(parameter.default)),
        )
        parts.append(str(shown))
        previous = parameter.kind
    if previous == inspect.Parameter.POSITIONAL_ONLY:
        parts.append("/")
    returns = ""
    if kind not in ("class", "exception", "warning") and signature.return_annotation is not signature.empty:
        returns = f" -> {clean_annotation(signature.return_annotation)}"
    line = f"{name}({', '.join(parts)}){returns}"
    if len(line) <= WIDTH:
        return line
    return f"{name}(\n" + "".join(f"    {part},\n" for part in parts) + f"){returns}"


def protocol_methods(protocol: type) -> str | None:
    """A protocol's own public attributes, properties and methods, one a line."""
    lines = [
        f"{name}: {clean_annotation(annotation)}"
        for name, annotation in inspect.get_annotations(protocol).items()
        if not name.startswith("_")
    ]
    for name, member in protocol.__dict__.items():
        if name.startswith("_"):
            continue
        if isinstance(member, property):
            getter = member.fget
            returns = inspect.signature(getter).return_annotation if getter is not None else inspect.Signature.empty
            shown = "" if returns is inspect.Signature.empty else f": {clean_annotation(returns)}"
            lines.append(f"{name}{shown}  # property")
            continue
        function = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
        if inspect.isfunction(function):
            kind = "async function" if inspect.iscoroutinefunction(function) else "function"
            text = signature_of(name, function, kind)
            if text:
                lines.append(("async def " if kind == "async function" else "def ") + text)
    return "\n".join(lines) or None


def first_paragraph(doc: str | None) -> str:
    if not doc:
        return ""
    paragraph = inspect.cleandoc(doc).split("\n\n")[0]
    text = " ".join(line.strip() for line in paragraph.splitlines())
    text = _ROLE.sub(lambda match: f"`{match.group(1)}`", text).replace("``", "`")
    # Outside code spans, "<name>" would be read as an HTML tag.
    pieces = text.split("`")
    return "`".join(piece if index % 2 else piece.replace("<", "&lt;") for index, piece in enumerate(pieces))


def own_doc(value: Any, kind: str) -> str | None:
    if kind in ("constant", "type alias"):
        return None
    if inspect.isclass(value):
        doc = value.__dict__.get("__doc__")
        # A dataclass without a docstring gets its signature as one.
        if isinstance(doc, str) and doc.startswith(f"{value.__name__}("):
            return None
        return doc if isinstance(doc, str) else None
    doc = getattr(value, "__doc__", None)
    return doc if isinstance(doc, str) else None


def assignment(module: types.ModuleType, name: str) -> tuple[str | None, str] | None:
    """Where ``module`` assigns ``name`` at its top level: (the assignment's source text, its comment or docstring).

    The source text is ``[: annotation] = value``, or ``: annotation`` alone for a dict, list or set filled at run
    time (its contents depend on what was imported).
    """
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):
        return None
    tree = ast.parse(source)
    lines = source.splitlines()
    body = tree.body
    for index, node in enumerate(body):
        targets: list[ast.expr] = []
        value: ast.expr | None = None
        annotation: ast.expr | None = None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign):
            targets, value, annotation = [node.target], node.value, node.annotation
        if not any(isinstance(target, ast.Name) and target.id == name for target in targets):
            continue
        shown = f": {_segment(source, annotation)}" if annotation is not None else ""
        if value is not None and not (annotation is not None and isinstance(value, (ast.Dict, ast.List, ast.Set))):
            shown += f" = {_segment(source, value)}"
        after = body[index + 1] if index + 1 < len(body) else None
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            return shown, after.value.value
        comment: list[str] = []
        line = node.lineno - 2
        while line >= 0 and lines[line].lstrip().startswith("#"):
            comment.insert(0, lines[line].strip().lstrip("#").strip())
            line -= 1
        return shown, " ".join(comment)
    return None


def _segment(source: str, value: ast.expr | None) -> str | None:
    if value is None:
        return None
    text = ast.get_source_segment(source, value)
    return None if text is None else " ".join(text.split())


def defining_module(value: Any, name: str, exporter: str) -> tuple[str, tuple[str | None, str] | None]:
    """The module that defines ``value``, and for a constant or alias its assignment there."""
    if inspect.isclass(value) or inspect.isroutine(value):
        return str(value.__module__), None
    # A constant or alias: the contextkeeper module that assigns it at its top level and holds this very object.
    for module_name in sorted(sys.modules):
        if module_name != "contextkeeper" and not module_name.startswith("contextkeeper."):
            continue
        module = sys.modules[module_name]
        if getattr(module, name, None) is not value:
            continue
        found = assignment(module, name)
        if found is not None:
            return module_name, found
    return exporter, None


def entry(exporter: str, name: str) -> Entry:
    value = getattr(importlib.import_module(exporter), name)
    kind = kind_of(value)
    module, found = defining_module(value, name, exporter)
    signature = signature_of(name, value, kind)
    summary = first_paragraph(own_doc(value, kind))
    if kind in ("constant", "type alias"):
        shown = found[0] if found and found[0] else f" = {clean_value(value)}"
        if len(shown) > WIDTH * 2:
            shown = shown[: WIDTH * 2 - 1] + "…"
        signature = f"{name}{shown}"
        summary = first_paragraph(found[1]) if found else ""
    elif kind == "enum":
        signature = f"{name}: " + ", ".join(member.name for member in value)
    elif kind == "protocol":
        signature = protocol_methods(value)
    return Entry(f"{exporter}.{name}", name, kind, module, signature, summary)


# -- the page ----------------------------------------------------------------------------------------------------


class Anchors:
    """GitHub's heading anchors, given the headings in page order: the text lower-cased, punctuation dropped,
    spaces as hyphens, and ``-1``, ``-2``... after a repeat (``Plan`` and ``plan`` share ``contextkeeperplan``)."""

    def __init__(self) -> None:
        self.used: dict[str, int] = {}

    def __call__(self, heading: str) -> str:
        base = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = self.used.get(base, 0)
        self.used[base] = count + 1
        return base if count == 0 else f"{base}-{count}"


def render(item: Entry) -> Iterator[str]:
    yield f"#### `{item.qualified}`"
    yield ""
    yield f"*{item.kind}* in `{item.module}`"
    yield ""
    if item.signature:
        yield "```python"
        yield from item.signature.splitlines()
        yield "```"
        yield ""
    if item.summary:
        yield item.summary
        yield ""


def group_of(item: Entry) -> str:
    relative = item.module.removeprefix("contextkeeper").removeprefix(".")
    first = relative.split(".")[0]
    for title, _, packages in GROUPS:
        if first in packages:
            return title
    raise SystemExit(
        f"{item.qualified} is defined in {item.module}, which no group of {Path(__file__).name} covers; add "
        f"{first!r} to GROUPS"
    )


def subpackages() -> list[str]:
    package = importlib.import_module("contextkeeper")
    found = sorted(
        info.name for info in pkgutil.iter_modules(package.__path__) if info.ispkg and not info.name.startswith("_")
    )
    ordered = [name for name in SUBPACKAGES if name in found] + [name for name in found if name not in SUBPACKAGES]
    return [name for name in ordered if hasattr(importlib.import_module(f"contextkeeper.{name}"), "__all__")]


def generate() -> str:
    package = importlib.import_module("contextkeeper")
    top = [entry("contextkeeper", name) for name in package.__all__]
    anchors = Anchors()
    seen: dict[tuple[str, int], str] = {}  # (name, id of the object) -> the anchor of its full entry
    title, section = "API reference", "`contextkeeper`"
    anchors(title)
    anchors(section)
    lines = [
        f"# {title}",
        "",
        f"<!-- Generated by `{COMMAND}` from the package's `__all__` lists; do not edit by hand. -->",
        "",
        f"contextkeeper {package.__version__}. First the flat API (`import contextkeeper as ck`: every name loads on "
        "first use), grouped by subject, then each public subpackage's own `__all__`. Each name: its kind, the "
        "module that defines it, its signature and the first paragraph of its docstring. A subpackage's name that "
        "is the same object as one documented before is linked to it. The guides are listed in "
        "[index.md](index.md).",
        "",
        f"## {section}",
        "",
    ]
    contents: list[str] = []
    body: list[str] = []
    for group, blurb, _ in GROUPS:
        members = [item for item in top if group_of(item) == group]
        if not members:
            continue
        contents.append(f"* [{group}](#{anchors(group)}): " + ", ".join(f"`{item.name}`" for item in members))
        body += [f"### {group}", "", blurb, ""]
        for item in members:
            seen.setdefault((item.name, id(getattr(package, item.name))), anchors(f"`{item.qualified}`"))
            body += render(item)
    lines += [*contents, "", *body]
    for sub in subpackages():
        module = importlib.import_module(f"contextkeeper.{sub}")
        heading = f"`contextkeeper.{sub}`"
        anchors(heading)
        lines += [f"## {heading}", ""]
        intro = first_paragraph(module.__doc__)
        if intro:
            lines += [intro, ""]
        shared: list[str] = []
        entries: list[str] = []
        for name in module.__all__:
            value = getattr(module, name)
            key = (name, id(value))
            if key in seen and kind_of(value) not in ("constant", "type alias"):
                shared.append(f"[`{name}`](#{seen[key]})")
                continue
            item = entry(f"contextkeeper.{sub}", name)
            seen.setdefault(key, anchors(f"`{item.qualified}`"))
            entries += render(item)
        if shared:
            lines += [f"Also exported here, documented above: {', '.join(shared)}.", ""]
        lines += entries
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="exit 1 when the file is not what would be written")
    parser.add_argument("--output", type=Path, default=OUTPUT, help=f"default: {OUTPUT.relative_to(REPO_ROOT)}")
    args = parser.parse_args(argv)
    # Nothing here may reach a network or a GPU.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    sys.path.insert(0, str(REPO_ROOT / "src"))
    text = generate()
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.exists() else ""
        if current != text:
            print(f"{args.output} is stale: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    args.output.write_text(text, encoding="utf-8")
    print(f"wrote {args.output} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
