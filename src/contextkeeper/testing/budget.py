"""The prompt budget a test asserts against, and the failure report that says what to change.

Everything in a failure message is measured, not estimated: the slot table is the exact breakdown of the
messages as given, and each suggested fix is checked with a real count or a real fit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._exceptions import ContextKeeperError
from ..keeper import ContextKeeper, Fit, RequestTooLarge
from ..messages import Conversation
from ..tokens import breakdown
from ..tokens.breakdown import split_slots
from .settings import BudgetSettings

if TYPE_CHECKING:
    from .snapshot import SnapshotStore

__all__ = ["BudgetCheck", "PromptBudget", "build_keeper", "explain_overflow"]


def build_keeper(settings: BudgetSettings, counters: dict[Any, Any]) -> ContextKeeper:
    """A keeper for ``settings``; the counter (the slow part: loading a tokenizer) is shared through
    ``counters`` by every budget of the session with the same tokenizer and chat template."""
    tokenizer = settings.get("tokenizer")
    template = settings.get("chat_template")
    if isinstance(tokenizer, str):
        key = (tokenizer, template)
        if key not in counters:
            from ..tokens import load_counter

            counters[key] = load_counter(tokenizer, chat_template=template)
        tokenizer, template = counters[key], None
    return ContextKeeper(
        tokenizer,
        context_window=settings.get("context_window"),
        chat_template=template,
        policy=settings.get("policy", "default"),
        model=settings.get("model"),
        gpu=settings.get("gpu"),
        concurrency=settings.get("concurrency", 1),
        runtime=settings.get("runtime", "vllm"),
        kv_dtype=settings.get("kv_dtype", "auto"),
    )


def fresh(keeper: ContextKeeper) -> ContextKeeper:
    """The same keeper (counter, limit, policy) without memory of earlier fits, so that a fit in one test never
    depends on the fits other tests made before it."""
    return keeper.fresh()


@dataclass(frozen=True)
class BudgetCheck:
    """A passing check: the prompt's exact tokens, the answer reserve, the limit and what is left."""

    tokens: int
    max_tokens: int
    limit: int
    limit_source: str

    @property
    def headroom(self) -> int:
        """Tokens still free once the prompt and the answer reserve are in."""
        return self.limit - self.tokens - self.max_tokens


class PromptBudget:
    """A context budget for tests: ``assert_fits``, ``count``, ``fit`` and ``snapshot`` against one keeper's
    settings (tokenizer, limit, answer reserve, policy)."""

    def __init__(self, keeper: ContextKeeper, settings: BudgetSettings, snapshots: SnapshotStore | None = None) -> None:
        self._prototype = keeper
        self._keeper: ContextKeeper | None = None
        self.settings = settings
        self._snapshots = snapshots
        requested = settings.get("max_tokens")
        self.max_tokens: int = keeper.policy.answer_tokens if requested is None else int(requested)

    def __repr__(self) -> str:
        return (
            f"PromptBudget({self.tokenizer}, limit={self.limit} ({self.limit_source}), max_tokens={self.max_tokens}, "
            f"policy={self.policy!r})"
        )

    @property
    def tokenizer(self) -> str:
        return self._prototype.name

    @property
    def limit(self) -> int:
        """The context limit: the smallest of context_window, the model's maximum and what the GPU holds."""
        return self._prototype.limit

    @property
    def limit_source(self) -> str:
        return self._prototype.limit_source

    @property
    def policy(self) -> str:
        return self._prototype.policy.name

    @property
    def keeper(self) -> ContextKeeper:
        """This budget's own keeper (it remembers its fits, like an application's: use it to test several
        turns in a row)."""
        if self._keeper is None:
            self._keeper = fresh(self._prototype)
        return self._keeper

    def count(self, messages: Sequence[Any], tools: Sequence[Any] | None = None) -> int:
        """The exact prompt tokens of ``messages`` and ``tools`` as given (no trimming)."""
        return self._prototype.count(messages, tools=tools)

    def fit(self, messages: Sequence[Any], tools: Sequence[Any] | None = None) -> Fit:
        """The keeper's fit with ``max_tokens`` reserved, from a keeper with no memory of earlier fits."""
        return fresh(self._prototype).fit(messages, tools=tools, max_tokens=self.max_tokens)

    def assert_fits(self, messages: Sequence[Any], tools: Sequence[Any] | None = None) -> BudgetCheck:
        """Assert that ``messages`` and ``tools`` AS GIVEN, plus ``max_tokens`` for the answer, fit the limit.

        On failure the ``AssertionError`` shows the slot table, the overflow and what would make it fit.
        """
        __tracebackhide__ = True
        tokens = self.count(messages, tools)
        if tokens + self.max_tokens <= self.limit:
            return BudgetCheck(tokens, self.max_tokens, self.limit, self.limit_source)
        raise AssertionError(explain_overflow(self, messages, tools))

    def snapshot(self, messages: Sequence[Any], tools: Sequence[Any] | None = None, *, name: str | None = None) -> Fit:
        """Fit ``messages`` and compare the fitted prompt with the stored snapshot (see ``prompt_snapshot``)."""
        __tracebackhide__ = True
        if self._snapshots is None:
            raise RuntimeError("this PromptBudget has no snapshot store: use the prompt_budget fixture")
        result = self.fit(messages, tools)
        self._snapshots.check(result, name)
        return result


