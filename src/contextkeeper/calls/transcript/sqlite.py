"""The transcript in a SQLite file (WAL mode) that survives restarts and is shared by the processes of one machine."""

from __future__ import annotations

import itertools
import json
import sqlite3
import time as _time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..._exceptions import ConfigurationError, ContextKeeperError, UnknownCall
from .base import Transcript, _content, _Gone, _Row

__all__ = ["SQLiteTranscript"]


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
