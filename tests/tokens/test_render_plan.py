"""The render plan as a table: for a previous call and this call's messages, which body outputs are taken whole
(kept at the same index, or moved by ``shift``) and which are looked up or rendered (before, middle)."""

from __future__ import annotations

from typing import Any

import pytest

from contextkeeper.tokens._sandbox import compile_template
from contextkeeper.tokens.render import Previous, RenderPlan, plan_render, split_template
from contextkeeper.tokens.render.plan import OUTSIDE, generation_key, guard_marks, window

S, S2, U1, A1, U2, A2, U3, X = ({"content": name} for name in ("s", "s2", "u1", "a1", "u2", "a2", "u3", "x"))
F, T = (False,), (True,)


def _plan(
    old: list[Any],
    new: list[Any],
    *,
    reach: int = 0,
    positional: bool = True,
    old_marks: list[tuple[Any, ...]] | None = None,
    new_marks: list[tuple[Any, ...]] | None = None,
) -> RenderPlan:
    guarded = new_marks is not None
    previous = Previous(old, [f"<{m['content']}>" for m in old], old_marks or [()] * len(old))
    return plan_render(previous, new, new_marks or [()] * len(new), reach=reach, positional=positional, guarded=guarded)


def _shape(plan: RenderPlan) -> tuple[tuple[int, int], ...]:
    """(before, kept, middle, moved) as (start, stop), (0, 0) when empty; then (shift, 0)."""
    spans = (plan.before, plan.kept, plan.middle, plan.moved)
    return (*((span.start, span.stop) if span else (0, 0) for span in spans), (plan.shift, 0))


CASES: dict[str, tuple[RenderPlan, tuple[tuple[int, int], ...]]] = {
    # One message appended: the old last body re-renders (loop.last changed), the new one renders.
    "grown by one": (_plan([S, U1, A1, U2], [S, U1, A1, U2, A2]), ((0, 0), (0, 3), (3, 5), (0, 0), (1, 0))),
    "grown by one, not positional": (
        _plan([S, U1, A1, U2], [S, U1, A1, U2, A2], positional=False),
        ((0, 0), (0, 3), (3, 5), (0, 0), (1, 0)),
    ),
    # A message replaced in the middle: the runs on both sides of it are taken whole.
    "edited in the middle": (
        _plan([S, U1, A1, U2, A2], [S, U1, X, U2, A2]),
        ((0, 0), (0, 2), (2, 3), (3, 5), (0, 0)),
    ),
    # Reading messages[loop.index0 - 1]: the edit reaches the next body too, and body 0 reads messages[-1].
    "edited in the middle, reach 1": (
        _plan([S, U1, A1, U2, A2], [S, U1, X, U2, A2], reach=1),
        ((0, 0), (0, 0), (0, 4), (4, 5), (0, 0)),
    ),
    "system prompt changed": (_plan([S, U1, A1, U2], [S2, U1, A1, U2]), ((0, 0), (0, 0), (0, 1), (1, 4), (0, 0))),
    "unchanged": (_plan([S, U1, A1], [S, U1, A1]), ((0, 0), (0, 3), (0, 0), (0, 0), (0, 0))),
    # The oldest turn dropped: a body that does not read its position is reused at its new index.
    "window slid, not positional": (
        _plan([S, U1, A1, U2, A2, U3], [S, U2, A2, U3], positional=False),
        ((0, 0), (0, 1), (0, 0), (1, 4), (-2, 0)),
    ),
    "window slid, positional": (
        _plan([S, U1, A1, U2, A2, U3], [S, U2, A2, U3]),
        ((0, 0), (0, 1), (1, 4), (0, 0), (-2, 0)),
    ),
    "last message removed": (_plan([S, U1, A1, U2], [S, U1, A1]), ((0, 0), (0, 2), (2, 3), (0, 0), (-1, 0))),
    # Windows at the ends: body 0 reads messages[-1], the list's changing end, so it is looked up, not kept.
    "grown, reach 1": (_plan([S, U1, A1], [S, U1, A1, U2], reach=1), ((0, 1), (1, 2), (2, 4), (0, 0), (1, 0))),
    # loop.index0 > last_user_index (a guard): a new user turn flips the result for the turns after the old one.
    "guard flipped by a new user turn": (
        _plan(
            [U1, A1, U2, A2, X],
            [U1, A1, U2, A2, X, U3],
            positional=False,
            old_marks=[F, F, F, T, T],
            new_marks=[F, F, F, F, F, F],
        ),
        ((0, 0), (0, 3), (3, 6), (0, 0), (1, 0)),
    ),
    "guards unchanged as the window slides": (
        _plan([S, U1, A1, U2, A2], [S, U2, A2], positional=False, old_marks=[F, F, F, F, T], new_marks=[F, F, T]),
        ((0, 0), (0, 1), (0, 0), (1, 3), (-2, 0)),
    ),
    "guard changed inside the shared end": (
        _plan([S, U1, A1, U2], [X, U1, A1, U2], old_marks=[F, F, T, F], new_marks=[F, F, F, F]),
        ((0, 0), (0, 0), (0, 3), (3, 4), (0, 0)),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_plan_reuses_what_is_provably_unchanged(case: str) -> None:
    plan, expected = CASES[case]
    assert _shape(plan) == expected
    assert plan.taken == len(plan.kept) + len(plan.moved)
    # Every body is accounted for exactly once.
    assert sorted([*plan.before, *plan.kept, *plan.middle, *plan.moved]) == list(range(plan.count))


def test_a_first_call_renders_everything() -> None:
    plan = plan_render(None, [S, U1, A1], [()] * 3, reach=0, positional=True, guarded=False)
    assert _shape(plan) == ((0, 0), (0, 0), (0, 3), (0, 0), (0, 0))
    assert plan.taken == 0


def test_windows_wrap_around_and_end_outside_as_jinja_indexes() -> None:
    chat = [S, U1, A1]
    assert window(chat, 0, 1) == (A1, S, U1)  # messages[-1] is the last message
    assert window(chat, 2, 1) == (U1, A1, OUTSIDE)  # messages[3] is undefined
    assert window(chat, 1, 1) == (S, U1, A1)


def _split(source: str) -> Any:
    split = split_template(compile_template(source), source)
    assert split is not None
    return split


def test_tools_change_the_generation_only_when_the_body_reads_them() -> None:
    # A changed tool list starts a new generation (its own memo and previous call) for a body that reads the
    # tools; a body that never reads them keeps its outputs.
    reads = _split("{% for m in messages %}{{ m.content }}{{ tools|length if tools else 0 }}{% endfor %}")
    ignores = _split("{{ tools }}{% for m in messages %}{{ m.content }}{% endfor %}")
    one, two = [{"name": "a"}], [{"name": "a"}, {"name": "b"}]
    for split, differ in ((reads, True), (ignores, False)):
        keys = [generation_key(split, "", {"messages": [S], "tools": tools}) for tools in (None, one, two)]
        assert (len(set(keys)) == 3) == differ
        assert (len(set(keys)) == 1) == (not differ)


def test_guard_marks_are_each_positions_comparison_or_none_to_render_whole() -> None:
    split = _split("{% for m in messages %}{% if loop.index0 > last %}*{% endif %}{{ m.content }}{% endfor %}")
    assert guard_marks(split, {"last": 1}, 4) == [F, F, T, T]
    assert guard_marks(split, {"last": "1"}, 2) is None  # int > str fails: the template decides, rendered whole
    plain = _split("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert guard_marks(plain, {}, 3) == [(), (), ()]
