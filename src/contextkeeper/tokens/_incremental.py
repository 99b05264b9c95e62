"""Rendering a chat template message by message, with each message's output remembered.

Most chat templates are a preamble, one ``{% for message in messages %}`` loop and a closing generation
prompt. When the loop body can only see its own message, its neighbours at fixed offsets, its position and
whether it is last — and nothing carries over from one iteration to the next — the rendered prompt is the
preamble, then each message's body output, then the ending; a body output can be remembered and reused as long
as those inputs are the same objects. :func:`split_template` proves that shape from the template's syntax tree
(refusing anything it cannot prove: namespace writes in the loop, ``loop.length``, filtered loops, loops over
anything but ``messages``, dates inside the loop, …); templates it refuses are rendered whole, as before.
The equivalence is checked against whole renders over all the templates the tests fetch.
"""

from __future__ import annotations

import copy
import operator
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import jinja2.meta
from jinja2 import Template, nodes

from .._memo import Memo, shared_prefix, shared_suffix

__all__ = [
    "Guard",
    "IncrementalRenderer",
    "LoopState",
    "SplitTemplate",
    "shared_prefix",
    "shared_suffix",
    "split_template",
]

# What the loop body may ask of ``loop``; the others (length, revindex, cycle, changed, previtem, nextitem) need
# the whole list or the previous iteration.
_LOOP_ATTRIBUTES = frozenset({"index0", "index", "first", "last"})
# Calls whose result is not a function of the inputs.
_IMPURE = frozenset({"strftime_now", "range", "cycler", "joiner", "namespace"})


class LoopState:
    """The ``loop`` variable for one iteration of a split template's loop (index and position only)."""

    __slots__ = ("first", "index", "index0", "last")

    def __init__(self, index0: int, length: int) -> None:
        self.index0 = index0
        self.index = index0 + 1
        self.first = index0 == 0
        self.last = index0 == length - 1


