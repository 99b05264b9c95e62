"""A call's transcript entry: the caller's inputs, the fitted prompt, the reply, what the prompt left out or changed
(``diff_prompt``), made by ``make_entry``; messages as plain dicts in the caller's key order."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import time as _time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..._exceptions import ContextKeeperError, MessageError
from ...messages import MAX_DEPTH, Message
from ...messages.guard import find_problem

__all__ = ["DEFAULT_MEMORY_BYTES", "INTERRUPTED", "TranscriptEntry", "diff_prompt", "make_entry"]


log = logging.getLogger("contextkeeper")

Indices = tuple[int, ...]

# Messages serialized between two voluntary releases of the GIL (see Transcript._serialize_ahead).
_YIELD_EVERY = 32

# Messages serialized before a write takes the lock, by id: (the message, its JSON, the JSON's digest, a snapshot,
# the snapshot's bytes).
Prepared = dict[int, Any]

_COMPARED = -1  # Prepared's key for the lane state compared ahead and how much of it matched

Status = Literal["ok", "failed", "pending", "interrupted", "refused"]

#: The error of a call that was started (its inputs stored) by a process that ended before the call did.
INTERRUPTED = "interrupted: the process ended before the reply"

#: The bound of the default transcript (``transcript=None``: in memory) in bytes; past it the least recently used
#: conversations are evicted whole. Stores given explicitly keep what they are given.
DEFAULT_MEMORY_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True, kw_only=True)
class TranscriptEntry:
    """One wrapped call. ``inputs`` is the caller's full list, ``sent`` the fitted prompt (plain dicts);
    ``dropped`` / ``rewritten`` index into ``inputs``. ``call`` is assigned by the transcript (0 until
    recorded). ``status``: ``"ok"``; ``"failed"`` (``error`` says why; ``received`` holds what arrived before
    the failure, e.g. a stream cut mid-way, or None); ``"pending"`` (started, not ended yet: only the inputs are
    known); ``"interrupted"`` (started by a process that ended before the call did; ``error`` is
    :data:`INTERRUPTED`); ``"refused"`` (refused by our own checks before anything was sent, see
    :meth:`Transcript.refuse`: ``error`` says why, ``report["refused"]`` its sizes, and the inputs are not kept)."""

    call: int = 0
    conversation: str = "default"
    time: float = 0.0
    inputs: tuple[dict[str, Any], ...] = ()
    sent: tuple[dict[str, Any], ...] = ()
    tools: tuple[dict[str, Any], ...] | None = None
    received: dict[str, Any] | None = None
    dropped: Indices = ()
    rewritten: Indices = ()
    actions: tuple[dict[str, Any], ...] = ()
    report: dict[str, Any] = dataclasses.field(default_factory=dict)
    usage: dict[str, Any] | None = None
    error: str | None = None
    attempts: int = 1
    status: Status = "ok"

    @property
    def removed(self) -> Indices:
        """Inputs not in the prompt as given: dropped or rewritten, in order."""
        return tuple(sorted({*self.dropped, *self.rewritten}))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _plain(message: Any) -> dict[str, Any]:
    """A message (or reply) as a plain dict: dicts as they are, anything else through :class:`Message`."""
    if type(message) is dict:
        return message
    if isinstance(message, Mapping):
        return dict(message)
    if isinstance(message, Message):
        return message.to_dict()
    try:
        return Message.from_dict(message).to_dict()
    except ContextKeeperError:
        dump = getattr(message, "model_dump", None)  # a reply the message model refuses: keep what it says
        if callable(dump):
            data = dump()
            if isinstance(data, dict):
                return data
        return {"content": str(message)}


def _plains(messages: Sequence[Any]) -> tuple[dict[str, Any], ...]:
    if set(map(type, messages)) <= {dict}:
        return tuple(messages)
    return tuple(_plain(m) for m in messages)


def _plain_value(value: Any) -> dict[str, Any] | None:
    """Usage and similar objects as plain dicts."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        return dict(value)
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        data = dump()
        if isinstance(data, dict):
            return data
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return {"value": str(value)}


def _default(value: Any) -> Any:
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return dump()
    if isinstance(value, (tuple, set, frozenset)):
        return list(value)
    return str(value)


def _serial(value: Any) -> str:
    """Compact JSON in the value's own key order (what is stored, and hashed: two dicts equal but for their key
    order are two blobs, each read back in its own order). The caller's data is checked first, in one pass over
    its containers: written ahead of any fit, it must not hang ``json.dumps`` (a list shared many times over
    writes out 2**depth times) or reach the file as text SQLite cannot encode."""
    if isinstance(value, (dict, list)):
        problem = find_problem(value, MAX_DEPTH)
        if problem is not None:
            where, what, fix = problem
            raise MessageError(f"cannot record this call: {where}: {what}", fix=fix)
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=_default)


