"""What replicas should learn once, kept in Redis: server facts, detected dialects and verified summaries.

``ContextKeeper(..., shared="redis://...")`` (by default the ``ledger=`` URL) gives every process and replica
one :class:`SharedState`:

- **server facts** (:class:`ServerFacts`): the limit a server reported in a refusal and the tokens it counts beyond
  ours, read for every wrapped call (by its admission's script, when the Redis ledger is on the same Redis), so no
  replica is refused for what another already learned. Each replica writes its own facts (a field of one Redis
  hash per server, named by the replica's :attr:`SharedState.writer`, with the time it wrote them), and a reader
  combines the fresh ones (:func:`combine`) so that no single replica can move what the others use: the hidden
  tokens are the lower median of the writers' offsets, the limit the least stated limit; facts older than the TTL
  are ignored;
- **detected dialects** (``server="auto"``): the first replica asks the server which it is; the others read the
  answer;
- **summaries** keyed by the hash of their sources, per conversation, and a **per-conversation lease**: one process
  at a time summarises a conversation; the others wait (at most ``summary_wait`` seconds) for its summary, or go
  on without one (the sliding window covers), so one conversation never gets two summaries of the same sources.

Everything stored is a cache with a TTL. Keys are ``{ck:<kind>:<hash>}:<what>``: a conversation's summaries and
its lease share one hash tag, so they sit in one Redis Cluster slot. When Redis cannot be reached the choice is
explicit: ``unavailable="fail"`` raises :class:`SharedUnavailable`; ``"local"`` logs it and goes on with what this
process knows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from .._exceptions import ConfigurationError, SharedUnavailable
from .redis_client import connect, connection_errors, safe_url

__all__ = ["ConversationShare", "ServerFacts", "SharedState", "SharedUnavailable", "SummaryClaim"]

log = logging.getLogger("contextkeeper")

Unavailable = Literal["fail", "local"]
T = TypeVar("T")

# Deletes the lease only while it is still ours (a lease that ran out may be another process's by now).
_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


@dataclass(frozen=True, kw_only=True)
class ServerFacts:
    """What wrapped calls learned about one server, as replicas share it."""

    limit: int | None = None  # the context length the server reported in a refusal
    hidden: int = 0  # tokens kept free for what the server counts beyond our count (agreed by several replies)
    measured: int = 0  # the part of ``hidden`` measured on replies
    confirmed: bool = False  # (read from older writers; a probe's numbers are now learned as drifts)
    kind: str | None = None  # the server software, when recognised
    samples: int = 0  # the drifts behind ``hidden`` (0 and ``hidden`` 0: the writer has no opinion on it)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> ServerFacts:
        return cls._of(json.loads(text))

    @classmethod
    def _of(cls, data: Any) -> ServerFacts:
        if not isinstance(data, dict):
            raise ValueError("server facts must be a JSON object")
        names = {f.name for f in dataclasses.fields(cls)}
        facts = cls(**{k: v for k, v in data.items() if k in names})  # a newer writer's extra fields are ignored
        whole = (facts.hidden, facts.measured, facts.samples, 0 if facts.limit is None else facts.limit)
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in whole):
            raise ValueError("server facts hold a count that is not a whole number >= 0")
        return facts

    @property
    def votes(self) -> bool:
        """Whether ``hidden`` is an opinion (measured, or stated) rather than the default of a writer that only
        learned the limit."""
        return self.samples > 0 or self.hidden > 0


@dataclass(frozen=True, kw_only=True)
class WrittenFacts:
    """One replica's facts about a server, with who wrote them (:attr:`SharedState.writer`) and when (seconds
    since the epoch, the writer's clock)."""

    writer: str
    at: float
    facts: ServerFacts

    def to_json(self) -> str:
        data = {**dataclasses.asdict(self.facts), "writer": self.writer, "at": self.at}
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> WrittenFacts | None:
        """The record in ``text``; None for one that is not a record (a foreign or broken write is ignored, not
        trusted and not fatal)."""
        try:
            return cls._of(json.loads(text))
        except (ValueError, TypeError):
            return None

    @classmethod
    def array(cls, text: str | bytes) -> list[WrittenFacts]:
        """The records of a JSON array of them (as a Redis ledger's admission brings them); what is not a record is
        left out."""
        try:
            data = json.loads(text)
        except ValueError:
            return []
        found = []
        for item in data if isinstance(data, list) else ():
            try:
                found.append(cls._of(item))
            except (ValueError, TypeError):
                continue
        return found

    @classmethod
    def many(cls, texts: Iterable[str | bytes]) -> list[WrittenFacts]:
        return [record for record in map(cls.from_json, texts) if record is not None]

    @classmethod
    def _of(cls, data: Any) -> WrittenFacts:
        facts = ServerFacts._of(data)
        at, writer = data.get("at"), data.get("writer")
        if isinstance(at, bool) or not isinstance(at, (int, float)) or not isinstance(writer, str):
            raise ValueError("a shared fact without its writer and time")
        return cls(writer=writer, at=float(at), facts=facts)

    def fresh(self, now: float, ttl: float) -> bool:
        """Written within ``ttl`` seconds of ``now`` (a record from the future beyond that is as stale)."""
        return abs(now - self.at) <= ttl


