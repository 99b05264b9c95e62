"""Loops that stop once their remaining iterations provably do nothing (see :func:`settle`).

Jinja has no ``break`` in the syntax chat templates use, so a template that looks for one thing in the messages
scans all of them, and a scan inside the message loop makes the render quadratic in the chat's length. Two
shapes are recognised, in a plain loop (not recursive, no filter, no ``else``, one loop variable) whose body is
exactly one ``if`` and where ``N`` is a name the template only ever binds to ``namespace(...)``:

- a *settled guard*: ``{% if not N.a %}...{% endif %}`` (no elif or else), or ``{% if N.a %}{% elif ... %}
  ...{% endif %}`` with an empty first branch. Once ``N.a`` is truthy at the start of an iteration, no later
  iteration runs anything but the test itself, which reads the same attribute of the same namespace;
- an *idempotent flag*: ``{% if <test> %}{% set N.a = <constant> %}{% endif %}`` (no elif or else; one or more
  such writes) whose test cannot fail or act (see :func:`pure_test`). Once the writes ran, later iterations can
  only write the same constants again.

Such a loop is compiled with a break at that point (:func:`settle` adds a ``Break`` node and a
:class:`SettlePlan` that tells the code generator what it stands for), taken only when the compiled code
confirms at run time what the syntax cannot: ``N`` is a namespace (a caller may pass a value of that name),
and iterating the rest cannot fail or act either (the iterable is a list, tuple, range, string or dict; for a
flag, its items are plain values, see :data:`ITEMS`). The rendered text, the namespaces the loop leaves and
every error are those of the full loop; only the bounds' counts (steps, time) are smaller.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from jinja2 import nodes
from jinja2 import tests as jinja_tests

from .syntax import is_namespace_call, walk

__all__ = ["ITEMS", "NO_PLAN", "SettleBreak", "SettlePlan", "Settled", "pure_test", "settle", "settled_loops"]

_PLAIN = frozenset({dict, list, tuple, str, int, float, bool, type(None)})
_CONTAINERS = frozenset({dict, list, tuple})
# What the items of a loop must be for its break to be taken, by name (the compiled code names one): "any" for a
# guard (its test never reads them); for a flag, the types on which its test cannot fail. On a plain value the
# sandbox's ``x.attr`` / ``x['key']`` give a value or an undefined, never an error (only an undefined item, or
# an object of the caller's own class, could raise or run code there); ``c in x`` needs ``x`` to be a
# container, and a string only holds strings.
ITEMS: dict[str, frozenset[type] | None] = {
    "any": None,
    "plain": _PLAIN,
    "containers": _CONTAINERS,
    "text or containers": _CONTAINERS | {str},
}
_ITEM_NAMES = {value: name for name, value in ITEMS.items() if value is not None}

# Tests that only look at their value's type (``isinstance``, ``is``): none can fail or run the value's code.
# Each is used only where the environment still has Jinja's own function under that name.
_SAFE_TESTS: dict[str, Callable[..., bool]] = {
    "defined": jinja_tests.test_defined,
    "undefined": jinja_tests.test_undefined,
    "none": jinja_tests.test_none,
    "string": jinja_tests.test_string,
    "mapping": jinja_tests.test_mapping,
    "number": jinja_tests.test_number,
    "boolean": jinja_tests.test_boolean,
    "true": jinja_tests.test_true,
    "false": jinja_tests.test_false,
    "integer": jinja_tests.test_integer,
    "float": jinja_tests.test_float,
}


@dataclass(frozen=True)
class Settled:
    """One loop :func:`settle` stops early: its line, its shape, and the namespace attribute it waits on."""

    line: int
    shape: Literal["guard", "flag"]
    flag: str  # "N.a"
    items: str  # the key in ITEMS the loop's items must satisfy


def settled_loops(template: nodes.Template, tests: Mapping[str, Any]) -> tuple[Settled, ...]:
    """The loops of ``template`` that :func:`settle` stops early (``tests``: the environment's tests)."""
    return tuple(found for _, _, found in _matches(template, tests))


@dataclass(frozen=True)
class SettleBreak:
    """What one added ``Break`` stands for: leave the loop if ``space`` is a namespace and the loop's iterable
    (kept under ``loop``, a key of :attr:`SettlePlan.loops`) and its items are as ``ITEMS[items]`` needs."""

    loop: int
    space: str
    items: str


@dataclass(frozen=True)
class SettlePlan:
    """The settled loops of one transformed tree, by node identity (the tree is compiled right away, while
    its nodes live): ``loops`` maps a ``For`` to its key, ``breaks`` each added ``Break`` to its test."""

    loops: Mapping[int, int]
    breaks: Mapping[int, SettleBreak]


NO_PLAN = SettlePlan(loops={}, breaks={})


def settle(template: nodes.Template, tests: Mapping[str, Any]) -> tuple[nodes.Template, SettlePlan]:
    """``template`` with a ``Break`` in each loop :func:`settled_loops` finds, and the plan the code generator
    compiles those breaks by (a bare ``Break`` there would be wrong: it stands for a checked one). A copy, or
    ``template`` itself with :data:`NO_PLAN` when there is none: the given tree is never changed (the template
    splitter compiles parts of one parsed tree several times)."""
    found = _matches(template, tests)
    if not found:
        return template, NO_PLAN
    # The nodes point at their environment: share it rather than copy it. The memo then maps each original
    # node's id to its copy.
    memo: dict[int, Any] = {
        id(n.environment): n.environment for n in (template, *walk(template)) if hasattr(n, "environment")
    }
    copied = copy.deepcopy(template, memo)
    loops: dict[int, int] = {}
    breaks: dict[int, SettleBreak] = {}
    for key, (loop, guard, settled) in enumerate(found):
        guard_copy = memo[id(guard)]
        loops[id(memo[id(loop)])] = key
        stop = nodes.Break(lineno=guard.lineno)
        breaks[id(stop)] = SettleBreak(loop=key, space=settled.flag.split(".")[0], items=settled.items)
        if settled.shape == "flag":
            guard_copy.body = [*guard_copy.body, stop]
        elif isinstance(guard.test, nodes.Not):
            guard_copy.else_ = [stop]
        else:
            guard_copy.body = [stop]
    return copied, SettlePlan(loops=loops, breaks=breaks)


# ------------------------------------------------------------------------------------------------ analysis


def _matches(template: nodes.Template, tests: Mapping[str, Any]) -> list[tuple[nodes.For, nodes.If, Settled]]:
    spaces = namespaces_of(template)
    if not spaces:
        return []
    out = []
    for loop in template.find_all(nodes.For):
        match = _match(loop, spaces, tests)
        if match is not None:
            out.append((loop, *match))
    return out


def namespaces_of(template: nodes.Template) -> frozenset[str]:
    """The names ``template`` binds only ever to ``namespace(...)``: every ``set`` of the name is a call of
    ``namespace`` (itself never rebound), and no loop variable, macro or call-block argument, ``with``, import
    or macro name binds it."""
    as_namespace: set[str] = set()
    targets: set[int] = set()  # ids of the Names those namespace sets bind
    for node in template.find_all(nodes.Assign):
        if isinstance(node.target, nodes.Name) and is_namespace_call(node.node):
            as_namespace.add(node.target.name)
            targets.add(id(node.target))
    otherwise = {n.name for n in template.find_all(nodes.Name) if n.ctx in ("store", "param") and id(n) not in targets}
    otherwise.update(macro.name for macro in template.find_all(nodes.Macro))
    otherwise.update(node.target for node in template.find_all(nodes.Import))
    for imported in template.find_all(nodes.FromImport):
        otherwise.update(name[1] if isinstance(name, tuple) else name for name in imported.names)
    if "namespace" in as_namespace | otherwise:
        return frozenset()
    return frozenset(as_namespace - otherwise - {"loop"})


def _match(loop: nodes.For, spaces: frozenset[str], tests: Mapping[str, Any]) -> tuple[nodes.If, Settled] | None:
    # A filter (``for x in xs if ...``) or an unpacking target runs code on the later items, an ``else`` and a
    # recursive loop are not plain loops.
    if loop.recursive or loop.test is not None or loop.else_ or not isinstance(loop.target, nodes.Name):
        return None
    if len(loop.body) != 1 or not isinstance(loop.body[0], nodes.If):
        return None
    guard, target = loop.body[0], loop.target.name
    allowed = spaces - {target}
    if isinstance(guard.test, nodes.Not) and not guard.elif_ and not guard.else_:
        flag = _flag(guard.test.node, allowed)
        if flag is not None:
            return guard, Settled(guard.lineno, "guard", flag, "any")
    flag = _flag(guard.test, allowed)
    if flag is not None and not guard.body:
        return guard, Settled(guard.lineno, "guard", flag, "any")
    if guard.elif_ or guard.else_ or not guard.body:
        return None
    writes = [_constant_write(node, allowed) for node in guard.body]
    items = pure_test(guard.test, target, tests)
    if items is None or any(write is None for write in writes):
        return None
    return guard, Settled(guard.lineno, "flag", str(writes[0]), items)


def _flag(expr: nodes.Node, spaces: frozenset[str]) -> str | None:
    """``"N.a"`` when ``expr`` is ``N.a`` for a namespace name ``N``."""
    if isinstance(expr, nodes.Getattr) and isinstance(expr.node, nodes.Name) and expr.node.name in spaces:
        return f"{expr.node.name}.{expr.attr}"
    return None


def _constant_write(node: nodes.Node, spaces: frozenset[str]) -> str | None:
    """``"N.a"`` when ``node`` is ``{% set N.a = <literal> %}`` for a namespace name ``N``."""
    if (
        isinstance(node, nodes.Assign)
        and isinstance(node.target, nodes.NSRef)
        and node.target.name in spaces
        and isinstance(node.node, nodes.Const)
    ):
        return f"{node.target.name}.{node.target.attr}"
    return None


def pure_test(test: nodes.Node, target: str, tests: Mapping[str, Any]) -> str | None:
    """The key in :data:`ITEMS` of the item types on which ``test`` cannot fail or act, when it is built only
    from the loop variable ``target`` (or one ``.attr`` / ``['key']`` of it), literals, ``== != in not in``,
    the type tests of ``_SAFE_TESTS`` and ``and or not``; else None."""
    needs = _needs(test, target, tests)
    return None if needs is None else _ITEM_NAMES[needs]


def _needs(test: nodes.Node, target: str, tests: Mapping[str, Any]) -> frozenset[type] | None:
    # ``and`` / ``or`` / ``not``: they only combine their operands' truth values (of plain values: no code runs).
    if isinstance(test, (nodes.And, nodes.Or)):
        left, right = _needs(test.left, target, tests), _needs(test.right, target, tests)
        return None if left is None or right is None else left & right
    if isinstance(test, nodes.Not):
        return _needs(test.node, target, tests)
    # A literal, the loop variable or one level of it: a value (see ITEMS), and its truth value.
    if isinstance(test, nodes.Const) or _subject(test, target):
        return _PLAIN
    # ``x is defined`` and the other type tests (no arguments).
    if isinstance(test, nodes.Test):
        plain = not (test.args or test.kwargs or test.dyn_args or test.dyn_kwargs)
        safe = _SAFE_TESTS.get(test.name)
        if plain and safe is not None and tests.get(test.name) is safe and _subject(test.node, target):
            return _PLAIN
        return None
    if isinstance(test, nodes.Compare) and len(test.ops) == 1:
        return _comparison(test.expr, test.ops[0].op, test.ops[0].expr, target)
    return None


def _comparison(left: nodes.Node, op: str, right: nodes.Node, target: str) -> frozenset[type] | None:
    # ``==`` / ``!=`` between plain values and literals compare, they never raise (unlike ``<``, which does
    # between a string and a number).
    if op in ("eq", "ne"):
        sides = (left, right)
        if any(isinstance(side, nodes.Const) for side in sides) and all(
            isinstance(side, nodes.Const) or _subject(side, target) for side in sides
        ):
            return _PLAIN
        return None
    if op not in ("in", "notin"):
        return None
    # ``x in [literals]``: a list or tuple of literals compares its items with ``==``.
    if _subject(left, target) and isinstance(right, (nodes.List, nodes.Tuple)):
        return _PLAIN if all(isinstance(item, nodes.Const) for item in right.items) else None
    # ``'key' in x``: needs ``x`` to be a container (a literal is hashable, as a dict's lookup needs), and a
    # string only holds strings. Only the loop variable itself, whose type the run-time check sees.
    if isinstance(left, nodes.Const) and isinstance(right, nodes.Name) and right.name == target:
        return ITEMS["text or containers"] if type(left.value) is str else _CONTAINERS
    return None


def _subject(expr: nodes.Node, target: str) -> bool:
    """``x``, ``x.attr`` or ``x['key']`` for the loop variable ``x`` (read, not written)."""
    if isinstance(expr, (nodes.Getattr, nodes.Getitem)):
        literal_key = isinstance(expr, nodes.Getattr) or (
            isinstance(expr.arg, nodes.Const) and type(expr.arg.value) is str
        )
        if not literal_key:
            return False
        expr = expr.node
    return isinstance(expr, nodes.Name) and expr.name == target and expr.ctx == "load"
