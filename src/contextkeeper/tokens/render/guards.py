"""Comparisons of the loop position with a loop-wide value, taken out of the loop body (see :class:`Guard`)."""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jinja2 import nodes

from .syntax import loop_position

# Jinja compiles these comparison operators to Python's own.
COMPARE: dict[str, Callable[[Any, Any], Any]] = {
    "eq": operator.eq,
    "ne": operator.ne,
    "gt": operator.gt,
    "gteq": operator.ge,
    "lt": operator.lt,
    "lteq": operator.le,
}


@dataclass(frozen=True)
class Guard:
    """A comparison of the loop position with a value fixed for the whole loop, taken out of the body.

    ``{% if loop.index0 > ns.last_query_index %}`` (Qwen3 strips the reasoning of turns before the last user
    query) makes every body depend on its position and on a value the head computes from the whole list. With
    the comparison replaced by a variable holding its result, a body's output depends on that one boolean
    instead: its output can be reused when the list shifts (oldest turns dropped) or the value moves (a new
    user turn), except where the boolean itself changed.
    """

    name: str  # the variable that replaces the comparison in the body
    attribute: str  # "index0" or "index"
    op: str  # a Jinja comparison operator name (eq, ne, gt, gteq, lt, lteq)
    loop_first: bool  # whether the loop position is the left operand
    value: str | None  # the name compared with (None: ``constant``)
    value_attribute: str | None = None  # ``value.attribute``
    constant: Any = None

    def evaluate(self, env: Any, scope: dict[str, Any], count: int) -> list[Any]:
        """The comparison's result for each position 0..count-1, as the template would compute it."""
        other = self._other(env, scope)
        compare = COMPARE[self.op]
        shift = 1 if self.attribute == "index" else 0
        if self.loop_first:
            return [compare(i + shift, other) for i in range(count)]
        return [compare(other, i + shift) for i in range(count)]

    def _other(self, env: Any, scope: dict[str, Any]) -> Any:
        """The value compared with, looked up as the template would (the scope, then the globals)."""
        if self.value is None:
            return self.constant
        if self.value in scope:
            other = scope[self.value]
        elif self.value in env.globals:
            other = env.globals[self.value]
        else:
            other = env.undefined(name=self.value)
        if self.value_attribute is not None:
            other = env.getattr(other, self.value_attribute)
        return other


def _loop_wide(other: nodes.Node, stored: frozenset[str]) -> tuple[str | None, str | None, Any] | None:
    """``(value, value_attribute, constant)`` for an integer, or a name (``.attr``) the body never assigns."""
    if isinstance(other, nodes.Const) and type(other.value) is int:
        return None, None, other.value
    if isinstance(other, nodes.Name) and other.name not in stored and other.name != "loop":
        return other.name, None, None
    if (
        isinstance(other, nodes.Getattr)
        and isinstance(other.node, nodes.Name)
        and other.node.name not in stored
        and other.node.name != "loop"
    ):
        return other.node.name, other.attr, None
    return None


def as_guard(node: nodes.Compare, stored: frozenset[str], number: int) -> Guard | None:
    """The guard for ``loop.index0 <op> name[.attr]`` (either way round, or against a number), else None."""
    if len(node.ops) != 1 or node.ops[0].op not in COMPARE:
        return None
    left, right, op = node.expr, node.ops[0].expr, node.ops[0].op
    for position, other, loop_first in ((left, right, True), (right, left, False)):
        attribute = loop_position(position)
        operand = None if attribute is None else _loop_wide(other, stored)
        if attribute is not None and operand is not None:
            value, value_attribute, constant = operand
            return Guard(f"__contextkeeper_guard{number}", attribute, op, loop_first, value, value_attribute, constant)
    return None


def take_guards(body: nodes.Template, env: Any, target: str) -> tuple[nodes.Template, tuple[Guard, ...]]:
    """A copy of ``body`` with each guard comparison (outside nested loops) replaced by its variable."""
    body = copy.deepcopy(body, {id(env): env})  # the nodes point at the environment: share it, do not copy it
    # A name the body assigns may change from one message to the next: comparisons with it stay.
    # The loop variable and ``loop`` are per message too.
    stored = frozenset(n.name for n in body.find_all(nodes.Name) if n.ctx in ("store", "param")) | {target, "loop"}
    guards: list[Guard] = []

    def visit(node: nodes.Node) -> None:
        for field, value in node.iter_fields():
            if isinstance(value, list):
                setattr(node, field, [swap(child) if isinstance(child, nodes.Node) else child for child in value])
            elif isinstance(value, nodes.Node):
                setattr(node, field, swap(value))

    def swap(child: nodes.Node) -> nodes.Node:
        if isinstance(child, nodes.Compare):
            guard = as_guard(child, stored, len(guards))
            if guard is not None:
                guards.append(guard)
                return nodes.Name(guard.name, "load", lineno=child.lineno)
        if not isinstance(child, nodes.For):  # inside a nested loop, ``loop`` is that loop's
            visit(child)
        return child

    visit(body)
    body.set_environment(env)
    return body, tuple(guards)
