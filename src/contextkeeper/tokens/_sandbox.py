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
from typing import Any

from jinja2 import Template
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

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
        # str methods (content.strip()) and namespace fields (ns.last_query_index) are what the sandbox's checks
        # would allow anyway for public names: neither is a known-mutable type nor an internal object.
        if not attribute.startswith("_") and (type(obj) is str or isinstance(obj, Namespace)):
            try:
                return getattr(obj, attribute)
            except AttributeError:
                pass
        return super().getattr(obj, attribute)


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
    env.globals.update(reference.globals)
    env.tests.update(reference.tests)
    return env.from_string(source)
