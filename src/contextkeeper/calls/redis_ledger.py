"""One KV ledger for every process and replica: admission against a shared pool, kept in Redis.

A :class:`RedisLedger` is a :class:`~contextkeeper.calls.ledger.Ledger` whose active tokens live in Redis, so four
workers of one app, or eight replicas behind a load balancer, admit against the one KV pool their inference
server has. Each decision is one server-side script (checked and booked atomically, timed by Redis's own clock):

- **first come, first served across processes**: a call joins one queue per pool; only its head is admitted,
  so a large call is never starved by a stream of small ones from other processes;
- **leases**: every ticket has a deadline in Redis that this process's heartbeat keeps moving; the tokens of a
  process that dies come back within ``lease`` seconds, and a waiter that stops asking leaves the queue (a call
  cancelled while it waits leaves at once, and gives back a grant whose answer it never read);
- **fencing**: a ticket's id is its call's own random id, never reused, not even after Redis restarted empty or
  failed over to a replica that lags; a holder whose ticket ran out cannot release or resize tokens it no longer
  holds (its ``release`` finds nothing, and ``expired`` says so);
- **one capacity per pool**: the first ledger stores it (again, after Redis lost it); replicas read the stored
  figure (a different one given is a warning, not a second truth);
- **a pool Redis lost is booked again before it admits**: the pool carries a *generation* (made when its state is
  first written, with the run id of the Redis server that holds it). When a script finds the state gone (Redis
  restarted empty, ``FLUSHALL``) or held by another server process (a restart from a snapshot, a Sentinel or
  Cluster failover to a replica that may lack the latest bookings; told by ``INFO``'s ``run_id``: where a server
  refuses ``INFO`` in scripts, only a pool found empty is noticed), it starts a new generation. Every ledger
  holding tickets asks at least every 0.5 s (``_BEAT``); seeing a new generation it books every ticket it still
  holds again, under the same ids, in one script, before any admission of its own goes on. Meanwhile the new
  pool *settles*: it admits nothing, and grows no ticket, for 2.5 s (``_SETTLE``) from its start, so the holders'
  tickets are back before anyone else is given their room. Re-booked tickets may leave the pool over its capacity
  by what was already in flight; it then admits nothing until it is back under.

  The bound: in-flight tokens stay within the capacity when every live holder reaches the new pool within the
  settle window (a holder asks within 0.5 s, and redis-py's reconnect backoff waits at most 1 s: about 1 s
  of the 2.5 s). A holder that reaches it later (cut off from Redis longer) books its tickets then, and what was
  admitted in between may overlap them. A pool found empty by a ledger that never knew it (started after the
  loss) settles when its Redis server started less than the window ago (a restart just happened; so the first
  admissions on a freshly started Redis wait up to 2.5 s); on a server up longer (a ``FLUSHALL``) it is taken for a
  new pool until the first sign of a ledger that knew the old one (its next heartbeat or call), and settles from
  then to the window's end counted from the generation's start. ``stats()`` says how many tickets this process
  re-booked, and when.

Keys are ``{ck:<pool>}:...``: one hash tag per pool, so every key of a script sits in one Redis Cluster slot.
``url`` is any form :mod:`contextkeeper.calls.redis_client` reads: one server, TLS, a Redis Cluster, or Sentinel.
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

from .._exceptions import ConfigurationError, LedgerUnavailable
from .ledger import AdmissionTimeout, ExceedsCapacity, Ledger, Mode, Ticket, _check_seconds
from .redis_client import connect, connection_errors
from .redis_client import safe_url as _safe

__all__ = ["LedgerUnavailable", "RedisLedger"]

log = logging.getLogger("contextkeeper")

Unavailable = Literal["fail", "local"]

#: The longest pause between two heartbeats of a ledger that holds tickets (shorter when lease / 3 is).
_BEAT = 0.5
#: Seconds a pool whose state Redis lost admits nothing, from the start of its new generation: two heartbeats, and
#: 1.5 s for a holder's reconnection (redis-py backs off at most 1 s between tries) and a busy process.
_SETTLE = 2.5

# KEYS: held (hash ticket id -> tokens), deadlines (zset id -> ms), queue (zset waiter -> arrival), alive (zset
# waiter -> ms), active, sequence, capacity, peak, generation (hash: id, server, born, settle, rebooked). The clock
# is Redis's own (TIME), so every process agrees on deadlines. A ticket's id is the id of the call that asked for it.
_TIME = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""
_REAP = (
    _TIME
    + """
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
)
# The pool's generation, started again when its state is gone or another server process holds it (restart, failover;
# INFO's run_id changes with every server process). `known`: the generation the caller saw last ('' if none): a
# caller that knew an older one proves the pool was lost, not new; so does a server that started less than the settle
# window ago. Returns the generation and the ms it still settles.
_GENERATION = """
local function generation(known)
  local server, up = '', 1000000000
  local info = redis.pcall('INFO', 'server')
  if type(info) == 'string' then
    server = string.match(info, 'run_id:(%x+)') or ''
    up = tonumber(string.match(info, 'uptime_in_seconds:(%d+)') or up)
  end
  local g = redis.call('HMGET', KEYS[9], 'id', 'server', 'born', 'settle')
  local gen, born, settle = g[1], tonumber(g[3] or '0'), tonumber(g[4] or '0')
  if not gen or g[2] ~= server then
    local lost = gen or known ~= ''
    local micros = t[1] .. string.format('%06d', tonumber(t[2]))
    gen, born, settle = micros .. '-' .. string.sub(server, 1, 12), now, 0
    if lost then
      settle = now + SETTLE_MS
    elseif up * 1000 < SETTLE_MS then
      -- Found empty on a server that just started: holders from before its restart may be on their way.
      settle = now + SETTLE_MS - up * 1000
    end
    redis.call('HSET', KEYS[9], 'id', gen, 'server', server, 'born', born, 'settle', settle, 'rebooked', 0)
    -- Arrivals are numbered from Redis's clock in microseconds: above every number a lost (or lagging) pool gave.
    if tonumber(redis.call('GET', KEYS[6]) or '0') < tonumber(micros) then redis.call('SET', KEYS[6], micros) end
  elseif known ~= '' and known ~= gen and settle == 0 and now < born + SETTLE_MS then
    settle = born + SETTLE_MS
    redis.call('HSET', KEYS[9], 'settle', settle)
  end
  return gen, math.max(0, settle - now)
end
""".replace("SETTLE_MS", str(int(_SETTLE * 1000)))
# ARGV: waiter, tokens, floor, lease ms, mode, waiter's life ms, its place in the queue ('' at first), the generation
# this process knows, '1' when it holds tickets, then ids of tickets it gives back first (releases sent behind, taken
# along). KEYS[10], when given: the server's facts (a hash, a field per writer) to read with the answer. Returns
# {status (1 granted: the ticket's id is the waiter's; 0 wait; -1 the pool lost its capacity; -2 book this process's
# tickets again first), granted, active, reaped, facts (a JSON array) or nil, generation, ms the pool still settles,
# the waiter's place, tokens each given-back ticket freed}.
_ADMIT = (
    _REAP
    + _GENERATION
    + """
local given = {}
for i = 10, #ARGV do
  local n = redis.call('HGET', KEYS[1], ARGV[i])
  given[i - 9] = 0
  if n then
    redis.call('DECRBY', KEYS[5], n)
    redis.call('HDEL', KEYS[1], ARGV[i])
    redis.call('ZREM', KEYS[2], ARGV[i])
    given[i - 9] = tonumber(n)
  end
end
local facts = false
if KEYS[10] then
  -- The server's facts: one field per writing replica, brought back as a JSON array of their records.
  local found = redis.pcall('HVALS', KEYS[10])
  if type(found) == 'table' and not found.err and #found > 0 then facts = '[' .. table.concat(found, ',') .. ']' end
end
local gen, settling = generation(ARGV[8])
if not redis.call('ZSCORE', KEYS[3], ARGV[1]) then
  -- A waiter keeps its place across a lost pool: it comes back with it.
  local place = ARGV[7]
  if place == '' then place = redis.call('INCR', KEYS[6]) end
  redis.call('ZADD', KEYS[3], place, ARGV[1])
end
local place = redis.call('ZSCORE', KEYS[3], ARGV[1])
redis.call('ZADD', KEYS[4], now + tonumber(ARGV[6]), ARGV[1])
local function answer(status, grant, active)
  return {status, grant, active, #dead, facts, gen, settling, place, unpack(given)}
end
local active = tonumber(redis.call('GET', KEYS[5]) or '0')
if ARGV[9] == '1' and ARGV[8] ~= gen then
  return answer(-2, 0, active)
end
if settling > 0 or redis.call('ZRANGE', KEYS[3], 0, 0)[1] ~= ARGV[1] then
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
redis.call('HSET', KEYS[1], ARGV[1], grant)
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[4]), ARGV[1])
active = redis.call('INCRBY', KEYS[5], grant)
if active > tonumber(redis.call('GET', KEYS[8]) or '0') then
  redis.call('SET', KEYS[8], active)
end
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
return answer(1, grant, active)
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
# ARGV: lease ms, the generation this process knows, then (ticket id, tokens, generation it was booked under) for
# each ticket it holds. A ticket booked under an older generation is booked again as it is now (the pool lost it
# since); one of this generation that is gone ran out. Returns {generation, ms it settles, ids no longer held, ids
# booked again, active}.
_RENEW = (
    _TIME
    + _GENERATION
    + """
local gen, settling = generation(ARGV[2])
local deadline = now + tonumber(ARGV[1])
local lost, again = {}, {}
for i = 3, #ARGV, 3 do
  local id, n = ARGV[i], tonumber(ARGV[i + 1])
  local had = redis.call('HGET', KEYS[1], id)
  if ARGV[i + 2] ~= gen then
    redis.call('HSET', KEYS[1], id, n)
    redis.call('ZADD', KEYS[2], deadline, id)
    redis.call('INCRBY', KEYS[5], n - tonumber(had or '0'))
    if not had then table.insert(again, id) end
  elseif had then
    redis.call('ZADD', KEYS[2], deadline, id)
  else
    table.insert(lost, id)
  end
end
local active = tonumber(redis.call('GET', KEYS[5]) or '0')
if #again > 0 then
  redis.call('HINCRBY', KEYS[9], 'rebooked', #again)
  if active > tonumber(redis.call('GET', KEYS[8]) or '0') then redis.call('SET', KEYS[8], active) end
end
return {gen, settling, lost, again, active}
"""
)
# ARGV: ticket id, tokens, the generation this process knows. Returns {status, active, generation, ms it settles}:
# 1 done, -1 not held, -2 no room to grow, -3 book this process's tickets again first, -4 settling (no growth yet).
_RESIZE = (
    _TIME
    + _GENERATION
    + """
local gen, settling = generation(ARGV[3])
local active = tonumber(redis.call('GET', KEYS[5]) or '0')
if ARGV[3] ~= gen then return {-3, active, gen, settling} end
local n = redis.call('HGET', KEYS[1], ARGV[1])
if not n then return {-1, active, gen, settling} end
local grow = tonumber(ARGV[2]) - tonumber(n)
if grow > 0 and settling > 0 then return {-4, active, gen, settling} end
local cap = tonumber(redis.call('GET', KEYS[7]) or '-1')
if grow > 0 and cap >= 0 and active + grow > cap then return {-2, active, gen, settling} end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
active = redis.call('INCRBY', KEYS[5], grow)
if active > tonumber(redis.call('GET', KEYS[8]) or '0') then redis.call('SET', KEYS[8], active) end
return {1, active, gen, settling}
"""
)
# ARGV: waiter, then ids of tickets to give back. Leaves the queue, and gives back a grant the waiter never read (its
# ticket id is the waiter's) and the releases it had taken along.
_LEAVE = """
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
for i = 1, #ARGV do
  local n = redis.call('HGET', KEYS[1], ARGV[i])
  if n then
    redis.call('DECRBY', KEYS[5], n)
    redis.call('HDEL', KEYS[1], ARGV[i])
    redis.call('ZREM', KEYS[2], ARGV[i])
  end
end
return 1
"""
# ARGV: the generation this process knows. Returns {generation, ms it settles}.
_CHECK = _TIME + _GENERATION + "return {generation(ARGV[1])}"
# ARGV: the generation this process knows. Returns {active, peak, held, queued, generation, ms it settles, tickets
# booked again in it, its start (ms)} after reaping.
_STATE = (
    _REAP
    + _GENERATION
    + """
local gen, settling = generation(ARGV[1])
local g = redis.call('HMGET', KEYS[9], 'rebooked', 'born')
return {tonumber(redis.call('GET', KEYS[5]) or '0'), tonumber(redis.call('GET', KEYS[8]) or '0'),
        redis.call('HLEN', KEYS[1]), redis.call('ZCARD', KEYS[3]), gen, settling, tonumber(g[1] or '0'),
        tonumber(g[2] or '0')}
"""
)
_SCRIPTS = {
    "admit": _ADMIT,
    "release": _RELEASE,
    "renew": _RENEW,
    "resize": _RESIZE,
    "leave": _LEAVE,
    "check": _CHECK,
    "state": _STATE,
}
_KEYS = ("held", "deadlines", "queue", "alive", "active", "sequence", "capacity", "peak", "generation")


def _text(value: Any) -> str:
    """A script's string answer (bytes from a plain client, str from one that decodes)."""
    return value.decode() if isinstance(value, bytes) else str(value)


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


class _Booking:
    """A ticket this process holds, its id in the pool, and the pool's generation it is booked under."""

    __slots__ = ("fence", "generation", "ticket")

    def __init__(self, fence: str, ticket: Ticket, generation: str) -> None:
        self.fence, self.ticket, self.generation = fence, ticket, generation


# A release to send: (ticket id, the ticket; None for one given back again after it was booked again meanwhile).
_Release = tuple[str, Ticket | None]


class _Releases:
    """Tickets given back behind (``release(wait=False)``), as (fence, ticket): the next admission of this ledger
    takes them along in its script; when none comes within ``delay`` seconds, the ledger's writer thread sends them
    (:meth:`RedisLedger._send_releases`) in one script."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.changed = threading.Condition()
        self.queued: list[_Release] = []
        self.oldest = 0.0  # time.monotonic() when the oldest queued release was given
        self.sending = 0  # batches taken and not yet answered
        self.urgent = False  # flush() or close() asked: send now
        self.closed = False

    def add(self, fence: str, ticket: Ticket | None) -> bool:
        """Queue a release; False once closed (the caller sends it itself)."""
        with self.changed:
            if self.closed:
                return False
            if not self.queued:
                self.oldest = time.monotonic()
                self.changed.notify_all()
            self.queued.append((fence, ticket))
            return True

    def take(self) -> list[_Release]:
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
    renews every held ticket each ``lease / 3`` seconds, so only a dead or frozen process loses its tokens; it
    looks at the pool's generation every ``min(lease / 3, 0.5)`` seconds, and books its tickets again when the
    pool was lost). A stream's own lease (``acquire(..., lease=)``) still runs out in this process when nobody
    reads it. ``poll``: the longest pause between two looks of a waiting call.

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
        self._held: dict[str, _Booking] = {}  # ticket id -> the booking of a ticket of this process
        self._fences: weakref.WeakKeyDictionary[Ticket, str] = weakref.WeakKeyDictionary()
        self._held_lock = threading.Lock()
        self._releases = _Releases(self.poll)
        self._leaving: set[asyncio.Future[None]] = set()  # cancelled waiters' leaves, running on their loops
        self.generation = ""  # the pool's generation, as last seen
        self.rebooked = 0  # tickets of this process booked again after the pool was lost
        self.rebooked_tokens = 0
        self.rebooked_at: float | None = None  # time.time() of the latest
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
        self._saw(self._run("check", "")[0])  # this ledger knows the pool from here on
        self._beat_every = min(held / 3, _BEAT)
        self._renewed = time.monotonic()  # when the heartbeat last sent a renewal
        self._stop = threading.Event()  # the heartbeat's
        self._closing = threading.Event()  # the release writer's
        # The thread holds the ledger weakly: a ledger nobody uses any more stops beating (and its tickets run out).
        self._beat = threading.Thread(
            target=_beating,
            args=(weakref.ref(self), self._stop, self._beat_every),
            name=f"ck-ledger-{pool}",
            daemon=True,
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

    def _ask(self, waiter: str, tokens: int, floor: int, place: str, batch: list[_Release]) -> tuple[Any, ...]:
        # A waiter that stops asking for ten polls leaves the queue (its process died or gave up).
        life = int(max(1.0, self.poll * 10) * 1000)
        live = self._live()
        # The generation this process's tickets are booked under: an older one than the pool's makes the script
        # answer "book them again first".
        known = next((b.generation for b in live if b.generation != self.generation), self.generation)
        lease = int(self.server_lease * 1000)
        holding = "1" if live else "0"
        return (waiter, tokens, floor, lease, self.mode, life, place, known, holding, *(f for f, _ in batch))

    def _admit_keys(self, facts: str | None) -> list[str] | None:
        return None if facts is None else [*self.keys, self.facts_key(facts)]

    def _book(
        self,
        answer: list[Any],
        waiter: str,
        tokens: int,
        waited: float,
        label: str | None,
        lease: float | None,
        batch: list[_Release],
    ) -> tuple[Ticket | None, int, str]:
        """The ticket an admission's ``answer`` granted (or None), its status and the waiter's place in the queue."""
        status, granted = int(answer[0]), int(answer[1])
        self.expired += int(answer[3])
        self._given_back(batch, answer[8:])
        generation = _text(answer[5])
        self._saw(generation)
        place = "" if answer[7] is None else _text(answer[7])
        if status == -1:  # Redis lost the pool (restarted without persistence): store the capacity again
            self._store_capacity()
        if status != 1:
            return None, status, place
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
            self._held[waiter] = _Booking(waiter, ticket, generation)
            self._fences[ticket] = waiter
        return ticket, status, place

    def _timed_out(self, tokens: int, waited: float, label: str | None) -> AdmissionTimeout:
        self.timeouts += 1
        state = self._state()
        error = AdmissionTimeout(
            requested=tokens,
            active=state["active"],
            capacity=self.capacity or 0,
            waited=waited,
            in_flight=state["in_flight"],
            label=label,
            source=self.source,
            mode=self.mode,
        )
        if state["settling"] > 0:  # the wait was the settling, not the room: say so
            why = (
                f"; the pool is settling: its Redis just started or lost the pool (a restart, a flush or a failover), "
                f"so it admits nothing for {_SETTLE:g} s ({state['settling']:.1f} s left) while calls already in "
                "flight are booked again"
            )
            error.args = (str(error).replace(". Fix:", f"{why}. Fix:", 1),)
        return error

    # ------------------------------------------------------------------------ a pool Redis lost
    def _saw(self, generation: Any) -> None:
        self.generation = _text(generation)

    def _live(self) -> list[_Booking]:
        with self._held_lock:
            return [booking for booking in self._held.values() if not booking.ticket.released]

    def _stale(self) -> list[_Booking]:
        """Every live booking of this process when some of them is under an older generation than the pool's (they
        must be booked again before this process is admitted anything more); else none."""
        live = self._live()
        return live if any(booking.generation != self.generation for booking in live) else []

    def _renew_args(self, live: list[_Booking]) -> list[Any]:
        self._renewed = time.monotonic()
        args: list[Any] = [int(self.server_lease * 1000), self.generation]
        for booking in live:
            args += [booking.fence, booking.ticket.tokens, booking.generation]
        return args

    def _renewed_answer(self, sent: list[_Booking], answer: list[Any]) -> None:
        """Take in a renewal's answer: tickets that ran out, and those booked again under the new generation."""
        generation = _text(answer[0])
        lost = {_text(fence) for fence in answer[2]}
        again = {_text(fence) for fence in answer[3]}
        self._saw(generation)
        back: list[str] = []
        tokens = count = 0
        with self._held_lock:
            for booking in sent:
                current = self._held.get(booking.fence) is booking
                if booking.fence in lost:
                    if current:
                        del self._held[booking.fence]
                        booking.ticket.expired = booking.ticket.released = True
                    continue
                booking.generation = generation
                if booking.fence not in again:
                    continue
                if current:
                    count, tokens = count + 1, tokens + booking.ticket.tokens
                else:  # released while it was being booked again: give it back again
                    back.append(booking.fence)
        if count:
            with self._lock:
                self.rebooked += count
                self.rebooked_tokens += tokens
                self.rebooked_at = time.time()
            log.warning(
                "the KV pool %r in %s lost its state (Redis restarted or failed over): booked %d ticket(s) of this "
                "process again (%s tokens) under generation %s",
                self.pool,
                _safe(self.url),
                count,
                f"{tokens:,}",
                generation,
            )
        for fence in back:
            if not self._releases.add(fence, None):
                self._send_releases([(fence, None)], taken=False)

    def _rebook(self, live: list[_Booking]) -> None:
        self._renewed_answer(live, self._run("renew", *self._renew_args(live)))

    async def _rebook_async(self, live: list[_Booking]) -> None:
        self._renewed_answer(live, await self._run_async("renew", *self._renew_args(live)))

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
        waiter, started, pause, place = uuid.uuid4().hex, time.monotonic(), 0.002, ""
        keys = self._admit_keys(facts)
        try:
            while True:
                waited = time.monotonic() - started
                stale = self._stale()
                if stale:  # this process's tickets are booked again before it is admitted anything more
                    self._rebook(stale)
                with self._taking() as batch:  # this process's releases given behind go along
                    answer = self._run("admit", *self._ask(waiter, tokens, floor, place, batch), keys=keys)
                    ticket, status, place = self._book(answer, waiter, tokens, waited, label, held, batch)
                if ticket is not None:
                    return ticket
                if waited >= limit:
                    raise self._timed_out(tokens, waited, label)
                if status != -2:  # -2: the pool was lost; book again at once, then ask again
                    time.sleep(min(pause, max(0.0, limit - waited)))
                    pause = min(pause * 2, self.poll)
        except BaseException:
            with contextlib.suppress(LedgerUnavailable):
                self._run("leave", waiter)  # let the calls behind go (and give back a grant never read)
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
        """The awaitable :meth:`acquire`: polls on the running loop, never blocking it. Cancelled while it waits
        (its client went away), it leaves the queue at once and holds nothing."""
        floor = self._validate(tokens, minimum, label)
        limit = self.timeout if timeout is None else timeout
        held = _check_seconds(lease, "lease") if lease is not None else None
        waiter, started, pause, place = uuid.uuid4().hex, time.monotonic(), 0.002, ""
        keys = self._admit_keys(facts)
        try:
            while True:
                waited = time.monotonic() - started
                stale = self._stale()
                if stale:
                    await self._rebook_async(stale)
                with self._taking() as batch:
                    answer = await self._run_async("admit", *self._ask(waiter, tokens, floor, place, batch), keys=keys)
                    ticket, status, place = self._book(answer, waiter, tokens, waited, label, held, batch)
                if ticket is not None:
                    return ticket
                if waited >= limit:
                    raise self._timed_out(tokens, waited, label)
                if status != -2:
                    await asyncio.sleep(min(pause, max(0.0, limit - waited)))
                    pause = min(pause * 2, self.poll)
        except BaseException:
            # A task group or cancel scope (anyio, as Starlette uses) cancels again at every await of a cancelled
            # task: the leave runs as a task of its own, so it is sent even when this await is cancelled too.
            leaving = asyncio.ensure_future(self._leave_async(waiter))
            self._leaving.add(leaving)
            leaving.add_done_callback(self._leaving.discard)
            await asyncio.shield(leaving)
            raise

    async def _leave_async(self, waiter: str) -> None:
        with contextlib.suppress(LedgerUnavailable):
            await self._run_async("leave", waiter)

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
    def _taking(self) -> Iterator[list[_Release]]:
        """The releases queued now, for the script sent in the block; if Redis cannot be reached, they are left to
        the lease (the error itself goes on); if the block is interrupted (a cancelled task), they are queued again
        (sent twice at worst: a second release finds nothing)."""
        batch = self._releases.take()
        try:
            yield batch
        except LedgerUnavailable as error:
            self._lost(batch, error)
            raise
        except BaseException:
            for fence, _ in batch:
                if not self._releases.add(fence, None):
                    break  # closing: the lease gives them back
            raise
        finally:
            if batch:
                self._releases.sent()

    def _send_releases(self, batch: list[_Release], taken: bool = True) -> None:
        """Give the tickets of ``batch`` (fence, ticket) back in one script (``taken``: from the queue)."""
        try:
            if batch:
                self._given_back(batch, self._run("release", *(fence for fence, _ in batch)))
        except LedgerUnavailable as error:
            self._lost(batch, error)
        finally:
            if taken and batch:
                self._releases.sent()

    def _given_back(self, batch: list[_Release], given: list[Any]) -> None:
        for (_, ticket), back in zip(batch, given, strict=True):
            if ticket is not None and not int(back):
                ticket.expired = True  # its lease ran out: the pool took the tokens back; nothing is given twice

    def _lost(self, batch: list[_Release], error: LedgerUnavailable) -> None:
        """Releases that could not be sent: the calls are done, so no failure; the lease returns the tokens."""
        if batch:
            tokens = sum(ticket.tokens for _, ticket in batch if ticket is not None)
            log.warning("%s; %s tokens return to the pool within the lease", error, f"{tokens:,}")

    def flush(self, timeout: float = 5.0) -> None:
        """Send the releases given behind so far, and wait (at most ``timeout`` seconds) until they have landed."""
        self._releases.flush(timeout)

    def _resize(self, ticket: Ticket, tokens: int) -> None:
        if ticket.released:
            raise ConfigurationError("cannot resize a released ticket")
        fence = self._fences.get(ticket)
        deadline = time.monotonic() + _SETTLE + 1.0
        while True:  # bounded: the pool settles at most _SETTLE seconds, and is booked again in one round
            stale = self._stale()
            if stale:
                self._rebook(stale)
            status, active, generation, settling = self._run("resize", fence or "", tokens, self.generation)
            status, active = int(status), int(active)
            self._saw(generation)
            if status == -4 and time.monotonic() < deadline:  # the pool was lost: grow once its holders are back
                time.sleep(min(int(settling) / 1000 + 0.01, max(0.0, deadline - time.monotonic())))
            elif status != -3 or time.monotonic() >= deadline:
                break
        if status in (-2, -3, -4):
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
        """Keep this process's tickets held in Redis, and booked again if the pool was lost; let a stream's own
        lease run out here."""
        now = time.monotonic()
        with self._held_lock:
            tickets = [booking.ticket for booking in self._held.values()]
        for ticket in tickets:
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
        live = self._live()
        if not live:
            return
        try:
            # Renewed each lease / 3; between renewals only the generation is looked at (one short script).
            due = time.monotonic() - self._renewed >= self.server_lease / 3 - self._beat_every / 2
            if not due and not self._stale():
                self._saw(self._run("check", self.generation)[0])
                due = bool(self._stale())
            if due:
                self._rebook(self._live())
        except LedgerUnavailable as error:
            log.warning("%s; the tickets held here may run out", error)

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
    def _state(self) -> dict[str, Any]:
        self.flush()  # this process's own releases are counted
        answer = self._run("state", self.generation)
        active, peak, held, queued = (int(x) for x in answer[:4])
        self._saw(answer[4])
        return {
            "active": active,
            "peak": peak,
            "in_flight": held,
            "queued": queued,
            "generation": _text(answer[4]),
            "generation_started": int(answer[7]) / 1000,
            "settling": int(answer[5]) / 1000,
            "pool_rebooked": int(answer[6]),
        }

    @property
    def in_flight(self) -> int:
        """Calls holding a ticket now, in every process."""
        return int(self._state()["in_flight"])

    def available(self) -> int | None:
        """Tokens free in the pool now (None: unlimited)."""
        active = int(self._state()["active"])
        return None if self.capacity is None else max(0, self.capacity - active)

    def stats(self) -> dict[str, Any]:
        """The pool's counters (active, peak, in flight, queued: every process), its generation (``generation``,
        started at ``generation_started``, Unix seconds; ``settling``: seconds it still admits nothing after Redis
        lost it; ``pool_rebooked``: tickets every process booked again into it), and this process's own counters
        (``rebooked``, ``rebooked_tokens``: its tickets booked again after Redis lost the pool, the latest at
        ``rebooked_at``, Unix seconds, or None)."""
        state = self._state()
        with self._lock:
            mine = {"rebooked": self.rebooked, "rebooked_tokens": self.rebooked_tokens, "rebooked_at": self.rebooked_at}
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
            **mine,
        }
