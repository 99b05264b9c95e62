"""Replace the oldest history with a model-written summary, and keep it only once it is verified.

The strategy asks the summarizer backend (through :class:`LLMCall`) to summarise the oldest units, then checks
the reply: every fact extracted from the sources (numbers, ids, names, constraints, open tasks; see
:mod:`._facts`) must be in it and, when the step asks for the meaning check (``embeddings = true`` or an
``embedding_model``), it must stay close in meaning to the sources. A reply that fails is sent back with the
missing items named, a bounded number of times; a backend error counts as a failed attempt. The bound holds per
fit (per ``FitState.turn``): the keeper may re-read history within one fit, and the calls of all its reads
count together. When no attempt passes, the history is returned unchanged with an action
saying so, and later strategies (the sliding window) take over: sources are never dropped here unless a
verified summary replaces them.

The summary goes in as two units, a user message ``"Summary of the earlier conversation:\\n..."`` and an
assistant ``"Understood."``, so user/assistant alternation holds for strict templates. A later fit recognises
that pair at the start of the history by its exact prefix and rolls forward: the old summary is one of the
sources of the new one. Verified summaries are cached in the conversation's memory (``_Summaries``) by a hash of their
source units, so the same sources never cost a second model call; when the caller sends its full history again
(one more turn on it), the summary of the unchanged prefix is found there and reused without a call as long as
the prompt fits with it, and otherwise becomes the previous summary that the next call rolls forward.

Across processes (``ContextKeeper(shared="redis://...")``, ``state.shared``), verified summaries are also stored
in Redis under the same hashes, and a per-conversation lease decides who writes one: a process that finds the
lease taken waits for that summary (``summary_wait``) and takes it, or fits without a summary when the wait runs
out. Sources summarised once are summarised once, whichever replica fits them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import Field, model_validator

from ..messages import Message
from ._embeddings import load_in_fit
from ._facts import ALL_KINDS, Fact, Source, extract, missing
from .base import Action, FitState, Item, Items, LLMCall, Step, StrategySettings, register

__all__ = ["ACKNOWLEDGEMENT", "SUMMARY_PREFIX", "SYSTEM_PROMPT", "Summarize"]

SUMMARY_PREFIX = "Summary of the earlier conversation:\n"
ACKNOWLEDGEMENT = "Understood."

SYSTEM_PROMPT = """\
You summarise the earlier part of a conversation between a user and an AI assistant. Your summary replaces \
that part: the assistant will continue from it alone, so anything you leave out is lost.

