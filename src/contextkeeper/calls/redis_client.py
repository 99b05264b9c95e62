"""Redis clients from URLs, for everything the keeper shares through Redis (the KV ledger, learned state).

One place decides which URL means which client, which errors mean "Redis cannot be reached", and how a URL is
shown without its password. The forms, one registry entry per scheme:

- ``redis://[[user]:password@]host[:port][/db][?option=...]`` (``rediss://`` with TLS), ``unix:///path.sock``: one
  server, through :meth:`redis.Redis.from_url`;
- ``redis+cluster://[[user]:password@]host:port[,host:port...][/0][?option=...]`` (``rediss+cluster://``): a
  Redis Cluster found from those startup nodes;
- ``redis+sentinel://[[user]:password@]host:port[,host:port...]/SERVICE[/db][?option=...]``
  (``rediss+sentinel://``): the master of SERVICE as the Sentinels name it, asked again on every new connection so
  a failover is followed. The password is the master's; ``sentinel_password=`` (and ``sentinel_username=``) in
  the query is the Sentinels' own, when they have one.

Query options are redis-py's connection options (``ssl_ca_certs=``, ``socket_keepalive=``, ...), read by
redis-py's own URL parser.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from .._exceptions import ConfigurationError

__all__ = ["SCHEMES", "RedisTarget", "connect", "connection_errors", "is_redis_url", "parse", "safe_url"]


@dataclass(frozen=True)
class RedisTarget:
    """What a cluster or Sentinel URL names: its nodes, the service (Sentinel), the db, and connection options."""

    # The URL and the options may hold passwords: they stay out of the repr.
    url: str = field(repr=False)
    nodes: tuple[tuple[str, int], ...]
    tls: bool
    service: str | None = None
    db: int = 0
    options: dict[str, Any] = field(default_factory=dict, repr=False)
    sentinel_options: dict[str, Any] = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class _Scheme:
    """One URL scheme: its accepted form (for errors), how it is read, and its sync and asyncio clients."""

    form: str
    sync: Callable[[str, RedisTarget | None, float], Any]
    asynchronous: Callable[[str, RedisTarget | None, float], Any]
    parse: Callable[[str], RedisTarget | None]


def _redis(module: str) -> Any:
    """A redis-py module, as untyped (parts of redis-py have no annotations; strict mypy would refuse them)."""
    return importlib.import_module(module)


# ------------------------------------------------------------------------------------------- one server
# Connections a client opens to one server at most. Every call waiting for KV room polls the ledger, so a busy
# process has as many commands in flight as waiting calls: past this many they wait for a free connection (a
# blocking pool, for at most the client's timeout) instead of redis-py's plain pool refusing them at once.
CONNECTIONS = 100


def _single_sync(url: str, target: RedisTarget | None, timeout: float) -> Any:
    import redis

    pool = redis.BlockingConnectionPool.from_url(
        url,
        max_connections=CONNECTIONS,
        timeout=timeout,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        health_check_interval=30,
    )
    client = redis.Redis(connection_pool=pool)
    client.auto_close_connection_pool = True  # the client's close() closes the pool it was given
    return client


def _single_async(url: str, target: RedisTarget | None, timeout: float) -> Any:
    import redis.asyncio as aioredis

    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=CONNECTIONS, timeout=timeout, socket_timeout=timeout, socket_connect_timeout=timeout
    )
    client = aioredis.Redis(connection_pool=pool)
    client.auto_close_connection_pool = True
    return client


def _single_parse(url: str) -> RedisTarget | None:
    try:
        _redis("redis.connection").parse_url(url)  # redis-py reads these itself; a bad port or option is its ValueError
    except ValueError as error:
        raise _bad(url, str(error)) from error
    return None


# ------------------------------------------------------------------------------ several nodes: parsing
_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[^\[\]:/,]+)(?::(\d*))?$")


def _bad(url: str, why: str) -> ConfigurationError:
    return ConfigurationError(f"Redis URL {safe_url(url)!r}: {why}. Accepted forms: {_forms()}")


def _nodes(url: str, netloc: str, default_port: int) -> tuple[tuple[str, int], ...]:
    nodes = []
    for item in netloc.split(","):
        match = _HOST.match(item.strip())
        if match is None:
            raise _bad(url, f"{item!r} is not host:port")
        host, port_text = match.group(1).strip("[]"), match.group(2)
        if port_text is None:
            port = default_port
        elif not port_text or not 0 < int(port_text) < 65536:
            raise _bad(url, f"{item!r} has no valid port (1-65535)")
        else:
            port = int(port_text)
        nodes.append((host, port))
    return tuple(nodes)


def _options(url: str, query: str, user: str | None, password: str | None) -> dict[str, Any]:
    """The connection options of ``?query`` (typed by redis-py's own URL parser) and the URL's credentials."""
    try:
        options: dict[str, Any] = _redis("redis.connection").parse_url(f"redis://localhost/?{query}") if query else {}
    except ValueError as error:
        raise _bad(url, str(error)) from error
    for name in ("host", "port", "db", "path", "connection_class"):
        options.pop(name, None)
    if user:
        options["username"] = user
    if password:
        options["password"] = password
    return options


def _split(url: str, default_port: int) -> tuple[tuple[tuple[str, int], ...], list[str], dict[str, Any], bool]:
    """``url``'s nodes, path segments, options, and whether it asks for TLS."""
    scheme, _, rest = url.partition("://")
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if not hosts:
        raise _bad(url, "no host:port given")
    user, _, password = userinfo.partition(":") if at else ("", "", "")
    options = _options(url, query, unquote(user) or None, unquote(password) or None)
    segments = [segment for segment in path.split("/") if segment]
    return _nodes(url, hosts, default_port), segments, options, scheme.startswith("rediss")


def _db(url: str, text: str) -> int:
    if not text.isdigit():
        raise _bad(url, f"the database {text!r} is not a number")
    return int(text)


def _cluster_parse(url: str) -> RedisTarget:
    nodes, path, options, tls = _split(url, 6379)
    if len(path) > 1 or (path and _db(url, path[0]) != 0):
        raise _bad(url, "a Redis Cluster has only database 0 (end the URL in /0 or nothing)")
    return RedisTarget(url, nodes, tls, options=options)


def _sentinel_parse(url: str) -> RedisTarget:
    nodes, path, options, tls = _split(url, 26379)
    if not path:
        raise _bad(url, "no service name: the master's name as the Sentinels know it goes after the hosts (/SERVICE)")
    if len(path) > 2:
        raise _bad(url, f"{'/'.join(path)!r} is more than /SERVICE/DB")
    db = _db(url, path[1]) if len(path) == 2 else 0
    sentinel = {name[len("sentinel_") :]: options.pop(name) for name in list(options) if name.startswith("sentinel_")}
    return RedisTarget(url, nodes, tls, service=unquote(path[0]), db=db, options=options, sentinel_options=sentinel)


# ------------------------------------------------------------------------------ several nodes: clients
def _timeouts(timeout: float) -> dict[str, Any]:
    return {"socket_timeout": timeout, "socket_connect_timeout": timeout}


def _cluster_in(module: str) -> Callable[[str, RedisTarget | None, float], Any]:
    """The cluster client of ``module`` (``redis.cluster`` or ``redis.asyncio.cluster``: the same calls)."""

    def make(url: str, target: RedisTarget | None, timeout: float) -> Any:
        assert target is not None
        cluster = _redis(module)
        nodes = [cluster.ClusterNode(host, port) for host, port in target.nodes]
        return cluster.RedisCluster(startup_nodes=nodes, ssl=target.tls, **_timeouts(timeout), **target.options)

    return make


def _sentinel_in(module: str) -> Callable[[str, RedisTarget | None, float], Any]:
    """The master client through the Sentinels of ``module`` (``redis.sentinel`` or ``redis.asyncio.sentinel``)."""

    def make(url: str, target: RedisTarget | None, timeout: float) -> Any:
        assert target is not None
        assert target.service is not None
        # The Sentinels get the same TLS and timeouts as the master, and only their own credentials.
        own = {"ssl": target.tls, **_timeouts(timeout), **target.sentinel_options}
        sentinel = _redis(module).Sentinel(list(target.nodes), sentinel_kwargs=own, **_timeouts(timeout))
        options = {"db": target.db, "ssl": target.tls, **_timeouts(timeout), **target.options}
        return sentinel.master_for(target.service, **options)

    return make


_cluster_sync, _cluster_async = _cluster_in("redis.cluster"), _cluster_in("redis.asyncio.cluster")
_sentinel_sync, _sentinel_async = _sentinel_in("redis.sentinel"), _sentinel_in("redis.asyncio.sentinel")


_SINGLE = "redis://[[user]:password@]host[:port][/db]"
_CLUSTER = "redis+cluster://[[user]:password@]host:port[,host:port...][/0]"
_SENTINEL = "redis+sentinel://[[user]:password@]host:port[,host:port...]/SERVICE[/db]"
_REGISTRY: dict[str, _Scheme] = {
    "redis": _Scheme(_SINGLE, _single_sync, _single_async, _single_parse),
    "rediss": _Scheme("rediss://... (TLS)", _single_sync, _single_async, _single_parse),
    "unix": _Scheme("unix:///path/redis.sock[?db=N]", _single_sync, _single_async, _single_parse),
    "redis+cluster": _Scheme(_CLUSTER, _cluster_sync, _cluster_async, _cluster_parse),
    "rediss+cluster": _Scheme("rediss+cluster://... (TLS)", _cluster_sync, _cluster_async, _cluster_parse),
    "redis+sentinel": _Scheme(_SENTINEL, _sentinel_sync, _sentinel_async, _sentinel_parse),
    "rediss+sentinel": _Scheme("rediss+sentinel://... (TLS)", _sentinel_sync, _sentinel_async, _sentinel_parse),
}

#: The URL schemes a Redis setting takes.
SCHEMES = tuple(f"{name}://" for name in _REGISTRY)


def _forms() -> str:
    return "; ".join(scheme.form for scheme in _REGISTRY.values())


def _scheme(url: object) -> _Scheme:
    name, sep, _ = url.partition("://") if isinstance(url, str) else ("", "", "")
    scheme = _REGISTRY.get(name) if sep else None
    if scheme is None:
        shown = safe_url(url) if isinstance(url, str) else url
        raise ConfigurationError(f"{shown!r} is not a Redis URL. Accepted forms: {_forms()}")
    return scheme


def is_redis_url(value: object) -> bool:
    """Whether ``value`` is a URL in one of :data:`SCHEMES`."""
    return isinstance(value, str) and value.startswith(SCHEMES)


def parse(url: str) -> RedisTarget | None:
    """Check ``url`` without connecting: a :class:`RedisTarget` for a cluster or Sentinel URL, None for one server
    (redis-py reads those). A bad URL is a :class:`ConfigurationError` naming it and the accepted forms."""
    return _scheme(url).parse(url)


def connect(url: str, *, asynchronous: bool = False, timeout: float = 5.0) -> Any:
    """A client for ``url`` (a ``redis.asyncio`` one when ``asynchronous``). Clients connect on first use, except a
    sync cluster client, which reads the cluster's slot layout at once (and raises one of
    :func:`connection_errors` when no startup node answers)."""
    scheme = _scheme(url)
    return (scheme.asynchronous if asynchronous else scheme.sync)(url, scheme.parse(url), timeout)


def connection_errors() -> tuple[type[Exception], ...]:
    """The exceptions that mean the server cannot be reached (as opposed to a bad command): connection loss and
    timeouts, a Sentinel that knows no master (``MasterNotFoundError`` is a ``ConnectionError``), a cluster with
    slots unserved (``CLUSTERDOWN``) or no node that answers."""
    import redis
    from redis import exceptions

    return (
        redis.ConnectionError,
        redis.TimeoutError,
        exceptions.ClusterError,  # ClusterDownError, MasterDownError: slots without a live master
        exceptions.RedisClusterException,  # no startup node reachable, slot not covered
    )


_SECRET = re.compile(r"((?:^|[?&])[^=&]*password=)[^&]*", re.IGNORECASE)


def safe_url(url: str) -> str:
    """``url`` without passwords (the userinfo's and ``...password=`` options'); the user name stays."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    rest, qmark, query = rest.partition("?")
    netloc, slash, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if at:
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}:***@{hosts}" if colon and user else f"***@{hosts}"
    query = _SECRET.sub(r"\1***", query)
    return f"{scheme}://{netloc}{slash}{path}{qmark}{query}"
