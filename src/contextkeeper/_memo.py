"""The one memo module: every cache contextkeeper keeps, bounded together in bytes.

Counting keeps many caches (token counts by piece text, rendered message bodies, validated messages, template
views, compiled templates, JSON of tool schemas, strategy rewrites). Each is a :class:`Memo`; all of them share
one budget, ``CONTEXTKEEPER_CACHE_BYTES`` (default 256 MiB), read at import and changed with
:func:`set_cache_bytes`. Sizes are measured from what an entry holds (``sys.getsizeof`` of its strings and
containers, plus a fixed cost per entry), so a cache of a few long texts and one of many short ones are charged
alike.

A memo keeps its entries in generations: a hit in the newest one is a plain dict look-up (no bookkeeping on the
hot path), a hit in an older one moves the entry to the newest. A memo starts a new generation when its newest
holds a sixteenth of the budget; when the budget is exceeded, the generation created longest ago, in any memo,
is dropped. So what is used survives, memory is freed in sixteenths, and a memo nobody reads any more (a dropped
keeper's) ages out first; a memo that is garbage-collected gives its bytes back at once. :class:`ReferenceLRU` is
the slow, obvious byte-bounded LRU the memo is tested against. :class:`IdentityMemo` is a memo keyed by object
identity (the caller's dicts, validated messages): each entry holds its object, so the id stays unique.
"""

from __future__ import annotations

import contextlib
import operator
import os
import sys
import threading
import types
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, ParamSpec, TypeVar

from ._exceptions import ConfigurationError

__all__ = [
    "CacheUsage",
    "IdentityMemo",
    "Memo",
    "ReferenceLRU",
    "approx_size",
    "cache_bytes",
    "cache_usage",
    "data_size",
    "deep_entry_size",
    "memoize",
    "same_values",
    "set_cache_bytes",
    "shared_prefix",
    "shared_suffix",
    "text_entry_size",
    "text_key_size",
]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
T = TypeVar("T")  # the object an IdentityMemo entry is keyed by
P = ParamSpec("P")
R = TypeVar("R")

ENV_VAR = "CONTEXTKEEPER_CACHE_BYTES"
DEFAULT_CACHE_BYTES = 256 * 1024 * 1024
# What a dict entry costs besides its key and value: its slot in the hash table and the entries array (about
# three words each, with the table's spare room), rounded up.
ENTRY_OVERHEAD = 96
_GENERATIONS = 16  # a memo starts a new generation when its newest holds 1/16 of the budget
_MIN_GENERATION = 16 * 1024

_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1024, "kib": 1024, "m": 1024**2, "mb": 1024**2, "mib": 1024**2}
_UNITS.update({"g": 1024**3, "gb": 1024**3, "gib": 1024**3})


def _parse_bytes(text: str) -> int:
    """``"268435456"``, ``"256MiB"``, ``"1g"``, ``"512 kb"`` (binary units) as a number of bytes."""
    raw = text.strip().lower().replace("_", "").replace(" ", "")
    number = raw.rstrip("kmgib")
    unit = raw[len(number) :]
    try:
        value = float(number) * _UNITS[unit]
    except (KeyError, ValueError):
        raise ConfigurationError(
            f"{ENV_VAR}={text!r} is not a size. Fix: set it to a number of bytes such as 268435456 or 256MiB."
        ) from None
    return int(value)


# ----------------------------------------------------------------------------------------------- the budget


class _Generation:
    """One generation of one memo: its entries and their bytes."""

    __slots__ = ("bytes", "data", "memo")

    def __init__(self, memo: weakref.ref[Memo[Any, Any]]) -> None:
        self.data: dict[Any, Any] = {}
        self.bytes = 0
        self.memo: weakref.ref[Memo[Any, Any]] | None = memo  # None once dropped


