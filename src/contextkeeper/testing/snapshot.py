"""Prompt snapshots: the fitted prompt of a golden conversation, pinned in a JSON file next to the test.

``<test dir>/__snapshots__/<test module>/<name>.json`` holds ``{"tokens": ..., "messages": [...]}``. A missing
snapshot is written and the test fails once (review the file and commit it); a changed prompt fails with a
diff; ``pytest --update-prompt-snapshots`` rewrites them.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["SnapshotLog", "SnapshotStore", "dump_fit"]

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")
_MAX_DIFF_LINES = 120


@dataclass
class SnapshotLog:
    """What the session wrote, for the terminal summary."""

    created: list[Path] = field(default_factory=list)
    updated: list[Path] = field(default_factory=list)


def _plain(value: Any) -> Any:
    for method in ("to_dict", "model_dump"):
        convert = getattr(value, method, None)
        if callable(convert):
            return convert()
    raise TypeError(f"cannot store {type(value).__name__} in a prompt snapshot")


def dump_fit(fit: Any) -> str:
    """The snapshot text of a Fit (or anything with ``messages`` and ``tokens``): stable, indented JSON."""
    data = {"tokens": int(fit.tokens), "messages": list(fit.messages)}
    return json.dumps(data, indent=2, ensure_ascii=False, default=_plain) + "\n"


class SnapshotStore:
    """The snapshots of one test: ``check(fit, name)`` compares, writes or updates."""

    def __init__(self, directory: Path, test_name: str, *, update: bool, log: SnapshotLog) -> None:
        self.directory = directory
        self.test_name = test_name
        self.update = update
        self.log = log
        self._used: set[str] = set()

    def __call__(self, fit: Any, name: str | None = None) -> Path:
        """``prompt_snapshot(fit, name=None)``: the same as :meth:`check`."""
        __tracebackhide__ = True
        return self.check(fit, name)

    def _name(self, name: str | None, *, register: bool = True) -> str:
        base = _UNSAFE.sub("_", name if name is not None else self.test_name).strip("_") or "snapshot"
        chosen, number = base, 1
        if name is None:  # several unnamed snapshots in one test: test, test-2, test-3, ...
            while chosen in self._used:
                number += 1
                chosen = f"{base}-{number}"
        elif chosen in self._used:
            raise ValueError(f"prompt snapshot name {chosen!r} is used twice in {self.test_name}")
        if register:
            self._used.add(chosen)
        return chosen

    def check(self, fit: Any, name: str | None = None) -> Path:
        """Compare ``fit`` with its snapshot; fail with a diff when it changed. Returns the snapshot's path."""
        __tracebackhide__ = True
        path = self.directory / f"{self._name(name)}.json"
        text = dump_fit(fit)
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            self.log.created.append(path)
            if not self.update:
                raise AssertionError(
                    f"prompt snapshot {path} did not exist: it has been written ({fit.tokens:,} tokens, "
                    f"{len(fit.messages)} messages). Review it and commit it; the next run compares against it."
                )
            return path
        stored = path.read_text(encoding="utf-8")
        try:
            old = json.loads(stored)
        except json.JSONDecodeError:
            old = None
        if old == json.loads(text):
            return path
        if self.update:
            path.write_text(text, encoding="utf-8")
            self.log.updated.append(path)
            return path
        raise AssertionError(_changed(path, old, stored, text))


def _changed(path: Path, old: Any, stored: str, text: str) -> str:
    new = json.loads(text)
    lines = [f"the fitted prompt changed from its snapshot {path}"]
    if isinstance(old, dict):
        before_tokens, before_messages = old.get("tokens"), old.get("messages")
        if isinstance(before_tokens, int):
            delta = new["tokens"] - before_tokens
            lines.append(f"  tokens:   {before_tokens:,} -> {new['tokens']:,} ({delta:+,})")
        if isinstance(before_messages, list):
            lines.append(f"  messages: {len(before_messages)} -> {len(new['messages'])}")
            changed = _changed_messages(before_messages, new["messages"])
            if changed:
                lines.append("  " + "; ".join(changed))
        stored = json.dumps(old, indent=2, ensure_ascii=False) + "\n"  # compare like with like
    else:
        lines.append("  (the stored file is not valid JSON)")
    diff = list(difflib.unified_diff(stored.splitlines(), text.splitlines(), "snapshot", "this run", lineterm=""))
    if len(diff) > _MAX_DIFF_LINES:
        diff = [*diff[:_MAX_DIFF_LINES], f"... {len(diff) - _MAX_DIFF_LINES} more diff line(s)"]
    lines += ["", *diff, "", "if the new prompt is right, accept it: pytest --update-prompt-snapshots"]
    return "\n".join(lines)


def _changed_messages(old: list[Any], new: list[Any]) -> list[str]:
    """Which messages were removed, added or changed, by position in the snapshot and in this run."""
    key = [json.dumps(m, sort_keys=True) for m in old], [json.dumps(m, sort_keys=True) for m in new]
    out: list[str] = []
    for tag, a0, a1, b0, b1 in difflib.SequenceMatcher(a=key[0], b=key[1], autojunk=False).get_opcodes():
        if tag == "delete":
            out.append(f"removed: snapshot message(s) {_span(a0, a1)} ({_roles(old[a0:a1])})")
        elif tag == "insert":
            out.append(f"added: message(s) {_span(b0, b1)} of this run ({_roles(new[b0:b1])})")
        elif tag == "replace":
            out.append(
                f"changed: snapshot message(s) {_span(a0, a1)} -> message(s) {_span(b0, b1)} of this run "
                f"({_roles(new[b0:b1])})"
            )
    return out


def _span(start: int, stop: int) -> str:
    return str(start) if stop - start == 1 else f"{start}-{stop - 1}"


def _roles(messages: list[Any]) -> str:
    return ", ".join(str(m.get("role", "?")) if isinstance(m, dict) else "?" for m in messages)
