"""Scans of the neighbouring messages up to the first that passes a test, taken out of the loop body (see
:class:`Scan`)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from jinja2 import nodes

from ..._memo import IdentityMemo
from .ahead import Check, check_of, lift_loops, result_size, tested
from .settle import pure_test
from .syntax import is_name, neighbour_offset, walk

# A body whose scans reach further than this many messages is rendered with the whole template: the window of
# every body would hold that many neighbours.
FARTHEST = 64


@dataclass(frozen=True)
class Scan:
    """A loop over the messages next to the current one that stops having any effect at the first message that
    passes a test, taken out of the body.

    Gemma 4's template finds the previous message that is not a tool result with ``{% for j in
    range(loop.index0 - 1, -1, -1) %}{% if not ns.found %}{% if messages[j].role != 'tool' %}... {% set
    ns.found = true %}{% endif %}{% endif %}{% endfor %}``, and writes the tool results that follow a call with
    ``{% for k in range(loop.index0 + 1, messages | length) %}{% if ns.stopped %}{% elif messages[k].role !=
    'tool' %}{% set ns.stopped = true %}{% else %}...{% endif %}{% endfor %}``. Each costs the whole list per
    body, and makes every body depend on every other message. Once the flag is set, an iteration does nothing
    (the flag guards all of it, and nothing else writes it), so the loop renders the same over the messages up
    to and including the first that passes the test: the body's loop runs over that list instead, given as the
    variable ``name``, and the body depends only on messages that near it (the renderer widens each body's
    window to the farthest such message, so the windows say when a body must be rendered again).
    """

    name: str  # the variable the body's loop runs over instead
    step: int  # -1: back from the message before the current one; 1: on from the one after it
    test: Check  # the test on one message
    memo: IdentityMemo[Any, bool] = field(compare=False)

    def bounds(self, messages: Sequence[Any]) -> list[tuple[int, int]] | None:
        """For each position, the messages the scan visits as ``messages[start:stop]``: in its direction up to
        and including the first that passes the test (to the end of the list when none does). None when one
        reaches farther than ``FARTHEST`` (the whole template renders such a list)."""
        passed = tested(self.test, self.memo, messages)
        count = len(messages)
        bounds: list[tuple[int, int]] = []
        if self.step > 0:
            stop = count  # the first passing position after the current one (count: none)
            for index in range(count - 1, -1, -1):
                bounds.append((index + 1, min(stop + 1, count)))
                if passed[index]:
                    stop = index
            bounds.reverse()
        else:
            stop = 0  # the last passing position before the current one (0 when none: the scan runs to the first)
            for index in range(count):
                bounds.append((stop, index))
                if passed[index]:
                    stop = index
        if any(end - start > FARTHEST for start, end in bounds):
            return None
        return bounds

    def span(self, messages: Sequence[Any], bounds: tuple[int, int]) -> list[Any]:
        """The messages of one position's bounds, in the order the scan visits them."""
        start, stop = bounds
        visited = list(messages[start:stop])
        return visited if self.step > 0 else visited[::-1]


def _integer(node: nodes.Node) -> int | None:
    """The value of an integer literal (``-1`` parses as the negation of ``1``)."""
    if isinstance(node, nodes.Neg):
        inner = _integer(node.node)
        return None if inner is None else -inner
    if isinstance(node, nodes.Const) and type(node.value) is int:
        return int(node.value)
    return None


def _range_start(loop: nodes.For) -> int | None:
    """-1 for ``range(loop.index0 - 1, -1, -1)``, 1 for ``range(loop.index0 + 1, <sequence> | length)``."""
    call = loop.iter
    if not (isinstance(call, nodes.Call) and is_name(call.node, "range")) or call.kwargs or call.dyn_args:
        return None
    args = call.args
    if call.dyn_kwargs is not None:
        return None
    if len(args) == 3 and neighbour_offset(args[0]) == -1 and all(_integer(a) == -1 for a in args[1:]):
        return -1
    length = args[1] if len(args) == 2 else None
    if (
        neighbour_offset(args[0]) == 1
        and isinstance(length, nodes.Filter)
        and length.name == "length"
        and not (length.args or length.kwargs)
    ):
        return 1
    return None


