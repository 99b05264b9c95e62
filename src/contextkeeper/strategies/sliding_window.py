"""Drop whole oldest units until the prompt fits; the kept history starts on a user turn."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Action, FitState, Unit, register


def _anchor(unit: Unit) -> int | None:
    """The caller's index of the unit's first unchanged message (None for a unit made by a strategy)."""
    return next((item.origin for item in unit if item.origin is not None), None)


def _estimate(state: FitState, history: tuple[Unit, ...], starts: list[int], target: int) -> int:
    """The index in ``starts`` where the kept history would just fit ``target``, estimated from characters at the
    rate the whole history was counted at (only a first guess: the search counts exactly from there)."""
    base = state.peek(()) if state.peek is not None else None
    sizes = state.unit_chars(history)
    total_chars = sum(sizes)
    if base is None or not total_chars:
        return (len(starts) - 1) // 2
    rate = (state.tokens() - base) / total_chars
    suffix = total_chars
    position = 0
    for k, start in enumerate(starts[:-1]):
        suffix -= sum(sizes[position:start])
        position = start
        if base + rate * suffix <= target:
            return k
    return len(starts) - 1


@register("sliding_window")
@dataclass(frozen=True, kw_only=True)
class SlidingWindow:
    """Keep the longest suffix of whole units that fits, starting on a user turn (or empty history).

    Exact: every candidate is counted through the template. The search starts where the previous fit of the
    same keeper started (a growing chat moves that point forward a little), so a turn costs two or three counts.
    ``slack``: when units must go, the kept history leaves this share of the budget free (0: the longest suffix).
    """

    slack: float = 0.05  # when units must go, leave this share of the budget free

    def apply(self, state: FitState) -> FitState:
        history = state.history
        if state.tokens() <= state.limit:
            return state
        starts = [i for i, unit in enumerate(history) if unit and unit[0].role == "user"] + [len(history)]
        # Dropping a little more than needed means the next turns only append: the prompt's prefix stays the same
        # for a while (the counter and a server's prefix cache reuse it) instead of shifting on every turn.
        target = int(state.limit * (1 - self.slack))
        if state.tokens(history[starts[-1] :]) > target:
            target = state.limit

        def fits(k: int) -> bool:
            return state.tokens(history[starts[k] :]) <= target

        memory = state.memory.setdefault("sliding_window", {})
        hint = memory.get("start")
        last = len(starts) - 1  # the answer lies in [0, last]; ``last`` always fits (empty history)
        if hint is not None:
            guess = next(
                (k for k, s in enumerate(starts[:-1]) if (a := _anchor(history[s])) is not None and a >= hint), last
            )
        else:
            guess = _estimate(state, history, starts, target)
        # Gallop from the guess towards the answer, then bisect the bracket: a good guess costs two counts.
        if fits(guess):
            low, high, step = 0, guess, 1
            while high > 0:
                probe = max(0, high - step)
                if not fits(probe):
                    low = probe + 1
                    break
                high, step = probe, step * 2
        else:
            low, high, step = guess + 1, last, 1
            while low < high:
                probe = min(high, low + step - 1)
                if fits(probe):
                    high = probe
                    break
                low, step = probe + 1, step * 2
        while low < high:
            middle = (low + high) // 2
            if fits(middle):
                high = middle
            else:
                low = middle + 1
        start = starts[low]
        kept = history[start:]
        memory["start"] = _anchor(kept[0]) if kept else None
        saved = state.tokens() - state.tokens(kept)
        detail = f"dropped the {start} oldest unit(s)"
        action = Action(strategy="sliding_window", detail=detail, saved=saved, units=start)
        return state.with_history(kept, action)
