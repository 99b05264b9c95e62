"""The transcript: everything each wrapped call was given, sent and received, so nothing fitting removes is lost.

A :class:`TranscriptEntry` per call holds the caller's full message list, the fitted prompt, the reply, which
inputs the prompt left out (``dropped``) or carried in a changed form (``rewritten``: pruned, truncated,
de-duplicated, summarised) and the fit's report. ``recover(call)`` gives those inputs back in their original
form; ``history(conversation)`` the whole, never-trimmed chat to resume from.

Wrapped calls write ahead: :meth:`Transcript.start` stores (and, in SQLite, commits) the caller's inputs before
anything is sent, and :meth:`Transcript.end` completes that entry with the prompt, the reply or the error. A call
whose process ended in between reads back with ``status="interrupted"``.

A call refused by our own checks before anything was sent (too large, invalid) is completed with
:meth:`Transcript.refuse`: its entry keeps the refusal (error, time, sizes) but not the inputs, and whatever its
write-ahead stored that no other entry uses is deleted (``status="refused"``; :meth:`Transcript.history` skips it).

Storage is content-addressed so a long chat costs linear space, not quadratic: every distinct message (and
tools list) is stored once under a hash of its JSON, and a call's message lists are paths in a trie of (previous
message, message) nodes, so a call that extends the previous call's list adds only its new messages. The JSON
keeps the caller's key order at every depth (a template renders keys in that order, so a replayed prompt counts
as the sent one did). Index lists are stored as runs. :class:`MemoryTranscript` keeps this in dicts (the default
store, ``open_transcript(None)``, is bounded by :data:`DEFAULT_MEMORY_BYTES` and evicts the least recently used
conversations whole); :class:`SQLiteTranscript` in a SQLite file (WAL mode) that survives restarts;
``PostgresTranscript`` (:mod:`.postgres`) in Postgres, shared by every process and replica.
Those two are the user's storage: never evicted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import os
import re
import socket
import sqlite3
import sys
import threading
import time as _time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..._exceptions import ConfigurationError, ContextKeeperError, MessageError, UnknownCall
from ..._memo import IdentityMemo, Memo, data_size
from ...messages import MAX_DEPTH, Message
from ...messages.guard import find_problem

__all__ = [
    "DEFAULT_MEMORY_BYTES",
    "INTERRUPTED",
    "URL_STORES",
    "Begun",
    "MemoryTranscript",
    "SQLiteTranscript",
    "Transcript",
    "TranscriptEntry",
    "UnknownCall",
    "check_transcript",
    "diff_prompt",
    "make_entry",
    "open_transcript",
]

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


# --------------------------------------------------------------------------------------------- plain dicts


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


# ------------------------------------------------------------------------------------------------- diff


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


# ------------------------------------------------------------------------------------------------ storage


def _runs(indices: Iterable[int]) -> list[list[int]]:
    """Sorted indices as [start, stop) runs: a sliding window drops one long run, not thousands of indices."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return runs


def _unruns(runs: Iterable[Sequence[int]]) -> Indices:
    return tuple(i for start, stop in runs for i in range(start, stop))


@dataclass(frozen=True, kw_only=True)
class _Row:
    """An entry as stored: message lists as trie nodes, other lists as blob ids or runs, the rest as JSON."""

    call: int
    conversation: str
    time: float
    inputs: int  # trie node of the last input (0: empty list)
    sent: int | None  # None: the inputs without the dropped ones (a store that derives it, see _derives_sent)
    tools: int | None  # blob id
    received: int | None
    dropped: str  # JSON runs
    rewritten: str
    report: str  # JSON (actions are report["actions"])
    usage: str | None
    error: str | None
    attempts: int
    # "begun": the inputs were stored before the call was sent; "done": it ended; "refused": refused before it was
    # sent (nothing of its inputs is stored)
    state: str = "done"
    owner: str | None = None  # the process that began it (see _owner)


@dataclass(frozen=True)
class _Gone:
    """What a store deleted (a refused call's inputs, evicted conversations): node -> (parent, blob), blob -> its
    digest (None where the store does not know it), so the caches in front of the store can forget exactly those."""

    nodes: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)
    blobs: dict[int, str | None] = dataclasses.field(default_factory=dict)


def _start_time(pid: int) -> str | None:
    """When process ``pid`` started (Linux: clock ticks since boot), or None where that cannot be read. With the
    pid it names one process even after the pid is reused (a restarted container often gets the same pid)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


_OWNERS: dict[int, str] = {}


def _owner() -> str:
    """This process, as stored with the calls it begins: host, pid and start time (or a random tag). Looked up by
    pid, so a forked child is another owner."""
    pid = os.getpid()
    owner = _OWNERS.get(pid)
    if owner is None:
        owner = _OWNERS[pid] = f"{socket.gethostname()}/{pid}/{_start_time(pid) or os.urandom(6).hex()}"
    return owner


def _running(owner: str | None) -> bool:
    """Whether the process that began a call may still be running it (unknown hosts are given the benefit)."""
    if owner is None:
        return False
    if owner == _owner():
        return True
    host, pid, started = owner.rsplit("/", 2)
    if host != socket.gethostname():
        return True
    if int(pid) == os.getpid():
        return False  # our pid, not our start: an earlier process that had this pid
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, someone else's
    except (OSError, ValueError):
        return False
    now = _start_time(int(pid))
    return now is None or now == started or not started.isdigit()


def _status(row: _Row, alive: Mapping[str, bool]) -> Status:
    """The row's status; ``alive``: :meth:`Transcript._alive` of the owners of the rows read together."""
    if row.state == "done":
        return "failed" if row.error is not None else "ok"
    if row.state == "refused":
        return "refused"
    return "pending" if row.owner is not None and alive.get(row.owner, False) else "interrupted"


def _seen_size(message: object, seen: tuple[int, object, int]) -> int:
    # The snapshot (a copy of a dict, or the message itself) and the blob id; the message held by the entry is
    # the caller's, or the snapshot.
    return seen[2] + 64


def _seen_fresh(message: object, seen: tuple[int, object, int]) -> bool:
    return _same(seen[1], message)


def _path_size(lane: str, path: tuple[tuple[object, ...], list[int], int]) -> int:
    # The snapshots (also charged in ``transcript.seen`` while it keeps them: the bound errs on the safe side),
    # the two lists, and a node id each.
    snapshots, nodes, held = path
    return sys.getsizeof(lane) + held + sys.getsizeof(snapshots) + sys.getsizeof(nodes) + 32 * len(nodes)


def _json_bytes(values: Sequence[Any]) -> int | None:
    """The UTF-8 bytes of ``values`` as the transcript stores them (each as its own JSON), or None where they do
    not serialise (only called on values a write already took)."""
    try:
        return sum(
            len(json.dumps(v, separators=(",", ":"), ensure_ascii=False, default=_default).encode()) for v in values
        )
    except (TypeError, ValueError, RecursionError):
        return None


def _kept_as_is(entry: TranscriptEntry) -> bool:
    """Whether the prompt is the inputs without the dropped ones, each kept as it was (same object, or equal with
    its keys in the same order): then a store that derives it need not store it (a sliding window's prompt is a
    new list on every call)."""
    if entry.rewritten or len(entry.sent) != len(entry.inputs) - len(entry.dropped):
        return False
    dropped = set(entry.dropped)
    kept = (m for i, m in enumerate(entry.inputs) if i not in dropped)
    return all(a is b or _same(a, b) for a, b in zip(entry.sent, kept, strict=True))


