"""Sandboxed Jinja rendering of chat templates, identical in output to transformers' own.

Chat templates are untrusted code from model repositories, so they only ever run in Jinja's
``ImmutableSandboxedEnvironment``. We copy the filters, globals, tests and extensions of the environment
transformers builds (so ``raise_exception``, ``strftime_now``, ``tojson`` and ``{% generation %}`` behave the
same) and add one speed-up: attribute access on plain dicts (``message.role``), which is most of what a
template does, skips the generic sandbox probing. The result is the same value the sandbox would return —
dicts have no unsafe attributes under those names — and the security checks still apply to everything else.
"""

from __future__ import annotations

import functools
from typing import Any

from jinja2 import Template
from jinja2.sandbox import ImmutableSandboxedEnvironment

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
