"""Who may call the proxy, as whom, from where, and which upstream paths it passes on.

- **Keys and tenants.** With proxy keys (``api_key``, or named ``[api_keys]``), a request must carry one; its
  tenant is that key's name (``default`` for ``api_key``), or the value of ``tenant_header`` when one is configured
  (set by a gateway in front that authenticated the user). Without proxy keys, a client's own bearer key is its
  tenant (as a hash: the key itself is never kept) and keyless clients are one tenant, ``anonymous``. The
  ``admin_key`` may read every tenant's debug views and the metrics.
- **Where from.** The ``Host`` header must name this proxy (``allowed_hosts``: by default the loopback names when it
  listens on loopback), so a web page that rebinds a DNS name to 127.0.0.1 is refused; a request with an ``Origin``
  (a browser's) is refused unless that origin is in ``cors_origins``, so a page cannot send a "simple" cross-site
  request that goes out with the upstream key.
- **What is passed on.** Paths outside the chat route are forwarded only when the allowlist names them
  (:data:`DEFAULT_FORWARD`: what OpenAI-compatible clients need from vLLM, SGLang, llama.cpp and Ollama), so
  admin paths (vLLM's ``/reset_prefix_cache``, ``/sleep``, LoRA loading; llama.cpp's ``/slots``) are not reachable
  with the upstream's key unless configured.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from .._exceptions import RequestRejected

__all__ = [
    "ANONYMOUS",
    "DEFAULT_FORWARD",
    "Access",
    "Caller",
    "Forwarding",
    "loopback_host",
    "tenant_name",
]

ANONYMOUS = "anonymous"
Scope = Literal["tenant", "loopback", "admin", "any", "off"]

#: ``METHOD /path`` globs forwarded by default: what OpenAI-compatible clients call on vLLM, SGLang, llama.cpp and
#: Ollama besides chat completions. ``*`` in a path matches within and across segments.
DEFAULT_FORWARD: tuple[str, ...] = (
    "GET /v1/models",
    "GET /v1/models/*",
    "POST /v1/completions",
    "POST /v1/embeddings",
    "POST /v1/responses",
    "POST /v1/responses/input_tokens",
    "POST /v1/messages",
    "POST /v1/messages/count_tokens",
    "POST /v1/rerank",
    "POST /v2/rerank",
    "POST /rerank",
    "POST /v1/score",
    "POST /score",
    "POST /v1/audio/transcriptions",
    "POST /v1/audio/translations",
    "POST /tokenize",
    "POST /detokenize",
    "POST /v1/tokenize",
    "POST /v1/detokenize",
    "GET /health",
    "GET /v1/health",
    "GET /version",
    "GET /ping",
    "GET /props",
    "GET /models",
    "POST /completion",
    "POST /completions",
    "POST /embedding",
    "POST /embeddings",
    "POST /infill",
    "POST /api/chat",
    "POST /api/generate",
    "POST /api/embed",
    "POST /api/embeddings",
    "POST /api/show",
    "GET /api/tags",
    "GET /api/ps",
    "GET /api/version",
)

#: Forwarded but not fitted yet (the wire formats the keeper does not read): said in a header and logged once.
UNFITTED: Mapping[str, str] = {
    "/v1/responses": "the OpenAI Responses format",
    "/v1/messages": "the Anthropic Messages format",
    "/api/chat": "Ollama's native chat format",
    "/api/generate": "Ollama's native generate format",
    "/v1/completions": "a raw completions prompt",
}

_LOOPBACK_NAMES = frozenset({"localhost", "localhost.", "127.0.0.1", "::1", "[::1]"})


def loopback_host(host: str) -> bool:
    """Whether ``host`` (a name or address, IPv6 with or without brackets) is this machine's loopback."""
    name = host.strip().lower()
    if name in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name.strip("[]")).is_loopback
    except ValueError:
        return False


def _host_name(header: str) -> str:
    """The host of a ``Host`` header without its port (``[::1]:8100`` -> ``::1``)."""
    value = header.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


@dataclass(frozen=True)
class Caller:
    """Who sent a request: its tenant, whether it holds the admin key, whether it came from loopback."""

    tenant: str
    admin: bool = False
    loopback: bool = False


def tenant_name(value: str, what: str) -> str:
    """``value`` as a tenant name: printable, at most 128 characters, no ``/`` (it separates tenant and id)."""
    if len(value) > 128 or "/" in value or not value.isprintable():
        raise RequestRejected(
            f"{what} is not a tenant name (at most 128 printable characters, no '/')",
            status=400,
            code="invalid_tenant",
            fix=f"send a short id in {what}",
        )
    return value


