"""Active-token admission: keep the KV cache of concurrent calls through one keeper within what the GPU holds.

Each call reserves its prompt plus its answer (``prompt_tokens + max_tokens``) while it is in flight. A
:class:`Ledger` admits a call when the tokens already active plus its own fit the capacity; otherwise it waits
(mode ``"wait"``, with a timeout) or, in mode ``"shrink"``, admits it at once with a smaller budget the caller
fits its prompt to. Threads and asyncio tasks share one ledger; admission is first come, first served, so a
large call is never starved by a stream of small ones.

``capacity_from_plan`` gives the capacity when the model and GPU are known: the KV tokens the GPU holds after
weights, runtime overhead and the prefill peak, from the memory planner.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from ._exceptions import ConfigurationError, ContextKeeperError

__all__ = ["AdmissionTimeout", "ExceedsCapacity", "Ledger", "Ticket", "capacity_from_plan"]

Mode = Literal["wait", "shrink"]

_FIX = (
    "lower concurrency= (fewer calls in flight), raise admission_timeout=, use a bigger GPU, or store the KV "
    "cache in a smaller dtype (kv_dtype='fp8' or 'q8_0') so the GPU holds more tokens"
)


class AdmissionTimeout(ContextKeeperError, TimeoutError):
    """A call waited ``timeout`` seconds for room in the KV ledger and got none."""

    def __init__(
        self, *, requested: int, active: int, capacity: int, waited: float, in_flight: int, label: str | None
    ) -> None:
        self.requested = requested
        self.active = active
        self.capacity = capacity
        self.waited = waited
        self.in_flight = in_flight
        what = f" for {label}" if label else ""
        super().__init__(
            f"waited {waited:.1f} s to admit {requested:,} KV tokens{what}, but {active:,} of the capacity of "
            f"{capacity:,} stayed in use by {in_flight} call(s) in flight (free: {capacity - active:,}, short by "
            f"{requested - (capacity - active):,}). Fix: {_FIX}"
        )


class ExceedsCapacity(ContextKeeperError, ValueError):
    """A call needs more KV tokens on its own than the whole capacity: no amount of waiting admits it."""

    def __init__(self, *, requested: int, capacity: int, label: str | None, what: str = "requested") -> None:
        self.requested = requested
        self.capacity = capacity
        name = f" ({label})" if label else ""
        super().__init__(
            f"a call{name} {what} {requested:,} KV tokens, {requested - capacity:,} more than the capacity of "
            f"{capacity:,} the GPU holds for all calls together. Fix: lower max_tokens or context_window so one "
            "call fits, use mode='shrink' with a smaller minimum, store the KV cache in a smaller dtype "
            "(kv_dtype='fp8' or 'q8_0'), or use a bigger GPU"
        )


@dataclass(eq=False)
class Ticket:
    """One admitted call: ``tokens`` it holds now, what it ``requested``, how long it ``waited`` and whether
    it was ``shrunk`` below its request. Released when the ``admit`` block exits (also on an exception)."""

    ledger: Ledger = field(repr=False)
    requested: int
    tokens: int
    waited: float
    shrunk: bool
    label: str | None = None
    released: bool = False

    def resize(self, tokens: int) -> None:
        """Hold ``tokens`` instead (the real prompt after the fit is usually smaller than the reservation).
        Shrinking always succeeds and wakes waiting calls; growing succeeds only into free room, else
        :class:`ExceedsCapacity`."""
        self.ledger._resize(self, _check_tokens(tokens))

    def release(self) -> None:
        """Give the tokens back (idempotent)."""
        self.ledger._release(self)


def _check_tokens(tokens: int, what: str = "tokens") -> int:
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise ConfigurationError(f"{what} must be an integer >= 0, got {tokens!r}")
    return tokens


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
    the longest a call waits before :class:`AdmissionTimeout`.
    """

    def __init__(self, capacity_tokens: int | None, *, mode: Mode = "wait", timeout: float = 30.0) -> None:
        if capacity_tokens is not None:
            _check_tokens(capacity_tokens, "capacity_tokens")
        if mode not in ("wait", "shrink"):
            raise ConfigurationError(f"mode must be 'wait' or 'shrink', got {mode!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
            raise ConfigurationError(f"timeout must be a number of seconds >= 0, got {timeout!r}")
        self.capacity = capacity_tokens
        self.mode: Mode = mode
        self.timeout = float(timeout)
        # One threading lock guards everything, for threads and event loops alike: critical sections are a few
        # arithmetic operations, so taking it from a coroutine never blocks a loop for long. Threads sleep on
        # the condition; an asyncio task sleeps on a future of its own loop, which a release from any thread
        # resolves through call_soon_threadsafe. So one ledger serves threads and any number of loops.
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._queue: deque[_Waiter] = deque()
        self._tickets: set[int] = set()
        self.active = 0
        self.peak = 0
        self.admitted = 0
        self.waits = 0  # admissions that had to wait
        self.shrinks = 0
        self.timeouts = 0

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
            raise ExceedsCapacity(requested=floor, capacity=self.capacity, label=label, what=what)
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

    def _admit(self, waiter: _Waiter, tokens: int, granted: int, waited: float, label: str | None) -> Ticket:
        """Book a grant (lock held) and let the next in the queue try."""
        self._queue.popleft()
        self.active += granted
        self.peak = max(self.peak, self.active)
        self.admitted += 1
        self.waits += waited > 0
        self.shrinks += granted < tokens
        ticket = Ticket(self, requested=tokens, tokens=granted, waited=waited, shrunk=granted < tokens, label=label)
        self._tickets.add(id(ticket))
        self._wake()
        return ticket

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

    def _release(self, ticket: Ticket) -> None:
        with self._lock:
            if ticket.released:
                return
            ticket.released = True
            self._tickets.discard(id(ticket))
            self.active -= ticket.tokens
            self._wake()

    def _resize(self, ticket: Ticket, tokens: int) -> None:
        with self._lock:
            if ticket.released:
                raise ConfigurationError("cannot resize a released ticket")
            grow = tokens - ticket.tokens
            if grow > 0 and self.capacity is not None and self.active + grow > self.capacity:
                raise ExceedsCapacity(
                    requested=self.active + grow, capacity=self.capacity, label=ticket.label, what="would hold"
                )
            self.active += grow
            self.peak = max(self.peak, self.active)
            ticket.tokens = tokens
            if grow < 0:
                self._wake()

    # ------------------------------------------------------------------------------------------ sync
    def acquire(
        self, tokens: int, *, minimum: int | None = None, label: str | None = None, timeout: float | None = None
    ) -> Ticket:
        """Block until ``tokens`` (in mode "shrink": at least ``minimum``) are admitted; the caller releases the
        ticket. Prefer ``with ledger.admit(...)``."""
        floor = self._validate(tokens, minimum, label)
        limit = self.timeout if timeout is None else timeout
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
                        return self._admit(waiter, tokens, granted, waited if blocked else 0.0, label)
                    if waited >= limit:
                        raise self._timeout(waiter, tokens, waited, label)
                    blocked = True
                    self._changed.wait(limit - waited)
            except BaseException:
                self._leave(waiter)  # interrupted while queued: let the calls behind go
                raise

    @contextlib.contextmanager
    def admit(
        self, tokens: int, *, minimum: int | None = None, label: str | None = None, timeout: float | None = None
    ) -> Iterator[Ticket]:
        """``with ledger.admit(prompt + max_tokens) as ticket:`` admits the call (waiting, or shrinking per
        the mode) and releases its tokens when the block exits, also on an exception."""
        ticket = self.acquire(tokens, minimum=minimum, label=label, timeout=timeout)
        try:
            yield ticket
        finally:
            ticket.release()

    # ----------------------------------------------------------------------------------------- async
    async def acquire_async(
        self, tokens: int, *, minimum: int | None = None, label: str | None = None, timeout: float | None = None
    ) -> Ticket:
        """The awaitable :meth:`acquire`: waits on the running loop, never blocking it."""
        floor = self._validate(tokens, minimum, label)
        limit = self.timeout if timeout is None else timeout
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
                        return self._admit(waiter, tokens, granted, waited if blocked else 0.0, label)
                    if waited >= limit:
                        raise self._timeout(waiter, tokens, waited, label)
                    # A new future each round, made under the lock, so no wake-up between the check and the
                    # wait is lost.
                    future: asyncio.Future[None] = loop.create_future()
                    waiter.future = future
                blocked = True
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(future, limit - waited)
        except BaseException:
            # Cancelled (or the timeout above): leave the queue so the calls behind can go.
            with self._lock:
                self._leave(waiter)
            raise

    @contextlib.asynccontextmanager
    async def admit_async(
        self, tokens: int, *, minimum: int | None = None, label: str | None = None, timeout: float | None = None
    ) -> AsyncIterator[Ticket]:
        """``async with ledger.admit_async(...) as ticket:`` — :meth:`admit` for asyncio tasks."""
        ticket = await self.acquire_async(tokens, minimum=minimum, label=label, timeout=timeout)
        try:
            yield ticket
        finally:
            ticket.release()

    def stats(self) -> dict[str, Any]:
        """The counters, for reports."""
        with self._lock:
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
    from .memory.plan import kv_pool_tokens, plan

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