def _same(a: Any, b: Any) -> bool:
    """``a == b`` with dict keys in the same order at every depth."""
    return a == b and _same_order(a, b)


def _same_order(a: Any, b: Any) -> bool:
    # Called on equal values only, so the shapes match; containers of scalars end the walk at once.
    if isinstance(a, Mapping):
        if list(a) != list(b):
            return False
        return all(_same_order(v, b[k]) for k, v in a.items() if isinstance(v, (Mapping, list, tuple)))
    if isinstance(a, (list, tuple)):
        return all(_same_order(x, y) for x, y in zip(a, b, strict=False) if isinstance(x, (Mapping, list, tuple)))
    return True


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).hexdigest()


def _key(message: dict[str, Any]) -> tuple[Any, ...]:
    """What a rewrite keeps of its source: a tool result its call id, a tool-calling assistant its call ids,
    any other message its role."""
    role = message.get("role")
    if role == "tool" and message.get("tool_call_id") is not None:
        return ("tool", message["tool_call_id"])
    calls = message.get("tool_calls")
    if role == "assistant" and calls:
        ids = tuple(c.get("id") if isinstance(c, Mapping) else getattr(c, "id", None) for c in calls)
        return ("calls", ids)
    return ("role", role)


def _is_summary(message: dict[str, Any]) -> bool:
    from ...strategies.summarize import SUMMARY_PREFIX

    content = message.get("content")
    return message.get("role") == "user" and isinstance(content, str) and content.startswith(SUMMARY_PREFIX)


def _is_ack(message: dict[str, Any]) -> bool:
    from ...strategies.summarize import ACKNOWLEDGEMENT

    return message.get("role") == "assistant" and message.get("content") == ACKNOWLEDGEMENT


def diff_prompt(inputs: Sequence[Any], sent: Sequence[Any], *, unread: int = 0) -> tuple[Indices, Indices, Indices]:
    """``(kept, dropped, rewritten)``: indices of ``inputs`` that are in the prompt ``sent`` verbatim, that it
    left out, and that it carries in a changed form.

    ``kept`` is a monotone matching (a fit keeps order): identical objects first (a fit hands unchanged dicts
    back as the caller's own), then equal messages between those anchors. Of the rest, an input is
    ``rewritten`` when a changed prompt message in the same gap stands for it: a tool result with its
    ``tool_call_id``, an assistant with its tool call ids, or the nearest message of its role (matched from
    the end of the gap, since a fit drops the oldest first). Inputs a verified summary replaced count as
    rewritten (their content lives on in it), except the ``unread`` oldest history messages, which a fit
    drops beyond its horizon without reading. Everything else is ``dropped``.
    """
    n = len(inputs)
    pin, pout = _lazy_plain(inputs), _lazy_plain(sent)
    match = _identity_matches(inputs, sent)  # sent index -> input index
    anchors = [(-1, -1), *sorted((i, j) for j, i in match.items()), (n, len(sent))]
    gaps = [(range(i0 + 1, i1), range(j0 + 1, j1)) for (i0, j0), (i1, j1) in itertools.pairwise(anchors)]
    for in_gap, out_gap in gaps:
        _match_equal(in_gap, out_gap, match, pin, pout)
    kept = set(match.values())
    never_read = _never_read(pin, n, unread)
    rewritten: set[int] = set()
    for in_gap, out_gap in gaps:
        rewritten |= _rewritten_in_gap(in_gap, out_gap, match, kept, pin, pout, never_read)
    dropped = tuple(sorted(set(range(n)) - kept - rewritten))
    return tuple(sorted(kept)), dropped, tuple(sorted(rewritten))


def _lazy_plain(messages: Sequence[Any]) -> Callable[[int], dict[str, Any]]:
    """``_plain(messages[i])``, made on first use and kept: a long chat is mostly matched by identity, unread."""
    plains: dict[int, dict[str, Any]] = {}

    def plain(i: int) -> dict[str, Any]:
        if i not in plains:
            plains[i] = _plain(messages[i])
        return plains[i]

    return plain


def _identity_matches(inputs: Sequence[Any], sent: Sequence[Any]) -> dict[int, int]:
    """``sent`` index -> ``inputs`` index of the very same object, in order: the anchors of the diff."""
    match: dict[int, int] = {}
    last = -1
    unique = dict(zip(map(id, inputs), range(len(inputs)), strict=True))  # at C speed: a long chat is mostly kept
    if len(unique) == len(inputs):
        for j, message in enumerate(sent):
            found = unique.get(id(message))
            if found is not None and found > last:
                match[j] = last = found
        return match
    by_id: dict[int, list[int]] = {}  # the caller put one object in its list twice
    for i, message in enumerate(inputs):
        by_id.setdefault(id(message), []).append(i)
    for j, message in enumerate(sent):
        found = next((c for c in by_id.get(id(message), ()) if c > last), None)
        if found is not None:
            match[j] = last = found
    return match