def lower_median(values: Sequence[int]) -> int:
    """The lower median: with two values the smaller, so one writer of two cannot raise it."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def combine(records: Iterable[WrittenFacts], *, now: float, ttl: float) -> ServerFacts | None:
    """What the fresh ``records`` say together: a single writer's facts as written; several writers' limit is the
    least they stated, their hidden tokens the lower median of those that have an opinion, so a replica that learned
    something wrong (or wrote something hostile) cannot move the others. None when no record is fresh."""
    fresh = [record.facts for record in records if record.fresh(now, ttl)]
    if not fresh:
        return None
    if len(fresh) == 1:
        return fresh[0]
    limits = [facts.limit for facts in fresh if facts.limit is not None]
    voters = [facts for facts in fresh if facts.votes]
    return ServerFacts(
        limit=min(limits) if limits else None,
        hidden=lower_median([facts.hidden for facts in voters]) if voters else 0,
        measured=lower_median([facts.measured for facts in voters]) if voters else 0,
        confirmed=bool(voters) and all(facts.confirmed for facts in voters),
        kind=next((facts.kind for facts in fresh if facts.kind), None),
        samples=sum(facts.samples for facts in voters),
    )


# A replica's writes are kept per writer; a hash holds at most this many (the least recently written go first),
# and a write drops the fields that went stale.
MOST_WRITERS = 64


def _tag(kind: str, name: str) -> str:
    """A hash tag naming one thing (a server, a conversation): hashed, so any name is safe inside braces."""
    return f"{{ck:{kind}:{hashlib.sha256(name.encode()).hexdigest()[:24]}}}"


def _seconds(value: float, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigurationError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


class SharedState:
    """Learned state shared through Redis at ``url``.

    ``ttl``: seconds server facts and detections are kept after their last write; ``summary_ttl``: the same for
    summaries; ``lease``: how long a summarising process holds its conversation (it gives the lease back when its
    summary is stored; a process that dies loses it after this long); ``summary_wait``: how long another process
    waits for that summary before it fits without one. ``unavailable``: "fail" or "local" (see the module)."""

    def __init__(
        self,
        url: str,
        *,
        ttl: float = 86_400.0,
        summary_ttl: float = 7 * 86_400.0,
        lease: float = 120.0,
        summary_wait: float = 30.0,
        unavailable: Unavailable = "fail",
        client: Any = None,
    ) -> None:
        if unavailable not in ("fail", "local"):
            raise ConfigurationError(f"shared_unavailable must be 'fail' or 'local', got {unavailable!r}")
        self.url = url
        self.ttl = _seconds(ttl, "ttl")
        self.summary_ttl = _seconds(summary_ttl, "summary_ttl")
        self.lease = _seconds(lease, "lease")
        self.summary_wait = _seconds(summary_wait, "summary_wait")
        self.unavailable = unavailable
        # Who this process's shared facts are from: host, process and a random part (two keepers in one process
        # are two writers).
        self.writer = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._errors = connection_errors()
        self._lock = threading.Lock()
        self.lost = 0  # operations that found Redis unreachable ("local" mode goes on without them)
        try:
            self.client = client or connect(url)  # a cluster client connects as it is made
            self.client.ping()
        except self._errors as error:
            raise self._unavailable(error) from error
        self._release = self.client.register_script(_RELEASE)
        # Learned facts are written behind the call, in order, so an event loop never waits for Redis.
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ck-shared")

    def __repr__(self) -> str:
        return f"SharedState(url={safe_url(self.url)!r})"

    def _unavailable(self, error: Exception) -> SharedUnavailable:
        failure = SharedUnavailable(
            f"the shared state at {safe_url(self.url)} cannot be reached ({type(error).__name__}: {error}). Fix: "
            "start Redis there or correct shared=..., or set shared_unavailable='local' to go on with what this "
            "process learns"
        )
        failure.fix = "start Redis, correct shared=..., or set shared_unavailable='local'"
        return failure

    def _do(self, operation: Callable[[], T], fallback: T) -> T:
        """``operation()`` against Redis; when Redis is gone, a typed error ("fail") or ``fallback`` ("local")."""
        try:
            return operation()
        except self._errors as error:
            with self._lock:
                self.lost += 1
            if self.unavailable == "fail":
                raise self._unavailable(error) from error
            log.warning("%s; going on without it", self._unavailable(error))
            return fallback

    def _behind(self, operation: Callable[[], Any]) -> None:
        def run() -> None:
            try:
                operation()
            except self._errors as error:
                with self._lock:
                    self.lost += 1
                log.warning("%s; a learned fact was not shared", self._unavailable(error))
            except Exception:  # a writer thread must not die silently
                log.exception("could not share a learned fact")

        self._writer.submit(run)

    def flush(self, timeout: float = 5.0) -> None:
        """Wait (at most ``timeout`` seconds) until the facts written behind so far are in Redis."""
        self._writer.submit(lambda: None).result(timeout=timeout)

    # ------------------------------------------------------------------------------------------ servers
    @staticmethod
    def facts_key(name: str) -> str:
        """The hash of the writers' facts about the server ``name``."""
        return f"{_tag('server', name)}:writers"

    def server(self, name: str) -> ServerFacts | None:
        """What the replicas learned about the server ``name`` (its base URL), combined (:func:`combine`), or
        None."""
        return combine(self.server_records(name), now=time.time(), ttl=self.ttl)

    def server_records(self, name: str) -> list[WrittenFacts]:
        """Each replica's facts about the server ``name`` as written (stale ones included: readers judge)."""
        stored: dict[Any, Any] = self._do(lambda: self.client.hgetall(self.facts_key(name)), {})
        return WrittenFacts.many(stored.values())

    def learn_server(self, name: str, facts: ServerFacts, copies: Sequence[str] = ()) -> None:
        """Share this replica's ``facts`` about ``name`` (written behind: the caller does not wait), also in the
        hashes ``copies`` (where a Redis ledger's admission reads them, under its pool's hash tag). Each write
        stamps the writer and the time, and drops the fields of writers gone stale."""
        keys, ttl, writer = (self.facts_key(name), *copies), self.ttl, self.writer

        def write() -> None:
            now = time.time()
            record = WrittenFacts(writer=writer, at=now, facts=facts).to_json()
            for key in keys:  # (key by key: on Redis Cluster the keys live in different slots)
                drop, others = [], []  # others: (when, field) of the other writers still fresh
                for raw, value in self._held(key).items():
                    field = raw.decode() if isinstance(raw, bytes) else str(raw)
                    if field == writer:
                        continue
                    found = WrittenFacts.from_json(value)
                    if found is None or not found.fresh(now, ttl):
                        drop.append(field)
                    else:
                        others.append((found.at, field))
                others.sort()
                drop += [field for _, field in others[: max(0, len(others) - (MOST_WRITERS - 1))]]
                pipe = self.client.pipeline(transaction=False)
                if drop:
                    pipe.hdel(key, *drop)
                pipe.hset(key, writer, record)
                pipe.pexpire(key, int(ttl * 1000))
                pipe.execute()

        self._behind(write)

    def _held(self, key: str) -> dict[Any, Any]:
        """The fields of the facts hash ``key``; a key of another type there (an older release's single record)
        is dropped, so this release's writes take its place."""
        try:
            return dict(self.client.hgetall(key))
        except self._errors:
            raise
        except Exception as error:
            if "WRONGTYPE" not in str(error):
                raise
            self.client.delete(key)
            return {}

    # --------------------------------------------------------------------------------------- detections
    def detection(self, url: str) -> dict[str, Any] | None:
        """The stored answer of ``server="auto"`` for the server at ``url``, or None."""
        stored = self._do(lambda: self.client.get(f"{_tag('detect', url)}:detection"), None)
        return dict(json.loads(stored)) if stored else None

    def remember_detection(self, url: str, found: dict[str, Any]) -> None:
        key, text = f"{_tag('detect', url)}:detection", json.dumps(found)
        self._do(lambda: self.client.set(key, text, px=int(self.ttl * 1000)), None)

    # ---------------------------------------------------------------------------------------- summaries
    def conversation(self, name: str) -> ConversationShare:
        """The summaries and the lease of one conversation."""
        return ConversationShare(self, name)

    def close(self) -> None:
        """Write what is pending, then close the connection."""
        self._writer.shutdown(wait=True)
        self.client.close()