def _sent_path(row: _Row, paths: Mapping[int, list[int]]) -> list[int]:
    """The blobs of the row's prompt: stored, or derived from its inputs and what was dropped."""
    if row.sent is not None:
        return paths[row.sent]
    dropped = set(_unruns(json.loads(row.dropped)))
    return [b for i, b in enumerate(paths[row.inputs]) if i not in dropped]


class _Never:
    """Equal to nothing: the snapshot of a message that cannot be compared cheaply."""

    def __eq__(self, other: object) -> bool:
        return False

    __hash__ = object.__hash__


_NEVER = _Never()


@dataclass(eq=False)
class Begun:
    """A call whose inputs :meth:`Transcript.begin` wrote: :meth:`wait` gives its entry once they are durable."""

    transcript: Transcript = dataclasses.field(repr=False)
    pending: TranscriptEntry  # call 0 until known
    node: int = dataclasses.field(repr=False)  # the inputs' trie node
    number: Callable[[], int] = dataclasses.field(repr=False)
    entry: TranscriptEntry | None = None
    error: BaseException | None = None  # why the inputs were not stored (raised again by every wait)

    def wait(self) -> TranscriptEntry:
        """The entry, with its call number, once the inputs are committed; the store's error if they were not."""
        if self.entry is None:
            if self.error is not None:
                raise self.error
            try:
                call = self.number()
            except BaseException as error:
                self.error = error
                raise
            self.transcript._began(call, self.node)
            self.entry = dataclasses.replace(self.pending, call=call)
        return self.entry


