"""Real Redis and Postgres servers for the tests, started by the tests.

Each is installed from its Debian package when missing (``redis-server``, ``postgresql``; CI runs as root), then
started on a free loopback port in a temporary directory, and stopped when the test session ends. Nothing listens
beyond 127.0.0.1; every wait is bounded. :class:`RedisCluster` (three nodes joined by ``redis-cli --cluster
create``) and :class:`RedisSentinel` (a master watched by one ``redis-server --sentinel``) are built from the same
parts.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Self

_APT_UPDATED: list[bool] = []


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _free_cluster_port() -> int:
    """A loopback port free together with its cluster bus port (+10000), both below 65536."""
    for _ in range(200):
        port = random.randrange(20000, 30000)
        try:
            with socket.socket() as first, socket.socket() as second:
                first.bind(("127.0.0.1", port))
                second.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free pair of loopback ports (port, port + 10000) in 20000-30000")


def install(package: str, present: bool) -> None:
    """Install a Debian package when it is not ``present`` (root only; otherwise the caller skips)."""
    if present:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise RuntimeError(f"{package} is not installed, and installing it needs root and apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    command = ["apt-get", "install", "-y", "-q", "--no-install-recommends", package]
    # The package would start its own service on the default port; the tests start theirs, so forbid that while
    # it installs (policy-rc.d exit 101: "action forbidden").
    policy = Path("/usr/sbin/policy-rc.d")
    made = not policy.exists()
    if made:
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600, check=False)
        if done.returncode != 0 and not _APT_UPDATED:
            _APT_UPDATED.append(True)
            subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env, timeout=600, check=False)
            done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600, check=False)
    finally:
        if made:
            policy.unlink(missing_ok=True)
    if done.returncode != 0:
        raise RuntimeError(f"apt-get install {package} failed: {done.stderr[-500:]}")


def _wait_port(port: int, process: subprocess.Popen[bytes], what: str, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}")
        with socket.socket() as sock:
            sock.settimeout(0.5)
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {seconds:.0f} s")


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=5)


class _Running:
    """Something the tests start and stop, in a directory of its own that :meth:`close` removes."""

    dir: str | Path

    def start(self) -> Self:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Engine(_Running):
    """A server process on ``self.port``: each engine says only how it is started (:meth:`command`)."""

    name = "server"
    port: int
    process: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def start(self) -> Self:
        self.process = subprocess.Popen(self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_port(self.port, self.process, self.name)
        return self

    def stop(self) -> None:
        if self.process is not None:
            _stop(self.process)
            self.process = None


class RedisServer(_Engine):
    """``redis-server`` on a free loopback port, nothing saved to disk; ``url`` is ``redis://127.0.0.1:PORT/0``."""

    name = "redis-server"

    def __init__(self) -> None:
        install("redis-server", shutil.which("redis-server") is not None)
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.dir = tempfile.mkdtemp(prefix="ck-redis-")

    def command(self) -> list[str]:
        return [
            str(shutil.which("redis-server")),
            "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.dir),
            "--save", "", "--appendonly", "no", "--protected-mode", "yes", "--daemonize", "no",
        ]  # fmt: skip

    def restart(self) -> None:
        """Stop and start again on the same port: nothing was saved, so it comes back empty."""
        self.stop()
        self.start()

    def kill(self) -> None:
        """SIGKILL: a crash (no shutdown, nothing handed to replicas)."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=15)
            self.process = None


def _postgres_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"), key=lambda p: int(Path(p).parts[-3]))
    return Path(found[-1]).parent if found else None


class PostgresServer(_Engine):
    """A Postgres cluster made with ``initdb`` in a temporary directory and served on a free loopback port (as the
    ``postgres`` user when run as root, which Postgres requires); ``url`` connects as superuser ``ck``."""

    name = "postgres"

    def __init__(self) -> None:
        install("postgresql", _postgres_bin() is not None)
        found = _postgres_bin()
        assert found is not None
        self.bin: Path = found
        self.port = _free_port()
        self.url = f"postgresql://ck@127.0.0.1:{self.port}/postgres"
        self.dir = Path(tempfile.mkdtemp(prefix="ck-postgres-"))
        self.data = self.dir / "data"
        self.prefix: list[str] = []
        if os.geteuid() == 0:
            owner = pwd.getpwnam("postgres")
            os.chown(self.dir, owner.pw_uid, owner.pw_gid)
            self.prefix = ["runuser", "-u", "postgres", "--"]
        initdb = [*self.prefix, str(self.bin / "initdb"), "-D", str(self.data), "-U", "ck", "-A", "trust"]
        done = subprocess.run([*initdb, "--no-sync"], capture_output=True, text=True, timeout=120, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"initdb failed: {done.stderr[-500:]}")

    def start(self) -> Self:
        """Start, and wait until sessions are accepted (it listens a moment before it is done starting up)."""
        super().start()
        deadline = time.monotonic() + 30
        ready = [str(self.bin / "pg_isready"), "-q", "-h", "127.0.0.1", "-p", str(self.port), "-t", "5"]
        while subprocess.run(ready, capture_output=True, timeout=10, check=False).returncode != 0:
            if time.monotonic() > deadline:
                raise RuntimeError(f"postgres on 127.0.0.1:{self.port} did not accept sessions within 30 s")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        """A fast shutdown (SIGINT to the postmaster: sessions are ended), as an operator's restart does; SIGTERM,
        a smart shutdown, would wait for every client to hang up."""
        if self.process is None:
            return
        pid_file = self.data / "postmaster.pid"
        if pid_file.exists():  # the process started may be runuser's; the postmaster's own pid is in this file
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(pid_file.read_text().split()[0]), signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=30)
        super().stop()

    def command(self) -> list[str]:
        return [
            *self.prefix, str(self.bin / "postgres"), "-D", str(self.data), "-p", str(self.port),
            "-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={self.dir}",
            "-c", "fsync=off", "-c", "max_connections=200",
        ]  # fmt: skip


def _redis_cli(*args: str, timeout: float = 30.0) -> str:
    """``redis-cli ARGS`` (from the redis-server package, or redis-tools), its stdout; an error names the output."""
    install("redis-tools", shutil.which("redis-cli") is not None)
    done = subprocess.run(
        [str(shutil.which("redis-cli")), *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"redis-cli {' '.join(args)} failed ({done.returncode}): {(done.stdout + done.stderr)[-500:]}"
        )
    return done.stdout


class _ClusterNode(RedisServer):
    """One ``redis-server --cluster-enabled yes`` node (its bus on ``port + 10000``)."""

    name = "redis-server (cluster node)"

    def __init__(self, port: int, root: str) -> None:
        install("redis-server", shutil.which("redis-server") is not None)
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self.dir = os.path.join(root, str(port))
        os.makedirs(self.dir, exist_ok=True)

    def command(self) -> list[str]:
        return [
            *super().command(),
            "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000",
        ]  # fmt: skip


class RedisCluster(_Running):
    """A Redis Cluster of ``nodes`` masters (no replicas) on free loopback ports; ``url`` is
    ``redis+cluster://127.0.0.1:P1,127.0.0.1:P2,.../0``. The slots are assigned once, by ``redis-cli --cluster
    create``; a stopped cluster starts again from its nodes' saved layout."""

    name = "redis cluster"

    def __init__(self, nodes: int = 3) -> None:
        self.dir = tempfile.mkdtemp(prefix="ck-redis-cluster-")
        self.nodes = [_ClusterNode(_free_cluster_port(), self.dir) for _ in range(nodes)]
        self.ports = [node.port for node in self.nodes]
        self.url = "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in self.ports) + "/0"
        self.created = False

    def start(self) -> Self:
        for node in self.nodes:
            node.start()
        if not self.created:
            _redis_cli(
                "--cluster", "create", *(f"127.0.0.1:{port}" for port in self.ports),
                "--cluster-replicas", "0", "--cluster-yes",
            )  # fmt: skip
            self.created = True
        self.wait_ok()
        return self

    def wait_ok(self, seconds: float = 20.0) -> None:
        """Wait until every node says ``cluster_state:ok`` (all slots served)."""
        deadline = time.monotonic() + seconds
        states: list[str] = []
        while time.monotonic() < deadline:
            states = [_redis_cli("-p", str(port), "cluster", "info", timeout=5) for port in self.ports]
            if all("cluster_state:ok" in state for state in states):
                return
            time.sleep(0.1)
        raise RuntimeError(f"the cluster on {self.ports} was not ok within {seconds:.0f} s: {states}")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


