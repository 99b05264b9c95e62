"""One KV ledger for every process and replica: admission against a shared pool, kept in Redis.

A :class:`RedisLedger` is a :class:`~contextkeeper.ledger.Ledger` whose active tokens live in Redis, so four
workers of one app, or eight replicas behind a load balancer, admit against the one KV pool their inference
server has. Each decision is one server-side script (checked and booked atomically, timed by Redis's own clock):

- **first come, first served across processes**: a call joins one queue per pool; only its head is admitted,
  so a large call is never starved by a stream of small ones from other processes;
- **leases**: every ticket has a deadline in Redis that this process's heartbeat keeps moving; the tokens of a
  process that dies come back within ``lease`` seconds, and a waiter that stops asking leaves the queue;
- **fencing**: ticket ids are never reused, not even after Redis restarted empty; a holder whose ticket ran out
  cannot release or resize tokens it no longer holds (its ``release`` finds nothing, and ``expired`` says so);
- **one capacity per pool**: the first ledger stores it; replicas read the stored figure (a different one given
  is a warning, not a second truth).

Keys are ``{ck:<pool>}:...``: one hash tag per pool, so every key of a script sits in one Redis Cluster slot.
``url`` is any form :mod:`contextkeeper._redis` reads: one server, TLS, a Redis Cluster, or Sentinel.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import threading
import time
import uuid
import weakref
from collections.abc import Iterator
from typing import Any, Literal

from ._exceptions import ConfigurationError, TransportError
from ._redis import connect, connection_errors
from ._redis import safe_url as _safe
from .ledger import AdmissionTimeout, ExceedsCapacity, Ledger, Mode, Ticket, _check_seconds

__all__ = ["LedgerUnavailable", "RedisLedger"]

log = logging.getLogger("contextkeeper")

Unavailable = Literal["fail", "local"]

# KEYS: held (hash id -> tokens), deadlines (zset id -> ms), queue (zset waiter -> arrival), alive (zset waiter ->
# ms), active, sequence, capacity, peak. The clock is Redis's own (TIME), so every process agrees on deadlines.
_REAP = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local dead = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
for _, id in ipairs(dead) do
  local n = redis.call('HGET', KEYS[1], id)
  if n then
    redis.call('DECRBY', KEYS[5], n)
    redis.call('HDEL', KEYS[1], id)
  end
  redis.call('ZREM', KEYS[2], id)
end
local gone = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now)
for _, w in ipairs(gone) do
  redis.call('ZREM', KEYS[3], w)
  redis.call('ZREM', KEYS[4], w)
end
"""
# ARGV: waiter, tokens, floor, lease ms, mode, waiter's life ms, then ids of tickets this process gives back first
# (releases sent behind, taken along). KEYS[9], when given: server facts to read with the answer. Returns {ticket id
# or 0 (-1: the pool lost its capacity), granted, active, reaped, facts or nil, tokens each given-back ticket freed}.
_ADMIT = (
    _REAP
    + """
local given = {}
for i = 7, #ARGV do
  local n = redis.call('HGET', KEYS[1], ARGV[i])
  given[i - 6] = 0
  if n then
    redis.call('DECRBY', KEYS[5], n)
    redis.call('HDEL', KEYS[1], ARGV[i])
    redis.call('ZREM', KEYS[2], ARGV[i])
    given[i - 6] = tonumber(n)
  end
end
local facts = false
if KEYS[9] then facts = redis.call('GET', KEYS[9]) end
local function answer(id, grant, active)
  return {id, grant, active, #dead, facts, unpack(given)}
end
if redis.call('EXISTS', KEYS[6]) == 0 then
  -- A new pool, or a Redis that restarted empty: ids start at Redis's clock in microseconds, above every id the
  -- pool gave before, so a ticket from before a restart never names one from after it.
  redis.call('SET', KEYS[6], t[1] .. string.format('%06d', tonumber(t[2])))
end
if not redis.call('ZSCORE', KEYS[3], ARGV[1]) then
  redis.call('ZADD', KEYS[3], redis.call('INCR', KEYS[6]), ARGV[1])
end
redis.call('ZADD', KEYS[4], now + tonumber(ARGV[6]), ARGV[1])
local active = tonumber(redis.call('GET', KEYS[5]) or '0')
if redis.call('ZRANGE', KEYS[3], 0, 0)[1] ~= ARGV[1] then
  return answer(0, 0, active)
end
local stored = redis.call('GET', KEYS[7])
if not stored then
  return answer(-1, 0, active)
end
local cap = tonumber(stored)
local tokens, floor = tonumber(ARGV[2]), tonumber(ARGV[3])
local free = cap - active
local grant = false
if cap < 0 or tokens <= free then
  grant = tokens
elseif ARGV[5] == 'shrink' and free >= floor and free > 0 then
  grant = free
end
if not grant then
  return answer(0, 0, active)
end
local id = redis.call('INCR', KEYS[6])
redis.call('HSET', KEYS[1], id, grant)
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[4]), id)
active = redis.call('INCRBY', KEYS[5], grant)
if active > tonumber(redis.call('GET', KEYS[8]) or '0') then
  redis.call('SET', KEYS[8], active)
end
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
return answer(id, grant, active)
"""
)
# ARGV: ticket ids. Returns the tokens each gave back (0: the ticket was no longer held).
_RELEASE = """
local given = {}
for i = 1, #ARGV do
  local n = redis.call('HGET', KEYS[1], ARGV[i])
  given[i] = 0
  if n then
    redis.call('DECRBY', KEYS[5], n)
    redis.call('HDEL', KEYS[1], ARGV[i])
    redis.call('ZREM', KEYS[2], ARGV[i])
    given[i] = tonumber(n)
  end
end
return given
"""
# ARGV: lease ms, then ticket ids. Returns the ids no longer held.
_RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lost = {}
for i = 2, #ARGV do
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 1 then
    redis.call('ZADD', KEYS[2], now + tonumber(ARGV[1]), ARGV[i])
  else
    table.insert(lost, ARGV[i])
  end
