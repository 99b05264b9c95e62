"""Drop whole oldest units until the prompt fits; the kept history starts on a user turn."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Action, FitState, Unit, register


def _anchor(unit: Unit) -> int | None:
    """The caller's index of the unit's first unchanged message (None for a unit made by a strategy)."""
    return next((item.origin for item in unit if item.origin is not None), None)


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
        low, high = 0, len(starts) - 1  # the answer lies in [low, high]; high always fits (empty history)
        if hint is not None:
            guess = next(
                (k for k, s in enumerate(starts[:-1]) if (a := _anchor(history[s])) is not None and a >= hint),
                len(starts) - 1,
            )
            if fits(guess):
                high = guess
                if guess > 0 and not fits(guess - 1):
                    low = guess
                else:
                    high = max(0, guess - 1)
            else:  # gallop forward from the guess, then search the bracket
                low = guess + 1
                probe, step = low, 1
                while probe < high and not fits(probe):
                    low = probe + 1
                    step *= 2
                    probe = min(high, low + step - 1)
                high = probe
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