# ------------------------------------------------------------------------------------------------ diagnosis


def _n(value: int) -> str:
    return f"{value:,}"


def explain_overflow(budget: PromptBudget, messages: Sequence[Any], tools: Sequence[Any] | None) -> str:
    """What overflows, by how much, slot by slot, and which change (each checked) would make it fit."""
    keeper = budget._prototype
    counter = keeper.counter
    tool_list = list(tools) if tools else None
    answer, limit = budget.max_tokens, budget.limit
    parts = breakdown(counter, messages, tools=tool_list)
    total = parts.tokens
    need = total + answer
    over = need - limit
    lines = [
        f"prompt does not fit: {_n(total)} prompt tokens + {_n(answer)} reserved for the answer = {_n(need)}, "
        f"over the limit of {_n(limit)} by {_n(over)} tokens",
        "",
    ]
    rows: list[tuple[str, int, str]] = [
        ("system", parts.system, _messages(parts.messages.get("system", 0))),
        ("tools", parts.tools, f"{len(tool_list)} schema(s)" if tool_list else ""),
        ("history", parts.history, _messages(parts.messages.get("history", 0))),
        ("request", parts.request, _messages(parts.messages.get("request", 0))),
        ("template overhead", parts.template_overhead, ""),
        ("answer reserve", answer, f"max_tokens ({budget.settings.source('max_tokens')})"),
        ("total", need, ""),
        ("context window", limit, budget.limit_source),
        ("over by", over, ""),
    ]
    width = max(len(_n(v)) for _, v, _ in rows)
    lines.append(f"  {'slot':<18} {'tokens':>{width}}")
    for label, value, note in rows:
        if label == "total":
            lines.append("  " + "-" * (19 + width))
        lines.append(f"  {label:<18} {_n(value):>{width}}" + (f"   {note}" if note else ""))
    if parts.estimated:
        lines.append("  (some parts are estimated: " + "; ".join(parts.notes) + ")")
    lines += ["", "what would make it fit:"]
    fixes: list[str] = []
    fixes += _history_fixes(budget, messages, tool_list)
    fixes += _limit_fixes(budget, need)
    if answer - over >= 1:
        fixes.append(f"lower max_tokens by {_n(over)} (to {_n(answer - over)})")
    else:
        fixes.append(
            f"max_tokens alone cannot fix it: the prompt by itself ({_n(total)}) is over the limit "
            f"by {_n(total - limit)}"
        )
    if tool_list and parts.tools > 0:
        fixes.append(_tools_fix(counter, messages, tool_list, parts.tools, total, answer, limit))
    lines += [f"  - {fix}" for fix in fixes]
    lines += ["", f"tokenizer {budget.tokenizer}; settings: {budget.settings.describe()}"]
    return "\n".join(lines)


def _messages(count: int) -> str:
    return f"{count} message(s)" if count else ""


