"""Carrying out a render plan: the head and tail afresh, bodies from the memo, the previous call or rendered."""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from typing import Any

from jinja2.utils import Namespace

from ..._memo import Memo
from .plan import BATCH, Previous, RenderPlan, body_key, generation_key, guard_marks, plan_render, window
from .split import RECORD, SENTINEL, SplitTemplate

# A body's window, its output, and the carried namespaces' state after it (None when nothing is carried).
_Entry = tuple[tuple[Any, ...], str, Any]
State = tuple[tuple[tuple[str, Any], ...], ...]  # each carried namespace's fields, sorted
_PLAIN = frozenset({type(None), bool, int, float, str})


def _same_window(known: tuple[Any, ...], seen: tuple[Any, ...]) -> bool:
    """Whether a kept body's window holds the very same message objects as this one (ids can be reused)."""
    return len(known) == len(seen) and all(a is b for a, b in zip(known, seen, strict=True))


def _mark_names(split: SplitTemplate) -> list[str]:
    """The variables each body's marks (its guard results, then its look-aheads) are given as."""
    return [*(guard.name for guard in split.guards), *(ahead.name for ahead in split.aheads)]


def _carried(split: SplitTemplate, scope: dict[str, Any]) -> tuple[list[Namespace], State] | None:
    """The carried namespaces as the head left them, and their state; None when one is not a namespace or holds a
    value that is not a plain constant."""
    found = [scope.get(name) for name in split.carried]
    spaces = [space for space in found if isinstance(space, Namespace)]
    state = _state(spaces) if len(spaces) == len(found) else None
    return None if state is None else (spaces, state)


def _state(spaces: Sequence[Namespace]) -> State | None:
    """The fields of each namespace, when every value is a plain constant (else None: the template is rendered
    whole, as a value such as a list could be changed in place where no snapshot sees it)."""
    fields = [object.__getattribute__(space, "_Namespace__attrs") for space in spaces]
    if not all(type(value) in _PLAIN for values in fields for value in values.values()):
        return None
    return tuple(tuple(sorted(values.items())) for values in fields)


def _restore(spaces: Sequence[Namespace], state: State) -> None:
    for space, values in zip(spaces, state, strict=True):
        attrs = object.__getattribute__(space, "_Namespace__attrs")
        attrs.clear()
        attrs.update(values)


class LoopState:
    """The ``loop`` variable for one iteration of a split template's loop (index and position only)."""

    __slots__ = ("first", "index", "index0", "last")

    def __init__(self, index0: int, length: int) -> None:
        self.index0 = index0
        self.index = index0 + 1
        self.first = index0 == 0
        self.last = index0 == length - 1


def _body_size(key: Any, entry: _Entry) -> int:
    # The key (ints, flags, ids), the window and the body's text. The views the window holds are counted where the
    # counter keeps them (its own memo of views, filled in the same count, so dropped at about the same time):
    # counting them again for each of up to hundreds of bodies per render would cost more than the render.
    messages, text, state = entry
    extra = sys.getsizeof(state) + 64 * len(state) if state else 0
    return sys.getsizeof(key) + 32 * len(key) + sys.getsizeof(messages) + sys.getsizeof(text) + 64 + extra


