"""Budget: the reserve order of one fit, checked when made, and the error that names the limit that binds."""

from __future__ import annotations

from typing import Any

import pytest

import contextkeeper as ck
from contextkeeper.fit.budget import Budget


def budget(max_tokens: int | None = 500, **reserve: Any) -> Budget:
    return Budget.of(
        8192,
        "context_window",
        max_tokens=max_tokens,
        policy="agent",
        policy_answer=1024,
        reserve=ck.fit.Reserve(**reserve),
    )


def test_the_prompt_gets_the_limit_less_the_answer_less_what_is_withheld() -> None:
    plain = budget()
    assert (plain.answer, plain.reserved, plain.prompt) == (500, 500, 7692)
    held = budget(withheld=1000, why="the server's limit", fix="raise the server's max_model_len")
    assert (held.reserved, held.prompt) == (1500, 6692)
    assert budget(None).answer == 1024  # the policy's answer_tokens when the caller gives none


@pytest.mark.parametrize("bad", [0, -5, 2.5, True, "100"])
def test_a_bad_answer_is_refused(bad: Any) -> None:
    with pytest.raises(ck.ConfigurationError, match="max_tokens must be a positive integer"):
        budget(bad)


@pytest.mark.parametrize("bad", [-1, 1.5, False])
def test_a_bad_withheld_count_is_refused(bad: Any) -> None:
    with pytest.raises(ck.ConfigurationError, match=r"reserve\.withheld must be an integer >= 0"):
        budget(withheld=bad)


def test_too_large_names_the_numbers_and_the_setting_that_frees_room() -> None:
    error = budget().too_large(fixed=9000, without_tools=7000)
    assert isinstance(error, ck.RequestTooLarge)
    assert (error.needed, error.limit, error.withheld) == (9500, 8192, 0)
    text = str(error)
    assert "need 9,000 tokens (tools 2,000; system prompt, new request and template 7,000)" in text
    assert "1,308 over the limit of 8,192 (context_window)" in text
    assert error.fix is not None
    assert error.fix.startswith("lower max_tokens")
    assert "raise context_window" in error.fix


def test_too_large_after_a_refusal_names_the_withheld_tokens_and_their_fix() -> None:
    error = budget(None, withheld=6144, why="the server's learned limit of 2,048", fix="raise the server's limit")
    made = error.too_large(fixed=3008, without_tools=3008)
    assert made.limit == 8192 - 6144
    assert "less 6,144 withheld (the server's learned limit of 2,048)" in str(made)
    assert made.fix is not None
    assert made.fix.startswith("lower answer_tokens in the policy ('agent')")
    assert made.fix.endswith("raise the server's limit")
    named = budget(withheld=10, answer_setting="max_completion_tokens").too_large(fixed=9000, without_tools=9000)
    assert named.fix is not None
    assert named.fix.startswith("lower max_completion_tokens")
