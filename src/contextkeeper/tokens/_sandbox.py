"""Sandboxed, bounded Jinja rendering of chat templates, identical in output to transformers' own.

Chat templates are untrusted code from model repositories, so they only ever run in Jinja's
``ImmutableSandboxedEnvironment``, configured as transformers configures it (:mod:`._chat_rules`: so
``raise_exception``, ``strftime_now``, ``tojson`` and ``{% generation %}`` behave the same), with fast paths for
what templates mostly do — ``message.role`` on plain dicts, ``text.strip()`` on strings, ``ns.flag`` on
namespaces — which skip the generic sandbox probing. Each returns the same value the sandbox would (none of those
names is unsafe on those types), and the checks still apply to everything else.

The sandbox stops a template from escaping, not from running forever or filling memory, so every render is
also bounded (:class:`TemplateLimits`): loop iterations and calls (``steps``), characters written (``output``,
also the largest string one expression may build, checked *before* it is built: ``'x' * 10**9``, ``~``, ``+``,
``%``, ``|join``, ``|indent``, ``.center()``, …), call depth (``nesting``: recursive macros) and time
(``seconds``: the rendering thread's own CPU time less its garbage collections, checked every few hundred steps
and writes; no signals or threads, so it works on any thread). Not wall time: under load (other threads holding
the GIL, other processes, a full collection of a large heap) an honest render can take seconds of wall time, and
it must not be refused for that.
The checks are compiled into the template: our code generator wraps each loop's iterable and each output, and
the environment intercepts calls, the string-building operators and the filters that can grow their input.
Past a bound the render stops with :class:`TemplateLimitExceeded`, naming the bound and the setting to raise.

Scans that Jinja cannot stop (it has no ``break`` in the syntax templates use) are stopped at compile time once
their remaining iterations provably do nothing (see :mod:`.render.settle`), so a template that scans the chat
for every message is no longer quadratic in its length. ``compile_template(source, False)`` compiles without
that, the slow reference the tests compare with.
"""

from __future__ import annotations

import contextvars
import gc
import re
import threading
import time
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import chain, islice
from string import Formatter
from typing import Any

from jinja2 import Template, nodes
from jinja2.compiler import CodeGenerator, Frame, optimizeconst
from jinja2.environment import TemplateModule
from jinja2.runtime import LoopContext, Macro, Undefined
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace, _PassArg, pass_context

from .._exceptions import ChatTemplateError, ConfigurationError, TemplateLimitExceeded
from .._memo import IdentityMemo, approx_size, data_size, memoize
from .._memo import same_values as same_values
from ._c_json import c_tojson
from ._chat_rules import CHAT_RULES
from .render import LoopState
from .render.settle import ITEMS, NO_PLAN, SettlePlan, settle

__all__ = [
    "DEFAULT_LIMITS",
    "FROZEN_JSON",
    "JINJA_RULES",
    "PYTHON_JINJA",
    "JinjaRules",
    "TemplateLimits",
    "bounded",
    "c_value",
    "compile_template",
    "limits_of",
    "same_values",
]

_DICT_ATTRIBUTES = frozenset(dir(dict))
# dict methods that only read (the immutable sandbox refuses the others: clear, pop, popitem, setdefault, update).
_DICT_READS = frozenset({"get", "items", "keys", "values", "copy"})
# Builtin methods of these types that reach ``call`` were let through by the sandbox's attribute checks, and none
# is marked unsafe: they are called directly (str ones after the size check they need).
_PLAIN_SELVES = frozenset({str, dict, list, tuple})
# str.format / format_map go through the sandbox's own wrapper (it blocks attribute access in the format string).
_FORMAT_METHODS = frozenset({"format", "format_map"})


# --------------------------------------------------------------------------------------------------- bounds


