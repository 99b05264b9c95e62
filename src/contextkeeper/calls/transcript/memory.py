"""The default store: the transcript in dicts, bounded by :data:`~.entry.DEFAULT_MEMORY_BYTES`; the least recently used
conversations are evicted whole."""

from __future__ import annotations

import dataclasses
import logging
import sys
import time as _time
from collections import OrderedDict
from collections.abc import Sequence

from ..._exceptions import ConfigurationError, UnknownCall
from .base import Transcript, _Gone, _Row

log = logging.getLogger("contextkeeper")

__all__ = ["MemoryTranscript"]


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
