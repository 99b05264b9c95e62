"""The layout holds: the parts named in docs/architecture.md, imports that run one way, no reach into another
package's private modules, and a bound on how complex one function may be."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import contextkeeper as ck

SRC = Path(ck.__file__).resolve().parent
ROOT = SRC.parents[1]

# What sits directly under src/contextkeeper besides packages (docs/architecture.md says what each is for).
TOP_MODULES = {"__init__", "__main__", "_exceptions", "_memo", "cli", "config", "demo", "keeper", "memo"}
PACKAGES = {
    "backends",
    "calls",
    "diagnose",
    "fit",
    "formats",
    "integrations",
    "memory",
    "messages",
    "proxy",
    "servers",
    "strategies",
    "testing",
    "tokens",
}

MAX_COMPLEXITY = 25  # radon's cyclomatic complexity of one function or method


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(SRC.rglob("*.py"))}


def runtime_imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement that can run, those inside functions included; not those under ``if
    TYPE_CHECKING:`` (read by type checkers only)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for branch in node.orelse:
                yield from runtime_imports(ast.Module(body=[branch], type_ignores=[]))
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from runtime_imports(node)


def imported(module: str) -> dict[str, int]:
    """The package's modules ``module`` imports, each with the line of its first import."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: dict[str, int] = {}
    for node in runtime_imports(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # ``from package import submodule`` imports the submodule; ``from module import name`` the module.
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source for a in node.names]
        for target in targets:
            if target in MODULES and target != module:
                found.setdefault(target, node.lineno)
    return found


GRAPH = {module: imported(module) for module in MODULES}


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_the_top_of_the_package_holds_the_named_parts_only() -> None:
    modules = {path.stem for path in SRC.glob("*.py")}
    packages = {path.parent.name for path in SRC.glob("*/__init__.py")}
    assert modules == TOP_MODULES
    assert packages == PACKAGES


def test_imports_run_one_way() -> None:
    # Each cycle as its modules and what each imports of the others (with the line): where to cut it.
    described = [{m: {t: line for t, line in GRAPH[m].items() if t in cycle} for m in cycle} for cycle in cycles(GRAPH)]
    assert described == []


def test_the_check_sees_imports_inside_functions_and_finds_cycles() -> None:
    # (not vacuous: an import inside a function counts, one under TYPE_CHECKING does not, and a cycle is found)
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\ndef f():\n    import b\n"
    assert [alias.name for node in runtime_imports(ast.parse(source)) for alias in node.names] == ["TYPE_CHECKING", "b"]
    assert cycles({"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}) == [["a", "b", "c"]]
    assert GRAPH["contextkeeper.keeper"]["contextkeeper.backends"]  # keeper.wrap imports the facades in a function


def test_nothing_imports_another_packages_private_module() -> None:
    reaches = []
    for module, targets in GRAPH.items():
        package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
        for target, line in targets.items():
            parts = target.split(".")
            private = next((i for i, part in enumerate(parts) if part.startswith("_") and i > 0), None)
            if private is None or parts[private] in ("__init__", "__main__"):
                continue
            owner = ".".join(parts[:private])
            if owner == "contextkeeper":
                continue  # _exceptions and _memo: the package's own shared modules
            if package != owner and not package.startswith(owner + "."):
                reaches.append(f"{module} (line {line}) -> {target}")
    assert reaches == []


def _functions() -> Iterator[tuple[str, int]]:
    from radon.complexity import cc_visit

    for path in sorted(SRC.rglob("*.py")):
        relative = path.relative_to(SRC).as_posix()
        for block in cc_visit(path.read_text(encoding="utf-8")):
            yield f"{relative}:{block.fullname}", block.complexity
            for closure in getattr(block, "closures", ()):
                yield f"{relative}:{block.fullname}.{closure.name}", closure.complexity


def test_no_function_is_more_complex_than_the_bound() -> None:
    pytest.importorskip("radon")
    found = dict(_functions())
    assert len(found) > 1000  # (every function was read)
    over = {name: cc for name, cc in found.items() if cc > MAX_COMPLEXITY}
    assert over == {}, f"split these (cyclomatic complexity over {MAX_COMPLEXITY})"


def test_the_architecture_page_names_every_package_and_module() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    tree = page.split("## The layers", 1)[1].split("```", 2)[1]
    # Each top-level package's section runs from its line ("  name/") to the next line indented as little.
    sections: dict[str, str] = {}
    current = "contextkeeper"
    for line in tree.splitlines():
        head = line[2:].split(" ", 1)[0] if line.startswith("  ") and not line.startswith("   ") else ""
        if head.endswith("/"):
            current = head.rstrip("/")
        elif head:
            current = "contextkeeper"
        sections[current] = sections.get(current, "") + line + "\n"
    missing = []
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC).parts
        top = parts[0] if len(parts) > 1 else "contextkeeper"
        text = sections.get(top)
        if text is None:
            missing.append(f"{top}/")
            continue
        names = [f"{part}/" for part in parts[1:-1]] + ([path.name] if path.name != "__init__.py" else [])
        missing += [f"{'/'.join(parts)} ({name})" for name in names if name not in text]
    assert missing == []
