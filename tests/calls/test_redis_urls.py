"""Redis URLs beyond one server: Redis Cluster and Sentinel, read by contextkeeper.calls.redis_client, and the shared
KV ledger over each, on real servers started by the tests (3 cluster nodes; a master, a replica and a Sentinel)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
from test_redis_ledger import wrapped_call_through

import contextkeeper as ck
from contextkeeper._exceptions import ConfigurationError
from contextkeeper.calls.redis_client import SCHEMES, connect, connection_errors, is_redis_url, parse, safe_url
from contextkeeper.calls.redis_ledger import LedgerUnavailable, RedisLedger
from engines import RedisCluster, RedisSentinel


# ------------------------------------------------------------------------------------------ parsing
def test_cluster_urls_name_their_startup_nodes() -> None:
    target = parse("redis+cluster://:s3cret@10.0.0.1:7000,10.0.0.2:7001,[::1]:7002,cache/0?socket_keepalive=true")
    assert target is not None
    assert target.nodes == (("10.0.0.1", 7000), ("10.0.0.2", 7001), ("::1", 7002), ("cache", 6379))
    assert (target.tls, target.db, target.service) == (False, 0, None)
    assert target.options == {"password": "s3cret", "socket_keepalive": True}  # typed by redis-py's parser
    tls = parse("rediss+cluster://app:pw@h:7000")
    assert tls is not None
    assert (tls.tls, tls.options) == (True, {"username": "app", "password": "pw"})


def test_sentinel_urls_name_the_service_and_the_sentinels_own_credentials() -> None:
    target = parse("redis+sentinel://:master-pw@s1:26379,s2/mymaster/3?sentinel_password=sentinel-pw")
    assert target is not None
    assert target.nodes == (("s1", 26379), ("s2", 26379))
    assert (target.service, target.db, target.tls) == ("mymaster", 3, False)
    assert target.options == {"password": "master-pw"}
    assert target.sentinel_options == {"password": "sentinel-pw"}
    tls = parse("rediss+sentinel://s1:5000/mymaster")
    assert tls is not None
    assert (tls.service, tls.db, tls.tls) == ("mymaster", 0, True)
    assert parse("redis://localhost:6379/0") is None  # one server: redis-py reads it
    assert all(is_redis_url(f"{scheme}h:1/x") for scheme in SCHEMES)
    assert {"redis+cluster://", "rediss+cluster://", "redis+sentinel://", "rediss+sentinel://"} <= set(SCHEMES)


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("redis+sentinel://s1:26379", "no service name"),
        ("redis+sentinel://s1:26379/", "no service name"),
        ("redis+sentinel://s1:26379/svc/0/x", "more than /SERVICE/DB"),
        ("redis+sentinel://s1:26379/svc/zero", "is not a number"),
        ("redis+cluster://h:99999", "no valid port"),
        ("redis+cluster://h:7000,h:", "no valid port"),
        ("redis+cluster://h:port", "is not host:port"),
        ("redis+cluster://:pw@/0", "no host:port"),
        ("redis+cluster://h:7000/1", "only database 0"),
        ("redis://localhost:abc/0", "Port could not be cast"),
        ("redis+foo://h:1", "is not a Redis URL"),
        ("http://h:1", "is not a Redis URL"),
        ("localhost:6379", "is not a Redis URL"),
    ],
)
def test_a_bad_url_is_a_configuration_error_with_the_accepted_forms(url: str, why: str) -> None:
    with pytest.raises(ConfigurationError, match=why) as raised:
        parse(url)
    message = str(raised.value)
    assert "redis+cluster://[[user]:password@]host:port[,host:port...][/0]" in message
    assert "redis+sentinel://[[user]:password@]host:port[,host:port...]/SERVICE[/db]" in message
    with pytest.raises(ConfigurationError, match=why):
        connect(url)  # connecting reads the URL the same way, before any socket


def test_a_bad_url_with_a_password_does_not_show_it() -> None:
    with pytest.raises(ConfigurationError) as raised:
        parse("redis+sentinel://:hunter2@s1:26379")
    assert "hunter2" not in str(raised.value)
    assert "redis+sentinel://***@s1:26379" in str(raised.value)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:pw@h:6379/0", "redis://***@h:6379/0"),
        ("rediss://app:pw@h:6379/0", "rediss://app:***@h:6379/0"),
        ("redis+cluster://:pw@a:1,b:2/0", "redis+cluster://***@a:1,b:2/0"),
        ("rediss+cluster://app:p@ss@a:1,b:2", "rediss+cluster://app:***@a:1,b:2"),
        (
            "redis+sentinel://:pw@s1:1,s2:2/svc/0?sentinel_password=spw&socket_keepalive=true",
            "redis+sentinel://***@s1:1,s2:2/svc/0?sentinel_password=***&socket_keepalive=true",
        ),
        ("redis://h:6379/0?password=pw", "redis://h:6379/0?password=***"),
        ("redis+cluster://a:1,b:2/0", "redis+cluster://a:1,b:2/0"),
        ("unix:///run/redis.sock?db=1", "unix:///run/redis.sock?db=1"),
    ],
)
def test_safe_url_hides_every_password(url: str, shown: str) -> None:
    assert safe_url(url) == shown


def test_unreachable_cluster_and_sentinel_errors_count_as_unavailable() -> None:
    from redis.exceptions import ClusterDownError, MasterDownError, RedisClusterException, SlotNotCoveredError
    from redis.sentinel import MasterNotFoundError, SlaveNotFoundError

    errors = connection_errors()
    for error in (ClusterDownError, MasterDownError, RedisClusterException, SlotNotCoveredError):
        assert issubclass(error, errors), error
    for error in (MasterNotFoundError, SlaveNotFoundError):
        assert issubclass(error, errors), error


# ------------------------------------------------------------------------------------------ cluster
@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    with RedisCluster() as server:
        yield server


@pytest.fixture
def pool(request: pytest.FixtureRequest) -> str:
    return f"u-{request.node.name[:40]}-{time.monotonic_ns()}"


def _pools_on_each_node(cluster: RedisCluster) -> dict[int, str]:
    """A pool name whose slot each node serves (port -> pool)."""
    client = connect(cluster.url)
    found: dict[int, str] = {}
    for index in range(200):
        name = f"spread-{time.monotonic_ns()}-{index}"
        found.setdefault(client.get_node_from_key(f"{{ck:{name}}}:held").port, name)
        if len(found) == len(cluster.ports):
            break
    client.close()
    return found


def _share_one_capacity(url: str, pool: str) -> None:
    first, second = RedisLedger(url, 1000, pool=pool), RedisLedger(url, 1000, pool=pool)
    with first.admit(700) as held:
        assert second.available() == 300
        with pytest.raises(ck.calls.AdmissionTimeout):
            second.acquire(400, timeout=0.2)
        with second.admit(300):
            assert first.available() == 0
        assert held.tokens == 700

    async def main() -> list[int]:
        held = first.acquire(600)
        waiting = asyncio.ensure_future(second.acquire_async(600, timeout=5))
        await asyncio.sleep(0.2)
        assert not waiting.done()  # the async call waits for the sync one of the other ledger
        held.release()
        ticket = await waiting
        grants = [ticket.tokens, first.available() or 0]
        ticket.release()
        return grants

    assert asyncio.run(main()) == [600, 400]
    assert asyncio.run(main()) == [600, 400]  # a second event loop: a client (and its scripts) made there
    assert second.stats()["peak"] == 1000
    first.close()
    second.close()


def test_two_ledgers_of_one_pool_admit_against_one_capacity_on_a_cluster(cluster: RedisCluster) -> None:
    pools = _pools_on_each_node(cluster)
    assert sorted(pools) == sorted(cluster.ports)
    for name in pools.values():  # the scripts are loaded, and run, on every node that serves a pool
        _share_one_capacity(cluster.url, name)


def test_a_cluster_node_down_makes_its_pools_unavailable_then_they_come_back(cluster: RedisCluster) -> None:
    pools = _pools_on_each_node(cluster)
    port = cluster.ports[0]
    node = next(node for node in cluster.nodes if node.port == port)
    ledger = RedisLedger(cluster.url, 1000, pool=pools[port])
    node.stop()
    try:
        started = time.monotonic()
        with pytest.raises(LedgerUnavailable, match="redis\\+cluster://"):
            ledger.acquire(100, timeout=2)
        assert time.monotonic() - started < 15  # nothing hangs
    finally:
        node.start()
        cluster.wait_ok()
    with ledger.admit(900) as ticket:  # the node came back empty: the pool's capacity is stored again
        assert ticket.tokens == 900
    ledger.close()


def test_the_keeper_admits_through_a_cluster_ledger(cluster: RedisCluster, pool: str) -> None:
    import assets

    _, stats = wrapped_call_through(cluster.url, pool, shared=False)
    other = RedisLedger(cluster.url, 5000, pool=pool)  # another replica sees what the keeper booked
    assert other.stats()["peak"] == stats["peak"]
    other.close()
    bad = ck.ContextKeeper(
        str(assets.tokenizer_dir("qwen2")), context_window=4096, kv_capacity=5000,
        ledger="redis+sentinel://127.0.0.1:1", shared=False,
    )  # fmt: skip
    with pytest.raises(ConfigurationError, match="no service name"):
        _ = bad.ledger


def test_a_cluster_with_no_node_up_is_unavailable() -> None:
    with pytest.raises(LedgerUnavailable, match="Fix: start Redis"):
        RedisLedger("redis+cluster://127.0.0.1:9,127.0.0.1:11/0", 1000)


# ----------------------------------------------------------------------------------------- sentinel
@pytest.fixture(scope="module")
def sentinel() -> Iterator[RedisSentinel]:
    with RedisSentinel() as server:
        yield server


def test_two_ledgers_of_one_pool_admit_against_one_capacity_through_sentinel(
    sentinel: RedisSentinel, pool: str
) -> None:
    _share_one_capacity(sentinel.url, pool)


def test_a_service_the_sentinels_do_not_know_is_unavailable(sentinel: RedisSentinel) -> None:
    started = time.monotonic()
    with pytest.raises(LedgerUnavailable, match="MasterNotFoundError"):
        RedisLedger(f"redis+sentinel://127.0.0.1:{sentinel.port}/no-such-service/0", 1000)
    assert time.monotonic() - started < 10


def test_a_failover_is_followed(pool: str) -> None:
    """The master dies; while no master is named, calls are LedgerUnavailable; then the Sentinel's promoted replica
    serves the pool, with the capacity and high-water mark it replicated."""
    with RedisSentinel(replicas=1) as servers:
        ledger = RedisLedger(servers.url, 1000, pool=pool)
        with ledger.admit(700):
            pass
        time.sleep(0.2)  # replicated
        servers.master.stop()
        stopped, refused, admitted = time.monotonic(), 0, None
        while time.monotonic() - stopped < 20 and admitted is None:
            try:
                with ledger.admit(100, timeout=5) as ticket:  # (a promoted replica settles first: 2.5 s)
                    admitted = ticket
            except LedgerUnavailable:
                refused += 1
                time.sleep(0.05)
        assert admitted is not None, "no master was found within 20 s of the failover"
        print(f"\nfailover: admitted {time.monotonic() - stopped:.2f} s after the master stopped; {refused} refusals")
        assert refused > 0
        assert servers.master_port() == servers.replicas[0].port
        stats: dict[str, Any] = ledger.stats()
        assert (stats["capacity"], stats["peak"], stats["active"]) == (1000, 700, 0)
        ledger.close()


def test_the_url_password_is_the_masters_and_not_the_sentinels(pool: str) -> None:
    import redis

    with RedisSentinel() as servers:
        master = redis.Redis(port=servers.master.port)
        master.config_set("requirepass", "m4ster")  # the Sentinel itself has none: sent to it, AUTH would fail
        master.close()
        url = f"redis+sentinel://:m4ster@127.0.0.1:{servers.port}/{servers.service}/0"
        ledger = RedisLedger(url, 1000, pool=pool)
        with ledger.admit(400) as ticket:
            assert ticket.tokens == 400
        ledger.close()
        with pytest.raises(LedgerUnavailable, match="AuthenticationError") as raised:
            RedisLedger(servers.url, 1000, pool=pool)
        assert "m4ster" not in str(raised.value)
        with pytest.raises(LedgerUnavailable) as raised:
            RedisLedger(url.replace("m4ster", "wrong"), 1000, pool=pool)
        assert "wrong" not in str(raised.value)


def test_a_target_does_not_show_its_passwords() -> None:
    target = parse("redis+sentinel://:pw1@s1:1/svc?sentinel_password=pw2")
    assert "pw1" not in repr(target)
    assert "pw2" not in repr(target)