def _flag_of(test: nodes.Node) -> tuple[str, str, bool] | None:
    """``(space, attribute, set)`` for ``space.attribute`` (True) or ``not space.attribute`` (False)."""
    negated = isinstance(test, nodes.Not)
    node = test.node if isinstance(test, nodes.Not) else test
    if isinstance(node, nodes.Getattr) and isinstance(node.node, nodes.Name):
        return node.node.name, node.attr, not negated
    return None


def _sets_true(node: nodes.Node, space: str, attr: str) -> bool:
    return (
        isinstance(node, nodes.Assign)
        and isinstance(node.target, nodes.NSRef)
        and (node.target.name, node.target.attr) == (space, attr)
        and isinstance(node.node, nodes.Const)
        and node.node.value is True
    )


def _guard_stopper(guard: nodes.If, space: str, attr: str) -> nodes.Node | None:
    """The test of ``{% if not ns.f %}...{% if <test> %}...{% set ns.f = true %}...{% endif %}...{% endif %}``."""
    if guard.elif_ or guard.else_:
        return None
    stoppers = [n for n in guard.body if isinstance(n, nodes.If) and any(_sets_true(w, space, attr) for w in n.body)]
    if len(stoppers) != 1 or stoppers[0].elif_ or stoppers[0].else_:
        return None
    return stoppers[0].test


def _elif_stopper(guard: nodes.If, space: str, attr: str) -> nodes.Node | None:
    """The test of ``{% if ns.f %}{% elif <test> %}{% set ns.f = true %}{% else %}...{% endif %}``."""
    if guard.body or len(guard.elif_) != 1 or not guard.elif_[0].body:
        return None
    branch = guard.elif_[0]
    return branch.test if any(_sets_true(w, space, attr) for w in branch.body) else None


def _plain_guard(loop: nodes.For) -> nodes.If | None:
    """The ``if`` that is the whole body of a plain loop (no ``else``, filter or recursion, one target)."""
    if loop.else_ or loop.test is not None or loop.recursive or not isinstance(loop.target, nodes.Name):
        return None
    if len(loop.body) != 1 or not isinstance(loop.body[0], nodes.If):
        return None
    return loop.body[0]


def _flag_decided(loop: nodes.For, space: str, attr: str) -> bool:
    """Whether the stopper's ``{% set space.attr = true %}`` is all in ``loop`` that changes the flag: no other
    write of it, no jump past the guard, no new binding of the namespace."""
    writes = [
        n
        for n in walk(loop)
        if isinstance(n, (nodes.Assign, nodes.AssignBlock))
        and isinstance(n.target, nodes.NSRef)
        and (n.target.name, n.target.attr) == (space, attr)
    ]
    if len(writes) != 1:
        return False  # another write could set (or clear) the flag where the test does not decide it
    if any(isinstance(n, (nodes.Break, nodes.Continue, nodes.Macro, nodes.CallBlock)) for n in walk(loop)):
        return False
    return not any(isinstance(n, nodes.Name) and n.name == space and n.ctx != "load" for n in walk(loop))


def _stopping_test(loop: nodes.For) -> tuple[nodes.Node, str] | None:
    """The test that stops the scan and the name of the list it reads, when the loop has one of the two shapes:
    ``{% if not ns.f %}...{% if <test> %}...{% set ns.f = true %}...{% endif %}...{% endif %}`` or
    ``{% if ns.f %}{% elif <test> %}{% set ns.f = true %}{% else %}...{% endif %}``."""
    guard = _plain_guard(loop)
    if guard is None:
        return None
    flag = _flag_of(guard.test)
    if flag is None:
        return None
    space, attr, wanted = flag
    # The guard tests ``ns.f`` in the second shape, ``not ns.f`` in the first.
    test = (_elif_stopper if wanted else _guard_stopper)(guard, space, attr)
    if test is None or not _flag_decided(loop, space, attr):
        return None
    assert isinstance(loop.target, nodes.Name)  # _plain_guard passed
    reads = _index_reads(test, loop.target.name)
    if reads is None or len(reads) != 1:
        return None
    return test, reads.pop()


