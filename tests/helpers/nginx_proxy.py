"""nginx for tests: the shipped tools/deploy/nginx.conf, run unprivileged from a prefix directory.

    proxy = start_nginx(tmp_path / "nginx", ["127.0.0.1:8001", "127.0.0.1:8002"])
    proxy.base_url, proxy.access_log_lines()
    stop_nginx(proxy)

The shipped file runs as it is; only its replica addresses (the `server ...  # replica` lines) and its
listen address (the `listen ...;  # proxy port` line) are substituted. A start that fails says why, with
nginx's error log.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

from helpers.processes import stop_process, wait_until_ready
from helpers.running_server import free_port

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
SHIPPED_CONFIG = Path(__file__).resolve().parents[2] / "tools" / "deploy" / "nginx.conf"
REPLICA_LINE = re.compile(r"^(\s*server\s+)(\S+)(\s.*#\s*replica\s*)$", re.MULTILINE)
LISTEN_LINE = re.compile(r"^(\s*listen\s+)([^;\s]+)(;\s*#\s*proxy port\s*)$", re.MULTILINE)
START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0


def config_for(replicas: list[str], listen: str) -> str:
    """The shipped config with these replica addresses (host:port) and this listen address."""
    text = SHIPPED_CONFIG.read_text()
    num_replica_lines = len(REPLICA_LINE.findall(text))
    if num_replica_lines != len(replicas):
        raise ValueError(f"expected {len(replicas)} `server ...  # replica` lines in {SHIPPED_CONFIG}, "
                         f"found {num_replica_lines}")
    addresses = iter(replicas)
    text = REPLICA_LINE.sub(lambda match: f"{match[1]}{next(addresses)}{match[3]}", text)
    text, num_listen_lines = LISTEN_LINE.subn(lambda match: f"{match[1]}{listen}{match[3]}", text)
    if num_listen_lines != 1:
        raise ValueError(f"expected one `listen ...;  # proxy port` line in {SHIPPED_CONFIG}, found {num_listen_lines}")
    return text


def nginx_command(prefix: Path, config: Path, *args: str) -> list[str]:
    """nginx with its prefix, its config and its start-up error log under the prefix, as the config's header says."""
    (prefix / "logs").mkdir(parents=True, exist_ok=True)
    return [NGINX, "-p", str(prefix), "-c", str(config), "-e", "logs/error.log", *args]


@dataclass
class NginxProxy:
    process: subprocess.Popen
    port: int
    prefix: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def error_log(self) -> str:
        path = self.prefix / "logs" / "error.log"
        return path.read_text() if path.exists() else "(no error log)"

    def access_log_lines(self) -> list[str]:
        path = self.prefix / "logs" / "access.log"
        return path.read_text().splitlines() if path.exists() else []

    def is_listening(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
            return True
        except OSError:
            return False


def start_nginx(prefix: Path, replicas: list[str]) -> NginxProxy:
    """nginx in the foreground on a free loopback port, proxying to `replicas`, once it accepts connections."""
    prefix.mkdir(parents=True, exist_ok=True)
    port = free_port()
    config = prefix / "nginx.conf"
    config.write_text(config_for(replicas, f"127.0.0.1:{port}"))
    process = subprocess.Popen(nginx_command(prefix, config, "-g", "daemon off;"), stdout=subprocess.DEVNULL,
                               stderr=subprocess.STDOUT, start_new_session=True)  # its own group: master + workers
    proxy = NginxProxy(process, port, prefix)
    wait_until_ready(process, proxy.is_listening, f"nginx did not start listening on port {port}",
                     lambda: proxy.error_log, START_TIMEOUT_S, stop=lambda: stop_nginx(proxy))
    return proxy


def stop_nginx(proxy: NginxProxy) -> None:
    """Fast shutdown (SIGTERM: the master stops its workers); a master that lingers dies with its whole group."""
    stop_process(proxy.process, STOP_TIMEOUT_S, kill_group=True)
