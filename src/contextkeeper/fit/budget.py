"""The budget of one fit, in the reserve-then-budget order: the limit, less the answer, less what a wrapped call
withholds, is what the prompt may use; the never-trimmed parts (system prompt, tools, new request) come first,
history gets the rest. A budget that cannot hold the never-trimmed parts says which limit and setting bind."""

from __future__ import annotations

from dataclasses import dataclass

from .._exceptions import ConfigurationError, RequestTooLarge

__all__ = ["Budget", "Reserve"]


@dataclass(frozen=True, kw_only=True)
class Reserve:
    """How a fit's reserve below the limit is made up, beyond the answer: ``answer_setting`` names the caller's
    argument that set the answer (None: ``max_tokens``, or the policy's ``answer_tokens`` when none was given);
    ``withheld`` tokens are kept free as well (a wrapped call's learned server limit, hidden tokens...), ``why``
    says what they are for and ``fix`` what frees them. Errors then name the limit that binds."""

    answer_setting: str | None = None
    withheld: int = 0
    why: str = ""
    fix: str = ""


@dataclass(frozen=True, kw_only=True)
class Budget:
    """One fit's tokens: ``limit`` (from ``limit_source``) = ``answer`` + ``reserve.withheld`` + ``prompt``.

    ``policy``: the name of the policy whose ``answer_tokens`` set the answer, when the caller gave no
    ``max_tokens`` (an error then says to lower it there)."""

    limit: int
    limit_source: str
    answer: int
    reserve: Reserve = Reserve()
    policy: str | None = None

    @classmethod
    def of(
        cls, limit: int, limit_source: str, *, max_tokens: int | None, policy: str, policy_answer: int, reserve: Reserve
    ) -> Budget:
        """The budget for a fit asked with ``max_tokens`` (None: the policy's ``answer_tokens``), checked."""
        answer = policy_answer if max_tokens is None else max_tokens
        if isinstance(answer, bool) or not isinstance(answer, int) or answer <= 0:
            raise ConfigurationError(f"max_tokens must be a positive integer, got {answer!r}")
        withheld = reserve.withheld
        if isinstance(withheld, bool) or not isinstance(withheld, int) or withheld < 0:
            raise ConfigurationError(f"reserve.withheld must be an integer >= 0, got {withheld!r}")
        return cls(
            limit=limit,
            limit_source=limit_source,
            answer=answer,
            reserve=reserve,
            policy=policy if max_tokens is None else None,
        )

    @property
    def reserved(self) -> int:
        """What the prompt may not use: the answer and the withheld tokens."""
        return self.answer + self.reserve.withheld

    @property
    def prompt(self) -> int:
        """The most prompt tokens a fit may send."""
        return self.limit - self.reserved

    def too_large(self, fixed: int, without_tools: int) -> RequestTooLarge:
        """The error for never-trimmed parts of ``fixed`` tokens (``without_tools`` of them not the tools') that
        do not fit: what they need, the limit that binds and the setting that frees room."""
        reserve = self.reserve
        withheld = reserve.withheld
        limit = self.limit - withheld
        over = fixed + self.answer - limit
        if reserve.answer_setting:
            lower = f"lower {reserve.answer_setting}"
        elif self.policy is not None:
            lower = f"lower answer_tokens in the policy ({self.policy!r}) or pass a smaller max_tokens"
        else:
            lower = "lower max_tokens"
        trims = "send fewer or shorter tool schemas, shorten the request or the system prompt"
        if withheld:
            where = (
                f"the limit of {limit:,}: the keeper's {self.limit:,} ({self.limit_source}) less {withheld:,} "
                f"withheld ({reserve.why or 'for this call'})"
            )
            fix = f"{lower}, {trims}, or {reserve.fix or 'raise the limit that binds'}"
        else:
            where = f"the limit of {self.limit:,} ({self.limit_source})"
            fix = (
                f"{lower}, {trims}, or raise context_window (a model with a longer context, or fewer concurrent "
                "sequences on the GPU)"
            )
        return RequestTooLarge(
            f"the parts that are never trimmed need {fixed:,} tokens (tools {fixed - without_tools:,}; system "
            f"prompt, new request and template {without_tools:,}) plus {self.answer:,} reserved for the answer: "
            f"{over:,} over {where}. Fix: {fix}",
            needed=fixed + self.answer,
            limit=limit,
            withheld=withheld,
            fix=fix,
        )
