"""A real redis-server for tests: on a free port, in a test's directory, stopped and started again at will.

    redis = start_redis(tmp_path / "redis")  # no RDB snapshots; an append-only file in tmp_path/redis
    redis.url                                # redis://127.0.0.1:PORT/0
    stop_redis(redis)                        # SIGTERM: redis flushes the append-only file and exits
    restart_redis(redis)                     # the same port, directory and data, in a new process

Snapshots are off (`--save ''`); the append-only file (`--appendonly yes`) is what lets the data outlive
a stop and start, as it would for a Redis run with persistence. Every failure message carries redis's log.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

from helpers.processes import stop_process, wait_until_ready
from helpers.running_server import free_port

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0


@dataclass
class RedisServer:
    process: subprocess.Popen
    port: int
    directory: Path

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log(self) -> str:
        path = self.directory / "redis.log"
        return path.read_text() if path.exists() else "(no log)"

    def is_ready(self) -> bool:
        """True once redis answers PING (while loading its append-only file it answers -LOADING)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False


def start_redis(directory: Path) -> RedisServer:
    """redis-server on a free port, its files and log in `directory`, once it answers PING."""
    directory.mkdir(parents=True, exist_ok=True)
    port = free_port()
    server = RedisServer(_launch(port, directory), port, directory)
    _wait_until_ready(server)
    return server


def restart_redis(server: RedisServer) -> None:
    """Start a stopped server again on its port and directory (it reloads its append-only file)."""
    if server.process.poll() is None:
        raise AssertionError(f"redis-server on port {server.port} still runs; stop_redis() it first")
    server.process = _launch(server.port, server.directory)
    _wait_until_ready(server)


def _launch(port: int, directory: Path) -> subprocess.Popen:
    command = [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(directory), "--save", "",
               "--appendonly", "yes", "--logfile", str(directory / "redis.log"), "--daemonize", "no"]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def _wait_until_ready(server: RedisServer) -> None:
    wait_until_ready(server.process, server.is_ready, f"redis-server did not answer on port {server.port}",
                     lambda: server.log, START_TIMEOUT_S, stop=lambda: stop_redis(server), interval=0.02)


def stop_redis(server: RedisServer) -> None:
    """SIGTERM (redis flushes the append-only file and exits), SIGKILL if it takes too long."""
    stop_process(server.process, STOP_TIMEOUT_S)