def _tenant_of_key(token: str) -> str:
    """A client's own key as a tenant name: a hash, stable across processes, never the key."""
    return "key-" + hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()[:20]


def _bearer(authorization: str | None) -> str | None:
    scheme, _, token = (authorization or "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def _same(given: str, key: str) -> bool:
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), key.encode("utf-8", "surrogatepass"))


@dataclass(frozen=True, kw_only=True, repr=False)
class Access:
    """The proxy's access rules (see the module docstring). ``keys`` maps a tenant name to its proxy key (empty:
    no proxy key); ``metrics`` and ``debug`` say who may read ``/metrics`` and ``/contextkeeper/*``:
    ``tenant`` (each caller its own conversations; debug only), ``loopback`` (callers on this machine, and the admin
    key), ``admin`` (the admin key only), ``any`` (every caller that passed the key check), ``off``."""

    keys: Mapping[str, str] = field(default_factory=dict)
    admin_key: str | None = None
    tenant_header: str | None = None
    allowed_hosts: tuple[str, ...] = ("*",)
    cors_origins: tuple[str, ...] = ()
    metrics: Scope = "loopback"
    debug: Scope = "tenant"

    def __repr__(self) -> str:  # never show keys
        return (
            f"Access(keys={sorted(self.keys)}, admin_key={'***' if self.admin_key else None}, "
            f"tenant_header={self.tenant_header!r}, allowed_hosts={self.allowed_hosts!r}, "
            f"cors_origins={self.cors_origins!r}, metrics={self.metrics!r}, debug={self.debug!r})"
        )

    @property
    def keyed(self) -> bool:
        """Whether callers need a proxy key."""
        return bool(self.keys)

    def caller(self, authorization: str | None, headers: Mapping[str, str], client_host: str | None) -> Caller | None:
        """The caller of a request, or None when it lacks the proxy key it needs."""
        token = _bearer(authorization)
        loopback = client_host is not None and loopback_host(client_host)
        if token is not None and self.admin_key is not None and _same(token, self.admin_key):
            return Caller("admin", admin=True, loopback=loopback)
        if self.keys:
            name = next((name for name, key in self.keys.items() if token is not None and _same(token, key)), None)
            if name is None:
                return None
        else:
            name = _tenant_of_key(token) if token is not None else ANONYMOUS
        if self.tenant_header is not None:
            given = (headers.get(self.tenant_header) or "").strip()
            if given:
                name = tenant_name(given, f"the {self.tenant_header} header")
        return Caller(name, loopback=loopback)

    def host_allowed(self, host: str | None) -> bool:
        """Whether a ``Host`` header names this proxy (a request without one is HTTP/1.0: allowed on loopback)."""
        if "*" in self.allowed_hosts:
            return True
        if not host:
            return False
        name = _host_name(host)
        return any(fnmatch.fnmatchcase(name, allowed.lower().strip("[]")) for allowed in self.allowed_hosts)

    def origin_allowed(self, origin: str | None) -> bool:
        """Whether a browser's ``Origin`` may call the proxy (no Origin: not a browser's cross-site request)."""
        if origin is None:
            return True
        return any(fnmatch.fnmatchcase(origin.lower(), allowed.lower()) for allowed in self.cors_origins)

    def may(self, scope: Scope, caller: Caller) -> bool:
        """Whether ``caller`` may use an endpoint open to ``scope``."""
        if scope == "off":
            return False
        if caller.admin or scope in ("any", "tenant"):
            return True
        return scope == "loopback" and caller.loopback


@dataclass(frozen=True)
class _Rule:
    method: str | None  # None: every method
    path: str


class Forwarding:
    """Which ``METHOD /path`` requests are passed to the upstream: ``DEFAULT_FORWARD`` plus ``extra`` (``*`` alone
    forwards everything, as before the allowlist)."""

    def __init__(self, extra: Iterable[str] = (), *, defaults: Sequence[str] = DEFAULT_FORWARD) -> None:
        self.patterns = tuple(dict.fromkeys((*defaults, *extra)))
        self._rules = tuple(self._rule(pattern) for pattern in self.patterns)
        self.everything = any(rule.method is None and rule.path == "*" for rule in self._rules)

    @staticmethod
    def _rule(pattern: str) -> _Rule:
        method, _, path = pattern.strip().partition(" ")
        if not path:
            return _Rule(None, method)
        return _Rule(method.upper(), path.strip())

    def allows(self, method: str, path: str) -> bool:
        method = method.upper()
        for rule in self._rules:
            methods = (rule.method,) if rule.method != "GET" else ("GET", "HEAD")
            if rule.method is not None and method not in methods:
                continue
            if rule.path == "*" or fnmatch.fnmatchcase(path, rule.path):
                return True
        return False
