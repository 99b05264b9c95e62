"""Active-token admission: keep the KV cache of concurrent calls through one keeper within what the GPU holds.

Each call reserves its prompt plus its answer (``prompt_tokens + max_tokens``) while it is in flight. A
:class:`Ledger` admits a call when the tokens already active plus its own fit the capacity; otherwise it waits
(mode ``"wait"``, with a timeout) or, in mode ``"shrink"``, admits it at once with a smaller budget the caller
fits its prompt to. Threads and asyncio tasks share one ledger; admission is first come, first served, so a
large call is never starved by a stream of small ones.

A ticket may carry a lease: held longer than ``lease`` seconds without being renewed, it is released by the
ledger itself (a wrapped stream renews its lease with every chunk, so only one that nobody reads or closes runs out).

``capacity_from_plan`` gives the capacity when the model and GPU are known: the KV tokens the GPU holds after
weights, runtime overhead and the prefill peak, from the memory planner.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from .._exceptions import AdmissionTimeout, ConfigurationError, ExceedsCapacity

__all__ = ["AdmissionTimeout", "ExceedsCapacity", "Ledger", "Ticket", "capacity_from_plan"]

Mode = Literal["wait", "shrink"]

log = logging.getLogger("contextkeeper")


@dataclass(eq=False)
class Ticket:
    """One admitted call: ``tokens`` it holds now, what it ``requested``, how long it ``waited`` and whether
    it was ``shrunk`` below its request. Released when the ``admit`` block exits (also on an exception), or by
    the ledger once its ``lease`` (seconds) runs out without a :meth:`renew` (``expired`` then says so)."""

    ledger: Ledger = field(repr=False)
    requested: int
    tokens: int
    waited: float
    shrunk: bool
    label: str | None = None
    released: bool = False
    lease: float | None = None
    expires: float | None = field(default=None, repr=False)  # time.monotonic() deadline
    expired: bool = False
    # The shared facts about a server, as JSON, read by a shared ledger's admission script (RedisLedger.acquire's
    # ``facts=``); None: not asked, or none stored.
    facts: str | None = field(default=None, repr=False)

    def renew(self) -> None:
        """Start the lease again (a stream calls it with every chunk)."""
        if self.lease is not None:
            self.expires = time.monotonic() + self.lease

    def resize(self, tokens: int) -> None:
        """Hold ``tokens`` instead (the real prompt after the fit is usually smaller than the reservation).
        Shrinking always succeeds and wakes waiting calls; growing succeeds only into free room, else
        :class:`ExceedsCapacity`."""
        self.ledger._resize(self, _check_tokens(tokens))

    def release(self, *, wait: bool = True) -> None:
        """Give the tokens back (idempotent). ``wait=False`` (what wrapped calls do): a shared ledger may send the
        release behind and return at once; until it lands, its lease keeps the tokens booked."""
        self.ledger._release(self, wait=wait)


def _check_tokens(tokens: int, what: str = "tokens") -> int:
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise ConfigurationError(f"{what} must be an integer >= 0, got {tokens!r}")
    return tokens


def _check_seconds(value: float | None, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
        raise ConfigurationError(f"{what} must be a number of seconds > 0 (or None: no limit), got {value!r}")
    return float(value)


class _Waiter:
    """A call in the queue. Async waiters carry their loop and a future to wake; threads wait on the condition."""

    __slots__ = ("future", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.loop = loop
        self.future: asyncio.Future[None] | None = None


class Ledger:
    """The KV tokens active across concurrent calls, and their admission.

    ``capacity_tokens``: the most tokens in flight at once (None: unlimited; the ledger still tracks
    ``active`` and ``peak``). ``mode``: ``"wait"`` queues a call until its tokens fit; ``"shrink"`` admits it
    at once with what is free when that is at least its ``minimum``, and queues it otherwise. ``timeout``:
    the longest a call waits before :class:`AdmissionTimeout`. ``lease``: the seconds a ticket is held at most
    without being renewed (None: until released; each ``acquire`` may set its own). ``source`` says where the
    capacity came from (``"kv_capacity"``, ``"planned"``), for the advice in errors.
    """

    def __init__(
        self,
        capacity_tokens: int | None,
        *,
        mode: Mode = "wait",
        timeout: float = 30.0,
        lease: float | None = None,
        source: str | None = None,
    ) -> None:
        if capacity_tokens is not None:
            _check_tokens(capacity_tokens, "capacity_tokens")
        if mode not in ("wait", "shrink"):
            raise ConfigurationError(f"mode must be 'wait' or 'shrink', got {mode!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout < float("inf"):
            raise ConfigurationError(f"timeout must be a number of seconds >= 0, got {timeout!r}")
        self.capacity = capacity_tokens
        self.mode: Mode = mode
        self.timeout = float(timeout)
        self.lease = _check_seconds(lease, "lease")
        self.source = source
        # One threading lock guards everything, for threads and event loops alike: critical sections are a few
        # arithmetic operations, so taking it from a coroutine never blocks a loop for long. Threads sleep on
        # the condition; an asyncio task sleeps on a future of its own loop, which a release from any thread
        # resolves through call_soon_threadsafe. So one ledger serves threads and any number of loops.
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._queue: deque[_Waiter] = deque()
        self._tickets: dict[int, Ticket] = {}
        self.active = 0
        self.peak = 0
        self.admitted = 0
        self.waits = 0  # admissions that had to wait
        self.shrinks = 0
        self.timeouts = 0
        self.expired = 0  # tickets released because their lease ran out

    def __repr__(self) -> str:
        cap = "unlimited" if self.capacity is None else f"{self.capacity:,}"
        return f"Ledger(active={self.active:,}, capacity={cap}, peak={self.peak:,}, mode={self.mode!r})"

    @property
    def in_flight(self) -> int:
        """Calls holding a ticket now."""
        return len(self._tickets)

    def available(self) -> int | None:
        """Tokens free now (None: unlimited)."""
        with self._lock:
            self._expire(time.monotonic())
            return None if self.capacity is None else max(0, self.capacity - self.active)

    # ------------------------------------------------------------------------------------- decision
    def _validate(self, tokens: int, minimum: int | None, label: str | None) -> int:
        """The smallest grant the call accepts; raises at once when even that can never fit."""
        _check_tokens(tokens)
        if minimum is not None:
            _check_tokens(minimum, "minimum")
        # The minimum only matters to a ledger that may shrink.
        floor = tokens if self.mode == "wait" else min(tokens, 1 if minimum is None else minimum)
        if self.capacity is not None and floor > self.capacity:
            what = "requested" if floor == tokens else "needs at least"
            shrinkable = self.mode == "wait" and minimum is not None and minimum <= self.capacity
            raise ExceedsCapacity(
                requested=floor,
                capacity=self.capacity,
                label=label,
                what=what,
                source=self.source,
                shrinkable=shrinkable,
            )
        return floor

    def _grant(self, waiter: _Waiter, tokens: int, floor: int) -> int | None:
        """The tokens to admit ``waiter`` with now, or None. Called with the lock held; the one decision both
        the sync and the async side make. First come, first served: only the head of the queue is admitted."""
        if self._queue[0] is not waiter:
            return None
        if self.capacity is None:
            return tokens
        free = self.capacity - self.active
        if tokens <= free:
            return tokens
        if self.mode == "shrink" and free >= floor and free > 0:
            return free
        return None

    def _admit(
        self, waiter: _Waiter, tokens: int, granted: int, waited: float, label: str | None, lease: float | None
    ) -> Ticket:
        """Book a grant (lock held) and let the next in the queue try."""
        self._queue.popleft()
        self.active += granted
        self.peak = max(self.peak, self.active)
        self.admitted += 1
        self.waits += waited > 0
        self.shrinks += granted < tokens
        ticket = Ticket(
            self, requested=tokens, tokens=granted, waited=waited, shrunk=granted < tokens, label=label, lease=lease
        )
        ticket.renew()
        self._tickets[id(ticket)] = ticket
        self._wake()
        return ticket

    def _expire(self, now: float) -> float | None:
        """Release the tickets whose lease ran out (lock held); the seconds until the next one runs out, if any."""
        due = [t for t in self._tickets.values() if t.expires is not None and t.expires <= now]
        for ticket in due:
            log.warning(
                "released %s KV tokens of %s: held %.0f s without a sign of life (its lease); a stream that is "
                "neither read to the end nor closed holds its tokens until then",
                f"{ticket.tokens:,}",
                ticket.label or "a call",
                ticket.lease or 0.0,
            )
            ticket.expired = True
            self._drop(ticket)
            self.expired += 1
        deadlines = [t.expires for t in self._tickets.values() if t.expires is not None]
        return max(0.0, min(deadlines) - now) if deadlines else None

    def _pause(self, waited: float, limit: float) -> float:
        """How long a waiter sleeps before it looks again (lock held): until its timeout or the next lease ends."""
        pause = limit - waited
        until_lease = self._expire(time.monotonic())
        return pause if until_lease is None else min(pause, until_lease + 0.001)

    def _timeout(self, waiter: _Waiter, tokens: int, waited: float, label: str | None) -> AdmissionTimeout:
        self.timeouts += 1
        self._leave(waiter)  # the next in the queue may fit where this one did not
        return AdmissionTimeout(
            requested=tokens,
            active=self.active,
            capacity=self.capacity or 0,
            waited=waited,
            in_flight=len(self._tickets),
            label=label,
            source=self.source,
            mode=self.mode,
        )

    def _leave(self, waiter: _Waiter) -> None:
        """Take a waiter that gave up out of the queue (lock held)."""
        if waiter in self._queue:
            self._queue.remove(waiter)
            self._wake()

    def _wake(self) -> None:
        """Tell every waiter the ledger changed (lock held)."""
        self._changed.notify_all()
        for waiter in self._queue:
            future = waiter.future
            if waiter.loop is not None and future is not None and not future.done():
                with contextlib.suppress(RuntimeError):  # its loop has closed: nobody is waiting there
                    waiter.loop.call_soon_threadsafe(_resolve, future)

    def _release(self, ticket: Ticket, *, wait: bool = True) -> None:
        with self._lock:
            self._drop(ticket)

    def _drop(self, ticket: Ticket) -> None:
        """Give a ticket's tokens back (lock held; idempotent)."""
        if ticket.released:
            return
        ticket.released = True
        self._tickets.pop(id(ticket), None)
        self.active -= ticket.tokens
        self._wake()

    def _resize(self, ticket: Ticket, tokens: int) -> None:
        with self._lock:
            if ticket.released:
                raise ConfigurationError("cannot resize a released ticket")
            grow = tokens - ticket.tokens
            if grow > 0 and self.capacity is not None and self.active + grow > self.capacity:
                raise ExceedsCapacity(
                    requested=self.active + grow,
                    capacity=self.capacity,
                    label=ticket.label,
                    what="would hold",
                    source=self.source,
                )
            self.active += grow
            self.peak = max(self.peak, self.active)
            ticket.tokens = tokens
            if grow < 0:
                self._wake()

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
        """Block until ``tokens`` (in mode "shrink": at least ``minimum``) are admitted; the caller releases the
        ticket. Prefer ``with ledger.admit(...)``. ``lease``: this ticket's lease (default: the ledger's)."""
        floor = self._validate(tokens, minimum, label)
        limit = self.timeout if timeout is None else timeout
        held = _check_seconds(lease, "lease") if lease is not None else self.lease
        started = time.monotonic()
        blocked = False
        waiter = _Waiter()
        with self._lock:
            self._queue.append(waiter)
            try:
                while True:
                    granted = self._grant(waiter, tokens, floor)
                    waited = time.monotonic() - started
                    if granted is not None:
                        return self._admit(waiter, tokens, granted, waited if blocked else 0.0, label, held)
                    if waited >= limit:
                        raise self._timeout(waiter, tokens, waited, label)
                    pause = self._pause(waited, limit)
                    if self._grant(waiter, tokens, floor) is None:  # expired leases may have made room
                        blocked = True
                        self._changed.wait(pause)
            except BaseException:
                self._leave(waiter)  # interrupted while queued: let the calls behind go
                raise

    @contextlib.contextmanager
    def admit(
        self,
        tokens: int,
        *,
        minimum: int | None = None,
        label: str | None = None,
        timeout: float | None = None,
        lease: float | None = None,
    ) -> Iterator[Ticket]:
        """``with ledger.admit(prompt + max_tokens) as ticket:`` admits the call (waiting, or shrinking per
        the mode) and releases its tokens when the block exits, also on an exception."""
        ticket = self.acquire(tokens, minimum=minimum, label=label, timeout=timeout, lease=lease)
        try:
            yield ticket
        finally:
            ticket.release()

    # ----------------------------------------------------------------------------------------- async
    async def acquire_async(
        self,
        tokens: int,
        *,
        minimum: int | None = None,
        label: str | None = None,
        timeout: float | None = None,
        lease: float | None = None,
    ) -> Ticket:
        """The awaitable :meth:`acquire`: waits on the running loop, never blocking it."""
        floor = self._validate(tokens, minimum, label)
        limit = self.timeout if timeout is None else timeout
        held = _check_seconds(lease, "lease") if lease is not None else self.lease
        started = time.monotonic()
        blocked = False
        loop = asyncio.get_running_loop()
        waiter = _Waiter(loop)
        with self._lock:
            self._queue.append(waiter)
        try:
            while True:
                with self._lock:
                    granted = self._grant(waiter, tokens, floor)
                    waited = time.monotonic() - started
                    if granted is not None:
                        return self._admit(waiter, tokens, granted, waited if blocked else 0.0, label, held)
                    if waited >= limit:
                        raise self._timeout(waiter, tokens, waited, label)
                    pause = self._pause(waited, limit)
                    if self._grant(waiter, tokens, floor) is not None:
                        continue  # expired leases made room
                    # A new future each round, made under the lock, so no wake-up between the check and the
                    # wait is lost.
                    future: asyncio.Future[None] = loop.create_future()
                    waiter.future = future
                blocked = True
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(future, pause)
        except BaseException:
            # Cancelled (or the timeout above): leave the queue so the calls behind can go.
            with self._lock:
                self._leave(waiter)
            raise

    @contextlib.asynccontextmanager
    async def admit_async(
        self,
        tokens: int,
        *,
        minimum: int | None = None,
        label: str | None = None,
        timeout: float | None = None,
        lease: float | None = None,
    ) -> AsyncIterator[Ticket]:
        """``async with ledger.admit_async(...) as ticket:`` — :meth:`admit` for asyncio tasks."""
        ticket = await self.acquire_async(tokens, minimum=minimum, label=label, timeout=timeout, lease=lease)
        try:
            yield ticket
        finally:
            ticket.release()

    def stats(self) -> dict[str, Any]:
        """The counters, for reports."""
        with self._lock:
            self._expire(time.monotonic())
            return {
                "capacity": self.capacity,
                "mode": self.mode,
                "active": self.active,
                "peak": self.peak,
                "in_flight": len(self._tickets),
                "queued": len(self._queue),
                "admitted": self.admitted,
                "waits": self.waits,
                "shrinks": self.shrinks,
                "timeouts": self.timeouts,
                "expired": self.expired,
            }


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def capacity_from_plan(
    model: Any,
    gpu: Any,
    *,
    concurrency: int = 1,
    gpus: int = 1,
    runtime: str = "vllm",
    kv_dtype: str = "auto",
    weights_dtype: str = "auto",
    settings: Any = None,
    **runtime_settings: Any,
) -> int:
    """The KV tokens ``gpus`` × ``gpu`` hold for ``model`` on ``runtime`` after weights, overhead and the
    prefill peak: the most tokens ``concurrency`` equal sequences hold together (windows, states and block
    rounding included, as the planner counts them). Unlike the plan's ``max_context`` it is not capped at the
    model's own maximum context: a server's KV pool is shared by all calls, however long each may be.

    Raises :class:`ConfigurationError` when the weights alone leave no room for any KV cache.
    """
    from ..memory.plan import kv_pool_tokens, plan

    pool = kv_pool_tokens(
        model,
        gpu,
        concurrency=concurrency,
        gpus=gpus,
        runtime=runtime,
        kv_dtype=kv_dtype,
        weights_dtype=weights_dtype,
        settings=settings,
        **runtime_settings,
    )
    if pool <= 0:
        checked = plan(model, gpu, context=1, gpus=gpus, runtime=runtime, kv_dtype=kv_dtype, advise=False)
        b = checked.breakdown
        raise ConfigurationError(
            f"{checked.model} on {checked.gpu} ({checked.runtime}) leaves no room for a KV cache: weights "
            f"{b.weights / 2**30:.1f} GiB + overhead {b.overhead / 2**30:.1f} GiB + prefill "
            f"{b.prefill_peak / 2**30:.1f} GiB of {b.capacity / 2**30:.1f} GiB. Fix: a quantised checkpoint "
            "(weights_dtype='fp8' or 'int4'), more GPUs (gpus=) or a bigger GPU"
        )
    return pool
