"""Looks ahead of the loop position, taken out of the loop body (see :class:`Ahead`)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from jinja2 import nodes

from ..._memo import IdentityMemo
from .settle import pure_test
from .syntax import loop_position, rewrite_statements, walk


@dataclass(frozen=True)
class Ahead:
    """A scan of the messages after the current one for one that passes a test, taken out of the body.

    ``{% set ns = namespace(found=false) %}{% for m in messages[loop.index:] %}{% if <test on m> %}
    {% set ns.found = true %}{% endif %}{% endfor %}`` (gpt-oss drops the analysis of a tool call when a final
    answer follows it) makes every body depend on all the messages after it, and costs the whole list per body.
    With the scan replaced by ``{% if <variable> %}{% set ns.found = true %}{% endif %}``, a body depends on one
    boolean, worked out for every position in one backward pass (each message's test remembered by identity).
    """

    name: str  # the variable that replaces the scan in the body
    test: Check  # the test on one later message
    memo: IdentityMemo[Any, bool] = field(compare=False)

    def evaluate(self, messages: Sequence[Any]) -> list[bool]:
        """For each position, whether a later message passes the test."""
        passes = tested(self.test, self.memo, messages)
        out = [False] * len(messages)
        later = False
        for index in range(len(messages) - 1, -1, -1):
            out[index] = later
            later = later or passes[index]
        return out


def tested(check: Check, memo: IdentityMemo[Any, bool], messages: Sequence[Any]) -> list[bool]:
    """Whether each message passes ``check``, remembered by identity; those not remembered are tested in one
    render."""
    passes = memo.get_many(messages)
    unknown = [message for message, known in zip(messages, passes, strict=True) if known is None]
    if not unknown:
        return [bool(known) for known in passes]
    found = iter(check.many(unknown))
    out: list[bool] = []
    new: list[tuple[Any, bool]] = []
    for message, known in zip(messages, passes, strict=True):
        if known is None:
            known = next(found)
            new.append((message, known))
        out.append(known)
    memo.put_many(new)
    return out


@dataclass(frozen=True)
class Check:
    """A test on one message (``item``), compiled twice in the same environment (the same sandbox, filters and
    rules): ``one`` writes "1" when a message passes, ``each`` writes "1" or "0" for every message of ``items``.
    ``each`` saves a whole render (a fresh context, the bounds) per message; ``one`` is its reference."""

    one: Any
    each: Any

    def passes(self, message: Any) -> bool:
        """Whether ``message`` passes, rendered on its own (the reference)."""
        return bool(self.one.render(item=message) == "1")

    def many(self, messages: Sequence[Any]) -> list[bool]:
        """Whether each of ``messages`` passes, in one render."""
        written = self.each.render(items=list(messages))
        assert len(written) == len(messages)  # each iteration writes one character
        return [flag == "1" for flag in written]


def check_of(test: nodes.Expr, env: Any) -> Check:
    """``test`` (which reads the message as ``item``) compiled as a :class:`Check`."""

    def verdict(otherwise: list[nodes.Node]) -> nodes.If:
        return nodes.If(copy.deepcopy(test, {id(env): env}), [nodes.Output([nodes.Const("1")])], [], otherwise)

    loop = nodes.For(
        nodes.Name("item", "store"),
        nodes.Name("items", "load"),
        [verdict([nodes.Output([nodes.Const("0")])])],
        [],
        None,
        False,
        lineno=1,
    )
    return Check(
        env.from_string(nodes.Template([verdict([])], lineno=1)), env.from_string(nodes.Template([loop], lineno=1))
    )


def result_size(key: Any, value: Any) -> int:
    """The bytes of one remembered test result (a message identity and a flag)."""
    return 64


def _scan_shape(loop: nodes.For, sequence: str, tests: Any) -> tuple[nodes.Node, nodes.Assign] | None:
    """(the test, the flag write) of a loop with exactly the look-ahead's shape; else None."""
    if loop.else_ or loop.test is not None or loop.recursive or not isinstance(loop.target, nodes.Name):
        return None
    source = loop.iter
    if not (
        isinstance(source, nodes.Getitem)
        and isinstance(source.node, nodes.Name)
        and source.node.name == sequence
        and isinstance(source.arg, nodes.Slice)
        and source.arg.stop is None
        and source.arg.step is None
        and source.arg.start is not None
        and loop_position(source.arg.start) == "index"  # messages[loop.index:]: the ones after this one
    ):
        return None
    if len(loop.body) != 1 or not isinstance(loop.body[0], nodes.If):
        return None
    guard = loop.body[0]
    if guard.elif_ or guard.else_ or len(guard.body) != 1:
        return None
    write = guard.body[0]
    if not (
        isinstance(write, nodes.Assign)
        and isinstance(write.target, nodes.NSRef)
        and isinstance(write.node, nodes.Const)
        and write.node.value is True
    ):
        return None
    # The test must be one the settled scans accept (see ``pure_test``): built from the later message and literals
    # only, it is the same evaluated on each message apart as in turn. A test that fails on some message fails
    # the marks, and the template is then rendered whole.
    if pure_test(guard.test, loop.target.name, tests) is None:
        return None
    return guard.test, write


def lift_loops(body: nodes.Template, env: Any, lift: Callable[[nodes.For, str], nodes.Node | None]) -> nodes.Template:
    """A copy of ``body`` with each loop at its top level (or inside its ``if`` blocks) that ``lift`` gives a
    replacement for (given the loop and its variable's name) replaced by it."""
    body = copy.deepcopy(body, {id(env): env})  # the nodes point at the environment: share it, do not copy it

    def replace(child: nodes.Node) -> nodes.Node | None:
        if not isinstance(child, nodes.For) or not isinstance(child.target, nodes.Name):
            return None
        return lift(child, child.target.name)

    body.body = rewrite_statements(body.body, replace)
    body.set_environment(env)
    return body


def take_aheads(body: nodes.Template, env: Any, sequence: str) -> tuple[nodes.Template, tuple[Ahead, ...]]:
    """A copy of ``body`` with each look-ahead scan at its top level (or inside its ``if`` blocks) replaced by
    its variable."""
    aheads: list[Ahead] = []

    def lift(loop: nodes.For, item: str) -> nodes.Node | None:
        shape = _scan_shape(loop, sequence, env.tests)
        if shape is None:
            return None
        test, write = shape
        name = f"__contextkeeper_ahead{len(aheads)}"
        aheads.append(
            Ahead(name, check_of(_renamed(test, item, env), env), IdentityMemo("render.ahead", sizer=result_size))
        )
        return nodes.If(nodes.Name(name, "load", lineno=loop.lineno), [write], [], [], lineno=loop.lineno)

    return lift_loops(body, env, lift), tuple(aheads)


def _renamed(test: nodes.Node, item: str, env: Any) -> nodes.Expr:
    """``test`` reading the loop's item as ``item`` (the name the compiled check is rendered with)."""
    copied = copy.deepcopy(test, {id(env): env})
    assert isinstance(copied, nodes.Expr)
    for node in [copied, *walk(copied)]:
        if isinstance(node, nodes.Name) and node.name == item:
            node.name = "item"
    return copied