# Jinja compiles these comparison operators to Python's own.
_COMPARE: dict[str, Callable[[Any, Any], Any]] = {
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
        if self.value is None:
            other = self.constant
        else:
            if self.value in scope:
                other = scope[self.value]
            elif self.value in env.globals:
                other = env.globals[self.value]
            else:
                other = env.undefined(name=self.value)
            if self.value_attribute is not None:
                other = env.getattr(other, self.value_attribute)
        compare = _COMPARE[self.op]
        shift = 1 if self.attribute == "index" else 0
        if self.loop_first:
            return [compare(i + shift, other) for i in range(count)]
        return [compare(other, i + shift) for i in range(count)]


@dataclass(frozen=True)
class SplitTemplate:
    """A template cut into the part before its message loop, the loop body, and the part after it."""

    marked: Template  # the template with SENTINEL written after each loop iteration
    head: Template
    body: Template
    tail: Template
    target: str  # the loop variable's name
    reach: int  # how far the body looks at neighbours: messages[loop.index0 ± reach]
    # Whether the body reads its position (loop.index / index0 other than to pick a neighbour). When it does not,
    # a body's output depends only on its window and on being first or last, so it can be reused when the
    # window shifts (a conversation whose oldest messages were dropped).
    positional: bool = True
    # Comparisons of the position with loop-wide values, replaced in ``body`` by variables (see Guard).
    guards: tuple[Guard, ...] = ()
    # The names the body reads from the render's context (None: it may read any, e.g. through a macro).
    reads: frozenset[str] | None = None
    whole: Template | None = None  # the template itself, for a render the guards cannot decide


def _loop_position(node: nodes.Node) -> str | None:
    """``index0`` or ``index`` when ``node`` is ``loop.index0`` or ``loop.index``."""
    if (
        isinstance(node, nodes.Getattr)
        and node.attr in ("index0", "index")
        and isinstance(node.node, nodes.Name)
        and node.node.name == "loop"
    ):
        return str(node.attr)
    return None


def _as_guard(node: nodes.Compare, stored: frozenset[str], number: int) -> Guard | None:
    """The guard for ``loop.index0 <op> name[.attr]`` (either way round, or against a number), else None."""
    if len(node.ops) != 1 or node.ops[0].op not in _COMPARE:
        return None
    left, right, op = node.expr, node.ops[0].expr, node.ops[0].op
    for position, other, loop_first in ((left, right, True), (right, left, False)):
        attribute = _loop_position(position)
        if attribute is None:
            continue
        name = f"__contextkeeper_guard{number}"
        if isinstance(other, nodes.Const) and type(other.value) is int:
            return Guard(name, attribute, op, loop_first, None, constant=other.value)
        if isinstance(other, nodes.Name) and other.name not in stored and other.name != "loop":
            return Guard(name, attribute, op, loop_first, other.name)
        if (
            isinstance(other, nodes.Getattr)
            and isinstance(other.node, nodes.Name)
            and other.node.name not in stored
            and other.node.name != "loop"
        ):
            return Guard(name, attribute, op, loop_first, other.node.name, other.attr)
    return None


def _take_guards(body: nodes.Template, env: Any, target: str) -> tuple[nodes.Template, tuple[Guard, ...]]:
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
            guard = _as_guard(child, stored, len(guards))
            if guard is not None:
                guards.append(guard)
                return nodes.Name(guard.name, "load", lineno=child.lineno)
        if not isinstance(child, nodes.For):  # inside a nested loop, ``loop`` is that loop's
            visit(child)
        return child

    visit(body)
    body.set_environment(env)
    return body, tuple(guards)


def _walk(root: nodes.Node) -> Iterator[nodes.Node]:
    """Every node below ``root``."""
    return root.find_all(nodes.Node)


def _parents(root: nodes.Node) -> dict[int, nodes.Node]:
    out: dict[int, nodes.Node] = {}

    def visit(node: nodes.Node) -> None:
        for child in node.iter_child_nodes():
            out[id(child)] = node
            visit(child)

    visit(root)
    return out


def _neighbour_offset(index: nodes.Node) -> int | None:
    """The constant c of ``loop.index0``, ``loop.index0 + c`` or ``loop.index0 - c``; None for anything else."""

    def is_index0(node: nodes.Node) -> bool:
        return (
            isinstance(node, nodes.Getattr)
            and node.attr == "index0"
            and isinstance(node.node, nodes.Name)
            and node.node.name == "loop"
        )

    if is_index0(index):
        return 0
    if isinstance(index, (nodes.Add, nodes.Sub)) and is_index0(index.left) and isinstance(index.right, nodes.Const):
        value = index.right.value
        if isinstance(value, int) and not isinstance(value, bool):
            return value if isinstance(index, nodes.Add) else -value
    return None


def _body_reach(body: nodes.Node, parents: dict[int, nodes.Node]) -> int | None:
    """How far the body looks at neighbours, if it reads ``messages`` only as ``messages[loop.index0 ± c]``."""
    reach = 0
    for node in _walk(body):
        if not (isinstance(node, nodes.Name) and node.name == "messages" and node.ctx == "load"):
            continue
        parent = parents.get(id(node))
        if not isinstance(parent, nodes.Getitem) or parent.node is not node:
            return None
        offset = _neighbour_offset(parent.arg)
        if offset is None:
            return None
        reach = max(reach, abs(offset))
    return reach


def _operands(test: nodes.Node) -> list[nodes.Node]:
    """The operands of a chain of ``and``, left to right."""
    if isinstance(test, nodes.And):
        return [*_operands(test.left), *_operands(test.right)]
    return [test]


def _quiet(expr: nodes.Node, sequence: str | None) -> bool:
    """Whether ``expr`` cannot fail or act: constants, ``loop`` positions, the scanned list's length, arithmetic."""
    if isinstance(expr, nodes.Const):
        return True
    if isinstance(expr, nodes.Getattr):
        return (
            isinstance(expr.node, nodes.Name) and expr.node.name == "loop" and expr.attr in ("index", "index0", "first")
        )
    if isinstance(expr, nodes.Filter):
        return (
            expr.name == "length"
            and isinstance(expr.node, nodes.Name)
            and expr.node.name == sequence
            and not expr.args
            and not expr.kwargs
        )
    if isinstance(expr, (nodes.Add, nodes.Sub, nodes.Mul)):
        return _quiet(expr.left, sequence) and _quiet(expr.right, sequence)
    return False


def _stop_scans(body: list[nodes.Node]) -> list[nodes.Node]:
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
            stopped = _stopped_scan(node)
            if stopped is not None:
                node = stopped
        out.append(node)
    return out


def _stopped_scan(loop: nodes.For) -> nodes.For | None:
    if loop.test is not None or loop.else_ or loop.recursive:
        return None
    sequence = loop.iter.node if isinstance(loop.iter, nodes.Getitem) else loop.iter
    sequence_name = sequence.name if isinstance(sequence, nodes.Name) else None
    ifs = [n for n in loop.body if isinstance(n, nodes.If)]
    if len(ifs) != 1 or ifs[0].elif_ or ifs[0].else_:
        return None
    guard = ifs[0]
    for node in loop.body:
        if node is guard:
            continue
        # Besides the ``if``: only loop-local variables set from expressions that cannot fail.
        if not (
            isinstance(node, nodes.Assign) and isinstance(node.target, nodes.Name) and _quiet(node.node, sequence_name)
        ):
            return None
    flag = _operands(guard.test)[0]
    if not (isinstance(flag, nodes.Getattr) and isinstance(flag.node, nodes.Name)):
        return None
    space, attribute = flag.node.name, flag.attr
    lowered = [
        n
        for n in guard.body
        if isinstance(n, nodes.Assign)
        and isinstance(n.target, nodes.NSRef)
        and (n.target.name, n.target.attr) == (space, attribute)
        and isinstance(n.node, nodes.Const)
        and not n.node.value
    ]
    writes = [
        n
        for n in _walk(loop)
        if isinstance(n, (nodes.Assign, nodes.AssignBlock))
        and isinstance(n.target, nodes.NSRef)
        and (n.target.name, n.target.attr) == (space, attribute)
    ]
    rebinds = any(isinstance(n, nodes.Name) and n.name == space and n.ctx in ("store", "param") for n in _walk(loop))
    if len(lowered) != 1 or len(writes) != 1 or rebinds:
        return None
    if any(isinstance(n, (nodes.For, nodes.Break, nodes.Continue, nodes.Macro, nodes.CallBlock)) for n in _walk(guard)):
        return None
    stopped = copy.copy(loop)
    stopped.body = [n for n in loop.body if n is not guard]
    stopped_guard = copy.copy(guard)
    stopped_guard.body = [*guard.body, nodes.Break(lineno=guard.lineno)]
    stopped.body.insert(loop.body.index(guard), stopped_guard)
    return stopped


def split_template(template: Template, source: str) -> SplitTemplate | None:
    """Cut ``source`` at its message loop when the loop body provably depends only on its own window."""
    env = template.environment
    try:
        ast = env.parse(source)
    except Exception:  # a template that does not parse here is rendered whole (and fails there, clearly)
        return None
    loops = [
        i
        for i, node in enumerate(ast.body)
        if isinstance(node, nodes.For) and isinstance(node.iter, nodes.Name) and node.iter.name == "messages"
    ]
    if len(loops) != 1:
        return None
    position = loops[0]
    loop = ast.body[position]
    assert isinstance(loop, nodes.For)
    if loop.test is not None or loop.else_ or loop.recursive or not isinstance(loop.target, nodes.Name):
        return None
    head_nodes, tail_nodes = _stop_scans(ast.body[:position]), ast.body[position + 1 :]
    body_root = nodes.Template(list(loop.body), lineno=loop.lineno)
    head_root = nodes.Template(list(head_nodes), lineno=1)
    tail_root = nodes.Template(list(tail_nodes), lineno=1)
    parents = _parents(ast)

    # The head and the tail are rendered afresh on every call, so they may read anything; what the head leaves
    # for the body (its output and variables) is part of the key under which body outputs are remembered.
    reach = _body_reach(body_root, parents)
    if reach is None:
        return None
    for inner in _walk(body_root):
        # Inside a nested loop, ``loop`` is that loop's: a messages[loop.index0 + c] there is no neighbour.
        if isinstance(inner, nodes.For) and any(
            isinstance(n, nodes.Name) and n.name == "messages" for n in _walk(inner)
        ):
            return None
    for node in _walk(body_root):
        if isinstance(node, (nodes.Macro, nodes.CallBlock, nodes.Break, nodes.Continue, nodes.Extends)):
            return None
        if isinstance(node, (nodes.Include, nodes.Import, nodes.FromImport, nodes.Block)):
            return None
        if isinstance(node, (nodes.Assign, nodes.AssignBlock)) and isinstance(node.target, nodes.NSRef):
            return None  # a namespace write carries state from one message to the next
        if isinstance(node, nodes.Name) and node.name in _IMPURE:
            return None
        if isinstance(node, nodes.Name) and node.name == "loop":
            parent = parents.get(id(node))
            if not (isinstance(parent, nodes.Getattr) and parent.attr in _LOOP_ATTRIBUTES):
                return None
        if isinstance(node, nodes.ExprStmt) and any(isinstance(n, nodes.Call) for n in _walk(node)):
            return None  # {% do x.append(...) %}: a side effect the sandbox may or may not refuse
    # A macro runs with the template's globals: one that reads the messages (or the clock) would let the body
    # see beyond its window through a call.
    macros = {macro.name: macro for macro in ast.find_all(nodes.Macro)}
    tainted = any(
        isinstance(n, nodes.Name) and (n.name == "messages" or n.name in _IMPURE)
        for macro in macros.values()
        for n in _walk(macro)
    )
    if tainted and any(
        isinstance(call, nodes.Call) and isinstance(call.node, nodes.Name) and call.node.name in macros
        for call in _walk(body_root)
    ):
        return None
    marked_loop = nodes.For(
        loop.target,
        loop.iter,
        [*loop.body, nodes.Output([nodes.TemplateData(SENTINEL)])],
        loop.else_,
        loop.test,
        loop.recursive,
        lineno=loop.lineno,
    )
    guarded, guards = _take_guards(body_root, env, loop.target.name)
    reads: frozenset[str] | None = None
    if not macros:
        reads = frozenset(jinja2.meta.find_undeclared_variables(guarded))
    try:
        marked = env.from_string(nodes.Template([*head_nodes, marked_loop, *tail_nodes], lineno=1))
        head = env.from_string(head_root)
        body = env.from_string(guarded)
        tail = env.from_string(tail_root)
    except Exception:
        return None
    return SplitTemplate(
        marked=marked,
        head=head,
        body=body,
        tail=tail,
        target=loop.target.name,
        reach=reach,
        positional=_reads_position(guarded, _parents(guarded)),
        guards=guards,
        reads=reads,
        whole=template,
    )


def _reads_position(body: nodes.Template, parents: dict[int, nodes.Node]) -> bool:
    """Whether the body uses ``loop.index``/``loop.index0`` for anything but ``messages[loop.index0 ± c]``."""
    for node in _walk(body):
        if not (
            isinstance(node, nodes.Getattr)
            and node.attr in ("index", "index0")
            and isinstance(node.node, nodes.Name)
            and node.node.name == "loop"
        ):
            continue
        parent = parents.get(id(node))
        child: nodes.Node = node
        first = 0 if node.attr == "index0" else 1
        if (
            isinstance(parent, nodes.Compare)
            and parent.expr is node
            and len(parent.ops) == 1
            and parent.ops[0].op in ("eq", "ne")
            and isinstance(parent.ops[0].expr, nodes.Const)
            and parent.ops[0].expr.value == first
        ):
            continue  # loop.index0 == 0 is loop.first, which the memo key holds
        if isinstance(parent, (nodes.Add, nodes.Sub)) and node.attr == "index0":
            child, parent = parent, parents.get(id(parent))
        if not (
            node.attr == "index0"
            and isinstance(parent, nodes.Getitem)
            and parent.arg is child
            and isinstance(parent.node, nodes.Name)
            and parent.node.name == "messages"
        ):
            return True
    return False


# Written after every loop iteration by the marked template, to cut one whole render into per-message outputs.
# Private-use characters around a fixed tag; if a message happens to contain it, the cut is refused (count check).
SENTINEL = "\ue000contextkeeper-body-end\ue001"

_BOOL = frozenset({bool})

_OUTSIDE = object()  # a neighbour index past the end: the template sees Undefined there


def _window(messages: list[Any], index: int, reach: int) -> tuple[Any, ...]:
    """The messages the body at ``index`` can read, as Jinja indexes a list: negative indices wrap around."""
    count = len(messages)
    if reach <= index < count - reach:  # no wrap-around and nothing outside: one slice
        return tuple(messages[index - reach : index + reach + 1])
    return tuple(
        messages[position] if -count <= position < count else _OUTSIDE
        for position in range(index - reach, index + reach + 1)
    )


# Above this many bodies to render, one marked whole render (cut at the sentinels) beats rendering each body.
_BATCH = 8


def _body_size(key: Any, entry: tuple[tuple[Any, ...], str]) -> int:
    # The key (ints, flags, ids), the window and the body's text. The views the window holds are counted where the
    # counter keeps them (its own memo of views, filled in the same count, so dropped at about the same time):
    # counting them again for each of up to hundreds of bodies per render would cost more than the render.
    window, text = entry
    return sys.getsizeof(key) + 32 * len(key) + sys.getsizeof(window) + sys.getsizeof(text) + 64


class IncrementalRenderer:
    """Renders a split template, reusing each message's body output while its window is unchanged. The outputs
    live in :class:`Memo` caches, within the shared cache budget."""

    def __init__(self, split: SplitTemplate, *, generations: int = 4) -> None:
        self.split = split
        self._generations = generations
        # One memo per generation (what the head leaves for the body), newest last: a caller that alternates
        # between, say, counting with and without tools keeps both.
        self._memos: dict[Any, Memo[Any, tuple[tuple[Any, ...], str]]] = {}
        # Per generation: the last call's messages, body outputs and guard results.
        self._previous: dict[Any, tuple[list[Any], list[str], list[tuple[Any, ...]]]] = {}
        self._lock = threading.Lock()  # a memo and its generation change together
        self.reused = 0

    def render(self, context: dict[str, Any]) -> str:
        """The same text as rendering the whole template with ``context``."""
        return "".join(self.render_segments(context))

    def render_segments(self, context: dict[str, Any]) -> list[str]:
        """That text in pieces whose concatenation it is: the head's output, each message's body output and the
        tail's (the very same string objects while reused, so counts can be cached by them); one piece when the
        template had to be rendered whole."""
        with self._lock:
            return self._render(context)

    def _keep_newest(self, per_generation: dict[Any, Any]) -> None:
        while len(per_generation) > self._generations:
            del per_generation[next(iter(per_generation))]

    def _render_marked(self, context: dict[str, Any], head_text: str, count: int) -> tuple[list[str], str] | None:
        """Every body's output from one whole render, or None when the cut is not clean."""
        parts = self.split.marked.render(context).split(SENTINEL)
        if len(parts) != count + 1 or not parts[0].startswith(head_text):
            return None  # a message contains the sentinel, or the head rendered differently (a date rolled over)
        bodies = [parts[0][len(head_text) :], *parts[1:count]] if count else []
        tail = parts[count] if count else parts[0][len(head_text) :]
        return bodies, tail

    def _render(self, context: dict[str, Any]) -> list[str]:
        split = self.split
        module = split.head.make_module(context)
        head_text = str(module)
        exported = {k: v for k, v in vars(module).items() if not k.startswith("_")}
        scope = {**context, **exported}
        messages = scope["messages"]
        count = len(messages)
        guards = split.guards
        # Each position's guard results (see Guard): part of the key of every body output.
        marks: list[tuple[Any, ...]]
        if guards:
            try:
                env = split.body.environment
                columns = [guard.evaluate(env, scope, count) for guard in guards]
            except Exception:  # the template decides (it may never reach the comparison, or fail clearly)
                columns = []
            if len(columns) != len(guards) or not all(_BOOL.issuperset(map(type, column)) for column in columns):
                assert split.whole is not None
                return [split.whole.render(context)]
            marks = list(zip(*columns, strict=True))
        else:
            marks = [()] * count
        # Anything the body can read besides its window: the head's variables and the call's context (only the
        # names the body reads, when known; else the head's output too). Macros are left out: they are code from
        # the template itself, recreated (new objects) on every render.
        reads = split.reads
        generation = (
            head_text if reads is None else "",
            repr(
                sorted(
                    (k, repr(v))
                    for k, v in scope.items()
                    if k != "messages" and (reads is None or k in reads) and not callable(v)
                )
            ),
        )
        memo = self._memos.pop(generation, None)
        if memo is None:
            memo = Memo("incremental.bodies", sizer=_body_size)
        self._memos[generation] = memo
        self._keep_newest(self._memos)
        reach = split.reach
        body = split.body
        positional = split.positional
        # Whole runs reused from the previous call under this generation: a prefix and a suffix of bodies whose
        # windows lie inside the runs of identical message objects the two lists share at their start and at
        # their end, and whose flags ("first", "last") and guard results are unchanged.
        previous = self._previous.get(generation)
        reuse_from, reuse_to = 0, 0  # bodies [reuse_from, reuse_to) are the previous call's at the same index
        tail_from, shift = count, 0  # bodies [tail_from, count) are the previous call's at index - shift
        last_texts: list[str] = []
        if previous is not None:
            last_messages, last_texts, last_marks = previous
            old_count = len(last_messages)
            shared = shared_prefix(messages, last_messages)
            # Bodies before ``reach`` may read messages[-1]... (Python indexing wraps), the list's changing end,
            # so they go through the per-message path below; the rest of the shared prefix is taken whole.
            reuse_from, reuse_to = reach, max(reach, shared - reach)
            for flag_index in (old_count - 1, count - 1):  # the only places where loop.last can differ
                if reuse_from <= flag_index < reuse_to and (flag_index == old_count - 1) != (flag_index == count - 1):
                    reuse_to = flag_index
            if guards and last_marks[reuse_from:reuse_to] != marks[reuse_from:reuse_to]:
                reuse_to = next(i for i in range(reuse_from, reuse_to) if last_marks[i] != marks[i])
            shift = count - old_count
            if not positional or shift == 0:
                ended = shared_suffix(messages, last_messages)
                # Not the first body of either list (loop.first), nor one whose window wraps to the list's end.
                tail_from = min(count, max(count - ended + reach, reach + max(shift, 0), 1 + max(shift, 0), reuse_to))
                if tail_from < count and guards and last_marks[tail_from - shift :] != marks[tail_from:]:
                    tail_from = 1 + max(i for i in range(tail_from, count) if last_marks[i - shift] != marks[i])

        def key_of(index: int, window: tuple[Any, ...]) -> Any:
            if positional:
                return (index, index == count - 1, marks[index])
            return (index == 0, index == count - 1, marks[index], *map(id, window))

        def scope_of(index: int) -> dict[str, Any]:
            local = {**scope, split.target: messages[index], "loop": LoopState(index, count)}
            for guard, value in zip(guards, marks[index], strict=True):
                local[guard.name] = value
            return local

        # Look every other body up first: only when many are new is one whole (marked) render cheaper.
        run = reuse_to > reuse_from
        before = range(reuse_from if run else 0)
        middle = range(reuse_to if run else 0, tail_from)
        found: dict[int, str] = {}
        misses = 0 if memo else len(before) + len(middle)  # an empty memo (a first render) has nothing to find
        for index in (*before, *middle) if memo else ():
            window = _window(messages, index, reach)
            known = memo.get(key_of(index, window))
            if (
                known is not None
                and len(known[0]) == len(window)
                and all(a is b for a, b in zip(known[0], window, strict=True))
            ):
                found[index] = known[1]
            else:
                misses += 1
        if misses > _BATCH:
            cut = self._render_marked(context, head_text, count)
            if cut is not None:
                bodies, tail_text = cut
                windows = [_window(messages, index, reach) for index in range(len(bodies))]
                memo.put_many(
                    (key_of(index, window), (window, text))
                    for index, (window, text) in enumerate(zip(windows, bodies, strict=True))
                )
                self._previous[generation] = (list(messages), bodies, marks)
                self._keep_newest(self._previous)
                return [head_text, *bodies, tail_text]

        def body_of(index: int) -> str:
            known_text = found.get(index)
            if known_text is not None:
                self.reused += 1
                return known_text
            window = _window(messages, index, reach)
            text = body.render(scope_of(index))
            memo.put(key_of(index, window), (window, text))
            return text

        texts = [body_of(index) for index in before]
        if run:
            texts.extend(last_texts[reuse_from:reuse_to])
        texts.extend(body_of(index) for index in middle)
        texts.extend(last_texts[tail_from - shift :] if tail_from < count else ())
        self.reused += (reuse_to - reuse_from if run else 0) + count - tail_from
        tail_text = split.tail.render(scope)
        self._previous[generation] = (list(messages), texts, marks)
        self._keep_newest(self._previous)
        return [head_text, *texts, tail_text]
