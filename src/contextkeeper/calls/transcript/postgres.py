"""The transcript in Postgres: one history for every process and replica of an app.

``ContextKeeper(..., transcript="postgresql://user@host/db")`` (or ``postgres://``) keeps the transcript in the
tables of one Postgres schema (``schema=``, default ``contextkeeper``), so ``history(conversation)`` and
``recover(call)`` answer the same on every replica, and a conversation that moves to another replica goes on where
it was. Storage is the shared :class:`~.store.Transcript` logic (content-addressed messages, a
trie of message lists, write-ahead calls) over these tables:

- ``blobs (id, json)``: each distinct message, tools list or reply once; ``nodes (id, parent, blob)``: the trie
  of message lists. A blob's id *is* its content hash (the 128-bit digest the other stores index by, as a uuid),
  and a node's id the hash of its (parent, blob), so every replica names the same rows the same way without
  asking the database: each write is one statement that upserts its new rows (``ON CONFLICT DO NOTHING``, in one
  order everywhere so concurrent writers never deadlock) and writes the call's row, one round trip, committed
  when it returns;
- ``calls``: one row per call, numbered by an identity sequence (unique across replicas);
- ``meta``: the schema's version. The library creates the schema and applies :data:`MIGRATIONS` in order, in one
  transaction under an advisory lock, so replicas that start together migrate once; a schema newer than this
  code is a :class:`ConfigurationError`.

"Pending" vs "interrupted" is decided by the database, not by a pid on one host: a call is owned by the writer's
database session (``pg_backend_pid()`` and its ``backend_start``), and reads "pending" while that session is in
``pg_stat_activity``. A SIGKILLed process's connection closes with it, so its calls read "interrupted" from any
replica; a host that vanishes is noticed by the server's TCP keepalives (set per session, about 30 s). A session
that a restart of the server ended is given ``restart_grace`` seconds (from the server's start) to come back:
meanwhile its calls read "pending", since its process is most likely alive and reconnecting.

A database that cannot be reached (at open, restarted, the network cut) is a :class:`TranscriptUnavailable`
naming the URL without its password; the next use connects again, and calls this process began on the lost
session are owned by the new one (a background thread notices a lost session while calls are in flight, and
reconnects). Nothing acknowledged is lost meanwhile: the end of a call (``end(..., wait=False)``, what wrapped
calls send) and a refusal that cannot be written are kept in an *outbox* and sent after reconnecting, oldest first
and before any later write of this process; reads wait for it too, so this process reads what it wrote.
:meth:`PostgresTranscript.flush` and ``close()`` wait for it, bounded. The outbox holds at most ``outbox`` writes
and ``outbox_bytes`` bytes: past that an end is dropped with an error in the log, and its call is closed as
failed (saying so) once the database is back, so it never reads "interrupted" while its process lives.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import select
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from ..._exceptions import ConfigurationError, ContextKeeperError, TranscriptUnavailable, UnknownCall
from .base import Transcript, _content, _Gone, _Row, safe_url

if TYPE_CHECKING:
    import psycopg

__all__ = ["MIGRATIONS", "PostgresTranscript", "TranscriptUnavailable"]

log = logging.getLogger("contextkeeper")


@dataclass(frozen=True, kw_only=True)
class Migration:
    """One step of the schema: ``statements`` (SQL, ``{schema}`` for the quoted schema name) take a schema at
    ``version - 1`` to ``version``."""

    version: int
    name: str
    statements: tuple[str, ...]


#: The schema's history, oldest first; a schema at version N has had the first N applied.
MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        version=1,
        name="entries: content-addressed messages, the trie of message lists, one row per call",
        statements=(
            "CREATE TABLE {schema}.blobs (id uuid PRIMARY KEY, json text NOT NULL)",
            "CREATE TABLE {schema}.nodes (id uuid PRIMARY KEY, parent uuid NOT NULL, blob uuid NOT NULL)",
            """CREATE TABLE {schema}.calls (
                call bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                conversation text NOT NULL,
                time double precision NOT NULL,
                inputs uuid NOT NULL,
                sent uuid NOT NULL,
                tools uuid,
                received uuid,
                dropped text NOT NULL,
                rewritten text NOT NULL,
                report text NOT NULL,
                usage text,
                error text,
                attempts integer NOT NULL
            )""",
            "CREATE INDEX calls_by_conversation ON {schema}.calls (conversation, call)",
        ),
    ),
    Migration(
        version=2,
        name="write-ahead: a call's inputs are stored before it is sent, owned by the session that sends it",
        statements=(
            "ALTER TABLE {schema}.calls ADD COLUMN state text NOT NULL DEFAULT 'done' "
            "CHECK (state IN ('begun', 'done')), ADD COLUMN owner text",
        ),
    ),
    Migration(
        version=3,
        name="a prompt that is the inputs without the dropped ones is not stored again: sent is NULL",
        statements=("ALTER TABLE {schema}.calls ALTER COLUMN sent DROP NOT NULL",),
    ),
    Migration(
        version=4,
        name="refusals: a call refused before it was sent keeps its sizes, not its inputs; the indexes tell whether "
        "anything else uses a message or a node it stored (a table already large is indexed once, here)",
        statements=(
            "ALTER TABLE {schema}.calls DROP CONSTRAINT IF EXISTS calls_state_check",
            "ALTER TABLE {schema}.calls ADD CONSTRAINT calls_state_check CHECK (state IN ('begun', 'done', 'refused'))",
            "CREATE INDEX nodes_by_parent ON {schema}.nodes (parent)",
            "CREATE INDEX nodes_by_blob ON {schema}.nodes (blob)",
            "CREATE INDEX calls_by_inputs ON {schema}.calls (inputs)",
            "CREATE INDEX calls_by_sent ON {schema}.calls (sent) WHERE sent IS NOT NULL",
            "CREATE INDEX calls_by_tools ON {schema}.calls (tools) WHERE tools IS NOT NULL",
            "CREATE INDEX calls_by_received ON {schema}.calls (received) WHERE received IS NOT NULL",
        ),
    ),
)
_LATEST = MIGRATIONS[-1].version
assert [m.version for m in MIGRATIONS] == list(range(1, _LATEST + 1)), "migrations are numbered 1, 2, ..."

# Set on every session (with statement_timeout, so a statement that hangs on a lock fails instead): the server drops
# the session of a host that vanished (no FIN) within about idle + interval * count seconds, and its calls read
# "interrupted".
_SERVER_KEEPALIVE = {"tcp_keepalives_idle": "15", "tcp_keepalives_interval": "5", "tcp_keepalives_count": "3"}
# libpq's own, unless the URL sets them: the client notices a dead server as soon.
_CLIENT_KEEPALIVE = {"keepalives": "1", "keepalives_idle": "15", "keepalives_interval": "5", "keepalives_count": "3"}

_NODE = b"ck.trie.node"  # blake2b personalisation: a node's hash never equals a blob's

# The outbox and the thread that looks after it (seconds, counts).
_DOWN_SECONDS = 1.0  # after a refused connection, writes sent behind go straight to the outbox this long
_WATCH_SECONDS = 0.5  # how often a session with calls in flight is looked at
_NEXT_CHUNK_SECONDS = 0.002  # the pause between chunks of the outbox (other threads take the lock)
_RETRY_SECONDS, _RETRY_MAX_SECONDS = 0.05, 1.0  # connecting again: the first wait, doubled up to the last
_CHUNK = 64  # outbox writes sent per hold of the lock by the thread
_TEND_PASSES = 500_000  # the thread's passes before it leaves (a later call starts it again)
_TRIES = 5  # an outbox write whose statement did not complete on a live session is tried this often
_DROPPED_LIMIT = 100_000  # calls whose end the full outbox dropped, remembered to be closed as failed
_FULL_WARNING_SECONDS = 10.0
_CLOSE_SECONDS = 10.0  # the longest close() waits for the outbox
_ORPHANED = "TranscriptUnavailable: this call's inputs were written but the answer was lost, so it was not sent"
_DROPPED = "TranscriptUnavailable: the end of this call was not recorded"

_COLUMNS = (
    "call, conversation, time, inputs, sent, tools, received, dropped, rewritten, report, usage, error, attempts, "
    "state, owner"
)
# A row that is already there is locked, not written (DO UPDATE ... WHERE false locks every conflicting row and
# updates none): a refusal deleting what nothing uses skips rows locked so (SKIP LOCKED), since the write holding
# the lock is about to use them, and a write that meets a row a refusal locked waits, then stores it again.
_UPSERT = """
WITH b AS (
    INSERT INTO {schema}.blobs (id, json) SELECT * FROM unnest(%s::uuid[], %s::text[])
    ON CONFLICT (id) DO UPDATE SET id = excluded.id WHERE false
), n AS (
    INSERT INTO {schema}.nodes (id, parent, blob) SELECT * FROM unnest(%s::uuid[], %s::uuid[], %s::uuid[])
    ON CONFLICT (id) DO UPDATE SET id = excluded.id WHERE false
)
"""
_STATEMENTS = {
    "insert": _UPSERT
    + """INSERT INTO {schema}.calls (conversation, time, inputs, sent, tools, received, dropped, rewritten, report,
    usage, error, attempts, state, owner) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)
