"""Real Redis and Postgres servers for the tests, started by the tests.

Each is installed from its Debian package when missing (``redis-server``, ``postgresql``; CI runs as root), then
started on a free loopback port in a temporary directory, and stopped when the test session ends. Nothing listens
beyond 127.0.0.1; every wait is bounded.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
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


class _Engine:
    """A server process on ``self.port``: each engine says only how it is started (:meth:`command`)."""

    name = "server"
    port: int
    dir: str | Path
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

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


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

    def command(self) -> list[str]:
        return [
            *self.prefix, str(self.bin / "postgres"), "-D", str(self.data), "-p", str(self.port),
            "-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={self.dir}",
            "-c", "fsync=off", "-c", "max_connections=200",
        ]  # fmt: skip
