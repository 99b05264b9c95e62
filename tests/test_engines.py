"""The real Redis and Postgres the shared-state tests use: installed when missing, started on loopback, stopped."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from engines import PostgresServer, RedisServer


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def postgres_server() -> Iterator[PostgresServer]:
    with PostgresServer() as server:
        yield server


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_a_real_redis_answers_on_loopback(redis_server: RedisServer) -> None:
    import redis

    client = redis.Redis.from_url(redis_server.url)
    assert client.ping() is True
    assert client.incrby("{ck:test}:n", 5) == 5
    assert int(client.info("server")["redis_version"].split(".")[0]) >= 6  # server-side scripts with TIME
    client.close()


def test_a_real_postgres_answers_on_loopback(postgres_server: PostgresServer) -> None:
    import psycopg

    with psycopg.connect(postgres_server.url, connect_timeout=10) as connection:
        version = connection.execute("select current_setting('server_version_num')::int").fetchone()
        assert version is not None
        assert version[0] >= 130000
        connection.execute("create table t (k text primary key)")
        connection.execute("insert into t values ('a')")
        assert connection.execute("select count(*) from t").fetchone() == (1,)


def test_servers_stop_and_leave_nothing_listening() -> None:
    with RedisServer() as redis_server:
        port = redis_server.port
        assert _listening(port)
    assert not _listening(port)
    with PostgresServer() as postgres_server:
        port = postgres_server.port
        assert _listening(port)
    assert not _listening(port)