@dataclass(frozen=True)
class SummaryClaim:
    """This process holds the conversation's summary lease: it summarises, stores, and gives the lease back."""

    share: ConversationShare
    token: str

    def release(self) -> None:
        shared = self.share.shared
        shared._do(lambda: shared._release(keys=[self.share.lease_key], args=[self.token]), None)


@dataclass(frozen=True)
class ConversationShare:
    """One conversation's shared summaries (by the hash of their sources) and its summary lease."""

    shared: SharedState
    name: str

    @property
    def tag(self) -> str:
        return _tag("conv", self.name)

    @property
    def lease_key(self) -> str:
        return f"{self.tag}:summary-lease"

    def _key(self, source: str) -> str:
        return f"{self.tag}:summary:{source}"

    def find(self, sources: Sequence[str]) -> dict[str, str]:
        """The stored summaries among ``sources`` (source hashes), in one round trip."""
        if not sources:
            return {}
        keys = [self._key(s) for s in sources]
        found = self.shared._do(lambda: self.shared.client.mget(keys), [None] * len(keys))
        pairs = zip(sources, found, strict=True)
        return {s: v.decode() if isinstance(v, bytes) else str(v) for s, v in pairs if v is not None}

    def store(self, source: str, summary: str) -> None:
        shared = self.shared
        shared._do(lambda: shared.client.set(self._key(source), summary, px=int(shared.summary_ttl * 1000)), None)

    def claim(self, source: str) -> SummaryClaim | str | None:
        """Take the lease to summarise ``source``: a :class:`SummaryClaim` (this process summarises), the summary
        another process stored meanwhile, or None when another process held the lease for all of
        ``summary_wait`` seconds. With Redis gone in "local" mode, this process summarises."""
        shared = self.shared
        deadline = time.monotonic() + shared.summary_wait
        pause = 0.01
        token = uuid.uuid4().hex
        lease = int(shared.lease * 1000)
        while True:
            done = self.find([source]).get(source)
            if done is not None:
                return done
            if shared._do(lambda: bool(shared.client.set(self.lease_key, token, nx=True, px=lease)), True):
                done = self.find([source]).get(source)  # stored between our look and our claim
                if done is not None:
                    SummaryClaim(self, token).release()
                    return done
                return SummaryClaim(self, token)
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.2)