class Transcript:
    """Where entries are kept. Subclasses provide the storage primitives; everything else is shared.

    Thread-safe. Use as a context manager, or call :meth:`close`.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        # Caches in front of the store, bounded with every other cache by the shared byte budget (a dropped
        # entry is looked up in the store again). A message sent again on every turn is neither serialised nor
        # hashed again: each message -> (blob id, snapshot to compare with, the snapshot's bytes); the entry holds
        # the message, so its id is not reused, and the snapshot notices a dict the caller changed in place.
        self._seen: IdentityMemo[object, tuple[int, object, int]] = IdentityMemo(
            "transcript.seen", sizer=_seen_size, fresh=_seen_fresh
        )
        self._blobs: Memo[str, int] = Memo("transcript.blobs")  # digest -> blob id
        self._nodes: Memo[tuple[int, int], int] = Memo("transcript.nodes")  # (parent node, blob id) -> node
        # Nodes this instance stored: their children are all in ``_nodes`` unless it dropped them (then storing a
        # child finds the existing one: the store keeps (parent, blob) unique).
        self._created: Memo[int, bool] = Memo("transcript.created")
        # conversation -> snapshots of the inputs it last recorded, their trie nodes, and the snapshots' bytes
        self._paths: Memo[str, tuple[tuple[object, ...], list[int], int]] = Memo("transcript.paths", sizer=_path_size)
        self._begun: dict[int, int] = {}  # calls started and not ended here -> their inputs' node

    #: Whether a prompt that is the inputs without the dropped ones is stored as such (``sent`` NULL) instead of as
    #: its own trie path. SQLite files keep the path (files written by earlier releases are read the same way).
    _derives_sent = True

    # -- primitives -------------------------------------------------------------------------------------
    def _store_blob(self, digest: str, text: str) -> int:
        raise NotImplementedError

    def _find_blob(self, digest: str) -> int | None:
        raise NotImplementedError

    def _blob_texts(self, ids: set[int]) -> dict[int, str]:
        raise NotImplementedError

    def _store_node(self, parent: int, blob: int) -> int:
        raise NotImplementedError

    def _find_node(self, parent: int, blob: int) -> int | None:
        raise NotImplementedError

    def _path(self, node: int) -> list[int]:
        """Blob ids from the root to ``node``."""
        raise NotImplementedError

    def _paths_of(self, nodes: set[int]) -> dict[int, list[int]]:
        return {node: self._path(node) for node in nodes}

    def _insert(self, row: _Row) -> int:
        raise NotImplementedError

    def _update(self, row: _Row, *, wait: bool = True) -> None:
        """Replace the stored row ``row.call`` (a begun call, now ended). ``wait=False``: a store that writes over
        the network may send it and return before it is committed (see :meth:`end`)."""
        raise NotImplementedError

    def _select(
        self, conversation: str | None, call: int | None = None, last: bool = False, kept: bool = False
    ) -> list[_Row]:
        """Rows in call order: of ``conversation`` (None: all), or the one ``call``; ``last``: the latest only;
        ``kept``: refused calls left out."""
        raise NotImplementedError

    def _discard(self, row: _Row) -> _Gone:
        """Replace the begun call ``row.call`` with ``row`` (its refusal, which refers to no message) and delete the
        trie nodes and blobs the begun row used that nothing else uses now; what was deleted.
        :class:`UnknownCall` when the store holds no begun call of that number."""
        raise NotImplementedError

    def _has_node(self, node: int) -> bool:
        """Whether a node a cache names is still stored (a store that deletes on its own, as the bounded memory
        store evicts, checks; the others delete only what they purge from the caches at once)."""
        return True

    def _has_blob(self, blob: int) -> bool:
        return True

    def _commit(self) -> None:
        pass

    def _rollback(self) -> bool:
        """Undo a half-written entry; True when ids handed out since the last commit are gone with it."""
        return False

    def _settle(self) -> None:
        """Complete a write left in flight (a :meth:`begin` not yet waited for, an ``end(..., wait=False)``) before
        anything reads or writes. Here every write completes at once."""

    def _forget(self) -> None:
        """Drop the caches in front of the store: they may name rows a failed write did not store."""
        self._blobs.clear()
        self._nodes.clear()
        self._seen.clear()
        self._paths.clear()
        self._created.clear()

    def _alive(self, owners: set[str]) -> dict[str, bool]:
        """Whether the owner that began each call still "begun" may still be running it (``"pending"``) or has
        ended (``"interrupted"``). Here: a process on this host, checked by pid and start time; other hosts are
        given the benefit. A store shared across hosts overrides this with what it can see of every writer."""
        return {owner: _running(owner) for owner in owners}

    # -- interning --------------------------------------------------------------------------------------
    def _blob(self, value: Any, text: str | None = None, digest: str | None = None) -> int:
        text = _serial(value) if text is None else text
        digest = _digest(text) if digest is None else digest
        blob = self._blobs.get(digest)
        if blob is None or not self._has_blob(blob):
            blob = self._find_blob(digest)
            if blob is None:
                blob = self._store_blob(digest, text)
            self._blobs.put(digest, blob)
        return blob

    def _message_blob(self, message: Any, prepared: Prepared | None = None) -> tuple[int, object, int]:
        """The message's blob id, a snapshot that compares equal to it while it is unchanged (a copy of a dict, a
        Message itself; ``_NEVER`` for objects we cannot compare cheaply) and the snapshot's bytes. ``prepared``:
        serializations made before the lock was taken (:meth:`_serialize_ahead`)."""
        seen = self._seen.get(message)
        if seen is not None and self._has_blob(seen[0]):
            return seen
        size: int | None = None
        if type(message) is dict:
            made = prepared.get(id(message)) if prepared is not None else None
            if made is not None and made[0] is message:
                _, text, digest, snapshot, size = made
                blob = self._blob(None, text, digest)
            else:
                text = _serial(message)
                blob = self._blob(None, text)
                snapshot = json.loads(text)
        elif isinstance(message, Message):
            blob, snapshot = self._blob(message.to_dict()), message
        else:
            return self._blob(_plain(message)), _NEVER, 0
        found = (blob, snapshot, data_size(snapshot) if size is None else size)
        self._seen.put(message, found)
        return found

    def _serialize_ahead(self, messages: Sequence[Any], lane: str | None) -> Prepared:
        """What :meth:`_node` will serialize and hash for ``messages`` (the plain dicts past the part the lane saw
        last, not seen before), done before the lock is taken: a large request's messages are written without
        holding up every other call of the keeper while they are serialized."""
        start = 0
        memo = self._paths.get(lane) if lane is not None else None
        if memo is not None:
            known = memo[0]
            if len(known) <= len(messages) and all(map(_same, known, messages[: len(known)])):
                start = len(known)
        prepared: Prepared = {_COMPARED: (memo, start)}  # (what was compared: _node need not compare it again)
        for index, message in enumerate(messages[start:] if start else messages):
            if index % _YIELD_EVERY == _YIELD_EVERY - 1:
                # A large request's messages (this runs on a worker thread) let the event loop and other calls have
                # the GIL now and then, rather than only at the interpreter's 5 ms switch interval each time.
                _time.sleep(0)
            if type(message) is dict and self._seen.get(message) is None:
                text = _serial(message)
                snapshot = json.loads(text)
                prepared[id(message)] = (message, text, _digest(text), snapshot, data_size(snapshot))
        return prepared

    def _node(self, messages: Sequence[Any], lane: str | None = None, prepared: Prepared | None = None) -> int:
        """The trie node of ``messages``. With a ``lane`` (one conversation's inputs), the list the lane saw
        last is compared in one go (by value, so edits in place are noticed): a growing chat costs its new
        messages, not its whole length, on every call."""
        node, start = 0, 0
        snapshots: list[object] = []
        nodes: list[int] = []
        held = 0  # the snapshots' bytes
        memo = self._paths.get(lane) if lane is not None else None
        if memo is not None:
            known, known_nodes, known_bytes = memo
            size = len(known)
            compared = prepared.get(_COMPARED) if prepared is not None else None
            if (
                size
                and size <= len(messages)
                and self._has_node(known_nodes[-1])  # (a node's ancestors are kept while it is)
                # The same lane state compared before the lock (_serialize_ahead) need not be compared again.
                and (
                    (compared[0] is memo and compared[1] == size)
                    if compared is not None
                    else all(map(_same, known, messages[:size]))
                )
            ):
                node, start = known_nodes[-1], size
                snapshots, nodes, held = list(known), list(known_nodes), known_bytes
        comparable = len(snapshots) == start
        for message in messages[start:] if start else messages:
            blob, snapshot, snapshot_bytes = self._message_blob(message, prepared)
            child = self._nodes.get((node, blob))
            if child is not None and not self._has_node(child):
                child = None
            if child is None:
                # A node this instance made has no children but those in the cache: no need to ask the store.
                child = None if node in self._created else self._find_node(node, blob)
                if child is None:
                    child = self._store_node(node, blob)
                    self._created.put(child, True)
                self._nodes.put((node, blob), child)
            node = child
            comparable = comparable and snapshot is not _NEVER
            if comparable:
                snapshots.append(snapshot)
                nodes.append(node)
                held += snapshot_bytes
        if lane is not None:
            self._paths.put(lane, (tuple(snapshots), nodes, held))
        return node

    # -- public -----------------------------------------------------------------------------------------
    def _row(self, entry: TranscriptEntry, inputs: int | None = None, prepared: Prepared | None = None) -> _Row:
        return _Row(
            call=entry.call,
            conversation=entry.conversation,
            time=entry.time,
            inputs=self._node(entry.inputs, lane=entry.conversation, prepared=prepared) if inputs is None else inputs,
            sent=None if self._derives_sent and _kept_as_is(entry) else self._node(entry.sent),
            tools=self._blob(list(entry.tools)) if entry.tools is not None else None,
            received=self._blob(entry.received) if entry.received is not None else None,
            dropped=json.dumps(_runs(entry.dropped)),
            rewritten=json.dumps(_runs(entry.rewritten)),
            report=_serial({**entry.report, "actions": list(entry.actions)}),
            usage=_serial(entry.usage) if entry.usage is not None else None,
            error=entry.error,
            attempts=entry.attempts,
        )

    def _write(self, store: Any) -> int:
        """Run ``store()`` (which writes rows and returns a call number) as one transaction, under the lock."""
        with self._lock:
            self._settle()  # first: a write left in flight that failed leaves the caches naming rows not stored
            try:
                call = int(store())
                self._commit()
            except BaseException:
                if self._rollback():  # the caches may hold ids the rollback took back
                    self._forget()
                raise
        return call

    def record(self, entry: TranscriptEntry) -> TranscriptEntry:
        """Store ``entry`` (a call that has ended) and return it with its call number."""
        call = self._write(lambda: self._insert(self._row(dataclasses.replace(entry, call=0))))
        return dataclasses.replace(entry, call=call)

    def add(self, inputs: Sequence[Any], fit: Any = None, **details: Any) -> TranscriptEntry:
        """Record one call that has ended: :func:`make_entry` then :meth:`record`."""
        return self.record(make_entry(inputs, fit, **details))

    def start(
        self,
        inputs: Sequence[Any],
        *,
        conversation: str = "default",
        tools: Sequence[Any] | None = None,
        time: float | None = None,
    ) -> TranscriptEntry:
        """Store (durably, before anything is sent) the inputs of a call about to be made; returns its entry
        (``status="pending"``) with the call number that :meth:`end` completes."""
        return self.begin(inputs, conversation=conversation, tools=tools, time=time).wait()

    def begin(
        self,
        inputs: Sequence[Any],
        *,
        conversation: str = "default",
        tools: Sequence[Any] | None = None,
        time: float | None = None,
    ) -> Begun:
        """:meth:`start` in two halves: the inputs are written now, and :meth:`Begun.wait` returns the entry once
        they are durable (a store over the network returns here before its answer, so a wrapped call fits while
        the write travels, and waits before its request leaves)."""
        entry = TranscriptEntry(
            conversation=conversation,
            time=_time.time() if time is None else time,
            inputs=_plains(inputs),
            tools=tuple(_plain_value(t) or {} for t in tools) if tools else None,
            status="pending",
        )
        sent: list[tuple[int, Callable[[], int]]] = []
        prepared = self._serialize_ahead(entry.inputs, entry.conversation)

        def store() -> int:
            row = dataclasses.replace(self._row(entry, prepared=prepared), state="begun", owner=_owner())
            sent.append((row.inputs, self._insert_later(row)))
            return 0

        self._write(store)
        node, number = sent[-1]
        return Begun(self, entry, node, number)

    def _insert_later(self, row: _Row) -> Callable[[], int]:
        """Insert ``row``; a function that returns its call number once the row is durable. Here the insert is
        complete when this returns; a store over the network may send it and wait in the function."""
        call = self._insert(row)
        return lambda: call

    def _began(self, call: int, node: int) -> None:
        """``call`` is durable, its inputs the trie node ``node``: :meth:`end` reuses them."""
        with self._lock:
            self._begun.setdefault(call, node)

    def end(self, started: TranscriptEntry, fit: Any = None, *, wait: bool = True, **details: Any) -> TranscriptEntry:
        """Complete the call :meth:`start` began: ``fit`` and ``details`` as for :func:`make_entry` (the inputs,
        conversation, tools and start time are the started entry's).

        ``wait=False`` (what wrapped calls do): a store over the network (Postgres) sends the completed entry and
        returns without waiting for its commit; this transcript's next read or write, :meth:`flush` or
        :meth:`close` waits for it first (so this process reads what it wrote). Such a store never raises it into
        the caller: an end the database could not commit (unreachable, restarted) waits in the store's outbox and
        is sent again once it can be; one the database refuses as such is logged. The inputs, written by
        :meth:`start`, are durable either way."""
        details.setdefault("tools", started.tools)
        entry = make_entry(started.inputs, fit, conversation=started.conversation, time=started.time, **details)
        entry = dataclasses.replace(entry, call=started.call)

        def store() -> int:
            inputs = self._begun.pop(started.call, None)
            self._update(self._row(entry, inputs), wait=wait)
            return started.call

        self._write(store)
        return entry

    def refuse(
        self,
        started: TranscriptEntry | None,
        error: BaseException | str,
        *,
        conversation: str = "default",
        inputs: Sequence[Any] = (),
        tools: Sequence[Any] | None = None,
    ) -> TranscriptEntry:
        """Complete a call refused by our own checks before anything was sent (too large, invalid messages): its
        entry keeps the refusal (conversation, time, ``error``, and in ``report["refused"]`` the sizes: message
        and tool counts, the inputs' JSON bytes) but not the inputs, and what :meth:`begin` stored for it that no
        other entry uses (message blobs, trie nodes, the tools list) is deleted, in the store and in this
        transcript's caches. A call of the same conversation writing alongside keeps everything it uses.

        ``started``: the entry :meth:`begin` (``.wait()``) or :meth:`start` returned, a call still begun. None: the
        call was refused before anything was written (the write itself refused it); then ``conversation``,
        ``inputs`` and ``tools`` describe it and only their counts are recorded. Returns the refusal's entry
        (``status="refused"``). A store over the network that cannot be reached records it once it can (see
        :class:`~contextkeeper.calls.transcript.postgres.PostgresTranscript`) instead of raising."""
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        sizes: dict[str, int | None]
        if started is None:
            sizes = {"messages": len(inputs), "tools": len(tools or ())}
            entry = TranscriptEntry(
                conversation=conversation, time=_time.time(), report={"refused": sizes}, error=text, attempts=0,
                status="refused",
            )  # fmt: skip
            call = self._write(lambda: self._insert(dataclasses.replace(self._row(entry, 0), state="refused")))
            return dataclasses.replace(entry, call=call)
        sizes = {
            "messages": len(started.inputs),
            "bytes": _json_bytes(started.inputs),
            "tools": len(started.tools or ()),
            "tools_bytes": _json_bytes(started.tools or ()),
        }
        entry = TranscriptEntry(
            call=started.call, conversation=started.conversation, time=started.time, report={"refused": sizes},
            error=text, attempts=0, status="refused",
        )  # fmt: skip
        with self._lock:
            self._settle()
            self._begun.pop(started.call, None)
            row = dataclasses.replace(self._row(entry, 0), state="refused")
            gone = self._discard(row)
            self._uncache(gone, started.conversation, started.inputs)
        return entry

    def _uncache(self, gone: _Gone, conversation: str | None = None, messages: Sequence[Any] = ()) -> None:
        """Forget what the caches say of rows the store deleted (``gone``), the lane of ``conversation`` (its
        snapshots are the refused inputs) and the snapshots of ``messages`` whose blobs went."""
        if conversation is not None:
            self._paths.pop(conversation)
        if not gone.nodes and not gone.blobs:
            return
        for node, key in gone.nodes.items():
            self._nodes.pop(key)
            self._created.pop(node)
        for digest in gone.blobs.values():
            if digest is not None:
                self._blobs.pop(digest)
        for message in messages:
            seen = self._seen.get(message)
            if seen is not None and seen[0] in gone.blobs:
                self._seen.pop(message)

    def _entries(self, rows: list[_Row]) -> list[TranscriptEntry]:
        wanted: set[int] = set()
        paths = self._paths_of({node for row in rows for node in (row.inputs, row.sent) if node is not None})
        for path in paths.values():
            wanted.update(path)
        for row in rows:
            wanted.update(b for b in (row.tools, row.received) if b is not None)
        texts = self._blob_texts(wanted)
        # Within one read, a message shared by several entries is one dict (parsed once).
        parsed: dict[int, Any] = {}

        def value(blob: int) -> Any:
            if blob not in parsed:
                parsed[blob] = json.loads(texts[blob])
            return parsed[blob]

        out = []
        owners = {row.owner for row in rows if row.state != "done" and row.owner is not None}
        alive = self._alive(owners) if owners else {}
        for row in rows:
            report = json.loads(row.report)
            status = _status(row, alive)
            out.append(
                TranscriptEntry(
                    call=row.call,
                    conversation=row.conversation,
                    time=row.time,
                    inputs=tuple(value(b) for b in paths[row.inputs]),
                    sent=tuple(value(b) for b in _sent_path(row, paths)),
                    tools=tuple(value(row.tools)) if row.tools is not None else None,
                    received=value(row.received) if row.received is not None else None,
                    dropped=_unruns(json.loads(row.dropped)),
                    rewritten=_unruns(json.loads(row.rewritten)),
                    actions=tuple(report.get("actions", ())),
                    report=report,
                    usage=json.loads(row.usage) if row.usage is not None else None,
                    error=INTERRUPTED if status == "interrupted" else row.error,
                    attempts=row.attempts,
                    status=status,
                )
            )
        return out

    def entries(self, conversation: str | None = None) -> list[TranscriptEntry]:
        """Every entry (of ``conversation``), oldest first."""
        with self._lock:
            return self._entries(self._select(conversation))

    def last(self, conversation: str | None = None) -> TranscriptEntry | None:
        """The latest entry (of ``conversation``), or None."""
        with self._lock:
            rows = self._select(conversation, last=True)
            return self._entries(rows)[0] if rows else None

    def get(self, call: int) -> TranscriptEntry:
        """The entry of ``call``; :class:`UnknownCall` when there is none."""
        with self._lock:
            rows = self._select(None, call=call)
            if not rows:
                raise UnknownCall(f"the transcript holds no call {call}")
            return self._entries(rows)[0]

    def recover(self, call: int) -> list[dict[str, Any]]:
        """The inputs of ``call`` that its prompt dropped or rewrote, in their original form and order."""
        entry = self.get(call)
        return [entry.inputs[i] for i in entry.removed]

    def history(self, conversation: str = "default") -> list[dict[str, Any]]:
        """The full conversation as the latest call saw it, never trimmed, plus its reply when it has one (a
        call that failed, or that a crash interrupted, ends the history with its inputs): what to resume from.
        Refused calls are skipped: their inputs were never part of the conversation, and are not kept."""
        with self._lock:
            rows = self._select(conversation, last=True, kept=True)
            entry = self._entries(rows)[0] if rows else None
        if entry is None:
            return []
        reply = [entry.received] if entry.received is not None and entry.status == "ok" else []
        return [*entry.inputs, *reply]

    def __len__(self) -> int:
        with self._lock:
            return len(self._select(None))

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every write made so far is committed (see :meth:`end`'s ``wait``); ``timeout`` bounds the
        wait of a store over the network (see there)."""
        with self._lock:
            self._settle()

    def close(self) -> None:
        """Release the storage (a no-op in memory)."""

    def __enter__(self) -> Transcript:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# What the memory store charges besides the texts: a blob's digest and its entries in four dicts; a node's tuple, key
# and entries in three; a row's object and its entries (its strings are added as they are).
_BLOB_BYTES = 480
_NODE_BYTES = 480
_ROW_BYTES = 1000
_BURST_SECONDS = 60.0  # evictions closer together than this are one burst, warned of once


def _row_bytes(row: _Row) -> int:
    texts = (row.conversation, row.dropped, row.rewritten, row.report, row.usage, row.error, row.owner)
    return _ROW_BYTES + sum(sys.getsizeof(text) for text in texts if text is not None)


class MemoryTranscript(Transcript):
    """Entries in this process's memory, lost when it ends.

    ``max_bytes`` (None: no bound) bounds what the store holds (messages, the trie, rows, by its own accounting,
    :attr:`nbytes`): past it, the least recently used conversations (written or read) are evicted whole, and a
    warning says so once per burst of evictions. A conversation with a call in flight (begun, not ended) is not
    evicted. ``open_transcript(None)``, the default of a keeper and of ``contextkeeper serve``, gives
    ``max_bytes=DEFAULT_MEMORY_BYTES``.
    """

    def __init__(self, *, max_bytes: int | None = None) -> None:
        super().__init__()
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1):
            raise ConfigurationError(
                f"max_bytes={max_bytes!r} is not a positive number of bytes. Fix: pass e.g. max_bytes=256 * 1024 * "
                "1024, or max_bytes=None for no bound"
            )
        self.max_bytes = max_bytes
        # The store. Each blob and node counts its uses (nodes and rows naming a blob; child nodes and rows naming a
        # node), so that what no entry uses any more is deleted with the last entry that did. Ids are never reused:
        # a cache naming a deleted row is a miss (_has_node, _has_blob), never another row.
        self._texts: dict[int, str] = {}
        self._digests: dict[int, str] = {}
        self._blob_ids: dict[str, int] = {}
        self._blob_uses: dict[int, int] = {}
        self._node_of: dict[int, tuple[int, int]] = {}  # node -> (parent, blob); node 0 is the empty list
        self._node_ids: dict[tuple[int, int], int] = {}
        self._node_uses: dict[int, int] = {}
        self._rows: dict[int, _Row] = {}
        self._calls_of: OrderedDict[str, list[int]] = OrderedDict()  # conversation -> its calls, least recent first
        self._begun_in: dict[str, int] = {}  # conversation -> its calls in flight
        self._next_blob = 0
        self._next_node = 1
        self._next_call = 1
        self._bytes = 0
        self._made: list[tuple[bool, int]] = []  # (a node?, id) stored by the write in progress
        self.evicted = 0  #: conversations evicted so far
        self._last_eviction = -_BURST_SECONDS  # monotonic

    @property
    def nbytes(self) -> int:
        """What the store holds, in bytes, by the accounting ``max_bytes`` bounds."""
        return self._bytes

    # -- blobs and nodes --------------------------------------------------------------------------------
    def _store_blob(self, digest: str, text: str) -> int:
        blob = self._blob_ids.get(digest)
        if blob is None:
            blob = self._next_blob
            self._next_blob += 1
            self._texts[blob], self._digests[blob], self._blob_ids[digest] = text, digest, blob
            self._blob_uses[blob] = 0
            self._bytes += _BLOB_BYTES + sys.getsizeof(text)
            self._made.append((False, blob))
        return blob

    def _find_blob(self, digest: str) -> int | None:
        return self._blob_ids.get(digest)

    def _has_blob(self, blob: int) -> bool:
        return blob in self._texts

    def _blob_texts(self, ids: set[int]) -> dict[int, str]:
        return {i: self._texts[i] for i in ids}

    def _store_node(self, parent: int, blob: int) -> int:
        node = self._node_ids.get((parent, blob))
        if node is None:
            node = self._next_node
            self._next_node += 1
            self._node_of[node], self._node_ids[(parent, blob)], self._node_uses[node] = (parent, blob), node, 0
            if parent:
                self._node_uses[parent] += 1
            self._blob_uses[blob] += 1
            self._bytes += _NODE_BYTES
            self._made.append((True, node))
        return node

    def _find_node(self, parent: int, blob: int) -> int | None:
        return self._node_ids.get((parent, blob))

    def _has_node(self, node: int) -> bool:
        return node == 0 or node in self._node_of

    def _path(self, node: int) -> list[int]:
        out = []
        while node:
            node, blob = self._node_of[node]
            out.append(blob)
        return out[::-1]

    def _use(self, row: _Row) -> None:
        for node in (row.inputs, row.sent):
            if node:
                self._node_uses[node] += 1
        for blob in (row.tools, row.received):
            if blob is not None:
                self._blob_uses[blob] += 1

    def _release(self, row: _Row, gone: _Gone) -> None:
        self._drop(
            [n for n in (row.inputs, row.sent) if n], [b for b in (row.tools, row.received) if b is not None], gone
        )

    def _drop(self, nodes: list[int], blobs: list[int], gone: _Gone) -> None:
        """One use less of each node and blob; each that has none left is deleted (a node's deletion is one use less
        of its parent and of its blob). A loop, not recursion: a chat may be thousands of messages deep."""
        while nodes:
            node = nodes.pop()
            uses = self._node_uses[node] - 1
            if uses:
                self._node_uses[node] = uses
                continue
            parent, blob = self._node_of.pop(node)
            del self._node_uses[node], self._node_ids[(parent, blob)]
            self._bytes -= _NODE_BYTES
            gone.nodes[node] = (parent, blob)
            if parent:
                nodes.append(parent)
            blobs.append(blob)
        for blob in blobs:
            uses = self._blob_uses[blob] - 1
            if uses:
                self._blob_uses[blob] = uses
                continue
            text, digest = self._texts.pop(blob), self._digests.pop(blob)
            del self._blob_uses[blob], self._blob_ids[digest]
            self._bytes -= _BLOB_BYTES + sys.getsizeof(text)
            gone.blobs[blob] = digest

    # -- rows -------------------------------------------------------------------------------------------
    def _insert(self, row: _Row) -> int:
        call = self._next_call
        self._next_call += 1
        row = dataclasses.replace(row, call=call)
        self._use(row)
        self._rows[call] = row
        self._bytes += _row_bytes(row)
        calls = self._calls_of.get(row.conversation)
        if calls is None:
            calls = self._calls_of[row.conversation] = []
        else:
            self._calls_of.move_to_end(row.conversation)
        calls.append(call)
        if row.state == "begun":
            self._begun_in[row.conversation] = self._begun_in.get(row.conversation, 0) + 1
        return call

    def _replace(self, row: _Row) -> _Gone:
        """Put ``row`` where the row of its call is; what the old row alone used is deleted."""
        old = self._rows[row.call]
        self._use(row)  # first: what both use must never drop to no use
        self._rows[row.call] = row
        self._bytes += _row_bytes(row) - _row_bytes(old)
        gone = _Gone()
        self._release(old, gone)
        if old.state == "begun" and row.state != "begun":
            left = self._begun_in.pop(row.conversation, 1) - 1
            if left:
                self._begun_in[row.conversation] = left
        if row.conversation in self._calls_of:
            self._calls_of.move_to_end(row.conversation)
        return gone

    def _update(self, row: _Row, *, wait: bool = True) -> None:
        if row.call not in self._rows:
            raise UnknownCall(f"the transcript holds no call {row.call}{self._evicted_note()}")
        self._uncache(self._replace(row))

    def _discard(self, row: _Row) -> _Gone:
        old = self._rows.get(row.call)
        if old is None or old.state != "begun":
            raise UnknownCall(f"the transcript holds no call {row.call} in flight{self._evicted_note()}")
        return self._replace(row)

    def _evicted_note(self) -> str:
        return f" (it evicted {self.evicted:,} conversations to stay within max_bytes)" if self.evicted else ""

    def _commit(self) -> None:
        self._made.clear()
        if self.max_bytes is not None and self._bytes > self.max_bytes:
            self._evict(self.max_bytes)

    def _rollback(self) -> bool:
        # What the failed write stored and nothing uses goes (children first: each takes its parent's use along).
        made, self._made = self._made, []
        gone = _Gone()
        for is_node, ident in reversed(made):
            uses = self._node_uses if is_node else self._blob_uses
            if uses.get(ident) == 0:
                uses[ident] = 1
                self._drop([ident] if is_node else [], [] if is_node else [ident], gone)
        return bool(gone.nodes or gone.blobs)

    def _evict(self, limit: int) -> None:
        """Evict the least recently used conversations whole until the store is within ``limit``."""
        gone = _Gone()
        before, conversations, calls = self._bytes, 0, 0
        skipped = 0
        while self._bytes > limit and skipped < len(self._calls_of):  # bounded: each pass evicts or skips one
            conversation = next(iter(self._calls_of))
            if self._begun_in.get(conversation):  # a call in flight: kept (and counted as used now)
                self._calls_of.move_to_end(conversation)
                skipped += 1
                continue
            for call in self._calls_of.pop(conversation):
                row = self._rows.pop(call)
                self._bytes -= _row_bytes(row)
                self._release(row, gone)
                calls += 1
            self._paths.pop(conversation)
            conversations += 1
        self._uncache(gone)
        if not conversations:
            return
        self.evicted += conversations
        now = _time.monotonic()
        if now - self._last_eviction > _BURST_SECONDS:
            log.warning(
                "the in-memory transcript reached max_bytes=%s: it evicts the least recently used conversations "
                "whole (%d conversation(s), %d call(s), %s bytes now; warned once per burst). Fix: give the keeper "
                "a store of your own to keep every conversation (transcript='chat.sqlite' or a postgresql:// URL), "
                "or a larger bound (transcript=MemoryTranscript(max_bytes=...))",
                f"{limit:,}",
                conversations,
                calls,
                f"{before - self._bytes:,}",
            )
        self._last_eviction = now

    def _select(
        self, conversation: str | None, call: int | None = None, last: bool = False, kept: bool = False
    ) -> list[_Row]:
        if call is not None:
            found = self._rows.get(call)
            return [found] if found is not None and conversation in (None, found.conversation) else []
        if conversation is None:
            rows: Sequence[_Row] | None = None
        else:
            calls = self._calls_of.get(conversation)
            if calls is None:
                return []
            self._calls_of.move_to_end(conversation)  # read: used
            rows = [self._rows[c] for c in calls]
        if last:
            latest = reversed(self._rows.values()) if rows is None else reversed(rows)
            return next(([r] for r in latest if not (kept and r.state == "refused")), [])
        return [r for r in (self._rows.values() if rows is None else rows) if not (kept and r.state == "refused")]

    def __len__(self) -> int:
        with self._lock:
            return len(self._rows)


_SCHEMA = """
CREATE TABLE IF NOT EXISTS blobs (id INTEGER PRIMARY KEY, digest TEXT NOT NULL UNIQUE, json TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS nodes (
    id INTEGER PRIMARY KEY, parent INTEGER NOT NULL, blob INTEGER NOT NULL, UNIQUE (parent, blob)
);
CREATE TABLE IF NOT EXISTS calls (
    call INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation TEXT NOT NULL,
    time REAL NOT NULL,
    inputs INTEGER NOT NULL,
    sent INTEGER NOT NULL,
    tools INTEGER,
    received INTEGER,
    dropped TEXT NOT NULL,
    rewritten TEXT NOT NULL,
    report TEXT NOT NULL,
    usage TEXT,
    error TEXT,
    attempts INTEGER NOT NULL,
    state TEXT NOT NULL DEFAULT 'done',
    owner TEXT
);
CREATE INDEX IF NOT EXISTS calls_by_conversation ON calls (conversation, call);
"""

# The chain of trie nodes from a node up to the root's child: (id, parent, blob), the node itself first.
_CHAIN = """
WITH RECURSIVE chain(id, parent, blob, depth) AS (
    SELECT id, parent, blob, 0 FROM nodes WHERE id = ?
    UNION ALL
    SELECT n.id, n.parent, n.blob, c.depth + 1 FROM nodes n JOIN chain c ON n.id = c.parent
)
SELECT id, parent, blob FROM chain ORDER BY depth
"""

# Columns added since the first files were written: (name, declaration), added to older files when opened.
_ADDED = (("state", "TEXT NOT NULL DEFAULT 'done'"), ("owner", "TEXT"))

_COLUMNS = (
    "call, conversation, time, inputs, sent, tools, received, dropped, rewritten, report, usage, error, attempts, "
    "state, owner"
)

_PATH = """
WITH RECURSIVE chain(id, parent, blob, depth) AS (
    SELECT id, parent, blob, 0 FROM nodes WHERE id = ?
    UNION ALL
    SELECT n.id, n.parent, n.blob, c.depth + 1 FROM nodes n JOIN chain c ON n.id = c.parent
)
SELECT blob FROM chain ORDER BY depth DESC
"""


def _content(row: _Row) -> tuple[Any, ...]:
    """The columns a call's row is written with and ended with, in the order both statements list them."""
    return (
        row.inputs,
        row.sent,
        row.tools,
        row.received,
        row.dropped,
        row.rewritten,
        row.report,
        row.usage,
        row.error,
        row.attempts,
        row.state,
    )


def _existing(found: int | None) -> int:
    if found is None:  # the insert conflicted, so the row exists: only a corrupt file gets here
        raise ContextKeeperError("the transcript file lost a row it had just refused to store twice")
    return found


def _with_retries(statement: Callable[[], Any], seconds: float = 10.0) -> None:
    """Run ``statement``, again while SQLite says the file is locked (switching to WAL takes a lock SQLite does not
    wait for when another process is opening or writing the same file), for at most ``seconds``."""
    deadline = _time.monotonic() + seconds
    for pause in itertools.count():
        try:
            statement()
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or _time.monotonic() >= deadline:
                raise
            _time.sleep(min(0.2, 0.005 * 2**pause))


class SQLiteTranscript(Transcript):
    """Entries in a SQLite file that survives restarts; call numbers continue where the file left off.

    One connection shared by threads under the transcript's lock; WAL mode so readers in other processes
    (an app inspecting the file) do not block writes.
    """

    _derives_sent = False  # its column is NOT NULL, and earlier releases read these files too

    def __init__(self, path: str | Path) -> None:
        super().__init__()
        self.path = Path(path)
        if self.path.parent and not self.path.parent.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
        # timeout: another process writing the same file holds its write lock for a moment; wait for it.
        db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None, timeout=10.0)
        self._db: sqlite3.Connection | None = db
        try:
            db.execute("PRAGMA busy_timeout=10000")  # first: the statements below may meet such a lock
            _with_retries(lambda: db.execute("PRAGMA journal_mode=WAL"))
            # NORMAL: a commit survives the process being killed (the WAL is in the OS's hands); only a power cut
            # may lose the latest commits.
            db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(_SCHEMA)
            have = {str(row[1]) for row in db.execute("PRAGMA table_info(calls)")}
            for name, declaration in _ADDED:
                if name not in have:
                    db.execute(f"ALTER TABLE calls ADD COLUMN {name} {declaration}")
        except sqlite3.DatabaseError as exc:
            db.close()
            self._db = None
            raise ConfigurationError(
                f"transcript={str(self.path)!r} cannot be used as a SQLite transcript ({exc}). Fix: pass a new file "
                "name, or the path of a transcript file this library wrote"
            ) from exc
        self._open = False

    def __repr__(self) -> str:
        return f"SQLiteTranscript({str(self.path)!r})"

    @property
    def db(self) -> sqlite3.Connection:
        if self._db is None:
            raise ContextKeeperError(f"the transcript {self.path} is closed")
        return self._db

    def _begin(self) -> None:
        # IMMEDIATE: the write lock from the first look-up on, so a row found here cannot be deleted by another
        # process's refusal before this write's call refers to it.
        if not self._open:
            self.db.execute("BEGIN IMMEDIATE")
            self._open = True

    def _store_blob(self, digest: str, text: str) -> int:
        self._begin()
        # Another process writing the same file may have stored it since we looked: then take its row.
        cursor = self.db.execute(
            "INSERT INTO blobs (digest, json) VALUES (?, ?) ON CONFLICT (digest) DO NOTHING", (digest, text)
        )
        if cursor.rowcount == 1:
            return int(cursor.lastrowid or 0)
        return _existing(self._find_blob(digest))

    def _find_blob(self, digest: str) -> int | None:
        self._begin()
        found = self.db.execute("SELECT id FROM blobs WHERE digest = ?", (digest,)).fetchone()
        return int(found[0]) if found else None

    def _blob_texts(self, ids: set[int]) -> dict[int, str]:
        out: dict[int, str] = {}
        order = sorted(ids)
        for start in range(0, len(order), 500):  # below SQLite's limit on bound parameters
            chunk = order[start : start + 500]
            marks = ",".join("?" * len(chunk))
            for blob, text in self.db.execute(f"SELECT id, json FROM blobs WHERE id IN ({marks})", chunk):
                out[int(blob)] = str(text)
        return out

    def _store_node(self, parent: int, blob: int) -> int:
        self._begin()
        # As for blobs: a node this process made may have gained children in another process.
        cursor = self.db.execute(
            "INSERT INTO nodes (parent, blob) VALUES (?, ?) ON CONFLICT (parent, blob) DO NOTHING", (parent, blob)
        )
        if cursor.rowcount == 1:
            return int(cursor.lastrowid or 0)
        return _existing(self._find_node(parent, blob))

    def _find_node(self, parent: int, blob: int) -> int | None:
        self._begin()
        found = self.db.execute("SELECT id FROM nodes WHERE parent = ? AND blob = ?", (parent, blob)).fetchone()
        return int(found[0]) if found else None

    def _path(self, node: int) -> list[int]:
        if not node:
            return []
        return [int(blob) for (blob,) in self.db.execute(_PATH, (node,))]

    def _paths_of(self, nodes: set[int]) -> dict[int, list[int]]:
        if len(nodes) <= 4:
            return super()._paths_of(nodes)
        # Many entries: one scan of the trie beats a recursive query per entry.
        parents: dict[int, tuple[int, int]] = {
            int(i): (int(p), int(b)) for i, p, b in self.db.execute("SELECT id, parent, blob FROM nodes")
        }
        out: dict[int, list[int]] = {}
        for node in nodes:
            path: list[int] = []
            at = node
            while at:
                parent, blob = parents[at]
                path.append(blob)
                at = parent
            out[node] = path[::-1]
        return out

    def _insert(self, row: _Row) -> int:
        self._begin()
        cursor = self.db.execute(
            "INSERT INTO calls (conversation, time, inputs, sent, tools, received, dropped, rewritten, report, "
            "usage, error, attempts, state, owner) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (row.conversation, row.time, *_content(row), row.owner),
        )
        return int(cursor.lastrowid or 0)

    def _update(self, row: _Row, *, wait: bool = True) -> None:
        self._begin()
        cursor = self.db.execute(
            "UPDATE calls SET inputs = ?, sent = ?, tools = ?, received = ?, dropped = ?, rewritten = ?, "
            "report = ?, usage = ?, error = ?, attempts = ?, state = ? WHERE call = ?",
            (*_content(row), row.call),
        )
        if cursor.rowcount != 1:
            raise UnknownCall(f"the transcript {self.path} holds no call {row.call}")

    def _discard(self, row: _Row) -> _Gone:
        # Whether anything else uses a row is asked of the whole table (one scan of calls and nodes per refusal,
        # rare): an index per column a row is named by would cost every write, and the file, more than refusals do.
        db = self.db
        self._begin()  # the write lock: no other process finds a row between our look and our delete
        try:
            found = db.execute(
                "SELECT inputs, sent, tools, received, state FROM calls WHERE call = ?", (row.call,)
            ).fetchone()
            if found is None or found[4] != "begun":
                raise UnknownCall(f"the transcript {self.path} holds no call {row.call} in flight")
            db.execute(
                "UPDATE calls SET inputs = ?, sent = ?, tools = ?, received = ?, dropped = ?, rewritten = ?, "
                "report = ?, usage = ?, error = ?, attempts = ?, state = ?, owner = NULL WHERE call = ?",
                (*_content(row), row.call),
            )
            gone = _Gone()
            blobs: list[int] = [int(b) for b in found[2:4] if b is not None]
            for tip in {int(found[0]), int(found[1])} - {0}:
                blobs += self._unused_chain(tip, gone)
            self._unused_blobs(list(dict.fromkeys(blobs)), gone)
            self._commit()
        except BaseException:
            self._rollback()
            raise
        return gone

    def _unused_chain(self, tip: int, gone: _Gone) -> list[int]:
        """Delete the nodes from ``tip`` up that nothing uses (no call names one, and it has no child but the one
        below it in the chain), stopping at the first one something uses; the blobs the deleted nodes named."""
        db = self.db
        chain = db.execute(_CHAIN, (tip,)).fetchall()  # the tip first
        ids = json.dumps([int(node) for node, _, _ in chain])
        used = {
            int(node)
            for (node,) in db.execute(
                "SELECT inputs FROM calls WHERE inputs IN (SELECT value FROM json_each(?1)) "
                "UNION SELECT sent FROM calls WHERE sent IN (SELECT value FROM json_each(?1)) "
                "UNION SELECT parent FROM nodes WHERE parent IN (SELECT value FROM json_each(?1)) "
                "AND id NOT IN (SELECT value FROM json_each(?1))",
                (ids,),
            )
        }
        top = db.execute("SELECT max(id) FROM nodes").fetchone()[0]
        blobs: list[int] = []
        for node, parent, blob in chain:
            if node in used:
                break
            gone.nodes[int(node)] = (int(parent), int(blob))
            blobs.append(int(blob))
            if node == top:  # kept as a tombstone: SQLite gives the highest id again to the next row otherwise
                db.execute("UPDATE nodes SET parent = ?1, blob = ?1 WHERE id = ?2", (-node, node))
                db.execute("DELETE FROM nodes WHERE parent < 0 AND id < ?", (node,))
            else:
                db.execute("DELETE FROM nodes WHERE id = ?", (node,))
        return blobs

    def _unused_blobs(self, blobs: list[int], gone: _Gone) -> None:
        """Delete the ``blobs`` no node and no call names (as tools or reply)."""
        if not blobs:
            return
        db = self.db
        ids = json.dumps(blobs)
        used = {
            int(blob)
            for (blob,) in db.execute(
                "SELECT blob FROM nodes WHERE blob IN (SELECT value FROM json_each(?1)) "
                "UNION SELECT tools FROM calls WHERE tools IN (SELECT value FROM json_each(?1)) "
                "UNION SELECT received FROM calls WHERE received IN (SELECT value FROM json_each(?1))",
                (ids,),
            )
        }
        top = db.execute("SELECT max(id) FROM blobs").fetchone()[0]
        for blob in blobs:
            digest = db.execute("SELECT digest FROM blobs WHERE id = ?", (blob,)).fetchone()
            if blob in used or digest is None:
                continue
            gone.blobs[blob] = str(digest[0])
            if blob == top:  # a tombstone, as for nodes (digests are hex: "~" sorts after every one)
                db.execute("UPDATE blobs SET digest = ?, json = '' WHERE id = ?", (f"~{blob}", blob))
                db.execute("DELETE FROM blobs WHERE digest >= '~' AND id < ?", (blob,))
            else:
                db.execute("DELETE FROM blobs WHERE id = ?", (blob,))

    def _commit(self) -> None:
        if self._open:
            self._open = False
            self.db.execute("COMMIT")

    def _rollback(self) -> bool:
        if not self._open:
            return False
        self._open = False
        self.db.execute("ROLLBACK")
        return True

    def _select(
        self, conversation: str | None, call: int | None = None, last: bool = False, kept: bool = False
    ) -> list[_Row]:
        columns = _COLUMNS
        where: list[str] = ["state <> 'refused'"] if kept else []
        args: list[int | str] = []
        if call is not None:
            where.append("call = ?")
            args.append(call)
        if conversation is not None:
            where.append("conversation = ?")
            args.append(conversation)
        sql = f"SELECT {columns} FROM calls"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY call DESC LIMIT 1" if last else " ORDER BY call"
        return [
            _Row(
                call=int(r[0]),
                conversation=str(r[1]),
                time=float(r[2]),
                inputs=int(r[3]),
                sent=int(r[4]),
                tools=None if r[5] is None else int(r[5]),
                received=None if r[6] is None else int(r[6]),
                dropped=str(r[7]),
                rewritten=str(r[8]),
                report=str(r[9]),
                usage=None if r[10] is None else str(r[10]),
                error=None if r[11] is None else str(r[11]),
                attempts=int(r[12]),
                state=str(r[13]),
                owner=None if r[14] is None else str(r[14]),
            )
            for r in self.db.execute(sql, args)
        ]

    def __len__(self) -> int:
        with self._lock:
            return int(self.db.execute("SELECT COUNT(*) FROM calls").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None


_SQLITE_HEADER = b"SQLite format 3\x00"

#: URL schemes ``transcript=`` takes, each with the ``module:class`` that stores transcripts there. The module is
#: imported only when such a URL is given (its client library is an extra); the class has ``check_url(url)``
#: (validates without connecting, raises :class:`ConfigurationError`) and is built as ``cls(url)``.
URL_STORES: dict[str, str] = {
    "postgresql": "contextkeeper.calls.transcript.postgres:PostgresTranscript",
    "postgres": "contextkeeper.calls.transcript.postgres:PostgresTranscript",
}


def safe_url(url: str) -> str:
    """``url`` with its password (in the authority or as a ``password=`` parameter) shown as ``***``."""
    head, sep, rest = url.partition("://")
    if not sep:
        return url
    authority, slash, tail = rest.partition("/")
    user, at, host = authority.rpartition("@")
    if at and ":" in user:
        authority = f"{user.split(':', 1)[0]}:***@{host}"
    tail = re.sub(r"(?i)(\bpassword=)[^&]*", r"\1***", tail)
    return f"{head}{sep}{authority}{slash}{tail}"


def _url_store(scheme: str) -> Any:
    import importlib

    module, _, name = URL_STORES[scheme].partition(":")
    return getattr(importlib.import_module(module), name)


def check_transcript(spec: Any) -> Transcript | Path | str | None:
    """``spec`` as :func:`open_transcript` takes it, checked without opening or connecting to anything: None, a
    :class:`Transcript`, the path of a SQLite file (new, or one this library wrote), or a database URL with a
    scheme of :data:`URL_STORES` (returned as given). Anything else is a :class:`ConfigurationError` that names
    the value and the fix."""
    fix = (
        "pass transcript=None (in memory), a file path such as 'chat.sqlite', a URL such as "
        "'postgresql://user@host/db', or a Transcript object"
    )
    if spec is None or isinstance(spec, Transcript):
        return spec
    if not isinstance(spec, (str, os.PathLike)) or isinstance(spec, bytes):
        raise ConfigurationError(f"transcript={spec!r} ({type(spec).__name__}) is not a path. Fix: {fix}")
    text = os.fspath(spec)
    if not text.strip():
        raise ConfigurationError(f"transcript={spec!r} is an empty path. Fix: {fix}")
    if "://" in text:
        scheme = text.partition("://")[0].lower()
        if scheme not in URL_STORES:
            supported = ", ".join(f"{name}://" for name in URL_STORES)
            raise ConfigurationError(
                f"transcript={safe_url(text)!r} is a URL of scheme {scheme!r}; the URLs supported are {supported}. "
                "Fix: pass a Postgres URL, the path of a SQLite file (e.g. 'chat.sqlite'), or a Transcript object "
                "of your own"
            )
        _url_store(scheme).check_url(text)
        return text
    path = Path(text).expanduser()
    if path.is_dir():
        raise ConfigurationError(
            f"transcript={text!r} is a directory. Fix: name a file in it, e.g. {str(path / 'transcript.sqlite')!r}"
        )
    if path.exists():
        try:
            with path.open("rb") as file:
                head = file.read(len(_SQLITE_HEADER))
        except OSError as exc:
            raise ConfigurationError(f"transcript={text!r} cannot be read ({exc}). Fix: {fix}") from exc
        if head and head != _SQLITE_HEADER:
            raise ConfigurationError(
                f"transcript={text!r} exists and is not a SQLite file (it starts with {head[:8]!r}); it is left as "
                "it is. Fix: pass a new file name, or the path of a transcript file this library wrote"
            )
    else:
        parent = next((p for p in path.absolute().parents if p.exists()), None)
        if parent is not None and not parent.is_dir():
            raise ConfigurationError(f"transcript={text!r}: {str(parent)!r} is a file, not a folder. Fix: {fix}")
        if parent is not None and not os.access(parent, os.W_OK | os.X_OK):
            raise ConfigurationError(
                f"transcript={text!r}: the folder {str(parent)!r} is not writable. Fix: pass a path you can write"
            )
    return path


def open_transcript(spec: Transcript | str | Path | None) -> Transcript:
    """None: a :class:`MemoryTranscript` bounded by :data:`DEFAULT_MEMORY_BYTES`; a path: a
    :class:`SQLiteTranscript` there; a URL: the store of its scheme (``postgresql://``: a
    :class:`~contextkeeper.calls.transcript.postgres.PostgresTranscript`); a transcript: itself. A bad value is a
    :class:`ConfigurationError` (see :func:`check_transcript`)."""
    checked = check_transcript(spec)
    if checked is None:
        return MemoryTranscript(max_bytes=DEFAULT_MEMORY_BYTES)
    if isinstance(checked, Transcript):
        return checked
    if isinstance(checked, str):  # a URL (paths come back as Path)
        store: Transcript = _url_store(checked.partition("://")[0].lower())(checked)
        return store
    return SQLiteTranscript(checked)