Keep, exactly as written:
- facts, numbers, amounts, dates, times and identifiers (order numbers, ids, codes, emails, URLs, file paths);
- names of people, companies, products and places;
- decisions made, and their reasons;
- every constraint or instruction (anything with must, never, always, only, do not, at most, required ...), \
as strongly worded as the original;
- unresolved tasks and questions that are still open.
Leave out greetings, filler and repetition. Use short sentences or bullet points, at most about {words} words. \
Write in the language of the transcript. If a previous summary is given, merge it in and keep everything in it \
that still holds. Answer with the summary only."""

_CHUNK_CHARS = 800  # the meaning check compares the summary with chunks this long (within a small model's window)
_CHUNKS = 32  # at most this many, spread over the transcript
_CACHE_SIZE = 64  # verified summaries kept per keeper
_CLIP_CHARS = 3000  # a tool result longer than this is clipped in the middle, in the prompt only
_CLIP_ARGUMENTS = 1000
_LISTED = 12  # missing items named in a retry instruction
_REPORTED = 4  # missing items named in a failure action

_ASSISTANT_KINDS = frozenset({"numbers", "ids", "names", "tasks"})  # no constraints: those are the user's
_ARGUMENT_KINDS = frozenset({"ids"})


@dataclass(frozen=True)
class _Outcome:
    summary: str | None  # None: no attempt passed
    note: str  # what verified it, or why it failed


@dataclass
class _Calls:
    """The summarizer calls made in one fit (one ``FitState.turn``). The keeper re-reads history up to a few
    times within a fit, and each read runs the pipeline again: kept in the keeper's memory, this bounds the
    calls of the whole fit, not of each read."""

    turn: int
    made: int = 0
    last: str = ""  # why the latest summary failed, for a later read that has no calls left

    @classmethod
    def of(cls, state: FitState) -> _Calls:
        calls = state.memory.get(cls)
        if calls is None or calls.turn != state.turn:
            calls = state.memory.put(cls(state.turn))
        return calls


@register("summarize")
class Summarize(StrategySettings):
    """Summarise the oldest history units with the summarizer backend; keep the summary only once verified.

    ``keep_recent``: newest units never summarised. ``max_summary_tokens``: the answer budget of each call.
    ``retries``: attempts after the first; one fit makes at most ``1 + retries`` calls. ``min_units``: fewer new
    units than this are not worth a call. ``embeddings``/``embedding_model``/``similarity_threshold``: the
    meaning check, only when asked for (``embedding_model``, a local sentence-transformers folder, implies it;
    unset: the bundled all-MiniLM-L6-v2). Loading the model imports torch: seconds, once per process.
    """

    name: ClassVar[str] = "summarize"
    needs_backend: ClassVar[bool] = True  # the keeper skips this step when no summarizer is set
    # It turns history that does not fit into a summary, so the keeper reads beyond what fits as it is.
    reads_beyond: ClassVar[bool] = True

    keep_recent: int = Field(default=4, ge=0)
    max_summary_tokens: int = Field(default=512, ge=1)
    retries: int = Field(default=2, ge=0)
    min_units: int = Field(default=2, ge=1)
    similarity_threshold: float = Field(default=0.35, ge=-1, le=1)
    embeddings: bool = False
    embedding_model: str | None = Field(
        default=None, json_schema_extra={"allowed": "the path of a local sentence-transformers folder"}
    )

    @model_validator(mode="after")
    def _check_embeddings(self) -> Summarize:
        if self.embedding_model is not None and not self.embeddings and "embeddings" in self.model_fields_set:
            raise ValueError(
                f"embedding_model = {self.embedding_model!r} with embeddings = false: leave embeddings out, or the "
                "model"
            )
        return self

    @property
    def uses_embeddings(self) -> bool:
        """Whether a verified summary must also pass the meaning check (which loads an embedding model)."""
        return self.embeddings or self.embedding_model is not None

    # ------------------------------------------------------------------------------------------- apply

    def apply(self, state: FitState) -> Step:
        history = state.history
        block = _summary_block(history)
        cut = self._cut(history, block)
        if cut - block < self.min_units:
            return state
        before = state.tokens()
        keys = _prefix_keys(history, cut)
        cache = _cache(state)
        share = state.shared
        if share is not None and keys[cut] not in cache:
            # Another process may have summarised these sources (or a shorter prefix): one look for all of them.
            for source, text in share.find([keys[b] for b in range(cut, block, -1)]).items():
                if source not in cache:
                    _store(cache, source, _Entry.make(text))
        cached = next((b for b in range(cut, block, -1) if keys[b] in cache), None)
        if cached is not None:
            # A cached summary of a shorter prefix costs no call: take it when it covers the whole cut, when too
            # few units follow it to be worth a call, or when the prompt fits with it.
            entry = cache[keys[cached]]
            if (
                cached == cut
                or cut - cached < self.min_units
                or state.count(entry.history(state, cached)) <= state.limit
            ):
                return self._replace(state, cached, entry, before, "reused the cached summary")

        if cached is not None:
            previous: str | None = cache[keys[cached]].summary
            start = cached
        else:
            previous = _summary_text(history[0]) if block else None
            start = block
        claim = share.claim(keys[cut]) if share is not None else None
        if isinstance(claim, str):  # another process summarised the same sources while this one waited
            entry = _Entry.make(claim)
            _store(cache, keys[cut], entry)
            return self._replace(state, cut, entry, before, "written by another process of this conversation")
        if share is not None and claim is None:
            waited = share.shared.summary_wait
            outcome = _Outcome(None, f"was left to another process holding this conversation (waited {waited:g} s)")
        else:
            try:
                outcome = yield from self._attempts(state, previous, history, start, cut)
                if outcome.summary is not None and share is not None:
                    share.store(keys[cut], outcome.summary)
            finally:
                if claim is not None:
                    claim.release()
        if outcome.summary is not None:
            entry = _Entry.make(outcome.summary)
            _store(cache, keys[cut], entry)
            return self._replace(state, cut, entry, before, outcome.note)
        failure = f"summary of {cut} units {outcome.note}"
        if cached is not None:
            # The newer units failed; the older ones still have a verified summary, which beats dropping them.
            note = f"{failure}; reused the cached summary of the first {cached} units instead"
            return self._replace(state, cached, cache[keys[cached]], before, note)
        return state.with_history(
            history, Action(strategy=self.name, detail=f"{failure}; history unchanged", saved=0, units=0)
        )

    def _cut(self, history: tuple[Items, ...], block: int) -> int:
        """How many leading units to replace: all but ``keep_recent``, ending before a user unit.

        The largest such boundary that still leaves ``min_units`` new units wins; when there is none (a long
        agent run after one user message), the cut falls before an assistant unit and the summary goes in as
        a single user message, which keeps alternation just the same.
        """
        end = len(history) - self.keep_recent
        if end - block < self.min_units:
            return block
        for k in range(end, block, -1):
            if k - block < self.min_units:
                break
            if k == len(history) or _role(history[k]) == "user":
                return k
        return end

    def _replace(self, state: FitState, cut: int, entry: _Entry, before: int, note: str) -> FitState:
        history = entry.history(state, cut)
        after = state.count(history)
        if after >= before:
            detail = f"summary of {cut} units would not save tokens ({after} vs {before}); history unchanged"
            return state.with_history(state.history, Action(strategy=self.name, detail=detail))
        detail = f"replaced {cut} units with a summary ({note}); {before} -> {after} tokens"
        return state.with_history(history, Action(strategy=self.name, detail=detail, saved=before - after, units=cut))

    # ---------------------------------------------------------------------------------------- attempts

    def _attempts(
        self, state: FitState, previous: str | None, history: tuple[Items, ...], start: int, cut: int
    ) -> Generator[LLMCall, str, _Outcome]:
        """Ask for the summary of ``previous`` + ``history[start:cut]`` until one passes verification, within
        the calls this fit has left."""
        calls = _Calls.of(state)
        attempts = 1 + self.retries - calls.made
        if attempts <= 0:
            there = f"; there the summary {calls.last}" if calls.last else ""
            return _Outcome(
                None,
                f"was not attempted: an earlier read of this fit's history made the {calls.made} summarizer "
                f"call(s) that retries = {self.retries} allows{there}",
            )
        outcome = yield from self._ask(state, calls, attempts, previous, history, start, cut)
        if outcome.summary is None:
            calls.last = outcome.note
        return outcome

    def _ask(
        self,
        state: FitState,
        calls: _Calls,
        attempts: int,
        previous: str | None,
        history: tuple[Items, ...],
        start: int,
        cut: int,
    ) -> Generator[LLMCall, str, _Outcome]:
        units = history[start:cut]
        transcript = _render(previous, units)
        facts = extract(_fact_sources(previous, history, start, cut))
        base: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM_PROMPT.format(words=max(20, self.max_summary_tokens * 3 // 5))},
            {"role": "user", "content": _request(transcript, previous is not None)},
        ]
        messages = list(base)
        embedder: Any = _UNLOADED
        chunks = _meaning_chunks(previous, units)
        loading = ""
        rejected: str | None = None  # why the latest reply failed verification
        error: str | None = None  # the latest backend error
        errors = 0
        for attempt in range(1, attempts + 1):
            calls.made += 1  # counted before it is made: a call that raises is a call too
            try:
                reply = yield LLMCall(messages=tuple(messages), max_tokens=self.max_summary_tokens)
            except Exception as exc:  # a failed backend call (timeout, error) is a failed attempt
                errors += 1
                error = _error(exc)
                continue
            summary = _clean(reply)
            lacking = missing(facts, summary) if summary else facts
            if not summary:
                rejected = f"attempt {attempt}: empty reply"
                instruction = "Your reply was empty. Write the summary. Answer with the summary only."
            elif lacking:
                shown = _listing(lacking, _REPORTED)
                rejected = f"attempt {attempt} missed {len(lacking)} of {len(facts)} facts: {shown}"
                instruction = _retry_instruction(lacking)
            else:
                verified = f"verified on attempt {attempt} of {attempts}: all {len(facts)} facts kept"
                if not self.uses_embeddings:
                    return _Outcome(summary, verified)
                if embedder is _UNLOADED:
                    memory = state.memory.slot(_Embeddings)
                    embedder, loading = load_in_fit(self.embedding_model, memory, state.turn)
                if embedder is None:
                    return _Outcome(summary, f"{verified}; no meaning check: {loading}")
                similarity = _similarity(embedder, chunks, summary)
                if similarity >= self.similarity_threshold:
                    return _Outcome(summary, f"{verified}, similarity {similarity:.2f} by {embedder.name}{loading}")
                rejected = f"attempt {attempt}: similarity {similarity:.2f} < {self.similarity_threshold}"
                instruction = (
                    "Your summary does not match the transcript closely enough. Summarise only what the transcript "
                    "says, keeping its facts, names, constraints and open tasks. Answer with the summary only."
                )
            messages = [*base, {"role": "assistant", "content": str(reply)}, {"role": "user", "content": instruction}]
        if rejected is None:
            note = f"was not written: the summarizer failed all {attempts} attempts (last: {error})"
        else:
            failed = f"; {errors} summarizer call(s) failed, last: {error}" if errors else ""
            note = f"failed verification after {attempts} attempts ({rejected}{failed})"
        return _Outcome(None, note)


# ------------------------------------------------------------------------------------------ the history


def _role(unit: Items) -> str:
    return unit[0].role if unit else ""


def _summary_block(history: Sequence[Items]) -> int:
    """Units at the start of ``history`` that are a previous summary: 0, 1 (summary only) or 2 (with the
    assistant's acknowledgement)."""
    if not history or len(history[0]) != 1:
        return 0
    first = history[0][0]
    if first.role != "user" or not first.text().startswith(SUMMARY_PREFIX):
        return 0
    if len(history) > 1 and len(history[1]) == 1:
        second = history[1][0]
        if second.role == "assistant" and second.text() == ACKNOWLEDGEMENT and not second.message.tool_calls:
            return 2
    return 1


def _summary_text(unit: Items) -> str:
    return unit[0].text()[len(SUMMARY_PREFIX) :]


_ACK: Items = (Item(Message.from_dict({"role": "assistant", "content": ACKNOWLEDGEMENT}), origin=None),)


@dataclass(frozen=True)
class _Entry:
    """A verified summary and its message, built once: the same objects in every fit, so the counter's
    caches (keyed by object identity) keep working and the units' ids are never reused while cached."""

    summary: str
    unit: Items

    @classmethod
    def make(cls, summary: str) -> _Entry:
        message = Message.from_dict({"role": "user", "content": SUMMARY_PREFIX + summary})
        return cls(summary, (Item(message, origin=None),))

    def history(self, state: FitState, cut: int) -> tuple[Items, ...]:
        """``state.history`` with its first ``cut`` units replaced by the summary and the acknowledgement (the
        summary alone when an assistant unit follows, so the roles still alternate)."""
        following = state.history[cut] if cut < len(state.history) else state.request
        head = (self.unit,) if _role(following) == "assistant" else (self.unit, _ACK)
        return head + state.history[cut:]


# ------------------------------------------------------------------------------------------------ cache


def _unit_bytes(unit: Items) -> bytes:
    """What identifies a unit's content: roles, texts, tool calls, media parts."""
    content = []
    for item in unit:
        message = item.message
        calls = [[call.name, call.arguments_as_object()] for call in message.tool_calls or ()]
        media = [part.model_dump() for part in message.media_parts()]
        content.append([message.role, item.text(), calls, media])
    return json.dumps(content, ensure_ascii=False, sort_keys=True, default=str).encode()


def _prefix_keys(history: Sequence[Items], cut: int) -> dict[int, str]:
    """``{b: hash of history[:b]}`` for b in 1..cut, so a cached summary of a shorter prefix is found too."""
    digest = hashlib.sha256(b"contextkeeper.summarize/1\n")
    keys: dict[int, str] = {}
    for index in range(cut):
        digest.update(_unit_bytes(history[index]))
        digest.update(b"\x1e")
        keys[index + 1] = digest.copy().hexdigest()
    return keys


class _Summaries(dict[str, "_Entry"]):
    """Verified summaries kept in a conversation's memory, by a hash of their sources."""


class _Embeddings(dict[str, Any]):
    """What the meaning check's embedding model cost to load in this fit (see ``load_in_fit``)."""


def _cache(state: FitState) -> dict[str, _Entry]:
    return state.memory.slot(_Summaries)


def _store(cache: dict[str, _Entry], key: str, entry: _Entry) -> None:
    cache.pop(key, None)
    cache[key] = entry
    while len(cache) > _CACHE_SIZE:
        del cache[next(iter(cache))]


# ----------------------------------------------------------------------------------------------- prompt


def _clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]} […{len(text) - 2 * half} characters omitted…] {text[-half:]}"


