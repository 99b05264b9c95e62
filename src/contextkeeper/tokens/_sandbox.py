"""Sandboxed Jinja rendering of chat templates, identical in output to transformers' own.

Chat templates are untrusted code from model repositories, so they only ever run in Jinja's
``ImmutableSandboxedEnvironment``. We copy the filters, globals, tests and extensions of the environment
transformers builds (so ``raise_exception``, ``strftime_now``, ``tojson`` and ``{% generation %}`` behave the
same) and add fast paths for what templates mostly do — ``message.role`` on plain dicts, ``text.strip()`` on
strings, ``ns.flag`` on namespaces — which skip the generic sandbox probing. Each returns the same value the
sandbox would (none of those names is unsafe on those types), and the checks still apply to everything else.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

from jinja2 import Template
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from ._incremental import LoopState

_DICT_ATTRIBUTES = frozenset(dir(dict))


class _ChatSandbox(ImmutableSandboxedEnvironment):
    """The transformers sandbox with a fast path for ``dict.key`` lookups."""

    def getattr(self, obj: Any, attribute: str) -> Any:
        # Jinja's sandbox first tries getattr(dict, key), fails, then indexes; for keys that are not dict
        # attributes that detour always ends in obj[key], so go there directly.
        if type(obj) is dict and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except KeyError:
                return self.undefined(obj=obj, name=attribute)
        # str methods (content.strip()), namespace fields (ns.last_query_index) and loop fields (loop.index0) are
        # what the sandbox's checks would allow anyway for public names: none is a known-mutable type or an
        # internal object.
        if not attribute.startswith("_") and (
            type(obj) is str or isinstance(obj, (Namespace, LoopContext)) or type(obj) is LoopState
        ):
            try:
                return getattr(obj, attribute)
            except AttributeError:
                pass
        return super().getattr(obj, attribute)


class FrozenJSON:
    """Objects we own and never change (copies of the caller's tool schemas), whose ``tojson`` output is kept.

    A template renders the tool schemas on every call, and ``tojson`` with ``indent`` runs Python's pure-Python
    JSON encoder: about a millisecond per call for five schemas. Only registered objects are memoised, keyed by
    identity; the registry holds each object, so its id cannot be reused by another while registered.
    """

    def __init__(self) -> None:
        self._outputs: dict[int, tuple[Any, dict[Any, Any]]] = {}
        self._lock = threading.Lock()

    def register(self, value: Any) -> None:
        """Register ``value`` and every dict and list inside it."""
        with self._lock:
            if len(self._outputs) > 100_000:  # counters that were dropped never unregister: start over
                self._outputs.clear()
            for item in _containers(value):
                self._outputs.setdefault(id(item), (item, {}))

    def unregister(self, value: Any) -> None:
        with self._lock:
            for item in _containers(value):
                entry = self._outputs.get(id(item))
                if entry is not None and entry[0] is item:
                    del self._outputs[id(item)]

    def wrap(self, tojson: Callable[..., Any]) -> Callable[..., Any]:
        outputs = self._outputs

        def memo_tojson(x: Any, *args: Any, **kwargs: Any) -> Any:
            entry = outputs.get(id(x))
            if entry is None or entry[0] is not x:
                return tojson(x, *args, **kwargs)
            try:
                key = (args, tuple(sorted(kwargs.items())))
                hash(key)
            except TypeError:  # e.g. separators given as a list
                return tojson(x, *args, **kwargs)
            out = entry[1].get(key)
            if out is None:
                out = entry[1][key] = tojson(x, *args, **kwargs)
            return out

        return memo_tojson


def _containers(value: Any) -> list[Any]:
    found: list[Any] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if type(item) is dict:
            found.append(item)
            stack.extend(item.values())
        elif isinstance(item, list):  # plain lists, and a counter's own list of tool schemas
            found.append(item)
            stack.extend(item)
    return found


FROZEN_JSON = FrozenJSON()


@functools.lru_cache(maxsize=64)
def compile_template(source: str) -> Template:
    """Compile ``source`` in a sandbox configured exactly like transformers' chat-template environment."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    reference = _compile_jinja_template(source).environment
    env = _ChatSandbox(
        trim_blocks=reference.trim_blocks,
        lstrip_blocks=reference.lstrip_blocks,
        extensions=[type(ext) for ext in reference.extensions.values()],
    )
    env.filters.update(reference.filters)
    if "tojson" in env.filters:
        env.filters["tojson"] = FROZEN_JSON.wrap(env.filters["tojson"])
    env.globals.update(reference.globals)
    env.tests.update(reference.tests)
    return env.from_string(source)


def same_values(a: Any, b: Any) -> bool:
    """Deep equality that also requires equal types, so 1, 1.0 and True differ (templates print them apart)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if type(a) is dict:
        return a.keys() == b.keys() and all(same_values(value, b[key]) for key, value in a.items())
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(same_values(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)
