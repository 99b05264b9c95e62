"""The transcript's storage logic shared by every store: write-ahead (``Transcript.begin`` -> :class:`Begun`, then
``end`` or ``refuse``), content-addressed messages and tries of paths, this process's identity (a call whose process
ended reads back ``interrupted``), and the storage hooks each store implements."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import sys
import threading
import time as _time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..._exceptions import UnknownCall
from ..._memo import IdentityMemo, Memo, data_size
from ...messages import Message
from .entry import (
    _COMPARED,
    _YIELD_EVERY,
    INTERRUPTED,
    Indices,
    Prepared,
    Status,
    TranscriptEntry,
    _default,
    _digest,
    _plain,
    _plain_value,
    _plains,
    _same,
    _serial,
    make_entry,
)

__all__ = ["Begun", "Transcript"]


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