end
return lost
"""
# ARGV: ticket id, tokens. Returns {status, active}: 1 done, -1 not held, -2 no room to grow.
_RESIZE = """
local n = redis.call('HGET', KEYS[1], ARGV[1])
local active = tonumber(redis.call('GET', KEYS[5]) or '0')
if not n then return {-1, active} end
local grow = tonumber(ARGV[2]) - tonumber(n)
local cap = tonumber(redis.call('GET', KEYS[7]) or '-1')
if grow > 0 and cap >= 0 and active + grow > cap then return {-2, active} end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
active = redis.call('INCRBY', KEYS[5], grow)
if active > tonumber(redis.call('GET', KEYS[8]) or '0') then redis.call('SET', KEYS[8], active) end
return {1, active}
"""
# ARGV: waiter. Leaves the queue.
_LEAVE = "redis.call('ZREM', KEYS[3], ARGV[1]) redis.call('ZREM', KEYS[4], ARGV[1]) return 1"
# Returns {active, peak, held, queued, capacity} after reaping.
_STATE = (
    _REAP
    + """
return {tonumber(redis.call('GET', KEYS[5]) or '0'), tonumber(redis.call('GET', KEYS[8]) or '0'),
        redis.call('HLEN', KEYS[1]), redis.call('ZCARD', KEYS[3])}
"""
)
_SCRIPTS = {"admit": _ADMIT, "release": _RELEASE, "renew": _RENEW, "resize": _RESIZE, "leave": _LEAVE, "state": _STATE}
_KEYS = ("held", "deadlines", "queue", "alive", "active", "sequence", "capacity", "peak")


def _beating(ref: weakref.ref[RedisLedger], stop: threading.Event, interval: float) -> None:
    while not stop.wait(interval):
        ledger = ref()
        if ledger is None:
            return
        ledger._heartbeat()
        del ledger


def _stopping(stop: threading.Event, closing: threading.Event, releases: _Releases) -> None:
    stop.set()
    closing.set()
    with releases.changed:
        releases.changed.notify_all()


class _Releases:
    """Tickets given back behind (``release(wait=False)``), as (fence, ticket): the next admission of this ledger
    takes them along in its script; when none comes within ``delay`` seconds, the ledger's writer thread sends them
    (:meth:`RedisLedger._send_releases`) in one script."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.changed = threading.Condition()
        self.queued: list[tuple[int, Ticket]] = []
        self.oldest = 0.0  # time.monotonic() when the oldest queued release was given
        self.sending = 0  # batches taken and not yet answered
        self.urgent = False  # flush() or close() asked: send now
        self.closed = False

    def add(self, fence: int, ticket: Ticket) -> bool:
        """Queue a release; False once closed (the caller sends it itself)."""
        with self.changed:
            if self.closed:
                return False
            if not self.queued:
                self.oldest = time.monotonic()
                self.changed.notify_all()
            self.queued.append((fence, ticket))
            return True

    def take(self) -> list[tuple[int, Ticket]]:
        """Everything queued, to send now (the caller calls :meth:`sent` when its answer is in)."""
        with self.changed:
            batch, self.queued = self.queued, []
            self.sending += bool(batch)
            return batch

    def sent(self) -> None:
        with self.changed:
            self.sending -= 1
            self.changed.notify_all()

    def due(self, stop: threading.Event) -> bool:
        """Block the writer until queued releases are due (True) or the ledger stops (False)."""
        with self.changed:
            while not stop.is_set():  # each wait ends within `delay`, or at a notify
                if self.queued and (self.urgent or time.monotonic() - self.oldest >= self.delay):
                    return True
                left = self.delay - (time.monotonic() - self.oldest) if self.queued else self.delay
                self.changed.wait(max(0.0, left))
            return bool(self.queued)

    def flush(self, timeout: float) -> bool:
        """Have the writer send what is queued now, and wait (at most ``timeout`` seconds) until every batch is
        answered; False if that did not happen in time."""
        deadline = time.monotonic() + timeout
        with self.changed:
            self.urgent = True
            self.changed.notify_all()
            while self.queued or self.sending:  # bounded by the deadline
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.changed.wait(left)
            self.urgent = False
            return not (self.queued or self.sending)