def _render(previous: str | None, units: Sequence[Items]) -> str:
    """The transcript as the summarizer reads it: one line per message, tool calls and results compact."""
    lines: list[str] = []
    if previous is not None:
        lines.append(f"Previous summary:\n{previous}\n")
    for unit in units:
        names: dict[str, str] = {}
        for item in unit:
            message = item.message
            text = item.text()
            media = "".join(f" [{part.type}]" for part in message.media_parts())
            if message.role == "tool":
                label = names.get(message.tool_call_id or "", message.name or "")
                header = f"Tool result ({label})" if label else "Tool result"
                lines.append(f"{header}: {_clip(text, _CLIP_CHARS)}{media}")
                continue
            role = message.role.capitalize()
            if text or media or not message.tool_calls:
                lines.append(f"{role}: {text}{media}")
            for call in message.tool_calls or ():
                if call.id is not None:
                    names[call.id] = call.name
                arguments = json.dumps(call.arguments_as_object(), ensure_ascii=False)
                lines.append(f"{role} called {call.name}({_clip(arguments, _CLIP_ARGUMENTS)})")
    return "\n".join(lines)


def _request(transcript: str, rolling: bool) -> str:
    what = "the previous summary and the transcript that follows it" if rolling else "this transcript"
    return f"Summarise {what}.\n\n<transcript>\n{transcript}\n</transcript>"


