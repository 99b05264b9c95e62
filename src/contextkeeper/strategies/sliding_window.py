"""Drop whole oldest units until the prompt fits; the kept history starts on a user turn."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from pydantic import Field, model_validator

from ._cache import CacheCost
from .base import Action, FitState, Items, StrategySettings, register


@dataclass(frozen=True)
class _Kept:
    """The conversation's last kept history, its tokens, and the growth per turn (the window's memory)."""

    history: tuple[Items, ...]
    tokens: int
    growth: float | None


_GROWTH_WEIGHT = 0.3  # the newest turn's weight in the growth per turn (an exponential mean)


@register("sliding_window")
class SlidingWindow(StrategySettings):
    """Keep a suffix of whole units that fits, starting on a user turn (or empty history).

    When units must go, the kept prompt leaves ``slack`` of the budget free, so the next turns only append (the
    prompt's prefix, and a server's prefix cache, stay valid for a while). The kept suffix is the longest one
    under that mark, or any one that ends within ``tolerance`` of the budget below it: the search may stop as
    soon as a count lands there. Exact: every candidate is counted through the template. Candidates are chosen
    by interpolating the counts already made over each unit's characters, so a fit usually costs two counts.

    Hysteresis (for prefix caches): ``low_water`` is where a cut leaves the prompt (a share of the budget; unset:
    ``1 - slack``) and ``high_water`` how far the prompt may then grow before the next cut (default the whole
    budget); ``hysteresis`` sets the gap between them in one number (``low_water = high_water - hysteresis``).
    Between two cuts every turn only appends, so the previous prompt stays a prefix of the next one. With
    hysteresis set, a turn where an earlier step broke the prefix anyway (cleared a batch of tool results) cuts on
    to the low-water mark when the break-even rule of :class:`~contextkeeper.strategies._cache.CacheCost` says
    that costs less per turn than keeping the prompt as it is: ``cached_price`` is a reused token's price beside a
    prefilled one's (0.1: hosted prompt caching; a few hundredths: prefill time on your own server).
    """

    # When units must go, leave this share of the budget free. With ``tolerance`` it bounds what a cut keeps from
    # below: at least 1 - slack - tolerance of the budget, less only by a turn that does not fit whole (97% by
    # default, so a cut keeps 95% of the longest whole-turn suffix while turns are under 2% of the budget).
    # More slack keeps the prefix longer between cuts; a cache-aware window (``hysteresis``) does that better.
    slack: float = Field(default=0.02, ge=0, lt=1)
    # A suffix this share of the budget below the mark is as good as the longest.
    tolerance: float = Field(default=0.01, ge=0, lt=1)
    low_water: float | None = Field(default=None, gt=0, lt=1)
    high_water: float = Field(default=1.0, gt=0, le=1)
    hysteresis: float | None = Field(default=None, gt=0, lt=1)
    cached_price: float = Field(default=0.1, ge=0, le=1)
    # Leave the slack free even when the history fits: older units are gone already (the keeper sets this for a
    # fresh read that dropped history beyond its horizon unread), so the next turns should only append.
    after_cut: bool = False

    def closing(self, *, after_cut: bool) -> SlidingWindow:
        """This window closing a fit (``after_cut``: the slack is left free even when the history fits)."""
        return self if self.after_cut == after_cut else self.model_copy(update={"after_cut": after_cut})

    @model_validator(mode="after")
    def _check_marks(self) -> SlidingWindow:
        given = self.model_fields_set
        if "hysteresis" in given and "low_water" in given:
            raise ValueError(
                f"hysteresis = {self.hysteresis} and low_water = {self.low_water} both set the low-water mark: "
                "keep one of them"
            )
        if "slack" in given and ({"hysteresis", "low_water"} & given):
            raise ValueError(
                f"slack = {self.slack} with low_water or hysteresis: slack is the low-water mark of a window "
                "without hysteresis (1 - slack); keep one of them"
            )
        low = self.low
        if low <= 0 or low >= self.high_water:
            raise ValueError(
                f"the low-water mark ({low:.3g}) must lie in (0, high_water = {self.high_water}): lower "
                "hysteresis or low_water, or raise high_water"
            )
        return self

    @property
    def hysteretic(self) -> bool:
        """Whether the window was asked for hysteresis (else it keeps its plain behaviour, ``1 - slack``)."""
        return self.low_water is not None or self.hysteresis is not None or self.high_water < 1

    @property
    def low(self) -> float:
        """Where a cut leaves the prompt, as a share of the budget."""
        if self.low_water is not None:
            return self.low_water
        if self.hysteresis is not None:
            return self.high_water - self.hysteresis
        return 1 - self.slack

    def apply(self, state: FitState) -> FitState:
        history = state.history
        total = state.tokens()
        share = self.low
        high = min(state.limit, int(state.limit * self.high_water))
        fits = total <= high and not (self.after_cut and total > state.limit * share)
        if fits and not (self.hysteretic and self._break_even(state, total, share, high)):
            self._remember(state, history, total)
            return state
        starts = [i for i, unit in enumerate(history) if unit and unit[0].role == "user"] + [len(history)]
        last = len(starts) - 1  # the answer lies in [0, last]; ``last`` (empty history) always fits the limit
        base = state.tokens(())
        target = int(state.limit * share)
        if base > target:
            target = state.limit
        if total <= target:
            self._remember(state, history, total)
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
        if total <= high and not self.after_cut:
            detail += f" (the prefix was broken already: cutting to {share:.0%} of the budget costs less per turn)"
        action = Action(strategy="sliding_window", detail=detail, saved=saved, units=start)
        self._remember(state, kept, counts[high])
        return state.with_history(kept, action)

    # -- hysteresis: what the previous fit kept, and the break-even rule --------------------------------------
    def _remember(self, state: FitState, kept: tuple[Items, ...], tokens: int) -> None:
        if not self.hysteretic:
            return
        known = state.memory.get(_Kept)
        state.memory.put(_Kept(kept, tokens, known.growth if known is not None else None))

    def _break_even(self, state: FitState, total: int, share: float, high: int) -> bool:
        """Whether to cut to the low-water mark although the prompt fits: an earlier step of this fit changed
        history the previous fit kept (the prefix is broken there anyway), and the break-even rule says a cut now
        costs less per turn than the prompt as it is. A history that only grew updates the growth per turn."""
        known = state.memory.get(_Kept)
        if known is None:
            return False
        kept, tokens, growth = known.history, known.tokens, known.growth
        history = state.history
        same = _same_units(history, kept)
        if same == len(kept):
            grew = total - tokens
            if grew > 0:
                growth = grew if growth is None else growth + _GROWTH_WEIGHT * (grew - growth)
                state.memory.put(_Kept(kept, tokens, growth))
            return False
        base = state.tokens(())
        if total * 1.0 <= state.limit * share or not history:
            return False
        # Where the prefix broke, in tokens: the head, plus the history's tokens in proportion to its characters.
        sizes = state.unit_chars(history)
        chars = sum(sizes) or 1
        broken = base + (total - base) * sum(sizes[:same]) / chars
        cost = CacheCost(self.cached_price)
        return cost.cut_pays(
            total=total,
            broken=broken,
            low=state.limit * share,
            base=base,
            high=high,
            growth=growth if growth is not None else 0.05 * state.limit,
        )

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


def _same_units(history: tuple[Items, ...], kept: tuple[Items, ...]) -> int:
    """How many leading units of ``history`` hold the very same messages as ``kept``'s."""
    for index, (unit, old) in enumerate(zip(history, kept, strict=False)):
        if unit is old:
            continue
        if len(unit) != len(old) or any(a.message is not b.message for a, b in zip(unit, old, strict=True)):
            return index
    return min(len(history), len(kept))


PLAIN_WINDOW = SlidingWindow()  # the window that closes a fit when the policy names none
