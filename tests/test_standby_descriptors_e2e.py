"""A server under a low open-files limit that loses its standby while many connections hold its descriptors: it says
so (a warning, pagedserve:standby_worker_missing 1, /health still 200) and starts a standby again as soon as the
connections close, not after a back-off that has grown meanwhile.

The server runs under `prlimit --nofile=256:256` with --max-connections 230; 200 raw connections each stream a
long completion (sent in the same write as the connect); the active worker is SIGKILLed, the standby takes
over, and the next standby's start is refused for want of descriptors until the 200 close.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Iterator

import pytest

from shared.default_model import DEFAULT_MODEL_NAME

from helpers.metrics_scrape import total
from helpers.running_server import RunningServer, start_server, stop_server

LIMIT = 256
CONNECTIONS = 200
LAUNCHER = ("prlimit", f"--nofile={LIMIT}:{LIMIT}", sys.executable, "-m", "server")
# A cap above the connections (the default, the limit less a reserve of 64, is below them), so that they take
# the descriptors a worker start needs.
FLAGS = ("--device", "cpu", "--dtype", "float32", "--standby-workers", "1", "--max-connections", "230")
BACK_WITHIN_S = 3.0  # from the last connection's close to the next standby's start
STARTED = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),\d+ INFO pagedserve\.standby: started standby engine worker")


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[RunningServer]:
    running = start_server(tmp_path_factory.mktemp("low-nofile"), None, *FLAGS, launcher=LAUNCHER)
    try:
        yield running
    finally:
        stop_server(running)


def gauge(server: RunningServer, name: str) -> float:
    return total(server.scrape(), name, model_name=DEFAULT_MODEL_NAME)


def open_streams(server: RunningServer) -> list[socket.socket]:
    body = json.dumps({"model": DEFAULT_MODEL_NAME, "prompt": "KING HENRY:", "max_tokens": 400, "stream": True,
                       "ignore_eos": True}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n" % len(body)) + body
    connections = []
    for _ in range(CONNECTIONS):
        connection = socket.create_connection(("127.0.0.1", server.port))
        connection.sendall(request)
        connections.append(connection)
    return connections


def test_the_standby_is_started_again_as_soon_as_descriptors_free_up(server):
    server.wait_for(lambda: gauge(server, "pagedserve:standby_worker_ready") == 1, "the first standby's load")
    connections = open_streams(server)
    try:
        server.wait_for(lambda: gauge(server, "vllm:num_requests_running") > 0, "streams running")
        os.kill(server.worker_pid, signal.SIGKILL)
        server.wait_for(lambda: gauge(server, "pagedserve:standby_worker_missing") == 1, "the lost standby, told")
        assert server.is_healthy(), "serving goes on: /health stays 200"
    finally:
        for connection in connections:
            connection.close()
    closed_at = time.time()
    server.wait_for(lambda: gauge(server, "pagedserve:standby_worker_ready") == 1, "a standby again")
    assert gauge(server, "pagedserve:standby_worker_missing") == 0
    log = server.log.read_text()
    assert "no standby engine worker: a worker death now costs a full restart" in log, log
    assert "a standby engine worker is ready again" in log, log
    starts = [time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) for stamp in STARTED.findall(log)]
    assert starts and starts[-1] - closed_at <= BACK_WITHIN_S, (starts, closed_at, log[-3000:])
