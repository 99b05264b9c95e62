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
import logging
import threading
import time
import uuid
import weakref
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
# ARGV: waiter, tokens, floor, lease ms, mode, waiter's life ms. Returns {ticket id or 0, granted, active, reaped}.
_ADMIT = (
    _REAP
    + """
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
  return {0, 0, active, #dead}
end
local stored = redis.call('GET', KEYS[7])
if not stored then
  return {-1, 0, active, #dead}
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
  return {0, 0, active, #dead}
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
return {id, grant, active, #dead}
"""
)
# ARGV: ticket id. Returns the tokens given back (0: the ticket was no longer held).
_RELEASE = """
local n = redis.call('HGET', KEYS[1], ARGV[1])
if not n then return 0 end
redis.call('DECRBY', KEYS[5], n)
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return tonumber(n)
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
    ``poll``: the longest pause between two looks of a waiting call."""

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
        self._stop = threading.Event()
        # The thread holds the ledger weakly: a ledger nobody uses any more stops beating (and its tickets run out).
        self._beat = threading.Thread(
            target=_beating, args=(weakref.ref(self), self._stop, held / 3), name=f"ck-ledger-{pool}", daemon=True
        )
        self._beat.start()
        weakref.finalize(self, self._stop.set)

    def _store_capacity(self) -> int:
        """The pool's capacity: stored by the first ledger of the pool (again after Redis lost it), read by all."""
        self.client.set(self.keys[6], self._stored, nx=True)
        return int(self.client.get(self.keys[6]) or self._stored)

    def __repr__(self) -> str:
        return f"RedisLedger(pool={self.pool!r}, url={_safe(self.url)!r}, mode={self.mode!r})"

    # ---------------------------------------------------------------------------------------- server
    def _run(self, name: str, *args: Any) -> Any:
        try:
            return self._scripts[name](keys=self.keys, args=list(args))
        except self._errors as error:
            raise _unavailable(self.url, error) from error

    async def _run_async(self, name: str, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        if self._async_client is None or self._async_client[0] is not loop:
            # An asyncio client belongs to the loop it was made on: one per loop (asyncio.run makes a new one).
            client = connect(self.url, asynchronous=True)
            scripts = {key: client.register_script(text) for key, text in _SCRIPTS.items()}
            self._async_client = (loop, client, scripts)
        try:
            return await self._async_client[2][name](keys=self.keys, args=list(args))
        except self._errors as error:
            raise _unavailable(self.url, error) from error

    def _ask(self, waiter: str, tokens: int, floor: int) -> tuple[Any, ...]:
        # A waiter that stops asking for ten polls leaves the queue (its process died or gave up).
        return (waiter, tokens, floor, int(self.server_lease * 1000), self.mode, int(max(1.0, self.poll * 10) * 1000))

    def _book(
        self, answer: list[Any], tokens: int, waited: float, label: str | None, lease: float | None
    ) -> Ticket | None:
        fence, granted = int(answer[0]), int(answer[1])
        self.expired += int(answer[3])
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
        ticket = Ticket(
            self, requested=tokens, tokens=granted, waited=waited, shrunk=granted < tokens, label=label, lease=lease
        )
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
    ) -> Ticket:
        """Block until ``tokens`` (in mode "shrink": at least ``minimum``) are admitted in the shared pool."""
        floor = self._validate(tokens, minimum, label)
        limit = self.timeout if timeout is None else timeout
        held = _check_seconds(lease, "lease") if lease is not None else None
        waiter, started, pause = uuid.uuid4().hex, time.monotonic(), 0.002
        try:
            while True:
                waited = time.monotonic() - started
                ticket = self._book(self._run("admit", *self._ask(waiter, tokens, floor)), tokens, waited, label, held)
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
    ) -> Ticket:
        """The awaitable :meth:`acquire`: polls on the running loop, never blocking it."""
        floor = self._validate(tokens, minimum, label)
        limit = self.timeout if timeout is None else timeout
        held = _check_seconds(lease, "lease") if lease is not None else None
        waiter, started, pause = uuid.uuid4().hex, time.monotonic(), 0.002
        try:
            while True:
                waited = time.monotonic() - started
                answer = await self._run_async("admit", *self._ask(waiter, tokens, floor))
                ticket = self._book(answer, tokens, waited, label, held)
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
    def _release(self, ticket: Ticket) -> None:
        if ticket.released:
            return
        ticket.released = True
        with self._held_lock:
            fence = self._fences.pop(ticket, None)
            if fence is not None:
                self._held.pop(fence, None)
        if fence is None:
            return
        try:
            given = self._run("release", fence)
        except LedgerUnavailable as error:
            # The call itself is done: do not turn it into a failure. No heartbeat renews the ticket any more, so
            # the pool takes its tokens back when its lease runs out.
            log.warning("%s; its %s tokens return to the pool within the lease", error, f"{ticket.tokens:,}")
            return
        if not given:
            ticket.expired = True  # its lease ran out: the pool took the tokens back, and nothing is given twice

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
        """Stop the heartbeat (the tickets still held run out within the lease) and close the connections."""
        self._stop.set()
        self._beat.join(timeout=5)
        self.client.close()

    # -------------------------------------------------------------------------------------- reading
    def _state(self) -> dict[str, int]:
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