RETURNING call""",
    "update": _UPSERT
    + """UPDATE {schema}.calls SET inputs = %s, sent = %s, tools = %s, received = %s, dropped = %s, rewritten = %s,
    report = %s, usage = %s, error = %s, attempts = %s, state = %s WHERE call = %s
RETURNING call""",
    "path": """WITH RECURSIVE chain (id, parent, blob, depth) AS (
    SELECT id, parent, blob, 0 FROM {schema}.nodes WHERE id = %s
    UNION ALL
    SELECT n.id, n.parent, n.blob, c.depth + 1 FROM {schema}.nodes n JOIN chain c ON n.id = c.parent
) SELECT blob FROM chain ORDER BY depth DESC""",
    # Every ancestor of the given nodes once (UNION stops where paths share a prefix); the paths are put
    # together here.
    "ancestors": """WITH RECURSIVE up (id, parent, blob) AS (
    SELECT id, parent, blob FROM {schema}.nodes WHERE id = ANY(%s::uuid[])
    UNION
    SELECT n.id, n.parent, n.blob FROM {schema}.nodes n JOIN up ON n.id = up.parent
) SELECT id, parent, blob FROM up""",
    "texts": "SELECT id, json FROM {schema}.blobs WHERE id = ANY(%s::uuid[])",
    "count": "SELECT count(*) FROM {schema}.calls",
    "reown": "UPDATE {schema}.calls SET owner = %s WHERE call = ANY(%s::bigint[]) AND state = 'begun'",
    # Calls this process began whose insert's answer a lost session took (the caller got the error, so nothing was
    # sent): closed as failed, found by what the insert wrote.
    "orphans": """UPDATE {schema}.calls c SET state = 'done', error = %s
    FROM unnest(%s::text[], %s::float8[], %s::text[]) AS o (conversation, time, owner)
    WHERE c.conversation = o.conversation AND c.time = o.time AND c.owner = o.owner AND c.state = 'begun'""",
    "dropped": "UPDATE {schema}.calls SET state = 'done', error = %s WHERE call = ANY(%s::bigint[]) "
    "AND state = 'begun'",
    "boot": "SELECT (extract(epoch FROM pg_postmaster_start_time()) * 1000000)::bigint, "
    "extract(epoch FROM clock_timestamp() - pg_postmaster_start_time())::float8",
    # A refusal, in one transaction: the row (locked), replaced; the chain of its inputs; those of them not locked
    # by a write in progress; of those, the ones something else uses (read after the locks are held, so every
    # write that could use them has committed or waits); then the deletes.
    "refused_row": "SELECT inputs, sent, tools, received, state FROM {schema}.calls WHERE call = %s FOR UPDATE",
    "refuse": """UPDATE {schema}.calls SET inputs = %s, sent = NULL, tools = NULL, received = NULL, dropped = %s,
    rewritten = %s, report = %s, usage = NULL, error = %s, attempts = 0, state = 'refused', owner = NULL
    WHERE call = %s""",
    "chain": """WITH RECURSIVE chain (id, parent, blob, depth) AS (
    SELECT id, parent, blob, 0 FROM {schema}.nodes WHERE id = %s
    UNION ALL
    SELECT n.id, n.parent, n.blob, c.depth + 1 FROM {schema}.nodes n JOIN chain c ON n.id = c.parent
) SELECT id, parent, blob FROM chain ORDER BY depth""",
    "lock_nodes": "SELECT id FROM {schema}.nodes WHERE id = ANY(%s::uuid[]) ORDER BY id FOR UPDATE SKIP LOCKED",
    "used_nodes": """SELECT c.id FROM unnest(%s::uuid[]) AS c (id)
    WHERE EXISTS (SELECT 1 FROM {schema}.nodes n WHERE n.parent = c.id AND n.id <> ALL(%s::uuid[]))
    OR EXISTS (SELECT 1 FROM {schema}.calls k WHERE k.inputs = c.id)
    OR EXISTS (SELECT 1 FROM {schema}.calls k WHERE k.sent = c.id)""",
    "delete_nodes": "DELETE FROM {schema}.nodes WHERE id = ANY(%s::uuid[])",
    "lock_blobs": "SELECT id FROM {schema}.blobs WHERE id = ANY(%s::uuid[]) ORDER BY id FOR UPDATE SKIP LOCKED",
    "delete_blobs": """DELETE FROM {schema}.blobs b WHERE b.id = ANY(%s::uuid[])
    AND NOT EXISTS (SELECT 1 FROM {schema}.nodes n WHERE n.blob = b.id)
    AND NOT EXISTS (SELECT 1 FROM {schema}.calls k WHERE k.tools = b.id)
    AND NOT EXISTS (SELECT 1 FROM {schema}.calls k WHERE k.received = b.id)
