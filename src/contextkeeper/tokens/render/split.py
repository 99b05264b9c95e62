"""Cutting a chat template at its message loop, when a sequence of named checks proves that safe."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import jinja2.meta
from jinja2 import Template, nodes

from .ahead import Ahead, take_aheads
from .guards import Guard, take_guards
from .scan import stop_scans
from .scans import Scan, take_scans
from .syntax import (
    IMPURE,
    LOOP_ATTRIBUTES,
    body_reach,
    is_namespace_call,
    message_reads,
    parents_of,
    reads_position,
    walk,
)

# Written after every loop iteration by the marked template, to cut one whole render into per-message outputs.
# Private-use characters around a fixed tag; if a message happens to contain it, the cut is refused (count check).
SENTINEL = "\ue000contextkeeper-body-end\ue001"
RECORD = "__contextkeeper_record"  # the function a marked render of a template with carried state calls


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
    # Scans of the messages after the current one, replaced in ``body`` by variables (see Ahead).
    aheads: tuple[Ahead, ...] = ()
    # Scans of the neighbours up to one that passes a test, running over their spans in ``body`` (see Scan).
    scans: tuple[Scan, ...] = ()
    # Namespaces the head makes and the body writes: their state before each body is part of its key.
    carried: tuple[str, ...] = ()
    sequence: str = "messages"  # the list the loop runs over: ``messages``, or a name the head binds to a slice
    # The names the body reads from the render's context (None: it may read any, e.g. through a macro).
    reads: frozenset[str] | None = None
    whole: Template | None = None  # the template itself, for a render the guards cannot decide


@dataclass(frozen=True)
class Refusal:
    """Why a template is rendered whole: the check that refused it (a name in :data:`CHECKS`, or ``parses`` /
    ``compiles`` when the template or a part of it does not) and what it found, with its line."""

    check: str
    reason: str


def _of_messages(value: nodes.Node) -> bool:
    """``messages``, or a slice of it with constant bounds."""
    if isinstance(value, nodes.Name):
        return value.name == "messages"
    return (
        isinstance(value, nodes.Getitem)
        and isinstance(value.node, nodes.Name)
        and value.node.name == "messages"
        and isinstance(value.arg, nodes.Slice)
        and all(
            part is None or isinstance(part, nodes.Const) for part in (value.arg.start, value.arg.stop, value.arg.step)
        )
    )


def _assigned(root: nodes.Node) -> set[str]:
    """The names ``{% set name = ... %}`` binds below ``root``."""
    return {n.target.name for n in walk(root) if isinstance(n, nodes.Assign) and isinstance(n.target, nodes.Name)}


def _outside_loops(root: nodes.Node) -> list[nodes.Node]:
    """The nodes below ``root`` that are not inside a nested loop or macro."""
    return _outside(root, (nodes.For, nodes.Macro, nodes.CallBlock))


def _outside(root: nodes.Node, kinds: tuple[type[nodes.Node], ...]) -> list[nodes.Node]:
    """The nodes below ``root`` that are not inside a node of one of ``kinds``."""
    out: list[nodes.Node] = []
    pending = list(root.iter_child_nodes())
    while pending:
        node = pending.pop()
        out.append(node)
        if not isinstance(node, kinds):
            pending.extend(node.iter_child_nodes())
    return out


def _made_namespaces(root: nodes.Node) -> list[nodes.Assign]:
    """The ``{% set name = namespace(...) %}`` below ``root``, nested loops included (a loop's own namespace is
    new in each of its iterations too), macros not."""
    return [
        n
        for n in _outside(root, (nodes.Macro, nodes.CallBlock))
        if isinstance(n, nodes.Assign) and isinstance(n.target, nodes.Name) and is_namespace_call(n.node)
    ]


# Nodes through which a loop can write output (or change a value in place, `{% do %}`).
_WRITING = (nodes.Output, nodes.Include, nodes.CallBlock, nodes.FilterBlock, nodes.Block, nodes.Extends, nodes.ExprStmt)


@dataclass(frozen=True)
class Parsed:
    """A parsed template and the parts of it the checks look at (each computed once, when first asked for)."""

    ast: nodes.Template
    env: Any  # compiles the look-ahead tests (see ``take_aheads``)

    @cached_property
    def sequences(self) -> frozenset[str]:
        """``messages``, and the names the template only ever binds to it or to a slice of it at its top level
        (``{% set loop_messages = messages[1:] %}``, inside top-level ``if`` blocks too)."""
        top: list[nodes.Node] = []
        pending = list(self.ast.body)
        while pending:
            node = pending.pop()
            top.append(node)
            if isinstance(node, nodes.If):
                pending += [*node.body, *node.elif_, *node.else_]
        aliases = {n.target.name for n in top if isinstance(n, nodes.Assign) and isinstance(n.target, nodes.Name)} - {
            "messages"
        }
        for n in walk(self.ast):
            if isinstance(n, nodes.Name) and n.name in aliases and n.ctx != "load":
                assign = next((a for a in top if isinstance(a, nodes.Assign) and a.target is n), None)
                if assign is None or not _of_messages(assign.node):
                    aliases.discard(n.name)
        return frozenset({"messages", *aliases})

    @cached_property
    def loops(self) -> list[int]:
        """Positions of the top-level loops over the messages (see ``sequences``) that write output. A loop that
        writes nothing (a scan that only sets variables, such as DeepSeek's gathering of system prompts) stays
        in the head or the tail, which are rendered afresh on every call."""
        return [
            i
            for i, node in enumerate(self.ast.body)
            if isinstance(node, nodes.For)
            and isinstance(node.iter, nodes.Name)
            and node.iter.name in self.sequences
            and any(True for _ in node.find_all(_WRITING))
        ]

    @cached_property
    def sequence(self) -> str:
        """The name the message loop runs over (once ``one_message_loop`` has passed)."""
        assert isinstance(self.loop.iter, nodes.Name)
        return str(self.loop.iter.name)

    @cached_property
    def local_namespaces(self) -> frozenset[str]:
        """Namespaces the body makes itself (``{% set ns = namespace(...) %}``, in its own loops too): new in every
        iteration, so they carry nothing from one message to the next."""
        return frozenset(n.target.name for n in _made_namespaces(self.body) if isinstance(n.target, nodes.Name))

    @cached_property
    def carried(self) -> tuple[str, ...]:
        """The namespaces the body writes (``{% set ns.flag = ... %}``), in order of first write."""
        names = [
            n.target.name
            for n in walk(self.body)
            if isinstance(n, (nodes.Assign, nodes.AssignBlock))
            and isinstance(n.target, nodes.NSRef)
            and n.target.name not in self.local_namespaces
        ]
        return tuple(dict.fromkeys(names))

    @cached_property
    def loop(self) -> nodes.For:
        """The message loop (once ``one_message_loop`` has passed)."""
        loop = self.ast.body[self.loops[0]]
        assert isinstance(loop, nodes.For)
        return loop

    @cached_property
    def lifted(self) -> tuple[nodes.Template, tuple[Ahead, ...], tuple[Scan, ...]]:
        """The loop body with its look-ahead scans taken out (see ``take_aheads``) and its scans of the
        neighbours running over their spans (see ``take_scans``), and those scans."""
        raw = nodes.Template(list(self.loop.body), lineno=self.loop.lineno)
        body, aheads = take_aheads(raw, self.env, self.sequence)
        body, scans = take_scans(body, self.env, self.sequence)
        return body, aheads, scans

    @cached_property
    def body(self) -> nodes.Template:
        """The loop body as the checks see it and the split renders it: look-ahead scans taken out."""
        return self.lifted[0]

    @cached_property
    def parents(self) -> dict[int, nodes.Node]:
        return {**parents_of(self.ast), **parents_of(self.body)}

    @cached_property
    def macros(self) -> dict[str, nodes.Macro]:
        return {macro.name: macro for macro in self.ast.find_all(nodes.Macro)}


Check = Callable[[Parsed], str | None]
# The checks, in the order they run; each returns None (passed) or why it refuses, and may assume the ones
# before it passed. The head and the tail are rendered afresh on every call, so they may read anything; what
# the head leaves for the body (its output and variables) is part of the key under which body outputs are kept.
CHECKS: dict[str, Check] = {}


def _check(function: Check) -> Check:
    CHECKS[function.__name__] = function
    return function


def _first(found: Iterable[nodes.Node], what: str) -> str | None:
    """``what``, with the line of the first node ``found``; None when there is none."""
    node = next(iter(found), None)
    return None if node is None else f"{what} (line {node.lineno})"


@_check
def one_message_loop(parsed: Parsed) -> str | None:
    count = len(parsed.loops)
    if count == 0:
        return "no top-level `{% for ... in messages %}` loop (it loops inside an `if`, or over another list)"
    if count > 1:
        return f"{count} top-level loops over `messages` write output; only a template with one can be cut"
    return None


@_check
def plain_loop(parsed: Parsed) -> str | None:
    loop = parsed.loop
    if loop.test is not None:
        return f"the message loop is filtered (`for ... if ...`, line {loop.lineno}): positions are not the list's"
    if loop.else_:
        return f"the message loop has an `else` (line {loop.lineno})"
    if loop.recursive:
        return f"the message loop is recursive (line {loop.lineno})"
    if not isinstance(loop.target, nodes.Name):
        return f"the message loop unpacks its items (line {loop.lineno})"
    return None


@_check
def neighbours_only(parsed: Parsed) -> str | None:
    sequence = parsed.sequence
    far = (name for name, offset in message_reads(parsed.body, parsed.parents, sequence) if offset is None)
    return _first(far, f"the body reads `{sequence}` other than as {sequence}[loop.index0 ± c]")


@_check
def no_nested_message_loop(parsed: Parsed) -> str | None:
    # Inside a nested loop, ``loop`` is that loop's: a messages[loop.index0 + c] there is no neighbour.
    nested = (
        inner
        for inner in walk(parsed.body)
        if isinstance(inner, nodes.For)
        and any(isinstance(n, nodes.Name) and n.name in ("messages", parsed.sequence) for n in walk(inner))
    )
    return _first(nested, "a loop inside the body reads `messages`")


@_check
def no_macros_or_jumps(parsed: Parsed) -> str | None:
    kinds = (nodes.Macro, nodes.CallBlock, nodes.Break, nodes.Continue, nodes.Extends)
    return _first((n for n in walk(parsed.body) if isinstance(n, kinds)), "the body defines a macro or jumps")


@_check
def no_imports(parsed: Parsed) -> str | None:
    kinds = (nodes.Include, nodes.Import, nodes.FromImport, nodes.Block)
    return _first((n for n in walk(parsed.body) if isinstance(n, kinds)), "the body includes, imports or has a block")


@_check
def carried_namespaces_only(parsed: Parsed) -> str | None:
    # A namespace the body writes carries state from one message to the next. That state is threaded through
    # the bodies (part of each body's key, its value after the body remembered with the output) when the head
    # makes the namespace once, at its top level, and nothing else in the template binds the name again or
    # reaches it from a macro.
    others = [node for node in parsed.ast.body if node is not parsed.loop]
    outside = _assigned(nodes.Template(others, lineno=1))
    shadowed = sorted(parsed.local_namespaces & outside)
    if shadowed:
        return f"the body makes namespace `{shadowed[0]}`, a name the template also binds outside the loop"
    for name in parsed.carried:
        reason = _carry_refusal(parsed, name)
        if reason is not None:
            return reason
    return None


def _carry_refusal(parsed: Parsed, name: str) -> str | None:
    """Why the body cannot carry namespace ``name`` from message to message; None when it can."""
    # A macro that binds the name for itself before it uses it (Gemma 4's formatting macros each make an
    # ``ns`` of their own) never reaches the carried one: its stores do not count.
    own = [macro for macro in parsed.macros.values() if _mentions(macro, name) and _binds_first(macro.body, name)]
    if _head_makes(parsed, name) != 1 or _stores(parsed, name, own) != 1:
        where = next(iter(n for n in walk(parsed.body) if isinstance(n, nodes.NSRef) and n.name == name))
        return (
            f"the body writes namespace `{name}`, which the head does not make once at its top level with "
            f"namespace(...) (line {where.lineno})"
        )
    if any(_mentions(macro, name) for macro in parsed.macros.values() if macro not in own):
        return f"a macro reads or writes namespace `{name}`, which the body carries from message to message"
    return None


def _head_makes(parsed: Parsed, name: str) -> int:
    """How many ``{% set name = namespace(...) %}`` the head has at its top level."""
    return sum(
        1
        for n in parsed.ast.body[: parsed.loops[0]]
        if isinstance(n, nodes.Assign)
        and isinstance(n.target, nodes.Name)
        and n.target.name == name
        and is_namespace_call(n.node)
    )


def _stores(parsed: Parsed, name: str, own: list[nodes.Macro]) -> int:
    """How many places in the template bind ``name``, outside the macros ``own`` that bind it for themselves."""
    inside_own = {id(n) for macro in own for n in walk(macro)}
    return sum(
        1
        for n in walk(parsed.ast)
        if isinstance(n, nodes.Name) and n.name == name and n.ctx != "load" and id(n) not in inside_own
    )


def _mentions(node: nodes.Node, name: str) -> bool:
    return any(isinstance(n, nodes.Name) and n.name == name for n in [node, *walk(node)])


def _binds_first(statements: list[nodes.Node], name: str) -> bool:
    """Whether every use of ``name`` in ``statements`` (a macro's body) comes after a ``{% set name = ... %}`` of
    its own that runs first: at the top of the statements, or of each ``if`` branch or loop body that uses the
    name, with nothing after that ``if`` or loop using it. Jinja makes such a name the macro's own, so the macro
    cannot reach a variable of the same name outside it."""
    for position, statement in enumerate(statements):
        if not _mentions(statement, name):
            continue
        if isinstance(statement, nodes.Assign) and isinstance(statement.target, nodes.Name):
            return statement.target.name == name and not _mentions(statement.node, name)
        if isinstance(statement, (nodes.If, nodes.For)):
            if isinstance(statement, nodes.If):
                branches = [statement.body, *(branch.body for branch in statement.elif_), statement.else_]
                tests = [statement.test, *(branch.test for branch in statement.elif_)]
            else:
                branches = [statement.body, statement.else_]
                tests = [statement.target, statement.iter, *([statement.test] if statement.test else [])]
            return (
                not any(_mentions(test, name) for test in tests)
                and all(_binds_first(branch, name) for branch in branches)
                and not any(_mentions(n, name) for n in statements[position + 1 :])
            )
        return False
    return True


@_check
def no_impure_calls(parsed: Parsed) -> str | None:
    # A namespace the body makes for itself is new in every iteration (see ``local_namespaces``).
    local = {id(n.node.node) for n in _made_namespaces(parsed.body) if isinstance(n.node, nodes.Call)}
    impure = (n for n in walk(parsed.body) if isinstance(n, nodes.Name) and n.name in IMPURE and id(n) not in local)
    return _first(impure, f"the body uses one of {', '.join(sorted(IMPURE))} (a date, or state across messages)")


@_check
def loop_position_only(parsed: Parsed) -> str | None:
    def allowed(node: nodes.Node) -> bool:
        parent = parsed.parents.get(id(node))
        return isinstance(parent, nodes.Getattr) and parent.attr in LOOP_ATTRIBUTES

    use = next(
        (n for n in walk(parsed.body) if isinstance(n, nodes.Name) and n.name == "loop" and not allowed(n)), None
    )
    if use is None:
        return None
    parent = parsed.parents.get(id(use))
    what = f"loop.{parent.attr}" if isinstance(parent, nodes.Getattr) else "`loop` itself"
    per_message = ", ".join(f"loop.{name}" for name in sorted(LOOP_ATTRIBUTES))
    return f"the body reads {what} (line {use.lineno}); only {per_message} are per message"


@_check
def no_side_effects(parsed: Parsed) -> str | None:
    # {% do x.append(...) %}: a side effect the sandbox may or may not refuse.
    calls = (
        n
        for n in walk(parsed.body)
        if isinstance(n, nodes.ExprStmt) and any(isinstance(c, nodes.Call) for c in walk(n))
    )
    return _first(calls, "the body calls something for its effect (`{% do ... %}`)")


@_check
def no_macro_reads_messages(parsed: Parsed) -> str | None:
    # A macro runs with the template's globals: one that reads the messages (or the clock) would let the body
    # see beyond its window through a call.
    # Objects a macro makes for itself (Gemma 4's formatting macros each make a namespace) are new in every call.
    macros = parsed.macros
    tainted = any(_tainted(macro) for macro in macros.values())
    calls = (
        call
        for call in walk(parsed.body)
        if isinstance(call, nodes.Call) and isinstance(call.node, nodes.Name) and call.node.name in macros
    )
    return None if not tainted else _first(calls, "the body calls a macro, and a macro reads `messages` or the clock")


def _tainted(macro: nodes.Macro) -> bool:
    """Whether ``macro`` reads the messages or the clock, or keeps state where a later call (or the body) sees
    it: a namespace, cycler or joiner it does not make for itself (``range`` holds nothing)."""
    own = {
        n.target.name
        for n in walk(macro)
        if isinstance(n, nodes.Assign) and isinstance(n.target, nodes.Name) and _binds_first(macro.body, n.target.name)
    }
    made = {
        id(n.node.node)
        for n in walk(macro)
        if isinstance(n, nodes.Assign)
        and isinstance(n.target, nodes.Name)
        and n.target.name in own
        and isinstance(n.node, nodes.Call)
    }
    for n in walk(macro):
        if isinstance(n, nodes.Name) and n.name in ("messages", "strftime_now"):
            return True
        if isinstance(n, nodes.Name) and n.name in IMPURE - {"range"} and id(n) not in made:
            return True
        if isinstance(n, nodes.NSRef) and n.name not in own:
            return True
    return False


def _reads(body: nodes.Template, macros: dict[str, nodes.Macro]) -> frozenset[str] | None:
    """The names the body reads from the render's context: its own, and those of every macro (a macro runs with
    the template's globals, and the body may call any of them, which may call the others). None when a macro's
    reads cannot be told apart from its parameters."""
    names = set(jinja2.meta.find_undeclared_variables(body))
    for macro in macros.values():
        if any(isinstance(n, nodes.Name) and n.name in ("varargs", "kwargs", "caller") for n in walk(macro)):
            return None
        own = {arg.name for arg in macro.args}
        inside = nodes.Template(list(macro.body), lineno=1)
        inside.environment = body.environment  # the nodes are the template's own: only this wrapper needs it
        names |= set(jinja2.meta.find_undeclared_variables(inside)) - own
    return frozenset(names)


def try_split(template: Template, source: str) -> SplitTemplate | Refusal:
    """``source`` cut at its message loop, or the first check that refuses to (see :data:`CHECKS`)."""
    env = template.environment
    try:
        parsed = Parsed(env.parse(source), env)
    except Exception as exc:  # a template that does not parse here is rendered whole (and fails there, clearly)
        return Refusal("parses", f"the template does not parse: {exc}")
    try:
        for name, check in CHECKS.items():
            reason = check(parsed)
            if reason is not None:
                return Refusal(name, reason)
    except Exception as exc:  # a look-ahead test that does not compile, say: rendered whole
        return Refusal("compiles", f"a part of the cut template does not compile: {exc}")
    return _cut(template, parsed)


def split_template(template: Template, source: str) -> SplitTemplate | None:
    """Cut ``source`` at its message loop when the loop body provably depends only on its own window."""
    split = try_split(template, source)
    return split if isinstance(split, SplitTemplate) else None


def _cut(template: Template, parsed: Parsed) -> SplitTemplate | Refusal:
    """The head, body, tail and marked whole of a template every check passed (refused if one does not compile)."""
    env: Any = template.environment
    ast, loop, position = parsed.ast, parsed.loop, parsed.loops[0]
    head_nodes, tail_nodes = stop_scans(ast.body[:position]), ast.body[position + 1 :]
    sequence = parsed.sequence
    reach = body_reach(parsed.body, parsed.parents, sequence)
    assert reach is not None  # neighbours_only passed
    # With carried namespaces, each iteration of the marked render also hands their state to RECORD (see
    # IncrementalRenderer), so one whole render gives every body's output and the state it leaves.
    record = (
        [
            nodes.Output(
                [
                    nodes.Call(
                        nodes.Name(RECORD, "load"), [nodes.Name(n, "load") for n in parsed.carried], [], None, None
                    )
                ]
            )
        ]
        if parsed.carried
        else []
    )
    marked_loop = nodes.For(
        loop.target,
        loop.iter,
        [*loop.body, *record, nodes.Output([nodes.TemplateData(SENTINEL)])],
        loop.else_,
        loop.test,
        loop.recursive,
        lineno=loop.lineno,
    )
    assert isinstance(loop.target, nodes.Name)  # plain_loop passed
    guarded, guards = take_guards(parsed.body, env, loop.target.name)
    reads = _reads(guarded, parsed.macros)
    try:
        marked = env.from_string(nodes.Template([*head_nodes, marked_loop, *tail_nodes], lineno=1))
        head = env.from_string(nodes.Template(list(head_nodes), lineno=1))
        body = env.from_string(guarded)
        tail = env.from_string(nodes.Template(list(tail_nodes), lineno=1))
    except Exception as exc:
        return Refusal("compiles", f"a part of the cut template does not compile: {exc}")
    return SplitTemplate(
        marked=marked,
        head=head,
        body=body,
        tail=tail,
        target=loop.target.name,
        reach=reach,
        positional=reads_position(guarded, parents_of(guarded), sequence),
        guards=guards,
        aheads=parsed.lifted[1],
        scans=parsed.lifted[2],
        carried=parsed.carried,
        sequence=sequence,
        reads=reads,
        whole=template,
    )
