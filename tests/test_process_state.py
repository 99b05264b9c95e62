"""State has an owner: nothing at module level changes between calls except the registries, process resources
and the memo module listed here, each with the reason it lives there; caches go through _memo.py."""

from __future__ import annotations

import ast
import os
import time
from pathlib import Path

import contextkeeper as ck
from contextkeeper.strategies import policy as policy_module

SRC = Path(ck.__file__).resolve().parent
MUTATORS = {"append", "add", "update", "setdefault", "pop", "clear", "extend", "insert", "remove", "popitem"}
MUTATORS |= {"discard", "move_to_end", "appendleft"}

# module:name -> why it is module state. Anything else that a function changes is a finding.
ALLOWED = {
    "_memo.py:_SLOTS": "the memo module itself: slot names per class, for sizing entries",
    "backends/registry.py:_WRAPPERS": "registry: register_wrapper adds a client kind",
    "backends/openai.py:_REAPER": "the one thread that closes streams dropped unread (started once per process)",
    "memory/dtypes.py:_ALIASES": "registry: dtypes register their names at import",
    "memory/dtypes.py:_KV": "registry: the KV dtypes, filled at import",
    "memory/dtypes.py:_TYPES": "registry: the dtypes, filled at import",
    "memory/dtypes.py:_WEIGHTS": "registry: the weight dtypes, filled at import",
    "tokens/prefix.py:_METERS": "registry: register_meter adds a counter kind's prefix meter",
    "strategies/policy.py:_REGISTERED": "configuration: the policy folders register_policy_path adds, in order",
    "strategies/_embeddings.py:_LOADED": "process resource: an embedding model, loaded once per process (seconds), "
    "never evicted and reloaded as a cache entry would be",
    "strategies/base.py:STRATEGIES": "registry: @register adds a strategy (registry.py loads the built-ins)",
    "strategies/base.py:_SETTINGS": "registry: each strategy's settings model, added with it",
    "tokens/loading.py:_LOADED": "process resource: the light tokenizers in use, shared by the counters of one "
    "tokenizer (weak references: gone with the last counter), never copied per counter",
    "tokens/render/split.py:CHECKS": "registry: the named split checks, in order, added at import",
    "calls/transcript/base.py:_OWNERS": "process identity: this process as stored with its calls "
    "(must not change while it runs)",
}


def module_state() -> set[str]:
    """Module-level names that some function of the same module changes (item assignment or a mutating call)."""
    found: set[str] = set()
    for file in sorted(SRC.rglob("*.py")):
        tree = ast.parse(file.read_text(encoding="utf-8"))
        names: set[str] = set()
        for node in tree.body:
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                changed: ast.expr | None = None
                if isinstance(node, (ast.Assign, ast.Delete)):
                    for target in node.targets:
                        if isinstance(target, ast.Subscript):
                            changed = target.value
                elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Subscript):
                    changed = node.target.value
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
                    changed = node.func.value
                if isinstance(changed, ast.Name) and changed.id in names:
                    found.add(f"{file.relative_to(SRC).as_posix()}:{changed.id}")
    return found


def test_module_state_is_only_registries_resources_and_the_memo() -> None:
    found = module_state()
    assert found - set(ALLOWED) == set(), "module-level state changed by functions; own it in a Session or _memo.py"
    assert set(ALLOWED) - found == set(), "listed as module state but no longer changed: drop it from ALLOWED"


def test_a_policy_file_is_parsed_once_per_version_in_the_shared_cache(tmp_path: Path) -> None:
    folder = tmp_path / "policies"
    folder.mkdir()
    file = folder / "mine.toml"
    file.write_text('name = "mine"\nmatch = ["my-model*"]\n[[steps]]\nstrategy = "dedupe"\n', encoding="utf-8")
    ck.register_policy_path(folder)
    try:
        first = policy_module.resolve_policy("auto", "my-model-7b")
        assert first.name == "mine"
        assert policy_module.resolve_policy("auto", "my-model-7b") is first  # parsed once
        assert "policy.files" in ck.memo.cache_usage().by_name
        file.write_text(
            'name = "mine"\nmatch = ["my-model*"]\n[[steps]]\nstrategy = "truncate"\nmax_tokens = 50\n',
            encoding="utf-8",
        )
        later = time.time() + 5
        os.utime(file, (later, later))  # a new version, whatever the file system's clock resolution
        changed = policy_module.resolve_policy("auto", "my-model-7b")
        assert [step.strategy for step in changed.steps] == ["truncate"]
    finally:
        policy_module._REGISTERED.remove(folder.resolve())
