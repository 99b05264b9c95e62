"""What a render reuses and what it renders: pure functions of the previous call's state and this call's inputs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..._memo import shared_prefix, shared_suffix
from .split import SplitTemplate

# Above this many bodies to render, one marked whole render (cut at the sentinels) beats rendering each body.
BATCH = 8

OUTSIDE = object()  # a neighbour index past the end: the template sees Undefined there

_BOOL = frozenset({bool})


@dataclass(frozen=True)
class Previous:
    """What a call leaves for the next one under the same generation."""

    messages: Sequence[Any]
    texts: Sequence[str]  # each message's body output
    marks: Sequence[tuple[Any, ...]]  # each message's guard results
    # The carried namespaces' state before each body, and after the last (empty when nothing is carried).
    states: Sequence[Any] = ()


@dataclass(frozen=True)
class RenderPlan:
    """Which bodies a call takes whole from the previous call, and which it looks up or renders.

    Bodies ``kept`` are the previous call's at the same index, bodies ``moved`` the previous call's at
    ``index - shift``; ``before`` and ``middle`` are looked up in the memo, and rendered where not found."""

    count: int
    reuse_from: int = 0
    reuse_to: int = 0
    tail_from: int = 0
    shift: int = 0

    @property
    def kept(self) -> range:
        return range(self.reuse_from, self.reuse_to)

    @property
    def before(self) -> range:
        return range(self.reuse_from if self.kept else 0)

    @property
    def middle(self) -> range:
        return range(self.reuse_to if self.kept else 0, self.tail_from)

    @property
    def moved(self) -> range:
        return range(self.tail_from, self.count)

    @property
    def taken(self) -> int:
        """How many bodies are taken whole."""
        return len(self.kept) + len(self.moved)


def plan_render(
    previous: Previous | None,
    messages: Sequence[Any],
    marks: Sequence[tuple[Any, ...]],
    *,
    reach: int,
    positional: bool,
    guarded: bool,
) -> RenderPlan:
    """The runs of bodies this call can take from ``previous``: a prefix and a suffix of bodies whose windows lie
    inside the runs of identical message objects the two lists share at their start and at their end, and whose
    flags (``loop.first``, ``loop.last``) and guard results are unchanged. ``marks`` are this call's guard results
    (see :func:`guard_marks`), compared only when ``guarded`` (else they are all empty)."""
    count = len(messages)
    if previous is None:
        return RenderPlan(count, tail_from=count)
    reuse_from, reuse_to = _kept_run(previous, messages, marks if guarded else None, reach)
    shift = count - len(previous.messages)
    tail_from = count
    if not positional or shift == 0:
        tail_from = _moved_run(previous, messages, marks if guarded else None, reach, reuse_to)
    return RenderPlan(count, reuse_from, reuse_to, tail_from, shift)


def _kept_run(
    previous: Previous, messages: Sequence[Any], marks: Sequence[tuple[Any, ...]] | None, reach: int
) -> tuple[int, int]:
    """Bodies ``[from, to)`` the previous call rendered at the same index from the same window."""
    old_count, count = len(previous.messages), len(messages)
    shared = shared_prefix(messages, previous.messages)
    # Bodies before ``reach`` may read messages[-1]... (Python indexing wraps), the list's changing end, so they
    # go through the per-message path; the rest of the shared prefix is taken whole.
    reuse_from, reuse_to = reach, max(reach, shared - reach)
    for flag_index in (old_count - 1, count - 1):  # the only places where loop.last can differ
        if reuse_from <= flag_index < reuse_to and (flag_index == old_count - 1) != (flag_index == count - 1):
            reuse_to = flag_index
    last_marks = previous.marks
    if marks is not None and last_marks[reuse_from:reuse_to] != marks[reuse_from:reuse_to]:
        reuse_to = next(i for i in range(reuse_from, reuse_to) if last_marks[i] != marks[i])
    return reuse_from, reuse_to


def _moved_run(
    previous: Previous, messages: Sequence[Any], marks: Sequence[tuple[Any, ...]] | None, reach: int, reuse_to: int
) -> int:
    """Where the bodies the previous call rendered from the same windows at ``index - shift`` start."""
    count = len(messages)
    shift = count - len(previous.messages)
    ended = shared_suffix(messages, previous.messages)
    # Not the first body of either list (loop.first), nor one whose window wraps to the list's end.
    tail_from = min(count, max(count - ended + reach, reach + max(shift, 0), 1 + max(shift, 0), reuse_to))
    last_marks = previous.marks
    if tail_from < count and marks is not None and last_marks[tail_from - shift :] != marks[tail_from:]:
        tail_from = 1 + max(i for i in range(tail_from, count) if last_marks[i - shift] != marks[i])
    return tail_from


def guard_marks(split: SplitTemplate, scope: dict[str, Any], count: int) -> list[tuple[Any, ...]] | None:
    """Each position's guard results (see ``Guard``), part of the key of its body output; None when the
    template itself must decide (a comparison that fails or is not a boolean): it is then rendered whole."""
    guards, aheads = split.guards, split.aheads
    if not guards and not aheads:
        return [()] * count
    try:
        env = split.body.environment
        columns = [guard.evaluate(env, scope, count) for guard in guards]
        columns += [ahead.evaluate(scope[split.sequence]) for ahead in aheads]
    except Exception:  # the template decides (it may never reach the comparison, or fail clearly)
        return None
    if not all(_BOOL.issuperset(map(type, column)) for column in columns):
        return None
    return list(zip(*columns, strict=True))


def generation_key(split: SplitTemplate, head_text: str, scope: dict[str, Any]) -> tuple[str, str]:
    """Anything the body can read besides its window: the head's variables and the call's context (only the names
    the body reads, when known; else the head's output too). Macros are left out: they are code from the
    template itself, recreated (new objects) on every render."""
    reads = split.reads
    return (
        head_text if reads is None else "",
        repr(
            sorted(
                (k, repr(v))
                for k, v in scope.items()
                if k != "messages" and k != split.sequence and (reads is None or k in reads) and not callable(v)
            )
        ),
    )


def window(messages: Sequence[Any], index: int, reach: int) -> tuple[Any, ...]:
    """The messages the body at ``index`` can read, as Jinja indexes a list: negative indices wrap around."""
    count = len(messages)
    if reach <= index < count - reach:  # no wrap-around and nothing outside: one slice
        return tuple(messages[index - reach : index + reach + 1])
    return tuple(
        messages[position] if -count <= position < count else OUTSIDE
        for position in range(index - reach, index + reach + 1)
    )


def body_key(
    positional: bool, index: int, count: int, marks: Sequence[tuple[Any, ...]], messages: tuple[Any, ...]
) -> Any:
    """The memo key of the body at ``index`` with window ``messages``: its position when the body reads it, else
    its flags and the window's message identities; and its guard results."""
    if positional:
        return (index, index == count - 1, marks[index])
    return (index == 0, index == count - 1, marks[index], *map(id, messages))