def _retry_instruction(lacking: Sequence[Fact]) -> str:
    shown = "\n".join(f"- {_describe(fact)}" for fact in lacking[:_LISTED])
    more = f"\n- and {len(lacking) - _LISTED} more" if len(lacking) > _LISTED else ""
    return (
        "Your summary leaves out these items from the transcript:\n"
        f"{shown}{more}\n"
        "Rewrite the complete summary so that it includes every one of them (numbers, identifiers and names "
        "exactly as written, constraints as strongly worded). Answer with the summary only."
    )


def _describe(fact: Fact) -> str:
    if fact.kind == "constraint":
        return f"the constraint “{fact.text}”"
    if fact.kind == "task":
        return f"the open task or question “{fact.text}”"
    return f"{fact.kind} {fact.text}"


def _listing(facts: Sequence[Fact], limit: int) -> str:
    shown = ", ".join(repr(_short(fact.text)) for fact in facts[:limit])
    return shown + (f" and {len(facts) - limit} more" if len(facts) > limit else "")


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _clean(reply: object) -> str:
    """The reply without surrounding space or a repeated summary heading."""
    text = str(reply if reply is not None else "").strip()
    for heading in (SUMMARY_PREFIX.strip(), "Summary:"):
        if text.startswith(heading):
            text = text[len(heading) :].strip()
    return text


