"""Questions about a chat template's syntax tree that the split and the guards ask."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from jinja2 import nodes

# What the loop body may ask of ``loop``; the others (length, revindex, cycle, changed, previtem, nextitem) need
# the whole list or the previous iteration.
LOOP_ATTRIBUTES = frozenset({"index0", "index", "first", "last"})
# Calls whose result is not a function of the inputs.
IMPURE = frozenset({"strftime_now", "range", "cycler", "joiner", "namespace"})


def walk(root: nodes.Node) -> Iterator[nodes.Node]:
    """Every node below ``root``."""
    return root.find_all(nodes.Node)


def parents_of(root: nodes.Node) -> dict[int, nodes.Node]:
    """Each node's parent, by the node's id."""
    out: dict[int, nodes.Node] = {}

    def visit(node: nodes.Node) -> None:
        for child in node.iter_child_nodes():
            out[id(child)] = node
            visit(child)

    visit(root)
    return out


def rewrite_statements(
    children: list[nodes.Node], rewrite: Callable[[nodes.Node], nodes.Node | None]
) -> list[nodes.Node]:
    """``children`` with each statement that ``rewrite`` gives a replacement for replaced, at their level and
    inside their ``if`` blocks (the ``if`` nodes are changed in place)."""
    out: list[nodes.Node] = []
    for child in children:
        replacement = rewrite(child)
        if replacement is not None:
            child = replacement
        elif isinstance(child, nodes.If):
            child.body = rewrite_statements(child.body, rewrite)
            for branch in child.elif_:
                branch.body = rewrite_statements(branch.body, rewrite)
            child.else_ = rewrite_statements(child.else_, rewrite)
        out.append(child)
    return out


def is_namespace_call(expr: nodes.Node) -> bool:
    """``namespace(...)``."""
    return isinstance(expr, nodes.Call) and is_name(expr.node, "namespace")


def is_name(node: nodes.Node | None, name: str) -> bool:
    return isinstance(node, nodes.Name) and node.name == name


def loop_position(node: nodes.Node) -> str | None:
    """``index0`` or ``index`` when ``node`` is ``loop.index0`` or ``loop.index``."""
    if isinstance(node, nodes.Getattr) and node.attr in ("index0", "index") and is_name(node.node, "loop"):
        return str(node.attr)
    return None


def neighbour_offset(index: nodes.Node) -> int | None:
    """The constant c of ``loop.index0``, ``loop.index0 + c`` or ``loop.index0 - c``; None for anything else."""
    if loop_position(index) == "index0":
        return 0
    if (
        isinstance(index, (nodes.Add, nodes.Sub))
        and loop_position(index.left) == "index0"
        and isinstance(index.right, nodes.Const)
    ):
        value = index.right.value
        if isinstance(value, int) and not isinstance(value, bool):
            return value if isinstance(index, nodes.Add) else -value
    return None


def message_reads(
    body: nodes.Node, parents: dict[int, nodes.Node], sequence: str = "messages"
) -> Iterator[tuple[nodes.Name, int | None]]:
    """Each read of ``messages`` (or of ``sequence``, the list the loop runs over) in ``body``, with its neighbour
    offset (None: not ``sequence[loop.index0 ± c]``)."""
    for node in walk(body):
        if isinstance(node, nodes.Name) and node.name in ("messages", sequence) and node.ctx == "load":
            parent = parents.get(id(node))
            if node.name == sequence and isinstance(parent, nodes.Getitem) and parent.node is node:
                yield node, neighbour_offset(parent.arg)
            else:
                yield node, None


def body_reach(body: nodes.Node, parents: dict[int, nodes.Node], sequence: str = "messages") -> int | None:
    """How far the body looks at neighbours, if it reads ``sequence`` only as ``sequence[loop.index0 ± c]``."""
    reach = 0
    for _, offset in message_reads(body, parents, sequence):
        if offset is None:
            return None
        reach = max(reach, abs(offset))
    return reach


def reads_position(body: nodes.Template, parents: dict[int, nodes.Node], sequence: str = "messages") -> bool:
    """Whether the body uses ``loop.index``/``loop.index0`` for anything but ``sequence[loop.index0 ± c]``."""
    return any(
        not (_tests_first(node, parents) or _picks_neighbour(node, parents, sequence))
        for node in walk(body)
        if loop_position(node) is not None
    )


def _tests_first(position: nodes.Node, parents: dict[int, nodes.Node]) -> bool:
    """``loop.index0 == 0`` (or ``!=``, or ``loop.index == 1``): that is ``loop.first``, which the memo key holds."""
    assert isinstance(position, nodes.Getattr)
    parent = parents.get(id(position))
    first = 0 if position.attr == "index0" else 1
    return (
        isinstance(parent, nodes.Compare)
        and parent.expr is position
        and len(parent.ops) == 1
        and parent.ops[0].op in ("eq", "ne")
        and isinstance(parent.ops[0].expr, nodes.Const)
        and parent.ops[0].expr.value == first
    )


def _picks_neighbour(position: nodes.Node, parents: dict[int, nodes.Node], sequence: str) -> bool:
    """``loop.index0`` (or ``loop.index0 ± c``) used as an index into ``sequence``."""
    if loop_position(position) != "index0":
        return False
    child, parent = position, parents.get(id(position))
    if isinstance(parent, (nodes.Add, nodes.Sub)):
        child, parent = parent, parents.get(id(parent))
    return isinstance(parent, nodes.Getitem) and parent.arg is child and is_name(parent.node, sequence)
