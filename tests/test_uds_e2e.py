"""--uds: `python -m server` listening on a Unix socket instead of a TCP port, as vLLM's --uds does."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
from pathlib import Path

from helpers.processes import stop_process, wait_until_ready
from helpers.running_server import START_TIMEOUT_S, WAIT_S
from helpers.tiny_tokenizer import make_served_checkpoint

SERVER_FLAGS = ("--served-model-name", "tiny", "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "256",
                "--max-num-seqs", "4", "--standby-workers", "0")
SHUTDOWN_GRACE_S = 30


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: Path):
        super().__init__("localhost", timeout=WAIT_S)
        self.socket_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(WAIT_S)
        self.sock.connect(str(self.socket_path))


def exchange(path: Path, method: str, target: str, body: dict | None = None) -> tuple[int, bytes]:
    conn = UnixHTTPConnection(path)
    try:
        conn.request(method, target, body=json.dumps(body) if body is not None else None,
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def is_healthy(path: Path) -> bool:
    try:
        return exchange(path, "GET", "/health")[0] == 200
    except OSError:
        return False


def test_serves_on_a_unix_socket_replacing_a_stale_one_and_removes_it_on_exit(tmp_path: Path) -> None:
    uds = tmp_path / "pagedserve.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as gone:
        gone.bind(str(uds))  # the socket file a server that is gone left behind
    log = tmp_path / "server.log"
    command = [sys.executable, "-m", "server", "--model", str(make_served_checkpoint(tmp_path)), "--uds", str(uds),
               "--state-store", f"sqlite://{tmp_path / 'responses.db'}", *SERVER_FLAGS]
    with open(log, "wb") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        wait_until_ready(process, lambda: is_healthy(uds), "the server's /health never said 200 on its socket",
                         log.read_text, START_TIMEOUT_S, stop=lambda: stop_process(process))
        assert f"listening on the Unix socket {uds} (http)" in log.read_text()
        status, body = exchange(uds, "POST", "/v1/completions", {"model": "tiny", "prompt": "to be", "max_tokens": 3})
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 3, body
        second = subprocess.run(command, capture_output=True, text=True, timeout=WAIT_S)
        assert second.returncode != 0  # a live server's socket is not taken over
        assert f"cannot listen on the Unix socket {uds}" in second.stderr, second.stderr
        assert is_healthy(uds)
    finally:
        assert stop_process(process, grace_s=SHUTDOWN_GRACE_S) == 0, log.read_text()
    assert not uds.exists()
