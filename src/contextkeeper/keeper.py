"""ContextKeeper: reserve-then-budget fitting of a conversation into the model's context.

The order is the seed's: the new request (never trimmed), the answer (``max_tokens``), the tools (as the
template renders them), then history, made to fit by the policy's strategies, cheapest first, and closed by a
sliding window over whole units. Every count is the template's exact count; every fit is checked against its
invariants before it is returned.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from ._exceptions import ChatTemplateError, ConfigurationError, ContextKeeperError, MessageError
from .messages import Conversation, Message, MessageLike, _restore_conversation
from .messages import Unit as MessageUnit
from .policy import Policy, resolve_policy
from .strategies.base import Action, FitState, Item, LLMCall, Unit, run_sync
from .strategies.sliding_window import SlidingWindow
from .tokens import TokenCounter, load_counter

__all__ = ["ContextKeeper", "Fit", "FitReport", "InvariantViolation", "RequestTooLarge"]


class RequestTooLarge(ContextKeeperError, ValueError):
    """The parts that are never trimmed (system prompt, tools, the new request) plus the answer do not fit."""

    def __init__(self, message: str, *, needed: int, limit: int) -> None:
        self.needed = needed
        self.limit = limit
        super().__init__(message)


class InvariantViolation(ContextKeeperError, AssertionError):
    """A fit broke one of its guarantees (a bug in a strategy): the fit is refused rather than returned."""


@dataclass(frozen=True, kw_only=True)
class FitReport:
    """What a fit did: the limit and where it came from, every slot, each strategy's savings, the time."""

    limit: int
    limit_source: str
    max_tokens: int
    tokens: int
    tokens_before: int | None  # None when history beyond the horizon was never read (counting it costs time)
    slots: dict[str, int]
    history_before: int | None
    history_after: int
    messages_before: int
    messages_after: int
    unread: int  # messages beyond the horizon, dropped without being read
    actions: tuple[Action, ...]
    seconds: float
    policy: str
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["actions"] = [dataclasses.asdict(a) for a in self.actions]
        data["notes"] = list(self.notes)
        return data


@dataclass(frozen=True)
class Fit:
    """The fitted prompt: ``messages`` in the caller's format, ``tokens`` its exact count, and the report."""

    messages: list[Any]
    tokens: int
    report: FitReport


def _role(message: Any) -> str:
    role = message.get("role") if isinstance(message, dict) else getattr(message, "role", None)
    return str(role) if role is not None else ""


def _chars(message: Any) -> int:
    content = message.get("content") if isinstance(message, dict) else getattr(message, "content", None)
    if isinstance(content, str):
        size = len(content)
    elif isinstance(content, list):
        size = sum(len(str(part.get("text", ""))) if isinstance(part, dict) else 16 for part in content)
    else:
        size = 0
    calls = message.get("tool_calls") if isinstance(message, dict) else getattr(message, "tool_calls", None)
    return size + (len(str(calls)) if calls else 0)


def _assemble(units: Sequence[Unit]) -> Conversation:
    """A Conversation of already validated units, without validating them again (the counter takes it as is).
    Strategies keep each unit's shape (a rewritten tool result keeps its call id), and the fit is validated
    once at the end by the invariant check."""
    messages: list[Message] = []
    groups: list[MessageUnit] = []
    for unit in units:
        if not unit:
            continue
        start = len(messages)
        messages.extend(item.message for item in unit)
        role = unit[0].role
        kind = "assistant" if role == "assistant" else "user" if role == "user" else "system"
        groups.append(MessageUnit(kind, start, len(messages), tuple(messages[start:])))  # type: ignore[arg-type]
    formats = cast(tuple[Literal["message"], ...], ("message",) * len(messages))
    return _restore_conversation(tuple(messages), formats, (None,) * len(messages), tuple(groups))


def _text_counter(counter: Any) -> Any:
    method = getattr(counter, "text_tokens", None)
    if method is not None:
        return method

    def marginal(text: str) -> int:  # any counter: what the text adds to a user message
        return int(counter.count([{"role": "user", "content": text}])) - int(
            counter.count([{"role": "user", "content": ""}])
        )

    return marginal


class _LazyRoles:
    """The messages' roles, read only when asked for (a fit on the sticky path never needs most of them)."""

    def __init__(self, messages: Sequence[Any]) -> None:
        self._messages = messages

    def __getitem__(self, index: int) -> str:
        return _role(self._messages[index])


