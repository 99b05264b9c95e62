"""The cost model of a server's prefix cache: what a turn costs, and when an edit that breaks the prompt's prefix
pays for itself.

A server reuses the KV cache of the prefix a prompt shares with the previous one; the rest it prefills. In units
of one prefilled token, a prompt of ``prompt`` tokens that reuses ``reused`` of them costs
``(prompt - reused) + cached_price * reused``: ``cached_price`` is what a reused token costs beside a prefilled
one (hosted prompt caching bills it at about a tenth; a self-hosted server spends a little attention on it and
no prefill, so the figure is prefill time's: a few hundredths).

An edit that changes history at token ``broken`` (clearing a tool result, dropping turns) re-prefills everything
after it: ``(level - broken) * (1 - cached_price)`` more than a turn that only appends. It leaves the prompt at
``level`` tokens, which then grows by about ``growth`` tokens a turn until ``high`` (the window's high-water mark)
forces the next cut; in between every turn carries its prompt at the cached price. The cost per turn of such a
cycle is what :meth:`CacheCost.per_turn` returns, and the break-even rule compares two ways on: an edit pays when
its cycle costs less per turn than the one it replaces.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CacheCost"]


@dataclass(frozen=True)
class CacheCost:
    """The prefix cache's prices: ``cached_price`` is a reused token's cost as a share of a prefilled one's."""

    cached_price: float = 0.1

    def turn(self, prompt: int, reused: int) -> float:
        """What one call costs, in prefilled tokens."""
        return (prompt - reused) + self.cached_price * reused

    def per_turn(self, level: float, broken: float, high: float, growth: float) -> float:
        """The cost per turn, beyond the turns' own new tokens, of leaving the prompt at ``level`` tokens after an
        edit at token ``broken`` (``broken = level``: no edit), held until the prompt has grown to ``high`` at
        ``growth`` tokens a turn."""
        turns = max(1.0, (high - level) / max(growth, 1.0))
        again = (1 - self.cached_price) * max(0.0, level - broken)
        carried = self.cached_price * (level + high) / 2
        return again / turns + carried

    def cut_pays(self, *, total: float, broken: float, low: float, base: float, high: float, growth: float) -> bool:
        """The break-even rule for a window whose prefix an earlier step already broke at token ``broken``: cutting
        on to the low-water mark ``low`` now (one more break, at ``base``, the never-trimmed head) pays when that
        cycle costs less per turn than keeping the ``total`` tokens as they are."""
        keep = self.per_turn(total, broken, high, growth)
        cut = self.per_turn(low, base, high, growth)
        return cut < keep