@dataclass(frozen=True, kw_only=True)
class TemplateLimits:
    """Bounds on one render of a chat template (one count). The defaults leave every template the tests fetch a
    wide margin on long chats (a 300-message agent chat with tools uses under a tenth of each).

    ``steps``: loop iterations plus calls plus items a filter materialises; ``output_chars``: characters
    written, counting each write (a macro's output counts where it is written and again where it is used), and
    the longest string or list one expression may build; ``seconds``: CPU time of the rendering thread, its
    garbage collections excluded; ``nesting``: depth of macro
    calls and recursive loops.
    """

    steps: int = 5_000_000
    output_chars: int = 32_000_000
    seconds: float = 2.0
    nesting: int = 64

    def __post_init__(self) -> None:
        for name in ("steps", "output_chars", "nesting"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigurationError(
                    f"TemplateLimits.{name} must be a positive integer, got {value!r}. Fix: pass a number such as "
                    f"{type(self).__dataclass_fields__[name].default:,}."
                )
        if isinstance(self.seconds, bool) or not isinstance(self.seconds, (int, float)) or not self.seconds > 0:
            raise ConfigurationError(
                f"TemplateLimits.seconds must be a positive number, got {self.seconds!r}. Fix: pass e.g. 2.0."
            )


DEFAULT_LIMITS = TemplateLimits()

_WHAT = {
    "steps": "loop iterations and calls",
    "output": "characters written",
    "size": "characters (or items) in one value it builds",
    "nesting": "levels of nested macro calls",
    "time": "seconds of rendering (CPU time)",
}
_SETTING = {
    "steps": "template_limits.steps",
    "output": "template_limits.output_chars",
    "size": "template_limits.output_chars",
    "nesting": "template_limits.nesting",
    "time": "template_limits.seconds",
}
_CLOCK_EVERY = 256  # events (steps, writes) between two looks at the clock
_LOOP_BATCH = 64  # loop items charged (and the clock read) at a time
_SIZED = frozenset({list, tuple, dict, str, range})
_DIRECT_KINDS = frozenset({type, types.FunctionType})  # what a direct callable can be (hashable)


def _call_plain(obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``obj(*args, **kwargs)`` for a callable that takes no context, without the loop's own arguments (what the
    sandbox and Context.call do for it, without their probing)."""
    if kwargs:
        kwargs.pop("_loop_vars", None)
        kwargs.pop("_block_vars", None)
    return obj(*args, **kwargs)


class _RenderClock:
    """Seconds of CPU time the calling thread has spent outside garbage collection.

    A template's time bound counts the work the template makes, not what else the process does: a full collection
    can take a second on a large heap, and it runs in whichever thread allocated last. The collector tells us when
    it starts and stops (``gc.callbacks``); each thread sums its own collections."""

    def __init__(self) -> None:
        self._local = threading.local()
        gc.callbacks.append(self._on_collection)

    def _on_collection(self, phase: str, info: dict[str, Any]) -> None:
        now = time.thread_time()
        local = self._local
        if phase == "start":
            local.started = now
        else:
            started = getattr(local, "started", None)
            if started is not None:
                local.collecting = getattr(local, "collecting", 0.0) + (now - started)
                local.started = None

    def __call__(self) -> float:
        return time.thread_time() - getattr(self._local, "collecting", 0.0)


_CLOCK = _RenderClock()


class _Budget:
    """What one render has used of its limits."""

    __slots__ = (
        "deadline",
        "deepest",
        "depth",
        "events",
        "limits",
        "max_depth",
        "max_steps",
        "max_written",
        "next_clock",
        "steps",
        "written",
    )

    def __init__(self, limits: TemplateLimits) -> None:
        self.limits = limits
        self.steps = 0
        self.written = 0
        self.depth = 0
        self.deepest = 0  # the deepest nesting reached (for reports)
        self.events = 0
        self.next_clock = _CLOCK_EVERY
        self.max_steps = limits.steps
        self.max_written = limits.output_chars
        self.max_depth = limits.nesting
        self.deadline = _CLOCK() + limits.seconds

    def exceeded(self, bound: str, detail: str = "") -> TemplateLimitExceeded:
        limit: float = {
            "steps": self.limits.steps,
            "output": self.limits.output_chars,
            "size": self.limits.output_chars,
            "nesting": self.limits.nesting,
            "time": self.limits.seconds,
        }[bound]
        setting = _SETTING[bound]
        shown = f"{limit:g}" if bound == "time" else f"{limit:,}"
        message = (
            f"the chat template ran past its bound of {shown} {_WHAT[bound]}{detail} and was stopped (a chat "
            f"template is code from the model's files: contextkeeper bounds its steps, output, nesting and time). "
            f"Fix: raise {setting} (now {shown}) if this template is trusted, or use another template"
        )
        return TemplateLimitExceeded(message, bound=bound, limit=limit, setting=setting)

    def step(self, n: int = 1) -> None:
        self.steps += n
        if self.steps > self.max_steps:
            raise self.exceeded("steps")
        self.events += 1
        if self.events >= self.next_clock:
            self.clock()

    def stepped(self) -> None:
        """After ``steps`` passed ``events``-free accounting (see ``_counted``): check the bound and the clock."""
        if self.steps > self.max_steps:
            raise self.exceeded("steps")
        self.clock()

    def write(self, n: int) -> None:
        self.written += n
        if self.written > self.max_written:
            raise self.exceeded("output")
        self.events += 1
        if self.events >= self.next_clock:
            self.clock()

    def clock(self) -> None:
        self.next_clock = self.events + _CLOCK_EVERY
        if _CLOCK() > self.deadline:
            raise self.exceeded("time")

    def size(self, n: int, what: str) -> None:
        """Refuse to build a string of ``n`` characters (before it is built)."""
        if n > self.max_written:
            raise self.exceeded("size", f" ({what} would make {n:,})")

    def items(self, n: int, what: str) -> None:
        """Refuse to build a list of ``n`` items: more than the steps left."""
        if n > self.max_steps - self.steps:
            raise self.exceeded("steps", f" ({what} would make {n:,} items)")


_CURRENT: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("contextkeeper_template_budget", default=None)


class bounded:
    """``with bounded(limits):`` renders inside are bounded by ``limits`` together (the outermost one counts)."""

    __slots__ = ("_limits", "_token")

    def __init__(self, limits: TemplateLimits = DEFAULT_LIMITS) -> None:
        self._limits = limits
        self._token: contextvars.Token[_Budget | None] | None = None

    def __enter__(self) -> None:
        if _CURRENT.get() is None:
            self._token = _CURRENT.set(_Budget(self._limits))

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            _CURRENT.reset(self._token)
            self._token = None


# ------------------------------------------------------------------------------ checks before building values

_MAX_INT_BITS = 1 << 16  # far beyond Python's own 4,300-digit limit for printing an int
_SMALL = 1 << 16  # a sum of two strings or lists this short is not checked (its parts were)
_BUILTIN_METHOD = types.BuiltinMethodType


def _huge_int(bits: int) -> ChatTemplateError:
    # Not a setting: Python refuses to print an integer past 4,300 digits, so the template fails on the server too.
    return ChatTemplateError(
        f"the chat template computes an integer of about {bits:,} bits, far past the 4,300 digits Python prints "
        "(it fails the same way on the server); use another template.",
        template_message=f"integer of {bits:,} bits",
    )


def _length(value: Any) -> int | None:
    return len(value) if type(value) in (str, list, tuple) else None


def _check_mul(budget: _Budget, left: Any, right: Any) -> None:
    for sequence, times in ((left, right), (right, left)):
        size = _length(sequence)
        if size is not None and type(times) is int:
            total = size * max(times, 0)
            if type(sequence) is str:
                budget.size(total, "'*'")
            else:
                budget.items(total, "'*'")
            return
    if type(left) is int and type(right) is int and left.bit_length() + right.bit_length() > _MAX_INT_BITS:
        raise _huge_int(left.bit_length() + right.bit_length())


def _check_add(budget: _Budget, left: Any, right: Any) -> None:
    if type(left) is str and type(right) is str:
        budget.size(len(left) + len(right), "'+'")
    elif type(left) in (list, tuple) and type(right) in (list, tuple):
        budget.items(len(left) + len(right), "'+'")


def _check_pow(budget: _Budget, left: Any, right: Any) -> None:
    if type(left) is int and type(right) is int and right > 0 and abs(left) > 1:
        bits = right * abs(left).bit_length()
        if bits > _MAX_INT_BITS:
            raise _huge_int(bits)


_PERCENT = re.compile(r"%(?:\([^)]*\))?[#0 +\-]*(\*|\d+)?(?:\.(\*|\d+))?")


def _check_percent(budget: _Budget, template: str, arguments: Any) -> None:
    """``template % arguments``: refuse field widths or precisions that would pad past the output bound."""
    star = False
    for match in _PERCENT.finditer(template):
        for number in match.groups():
            if number == "*":
                star = True
            elif number and (len(number) > 12 or int(number) > budget.max_written):
                budget.size(budget.max_written + 1 if len(number) > 12 else int(number), "a '%' field width")
    if star:
        values = arguments if isinstance(arguments, tuple) else (arguments,)
        for value in values:
            if type(value) is int and value > budget.max_written:
                budget.size(value, "a '%*' field width")


def _check_format(budget: _Budget, template: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """``template.format(...)``: refuse format specs (``{:>999999999}``) that would pad past the output bound."""
    try:
        fields = list(Formatter().parse(template))
    except ValueError:
        return  # str.format raises the same error itself
    for _, _, spec, _ in fields:
        if not spec:
            continue
        if "{" in spec:  # a nested width, given as an argument
            for value in (*args, *kwargs.values()):
                if type(value) is int and value > budget.max_written:
                    budget.size(value, "a format width")
        for number in re.findall(r"\d+", spec):
            if len(number) > 12 or int(number) > budget.max_written:
                budget.size(budget.max_written + 1 if len(number) > 12 else int(number), "a format width")


def _width(value: Any) -> int:
    if type(value) is str:
        return len(value)
    return value if type(value) is int else 0


def _count_of(text: str, old: Any, count: Any) -> int:
    """How many replacements ``text.replace(old, new, count)`` makes."""
    found = len(text) + 1 if old == "" else text.count(old) if type(old) is str else 0
    return min(found, count) if type(count) is int and count >= 0 else found


def _str_pad(budget: _Budget, text: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    budget.size(_width(kwargs.get("width", args[0] if args else 0)), "str.center()/ljust()/rjust()/zfill()")


def _str_expandtabs(budget: _Budget, text: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    size = _width(kwargs.get("tabsize", args[0] if args else 8))
    budget.size(len(text) + text.count("\t") * size, "str.expandtabs()")


def _str_replace(budget: _Budget, text: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if len(args) >= 2 and type(args[1]) is str:
        times = _count_of(text, args[0], args[2] if len(args) > 2 else kwargs.get("count", -1))
        budget.size(len(text) + times * (len(args[1]) - _width(args[0])), "str.replace()")


def _str_join(budget: _Budget, text: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    items = args[0] if args else None
    if type(items) in (list, tuple):
        assert isinstance(items, (list, tuple))
        budget.items(len(items), "str.join()")
        size = sum(len(item) if type(item) is str else 0 for item in items) + len(text) * max(len(items) - 1, 0)
        budget.size(size, "str.join()")


def _str_split(budget: _Budget, text: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    separator = kwargs.get("sep", args[0] if args else None)
    if type(separator) is str and separator:
        pieces = text.count(separator) + 1
    elif text.isascii():
        pieces = sum(map(text.count, " \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f")) + 1
    else:
        pieces = len(text) // 2 + 1
    budget.items(pieces, "str.split()")


def _str_splitlines(budget: _Budget, text: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    lines = text.count("\n") + text.count("\r") + (0 if text.isascii() else len(text) // 2) + 1
    budget.items(lines, "str.splitlines()")


def _str_translate(budget: _Budget, text: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    table = args[0] if args else None
    if isinstance(table, dict):
        longest = max((len(v) for v in table.values() if type(v) is str), default=1)
        budget.size(len(text) * longest, "str.translate()")


# The str methods that can build a string longer than their input or many pieces, and the check each needs;
# the others (strip, startswith, lower, …) make at most what they were given.
_STR_CHECKS: dict[str, Callable[[_Budget, str, tuple[Any, ...], dict[str, Any]], None]] = {
    "center": _str_pad,
    "ljust": _str_pad,
    "rjust": _str_pad,
    "zfill": _str_pad,
    "expandtabs": _str_expandtabs,
    "replace": _str_replace,
    "join": _str_join,
    "split": _str_split,
    "rsplit": _str_split,
    "splitlines": _str_splitlines,
    "translate": _str_translate,
}


# ------------------------------------------------------------------------------------------ bounded filters


def _materialize(budget: _Budget, value: Any, what: str) -> Any:
    """``value`` as a list when it is an iterator, each item charged as a step; sized values as they are."""
    if isinstance(value, (str, list, tuple, dict)):
        budget.items(len(value), what)
        return value
    if isinstance(value, Iterable):
        out = []
        for item in value:
            budget.step()
            out.append(item)
        return out
    return value


def _filter_center(budget: _Budget, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    budget.size(_width(kwargs.get("width", args[0] if args else 80)), "|center")
    return value


def _filter_indent(budget: _Budget, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if type(value) is str:
        width = _width(kwargs.get("width", args[0] if args else 4))
        budget.size(len(value) + (value.count("\n") + 1) * width, "|indent")
    return value


def _filter_wordwrap(budget: _Budget, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if type(value) is str:
        width = max(_width(kwargs.get("width", args[0] if args else 79)), 1)
        wrapstring = kwargs.get("wrapstring", args[2] if len(args) > 2 else None)
        lines = len(value) // width + value.count("\n") + 1
        budget.size(len(value) + lines * (len(wrapstring) if type(wrapstring) is str else 1), "|wordwrap")
        # textwrap cuts a long word by copying the rest of it once per line: its work grows with the text's
        # length times its lines. Charged as steps (one per 64 KiB copied), before it runs.
        budget.step(len(value) * (len(value) // width) // 65536 + 1)
    return value


def _filter_join(budget: _Budget, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    items = _materialize(budget, value, "|join")
    if isinstance(items, (list, tuple)):
        glue = kwargs.get("d", args[0] if args else "")
        size = sum(len(item) if type(item) is str else 0 for item in items)
        budget.size(size + _width(glue) * max(len(items) - 1, 0), "|join")
    return items


def _filter_replace(budget: _Budget, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if type(value) is str and len(args) >= 2 and type(args[1]) is str and len(value) * len(args[1]) > _SMALL:
        times = _count_of(value, args[0], args[2] if len(args) > 2 else kwargs.get("count"))
        budget.size(len(value) + times * (len(args[1]) - _width(args[0])), "|replace")
    return value


def _filter_format(budget: _Budget, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if type(value) is str:
        _check_percent(budget, value, args or kwargs)
    return value


def _filter_tojson(budget: _Budget, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    indent = kwargs.get("indent", args[1] if len(args) > 1 else None)
    width = _width(indent)
    if width > 16:  # a wide indent repeats on every line, once per level: estimate lines x levels
        lines = max(approx_size(value) // 32, 1)
        budget.size(lines * width * 8, "|tojson with a wide indent")
    return value


def _filter_batch(budget: _Budget, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    count = kwargs.get("linecount", args[0] if args else None)
    if type(count) is int:
        budget.items(count, "|batch")
    return value


def _filter_slice(budget: _Budget, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    count = kwargs.get("slices", args[0] if args else None)
    if type(count) is int:
        budget.items(count, "|slice")
    return value


def _filter_list(budget: _Budget, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return _materialize(budget, value, "|list")


def _filter_escape(budget: _Budget, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if type(value) is str:
        budget.size(len(value) + 5 * sum(map(value.count, "&<>'\"")), "|escape")
    return value


_FILTER_CHECKS: dict[str, Callable[[_Budget, Any, tuple[Any, ...], dict[str, Any]], Any]] = {
    "center": _filter_center,
    "indent": _filter_indent,
    "wordwrap": _filter_wordwrap,
    "join": _filter_join,
    "replace": _filter_replace,
    "format": _filter_format,
    "batch": _filter_batch,
    "slice": _filter_slice,
    "list": _filter_list,
    "escape": _filter_escape,
    "e": _filter_escape,
    "forceescape": _filter_escape,
}


def _bounded_filter(
    original: Callable[..., Any], check: Callable[[_Budget, Any, tuple[Any, ...], dict[str, Any]], Any]
) -> Callable[..., Any]:
    """``original`` with ``check`` run on its input first (and a string result measured). Marked as needing the
    context, so Jinja never runs it at compile time, outside any bound; the context (or what the original asks
    for instead) is passed on."""
    passes = _PassArg.from_obj(original)
    attribute = {_PassArg.eval_context: "eval_ctx", _PassArg.environment: "environment"}.get(passes)  # type: ignore[arg-type]

    @pass_context
    def bounded_filter(context: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
        budget = _CURRENT.get()
        if budget is not None:
            value = check(budget, value, args, kwargs)
        if passes is None:
            result = original(value, *args, **kwargs)
        else:
            result = original(context if attribute is None else getattr(context, attribute), value, *args, **kwargs)
        if budget is not None and type(result) is str and len(result) > budget.max_written:
            budget.size(len(result), "a filter's result")
        return result

    bounded_filter.__name__ = getattr(original, "__name__", "filter")
    bounded_filter.__doc__ = original.__doc__
    return bounded_filter


def _bounded_range(original: Callable[..., Any]) -> Callable[..., Any]:
    def bounded_range(*args: int) -> Any:
        try:
            return original(*args)
        except OverflowError as exc:  # the sandbox's MAX_RANGE, which transformers (so the server) applies too
            raise ChatTemplateError(
                f"the chat template asked for range{args!r}: {exc} It fails the same way on the server (transformers "
                "uses this sandbox); use another template.",
                template_message=str(exc),
            ) from None

    return bounded_range


def _bounded_lipsum(original: Callable[..., Any]) -> Callable[..., Any]:
    def lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> Any:
        budget = _CURRENT.get()
        if budget is not None and type(n) is int and type(max) is int:
            budget.size(n * max * 12, "lipsum()")
        return original(n, html, min, max)

    return lipsum


# ---------------------------------------------------------------------------------------- the code generator


def _number(node: nodes.Node) -> bool:
    return isinstance(node, nodes.Const) and type(node.value) in (int, float, bool)


def _short_literal(node: nodes.Node) -> bool:
    """A number, or a string literal of at most 256 characters: adding one to anything grows it by that much at
    most (a loop that keeps appending it is stopped by the steps and time bounds long before memory runs out)."""
    return _number(node) or (isinstance(node, nodes.Const) and type(node.value) is str and len(node.value) <= 256)


def _bounded_binop(operator: str, hook: str) -> Callable[[CodeGenerator, nodes.BinExpr, Frame], None]:
    """The visitor of one string-building operator: a call of ``environment.<hook>`` (which checks the size
    first), or the plain operator where an operand is a number literal and the result cannot be a long value."""

    @optimizeconst
    def visitor(self: CodeGenerator, node: nodes.BinExpr, frame: Frame) -> None:
        if operator == "+":
            native = _short_literal(node.left) or _short_literal(node.right)
        elif operator == "**":
            native = False  # 2 ** 100000000 is two short literals
        else:
            native = _number(node.left) and (operator == "%" or _number(node.right))
        if native:
            self.write("(")
            self.visit(node.left, frame)
            self.write(f" {operator} ")
            self.visit(node.right, frame)
        else:
            self.write(f"environment.{hook}(")
            self.visit(node.left, frame)
            self.write(", ")
            self.visit(node.right, frame)
        self.write(")")

    return visitor


# The settled loops of the tree being compiled in this thread: Jinja builds the code generator itself, inside
# Environment._generate.
_SETTLING: contextvars.ContextVar[SettlePlan] = contextvars.ContextVar("contextkeeper_settling", default=NO_PLAN)


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's code generator with the bounds compiled in: every ``for`` iterates through ``ck_iter``, output
    written into a buffer (a macro's, a ``{% set %}`` block's) goes through ``ck_out`` / ``ck_const`` (output at
    the top level is counted as the template yields it, see ``_BoundedTemplate``), ``~`` through ``ck_concat``
    and ``+ * % **`` through ``ck_add`` / ``ck_mul`` / ``ck_mod`` / ``ck_pow``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._loop_iters: set[int] = set()  # ids of the iterables of the loops being compiled
        self._buffered = False  # whether the Output being compiled writes into a buffer
        self._settled = _SETTLING.get()  # the settled loops of the tree being compiled (see _ChatSandbox)
        self._kept: dict[int, str] = {}  # a settled loop's key -> the Python name its iterable is kept under
        self._keep: dict[int, str] = {}  # id of a settled loop's iterable -> that name

    def visit_For(self, node: nodes.For, frame: Frame) -> None:
        self._loop_iters.add(id(node.iter))
        key = self._settled.loops.get(id(node))
        if key is not None:
            self._keep[id(node.iter)] = self._kept[key] = self.temporary_identifier()
        try:
            super().visit_For(node, frame)
        finally:
            self._loop_iters.discard(id(node.iter))

    def visit(self, node: nodes.Node, *args: Any, **kwargs: Any) -> Any:
        if id(node) not in self._loop_iters:
            return super().visit(node, *args, **kwargs)
        # A loop's iterable (once per loop, and again where a recursive loop calls itself). A settled loop's is
        # also kept in a local for its break: the ``for`` and its body are in one Python function.
        kept = self._keep.get(id(node))
        self.write("environment.ck_iter(" if kept is None else f"environment.ck_iter(({kept} := ")
        result = super().visit(node, *args, **kwargs)
        self.write(")" if kept is None else "))")
        return result

    def visit_Break(self, node: nodes.Break, frame: Frame) -> None:
        stop = self._settled.breaks.get(id(node))
        if stop is None:
            super().visit_Break(node, frame)
            return
        # A settled loop's break (see render.settle), taken only when the run-time checks allow it. Their answer
        # holds for the rest of the loop (nothing the checks look at changes in it), so a "no" drops the kept
        # iterable and later iterations are refused at once, instead of checking every item again.
        kept = self._kept[stop.loop]
        self.writeline(f"if environment.ck_settled({kept}, ", node)
        self.visit(nodes.Name(stop.space, "load", lineno=node.lineno), frame)
        self.write(f", {stop.items!r}):")
        self.indent()
        self.writeline("break", node)
        self.outdent()
        self.writeline(f"{kept} = None")

    def visit_Output(self, node: nodes.Output, frame: Frame) -> None:
        self._buffered = frame.buffer is not None
        super().visit_Output(node, frame)

    def _output_const_repr(self, group: Iterable[Any]) -> str:
        text = super()._output_const_repr(group)
        return f"environment.ck_const({text})" if self._buffered else text

    def _output_child_pre(self, node: nodes.Expr, frame: Frame, finalize: Any) -> None:
        if self._buffered:
            self.write("environment.ck_out(")
        super()._output_child_pre(node, frame, finalize)

    def _output_child_post(self, node: nodes.Expr, frame: Frame, finalize: Any) -> None:
        super()._output_child_post(node, frame, finalize)
        if self._buffered:
            self.write(")")

    @optimizeconst
    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        if frame.eval_ctx.volatile or frame.eval_ctx.autoescape:
            super().visit_Concat(node, frame)
            return
        self.write("environment.ck_concat((")
        for argument in node.nodes:
            self.visit(argument, frame)
            self.write(", ")
        self.write("))")

    visit_Add = _bounded_binop("+", "ck_add")
    visit_Mul = _bounded_binop("*", "ck_mul")
    visit_Mod = _bounded_binop("%", "ck_mod")
    visit_Pow = _bounded_binop("**", "ck_pow")


def _collect(stream: Iterable[str], budget: _Budget) -> list[str]:
    """The pieces a template yields at its top level, each counted against the output bound as it comes (one
    at a time: each may be a new string as long as the bound, so none is held before it is counted)."""
    parts: list[str] = []
    append = parts.append
    limit = budget.max_written
    since_clock = 0
    for piece in stream:
        budget.written += len(piece)  # on the budget, not a local: nested writes (macros) add to it meanwhile
        if budget.written > limit:
            raise budget.exceeded("output")
        append(piece)
        since_clock += 1
        if since_clock == _CLOCK_EVERY:
            since_clock = 0
            budget.clock()
    return parts


class _BoundedTemplate(Template):
    """A template whose top-level output is counted, and whose renders are bounded by the default limits when
    no ``bounded(...)`` is active."""

    def render(self, *args: Any, **kwargs: Any) -> str:
        budget = _CURRENT.get()
        if budget is None:
            with bounded():
                return self.render(*args, **kwargs)
        context = self.new_context(dict(*args, **kwargs))
        try:
            return "".join(_collect(self.root_render_func(context), budget))
        except Exception:
            self.environment.handle_exception()

    def make_module(self, vars: Any = None, shared: bool = False, locals: Any = None) -> Any:
        budget = _CURRENT.get()
        if budget is None:
            with bounded():
                return self.make_module(vars, shared, locals)
        context = self.new_context(vars, shared, locals)
        return TemplateModule(self, context, _collect(self.root_render_func(context), budget))


def _counted(iterable: Iterable[Any], budget: _Budget) -> Iterator[Any]:
    """``iterable``, its items charged as steps a batch at a time (the bound and the clock checked before each
    batch is handed out; a batch is a few dozen items, so a loop body that makes no call still sees both). The
    items themselves pass through C (``chain``): a Python step per item would slow every loop."""
    iterator = iter(iterable)

    def batch() -> list[Any]:
        items = list(islice(iterator, _LOOP_BATCH))
        if items:
            budget.steps += len(items)
            budget.stepped()
        return items

    return chain.from_iterable(iter(batch, []))


# Iterables whose iteration cannot fail or run the template's or the caller's code (the sandbox is immutable: a
# list cannot change while it is iterated). A settled loop over anything else (a filter's generator) runs out.
_SETTLED_ITERABLES = frozenset({list, tuple, range, str, dict})


class _ChatSandbox(ImmutableSandboxedEnvironment):
    """The transformers sandbox with a fast path for ``dict.key`` lookups, the bounds, and settled scans (see the
    module). ``settle_scans = False`` (:class:`_ReferenceSandbox`) compiles every loop as it is written."""

    code_generator_class = _BoundedCodeGenerator
    template_class = _BoundedTemplate
    intercepted_binops = frozenset({"*", "+", "%", "**"})
    settle_scans = True
    # The classes ``namespace(...)`` makes here: Jinja's, and the environment's own global (transformers' subclass
    # refuses underscore names when one is set, and reads like Jinja's).
    namespace_types: frozenset[type] = frozenset({Namespace})
    # Globals called without the sandbox's probing (see ``call``); call_directly = False takes the sandbox's own
    # way for them too (the reference, for tests).
    direct_callables: frozenset[Any] = frozenset({Namespace})
    call_directly = True

    def _generate(
        self, source: nodes.Template, name: str | None, filename: str | None, defer_init: bool = False
    ) -> str:
        # Every compile passes here, from source text and from trees the template splitter builds; the splitter
        # and the other checks parse the source themselves, so they see the template as written.
        plan = NO_PLAN
        if self.settle_scans:
            source, plan = settle(source, self.tests)
        token = _SETTLING.set(plan)  # for the code generator, which Jinja builds inside
        try:
            return super()._generate(source, name, filename, defer_init)
        finally:
            _SETTLING.reset(token)

    def ck_settled(self, iterable: Any, space: Any, items: str) -> bool:
        """Whether a settled loop may stop: what its compiled test could not see, checked now (once per loop)."""
        kind = type(iterable)
        if type(space) not in self.namespace_types or kind not in _SETTLED_ITERABLES:
            return False
        allowed = ITEMS[items]
        if allowed is None:
            return True
        if kind is range or kind is str:
            return (int if kind is range else str) in allowed
        return set(map(type, iterable)) <= allowed

    def getattr(self, obj: Any, attribute: str) -> Any:
        # Jinja's sandbox first tries getattr(dict, key), fails, then indexes; for keys that are not dict
        # attributes that detour always ends in obj[key], so go there directly.
        kind = type(obj)
        if kind is dict:
            if attribute not in _DICT_ATTRIBUTES:
                try:
                    return obj[attribute]
                except KeyError:
                    return self.undefined(obj=obj, name=attribute)
            if attribute in _DICT_READS:  # message.get(...), tool.items(): allowed by the sandbox's checks
                return getattr(obj, attribute)
        # str methods (content.strip()), namespace fields (ns.last_query_index) and loop fields (loop.index0) are
        # what the sandbox's checks would allow anyway for public names: none is a known-mutable type or an
        # internal object. str.format is not: the sandbox wraps it, so it takes the long way.
        elif not attribute.startswith("_") and (
            (kind is str and attribute not in _FORMAT_METHODS)
            or kind is LoopState
            or isinstance(obj, (Namespace, LoopContext))
        ):
            try:
                return getattr(obj, attribute)
            except AttributeError:
                pass
        return super().getattr(obj, attribute)

    # -- the bounds, called from the compiled template ------------------------------------------------------
    def ck_iter(self, iterable: Any) -> Any:
        budget = _CURRENT.get()
        if budget is None:
            return iterable
        if type(iterable) in _SIZED and len(iterable) <= _LOOP_BATCH:
            # A short loop (a message's tool calls, its content parts): charged whole, iterated as it is.
            budget.step(len(iterable))
            return iterable
        return _counted(iterable, budget)

    def ck_out(self, text: str) -> str:
        budget = _CURRENT.get()
        if budget is not None:
            budget.write(len(text))
        return text

    ck_const = ck_out

    # How ``~`` writes a part that is not a string (compile_template's ``values`` sets llama.cpp's).
    concat_text: Callable[[Any], str] = staticmethod(str)

    def ck_concat(self, parts: tuple[Any, ...]) -> str:
        texts = [part if type(part) is str else self.concat_text(part) for part in parts]
        budget = _CURRENT.get()
        if budget is not None:
            budget.size(sum(map(len, texts)), "'~'")
        return "".join(texts)

    def ck_add(self, left: Any, right: Any) -> Any:
        kind = type(left)
        if (
            (kind is str or kind is list or kind is tuple)
            and type(right) is kind
            and len(left) + len(right) > _SMALL
            and (budget := _CURRENT.get()) is not None
        ):
            _check_add(budget, left, right)
        return left + right

    def ck_mul(self, left: Any, right: Any) -> Any:
        if (budget := _CURRENT.get()) is not None:
            _check_mul(budget, left, right)
        return left * right

    def ck_mod(self, left: Any, right: Any) -> Any:
        if type(left) is not str or (budget := _CURRENT.get()) is None:
            return left % right
        _check_percent(budget, left, right)
        result = left % right
        budget.size(len(result), "'%'")
        return result

    def ck_pow(self, left: Any, right: Any) -> Any:
        if (budget := _CURRENT.get()) is not None:
            _check_pow(budget, left, right)
        return left**right

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = _CURRENT.get()
        if budget is not None:
            if operator == "+":
                _check_add(budget, left, right)
            elif operator == "*":
                _check_mul(budget, left, right)
            elif operator == "%":
                if type(left) is str:
                    _check_percent(budget, left, right)
            else:
                _check_pow(budget, left, right)
        result = self.binop_table[operator](left, right)
        if budget is not None and operator == "%" and type(result) is str:
            budget.size(len(result), "'%'")
        return result

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        if (
            type(__obj) is _BUILTIN_METHOD
            and __obj.__name__ in _STRIPS
            and not args
            and "chars" not in kwargs
            and type(__obj.__self__) is str
            and JINJA_RULES.get().ascii_trim
        ):
            return __obj(_ASCII_SPACE)  # content.strip() on llama.cpp: C's isspace, as its trim filter
        budget = _CURRENT.get()
        if budget is None:
            return super().call(__context, __obj, *args, **kwargs)
        budget.step()
        if type(__obj) is _BUILTIN_METHOD and type(__obj.__self__) in _PLAIN_SELVES:
            # Methods of plain values: called directly (a str method is charged for what it makes first).
            if type(__obj.__self__) is str:
                check = _STR_CHECKS.get(__obj.__name__)
                if check is not None:
                    check(budget, __obj.__self__, args, kwargs)
            return _call_plain(__obj, args, kwargs)
        if __self.call_directly and type(__obj) in _DIRECT_KINDS and __obj in __self.direct_callables:
            # ``namespace(...)`` and ``range(...)``, called for every message by some templates (Gemma 4: six
            # times per message): safe callables that take no context, called directly.
            return _call_plain(__obj, args, kwargs)
        if not isinstance(__obj, (Macro, LoopContext)):
            return super().call(__context, __obj, *args, **kwargs)
        # A macro (or a recursive loop) runs template code again: count how deep.
        budget.depth += 1
        try:
            if budget.depth > budget.deepest:
                budget.deepest = budget.depth
                if budget.depth > budget.max_depth:
                    raise budget.exceeded("nesting")
            return super().call(__context, __obj, *args, **kwargs)
        finally:
            budget.depth -= 1

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        if not isinstance(value, (types.MethodType, types.BuiltinMethodType)) or value.__name__ not in _FORMAT_METHODS:
            return None  # the sandbox's own first test, without the call
        wrapper = super().wrap_str_format(value)
        if wrapper is None:
            return None
        template = str(value.__self__)
        mapping = value.__name__ == "format_map"

        def bounded_format(*args: Any, **kwargs: Any) -> str:
            budget = _CURRENT.get()
            if budget is not None:
                given = args[0] if mapping and args and isinstance(args[0], dict) else kwargs
                _check_format(budget, template, () if mapping else args, given)
            result = wrapper(*args, **kwargs)
            if budget is not None:
                budget.size(len(result), "str.format()")
            return result

        return bounded_format


# ------------------------------------------------------------------------------------------ tojson, memoised


def _frozen_entry_size(value: Any, outputs: dict[Any, str]) -> int:
    return data_size((value, outputs))


class FrozenJSON:
    """Objects we own and never change (copies of the caller's tool schemas), whose ``tojson`` output is kept.

    A template renders the tool schemas on every call, and ``tojson`` with ``indent`` runs Python's pure-Python
    JSON encoder: about a millisecond per call for five schemas. Only registered objects are memoised, keyed by
    identity in an :class:`~contextkeeper._memo.IdentityMemo` (within the shared cache budget; an entry holds its
    object, so its id cannot be reused by another while the entry lives): one that was dropped is computed again.
    """

    def __init__(self) -> None:
        self._outputs: IdentityMemo[Any, dict[Any, str]] = IdentityMemo("sandbox.tojson", sizer=_frozen_entry_size)
        self._lock = threading.Lock()

    def register(self, value: Any) -> None:
        """Register ``value`` and every dict and list inside it."""
        with self._lock:
            for item in _containers(value):
                if self._outputs.get(item) is None:
                    self._outputs.put(item, {})

    def unregister(self, value: Any) -> None:
        with self._lock:
            for item in _containers(value):
                self._outputs.pop(item)

    def wrap(self, tojson: Callable[..., Any]) -> Callable[..., Any]:
        """``tojson`` memoised for registered objects and bounded (see ``_filter_tojson``) where it runs; marked
        as needing the context, so Jinja never runs it at compile time, outside any bound."""
        outputs = self._outputs

        @pass_context
        def memo_tojson(context: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
            known = outputs.get(x)
            if known is None:
                return _bounded_call(tojson, x, args, kwargs)
            try:
                # The rules are part of the key: one object may be written under Python's and llama.cpp's.
                key = (args, tuple(sorted(kwargs.items())), JINJA_RULES.get())
                hash(key)
            except TypeError:  # e.g. separators given as a list
                return _bounded_call(tojson, x, args, kwargs)
            out = known.get(key)
            if out is None:
                out = _bounded_call(tojson, x, args, kwargs)
                # A new entry (the old one's dict is never changed: its size was charged when it was put).
                outputs.put(x, {**known, key: out})
            return out

        return memo_tojson


def _bounded_call(tojson: Callable[..., Any], value: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    budget = _CURRENT.get()
    if budget is not None:
        _filter_tojson(budget, value, args, kwargs)
    result = tojson(value, *args, **kwargs)
    if budget is not None and type(result) is str and len(result) > budget.max_written:
        budget.size(len(result), "|tojson")
    return result


def _containers(value: Any) -> list[Any]:
    found: list[Any] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if type(item) is dict:
            found.append(item)
            stack.extend(item.values())
        elif isinstance(item, list):  # plain lists, and a counter's own list of tool schemas
            found.append(item)
            stack.extend(item)
    return found


FROZEN_JSON = FrozenJSON()


# ------------------------------------------------------------------------------------------------- compile


def _template_size(key: Any, template: Any) -> int:
    # A compiled template is Python code objects and the nodes they came from: 11 to 52 bytes per source character
    # over the templates the tests fetch, plus its environment's own filters and globals.
    return 64 * len(key[0]) + 64 * 1024


class _ReferenceSandbox(_ChatSandbox):
    """The sandbox with every loop compiled as written: the slow reference settled scans are checked against."""

    settle_scans = False


@dataclass(frozen=True)
class JinjaRules:
    """Where a server's Jinja engine differs from Python's (llama.cpp's: C++ with nlohmann::json)."""

    ascii_trim: bool = False  # ``trim`` and ``str.strip()`` strip ASCII whitespace only (C's isspace: U+00A0 stays)
    c_json: bool = False  # ``tojson`` writes floats as a C++ stream does (1.0 -> 1, 3.14159265 -> 3.14159): _c_json


PYTHON_JINJA = JinjaRules()
# The rules of the render running now (set by the counter around each render; compiled templates are shared).
JINJA_RULES: contextvars.ContextVar[JinjaRules] = contextvars.ContextVar("contextkeeper_jinja", default=PYTHON_JINJA)
_ASCII_SPACE = " \t\n\r\f\v"


_STRIPS = frozenset({"strip", "lstrip", "rstrip"})


def c_value(value: Any) -> str:
    """What llama.cpp's Jinja engine writes for ``{{ value }}`` (common/jinja/runtime.h, value.h): a float as C's
    ``%f`` without its trailing zeros (1e21 -> 1000000000000000000000.0, 1.5e-07 -> 0.0), a list as its items'
    text joined, and None, undefined values and mappings as nothing; strings, ints and bools as Python writes
    them."""
    kind = type(value)
    if kind is str or isinstance(value, str):
        return value  # type: ignore[no-any-return]
    if kind is bool or kind is int:
        return str(value)
    if kind is float:
        text = f"{value:f}".rstrip("0")
        return text + "0" if text.endswith(".") else text
    if isinstance(value, (list, tuple)):
        return "".join(c_value(item) for item in value)
    return ""


def c_concat(value: Any) -> str:
    """What llama.cpp writes for a part of ``~`` that is not a string: a float as for ``{{ }}``, None and undefined
    values as nothing, anything else as Python writes it."""
    kind = type(value)
    if kind is float:
        return c_value(value)
    if value is None or isinstance(value, Undefined):
        return ""
    return str(value)


def _c_string(original: Callable[..., Any]) -> Callable[..., Any]:
    def string(value: Any) -> Any:
        # llama.cpp's string filter writes a float with C's %g (six significant digits: 1e+21, 123457, -0)
        return f"{value:g}" if type(value) is float else original(value)

    return string


@dataclass(frozen=True)
class _Engine:
    """Where a server's Jinja engine writes values otherwise than Python's (compile_template's ``values``)."""

    finalize: Callable[[Any], Any] | None = None  # ``{{ value }}``
    concat_text: Callable[[Any], str] = str  # a part of ``~``
    string: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None  # the ``string`` filter, wrapped


_ENGINES: dict[str, _Engine] = {
    "python": _Engine(),
    "llama.cpp": _Engine(finalize=c_value, concat_text=c_concat, string=_c_string),
}


def _ruled_trim(original: Callable[..., Any]) -> Callable[..., Any]:
    def trim(value: Any, chars: str | None = None) -> Any:
        if chars is None and type(value) is str and JINJA_RULES.get().ascii_trim:
            return value.strip(_ASCII_SPACE)
        return original(value, chars)

    return trim


def _ruled_tojson(original: Callable[..., Any]) -> Callable[..., Any]:
    def tojson(value: Any, *args: Any, **kwargs: Any) -> Any:
        if JINJA_RULES.get().c_json:
            return c_tojson(value, *args, **kwargs)
        return original(value, *args, **kwargs)

    return tojson


_SANDBOXES: dict[bool, type[_ChatSandbox]] = {True: _ChatSandbox, False: _ReferenceSandbox}


@memoize("sandbox.templates", sizer=_template_size)
def compile_template(source: str, settle_scans: bool = True, values: str = "python") -> Template:
    """Compile ``source`` in a sandbox configured exactly like transformers' chat-template environment, with
    the bounds compiled in and (unless ``settle_scans`` is False) its settled scans stopped early. ``values``:
    whose engine's way of writing a value ``{{ x }}`` follows ("python", or "llama.cpp": :func:`c_value`); pass
    it by position, as the memo keys by position. Raises what Jinja raises (``TemplateSyntaxError`` and
    friends)."""
    rules = CHAT_RULES
    env = _SANDBOXES[settle_scans](
        trim_blocks=rules.trim_blocks,
        lstrip_blocks=rules.lstrip_blocks,
        extensions=list(rules.extensions),
        finalize=_ENGINES[values].finalize,
    )
    engine = _ENGINES[values]
    env.concat_text = engine.concat_text
    env.filters.update(rules.filters)
    if "tojson" in env.filters:
        env.filters["tojson"] = FROZEN_JSON.wrap(_ruled_tojson(env.filters["tojson"]))
    if "trim" in env.filters:
        env.filters["trim"] = _ruled_trim(env.filters["trim"])
    if engine.string is not None and "string" in env.filters:
        env.filters["string"] = engine.string(env.filters["string"])
    for name, check in _FILTER_CHECKS.items():
        if name in env.filters:
            env.filters[name] = _bounded_filter(env.filters[name], check)
    env.globals.update(rules.globals)
    made = env.globals.get("namespace")
    if isinstance(made, type) and issubclass(made, Namespace):
        env.namespace_types = frozenset({Namespace, made})
    for name, bound in (("lipsum", _bounded_lipsum), ("range", _bounded_range)):
        original = env.globals.get(name)
        if callable(original):
            env.globals[name] = bound(original)
    env.direct_callables = frozenset({*env.namespace_types, env.globals.get("range")} - {None})
    return env.from_string(source)


def limits_of(given: TemplateLimits | None) -> TemplateLimits:
    """``given``, or the defaults; anything else is a ConfigurationError."""
    if given is None:
        return DEFAULT_LIMITS
    if not isinstance(given, TemplateLimits):
        raise ConfigurationError(
            f"template_limits must be a TemplateLimits, got {type(given).__name__}. "
            "Fix: pass template_limits=TemplateLimits(steps=..., output_chars=..., seconds=..., nesting=...)."
        )
    return given
