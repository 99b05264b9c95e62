"""What replicas should learn once, kept in Redis: server facts, detected dialects and verified summaries.

``ContextKeeper(..., shared="redis://...")`` (by default the ``ledger=`` URL) gives every process and replica
one :class:`SharedState`:

- **server facts** (:class:`ServerFacts`): the limit a server reported in a refusal and the tokens it counts beyond
  ours, read for every wrapped call (by its admission's script, when the Redis ledger is on the same Redis), so no
  replica is refused for what another already learned;
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
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from ._exceptions import ConfigurationError, TransportError
from ._redis import connect, connection_errors, safe_url

__all__ = ["ConversationShare", "ServerFacts", "SharedState", "SharedUnavailable", "SummaryClaim"]

log = logging.getLogger("contextkeeper")

Unavailable = Literal["fail", "local"]
T = TypeVar("T")

# Deletes the lease only while it is still ours (a lease that ran out may be another process's by now).
_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


class SharedUnavailable(TransportError):
    """The shared state's Redis could not be reached (``shared_unavailable="local"`` goes on without it)."""


@dataclass(frozen=True, kw_only=True)
class ServerFacts:
    """What wrapped calls learned about one server, as replicas share it."""

    limit: int | None = None  # the context length the server reported in a refusal
    hidden: int = 0  # tokens kept free for what the server counts beyond our count
    measured: int = 0  # the part of ``hidden`` measured on replies
    confirmed: bool = False  # a refusal sent without the implied offset bore it out
    kind: str | None = None  # the server software, when recognised

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> ServerFacts:
        data = json.loads(text)
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})  # a newer writer's extra fields are ignored


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
    def server(self, name: str) -> ServerFacts | None:
        """What the replicas learned about the server ``name`` (its base URL), or None."""
        stored = self._do(lambda: self.client.get(f"{_tag('server', name)}:facts"), None)
        return ServerFacts.from_json(stored) if stored else None

    def learn_server(self, name: str, facts: ServerFacts, copies: Sequence[str] = ()) -> None:
        """Share ``facts`` about ``name`` (written behind: the caller does not wait), also at the keys ``copies``
        (where a Redis ledger's admission reads them, under its pool's hash tag)."""
        keys, text, ttl = (f"{_tag('server', name)}:facts", *copies), facts.to_json(), int(self.ttl * 1000)

        def write() -> None:
            for key in keys:  # (one SET each: on Redis Cluster the keys live in different slots)
                self.client.set(key, text, px=ttl)

        self._behind(write)

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