def _match_equal(
    in_gap: range,
    out_gap: range,
    match: dict[int, int],
    pin: Callable[[int], dict[str, Any]],
    pout: Callable[[int], dict[str, Any]],
) -> None:
    """Add to ``match`` the equal messages of one gap between anchors, in order."""
    pointer = in_gap.start
    for j in out_gap:
        equal = next((i for i in range(pointer, in_gap.stop) if pin(i) == pout(j)), None)
        if equal is not None:
            match[j] = equal
            pointer = equal + 1


def _never_read(pin: Callable[[int], dict[str, Any]], n: int, unread: int) -> range:
    """The ``unread`` oldest history inputs (after the leading system messages)."""
    system_end = 0
    while system_end < n and pin(system_end).get("role") in ("system", "developer"):
        system_end += 1
    return range(system_end, system_end + max(0, unread))


def _rewritten_in_gap(
    in_gap: range,
    out_gap: range,
    match: dict[int, int],
    kept: set[int],
    pin: Callable[[int], dict[str, Any]],
    pout: Callable[[int], dict[str, Any]],
    never_read: range,
) -> set[int]:
    """The inputs of one gap that its changed prompt messages stand for (see :func:`diff_prompt`)."""
    changed = [j for j in out_gap if j not in match]
    if not changed:
        return set()  # a gap of inputs the prompt does not hold in any form: dropped
    free_in = [i for i in in_gap if i not in kept]
    if not free_in:
        return set()
    rewritten: set[int] = set()
    summarised = False
    pointer = len(free_in)
    for j in reversed(changed):
        message = pout(j)
        if _is_summary(message):
            summarised = True
            continue
        if _is_ack(message) and j > 0 and _is_summary(pout(j - 1)):
            continue  # the summary's acknowledgement stands for no input of its own
        found = _nearest(_key(message), free_in, pointer, pin)
        if found is not None:
            rewritten.add(free_in[found])
            pointer = found
    if summarised:
        rewritten.update(i for i in free_in[:pointer] if i not in never_read)
    return rewritten


def _nearest(key: tuple[Any, ...], free_in: list[int], stop: int, pin: Callable[[int], dict[str, Any]]) -> int | None:
    """The last position before ``stop`` in ``free_in`` whose input has ``key`` (a fit drops the oldest first)."""
    return next((p for p in range(stop - 1, -1, -1) if _key(pin(free_in[p])) == key), None)


def make_entry(
    inputs: Sequence[Any],
    fit: Any = None,
    *,
    conversation: str = "default",
    tools: Sequence[Any] | None = None,
    received: Any = None,
    usage: Any = None,
    error: str | BaseException | None = None,
    attempts: int = 1,
    sent: Sequence[Any] | None = None,
    time: float | None = None,
) -> TranscriptEntry:
    """The entry for one call: ``inputs`` the caller's list, ``fit`` the :class:`~contextkeeper.keeper.Fit`
    whose prompt was sent (None: the call failed before a prompt was made). ``sent`` overrides
    ``fit.messages`` (the prompt of the last attempt, after a retry shrank it). The entry refers to the
    caller's dicts; the transcript copies them when it records the entry."""
    report = fit.report if fit is not None else None
    prompt = list(sent) if sent is not None else (list(fit.messages) if fit is not None else [])
    if fit is None and sent is None:
        dropped: Indices = ()
        rewritten: Indices = ()
    else:
        unread = int(getattr(report, "unread", 0) or 0)
        _, dropped, rewritten = diff_prompt(inputs, prompt, unread=unread)
    report_dict: dict[str, Any] = report.to_dict() if report is not None else {}
    return TranscriptEntry(
        conversation=conversation,
        time=_time.time() if time is None else time,
        inputs=_plains(inputs),
        sent=_plains(prompt),
        tools=tuple(_plain_value(t) or {} for t in tools) if tools else None,
        received=_plain(received) if received is not None else None,
        dropped=dropped,
        rewritten=rewritten,
        actions=tuple(report_dict.get("actions", ())),
        report=report_dict,
        usage=_plain_value(usage),
        error=None if error is None else (error if isinstance(error, str) else f"{type(error).__name__}: {error}"),
        attempts=attempts,
        status="ok" if error is None else "failed",
    )
