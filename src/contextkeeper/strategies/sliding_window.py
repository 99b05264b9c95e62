"""Drop whole oldest units until the prompt fits; the kept history starts on a user turn."""

from __future__ import annotations

import itertools

from pydantic import Field

from .base import Action, FitState, StrategySettings, register


@register("sliding_window")
class SlidingWindow(StrategySettings):
    """Keep a suffix of whole units that fits, starting on a user turn (or empty history).

    When units must go, the kept prompt leaves ``slack`` of the budget free, so the next turns only append (the
    prompt's prefix, and a server's prefix cache, stay valid for a while). The kept suffix is the longest one
    under that mark, or any one that ends within ``tolerance`` of the budget below it: the search may stop as
    soon as a count lands there. Exact: every candidate is counted through the template. Candidates are chosen
    by interpolating the counts already made over each unit's characters, so a fit usually costs two counts.
    """

    slack: float = Field(default=0.05, ge=0, lt=1)  # when units must go, leave this share of the budget free
    # A suffix this share of the budget below the mark is as good as the longest.
    tolerance: float = Field(default=0.01, ge=0, lt=1)
    # Leave the slack free even when the history fits: older units are gone already (the keeper sets this for a
    # fresh read that dropped history beyond its horizon unread), so the next turns should only append.
    after_cut: bool = False

    def apply(self, state: FitState) -> FitState:
        history = state.history
        total = state.tokens()
        if total <= state.limit and not (self.after_cut and total > state.limit * (1 - self.slack)):
            return state
        starts = [i for i, unit in enumerate(history) if unit and unit[0].role == "user"] + [len(history)]
        last = len(starts) - 1  # the answer lies in [0, last]; ``last`` (empty history) always fits the limit
        base = state.tokens(())
        target = int(state.limit * (1 - self.slack))
        if base > target:
            target = state.limit
        if total <= target:
            return state
        floor = target - int(state.limit * self.tolerance)
        # Characters of the history kept from each candidate start, for interpolating between exact counts.
        sizes = state.unit_chars(history)
        cumulative = [0, *itertools.accumulate(sizes)]
        kept_chars = [cumulative[-1] - cumulative[s] for s in starts]
        counts = {last: base}
        if starts[0] == 0:
            counts[0] = total

        def tokens(k: int) -> int:
            if k not in counts:
                counts[k] = state.tokens(history[starts[k] :])
            return counts[k]

        low = 0 if 0 in counts else -1  # the largest candidate known to be over ``target`` (-1: none known)
        high = last  # the smallest candidate known to fit ``target``
        rounds = 0
        while high - low > 1:
            probe = self._probe(low, high, counts, kept_chars, target, floor, rounds)
            rounds += 1
            if tokens(probe) <= target:
                high = probe
                if counts[probe] >= floor:
                    break  # close enough below the mark: as good as the longest
            else:
                low = probe
        start = starts[high]
        kept = history[start:]
        saved = total - counts[high]
        detail = f"dropped the {start} oldest unit(s)"
        action = Action(strategy="sliding_window", detail=detail, saved=saved, units=start)
        return state.with_history(kept, action)

    @staticmethod
    def _probe(
        low: int, high: int, counts: dict[int, int], kept_chars: list[int], target: int, floor: int, rounds: int
    ) -> int:
        """The next candidate strictly between ``low`` and ``high``: where the counts on either side, spread
        over the characters in between, reach the middle of the band; every fourth round a plain bisection,
        so a poor interpolation cannot make the search slower than bisecting."""
        middle = (low + high) // 2
        if low < 0 or rounds % 4 == 3:
            return middle
        chars_low, chars_high = kept_chars[low], kept_chars[high]
        tokens_low, tokens_high = counts[low], counts[high]
        if chars_low <= chars_high or tokens_low <= tokens_high:
            return middle
        aim = (target + floor) / 2
        # Kept characters where the line through the two known counts reaches ``aim``.
        want = chars_high + (aim - tokens_high) * (chars_low - chars_high) / (tokens_low - tokens_high)
        # The first candidate keeping at most ``want`` characters (kept_chars falls as k grows).
        probe = next((k for k in range(low + 1, high) if kept_chars[k] <= want), high - 1)
        return min(max(probe, low + 1), high - 1)