def _writing(ref: weakref.ref[RedisLedger], releases: _Releases, stop: threading.Event) -> None:
    while releases.due(stop):
        ledger = ref()
        if ledger is None:
            return
        ledger._send_releases(releases.take())
        del ledger


class LedgerUnavailable(TransportError):
    """The shared ledger's Redis could not be reached (at start, or during an admission)."""


def _unavailable(url: str, error: Exception) -> LedgerUnavailable:
    failure = LedgerUnavailable(
        f"the shared KV ledger at {_safe(url)} cannot be reached ({type(error).__name__}: {error}). Fix: start Redis "
        "there or correct ledger=..., or set ledger_unavailable='local' to admit per process (each process then "
        "admits against the whole capacity)"
    )
    failure.fix = "start Redis, correct ledger=..., or set ledger_unavailable='local'"
    return failure


class RedisLedger(Ledger):
    """A :class:`Ledger` shared through Redis at ``url`` by every process using the same ``pool`` name.

    ``lease``: seconds a ticket stays held in Redis without a heartbeat from its process (a heartbeat thread
    renews every held ticket each ``lease / 3`` seconds, so only a dead or frozen process loses its tokens).
    A stream's own lease (``acquire(..., lease=)``) still runs out in this process when nobody reads it.
    ``poll``: the longest pause between two looks of a waiting call.

    ``ticket.release(wait=False)`` (wrapped calls) gives the tokens back behind the call, in no round trip of its
    own: the next admission's script takes it along, or, when none comes within ``poll`` seconds, a writer thread
    sends it. :meth:`flush`, :meth:`stats` and :meth:`close` send what is queued and wait for it. A release that
    never lands (the process died) is covered by the lease."""

    def __init__(
        self,
        url: str,
        capacity_tokens: int | None,
        *,
        pool: str = "default",
        mode: Mode = "wait",
        timeout: float = 30.0,
        lease: float = 30.0,
        poll: float = 0.05,
        source: str | None = None,
        client: Any = None,
    ) -> None:
        super().__init__(capacity_tokens, mode=mode, timeout=timeout, lease=None, source=source)
        held = _check_seconds(lease, "lease")
        assert held is not None
        self.server_lease = held
        self.poll = _check_seconds(poll, "poll") or 0.05
        if not pool or any(c in pool for c in "{}"):
            raise ConfigurationError(f"pool must be a non-empty name without braces, got {pool!r}")
        self.url, self.pool = url, pool
        self.keys = [f"{{ck:{pool}}}:{name}" for name in _KEYS]
        self._errors = connection_errors()
        try:
            # A cluster client reads the slot layout here: a cluster with no node up is unavailable at once.
            self.client: Any = client or connect(url)
        except self._errors as error:
            raise _unavailable(url, error) from error
        self._async_client: Any = None
        # Registered scripts run as EVALSHA (loaded again where a server lacks them: a restart, another cluster
        # node); every key of a script shares the pool's hash tag, so a cluster sends it to the one slot's node.
        self._scripts = {name: self.client.register_script(text) for name, text in _SCRIPTS.items()}
        self._held: dict[int, Ticket] = {}  # fence id -> ticket of this process
        self._fences: weakref.WeakKeyDictionary[Ticket, int] = weakref.WeakKeyDictionary()
        self._held_lock = threading.Lock()
        self._releases = _Releases(self.poll)
        self._stored = stored = -1 if capacity_tokens is None else capacity_tokens
        try:
            found = self._store_capacity()
        except self._errors as error:
            raise _unavailable(url, error) from error
        if found != stored:
            log.warning(
                "pool %r already has a capacity of %s tokens in %s; this process was given %s and uses the pool's",
                pool,
                "unlimited" if found < 0 else f"{found:,}",
                _safe(url),
                "unlimited" if capacity_tokens is None else f"{capacity_tokens:,}",
            )
        self.capacity = None if found < 0 else found
        self._stop = threading.Event()  # the heartbeat's
        self._closing = threading.Event()  # the release writer's
        # The thread holds the ledger weakly: a ledger nobody uses any more stops beating (and its tickets run out).
        self._beat = threading.Thread(
            target=_beating, args=(weakref.ref(self), self._stop, held / 3), name=f"ck-ledger-{pool}", daemon=True
        )
        self._beat.start()
        self._writer = threading.Thread(
            target=_writing,
            args=(weakref.ref(self), self._releases, self._closing),
            name=f"ck-release-{pool}",
            daemon=True,
        )
        self._writer.start()
        weakref.finalize(self, _stopping, self._stop, self._closing, self._releases)

    def _store_capacity(self) -> int:
        """The pool's capacity: stored by the first ledger of the pool (again after Redis lost it), read by all."""
        self.client.set(self.keys[6], self._stored, nx=True)
        return int(self.client.get(self.keys[6]) or self._stored)

    def __repr__(self) -> str:
        return f"RedisLedger(pool={self.pool!r}, url={_safe(self.url)!r}, mode={self.mode!r})"

    # ---------------------------------------------------------------------------------------- server
    def _run(self, name: str, *args: Any, keys: list[str] | None = None) -> Any:
        try:
            return self._scripts[name](keys=keys or self.keys, args=list(args))
        except self._errors as error:
            raise _unavailable(self.url, error) from error

    async def _run_async(self, name: str, *args: Any, keys: list[str] | None = None) -> Any:
        loop = asyncio.get_running_loop()
        if self._async_client is None or self._async_client[0] is not loop:
            # An asyncio client belongs to the loop it was made on: one per loop (asyncio.run makes a new one).
            client = connect(self.url, asynchronous=True)
            scripts = {key: client.register_script(text) for key, text in _SCRIPTS.items()}
            self._async_client = (loop, client, scripts)
        try:
            return await self._async_client[2][name](keys=keys or self.keys, args=list(args))
        except self._errors as error:
            raise _unavailable(self.url, error) from error

    def facts_key(self, server: str) -> str:
        """Where a copy of the shared facts about ``server`` lives under this pool's hash tag, so the admission
        script reads them (``acquire(..., facts=server)``) in the same round trip, on Redis Cluster too."""
        return f"{{ck:{self.pool}}}:server:{hashlib.sha256(server.encode()).hexdigest()[:24]}"

    def _ask(self, waiter: str, tokens: int, floor: int, batch: list[tuple[int, Ticket]]) -> tuple[Any, ...]:
        # A waiter that stops asking for ten polls leaves the queue (its process died or gave up).
        life = int(max(1.0, self.poll * 10) * 1000)
        return (waiter, tokens, floor, int(self.server_lease * 1000), self.mode, life, *(f for f, _ in batch))

    def _admit_keys(self, facts: str | None) -> list[str] | None:
        return None if facts is None else [*self.keys, self.facts_key(facts)]

    def _book(
        self,
        answer: list[Any],
        tokens: int,
        waited: float,
        label: str | None,
        lease: float | None,
        batch: list[tuple[int, Ticket]],
    ) -> Ticket | None:
        fence, granted = int(answer[0]), int(answer[1])
        self.expired += int(answer[3])
        self._given_back(batch, answer[5:])
        if fence < 0:  # Redis lost the pool (restarted without persistence): store the capacity again
            self._store_capacity()
            return None
        if not fence:
            return None
        with self._lock:
            self.admitted += 1
            self.waits += waited > 0
            self.shrinks += granted < tokens
            self.active, self.peak = int(answer[2]), max(self.peak, int(answer[2]))
        facts = answer[4]
        ticket = Ticket(
            self, requested=tokens, tokens=granted, waited=waited, shrunk=granted < tokens, label=label, lease=lease
        )
        ticket.facts = facts.decode() if isinstance(facts, bytes) else facts
        ticket.renew()
        with self._held_lock:
            self._held[fence] = ticket
            self._fences[ticket] = fence
        return ticket

    def _timed_out(self, tokens: int, waited: float, label: str | None) -> AdmissionTimeout:
        self.timeouts += 1
        state = self._state()
        return AdmissionTimeout(
            requested=tokens,
            active=state["active"],
            capacity=self.capacity or 0,
            waited=waited,
            in_flight=state["in_flight"],
            label=label,
            source=self.source,
            mode=self.mode,
        )

    # ------------------------------------------------------------------------------------------ sync
    def acquire(
        self,
        tokens: int,
        *,
        minimum: int | None = None,
        label: str | None = None,
        timeout: float | None = None,
        lease: float | None = None,
        facts: str | None = None,
    ) -> Ticket:
        """Block until ``tokens`` (in mode "shrink": at least ``minimum``) are admitted in the shared pool.
        ``facts``: a server name whose shared facts (:meth:`facts_key`) the ticket brings back (``ticket.facts``,
        JSON or None), read by the admission's own script."""
        floor = self._validate(tokens, minimum, label)
        limit = self.timeout if timeout is None else timeout
        held = _check_seconds(lease, "lease") if lease is not None else None
        waiter, started, pause = uuid.uuid4().hex, time.monotonic(), 0.002
        keys = self._admit_keys(facts)
        try:
            while True:
                waited = time.monotonic() - started
                with self._taking() as batch:  # this process's releases given behind go along
                    answer = self._run("admit", *self._ask(waiter, tokens, floor, batch), keys=keys)
                    ticket = self._book(answer, tokens, waited, label, held, batch)
                if ticket is not None:
                    return ticket
                if waited >= limit:
                    raise self._timed_out(tokens, waited, label)
                time.sleep(min(pause, max(0.0, limit - waited)))
                pause = min(pause * 2, self.poll)
        except BaseException:
            with contextlib.suppress(LedgerUnavailable):
                self._run("leave", waiter)  # let the calls behind go
            raise

    async def acquire_async(
        self,
        tokens: int,
        *,
        minimum: int | None = None,
        label: str | None = None,
        timeout: float | None = None,
        lease: float | None = None,
        facts: str | None = None,
    ) -> Ticket:
        """The awaitable :meth:`acquire`: polls on the running loop, never blocking it."""
        floor = self._validate(tokens, minimum, label)
        limit = self.timeout if timeout is None else timeout
        held = _check_seconds(lease, "lease") if lease is not None else None
        waiter, started, pause = uuid.uuid4().hex, time.monotonic(), 0.002
        keys = self._admit_keys(facts)
        try:
            while True:
                waited = time.monotonic() - started
                with self._taking() as batch:
                    answer = await self._run_async("admit", *self._ask(waiter, tokens, floor, batch), keys=keys)
                    ticket = self._book(answer, tokens, waited, label, held, batch)
                if ticket is not None:
                    return ticket
                if waited >= limit:
                    raise self._timed_out(tokens, waited, label)
                await asyncio.sleep(min(pause, max(0.0, limit - waited)))
                pause = min(pause * 2, self.poll)
        except BaseException:
            with contextlib.suppress(LedgerUnavailable):
                await self._run_async("leave", waiter)
            raise

    # --------------------------------------------------------------------------------------- tickets
    def _release(self, ticket: Ticket, *, wait: bool = True) -> None:
        if ticket.released:
            return
        ticket.released = True
        with self._held_lock:  # from here the heartbeat no longer renews it
            fence = self._fences.pop(ticket, None)
            if fence is not None:
                self._held.pop(fence, None)
        if fence is None or (not wait and self._releases.add(fence, ticket)):
            return
        self._send_releases([(fence, ticket)], taken=False)

    @contextlib.contextmanager
    def _taking(self) -> Iterator[list[tuple[int, Ticket]]]:
        """The releases queued now, for the script sent in the block; if Redis cannot be reached, they are left to
        the lease (the error itself goes on)."""
        batch = self._releases.take()
        try:
            yield batch
        except LedgerUnavailable as error:
            self._lost(batch, error)
            raise
        finally:
            if batch:
                self._releases.sent()

    def _send_releases(self, batch: list[tuple[int, Ticket]], taken: bool = True) -> None:
        """Give the tickets of ``batch`` (fence, ticket) back in one script (``taken``: from the queue)."""
        try:
            if batch:
                self._given_back(batch, self._run("release", *(fence for fence, _ in batch)))
        except LedgerUnavailable as error:
            self._lost(batch, error)
        finally:
            if taken and batch:
                self._releases.sent()

    def _given_back(self, batch: list[tuple[int, Ticket]], given: list[Any]) -> None:
        for (_, ticket), back in zip(batch, given, strict=True):
            if not int(back):
                ticket.expired = True  # its lease ran out: the pool took the tokens back; nothing is given twice

    def _lost(self, batch: list[tuple[int, Ticket]], error: LedgerUnavailable) -> None:
        """Releases that could not be sent: the calls are done, so no failure; the lease returns the tokens."""
        if batch:
            tokens = sum(ticket.tokens for _, ticket in batch)
            log.warning("%s; %s tokens return to the pool within the lease", error, f"{tokens:,}")

    def flush(self, timeout: float = 5.0) -> None:
        """Send the releases given behind so far, and wait (at most ``timeout`` seconds) until they have landed."""
        self._releases.flush(timeout)

    def _resize(self, ticket: Ticket, tokens: int) -> None:
        if ticket.released:
            raise ConfigurationError("cannot resize a released ticket")
        fence = self._fences.get(ticket)
        status, active = (int(x) for x in self._run("resize", fence or 0, tokens))
        if status == -2:
            raise ExceedsCapacity(
                requested=active + tokens - ticket.tokens,
                capacity=self.capacity or 0,
                label=ticket.label,
                what="would hold",
                source=self.source,
            )
        if status == -1:
            ticket.expired = ticket.released = True
            raise ConfigurationError("cannot resize a ticket whose lease ran out (the pool took its tokens back)")
        ticket.tokens = tokens

    def _heartbeat(self) -> None:
        """Keep this process's tickets held in Redis; let a stream's own lease run out here."""
        now = time.monotonic()
        with self._held_lock:
            tickets = dict(self._held)
        for ticket in tickets.values():
            if ticket.expires is not None and ticket.expires <= now:
                log.warning(
                    "released %s KV tokens of %s: held %.0f s without a sign of life (its lease)",
                    f"{ticket.tokens:,}",
                    ticket.label or "a call",
                    ticket.lease or 0.0,
                )
                self.expired += 1
                with contextlib.suppress(LedgerUnavailable):
                    self._release(ticket)
                ticket.expired = True
        with self._held_lock:
            fences = [fence for fence, ticket in self._held.items() if not ticket.released]
        if not fences:
            return
        try:
            lost = self._run("renew", int(self.server_lease * 1000), *fences)
        except LedgerUnavailable as error:
            log.warning("%s; the tickets held here may run out", error)
            return
        for fence in lost:
            with self._held_lock:
                gone = self._held.pop(int(fence), None)
            if gone is not None:
                gone.expired = gone.released = True

    def close(self) -> None:
        """Send the releases still queued, stop the heartbeat (the tickets still held run out within the lease) and
        close the connections."""
        self._releases.flush(timeout=5)
        with self._releases.changed:
            self._releases.closed = True  # later releases are sent at once
        _stopping(self._stop, self._closing, self._releases)
        self._writer.join(timeout=5)
        self._send_releases(self._releases.take())  # any given between the flush and the close
        self._beat.join(timeout=5)
        self.client.close()

    # -------------------------------------------------------------------------------------- reading
    def _state(self) -> dict[str, int]:
        self.flush()  # this process's own releases are counted
        active, peak, held, queued = (int(x) for x in self._run("state"))
        return {"active": active, "peak": peak, "in_flight": held, "queued": queued}

    @property
    def in_flight(self) -> int:
        """Calls holding a ticket now, in every process."""
        return self._state()["in_flight"]

    def available(self) -> int | None:
        """Tokens free in the pool now (None: unlimited)."""
        active = self._state()["active"]
        return None if self.capacity is None else max(0, self.capacity - active)

    def stats(self) -> dict[str, Any]:
        """The pool's counters (active, peak, in flight, queued: every process) and this process's own."""
        state = self._state()
        return {
            "capacity": self.capacity,
            "mode": self.mode,
            **state,
            "pool": self.pool,
            "admitted": self.admitted,
            "waits": self.waits,
            "shrinks": self.shrinks,
            "timeouts": self.timeouts,
            "expired": self.expired,
        }