def _index_reads(node: nodes.Node, index: str) -> set[str] | None:
    """The lists ``node`` indexes with ``index`` (``messages[index]``), when it reads ``index`` no other way."""
    lists: set[str] = set()
    picked: set[int] = set()
    for n in [node, *walk(node)]:
        if isinstance(n, nodes.Getitem) and is_name(n.arg, index) and isinstance(n.node, nodes.Name):
            lists.add(n.node.name)
            picked.add(id(n.arg))
    for n in [node, *walk(node)]:
        if isinstance(n, nodes.Name) and n.name == index and id(n) not in picked:
            return None
    return lists


def _item_test(test: nodes.Node, sequence: str, index: str, env: Any) -> nodes.Expr:
    """``test`` with ``sequence[index]`` read as ``item``."""
    copied = copy.deepcopy(test, {id(env): env})
    replaced = _replace_reads(copied, sequence, index, nodes.Name("item", "load"))
    assert isinstance(replaced, nodes.Expr)
    return replaced


def _replace_reads(root: Any, sequence: str, index: str, replacement: nodes.Name) -> Any:
    """``root`` with every ``sequence[index]`` replaced by ``replacement`` (changed in place, returned)."""
    if isinstance(root, nodes.Getitem) and is_name(root.node, sequence) and is_name(root.arg, index):
        return nodes.Name(replacement.name, "load", lineno=root.lineno)
    for field_name in root.fields:
        value = getattr(root, field_name)
        if isinstance(value, nodes.Node):
            setattr(root, field_name, _replace_reads(value, sequence, index, replacement))
        elif isinstance(value, list):
            setattr(
                root,
                field_name,
                [_replace_reads(v, sequence, index, replacement) if isinstance(v, nodes.Node) else v for v in value],
            )
    return root


def _scan_shape(loop: nodes.For, sequence: str, env: Any) -> tuple[int, nodes.Expr] | None:
    """(the direction, the stopping test reading the scanned message as ``item``) of a loop with one of the
    scans' shapes over ``sequence``; else None."""
    step = _range_start(loop)
    if step is None:
        return None
    if step > 0:
        length = loop.iter.args[1]  # type: ignore[attr-defined]
        if not is_name(length.node, sequence):
            return None
    found = _stopping_test(loop)
    if found is None:
        return None
    test, read = found
    assert isinstance(loop.target, nodes.Name)
    index = loop.target.name
    lists = _index_reads(nodes.Template(list(loop.body)), index)
    # The scan's index serves only to pick messages of the loop's own list, and the scan reads no ``loop`` of
    # its own (its length and position change with the list the body's loop gets).
    if read != sequence or lists != {sequence}:
        return None
    if any(isinstance(n, nodes.Name) and n.name == "loop" for n in walk(nodes.Template(list(loop.body)))):
        return None
    item_test = _item_test(test, sequence, index, env)
    if pure_test(item_test, "item", env.tests) is None:
        return None
    return step, item_test


def take_scans(body: nodes.Template, env: Any, sequence: str) -> tuple[nodes.Template, tuple[Scan, ...]]:
    """A copy of ``body`` with each scan (at its top level or inside its ``if`` blocks) looping over its span
    instead (see :class:`Scan`)."""
    scans: list[Scan] = []

    def lift(loop: nodes.For, index: str) -> nodes.Node | None:
        shape = _scan_shape(loop, sequence, env)
        if shape is None:
            return None
        step, test = shape
        name = f"__contextkeeper_scan{len(scans)}"
        item = nodes.Name(f"{name}_item", "load")
        scans.append(
            Scan(
                name,
                step,
                check_of(test, env),
                IdentityMemo("render.scans", sizer=result_size),
            )
        )
        loop_body = [_replace_reads(node, sequence, index, item) for node in loop.body]
        target = nodes.Name(item.name, "store", lineno=loop.lineno)
        return nodes.For(target, nodes.Name(name, "load", lineno=loop.lineno), loop_body, [], None, False)

    return lift_loops(body, env, lift), tuple(scans)