def _error(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {_short(text, 120)}" if text else type(exc).__name__


# ----------------------------------------------------------------------------------------------- facts


def _fact_sources(previous: str | None, history: tuple[Items, ...], start: int, cut: int) -> list[Source]:
    """What the summary must keep, by role: the previous summary and user messages yield every kind; the
    assistant's text no constraints; tool call arguments only identifiers; tool results nothing (they are
    often long, and what mattered the assistant said). Questions of a user unit that no assistant text
    followed before the next user unit count as open tasks."""
    sources: list[Source] = []
    if previous is not None:
        sources.append(Source(previous))
    for index in range(start, cut):
        for item in history[index]:
            message = item.message
            text = item.text()
            if message.role == "assistant":
                sources.append(Source(text, _ASSISTANT_KINDS))
                for call in message.tool_calls or ():
                    values = _argument_values(call.arguments_as_object())
                    sources.append(Source("\n".join(values), _ARGUMENT_KINDS))
            elif message.role != "tool":
                kinds = ALL_KINDS if _answered(history, index) else ALL_KINDS | {"questions"}
                sources.append(Source(text, kinds))
    return sources


def _answered(history: tuple[Items, ...], index: int) -> bool:
    for unit in history[index + 1 :]:
        role = _role(unit)
        if role == "user":
            return False
        if role == "assistant" and any(item.role == "assistant" and item.text().strip() for item in unit):
            return True
    return False


def _argument_values(arguments: object) -> list[str]:
    """String values of tool arguments that are codes: one token with a digit or an ``@ / \\ .`` in it
    (``"ORD-4471"``, an email, a path), not prose, SQL or enum-like settings such as ``"claim_opened"``."""
    if isinstance(arguments, str):
        code = len(arguments) <= 80 and not any(char.isspace() for char in arguments)
        return [arguments] if code and any(char.isdigit() or char in "@/\\." for char in arguments) else []
    if isinstance(arguments, dict):
        return [value for item in arguments.values() for value in _argument_values(item)]
    if isinstance(arguments, list):
        return [value for item in arguments for value in _argument_values(item)]
    return []


# ---------------------------------------------------------------------------------------------- meaning

_UNLOADED: Any = object()


def _meaning_chunks(previous: str | None, units: Sequence[Items]) -> list[str]:
    """The conversation in chunks a small embedding model reads whole: what was said (previous summary, user
    and assistant text, tool calls), not tool output, which the summary is not meant to restate."""
    lines = [line for line in (previous or "").splitlines() if line.strip()]
    for line in _render(None, units).splitlines():
        if not line.startswith("Tool result") and line.strip():
            lines.append(line)
    chunks: list[str] = []
    current = ""
    for line in lines:
        while len(line) > _CHUNK_CHARS:
            chunks.append(line[:_CHUNK_CHARS])
            line = line[_CHUNK_CHARS:]
        if current and len(current) + len(line) + 1 > _CHUNK_CHARS:
            chunks.append(current)
            current = ""
        current = f"{current}\n{line}" if current else line
    if current:
        chunks.append(current)
    if len(chunks) > _CHUNKS:
        step = len(chunks) / _CHUNKS
        chunks = [chunks[int(index * step)] for index in range(_CHUNKS)]
    return chunks


def _similarity(embedder: Any, chunks: Sequence[str], summary: str) -> float:
    """Mean cosine similarity of the summary with the transcript's chunks (length-weighted)."""
    if not chunks:
        return 1.0
    total = sum(len(chunk) for chunk in chunks)
    return sum(float(embedder.similarity(chunk, summary)) * len(chunk) for chunk in chunks) / total