@dataclass(frozen=True)
class _Sticky:
    """The previous fit: the caller's messages it saw, where its history started, and its rewrites by source."""

    inputs: tuple[Any, ...]
    sys_end: int
    start: int
    rewrites: dict[int, tuple[Message, Message]]


@dataclass
class _Session:
    """What a keeper remembers between fits."""

    turn: int = 0
    memory: dict[str, Any] = field(default_factory=dict)


class ContextKeeper:
    """Fits conversations into a model's context, exactly.

    ``tokenizer``: a tokenizer folder, a .gguf file, a hub id, ``mistral:<name>``, a transformers tokenizer or a
    ready :class:`TokenCounter`. The limit is the smallest of ``context_window``, the model's own maximum (when
    ``model`` is given) and, with ``gpu``, the longest context per sequence that fits at ``concurrency``.
    ``policy``: a built-in name, a .toml file, a :class:`Policy`, or ``"auto"`` to match by model name.
    ``summarizer``: a callable taking an :class:`LLMCall` and returning text, for the summarize strategy.
    """

    def __init__(
        self,
        tokenizer: Any = None,
        *,
        context_window: int | None = None,
        chat_template: str | None = None,
        policy: str | Policy | None = "default",
        model: Any = None,
        gpu: Any = None,
        concurrency: int = 1,
        runtime: str = "vllm",
        kv_dtype: str = "auto",
        summarizer: Any = None,
    ) -> None:
        if tokenizer is None:
            raise ConfigurationError(
                "ContextKeeper needs tokenizer=... (a folder, .gguf file, hub id or mistral:<name>)"
            )
        self.counter: TokenCounter = self._counter(tokenizer, chat_template)
        self.name = str(getattr(self.counter, "name", tokenizer))
        self.model = None
        limits: list[tuple[int, str]] = []
        if context_window is not None:
            if isinstance(context_window, bool) or not isinstance(context_window, int) or context_window <= 0:
                raise ConfigurationError(f"context_window must be a positive integer, got {context_window!r}")
            limits.append((context_window, "context_window"))
        if model is not None:
            from .memory import ModelSpec

            self.model = model if isinstance(model, ModelSpec) else ModelSpec.from_config(model)
            if self.model.max_context:
                limits.append((self.model.max_context, f"the model's maximum context ({self.model.name})"))
            if gpu is not None:
                from .memory import plan

                wanted = min(n for n, _ in limits)
                result = plan(
                    self.model, gpu, context=wanted, concurrency=concurrency, runtime=runtime, kv_dtype=kv_dtype
                )
                limits.append(
                    (
                        max(0, result.max_context),
                        f"the GPU ({result.gpu}, {runtime}, {concurrency} concurrent sequence(s))",
                    )
                )
        elif gpu is not None:
            raise ConfigurationError("gpu=... needs model=... too (the KV cache per token comes from the model config)")
        if not limits:
            raise ConfigurationError("set context_window=N (or model=... so the model's maximum context applies)")
        self.limit, self.limit_source = min(limits, key=lambda pair: pair[0])
        if self.limit <= 0:
            raise ConfigurationError(f"no context fits: {self.limit_source} allows 0 tokens; use fewer sequences")
        self.policy = resolve_policy(policy, self.model.name if self.model else self.name)
        self.pipeline = self.policy.pipeline()
        self.summarizer = summarizer
        self._text_tokens = _text_counter(self.counter)
        # Counts of the small fixed parts (system + request, the report's slots) go to a second counter, so the
        # main counter's incremental state follows the long prompt from fit to fit.
        fork = getattr(self.counter, "fork", None)
        self._side: TokenCounter = fork() if callable(fork) else self.counter
        self._session = _Session()
        self._previous: Conversation | None = None
        self.last_fit: Fit | None = None

    def fresh(self) -> ContextKeeper:
        """The same keeper (counter, limit, policy, summarizer) without memory of earlier fits: the next fit is
        computed from scratch, whatever this keeper fitted before."""
        clone = copy.copy(self)
        clone._session = _Session()
        clone._previous = None
        clone.last_fit = None
        return clone

    @staticmethod
    def _counter(tokenizer: Any, chat_template: str | None) -> TokenCounter:
        if isinstance(tokenizer, str):
            return load_counter(tokenizer, chat_template=chat_template)
        if hasattr(tokenizer, "apply_chat_template"):
            from .tokens import HFChatTemplateCounter

            return HFChatTemplateCounter(tokenizer, chat_template=chat_template)
        if callable(getattr(tokenizer, "count", None)):
            return tokenizer  # type: ignore[no-any-return]
        raise ConfigurationError(
            "tokenizer must be a spec string, a transformers tokenizer or a TokenCounter, got "
            f"{type(tokenizer).__name__}"
        )

    # ------------------------------------------------------------------------------------------ fit
    def fit(
        self, messages: Sequence[MessageLike], *, tools: Sequence[Any] | None = None, max_tokens: int | None = None
    ) -> Fit:
        """The longest prompt that fits with ``max_tokens`` reserved for the answer, keeping what matters."""
        started = time.perf_counter()
        answer = self.policy.answer_tokens if max_tokens is None else max_tokens
        if isinstance(answer, bool) or not isinstance(answer, int) or answer <= 0:
            raise ConfigurationError(f"max_tokens must be a positive integer, got {answer!r}")
        if not isinstance(messages, (list, tuple)):
            raise MessageError(
                f"expected a list of messages, got {type(messages).__name__}",
                index=None,
                fix="pass a list such as [{'role': 'user', 'content': '...'}]",
            )
        tool_list = list(tools) if tools else None
        sys_end = 0
        while sys_end < len(messages) and _role(messages[sys_end]) in ("system", "developer"):
            sys_end += 1
        last_user = next(
            (i for i in range(len(messages) - 1, sys_end - 1, -1) if _role(messages[i]) == "user"), len(messages)
        )
        roles = _LazyRoles(messages)
        # Read history back to the horizon; when strategies (pruning, summaries) leave room and older history was
        # left unread, read twice as far and fit again. The keeper remembers how far it had to read.
        memory = self._session.memory
        per_token = float(memory.get("horizon", self.policy.horizon))
        prompt_limit = self.limit - answer
        sticky = self._sticky(messages, sys_end, last_user)
        for _ in range(6):
            fit = self._fit_once(messages, roles, sys_end, last_user, answer, tool_list, per_token, started, sticky)
            if sticky is not None or not fit.report.unread or not per_token or fit.tokens >= 0.9 * prompt_limit:
                break
            per_token *= 2
        if per_token:
            memory["horizon"] = per_token
        self._session.turn += 1
        self.last_fit = fit
        return fit

    def _sticky(self, messages: Sequence[Any], sys_end: int, last_user: int) -> _Sticky | None:
        """The previous fit's window start and rewrites, when ``messages`` grew from the list it fitted (the same
        objects up to its end): re-applying them first keeps the prompt's prefix stable from turn to turn, so the
        counter (and a server's prefix cache) reuse it, and a turn that still fits needs no strategy at all."""
        previous: _Sticky | None = self._session.memory.get("_sticky")
        if previous is None or previous.sys_end != sys_end or len(messages) < len(previous.inputs):
            return None
        if previous.start >= last_user:
            return None
        if any(a is not b for a, b in zip(previous.inputs, messages, strict=False)):
            return None  # the caller edited or replaced earlier messages: fit from scratch
        return previous

    def _fit_once(
        self,
        messages: Sequence[MessageLike],
        roles: _LazyRoles,
        sys_end: int,
        last_user: int,
        answer: int,
        tool_list: list[Any] | None,
        per_token: float,
        started: float,
        sticky: _Sticky | None = None,
    ) -> Fit:
        if sticky is not None:
            horizon = sticky.start
        else:
            horizon = self._horizon(messages, roles, sys_end, last_user, answer, per_token)
        kept_indices = list(range(sys_end)) + list(range(horizon, len(messages)))
        selected = [messages[i] for i in kept_indices]
        conversation = Conversation.from_messages(selected, previous=self._previous)
        self._previous = conversation
        items = [Item(message, index) for message, index in zip(conversation.messages, kept_indices, strict=True)]
        system: Unit = tuple(items[:sys_end])
        request: Unit = tuple(item for item in items[sys_end:] if item.origin is not None and item.origin >= last_user)
        history: list[Unit] = []
        for unit in conversation.units():
            unit_items = tuple(items[i] for i in unit.indices)
            if unit_items and unit_items[0].origin is not None and sys_end <= unit_items[0].origin < last_user:
                history.append(unit_items)
        if history and history[0][0].role != "user" and horizon > sys_end:
            history = history[1:]  # the horizon always starts history on a user turn
        if sticky is not None and sticky.rewrites:
            history = [
                tuple(
                    Item(sticky.rewrites[id(i.message)][1], None, i.message)
                    if id(i.message) in sticky.rewrites and sticky.rewrites[id(i.message)][0] is i.message
                    else i
                    for i in unit
                )
                for unit in history
            ]

        counted: dict[tuple[int, ...], tuple[tuple[Unit, ...], int]] = {}

        def count(units: Sequence[Unit]) -> int:
            # Strategies and triggers ask for the same history more than once: count each distinct one once. The
            # entry holds the units, so their ids cannot be reused by other tuples while it lives.
            key = tuple(map(id, units))
            entry = counted.get(key)
            if entry is not None and all(a is b for a, b in zip(entry[0], units, strict=True)):
                return entry[1]
            tokens = int(self.counter.count(_assemble((system, *units, request)), tools=tool_list))
            counted[key] = (tuple(units), tokens)
            return tokens

        def peek(units: Sequence[Unit]) -> int | None:
            entry = counted.get(tuple(map(id, units)))
            return entry[1] if entry is not None and all(a is b for a, b in zip(entry[0], units, strict=True)) else None

        prompt_limit = self.limit - answer
        base = int(self._side.count(_assemble((system, request)), tools=tool_list))
        counted[()] = ((), base)
        if base > prompt_limit:
            raise self._too_large(base, answer, system, request, tool_list)
        query = "\n".join(item.text() for item in request if item.role == "user")
        state = FitState(
            system=system,
            history=tuple(history),
            request=request,
            limit=prompt_limit,
            count=count,
            peek=peek,
            text_tokens=self._text_tokens,
            query=query,
            turn=self._session.turn,
            memory=self._session.memory,
        )
        initial = state.history
        for strategy, trigger in self.pipeline:
            if getattr(strategy, "needs_backend", False) and self.summarizer is None:
                continue  # a summarising step without a summarizer: the sliding window covers it
            if trigger(state):
                state = run_sync(strategy, state, self._backend())
        state = run_sync(SlidingWindow(), state)
        final = [item for unit in (system, *state.history, request) for item in unit]
        tokens = state.tokens()
        # Exact when some step counted the history as it came in; None when none had to (it was clearly over the
        # budget, and tokenizing text about to be dropped would only cost time).
        before = peek(initial) if horizon <= sys_end else None
        self._remember(messages, sys_end, state.history)
        self._check(final, tokens, prompt_limit, system, request, messages)
        out = self._caller_format(final, conversation, kept_indices, messages)
        slots = self._slots(system, request, tool_list, base, tokens, answer)
        history_after = tokens - base
        report = FitReport(
            limit=self.limit,
            limit_source=self.limit_source,
            max_tokens=answer,
            tokens=tokens,
            tokens_before=before,
            slots=slots,
            history_before=(before - base) if before is not None else None,
            history_after=history_after,
            messages_before=len(messages),
            messages_after=len(out),
            unread=horizon - sys_end,
            actions=state.actions,
            seconds=time.perf_counter() - started,
            policy=self.policy.name,
            notes=(f"{horizon - sys_end} older message(s) beyond the horizon were dropped unread",)
            if horizon > sys_end
            else (),
        )
        return Fit(messages=out, tokens=tokens, report=report)

    def _remember(self, messages: Sequence[Any], sys_end: int, history: Sequence[Unit]) -> None:
        """Keep what the next fit re-applies first: the window start and each rewrite by its source."""
        memory = self._session.memory
        anchors = [item.origin for item in history[0] if item.origin is not None] if history else []
        made_up = any(item.origin is None and item.source is None for unit in history for item in unit)
        if made_up or (history and not anchors):
            memory.pop("_sticky", None)  # a summary or other unit without a source: fit from scratch next time
            return
        rewrites = {
            id(item.source): (item.source, item.message) for unit in history for item in unit if item.source is not None
        }
        start = anchors[0] if anchors else len(messages)
        memory["_sticky"] = _Sticky(inputs=tuple(messages), sys_end=sys_end, start=start, rewrites=rewrites)

    def _backend(self) -> Any:
        if self.summarizer is None:
            return None
        summarizer = self.summarizer

        def call(request: LLMCall) -> str:
            return str(summarizer(request))

        return call

    def _horizon(
        self, messages: Sequence[Any], roles: _LazyRoles, sys_end: int, last_user: int, answer: int, per_token: float
    ) -> int:
        """The first history message worth reading: older units cannot fit even at ``per_token`` characters per
        token, so they are dropped without being validated or tokenized. 0 characters per token: read all."""
        if not per_token:
            return sys_end
        budget = (self.limit - answer) * per_token
        used = 0
        horizon = last_user
        for index in range(last_user - 1, sys_end - 1, -1):
            used += _chars(messages[index])
            if roles[index] == "user":
                if used > budget and horizon < last_user:
                    break
                horizon = index
        else:
            return sys_end
        return horizon

    def _too_large(
        self, base: int, answer: int, system: Unit, request: Unit, tools: list[Any] | None
    ) -> RequestTooLarge:
        over = base + answer - self.limit
        without_tools = int(self.counter.count([i.message for i in (*system, *request)])) if tools else base
        return RequestTooLarge(
            f"the parts that are never trimmed need {base:,} tokens (tools {base - without_tools:,}; system prompt, "
            f"new request and template {without_tools:,}) plus {answer:,} reserved for the answer: {over:,} over "
            f"the limit of {self.limit:,} ({self.limit_source}). Fix: lower max_tokens, send fewer or shorter tool "
            "schemas, shorten the request or the system prompt, or raise context_window (a model with a longer "
            "context, or fewer concurrent sequences on the GPU)",
            needed=base + answer,
            limit=self.limit,
        )

    def _check(
        self, final: list[Item], tokens: int, prompt_limit: int, system: Unit, request: Unit, original: Sequence[Any]
    ) -> None:
        """The guarantees of every fit; a violation is a bug, so the fit is refused."""
        problems = []
        if tokens > prompt_limit:
            problems.append(f"{tokens} prompt tokens exceed the {prompt_limit} available")
        if any(item.origin != i for i, item in enumerate(system)):
            problems.append("the system prompt was changed")
        if any(item.origin is None for item in request):
            problems.append("the new request was changed")
        origins = [item.origin for item in final if item.origin is not None]
        if origins != sorted(origins) or len(set(origins)) != len(origins):
            problems.append("messages were reordered or repeated")
        try:
            Conversation.from_messages([item.message for item in final])
        except MessageError as exc:
            problems.append(f"the fitted conversation is not valid: {exc}")
        if problems:
            raise InvariantViolation("fit invariant broken: " + "; ".join(problems))

    @staticmethod
    def _caller_format(
        final: list[Item], conversation: Conversation, kept: list[int], original: Sequence[Any]
    ) -> list[Any]:
        position = {index: j for j, index in enumerate(kept)}
        formats = conversation._formats
        out: list[Any] = []
        dicts = not formats or formats[0] == "dict"
        for item in final:
            if item.origin is not None:
                fmt = formats[position[item.origin]]
                source = original[item.origin]
                if fmt == "dict":
                    # An unchanged plain dict goes back as the caller's own object (equal to itself, and free);
                    # other mappings as a new plain dict.
                    out.append(source if type(source) is dict else item.message.to_dict())
                elif fmt == "object":
                    out.append(original[item.origin])
                else:
                    out.append(item.message)
            else:
                out.append(item.message.to_dict() if dicts else item.message)
        return out

    def _slots(
        self, system: Unit, request: Unit, tools: list[Any] | None, base: int, tokens: int, answer: int
    ) -> dict[str, int]:
        """Tokens per slot in prompt order (each is what it adds to the prompt so far; they sum to the prompt).
        Only the small lists are counted; history is the prompt minus everything that is never trimmed."""
        count = self._side.count
        head = [i.message for i in system]
        asked = [i.message for i in request]
        fixed = [*head, *asked]
        try:
            alone = int(count(head, add_generation_prompt=False)) if head else 0
            with_tools = int(count(head, tools=tools, add_generation_prompt=False)) if tools else alone
            bare = int(count(fixed, tools=tools, add_generation_prompt=False))
            system_slot, tools_slot, request_slot, overhead = alone, with_tools - alone, bare - with_tools, base - bare
        except ChatTemplateError:
            # Templates that refuse a system prompt on its own (Llama 3.1+ puts tools in the first user message):
            # the same slots as marginal costs of removing each part.
            no_tools = int(count(fixed)) if tools else base
            no_tools_bare = int(count(fixed, add_generation_prompt=False))
            request_slot = int(count(asked, add_generation_prompt=False)) if asked else 0
            system_slot, tools_slot, overhead = no_tools_bare - request_slot, base - no_tools, no_tools - no_tools_bare
        return {
            "system": system_slot,
            "tools": tools_slot,
            "history": tokens - base,
            "request": request_slot,
            "template_overhead": overhead,
            "answer": answer,
        }

    def count(self, messages: Sequence[MessageLike], *, tools: Sequence[Any] | None = None) -> int:
        """The exact prompt tokens of ``messages`` as given (no fitting)."""
        return int(self.counter.count(messages, tools=list(tools) if tools else None))