class _SentinelProcess(_Engine):
    """``redis-server CONF --sentinel`` watching one master (quorum 1); Sentinel rewrites CONF, so it is its own."""

    name = "redis-server --sentinel"

    def __init__(self, root: str, service: str, master_port: int) -> None:
        self.port = _free_port()
        self.dir = root
        self.config = os.path.join(root, "sentinel.conf")
        with open(self.config, "w") as config:
            config.write(
                f"port {self.port}\nbind 127.0.0.1\ndir {root}\ndaemonize no\n"
                f"sentinel monitor {service} 127.0.0.1 {master_port} 1\n"
                f"sentinel down-after-milliseconds {service} 1000\n"
                f"sentinel failover-timeout {service} 5000\n"
            )

    def command(self) -> list[str]:
        return [str(shutil.which("redis-server")), self.config, "--sentinel"]


class RedisSentinel(_Running):
    """A Redis master (``master``, a :class:`RedisServer`) and one Sentinel monitoring it as ``service``, with
    ``replicas`` replicas of the master when a failover is to be tried; ``url`` is
    ``redis+sentinel://127.0.0.1:SENTINEL_PORT/SERVICE/0``."""

    name = "redis sentinel"

    def __init__(self, service: str = "ckmaster", replicas: int = 0) -> None:
        self.service = service
        self.master = RedisServer()
        self.replicas = [RedisServer() for _ in range(replicas)]
        self.dir = tempfile.mkdtemp(prefix="ck-redis-sentinel-")
        self.sentinel = _SentinelProcess(self.dir, service, self.master.port)
        self.port = self.sentinel.port
        self.url = f"redis+sentinel://127.0.0.1:{self.port}/{service}/0"

    def start(self) -> Self:
        self.master.start()
        # A replica's first sync waits 5 s for more replicas by default: none are coming.
        _redis_cli("-p", str(self.master.port), "config", "set", "repl-diskless-sync-delay", "0", timeout=5)
        for replica in self.replicas:
            replica.start()
            _redis_cli("-p", str(replica.port), "replicaof", "127.0.0.1", str(self.master.port), timeout=5)
        for replica in self.replicas:
            self._wait_synced(replica.port)
        self.sentinel.start()
        self.wait_master(self.master.port)
        return self

    def _wait_synced(self, port: int, seconds: float = 20.0) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if "master_link_status:up" in _redis_cli("-p", str(port), "info", "replication", timeout=5):
                return
            time.sleep(0.05)
        raise RuntimeError(f"the replica on {port} did not sync with its master within {seconds:.0f} s")

    def master_port(self) -> int | None:
        """The port the Sentinel names for the service's master now."""
        answer = _redis_cli("-p", str(self.port), "sentinel", "get-master-addr-by-name", self.service, timeout=5)
        lines = answer.split()
        return int(lines[1]) if len(lines) == 2 else None

    def wait_master(self, port: int, seconds: float = 20.0) -> None:
        """Wait until the Sentinel names ``port`` as the master (after a start, or a failover)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.master_port() == port:
                return
            time.sleep(0.1)
        raise RuntimeError(f"the sentinel on {self.port} did not name 127.0.0.1:{port} within {seconds:.0f} s")

    def stop(self) -> None:
        self.sentinel.stop()
        for replica in self.replicas:
            replica.stop()
        self.master.stop()

    def close(self) -> None:
        self.stop()
        for server in (self.master, *self.replicas):
            server.close()
        shutil.rmtree(self.dir, ignore_errors=True)