class _Ledger:
    """The budget all memos share: their generations in creation order, and the bytes they hold."""

    def __init__(self, limit: int) -> None:
        self.lock = threading.Lock()
        self.limit = limit
        self.generation_bytes = max(limit // _GENERATIONS, _MIN_GENERATION)
        self.total = 0
        self.order: deque[_Generation] = deque()
        self.released: list[list[_Generation]] = []  # generations of collected memos, freed under the lock

    def open(self, memo: Memo[Any, Any]) -> _Generation:
        generation = _Generation(memo._ref)
        self.order.append(generation)
        if len(self.order) > 64 and len(self.order) > 4 * (self.total // self.generation_bytes + 16):
            # Many memos came and went (keepers made per request): drop the generations they left behind.
            self.order = deque(g for g in self.order if g.memo is not None)
        return generation

    def settle(self) -> None:
        """Free collected memos' generations, then drop the oldest generations while over the budget."""
        while self.released:
            for generation in self.released.pop():
                self.drop(generation)
        chances = len(self.order)  # second chances given in this pass: each generation's at most once
        while self.total > self.limit and self.order:
            oldest = self.order.popleft()
            owner = oldest.memo() if oldest.memo is not None else None
            if owner is None:
                self.drop(oldest)
                continue
            if chances > 0 and oldest is owner._gens[-1] and owner._used:
                chances -= 1
                # The owner's newest generation was read since it was last considered: a second chance.
                owner._used = False
                self.order.append(oldest)
                continue
            owner._drop(oldest)
            self.drop(oldest)

    def drop(self, generation: _Generation) -> None:
        if generation.memo is None:
            return
        self.total -= generation.bytes
        generation.memo = None
        generation.bytes = 0
        generation.data = {}


_LEDGER = _Ledger(DEFAULT_CACHE_BYTES)


def _release(ledger: _Ledger, generations: list[_Generation]) -> None:
    """A memo was collected: its bytes go back to the budget (at once unless a put holds the lock now)."""
    ledger.released.append(generations)
    if ledger.lock.acquire(blocking=False):
        try:
            ledger.settle()
        finally:
            ledger.lock.release()


def cache_bytes() -> int:
    """The byte budget every cache shares (``CONTEXTKEEPER_CACHE_BYTES``, default 256 MiB)."""
    return _LEDGER.limit


def set_cache_bytes(limit: int | str | None) -> int:
    """Set the byte budget of all caches together (bytes, or a size such as ``"64MiB"``; None: back to
    ``CONTEXTKEEPER_CACHE_BYTES`` or the default). Shrinking it frees the oldest cache generations at once.
    Returns the new budget."""
    if limit is None:
        env = os.environ.get(ENV_VAR, "").strip()
        value = _parse_bytes(env) if env else DEFAULT_CACHE_BYTES
    elif isinstance(limit, str):
        value = _parse_bytes(limit)
    elif isinstance(limit, bool) or not isinstance(limit, int):
        raise ConfigurationError(f"cache bytes must be an integer or a size string, got {type(limit).__name__}")
    else:
        value = limit
    if value < 0:
        raise ConfigurationError(f"cache bytes must be 0 or more, got {value:,}. Fix: pass a positive size.")
    with _LEDGER.lock:
        _LEDGER.limit = value
        _LEDGER.generation_bytes = max(value // _GENERATIONS, _MIN_GENERATION)
        _LEDGER.settle()
    return value


@dataclass(frozen=True, kw_only=True)
class CacheUsage:
    """What the caches hold: ``held`` bytes of ``limit``, and the bytes of each memo by name."""

    held: int
    limit: int
    by_name: dict[str, int]


def cache_usage() -> CacheUsage:
    """The bytes the caches hold now, by the memos' own accounting."""
    with _LEDGER.lock:
        _LEDGER.settle()
        by_name: dict[str, int] = {}
        for generation in _LEDGER.order:
            owner = generation.memo() if generation.memo is not None else None
            if owner is not None:
                by_name[owner.name] = by_name.get(owner.name, 0) + generation.bytes
        return CacheUsage(held=_LEDGER.total, limit=_LEDGER.limit, by_name=by_name)


# --------------------------------------------------------------------------------------------------- sizes

_FIXED: dict[type, int] = {type(None): 0, bool: 0, int: 32, float: 24}
_CONTAINERS = frozenset({dict, list, tuple, set, frozenset, deque})
_OPAQUE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


_SMALL_VALUE = 32  # a small int (token counts) or a shared tuple, as text_key_size counts it


def text_key_size(key: str, value: Any) -> int:
    """Bytes of an entry keyed by a string whose value is a small number or a shared constant (the piece
    caches): the string alone, and a word for the value. :meth:`Memo.put_many` computes it inline."""
    return sys.getsizeof(key) + _SMALL_VALUE


def text_entry_size(key: Any, value: Any) -> int:
    """Bytes of an entry whose key is a string (or a small tuple) and whose value is a number or a small tuple."""
    size = sys.getsizeof(key)
    if type(key) is tuple:
        size += sum(sys.getsizeof(part) for part in key)
    fixed = _FIXED.get(type(value))
    return size + (sys.getsizeof(value) if fixed is None else fixed)


def _slot_names(kind: type) -> tuple[str, ...]:
    names: list[str] = []
    for cls in kind.__mro__:
        slots = cls.__dict__.get("__slots__", ())
        names.extend((slots,) if isinstance(slots, str) else slots)
    return tuple(name for name in names if name not in ("__dict__", "__weakref__"))


_SLOTS: dict[type, tuple[str, ...]] = {}


def approx_size(*objects: Any) -> int:
    """Bytes held by ``objects`` and everything they reach (strings, containers, instances' fields), each object
    counted once. Types, modules and functions are shared code, not data: counted as nothing."""
    seen: set[int] = set()
    stack = list(objects)
    total = 0
    getsizeof = sys.getsizeof
    fixed_sizes = _FIXED
    while stack:
        obj = stack.pop()
        kind = type(obj)
        fixed = fixed_sizes.get(kind)
        if fixed is not None:
            total += fixed
            continue
        key = id(obj)
        if key in seen:
            continue
        seen.add(key)
        if kind is str:
            total += getsizeof(obj)
        elif kind is dict:
            total += getsizeof(obj)
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif kind is list or kind is tuple:
            total += getsizeof(obj)
            stack.extend(obj)
        else:
            total += _object_size(obj, kind, stack)
    return total


def _object_size(obj: Any, kind: type, stack: list[Any]) -> int:
    """``getsizeof`` of an object that is not a str, dict, list or tuple; what it holds goes on ``stack``."""
    if isinstance(obj, _OPAQUE):
        return 0
    own = getattr(kind, "approx_size", None)
    if own is not None:  # an object that knows its size (a validated message)
        return int(own(obj))
    size = sys.getsizeof(obj)
    if isinstance(obj, (dict, list, tuple, set, frozenset, deque)):  # subclasses, sets
        stack.extend(obj.values() if isinstance(obj, dict) else obj)
        if isinstance(obj, dict):
            stack.extend(obj.keys())
    if kind in _CONTAINERS or isinstance(obj, (str, bytes)):
        return size
    attributes = getattr(obj, "__dict__", None)
    if type(attributes) is dict:
        stack.append(attributes)
    slots = _SLOTS.get(kind)
    if slots is None:
        slots = _SLOTS[kind] = _slot_names(kind)
    for name in slots:
        with contextlib.suppress(AttributeError):  # an unset slot
            stack.append(object.__getattribute__(obj, name))
    return size


def data_size(value: Any) -> int:
    """:func:`approx_size` for data made of strings, numbers, dicts, lists, tuples and objects that say their own
    size (an ``approx_size()`` method, as :class:`~contextkeeper.messages.Message` has), several times faster: no
    bookkeeping of what was counted (a string held twice is counted twice). Anything else is walked by
    :func:`approx_size`."""
    kind = type(value)
    fixed = _FIXED.get(kind)
    if fixed is not None:
        return fixed
    getsizeof = sys.getsizeof
    if kind is str:
        return getsizeof(value)
    if kind is dict or kind is list or kind is tuple:
        total = getsizeof(value)
        if kind is dict:
            total += sum(map(getsizeof, value))
            value = value.values()
        for item in value:  # strings and numbers inline: most values are one or the other
            item_kind = type(item)
            if item_kind is str:
                total += getsizeof(item)
            else:
                item_fixed = _FIXED.get(item_kind)
                total += data_size(item) if item_fixed is None else item_fixed
        return total
    own = getattr(kind, "approx_size", None)
    if own is not None and not isinstance(value, type):
        return int(own(value))
    return approx_size(value)


def deep_entry_size(key: Any, value: Any) -> int:
    """The bytes of an entry whose key and value hold messages, views or other nested data (see
    :func:`data_size`)."""
    return data_size(key) + data_size(value)


# ----------------------------------------------------------------------------------------------- the memo


class Memo(Generic[K, V]):
    """A thread-safe cache bounded by the shared byte budget (see the module docstring).

    ``sizer(key, value)`` gives an entry's bytes (``ENTRY_OVERHEAD`` is added); it must give the same number for
    the same entry. Values are never None (None is what a miss returns). Reads take no lock: a hit in the newest
    generation is one dict look-up. Writes, moves and drops take the budget's lock.
    """

    __slots__ = ("__weakref__", "_gens", "_ledger", "_newest", "_ref", "_sizer", "_used", "name")

    def __init__(self, name: str, *, sizer: Callable[[Any, Any], int] = text_entry_size) -> None:
        self.name = name
        self._sizer = sizer
        self._ledger = _LEDGER
        self._ref: weakref.ref[Memo[Any, Any]] = weakref.ref(self)
        self._used = False
        with self._ledger.lock:
            first = self._ledger.open(self)
        self._gens: list[_Generation] = [first]
        self._newest: dict[Any, Any] = first.data
        weakref.finalize(self, _release, self._ledger, self._gens)

    # -- reads ---------------------------------------------------------------------------------------------
    def get(self, key: K) -> V | None:
        """The value for ``key``, or None."""
        value: V | None = self._newest.get(key)
        if value is not None:
            self._used = True
            return value
        return self._older(key) if len(self._gens) > 1 else None

    def recent(self) -> Callable[[K], V | None]:
        """The look-up of the newest generation alone, for a hot loop: its hits are hits, but a miss must be
        asked of :meth:`get` (the entry may sit in an older generation)."""
        self._used = True
        return self._newest.get

    def _older(self, key: K) -> V | None:
        for generation in reversed(self._gens[:-1]):
            found = generation.data.get(key)
            if found is not None:
                value: V = found
                with self._ledger.lock:
                    if generation.data.get(key) is value:  # not dropped or moved meanwhile
                        size = self._size(key, value)
                        del generation.data[key]
                        generation.bytes -= size
                        self._ledger.total -= size
                        self._store(key, value, size)
                return value
        return None

    # -- writes --------------------------------------------------------------------------------------------
    def put(self, key: K, value: V) -> None:
        """Remember ``value`` for ``key`` (replacing an earlier value); a value larger than the whole budget is
        not kept."""
        size = self._sizer(key, value) + ENTRY_OVERHEAD
        ledger = self._ledger
        with ledger.lock:
            self._put(key, value, size)
            if ledger.total > ledger.limit or ledger.released:
                ledger.settle()

    def put_many(self, items: Iterable[tuple[K, V]]) -> None:
        """:meth:`put` of each ``(key, value)``, under one lock (the batch one count made): the hot path of a
        count that meets new text, so the loop is written out."""
        sizer = self._sizer
        getsizeof = sys.getsizeof
        plain = sizer is text_key_size
        ledger = self._ledger
        with ledger.lock:
            gens = self._gens
            newest = gens[-1]
            data = newest.data
            limit = ledger.limit
            room = ledger.generation_bytes - newest.bytes  # what the newest generation takes before a new one
            added = 0
            for key, value in items:
                size = (getsizeof(key) + _SMALL_VALUE if plain else sizer(key, value)) + ENTRY_OVERHEAD
                old = data.pop(key, None)
                if old is not None:
                    old_size = (getsizeof(key) + _SMALL_VALUE if plain else sizer(key, old)) + ENTRY_OVERHEAD
                    added -= old_size
                    room += old_size
                elif len(gens) > 1:
                    newest.bytes += added  # settle this generation's account before _discard reads others
                    ledger.total += added
                    added = 0
                    self._discard(key)
                if size > limit:
                    continue
                if size > room and data:
                    newest.bytes += added
                    ledger.total += added
                    added = 0
                    newest = ledger.open(self)
                    gens.append(newest)
                    data = self._newest = newest.data
                    room = ledger.generation_bytes
                data[key] = value
                added += size
                room -= size
            newest.bytes += added
            ledger.total += added
            if ledger.total > limit or ledger.released:
                ledger.settle()

    def pop(self, key: K) -> V | None:
        """Forget ``key``; its value, or None."""
        with self._ledger.lock:
            return self._discard(key)

    def clear(self) -> None:
        """Forget every entry."""
        ledger = self._ledger
        with ledger.lock:
            for generation in self._gens:
                ledger.drop(generation)
            self._gens[:] = [ledger.open(self)]
            self._newest = self._gens[0].data

    def _size(self, key: K, value: V) -> int:
        return self._sizer(key, value) + ENTRY_OVERHEAD

    def _put(self, key: K, value: V, size: int) -> None:
        """Store an entry in the newest generation, replacing the key's earlier entry (the caller holds the lock
        and settles the budget after)."""
        ledger = self._ledger
        newest = self._gens[-1]
        data = newest.data
        old = data.pop(key, None)
        if old is not None:
            old_size = self._sizer(key, old) + ENTRY_OVERHEAD
            newest.bytes -= old_size
            ledger.total -= old_size
        elif len(self._gens) > 1:
            self._discard(key)
        if size > ledger.limit:
            return
        self._store(key, value, size)

    def _discard(self, key: K) -> V | None:
        for generation in self._gens:
            old: V | None = generation.data.pop(key, None)
            if old is not None:
                size = self._size(key, old)
                generation.bytes -= size
                self._ledger.total -= size
                return old
        return None

    def _store(self, key: K, value: V, size: int) -> None:
        """Put an entry into the newest generation and charge its bytes (the caller holds the lock)."""
        ledger = self._ledger
        newest = self._gens[-1]
        if newest.bytes + size > ledger.generation_bytes and newest.data:
            newest = ledger.open(self)
            self._gens.append(newest)
            self._newest = newest.data
        newest.data[key] = value
        newest.bytes += size
        ledger.total += size

    def _drop(self, generation: _Generation) -> None:
        """The budget drops ``generation`` (the caller holds the lock)."""
        self._gens.remove(generation)
        if not self._gens:
            self._gens.append(self._ledger.open(self))
        self._newest = self._gens[-1].data

    # -- inspection ----------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return sum(len(generation.data) for generation in self._gens)

    def __contains__(self, key: object) -> bool:
        return any(key in generation.data for generation in self._gens)

    @property
    def nbytes(self) -> int:
        """Bytes this memo holds, by its own accounting."""
        return sum(generation.bytes for generation in self._gens)

    def items(self) -> list[tuple[K, V]]:
        """Every entry, oldest generation first (a copy)."""
        with self._ledger.lock:
            return [item for generation in self._gens for item in generation.data.items()]

    def __repr__(self) -> str:
        return f"Memo({self.name!r}, {len(self)} entries, {self.nbytes:,} bytes)"


def _kept_size(key: int, entry: tuple[Any, Any, int]) -> int:
    """An :class:`IdentityMemo` entry's size, measured when it was put."""
    return entry[2]


class IdentityMemo(Generic[T, V]):
    """A :class:`Memo` keyed by an object's identity: for values derived from objects that are not hashable
    (the caller's dicts) or whose equality is not what matters (equal messages that render apart).

    Each entry holds its object, so the object's ``id`` cannot be reused by another object while the entry
    lives, and a look-up answers only for the very same object. ``fresh(obj, value)``, when given, must hold too:
    an object changed in place since its value was made (say, no longer equal to the copy kept in the value) is
    a miss, never a stale answer. ``sizer(obj, value)`` gives an entry's bytes (``ENTRY_OVERHEAD`` is added);
    it may leave out the object itself where the value holds a copy of it. It is called once per entry: the entry
    keeps its size, so moving it to the newest generation (many conversations read in turn) or dropping it costs
    no second walk of its value. Thread-safe as :class:`Memo` is.
    """

    __slots__ = ("_fresh", "_memo", "_sizer")

    def __init__(
        self,
        name: str,
        *,
        sizer: Callable[[T, V], int],
        fresh: Callable[[T, V], bool] | None = None,
    ) -> None:
        # An entry is (object, value, its size): never falsy.
        self._memo: Memo[int, tuple[T, V, int]] = Memo(name, sizer=_kept_size)
        self._sizer = sizer
        self._fresh = fresh

    @property
    def name(self) -> str:
        """The name :func:`cache_usage` reports this memo's bytes under."""
        return self._memo.name

    def get(self, obj: T) -> V | None:
        """The value kept for this very object while it is still fresh, or None."""
        entry = self._memo.get(id(obj))
        if entry is None or entry[0] is not obj:
            return None
        value = entry[1]
        if self._fresh is not None and not self._fresh(obj, value):
            return None
        return value

    def get_many(self, objs: Iterable[T]) -> list[V | None]:
        """:meth:`get` of each object, in one call (the hot path of a count over a long history)."""
        recent = self._memo.recent()
        older = self._memo.get
        fresh = self._fresh
        out: list[V | None] = []
        for obj in objs:
            key = id(obj)
            entry = recent(key) or older(key)  # an entry is a 3-tuple: never falsy
            if entry is None or entry[0] is not obj or (fresh is not None and not fresh(obj, entry[1])):
                out.append(None)
            else:
                out.append(entry[1])
        return out

    def put(self, obj: T, value: V) -> None:
        """Remember ``value`` for ``obj`` (holding ``obj`` while the entry lives)."""
        self._memo.put(id(obj), (obj, value, self._sizer(obj, value)))

    def put_many(self, items: Iterable[tuple[T, V]]) -> None:
        """:meth:`put` of each ``(obj, value)``, under one lock."""
        sizer = self._sizer
        self._memo.put_many((id(obj), (obj, value, sizer(obj, value))) for obj, value in items)

    def pop(self, obj: T) -> V | None:
        """Forget ``obj``; its value, or None (also when the entry was another object's)."""
        entry = self._memo.get(id(obj))
        if entry is None or entry[0] is not obj:
            return None
        self._memo.pop(id(obj))
        return entry[1]

    def clear(self) -> None:
        """Forget every entry."""
        self._memo.clear()

    def __len__(self) -> int:
        return len(self._memo)

    @property
    def nbytes(self) -> int:
        """Bytes this memo holds, by its own accounting."""
        return self._memo.nbytes

    def __repr__(self) -> str:
        return f"IdentityMemo({self.name!r}, {len(self)} entries, {self.nbytes:,} bytes)"


_NONE: Any = object()  # stands for a None result in a memoised function's memo


def memoize(name: str, *, sizer: Callable[[Any, Any], int]) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """``functools.lru_cache`` on a :class:`Memo`: results kept by their positional arguments, within the
    shared byte budget. ``sizer(args, result)`` gives an entry's bytes. The wrapper's ``memo`` is the cache."""

    def decorate(function: Callable[P, R]) -> Callable[P, R]:
        memo: Memo[Any, Any] = Memo(name, sizer=sizer)

        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            if kwargs:
                return function(*args, **kwargs)
            found = memo.get(args)
            if found is None:
                found = function(*args, **kwargs)
                memo.put(args, _NONE if found is None else found)  # a memo's None is a miss
            return None if found is _NONE else found  # type: ignore[return-value]

        wrapper.memo = memo  # type: ignore[attr-defined]
        wrapper.__doc__ = function.__doc__
        wrapper.__name__ = function.__name__
        wrapper.__qualname__ = function.__qualname__
        wrapper.__wrapped__ = function  # type: ignore[attr-defined]
        return wrapper

    return decorate


class ReferenceLRU(Generic[K, V]):
    """The slow, obvious byte-bounded LRU (an ``OrderedDict`` in use order, least recently used dropped first)
    that :class:`Memo` is checked against in the tests; not shared, not thread-safe."""

    def __init__(self, limit: int, *, sizer: Callable[[Any, Any], int] = text_entry_size) -> None:
        self.limit = limit
        self._sizer = sizer
        self._data: OrderedDict[K, V] = OrderedDict()
        self.nbytes = 0

    def get(self, key: K) -> V | None:
        value = self._data.get(key)
        if value is not None:
            self._data.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> None:
        self.pop(key)
        size = self._sizer(key, value) + ENTRY_OVERHEAD
        if size > self.limit:
            return
        self._data[key] = value
        self.nbytes += size
        while self.nbytes > self.limit:
            old_key, old = self._data.popitem(last=False)
            self.nbytes -= self._sizer(old_key, old) + ENTRY_OVERHEAD

    def pop(self, key: K) -> V | None:
        old = self._data.pop(key, None)
        if old is not None:
            self.nbytes -= self._sizer(key, old) + ENTRY_OVERHEAD
        return old

    def __len__(self) -> int:
        return len(self._data)

    def keys(self) -> Iterable[K]:
        return self._data.keys()


# ------------------------------------------------------------------------------------------ cache keys


_DEEPEST = 256  # same_values answers "not the same" past this depth (callers then copy, and check, the data)


def same_values(a: Any, b: Any, _depth: int = 0) -> bool:
    """Whether ``a`` and ``b`` render alike: deep equality that also requires equal types (1, 1.0 and True
    differ) and, in dicts, the same keys in the same order (a template writes keys in order). Data nested deeper
    than 256 levels is never "the same" (no recursion past that)."""
    if a is b:
        return True
    kind = type(a)
    if kind is not type(b):
        return False
    if kind is dict:
        if len(a) != len(b) or _depth > _DEEPEST:
            return False
        # Keys in the same order: mostly the very same string objects (a copy shares them), checked in C.
        if not all(map(operator.is_, a, b)) and (list(a) != list(b) or not all(map(_same_type, a, b))):
            return False
        values: Iterable[tuple[Any, Any]] = zip(a.values(), b.values(), strict=True)
    elif kind is list or kind is tuple:
        if len(a) != len(b) or _depth > _DEEPEST:
            return False
        values = zip(a, b, strict=True)
    else:
        return bool(a == b)
    for x, y in values:  # noqa: SIM110 - a plain loop is faster than all() over a generator here
        if x is not y and not same_values(x, y, _depth + 1):
            return False
    return True


def _same_type(a: Any, b: Any) -> bool:
    return type(a) is type(b)


set_cache_bytes(None)  # the environment's setting, checked once at import


# ------------------------------------------------------------------------------------------ identity runs


def shared_prefix(a: Sequence[Any], b: Sequence[Any], same: Callable[[Any, Any], bool] = operator.is_) -> int:
    """Length of the longest common prefix of two lists of the very same objects (``same``: another test).

    Identity, not equality: ``{"n": 1} == {"n": True}`` in Python, yet a template renders them differently.
    ``map(same, ...)`` keeps the loop in C.
    """
    limit = min(len(a), len(b))
    if limit and same(a[limit - 1], b[limit - 1]) and all(map(same, a[:limit], b[:limit])):
        return limit  # the usual answer, found in one pass that builds nothing
    equal = list(map(same, a[:limit], b[:limit]))
    return limit if all(equal) else equal.index(False)


def shared_suffix(a: Sequence[Any], b: Sequence[Any], same: Callable[[Any, Any], bool] = operator.is_) -> int:
    """Length of the longest common suffix (see :func:`shared_prefix`)."""
    return shared_prefix(a[::-1], b[::-1], same)
