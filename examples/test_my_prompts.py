"""Unit tests for prompt budgets, with the pytest plugin that comes with contextkeeper (no setup needed).

    pytest examples/test_my_prompts.py -p no:cacheprovider

The tokenizer is ``mistral:tekken``, which mistral-common ships: everything runs offline. The conversation is the
demo's travel agent (11 messages, 3 tools, 2,103 prompt tokens). See docs/testing.md.
"""

from __future__ import annotations

import pytest

from contextkeeper.demo import load_sample

# Defaults for every test in this module; a test's own marker or the fixture's arguments override them.
pytestmark = pytest.mark.contextkeeper(tokenizer="mistral:tekken", context_window=8192, max_tokens=1024)

MESSAGES, TOOLS = load_sample()


def test_the_agent_conversation_fits(prompt_budget):
    budget = prompt_budget()
    check = budget.assert_fits(MESSAGES, tools=TOOLS)  # as given, nothing trimmed, 1,024 kept for the answer
    assert check.headroom > 4000  # and room for several more turns


def test_fixed_parts_stay_small(prompt_budget):
    # The system prompt, the tools and a short request are paid on every call: keep them under 400 tokens.
    budget = prompt_budget()
    assert budget.count([MESSAGES[0], {"role": "user", "content": "Hi"}], tools=TOOLS) < 400


@pytest.mark.contextkeeper(context_window=2048, max_tokens=256)
def test_a_small_context_gets_a_fitted_prompt(prompt_budget):
    budget = prompt_budget()
    with pytest.raises(AssertionError, match="over the limit of 2,048"):
        budget.assert_fits(MESSAGES, tools=TOOLS)  # as given it does not fit...
    fit = budget.fit(MESSAGES, tools=TOOLS)  # ...but the keeper's fit does, keeping what matters
    assert fit.tokens + 256 <= 2048
    assert fit.messages[0] == MESSAGES[0]  # the system prompt, verbatim
    assert fit.messages[-1] == MESSAGES[-1]  # the new request, verbatim


@pytest.mark.parametrize("turns", [1, 10, 40])
def test_long_chats_stay_in_budget(prompt_budget, turns):
    budget = prompt_budget(max_tokens=512)
    chat = list(MESSAGES)
    for turn in range(turns):
        chat += [
            {"role": "assistant", "content": f"Noted: option {turn}."},
            {"role": "user", "content": f"And what about option {turn + 1}, with hotel and a rental car?"},
        ]
    fit = budget.fit(chat, tools=TOOLS)
    assert fit.tokens + 512 <= budget.limit
    assert fit.messages[-1] == chat[-1]


def test_pinned_prompt(prompt_budget):
    # The fitted prompt of this golden conversation is pinned in
    # examples/__snapshots__/test_my_prompts/travel-agent-2k.json; when a policy or template change alters it,
    # this test fails with a diff. Accept a change with: pytest --update-prompt-snapshots
    budget = prompt_budget(context_window=2048, max_tokens=256)
    fit = budget.snapshot(MESSAGES, tools=TOOLS, name="travel-agent-2k")
    assert fit.messages[-1] == MESSAGES[-1]