class IncrementalRenderer:
    """Renders a split template, reusing each message's body output while its window is unchanged. The outputs
    live in :class:`Memo` caches, within the shared cache budget."""

    def __init__(self, split: SplitTemplate, *, generations: int = 4) -> None:
        self.split = split
        self._generations = generations
        # One memo per generation (what the head leaves for the body), newest last: a caller that alternates
        # between, say, counting with and without tools keeps both.
        self._memos: dict[Any, Memo[Any, _Entry]] = {}
        self._previous: dict[Any, Previous] = {}  # per generation: what the last call left
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

    def _render(self, context: dict[str, Any]) -> list[str]:
        split = self.split
        module = split.head.make_module(context)
        head_text = str(module)
        scope = {**context, **{k: v for k, v in vars(module).items() if not k.startswith("_")}}
        sequence = scope.get(split.sequence)
        messages: Sequence[Any] = sequence if isinstance(sequence, (list, tuple)) else ()
        marks = guard_marks(split, scope, len(messages)) if messages is sequence else None
        bounds = [scan.bounds(messages) for scan in split.scans] if marks is not None else []
        if marks is None or any(column is None for column in bounds):
            assert split.whole is not None
            return [split.whole.render(context)]
        # A body sees the messages its scans visit: its window reaches that far (see Scan).
        reach = max([split.reach, *(stop - start for column in bounds if column for start, stop in column)])
        per_body = list(zip(*bounds, strict=True)) if bounds else [()] * len(messages)
        generation = generation_key(split, head_text, scope)
        memo = self._memo(generation)
        previous = self._previous.get(generation)
        plan = plan_render(
            previous,
            messages,
            marks,
            reach=reach,
            positional=split.positional,
            guarded=bool(split.guards or split.aheads),
        )
        if split.carried:
            if plan.taken == 0 and not memo and len(messages) > BATCH:
                # Nothing to reuse (a first render): one whole render, recording each body's state, beats
                # rendering each body on its own.
                recorded = self._render_recorded(context, scope, head_text, messages, marks, reach, memo)
                if recorded is not None:
                    bodies, tail_text, states = recorded
                    self._remember(generation, Previous(list(messages), bodies, marks, states))
                    return [head_text, *bodies, tail_text]
            threaded = self._threaded(plan, previous, memo, scope, marks, reach, per_body)
            if threaded is None:
                assert split.whole is not None
                return [split.whole.render(context)]
            texts, states = threaded
            tail_text = split.tail.render(scope)
            self._remember(generation, Previous(list(messages), texts, marks, states))
            return [head_text, *texts, tail_text]
        found, misses = self._look_up(memo, plan, messages, marks, reach)
        if misses > BATCH:  # only when many are new is one whole (marked) render cheaper
            cut = self._render_marked(context, head_text, len(messages))
            if cut is not None:
                bodies, tail_text = cut
                self._keep_all(memo, messages, marks, bodies, reach)
                self._remember(generation, Previous(list(messages), bodies, marks))
                return [head_text, *bodies, tail_text]
        texts = self._bodies(plan, previous, found, memo, scope, marks, reach, per_body)
        tail_text = split.tail.render(scope)
        self._remember(generation, Previous(list(messages), texts, marks))
        return [head_text, *texts, tail_text]

    def _memo(self, generation: Any) -> Memo[Any, _Entry]:
        """The body outputs kept for ``generation``, made the newest."""
        memo = self._memos.pop(generation, None)
        if memo is None:
            memo = Memo("incremental.bodies", sizer=_body_size)
        self._memos[generation] = memo
        self._keep_newest(self._memos)
        return memo

    def _remember(self, generation: Any, previous: Previous) -> None:
        self._previous[generation] = previous
        self._keep_newest(self._previous)

    def _keep_newest(self, per_generation: dict[Any, Any]) -> None:
        while len(per_generation) > self._generations:
            del per_generation[next(iter(per_generation))]

    def _threaded(
        self,
        plan: RenderPlan,
        previous: Previous | None,
        memo: Memo[Any, _Entry],
        scope: dict[str, Any],
        marks: Sequence[tuple[Any, ...]],
        reach: int,
        per_body: Sequence[tuple[Any, ...]],
    ) -> tuple[list[str], list[State]] | None:
        """Each body's output when the body carries namespace state from message to message: in order, with the
        state before each body part of its key, so a body is reused only where its window and the state it starts
        from are both unchanged (a run taken from the previous call, when it starts from the same state). Leaves
        the namespaces as the last body left them, for the tail. None when a namespace holds a value that is not a
        plain constant."""
        split = self.split
        messages = scope[split.sequence]
        count = plan.count
        carried = _carried(split, scope)
        if carried is None:
            return None
        spaces, state = carried
        old = previous.states if previous is not None and previous.states else None
        texts: list[str] = []
        states: list[State] = []
        index = 0
        while index < count:
            states.append(state)
            if old is not None and previous is not None:
                if plan.kept and index == plan.reuse_from and old[index] == state:
                    texts.extend(previous.texts[plan.reuse_from : plan.reuse_to])
                    states.extend(old[index + 1 : plan.reuse_to])
                    state, index = old[plan.reuse_to], plan.reuse_to
                    self.reused += len(plan.kept)
                    continue
                moved_from = plan.tail_from - plan.shift
                if plan.moved and index == plan.tail_from and old[moved_from] == state:
                    texts.extend(previous.texts[moved_from:])
                    states.extend(old[moved_from + 1 : len(previous.texts)])
                    state, index = old[len(previous.texts)], count
                    self.reused += len(plan.moved)
                    continue
            seen = window(messages, index, reach)
            key = (body_key(split.positional, index, count, marks, seen), state)
            known = memo.get(key)
            if known is not None and _same_window(known[0], seen):
                text, after = known[1], known[2]
                self.reused += 1
            else:
                _restore(spaces, state)
                text = self._render_body(scope, messages, index, count, marks, per_body)
                after = _state(spaces)
                if after is None:
                    return None
                memo.put(key, (seen, text, after))
            texts.append(text)
            state = after
            index += 1
        states.append(state)
        _restore(spaces, state)
        return texts, states

    def _render_body(
        self,
        scope: dict[str, Any],
        messages: Sequence[Any],
        index: int,
        count: int,
        marks: Sequence[tuple[Any, ...]],
        per_body: Sequence[tuple[Any, ...]],
    ) -> str:
        """The body's output for the message at ``index``, its marks and its scans' spans (``per_body``: their
        bounds) given as their variables."""
        split = self.split
        local = {**scope, split.target: messages[index], "loop": LoopState(index, count)}
        local.update(zip(_mark_names(split), marks[index], strict=True))
        local.update(
            (scan.name, scan.span(messages, found)) for scan, found in zip(split.scans, per_body[index], strict=True)
        )
        return str(split.body.render(local))

    def _look_up(
        self,
        memo: Memo[Any, _Entry],
        plan: RenderPlan,
        messages: Sequence[Any],
        marks: Sequence[tuple[Any, ...]],
        reach: int,
    ) -> tuple[dict[int, str], int]:
        """The outputs the memo holds for the bodies the plan does not take whole, and how many it lacks."""
        indexes = (*plan.before, *plan.middle)
        if not memo:  # an empty memo (a first render) has nothing to find
            return {}, len(indexes)
        split = self.split
        found: dict[int, str] = {}
        misses = 0
        for index in indexes:
            seen = window(messages, index, reach)
            known = memo.get(body_key(split.positional, index, plan.count, marks, seen))
            if known is not None and _same_window(known[0], seen):
                found[index] = known[1]
            else:
                misses += 1
        return found, misses

    def _keep_all(
        self,
        memo: Memo[Any, _Entry],
        messages: Sequence[Any],
        marks: Sequence[tuple[Any, ...]],
        bodies: list[str],
        reach: int,
        states: Sequence[State] | None = None,
    ) -> None:
        """Remember every body output of a marked render; with ``states`` (the carried state before each body and
        after the last), each under the state it started from, with the state it left, as ``_threaded`` keys
        them."""
        split, count = self.split, len(messages)
        entries: list[tuple[Any, _Entry]] = []
        for index, text in enumerate(bodies):
            seen = window(messages, index, reach)
            key = body_key(split.positional, index, count, marks, seen)
            if states is None:
                entries.append((key, (seen, text, None)))
            else:
                entries.append(((key, states[index]), (seen, text, states[index + 1])))
        memo.put_many(entries)

    def _render_recorded(
        self,
        context: dict[str, Any],
        scope: dict[str, Any],
        head_text: str,
        messages: Sequence[Any],
        marks: Sequence[tuple[Any, ...]],
        reach: int,
        memo: Memo[Any, _Entry],
    ) -> tuple[list[str], str, list[State]] | None:
        """Every body's output, the tail's, and the carried state before each body and after the last, from one
        whole render that records the state each body leaves; each body kept in the memo under the state it
        started from, as ``_threaded`` would. None when the cut is not clean or a state is not plain."""
        carried = _carried(self.split, scope)
        if carried is None:
            return None
        spaces, first = carried
        after: list[State | None] = []

        def record(*carried: Any) -> str:
            after.append(_state(carried) if all(isinstance(c, Namespace) for c in carried) else None)
            return ""

        count = len(messages)
        cut = self._render_marked({**context, RECORD: record}, head_text, count)
        if cut is None or len(after) != count or any(state is None for state in after):
            return None
        bodies, tail_text = cut
        states: list[State] = [first, *(state for state in after if state is not None)]
        self._keep_all(memo, messages, marks, bodies, reach, states)
        _restore(spaces, states[-1])
        return bodies, tail_text, states

    def _render_marked(self, context: dict[str, Any], head_text: str, count: int) -> tuple[list[str], str] | None:
        """Every body's output from one whole render, or None when the cut is not clean."""
        parts = self.split.marked.render(context).split(SENTINEL)
        if len(parts) != count + 1 or not parts[0].startswith(head_text):
            return None  # a message contains the sentinel, or the head rendered differently (a date rolled over)
        bodies = [parts[0][len(head_text) :], *parts[1:count]] if count else []
        tail = parts[count] if count else parts[0][len(head_text) :]
        return bodies, tail

    def _bodies(
        self,
        plan: RenderPlan,
        previous: Previous | None,
        found: dict[int, str],
        memo: Memo[Any, _Entry],
        scope: dict[str, Any],
        marks: Sequence[tuple[Any, ...]],
        reach: int,
        per_body: Sequence[tuple[Any, ...]],
    ) -> list[str]:
        """Each body's output, in order: found in the memo, taken whole from the previous call, or rendered."""
        split = self.split
        messages = scope[split.sequence]
        count = plan.count

        def body_of(index: int) -> str:
            known = found.get(index)
            if known is not None:
                self.reused += 1
                return known
            seen = window(messages, index, reach)
            text = self._render_body(scope, messages, index, count, marks, per_body)
            memo.put(body_key(split.positional, index, count, marks, seen), (seen, text, None))
            return text

        texts = [body_of(index) for index in plan.before]
        last_texts = previous.texts if previous is not None else ()
        texts.extend(last_texts[plan.reuse_from : plan.reuse_to] if plan.kept else ())
        texts.extend(body_of(index) for index in plan.middle)
        texts.extend(last_texts[plan.tail_from - plan.shift :] if plan.moved else ())
        self.reused += plan.taken
        return texts
