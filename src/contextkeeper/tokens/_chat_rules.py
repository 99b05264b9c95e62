"""The Jinja environment a chat template renders in, as transformers' ``apply_chat_template`` configures it.

Servers built on transformers (vLLM, SGLang, TGI) render with that environment, so ours must match it: blocks
trimmed and left-stripped, loop controls, the ``{% generation %}`` tag, a ``tojson`` that keeps non-ASCII text and
takes ``indent``/``separators``/``sort_keys``, ``raise_exception``, ``strftime_now``, a ``dict`` without attribute
access and a ``namespace`` that refuses underscore names. Written here rather than borrowed from transformers so that
counting does not import it (half a second); tests/tokens/test_chat_rules.py holds this equal to the installed
transformers' environment, name by name and render by render.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.utils import Namespace

__all__ = ["CHAT_RULES", "ChatRules"]


class GenerationTag(Extension):
    """``{% generation %}…{% endgeneration %}`` renders its body (transformers uses the tag to find the assistant's
    tokens for training masks; a prompt needs only the text)."""

    tags = {"generation"}  # noqa: RUF012 - Jinja declares it so on Extension

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


def tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """``json.dumps`` with non-ASCII kept and no HTML escaping (Jinja's own filter escapes ``<>&'``)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def raise_exception(message: str) -> None:
    """What a template calls to refuse its input."""
    raise TemplateError(message)


def strftime_now(format: str) -> str:
    """Today's date (and time) as the template formats it."""
    return datetime.now().strftime(format)


class TemplateDict:
    """``dict(...)`` and ``dict.fromkeys(...)`` for templates, without the dict type's attributes."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _check_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise SecurityError(
            f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
            "Please rename the attribute."
        )


class TemplateNamespace(Namespace):
    """Jinja's namespace, refusing attribute names that start with an underscore (they lead to CPython's
    internals)."""

    # No named ``self``, as in Jinja's own: ``namespace(self=...)`` must work.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, attrs = args[0], dict(*args[1:], **kwargs)  # once: the arguments may be a one-pass iterator
        for name in attrs:
            _check_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        Namespace.__setitem__(self, name, value)


@dataclass(frozen=True)
class ChatRules:
    """What a chat-template environment is built with."""

    trim_blocks: bool = True
    lstrip_blocks: bool = True
    extensions: tuple[type[Extension], ...] = (GenerationTag, loopcontrols)
    filters: dict[str, Callable[..., Any]] = field(default_factory=lambda: {"tojson": tojson})
    globals: dict[str, Any] = field(
        default_factory=lambda: {
            "raise_exception": raise_exception,
            "strftime_now": strftime_now,
            "dict": TemplateDict(),
            "namespace": TemplateNamespace,
        }
    )


CHAT_RULES = ChatRules()