RETURNING b.id""",
    "version": "SELECT value FROM {schema}.meta WHERE key = 'version'",
    "set_version": "INSERT INTO {schema}.meta (key, value) VALUES ('version', %s) "
    "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
    "meta": "CREATE TABLE IF NOT EXISTS {schema}.meta (key text PRIMARY KEY, value text NOT NULL)",
    "create": "CREATE SCHEMA IF NOT EXISTS {schema}",
}
_STATEMENTS.update(
    {
        "select_one": f"SELECT {_COLUMNS} FROM {{schema}}.calls WHERE call = %s",
        "select_of": f"SELECT {_COLUMNS} FROM {{schema}}.calls WHERE conversation = %s ORDER BY call",
        "select_last_of": f"SELECT {_COLUMNS} FROM {{schema}}.calls WHERE conversation = %s ORDER BY call DESC LIMIT 1",
        "select_all": f"SELECT {_COLUMNS} FROM {{schema}}.calls ORDER BY call",
        "select_last": f"SELECT {_COLUMNS} FROM {{schema}}.calls ORDER BY call DESC LIMIT 1",
        "select_kept_last_of": f"SELECT {_COLUMNS} FROM {{schema}}.calls WHERE conversation = %s "
        "AND state <> 'refused' ORDER BY call DESC LIMIT 1",
        "select_kept_last": f"SELECT {_COLUMNS} FROM {{schema}}.calls WHERE state <> 'refused' "
        "ORDER BY call DESC LIMIT 1",
    }
)
# The writer's session, as stored with the calls it begins, and the settings every session gets.
_SESSION = (
    "SELECT pg_backend_pid(), (SELECT (extract(epoch FROM backend_start) * 1000000)::bigint FROM pg_stat_activity "
    "WHERE pid = pg_backend_pid()), "
    + ", ".join(f"set_config('{name}', %s, false)" for name in (*_SERVER_KEEPALIVE, "statement_timeout"))
)
_SESSIONS = (
    "SELECT pid, (extract(epoch FROM backend_start) * 1000000)::bigint FROM pg_stat_activity WHERE pid = ANY(%s)"
)


# What each parameter of the two writes is, and how each path sends it: the reference through psycopg's adapters,
# the fast one as the text libpq sends (no adaptation: half the time of a write on loopback).
_ARRAYS = ("uuid[]", "text[]", "uuid[]", "uuid[]", "uuid[]")
_CONTENT = ("uuid", "uuid", "uuid", "uuid", "text", "text", "text", "text", "text", "int", "text")
_KINDS = {
    "insert": (*_ARRAYS, "text", "float", *_CONTENT, "text"),
    "update": (*_ARRAYS, *_CONTENT, "int"),
}
_PREPARED = {"insert": b"ck_transcript_insert", "update": b"ck_transcript_update"}


def _uuid(value: int) -> uuid.UUID:
    return uuid.UUID(int=value)


def _quoted_element(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


_ADAPT: dict[str, Any] = {
    "uuid[]": lambda ids: [_uuid(i) for i in ids],
    "text[]": list,
    "uuid": lambda i: None if i is None else _uuid(i),
    "text": lambda v: v,
    "float": lambda v: v,
    "int": lambda v: v,
}
_ENCODE: dict[str, Any] = {
    "uuid[]": lambda ids: ("{" + ",".join(f"{i:032x}" for i in ids) + "}").encode(),
    "text[]": lambda texts: ("{" + ",".join(map(_quoted_element, texts)) + "}").encode(),
    "uuid": lambda i: f"{i:032x}".encode(),
    "text": str.encode,
    "float": lambda v: repr(float(v)).encode(),
    "int": lambda v: str(int(v)).encode(),
}


def _numbered(statement: str) -> bytes:
    """``statement`` with libpq's ``$1, $2, ...`` for psycopg's ``%s`` placeholders."""
    count = iter(range(1, statement.count("%s") + 1))
    return re.sub("%s", lambda _: f"${next(count)}", statement).encode()


def _node_id(parent: int, blob: int) -> int:
    data = parent.to_bytes(16, "big") + blob.to_bytes(16, "big")
    return int.from_bytes(hashlib.blake2b(data, digest_size=16, person=_NODE).digest(), "big")


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _password(url: str) -> str | None:
    import psycopg

    try:
        found = psycopg.conninfo.conninfo_to_dict(url).get("password")
    except psycopg.Error:
        return None
    return str(found) if found else None


def _clean(text: str, secret: str | None) -> str:
    """One line of ``text`` (an error of libpq or the server), without ``secret`` in it."""
    if secret:
        text = text.replace(secret, "***")
    return re.sub(r"\s+", " ", text).strip()


class PostgresTranscript(Transcript):
    """Entries in Postgres at ``url``, in the tables of ``schema``, shared by every process and replica that opens
    the same database and schema; call numbers come from one sequence there.

    One connection (the writer's session, which owns the calls this process begins) shared by threads under the
    transcript's lock, in autocommit: every write is one statement. ``connect_timeout`` and ``statement_timeout``
    (seconds) bound every wait for the database; libpq settings in the URL (``sslmode``, ``options``, ...) are used
    as given and win over this class's defaults (but ``client_encoding``, always UTF8).

    ``fast_writes`` (class attribute, True): a write sends its parameters to libpq as the text it sends anyway;
    False takes the reference path through psycopg's adapters (the tests hold the two equal). The fast path also
    sends ``end(..., wait=False)`` without waiting for its commit (the reference waits): the next use of the
    session reads its result first.

    ``outbox`` and ``outbox_bytes`` bound the writes kept while the database cannot be reached (see the module's
    docstring); ``restart_grace`` (seconds) is how long after a restart of the server the calls of sessions it
    ended read "pending" rather than "interrupted".
    """

    fast_writes = True

    def __init__(
        self,
        url: str,
        *,
        schema: str = "contextkeeper",
        connect_timeout: float = 5.0,
        statement_timeout: float = 30.0,
        outbox: int = 10_000,
        outbox_bytes: int = 64 * 1024 * 1024,
        restart_grace: float = 30.0,
    ) -> None:
        super().__init__()
        self.check_url(url)
        if not isinstance(schema, str) or not schema or "\x00" in schema or len(schema.encode()) > 63:
            raise ConfigurationError(
                f"schema={schema!r} is not a Postgres schema name. Fix: pass a name of 1 to 63 bytes, e.g. "
                "schema='contextkeeper'"
            )
        for name, value in (
            ("connect_timeout", connect_timeout),
            ("statement_timeout", statement_timeout),
            ("restart_grace", restart_grace),
        ):
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ConfigurationError(f"{name} must be a positive number of seconds, got {value!r}")
        for name, count in (("outbox", outbox), ("outbox_bytes", outbox_bytes)):
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise ConfigurationError(f"{name} must be a positive whole number, got {count!r}")
        import psycopg

        self.url, self.schema = url, schema
        self._safe = safe_url(url)
        self._secret = _password(url) or _password_of(url)
        given = psycopg.conninfo.conninfo_to_dict(url)
        defaults = {"connect_timeout": str(max(2, math.ceil(connect_timeout))), "application_name": "contextkeeper"}
        merged = {**defaults, **_CLIENT_KEEPALIVE, **given, "client_encoding": "UTF8"}  # what the fast path sends
        self._conninfo = psycopg.conninfo.make_conninfo("", **merged)
        self._settings = [*_SERVER_KEEPALIVE.values(), f"{round(statement_timeout * 1000)}ms"]
        quoted = _quote(schema)
        self._sql = {name: text.replace("{schema}", quoted) for name, text in _STATEMENTS.items()}
        self._lock_key = int.from_bytes(
            hashlib.blake2b(f"ck.transcript:{schema}".encode(), digest_size=8).digest(), "big"
        )
        self._lock_key -= 1 << 63  # a signed bigint
        self._db: psycopg.Connection[tuple[Any, ...]] | None = None
        self._wait_seconds = connect_timeout + statement_timeout  # the longest a result left in flight takes
        # The write sent on this session whose result is not read yet (begin(), end(wait=False)): read before the
        # session's next use.
        self._in_flight: _Flight | None = None
        self._pid = os.getpid()
        self._owner = ""
        self._prepared: set[str] = set()  # the fast writes prepared on the current session
        self._closed = False
        # Rows of the write in progress, sent with its call's row (id -> text; id -> (parent, blob)).
        self._new_blobs: dict[int, str] = {}
        self._new_nodes: dict[int, tuple[int, int]] = {}
        self._dirty = False  # ids were handed out (or a statement sent) since the last write ended
        # Writes that could not be sent or committed (the session was lost), oldest first: sent before anything else
        # once a session is back. Bounded by count and bytes; what does not fit is dropped (and closed as failed).
        self.outbox_limit, self.outbox_bytes, self.restart_grace = outbox, outbox_bytes, float(restart_grace)
        self._outbox: deque[_Pending] = deque()
        self._outbox_size = 0
        self._orphans: list[tuple[str, float, str]] = []  # begins whose answer a lost session took: (conv, time, owner)
        self._dropped: list[int] = []  # calls whose end did not fit in the outbox
        self._full_warned = -math.inf  # monotonic: when the outbox last said it was full
        self._failed_at = -math.inf  # monotonic: when a connection was last refused
        self._thread: threading.Thread | None = None  # the outbox's (see _tend)
        with self._lock:
            self._migrate(self._connection())

    @staticmethod
    def check_url(url: str) -> None:
        """Raise :class:`ConfigurationError` unless ``url`` is a Postgres URL libpq can read (nothing connects)."""
        try:
            import psycopg
        except ImportError:
            raise ConfigurationError(
                f"transcript={safe_url(url)!r} needs psycopg 3, which is not installed. Fix: pip install "
                "'contextkeeper[shared]'"
            ) from None
        if not url.lower().startswith(("postgresql://", "postgres://")):
            raise ConfigurationError(f"{safe_url(url)!r} is not a postgresql:// or postgres:// URL")
        fix = "write it as postgresql://user[:password]@host[:port]/database[?param=value]"
        try:
            given = psycopg.conninfo.conninfo_to_dict(url)
        except psycopg.Error as error:
            raise ConfigurationError(
                f"transcript={safe_url(url)!r} is not a Postgres URL libpq can read "
                f"({_clean(str(error), _password_of(url))}). Fix: {fix}"
            ) from None
        ports = str(given.get("port") or "5432").split(",")  # (one per host where the URL names several)
        if not all(port.isdigit() and 0 < int(port) < 65536 for port in ports):
            raise ConfigurationError(
                f"transcript={safe_url(url)!r} names port {given['port']!r}, not a port number. Fix: {fix}"
            )

    def __repr__(self) -> str:
        return f"PostgresTranscript({self._safe!r}, schema={self.schema!r})"

    # ---------------------------------------------------------------------------------------- connection
    def _failed(self, db: psycopg.Connection[tuple[Any, ...]], error: BaseException) -> TranscriptUnavailable:
        """The error for a statement that failed on ``db``; a session the failure ended is closed and forgotten (the
        next write connects again)."""
        lost = db.broken or db.closed
        if lost:
            db.close()
            self._db = None
        return self._unavailable(error, lost)

    def _unavailable(self, error: BaseException, lost: bool = True) -> TranscriptUnavailable:
        what = "cannot be reached" if lost else "did not complete a statement"
        failure = TranscriptUnavailable(
            f"the transcript database at {self._safe} {what} ({type(error).__name__}: "
            f"{_clean(str(error), self._secret)}). Fix: start Postgres there or correct transcript=... (the next call "
            "connects again)",
            cause=error,
        )
        failure.fix = "start Postgres at the transcript URL, or correct transcript=..."
        return failure

    def _open(self) -> psycopg.Connection[tuple[Any, ...]]:
        """A new connection, not yet this transcript's session (it may take connect_timeout: the outbox's thread
        opens one without holding the lock)."""
        import psycopg

        try:
            return psycopg.connect(self._conninfo, autocommit=True)
        except psycopg.OperationalError as error:
            raise self._unavailable(error) from None  # (the chained error would print the libpq text as is)

    def _connect(self, db: psycopg.Connection[tuple[Any, ...]] | None = None) -> psycopg.Connection[tuple[Any, ...]]:
        """``db`` (default: a new connection) made this transcript's session: set up, and carrying on the calls
        this process is making (the caller holds the lock)."""
        import psycopg

        if db is None:
            db = self._open()
        try:
            found = db.execute(_SESSION, self._settings).fetchone()
            assert found is not None
            self._owner = f"pg/{found[0]}/{found[1]}"
            self._prepared = set()  # a new session has none of our statements
            # Calls this process is still making, and those whose end or refusal waits in the outbox: the new
            # session carries them on (so they never read interrupted while this process lives).
            calls = [*self._begun, *(item.call for item in self._outbox)]
            if calls:
                db.execute(self._sql["reown"], (self._owner, calls))
            self._sweep(db)
        except psycopg.OperationalError as error:
            db.close()
            raise self._unavailable(error) from None
        return db

    def _connection(self, *, drain: bool = True) -> psycopg.Connection[tuple[Any, ...]]:
        """The session, connected again if it was lost; with ``drain``, the outbox sent first (a write or read of
        this process comes after every write it made before)."""
        if self._closed:
            raise ContextKeeperError(f"the transcript {self._safe} is closed")
        if self._pid != os.getpid():
            # A forked child: the connection is the parent's (psycopg leaves it open for the parent), and so are
            # the calls it began and the writes its outbox holds.
            self._db, self._pid, self._in_flight = None, os.getpid(), None
            self._begun.clear()
            self._outbox.clear()
            self._outbox_size = 0
            self._orphans.clear()
            self._dropped.clear()
            self._thread = None
        self._settle()
        db = self._db
        if db is not None and (db.broken or db.closed or _gone(db)):
            db.close()
            self._db = db = None
        if db is None:
            try:
                db = self._db = self._connect()
            except TranscriptUnavailable:
                self._failed_at = time.monotonic()
                self._wake()
                raise
        if drain and (self._outbox or self._orphans or self._dropped):
            self._drain(db)
        return db

    def _recently_down(self) -> bool:
        """Whether the latest attempt to connect failed a moment ago: a write sent behind then goes to the outbox
        at once rather than waiting for another attempt (which may take connect_timeout)."""
        return self._db is None and time.monotonic() - self._failed_at < _DOWN_SECONDS

    # ---------------------------------------------------------------------------------------- the outbox
    def _queue(self, item: _Pending, *, front: bool = False) -> None:
        """Keep ``item`` (a write that could not be sent or committed) for the next session; ``front``: it was sent
        before anything the outbox holds. Past the outbox's bounds it is dropped, loudly."""
        # The caches may name rows that only a write now waiting stores: forget them, so that every later write
        # carries each row it names (it is sent after, or instead of, the writes it would have relied on).
        self._forget()
        full = len(self._outbox) >= self.outbox_limit or self._outbox_size + item.size > self.outbox_bytes
        if full and not front:
            if len(self._dropped) < _DROPPED_LIMIT:
                self._dropped.append(item.call)
            now = time.monotonic()
            if now - self._full_warned >= _FULL_WARNING_SECONDS:
                self._full_warned = now
                log.error(
                    "the transcript outbox is full (%d writes, %s bytes) while the database at %s cannot be reached: "
                    "the %s of call %s is not recorded, and the call will read failed once the database is back "
                    "(said at most every %.0f s). Fix: bring the database back, or raise the transcript's "
                    "outbox=/outbox_bytes=",
                    len(self._outbox),
                    f"{self._outbox_size:,}",
                    self._safe,
                    "end" if item.kind == "update" else "refusal",
                    item.call,
                    _FULL_WARNING_SECONDS,
                )
        else:
            if front:
                self._outbox.appendleft(item)
            else:
                self._outbox.append(item)
            self._outbox_size += item.size
        self._wake()

    def _drain(self, db: psycopg.Connection[tuple[Any, ...]], limit: int | None = None) -> None:
        """Send the outbox's writes on ``db``, oldest first (at most ``limit``); once it is empty, close the calls
        that will never end (:meth:`_sweep`). A lost session raises :class:`TranscriptUnavailable` and leaves the
        rest for the next one; a write the database refuses as such is dropped, with a warning."""
        import psycopg

        sent = 0
        while self._outbox and (limit is None or sent < limit):  # bounded by the outbox's length
            item = self._outbox[0]
            try:
                if item.kind == "update":
                    assert item.values is not None
                    if self._write_row("update", item.values, db) is None:
                        raise UnknownCall(f"the transcript {self._safe} holds no call {item.call}")
                else:
                    assert item.row is not None
                    self._uncache(self._discard_now(db, item.row))
            except TranscriptUnavailable as error:
                if self._db is not db:
                    raise  # the session is lost: the rest waits for the next one
                item.tries += 1  # the statement did not complete (a timeout): a few more tries
                if item.tries < _TRIES:
                    raise
                log.error(
                    "gave up the %s of call %s in the transcript %s after %d tries: %s",
                    "end" if item.kind == "update" else "refusal",
                    item.call,
                    self._safe,
                    item.tries,
                    _clean(str(error), self._secret),
                )
            except (ContextKeeperError, psycopg.Error) as error:  # refused as such: sending it again cannot help
                log.warning(
                    "could not complete call %s in the transcript %s (it reads interrupted once this process ends): %s",
                    item.call,
                    self._safe,
                    _clean(str(error), self._secret),
                )
            self._outbox.popleft()
            self._outbox_size -= item.size
            sent += 1
        if not self._outbox:
            try:
                self._sweep(db)
            except psycopg.OperationalError as error:
                raise self._failed(db, error) from None

    def _sweep(self, db: psycopg.Connection[tuple[Any, ...]]) -> None:
        """Close as failed (saying why) the calls this process began that will never end: begins whose answer a
        lost session took (their caller got the error, nothing was sent), ends the outbox could not hold."""
        if self._orphans:
            conversations, times, owners = zip(*self._orphans, strict=True)
            error = f"{_ORPHANED} (the transcript database at {self._safe} was lost while they were written)"
            db.execute(self._sql["orphans"], (error, list(conversations), list(times), list(owners)))
            self._orphans.clear()
        if self._dropped:
            error = f"{_DROPPED} (the database at {self._safe} could not be reached and the outbox was full)"
            db.execute(self._sql["dropped"], (error, self._dropped))
            self._dropped.clear()

    def _wake(self) -> None:
        """Start the thread that looks after the session while there is anything to look after (see :meth:`_tend`);
        the caller holds the lock."""
        if self._closed or self._pid != os.getpid() or (self._thread is not None and self._thread.is_alive()):
            return
        if not (self._outbox or self._begun or self._orphans or self._dropped):
            return
        self._thread = threading.Thread(target=self._tend, name="contextkeeper-transcript", daemon=True)
        self._thread.start()

    def _tend(self) -> None:
        """While calls are in flight or writes wait in the outbox: notice a lost session (a restart ends it with a
        message, a dead server closes it) without waiting for the next call, connect again (re-owning the calls in
        flight), and send the outbox a chunk per hold of the lock, so other threads' calls go on in between."""
        delay = _RETRY_SECONDS
        for _ in range(_TEND_PASSES):  # bounded; a later call starts it again
            time.sleep(delay)
            with self._lock:
                if not self._tending():
                    return
                db = self._live_session()
            opened = None
            if db is None:  # connected outside the lock: other threads' calls are not held up meanwhile
                try:
                    opened = self._open()
                except TranscriptUnavailable:
                    with self._lock:
                        self._failed_at = time.monotonic()
                    delay = _backoff(delay)
                    continue
            with self._lock:
                delay = self._tend_pass(opened, delay)
        with self._lock:
            if self._thread is threading.current_thread():
                self._thread = None

    def _tending(self) -> bool:
        """Whether this thread still has anything to look after (the caller holds the lock); once nothing is left,
        it lets go of the transcript (a later call starts another)."""
        if self._closed or self._pid != os.getpid() or self._thread is not threading.current_thread():
            return False
        if not (self._outbox or self._begun or self._orphans or self._dropped):
            self._thread = None
            return False
        return True

    def _live_session(self) -> psycopg.Connection[tuple[Any, ...]] | None:
        """The session, or None where it is lost (then closed and forgotten); the caller holds the lock. Not while a
        result is in flight on it: reading it first is the next use's work."""
        db = self._db
        if db is not None and self._in_flight is None and (db.broken or db.closed or _gone(db)):
            db.close()
            self._db = db = None
        return db

    def _tend_pass(self, opened: psycopg.Connection[tuple[Any, ...]] | None, delay: float) -> float:
        """One pass of :meth:`_tend` under the lock: make ``opened`` (if any) the session, send the outbox a chunk;
        the delay before the next pass."""
        try:
            if opened is not None:
                if self._closed or self._pid != os.getpid() or self._db is not None:
                    opened.close()  # (connected meanwhile by a call, or closed)
                else:
                    self._db = self._connect(opened)
            if self._db is not None and (self._outbox or self._orphans or self._dropped):
                self._drain(self._connection(drain=False), limit=_CHUNK)
            return _NEXT_CHUNK_SECONDS if self._outbox else _WATCH_SECONDS
        except ContextKeeperError:  # (lost again, or closed meanwhile: the next pass looks again)
            return _backoff(delay)

    def _run(
        self, name: str, params: Sequence[Any] = (), db: psycopg.Connection[tuple[Any, ...]] | None = None
    ) -> list[tuple[Any, ...]]:
        import psycopg

        db = db or self._connection()
        try:
            cursor = db.execute(self._sql[name], params, prepare=True)
            return cursor.fetchall() if cursor.description is not None else []
        except psycopg.OperationalError as error:
            raise self._failed(db, error) from None

    def _migrate(self, db: psycopg.Connection[tuple[Any, ...]]) -> None:
        """Bring the schema to :data:`MIGRATIONS`' latest version (once, however many replicas start at once)."""
        import psycopg

        version = self._version(db)
        if version == _LATEST:
            return  # no DDL, no lock: a role that may only read and write the tables opens a migrated schema
        self._check_version(version)
        try:
            with db.transaction():
                # Held until the transaction ends: a replica starting alongside waits here, then sees our version.
                db.execute("SELECT pg_advisory_xact_lock(%s)", (self._lock_key,))
                db.execute(self._sql["create"])
                db.execute(self._sql["meta"])
                version = self._version(db)
                self._check_version(version)
                for migration in MIGRATIONS[version:]:
                    for statement in migration.statements:
                        db.execute(statement.replace("{schema}", _quote(self.schema)))
                db.execute(self._sql["set_version"], (str(_LATEST),))
        except psycopg.OperationalError as error:
            raise self._unavailable(error, db.broken or db.closed) from None
        except psycopg.Error as error:
            raise ConfigurationError(
                f"the transcript schema {self.schema!r} at {self._safe} cannot be created or migrated to version "
                f"{_LATEST} ({type(error).__name__}: {_clean(str(error), self._secret)}). Fix: let this role create "
                "schemas in the database, or open it once as a role that may (later opens need no DDL)"
            ) from None

    def _version(self, db: psycopg.Connection[tuple[Any, ...]]) -> int:
        import psycopg

        try:
            found = db.execute("SELECT to_regclass(%s)", (f"{_quote(self.schema)}.meta",)).fetchone()
            if found is None or found[0] is None:
                return 0
            row = db.execute(self._sql["version"]).fetchone()
        except psycopg.OperationalError as error:
            raise self._unavailable(error, db.broken or db.closed) from None
        return int(row[0]) if row else 0

    def _check_version(self, version: int) -> None:
        if version > _LATEST:
            raise ConfigurationError(
                f"the transcript schema {self.schema!r} at {self._safe} is at version {version}, newer than this "
                f"contextkeeper knows (up to {_LATEST}): a newer release migrated it. Fix: upgrade contextkeeper here "
                "(every replica of one schema runs the newest release), or pass another schema="
            )

    # ---------------------------------------------------------------------------------------- primitives
    # Ids are content hashes, known without asking: nothing is looked up before it is stored, and what a write
    # stores goes with its call's row in one statement.
    def _store_blob(self, digest: str, text: str) -> int:
        blob = int(digest, 16)
        self._new_blobs[blob] = text
        self._dirty = True
        return blob

    def _find_blob(self, digest: str) -> int | None:
        return None

    def _store_node(self, parent: int, blob: int) -> int:
        node = _node_id(parent, blob)
        self._new_nodes[node] = (parent, blob)
        self._dirty = True
        return node

    def _find_node(self, parent: int, blob: int) -> int | None:
        return None

    def _upserts(self) -> list[Any]:
        """The new rows as the five arrays of the upsert (ids as ints), each table's in id order: writers that
        share rows take their key locks in one order, so two never wait on each other."""
        blobs, nodes = sorted(self._new_blobs.items()), sorted(self._new_nodes.items())
        self._new_blobs, self._new_nodes = {}, {}
        self._dirty = True
        return [
            [i for i, _ in blobs],
            [text for _, text in blobs],
            [i for i, _ in nodes],
            [p for _, (p, _) in nodes],
            [b for _, (_, b) in nodes],
        ]

    def _prepare(self, name: str, db: psycopg.Connection[tuple[Any, ...]]) -> psycopg.pq.abc.PGresult | None:
        """Prepare the write ``name`` once per session (the tables exist by then); the failed result, if it failed."""
        import psycopg

        if name in self._prepared:
            return None
        done = db.pgconn.prepare(_PREPARED[name], _numbered(self._sql[name]))
        if done.status != psycopg.pq.ExecStatus.COMMAND_OK:
            return done
        self._prepared.add(name)
        return None

    def _write_row(self, name: str, values: list[Any], db: psycopg.Connection[tuple[Any, ...]]) -> int | None:
        """Run the write ``name`` ("insert" or "update") with ``values`` in :data:`_KINDS` order; the call number it
        returns (None: no such call)."""
        kinds = _KINDS[name]
        if not self.fast_writes:  # the reference: psycopg adapts every value
            rows = self._run(name, [_ADAPT[kind](v) for kind, v in zip(kinds, values, strict=True)], db)
            return int(rows[0][0]) if rows else None
        flight = self._send(name, values, db, _Flight(name=name))
        self._settle()
        if flight.error is not None:
            raise flight.error
        return flight.call

    def _send(self, name: str, values: list[Any], db: psycopg.Connection[tuple[Any, ...]], flight: _Flight) -> _Flight:
        """Send the write ``name`` (fast path: its parameters as the text libpq sends) without waiting for its
        result, which :meth:`_settle` reads into ``flight``."""
        import psycopg

        params = [None if v is None else _ENCODE[kind](v) for kind, v in zip(_KINDS[name], values, strict=True)]
        failure: Exception
        try:
            prepared = self._prepare(name, db)
            if prepared is None:
                db.pgconn.send_query_prepared(_PREPARED[name], cast(Any, params))
                self._in_flight = flight
                self._flush(db)
                return flight
            failure = self._failure(prepared, db)
        except psycopg.OperationalError as error:  # it could not be sent: the connection is gone
            failure = error
        self._in_flight = None
        lost = db.pgconn.status != psycopg.pq.ConnStatus.OK
        if lost:
            db.close()
            self._db = None
        raise self._unavailable(failure, lost) from None

    @staticmethod
    def _returned(result: psycopg.pq.abc.PGresult, db: psycopg.Connection[tuple[Any, ...]]) -> int | bool | None:
        """The call number a write's result holds (None: no row); False when it failed because the session did;
        an error of the statement itself is raised as the reference path raises it."""
        import psycopg

        if result.status == psycopg.pq.ExecStatus.TUPLES_OK:
            return int(result.get_value(0, 0) or b"0") if result.ntuples else None
        PostgresTranscript._failure(result, db)
        return False

    @staticmethod
    def _failure(result: psycopg.pq.abc.PGresult, db: psycopg.Connection[tuple[Any, ...]]) -> Exception:
        """The error a failed result holds: raised here when the statement itself failed (as the reference path
        raises it), returned when the session did."""
        import psycopg

        failure = psycopg.errors.error_from_result(result, encoding="utf-8")
        if db.pgconn.status == psycopg.pq.ConnStatus.OK and not isinstance(failure, psycopg.OperationalError):
            raise failure
        return failure

    def _deadline_wait(self, db: psycopg.Connection[tuple[Any, ...]], deadline: float, write: bool) -> None:
        import psycopg

        left = deadline - time.monotonic()
        if left <= 0:
            raise psycopg.OperationalError(f"no answer from the server within {self._wait_seconds:.0f} s")
        socket = db.pgconn.socket
        select.select([] if write else [socket], [socket] if write else [], [], left)

    def _flush(self, db: psycopg.Connection[tuple[Any, ...]]) -> None:
        """Send what libpq still holds of a statement sent without waiting (the session is non-blocking)."""
        deadline = time.monotonic() + self._wait_seconds
        while db.pgconn.flush():  # bounded: the deadline raises
            self._deadline_wait(db, deadline, write=True)

    def _settle(self) -> None:
        """Read the result of the write in flight on this session into its :class:`_Flight`. On a failure the
        caches go (they may name rows that were not stored); an end()'s failure is logged (its caller has its
        reply), a begin()'s raised by its wait."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return
        import psycopg

        db = self._db
        failure: BaseException | None = None
        try:
            if db is None:
                raise psycopg.OperationalError("the session was closed")
            number = self._returned(self._result(db), db)
            if number is False:
                failure = psycopg.OperationalError(db.pgconn.error_message.decode(errors="replace"))
            elif number is None:
                failure = UnknownCall(f"the transcript {self._safe} holds no call {flight.call}")
            else:
                flight.call = int(number)
                if flight.node is not None:  # a begun call, committed: a new session re-owns it
                    self._begun.setdefault(flight.call, flight.node)
        except psycopg.Error as error:
            failure = error
        flight.done = True
        if failure is None:
            return
        self._forget()
        lost = db is None or db.pgconn.status != psycopg.pq.ConnStatus.OK
        if lost and db is not None:
            db.close()
            self._db = None
        if isinstance(failure, psycopg.OperationalError):
            failure = self._unavailable(failure, lost)
        flight.error = failure
        if flight.begun is not None and lost:
            # A begin whose commit is unknown: its caller gets the error (nothing is sent), and its row, if it was
            # stored, is closed as failed once a session is back.
            self._orphans.append(flight.begun)
            self._wake()
        pending = flight.pending
        if pending is not None and isinstance(failure, TranscriptUnavailable) and (lost or pending.tries < _TRIES):
            # An end sent behind that was not committed: the first write of the next session (or retry).
            pending.tries += 0 if lost else 1
            self._queue(pending, front=True)
            return
        if flight.behind:
            log.warning(
                "could not complete call %s in the transcript %s (it reads interrupted once this process ends): %s",
                flight.call,
                self._safe,
                _clean(str(failure), self._secret),
            )

    def _result(self, db: psycopg.Connection[tuple[Any, ...]]) -> psycopg.pq.abc.PGresult:
        """The result of the statement sent last, read to its end (waiting for the socket only while libpq needs
        more: an answer already here is taken without giving up the GIL)."""
        import psycopg

        deadline = time.monotonic() + self._wait_seconds
        results = []
        for _ in range(4):  # one result, then the end of them
            db.pgconn.consume_input()
            while db.pgconn.is_busy():  # bounded: the deadline raises
                self._deadline_wait(db, deadline, write=False)
                db.pgconn.consume_input()
            result = db.pgconn.get_result()
            if result is None:
                break
            results.append(result)
        if not results:
            raise psycopg.OperationalError("the server sent no result")
        return results[0]

    def _answered(self) -> None:
        """Wait, without holding the transcript's lock, until the write in flight now has its answer here (so that
        the thread that reads it, under the lock, does not wait on the network while the other threads queue)."""
        import psycopg

        deadline = time.monotonic() + self._wait_seconds
        flight = self._in_flight
        for _ in range(100_000):  # bounded: each pass waits 2 ms at most; the deadline ends it sooner
            with self._lock:
                db = self._db
                if flight is None or self._in_flight is not flight or db is None or db.closed:
                    return  # answered, and read by another thread
                try:
                    db.pgconn.consume_input()
                    if not db.pgconn.is_busy():
                        return
                    socket = db.pgconn.socket
                except psycopg.OperationalError:
                    return  # (the reader, under the lock, reports it)
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                # Short: another thread may read the answer between our look and this wait, and the socket then
                # stays quiet.
                select.select([socket], [], [], min(left, 0.002))
            except (OSError, ValueError):  # closed meanwhile by another thread
                return

    def _write(self, store: Any) -> int:
        self._answered()
        with self._lock:
            if self._outbox or self._recently_down():
                self._forget()  # a write that may wait in the outbox carries every row it names (see _queue)
            return super()._write(store)

    def _began(self, call: int, node: int) -> None:
        with self._lock:
            super()._began(call, node)
            self._wake()  # a call in flight: its session is watched until it ends

    def _landed(self, flight: _Flight) -> int:
        """The call number ``flight`` (a begin()'s insert) wrote, once committed; its error if it failed."""
        if self._in_flight is flight:
            self._answered()
        with self._lock:
            if self._in_flight is flight:
                self._settle()
            if flight.error is not None:
                raise flight.error
            assert flight.done  # a later use of the session read it
            return flight.call

    def _blob_texts(self, ids: set[int]) -> dict[int, str]:
        if not ids:
            return {}
        return {r[0].int: str(r[1]) for r in self._run("texts", ([_uuid(i) for i in ids],))}

    def _path(self, node: int) -> list[int]:
        if not node:
            return []
        return [r[0].int for r in self._run("path", (_uuid(node),))]

    def _paths_of(self, nodes: set[int]) -> dict[int, list[int]]:
        wanted = [n for n in nodes if n]
        if len(wanted) <= 1:
            return super()._paths_of(nodes)
        parents = {r[0].int: (r[1].int, r[2].int) for r in self._run("ancestors", ([_uuid(n) for n in wanted],))}
        out: dict[int, list[int]] = {}
        for node in nodes:
            path: list[int] = []
            at = node
            while at:
                at, blob = parents[at]
                path.append(blob)
            out[node] = path[::-1]
        return out

    def _insert_values(self, row: _Row) -> tuple[psycopg.Connection[tuple[Any, ...]], list[Any]]:
        db = self._connection()  # first: the owner is this session's
        owner = None if row.owner is None else self._owner  # begun by this process: owned by its session
        return db, [*self._upserts(), row.conversation, row.time, *_content(row), owner]

    def _insert(self, row: _Row) -> int:
        db, values = self._insert_values(row)
        call = self._write_row("insert", values, db)
        assert call is not None  # an insert returns its row
        return call

    def _insert_later(self, row: _Row) -> Callable[[], int]:
        if not self.fast_writes:  # the reference waits
            return super()._insert_later(row)
        db, values = self._insert_values(row)
        begun = (row.conversation, row.time, self._owner)
        flight = self._send("insert", values, db, _Flight(name="insert", node=row.inputs, begun=begun))
        return lambda: self._landed(flight)

    def _update(self, row: _Row, *, wait: bool = True) -> None:
        values = [*self._upserts(), *_content(row), row.call]
        if wait:
            if self._write_row("update", values, self._connection()) is None:
                raise UnknownCall(f"the transcript {self._safe} holds no call {row.call}")
            return
        # Sent behind: never raised into the caller (who has its reply). Whatever keeps it from being committed now
        # (the session lost, the database down, writes already waiting) puts it in the outbox.
        item = _Pending(kind="update", call=row.call, values=values, size=_weight(values))
        if self._outbox or self._recently_down():
            self._queue(item)
            return
        try:
            db = self._connection()
            if self.fast_writes:
                self._send("update", values, db, _Flight(name="update", call=row.call, behind=True, pending=item))
            elif self._write_row("update", values, db) is None:
                log.warning(
                    "could not complete call %s in the transcript %s: it holds no such call", row.call, self._safe
                )
        except TranscriptUnavailable:
            self._queue(item)

    def _discard(self, row: _Row) -> _Gone:
        item = _Pending(kind="refuse", call=row.call, row=row, size=_weight([row.report, row.error or ""]))
        if self._outbox or self._recently_down():
            self._queue(item)
            return _Gone()
        try:
            return self._discard_now(self._connection(), row)
        except TranscriptUnavailable:
            self._queue(item)  # recorded once the database is back (the caches are forgotten meanwhile)
            return _Gone()

    def _discard_now(self, db: psycopg.Connection[tuple[Any, ...]], row: _Row) -> _Gone:
        """The refusal ``row`` written on ``db``, in one transaction: the begun row replaced, then the nodes of its
        inputs (from the tip up, to the first one something else uses) and the blobs only they and the row named,
        deleted. Rows a write in progress holds locked are kept (that write is about to use them)."""
        import psycopg

        sql = self._sql
        gone = _Gone()
        try:
            with db.transaction():
                found = db.execute(sql["refused_row"], (row.call,)).fetchone()
                if found is None or found[4] != "begun":
                    raise UnknownCall(f"the transcript {self._safe} holds no call {row.call} in flight")
                db.execute(sql["refuse"], (_uuid(0), row.dropped, row.rewritten, row.report, row.error, row.call))
                blobs = [b for b in found[2:4] if b is not None]
                for tip in {found[0], found[1]} - {None, _uuid(0)}:
                    chain = db.execute(sql["chain"], (tip,)).fetchall()  # the tip first
                    ids = [r[0] for r in chain]
                    locked = {r[0] for r in db.execute(sql["lock_nodes"], (ids,))}
                    used = {r[0] for r in db.execute(sql["used_nodes"], (ids, ids))}  # read after the locks
                    unused = []
                    for node, parent, blob in chain:
                        if node not in locked or node in used:
                            break
                        unused.append(node)
                        gone.nodes[node.int] = (parent.int, blob.int)
                        blobs.append(blob)
                    if unused:
                        db.execute(sql["delete_nodes"], (unused,))
                if blobs:
                    candidates = list(dict.fromkeys(blobs))
                    locked_blobs = [r[0] for r in db.execute(sql["lock_blobs"], (candidates,))]
                    for (blob,) in db.execute(sql["delete_blobs"], (locked_blobs,)).fetchall():
                        gone.blobs[blob.int] = f"{blob.int:032x}"
        except psycopg.OperationalError as error:
            raise self._failed(db, error) from None
        return gone

    def _commit(self) -> None:
        self._dirty = False  # each write was one statement, committed when it returned

    def _rollback(self) -> bool:
        # The write's statement failed (and took nothing with it) or was never sent: ids handed out since the last
        # write are not stored, and the caches that hold them must go.
        dirty, self._dirty = self._dirty, False
        self._new_blobs, self._new_nodes = {}, {}
        return dirty

    def _alive(self, owners: set[str]) -> dict[str, bool]:
        sessions: dict[str, tuple[int, str]] = {}
        out: dict[str, bool] = {}
        for owner in owners:
            kind, _, rest = owner.partition("/")
            number, _, started = rest.partition("/")
            if kind == "pg" and number.isdigit():
                sessions[owner] = (int(number), started)
            else:  # not a session's (never written by this class): the base rule
                out.update(super()._alive({owner}))
        if sessions:
            pids = sorted({pid for pid, _ in sessions.values()})
            found = {int(r[0]): r[1] for r in self._run_sessions(_SESSIONS, (pids,))}
            for owner, (session, started) in sessions.items():
                # A session of another role shows its pid but not its start (no pg_read_all_stats): alive.
                out[owner] = session in found and (found[session] is None or str(found[session]) == started)
            ended = [owner for owner, alive in out.items() if not alive and owner in sessions]
            if ended:
                # Sessions a restart of the server ended (they started before it did): their processes are most
                # likely alive and reconnecting (a lost session's calls are re-owned by the next one), so they
                # are given restart_grace seconds from the server's start.
                boot, uptime = self._run_sessions(self._sql["boot"], ())[0]
                if float(uptime) < self.restart_grace:
                    for owner in ended:
                        started = sessions[owner][1]
                        out[owner] = started.isdigit() and int(started) < int(boot)
        return out

    def _run_sessions(self, statement: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        import psycopg

        db = self._connection()
        try:
            return db.execute(statement, params, prepare=True).fetchall()
        except psycopg.OperationalError as error:
            if db.broken or db.closed:
                self._db = None
            raise self._unavailable(error, db.broken or db.closed) from None

    def _select(
        self, conversation: str | None, call: int | None = None, last: bool = False, kept: bool = False
    ) -> list[_Row]:
        if call is not None:
            rows = self._run("select_one", (call,))
            rows = [r for r in rows if conversation is None or r[1] == conversation]
        elif conversation is not None:
            name = "select_kept_last_of" if kept and last else "select_last_of" if last else "select_of"
            rows = self._run(name, (conversation,))
        else:
            rows = self._run("select_kept_last" if kept and last else "select_last" if last else "select_all")
        if kept and not last:
            rows = [r for r in rows if r[13] != "refused"]
        return [
            _Row(
                call=int(r[0]),
                conversation=str(r[1]),
                time=float(r[2]),
                inputs=r[3].int,
                sent=None if r[4] is None else r[4].int,
                tools=None if r[5] is None else r[5].int,
                received=None if r[6] is None else r[6].int,
                dropped=str(r[7]),
                rewritten=str(r[8]),
                report=str(r[9]),
                usage=None if r[10] is None else str(r[10]),
                error=None if r[11] is None else str(r[11]),
                attempts=int(r[12]),
                state=str(r[13]),
                owner=None if r[14] is None else str(r[14]),
            )
            for r in rows
        ]

    def __len__(self) -> int:
        with self._lock:
            return int(self._run("count")[0][0])

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every write of this process is committed: the one in flight, and the outbox's (connecting
        again while the database cannot be reached, for ``timeout`` seconds at most; None: connect_timeout +
        statement_timeout). Still unreachable by then: a :class:`TranscriptUnavailable` that says how many writes
        wait (they stay in the outbox, and are sent once the database is back)."""
        deadline = time.monotonic() + (self._wait_seconds if timeout is None else max(0.0, timeout))
        delay = _RETRY_SECONDS
        for _ in range(1_000_000):  # bounded: the deadline ends it
            with self._lock:
                if self._pid != os.getpid() or self._closed:
                    return  # (a forked child's outbox is its parent's; a closed transcript has none)
                self._settle()
                if not (self._outbox or self._orphans or self._dropped):
                    return
                try:
                    self._connection()
                    continue  # drained (and the calls that will never end closed)
                except TranscriptUnavailable as error:
                    failure = error
                waiting = len(self._outbox)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TranscriptUnavailable(
                    f"{waiting} write(s) of this process (ends or refusals of calls) still wait for the transcript "
                    f"database at {self._safe}, which cannot be reached: {failure}",
                    cause=failure,
                )
            time.sleep(min(delay, left))
            delay = min(2 * delay, _RETRY_MAX_SECONDS)

    def close(self) -> None:
        """Close the session once the outbox is sent (waiting at most ``min(10 s, connect_timeout +
        statement_timeout)``; what is still waiting then is logged as not recorded)."""
        with self._lock:
            mine = self._pid == os.getpid() and not self._closed
        if mine:
            try:
                self.flush(timeout=min(_CLOSE_SECONDS, self._wait_seconds))
            except ContextKeeperError as error:
                log.error(
                    "closing the transcript %s with %d write(s) not recorded (their calls read interrupted): %s",
                    self._safe,
                    len(self._outbox),
                    _clean(str(error), self._secret),
                )
        with self._lock:
            if self._pid == os.getpid():
                self._settle()  # an end() still in flight is committed before the session closes
            self._closed = True
            self._outbox.clear()
            self._outbox_size = 0
            if self._db is not None and self._pid == os.getpid():
                self._db.close()
            self._db = None


@dataclass(eq=False, kw_only=True)
class _Flight:
    """A write sent on the session whose result is read later (:meth:`PostgresTranscript._settle`)."""

    name: str  # "insert" (a begin()) or "update" (an end())
    call: int = 0  # an update's call; an insert's once its result is read
    node: int | None = None  # a begin()'s inputs (its trie node)
    behind: bool = False  # an end(wait=False): nobody waits for it, so a failure is logged
    pending: _Pending | None = None  # an end(wait=False): what the outbox keeps if the session does not commit it
    begun: tuple[str, float, str] | None = None  # a begin(): (conversation, time, owner), to find its row again
    done: bool = False
    error: BaseException | None = None


@dataclass(eq=False, kw_only=True)
class _Pending:
    """A write in the outbox: an end (``values`` of the update, its new rows included) or a refusal (``row``)."""

    kind: str  # "update" or "refuse"
    call: int
    values: list[Any] | None = None
    row: _Row | None = None
    size: int = 0  # bytes it holds, roughly
    tries: int = 0  # sent on a live session without completing


def _weight(values: Sequence[Any]) -> int:
    """The bytes an update's values hold, roughly (the texts, and 16 per id or number)."""
    total = 256
    for value in values:
        if isinstance(value, str):
            total += len(value)
        elif isinstance(value, list):
            total += sum(len(v) if isinstance(v, str) else 16 for v in value)
        else:
            total += 16
    return total


def _password_of(url: str) -> str | None:
    """The password in ``url``'s authority, read without libpq (for the message of a URL libpq refused)."""
    authority = url.partition("://")[2].partition("/")[0]
    user, at, _ = authority.rpartition("@")
    return user.partition(":")[2] or None if at else None


def _backoff(delay: float) -> float:
    """The wait after a failed pass of the outbox's thread: doubled, from _RETRY_SECONDS up to _RETRY_MAX_SECONDS
    (a pass after a short chunk pause starts again from the first)."""
    return min(max(2 * delay, _RETRY_SECONDS), _RETRY_MAX_SECONDS)


def _gone(db: psycopg.Connection[tuple[Any, ...]]) -> bool:
    """Whether an idle connection was closed by the server (a restart, an admin): checked without a round trip, so
    the next statement goes to a new session instead of failing on the dead one."""
    import psycopg

    try:
        for _ in range(4):  # a server that ends a session sends a FATAL message, then closes: read both
            readable, _, _ = select.select([db.pgconn.socket], [], [], 0)
            if not readable:
                break
            db.pgconn.consume_input()  # raises at the end of the stream
    except (psycopg.OperationalError, OSError, ValueError):
        return True
    return db.pgconn.status != psycopg.pq.ConnStatus.OK
