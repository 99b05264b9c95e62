"""Stopping the head's backward scan for "the last user query" once its flag is down (see :func:`stop_scans`)."""

from __future__ import annotations

import copy
from collections.abc import Callable

from jinja2 import nodes

from .syntax import walk


def stop_scans(body: list[nodes.Node]) -> list[nodes.Node]:
    """``body`` with a ``{% break %}`` after the flag write of each loop that only scans until a flag goes down.

    Templates find "the last user query" by scanning the messages backwards: ``{% for m in messages[::-1] %}
    {% set i = ... %}{% if ns.flag and <test> %}{% set ns.flag = false %}{% set ns.i = i %}{% endif %}
    {% endfor %}`` (Qwen3 and its descendants). Once ``ns.flag`` is false every later iteration only sets loop
    variables nobody reads and skips the ``if`` (the flag comes first in its ``and`` and nothing in the loop sets
    it again), so stopping there renders the same text and leaves the same namespace: a long conversation is no
    longer scanned to its first message on every render. Loops of any other shape are left as they are."""
    out = []
    for node in body:
        if isinstance(node, nodes.For):
            stopped = stopped_scan(node)
            if stopped is not None:
                node = stopped
        out.append(node)
    return out


def stopped_scan(loop: nodes.For) -> nodes.For | None:
    """``loop`` with the ``break`` added, when it has exactly the scan's shape; else None."""
    guard = _scan_test(loop)
    if guard is None or not _lowers_its_flag_once(loop, guard):
        return None
    stopped = copy.copy(loop)
    stopped.body = [n for n in loop.body if n is not guard]
    stopped_guard = copy.copy(guard)
    stopped_guard.body = [*guard.body, nodes.Break(lineno=guard.lineno)]
    stopped.body.insert(loop.body.index(guard), stopped_guard)
    return stopped


def _scan_test(loop: nodes.For) -> nodes.If | None:
    """The loop's one ``if`` (no elif, no else), when everything else in a plain loop is a quiet assignment."""
    if loop.test is not None or loop.else_ or loop.recursive:
        return None
    test = _only_if(loop.body)
    if test is None:
        return None
    sequence = loop.iter.node if isinstance(loop.iter, nodes.Getitem) else loop.iter
    sequence_name = sequence.name if isinstance(sequence, nodes.Name) else None
    # Besides the ``if``: only loop-local variables set from expressions that cannot fail.
    if all(node is test or _quiet_assignment(node, sequence_name) for node in loop.body):
        return test
    return None


def _only_if(body: list[nodes.Node]) -> nodes.If | None:
    """The one ``if`` among ``body``'s statements, when there is exactly one and it has no elif or else."""
    ifs = [n for n in body if isinstance(n, nodes.If)]
    if len(ifs) == 1 and not ifs[0].elif_ and not ifs[0].else_:
        return ifs[0]
    return None


def _lowers_its_flag_once(loop: nodes.For, guard: nodes.If) -> bool:
    """Whether ``guard`` tests a namespace flag first and lowers it, the one write of it in the loop, and holds
    no loop, jump or macro of its own."""
    ref = _flag(guard)
    if ref is None:
        return False
    lowered = [n for n in guard.body if isinstance(n, nodes.Assign) and _writes(n, ref) and _is_false_constant(n.node)]
    writes = [n for n in walk(loop) if _writes(n, ref)]
    return len(lowered) == 1 and len(writes) == 1 and not _rebinds(loop, ref[0]) and not _jumps(guard)


def _flag(guard: nodes.If) -> tuple[str, str] | None:
    """``(space, attribute)`` when the test's first ``and`` operand is ``space.attribute``."""
    flag = _operands(guard.test)[0]
    if isinstance(flag, nodes.Getattr) and isinstance(flag.node, nodes.Name):
        return flag.node.name, flag.attr
    return None


def _writes(node: nodes.Node, ref: tuple[str, str]) -> bool:
    """Whether ``node`` is ``{% set space.attribute = ... %}`` (or its block form) for ``ref``."""
    return (
        isinstance(node, (nodes.Assign, nodes.AssignBlock))
        and isinstance(node.target, nodes.NSRef)
        and (node.target.name, node.target.attr) == ref
    )


def _rebinds(loop: nodes.For, name: str) -> bool:
    return any(isinstance(n, nodes.Name) and n.name == name and n.ctx in ("store", "param") for n in walk(loop))


def _jumps(guard: nodes.If) -> bool:
    kinds = (nodes.For, nodes.Break, nodes.Continue, nodes.Macro, nodes.CallBlock)
    return any(isinstance(n, kinds) for n in walk(guard))


def _is_false_constant(node: nodes.Node) -> bool:
    return isinstance(node, nodes.Const) and not node.value


def _operands(test: nodes.Node) -> list[nodes.Node]:
    """The operands of a chain of ``and``, left to right."""
    if isinstance(test, nodes.And):
        return [*_operands(test.left), *_operands(test.right)]
    return [test]


def _quiet_assignment(node: nodes.Node, sequence: str | None) -> bool:
    """``{% set name = <quiet expression> %}``."""
    return isinstance(node, nodes.Assign) and isinstance(node.target, nodes.Name) and quiet(node.node, sequence)


def quiet(expr: nodes.Node, sequence: str | None) -> bool:
    """Whether ``expr`` cannot fail or act: constants, ``loop`` positions, the scanned list's length, arithmetic."""
    rule = _QUIET.get(type(expr))
    return rule is not None and rule(expr, sequence)


def _quiet_position(expr: nodes.Node, sequence: str | None) -> bool:
    assert isinstance(expr, nodes.Getattr)
    return isinstance(expr.node, nodes.Name) and expr.node.name == "loop" and expr.attr in ("index", "index0", "first")


def _quiet_length(expr: nodes.Node, sequence: str | None) -> bool:
    assert isinstance(expr, nodes.Filter)
    return (
        expr.name == "length"
        and isinstance(expr.node, nodes.Name)
        and expr.node.name == sequence
        and not expr.args
        and not expr.kwargs
    )


def _quiet_arithmetic(expr: nodes.Node, sequence: str | None) -> bool:
    assert isinstance(expr, nodes.BinExpr)
    return quiet(expr.left, sequence) and quiet(expr.right, sequence)


# By exact node type (none of these has subclasses in Jinja).
_QUIET: dict[type[nodes.Node], Callable[[nodes.Node, str | None], bool]] = {
    nodes.Const: lambda expr, sequence: True,
    nodes.Getattr: _quiet_position,
    nodes.Filter: _quiet_length,
    nodes.Add: _quiet_arithmetic,
    nodes.Sub: _quiet_arithmetic,
    nodes.Mul: _quiet_arithmetic,
}