def _history_fixes(budget: PromptBudget, messages: Sequence[Any], tools: list[Any] | None) -> list[str]:
    keeper = budget._prototype
    answer, limit = budget.max_tokens, budget.limit
    fixes: list[str] = []
    try:
        conversation = Conversation.from_messages(messages)
    except ContextKeeperError:
        return fixes
    end_system, start_request = split_slots(conversation)
    units = [u for u in conversation.units() if end_system <= u.start and u.stop <= start_request]
    if not units:
        return fixes
    head, tail = list(messages[:end_system]), list(messages[start_request:])

    def prompt_without(k: int) -> int:
        kept = [messages[i] for unit in units[k:] for i in unit.indices]
        return keeper.count([*head, *kept, *tail], tools=tools)

    fixed = prompt_without(len(units))
    if fixed + answer > limit:
        fixes.append(
            f"trimming history cannot fix it: without any history the prompt still needs {_n(fixed)} tokens "
            f"+ {_n(answer)} for the answer, {_n(fixed + answer - limit)} over the limit"
            + (f" (with max_tokens <= {_n(limit - fixed)} it would fit)" if fixed < limit else "")
        )
        return fixes
    low, high = 1, len(units)  # the smallest k that fits lies in [low, high]
    while low < high:
        middle = (low + high) // 2
        if prompt_without(middle) + answer <= limit:
            high = middle
        else:
            low = middle + 1
    dropped = sum(len(unit.indices) for unit in units[:low])
    fixes.append(
        f"drop the {low} oldest of {len(units)} history unit(s) ({dropped} message(s); a unit is a user message, "
        f"or an assistant message with its tool results): the prompt becomes {_n(prompt_without(low))} tokens"
    )
    fixes.append(_policy_fix(budget, messages, tools))
    return fixes


def _policy_fix(budget: PromptBudget, messages: Sequence[Any], tools: list[Any] | None) -> str:
    try:
        result = budget.fit(messages, tools)
    except RequestTooLarge as exc:  # pragma: no cover - the history check above rules this out
        return f"policy {budget.policy!r} cannot fit it: {exc}"
    except ContextKeeperError as exc:
        return f"policy {budget.policy!r} failed: {type(exc).__name__}: {exc}"
    report = result.report
    steps = [f"{a.strategy}: {a.detail}" + (f" (saved {_n(a.saved)})" if a.saved else "") for a in report.actions]
    steps += list(report.notes)
    how = "; ".join(steps) if steps else "no step needed"
    return (
        f"policy {budget.policy!r} (budget.fit / keeper.fit) would fit it in {_n(result.tokens)} tokens, "
        f"{report.messages_before} -> {report.messages_after} messages: {how}"
    )


def _limit_fixes(budget: PromptBudget, need: int) -> list[str]:
    keeper = budget._prototype
    source = budget.limit_source
    settings = budget.settings
    if source == "context_window":
        text = f"raise context_window to >= {_n(need)}"
        if keeper.model is not None and keeper.model.max_context and keeper.model.max_context < need:
            text += f" (but the model {keeper.model.name} allows only {_n(keeper.model.max_context)})"
        return [text]
    if source.startswith("the model's maximum"):
        return [f"{source} is {_n(budget.limit)}: this prompt needs a model with >= {_n(need)} tokens of context"]
    if keeper.model is None or settings.get("gpu") is None:  # pragma: no cover - no other limit sources
        return [f"raise the limit ({source}) to >= {_n(need)}"]
    from ..memory import plan

    concurrency = settings.get("concurrency", 1)
    result = plan(
        keeper.model,
        settings.get("gpu"),
        context=need,
        concurrency=1,
        runtime=settings.get("runtime", "vllm"),
        kv_dtype=settings.get("kv_dtype", "auto"),
        advise=False,
    )
    if result.max_concurrency >= 1:
        return [
            f"the GPU holds {_n(budget.limit)} tokens per sequence at concurrency={concurrency}: "
            f"concurrency <= {result.max_concurrency} leaves room for {_n(need)}"
        ]
    return [
        f"the GPU cannot hold {_n(need)} tokens even for one sequence (at most {_n(result.max_context)}): "
        "use a larger GPU, a smaller kv_dtype (e.g. fp8) or a smaller model"
    ]


def _tools_fix(
    counter: Any, messages: Sequence[Any], tools: list[Any], cost: int, total: int, answer: int, limit: int
) -> str:
    without = total - cost
    verdict = "would fit" if without + answer <= limit else "would still not fit"
    text = f"the tools alone cost {_n(cost)} tokens: without them the prompt is {_n(without)} ({verdict})"
    if 1 < len(tools) <= 32:
        costs = []
        for index, tool in enumerate(tools):
            rest = tools[:index] + tools[index + 1 :]
            costs.append((total - int(counter.count(messages, tools=rest)), _tool_name(tool, index)))
        top = sorted(costs, key=lambda pair: -pair[0])[:3]
        text += "; largest: " + ", ".join(f"{name} {_n(tokens)}" for tokens, name in top)
    return text


def _tool_name(tool: Any, index: int) -> str:
    if isinstance(tool, dict):
        function = tool.get("function", tool)
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return str(function["name"])
    return f"tools[{index}]"
