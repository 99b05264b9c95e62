"""ContextKeeper: reserve-then-budget fitting of a conversation into the model's context.

The order is reserve-then-budget: the new request (never trimmed), the answer (``max_tokens``), the tools (as the
template renders them), then history, made to fit by the policy's strategies, cheapest first, and closed by a
sliding window over whole units. Every count is the template's exact count; every fit is checked against its
invariants before it is returned.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import inspect
import logging
import threading
import time
import warnings
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING, Any, Literal, overload

from ._exceptions import ConfigurationError, InvariantViolation, RequestTooLarge, TransportError
from .config import Admission, Limit, Recording, Sharing, merged
from .fit import engine
from .fit.budget import Budget, Reserve
from .fit.report import Fit, FitReport
from .fit.session import DEFAULT_CONVERSATION, Session, Sessions
from .messages import MessageLike
from .servers.calibration import Calibration, calibrate
from .servers.dialects import DIALECTS, Dialect, dialect_of
from .strategies.base import LLMCall
from .strategies.policy import Policy, resolve_policy
from .tokens import TemplateLimits, TokenCounter, load_counter

if TYPE_CHECKING:
    import openai

    from .backends.openai import WrappedOpenAI
    from .calls.loop import Calls

# The fit's types live in their own modules; importable from here as they always were.
__all__ = ["ContextKeeper", "Fit", "FitReport", "InvariantViolation", "RequestTooLarge", "Reserve"]

log = logging.getLogger("contextkeeper")


def _resolve_limit(limit: Limit) -> tuple[Any, int, str]:
    """The model spec, the token limit and what sets it: the least of the context window, the model's maximum
    context and what the GPU holds for the concurrency."""
    from .memory import ModelSpec

    limits: list[tuple[int, str]] = []
    if limit.context_window is not None:
        limits.append((limit.context_window, "context_window"))
    model = None
    if limit.model is not None:
        model = limit.model if isinstance(limit.model, ModelSpec) else ModelSpec.from_config(limit.model)
        if model.max_context:
            limits.append((model.max_context, f"the model's maximum context ({model.name})"))
        if limit.gpu is not None:
            from .memory import plan

            result = plan(
                model,
                limit.gpu,
                context=min(n for n, _ in limits),
                concurrency=limit.concurrency,
                runtime=limit.runtime,
                kv_dtype=limit.kv_dtype,
            )
            where = f"the GPU ({result.gpu}, {limit.runtime}, {limit.concurrency} concurrent sequence(s))"
            limits.append((result.context_limit(), where))  # (context_limit says why when not one token fits)
    if not limits:
        raise ConfigurationError("set context_window=N (or model=... so the model's maximum context applies)")
    tokens, source = min(limits, key=lambda pair: pair[0])
    if tokens <= 0:
        raise ConfigurationError(f"no context fits: {source} allows 0 tokens; use fewer sequences")
    return model, tokens, source


def _reads_facts(ledger: object, shared: object) -> bool:
    """Whether ``ledger``'s admissions can read the server facts ``shared`` keeps: a Redis ledger on the same Redis
    (one URL); different URLs stay apart."""
    if ledger is None or shared is None:
        return False
    from .calls.redis_ledger import RedisLedger
    from .calls.shared import SharedState

    return isinstance(ledger, RedisLedger) and isinstance(shared, SharedState) and ledger.url == shared.url


async def _awaited(value: Awaitable[Any]) -> Any:
    return await value


class ContextKeeper:
    """Fits conversations into a model's context, exactly.

    ``tokenizer``: a tokenizer folder, a .gguf file, a hub id, ``mistral:<name>``, a transformers tokenizer or a
    ready :class:`TokenCounter`. The limit is the smallest of ``context_window``, the model's own maximum (when
    ``model`` is given) and, with ``gpu``, the longest context per sequence that fits at ``concurrency``.
    ``template_limits`` bounds what the chat template may do per render (a :class:`TemplateLimits`: steps,
    output, seconds, nesting); a template past a bound is refused with :class:`TemplateLimitExceeded`.
    ``policy``: a built-in name, a .toml file, a :class:`Policy`, or ``"auto"`` to match by model name.
    ``summarizer``: a callable taking an :class:`LLMCall` and returning text, for the summarize strategy.

    Wrapped calls (:meth:`wrap`): ``transcript`` (None: in memory; a path: a SQLite file; a ``postgresql://``
    URL: Postgres, for every replica) keeps everything sent and received; ``admission`` ("wait" or "shrink")
    and ``admission_timeout`` decide what a call does when the calls in flight already hold the KV capacity,
    which is ``kv_capacity`` tokens when given (a server's own figure, e.g. vLLM's "GPU KV cache size") or else
    planned from ``model`` and ``gpu`` at ``concurrency``; ``monitor`` (a
    :class:`~contextkeeper.diagnose.MemoryMonitor`) is sampled after every call.
    ``server``: whose preprocessing counts follow (a name in :data:`~contextkeeper.servers.dialects.DIALECTS`, default
    vLLM's), or ``"auto"``: the first :meth:`wrap` of an openai client asks that server once which it is.

    Many processes and replicas (docs/scaling.md): ``ledger`` (a Redis URL) admits every process against one KV
    pool named ``ledger_pool``; ``shared`` (a Redis URL or a :class:`~.calls.shared.SharedState`; by default
    the ledger's URL; False: off) shares what is learned once: server limits and hidden tokens, detected servers,
    summaries with a per-conversation lease. ``transcript`` may be a ``postgresql://`` URL. When Redis cannot be
    reached, ``ledger_unavailable`` / ``shared_unavailable`` (by default the ledger's choice) say "fail" (a typed
    error) or "local" (go on in this process, with a warning).

    The same settings as typed objects (:mod:`contextkeeper.config`, each checked once when made):
    ``limit=Limit(...)``, ``admission=Admission(...)``, ``sharing=Sharing(...)``, ``recording=Recording(...)``;
    the keywords above fill them, and an object with a keyword of its own part is refused. The keeper keeps them as
    ``limit_config``, ``admission_config``, ``sharing_config`` and ``recording_config``.
    """

    def __init__(
        self,
        tokenizer: Any = None,
        *,
        context_window: int | None = None,
        chat_template: str | None = None,
        template_limits: TemplateLimits | None = None,
        policy: str | Policy | None = "default",
        model: Any = None,
        gpu: Any = None,
        concurrency: int = 1,
        runtime: str = "vllm",
        kv_dtype: str = "auto",
        summarizer: Any = None,
        conversations: int = 1024,
        transcript: Any = None,
        admission: Literal["wait", "shrink"] | Admission = "wait",
        admission_timeout: float = 30.0,
        kv_capacity: int | None = None,
        monitor: Any = None,
        server: str | None = None,
        ledger: str | None = None,
        ledger_pool: str = "default",
        ledger_unavailable: Literal["fail", "local"] = "fail",
        shared: Any = None,
        shared_unavailable: Literal["fail", "local"] | None = None,
        limit: Limit | None = None,
        sharing: Sharing | None = None,
        recording: Recording | None = None,
    ) -> None:
        if tokenizer is None:
            raise ConfigurationError(
                "ContextKeeper needs tokenizer=... (a folder, .gguf file, hub id or mistral:<name>)"
            )
        # "auto": vLLM's rules until wrap() asks the server which it is (detection.py), then the dialect found.
        self._auto = isinstance(server, str) and server.strip().lower() == "auto"
        self._build = (tokenizer, chat_template, template_limits)
        self.counter: TokenCounter = self._counter(tokenizer, chat_template, template_limits, server, self._auto)
        # Whose preprocessing the counts follow (vLLM's unless told): a ready counter's own where it has one.
        self.server: Dialect = getattr(self.counter, "dialect", None) or dialect_of(None if self._auto else server)
        self.detection: Any = None  # what server="auto" found (a detection.Detection), after the first wrap
        self.name = str(getattr(self.counter, "name", tokenizer))
        self.limit_config = merged(
            Limit,
            limit,
            "limit",
            {
                "context_window": ("context_window", context_window),
                "model": ("model", model),
                "gpu": ("gpu", gpu),
                "concurrency": ("concurrency", concurrency),
                "runtime": ("runtime", runtime),
                "kv_dtype": ("kv_dtype", kv_dtype),
            },
        )
        self.model, self.limit, self.limit_source = _resolve_limit(self.limit_config)
        self.policy = resolve_policy(policy, self.model.name if self.model else self.name)
        self.pipeline = self.policy.pipeline()
        self.summarizer = summarizer
        if isinstance(conversations, bool) or not isinstance(conversations, int) or conversations < 1:
            raise ConfigurationError(
                f"conversations must be a whole number >= 1 (the sessions a keeper remembers), got {conversations!r}"
            )
        self.conversations = conversations
        self._sessions = Sessions(self.counter, conversations)
        self.last_fit: Fit | None = None  # the latest fit of any conversation
        # Wrapped calls (see wrap): what they share, made on first use.
        given = admission if isinstance(admission, Admission) else None
        self.admission_config = merged(
            Admission,
            given,
            "admission",
            {
                "mode": ("admission", "wait" if given is not None else admission),
                "timeout": ("admission_timeout", admission_timeout),
                "capacity": ("kv_capacity", kv_capacity),
                "ledger": ("ledger", ledger),
                "pool": ("ledger_pool", ledger_pool),
                "unavailable": ("ledger_unavailable", ledger_unavailable),
            },
        )
        self.sharing_config = merged(
            Sharing,
            sharing,
            "sharing",
            {"state": ("shared", shared), "unavailable": ("shared_unavailable", shared_unavailable)},
        ).resolved(self.admission_config)
        self.recording_config = merged(
            Recording,
            recording,
            "recording",
            {"transcript": ("transcript", transcript), "monitor": ("monitor", monitor)},
        )
        self._shared_spec: Any = self.sharing_config.state
        self._shared_unavailable = self.sharing_config.unavailable or self.admission_config.unavailable
        self._shared: Any = None
        self._shared_lock = threading.Lock()
        self.gpu, self.concurrency = self.limit_config.gpu, self.limit_config.concurrency
        self.runtime, self.kv_dtype = self.limit_config.runtime, self.limit_config.kv_dtype
        self.monitor = self.recording_config.monitor
        self.last_call: Any = None
        self._calls: Any = None
        self._calls_lock = threading.Lock()  # threads that wrap at the same moment get the same call state

    def fresh(self) -> ContextKeeper:
        """The same keeper (counter, limit, policy, summarizer) without memory of earlier fits: the next fit is
        computed from scratch, whatever this keeper fitted before."""
        clone = copy.copy(self)
        clone._sessions = Sessions(self.counter, self.conversations)
        clone.last_fit = None
        clone.last_call = None
        clone._calls = None
        clone._calls_lock = threading.Lock()
        return clone

    @staticmethod
    def _counter(
        tokenizer: Any,
        chat_template: str | None,
        limits: TemplateLimits | None,
        server: str | None,
        auto: bool = False,
    ) -> TokenCounter:
        named = None if auto else server
        if isinstance(tokenizer, str):
            return load_counter(tokenizer, chat_template=chat_template, template_limits=limits, server=named)
        if hasattr(tokenizer, "apply_chat_template"):
            from .tokens import HFChatTemplateCounter

            return HFChatTemplateCounter(tokenizer, chat_template=chat_template, template_limits=limits, server=named)
        if callable(getattr(tokenizer, "count", None)):
            if chat_template is not None or limits is not None or server is not None:
                raise ConfigurationError(
                    "chat_template=, template_limits= and server= apply when the keeper builds the counter; this "
                    "tokenizer is a ready counter. Fix: pass them to the counter itself (load_counter(..., "
                    "chat_template=..., template_limits=..., server=...)) or pass the tokenizer instead"
                )
            return tokenizer  # type: ignore[no-any-return]
        raise ConfigurationError(
            "tokenizer must be a spec string, a transformers tokenizer or a TokenCounter, got "
            f"{type(tokenizer).__name__}"
        )

    # ------------------------------------------------------------------------------------------ fit
    def fit(
        self,
        messages: Sequence[MessageLike],
        *,
        tools: Sequence[Any] | None = None,
        max_tokens: int | None = None,
        reserve: Reserve | None = None,
        conversation: str | None = None,
    ) -> Fit:
        """The longest prompt that fits with ``max_tokens`` reserved for the answer, keeping what matters.
        ``reserve``: tokens to keep free beyond the answer, and why (wrapped calls pass what they learned).
        ``conversation``: which chat this is (default: one implicit conversation). Each conversation has its
        own session, so a turn of one costs what it costs alone, whatever other chats the keeper fits between;
        fits of different conversations run in parallel."""
        started = time.perf_counter()
        if conversation is not None and (not isinstance(conversation, str) or not conversation):
            raise ConfigurationError(
                f"conversation must be a non-empty string naming the chat, got {conversation!r}. Fix: pass an id "
                "such as conversation='user-42', or leave it out for the keeper's one default conversation"
            )
        session = self._sessions.get(conversation or DEFAULT_CONVERSATION)
        with session.lock:
            budget = Budget.of(
                self.limit,
                self.limit_source,
                max_tokens=max_tokens,
                policy=self.policy.name,
                policy_answer=self.policy.answer_tokens,
                reserve=reserve if reserve is not None else Reserve(),
            )
            ask = engine.Ask.of(session, messages, tools, budget, started)
            backend = self._backend()
            setup = engine.Setup(
                pipeline=self.pipeline,
                horizon=self.policy.horizon,
                policy=self.policy.name,
                backend=backend,
                shared=self.shared if backend is not None else None,
            )
            fit = engine.fit(setup, session, ask)
            session.last_fit = fit
        self.last_fit = fit
        return fit

    def sessions(self) -> list[str]:
        """The conversations this keeper remembers, the least recently fitted first."""
        return self._sessions.names()

    def forget(self, conversation: str | None = None) -> bool:
        """Drop what the keeper remembers of ``conversation`` (default: the default one); True if it had any."""
        return self._sessions.drop(conversation or DEFAULT_CONVERSATION)

    @property
    def shared(self) -> Any:
        """What replicas learn once, in Redis (a :class:`~.calls.shared.SharedState`; None: this process
        only). Connected on first use; unreachable, it is a :class:`SharedUnavailable` error, or with
        ``shared_unavailable="local"`` a warning and None."""
        if self._shared_spec is None or self._shared is not None:
            return self._shared
        with self._shared_lock:
            if self._shared is None and self._shared_spec is not None:
                from .calls.shared import SharedState, SharedUnavailable

                spec = self._shared_spec
                try:
                    self._shared = (
                        spec
                        if isinstance(spec, SharedState)
                        else SharedState(spec, unavailable=self._shared_unavailable)
                    )
                except SharedUnavailable as error:
                    if self._shared_unavailable == "fail":
                        raise
                    warnings.warn(
                        f"{error}. shared_unavailable='local': this process learns on its own until it is restarted",
                        UserWarning,
                        stacklevel=3,
                    )
                    self._shared_spec = None
        return self._shared

    def _backend(self) -> Any:
        if self.summarizer is None:
            return None
        summarizer = self.summarizer

        def call(request: LLMCall) -> str:
            reply = summarizer(request)
            if inspect.isawaitable(reply):  # an async summarizer, reached from a wrapped async call's worker thread
                from .calls.loop import CALLER_LOOP

                loop = CALLER_LOOP.get()
                if loop is None:
                    return str(asyncio.run(_awaited(reply)))
                return str(asyncio.run_coroutine_threadsafe(_awaited(reply), loop).result())
            return str(reply)

        return call

    def count(self, messages: Sequence[MessageLike], *, tools: Sequence[Any] | None = None) -> int:
        """The exact prompt tokens of ``messages`` as given (no fitting)."""
        return int(self.counter.count(messages, tools=list(tools) if tools else None))

    # ------------------------------------------------------------------------------------ wrapped calls
    def calibrate(self, target: Any, *, timeout: float = 10.0) -> Calibration:
        """Compare this keeper's counts with a running server's on probe conversations, each aimed at one rule
        where servers differ (``target``: an openai client or the server's URL; llama.cpp's llama-server, which
        renders and tokenizes on request). Every difference comes with the rule that explains it."""
        return calibrate(self.counter, target, timeout=timeout)

    @overload
    def wrap(self, client: openai.OpenAI | openai.AsyncOpenAI, **options: Any) -> WrappedOpenAI: ...
    @overload
    def wrap(self, client: Any, **options: Any) -> Any: ...

    def wrap(self, client: Any, **options: Any) -> Any:
        """``client`` with its own call shape, every call fitted first: an ``openai.OpenAI`` / ``AsyncOpenAI``
        (``client.chat.completions.create(...)``, streams included), a transformers model (with
        ``tokenizer=...``) or text-generation pipeline, or a callable ``fn(messages, **kwargs)``, sync or async.
        The client itself is never patched. Options: ``attempts`` (calls per request, default 4), ``backoff``
        (seconds before the first transport retry), ``conversation`` (the transcript key)."""
        from .backends import wrap

        if self._auto and self.detection is None and hasattr(client, "base_url"):
            self._adopt(client)
        return wrap(self, client, **options)

    def _adopt(self, client: Any) -> None:
        """Ask the server behind ``client`` which it is (once), and count with its dialect from now on."""
        from .servers.detection import Detection, DetectionWarning, detect_server

        shared = self.shared
        url = str(client.base_url)
        known = shared.detection(url) if shared is not None else None
        if known is not None:
            found = Detection(**{**known, "asked": tuple(known.get("asked", ())), "evidence": known["evidence"]})
        else:
            try:
                found = detect_server(client)
            except TransportError as error:
                found = Detection(url=url, server=None, evidence=str(error))
            if shared is not None and found.server is not None:
                shared.remember_detection(url, dataclasses.asdict(found))
        self.detection = found
        if found.server is None:
            warnings.warn(
                f"server='auto': could not tell which server answers at {found.url} ({found.evidence}; asked "
                f"{', '.join(found.asked) or 'nothing'}); counting with vLLM's preprocessing. Fix: "
                f"ContextKeeper(..., server=one of {', '.join(DIALECTS)})",
                DetectionWarning,
                stacklevel=3,
            )
            return
        if found.server == self.server.name:
            return
        try:
            counter = self._counter(*self._build, found.server)
        except ConfigurationError as error:  # e.g. a Mistral tokenizer behind llama.cpp's Jinja templates
            warnings.warn(
                f"server='auto' found {found.server} ({found.evidence}) but the keeper cannot count its way: {error}",
                DetectionWarning,
                stacklevel=3,
            )
            return
        log.info("server='auto': %s at %s (%s)", found.server, found.url, found.evidence)
        self.counter = counter
        self.server = getattr(counter, "dialect", None) or dialect_of(found.server)
        self._sessions = Sessions(self.counter, self.conversations)  # counts made the old way are not reused

    def session(self, conversation: str | None = None) -> Session:
        """The session of ``conversation`` (made when new): what its fits leave for the next."""
        return self._sessions.get(conversation or DEFAULT_CONVERSATION)

    @property
    def calls(self) -> Calls:
        """What this keeper's wrapped calls share (a :class:`~contextkeeper.calls.loop.Calls`: the ledger, the
        transcript, what each server taught), made on first use."""
        calls: Calls | None = self._calls
        if calls is None:
            with self._calls_lock:
                calls = self._calls if self._calls is not None else self._make_calls()
        return calls

    def _recorded_fit(self, fit: Fit) -> None:
        self.last_fit = fit

    def _recorded_call(self, report: Any) -> None:
        self.last_call = report

    def _make_calls(self) -> Calls:
        from .calls.ledger import capacity_from_plan
        from .calls.loop import Calls, Hooks
        from .calls.transcript import open_transcript

        capacity = self.admission_config.capacity
        source = "kv_capacity" if capacity is not None else None
        if capacity is None and self.model is not None and self.gpu is not None:
            capacity = capacity_from_plan(
                self.model, self.gpu, concurrency=self.concurrency, runtime=self.runtime, kv_dtype=self.kv_dtype
            )
            source = "planned"
        ledger, shared = self._ledger(capacity, source), self.shared
        calls = Calls(
            keeper=self,
            hooks=Hooks(fit=(self._recorded_fit,), report=(self._recorded_call,)),
            ledger=ledger,
            transcript=open_transcript(self.recording_config.transcript),
            shared=shared,
            facts_ledger=ledger if _reads_facts(ledger, shared) else None,
        )
        self._calls = calls
        return calls

    def _ledger(self, capacity: int | None, source: str | None) -> Any:
        """The KV ledger of wrapped calls: this process's, or the pool's in Redis (``ledger=``)."""
        from .calls.ledger import Ledger

        settings = self.admission_config
        if settings.ledger is not None:
            from .calls.redis_ledger import LedgerUnavailable, RedisLedger

            try:
                return RedisLedger(
                    settings.ledger,
                    capacity,
                    pool=settings.pool,
                    mode=settings.mode,
                    timeout=settings.timeout,
                    source=source,
                )
            except LedgerUnavailable as error:
                if settings.unavailable == "fail":
                    raise
                warnings.warn(
                    f"{error}. ledger_unavailable='local': this process admits per process, against the whole "
                    "capacity, until it is restarted",
                    UserWarning,
                    stacklevel=4,
                )
        return Ledger(capacity, mode=settings.mode, timeout=settings.timeout, source=source)

    @property
    def transcript(self) -> Any:
        """Everything wrapped calls sent and received, and what each fit dropped or rewrote."""
        return self.calls.transcript

    @property
    def ledger(self) -> Any:
        """The active tokens of wrapped calls in flight (admission against the GPU's KV capacity)."""
        return self.calls.ledger

    def kv_bytes(self, tokens: int) -> tuple[int | None, float | None]:
        """The KV cache ``tokens`` take for one sequence on the keeper's runtime, and their share of the GPU's KV
        capacity (None without a model, or without a GPU for the share)."""
        if self.model is None:
            return None, None
        from .memory import kv_report

        size = kv_report(self.model, tokens, runtime=self.runtime, kv_dtype=self.kv_dtype).bytes
        ledger = self._calls.ledger if self._calls is not None else None
        capacity = ledger.capacity if ledger is not None else None
        return size, (tokens / capacity if capacity else None)

    def close(self) -> None:
        """Close the transcript (a SQLite file keeps everything recorded) and the shared state's connection."""
        if self._calls is not None and self._calls.transcript is not None:
            self._calls.transcript.close()
        if self._shared is not None:
            self._shared.close()

    def __enter__(self) -> ContextKeeper:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
