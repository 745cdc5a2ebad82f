"""`python -m server` as a subprocess for end-to-end tests: start it, speak to it, stop it.

    server = start_server(tmp_path, checkpoint, "--device", "cpu", "--max-num-seqs", "4")
    status, headers, body = server.request("POST", "/tokenize", {"prompt": "Hi"})
    server.scrape()['vllm:num_requests_running{engine="0",model_name="tiny"}']
    stop_server(server)

start_server picks a free port (--port 0, read back from the "listening on" log
line), keeps the worker's sockets in tmp/runtime and the log in tmp/server.log,
and returns once /health says 200. Every failure message carries the log.
A server started with --ssl-* flags is spoken to over HTTPS with the client
SSLContext given to start_server (its CA, and a client certificate if needed).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import ssl
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import openai

from helpers.metrics_scrape import parse_metrics
from helpers.processes import stop_process, wait_until_ready
from helpers.waiting import wait_until

START_TIMEOUT_S = 90.0  # a torch import and a model load in the worker
WAIT_S = 60.0  # for one HTTP exchange, or for a condition the server should reach
LISTENING = re.compile(rb"listening on https?://127\.0\.0\.1:(\d+)")
# The worker in service: one started as such, or the standby that took over.
WORKER_PID = re.compile(rb"(?:started|the standby) engine worker pid (\d+) \(epoch \d+\)(?:$| takes over)", re.MULTILINE)
JSON = {"Content-Type": "application/json"}


@dataclass
class RunningServer:
    process: subprocess.Popen
    port: int
    log: Path
    runtime_dir: Path
    ssl_context: ssl.SSLContext | None = None  # the client's, for a server on HTTPS

    @property
    def base_url(self) -> str:
        return f"{'http' if self.ssl_context is None else 'https'}://127.0.0.1:{self.port}"

    @property
    def worker_pid(self) -> int:
        """The current worker's pid: the last one the server logged."""
        return int(WORKER_PID.findall(self.log.read_bytes())[-1])

    def client(self, api_key: str = "unused", timeout: float = WAIT_S) -> openai.OpenAI:
        http_client = (None if self.ssl_context is None
                       else openai.DefaultHttpxClient(verify=self.ssl_context, timeout=timeout))
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0, timeout=timeout,
                             http_client=http_client)

    def request(self, method: str, path: str, body: bytes | dict | None = None,
                headers: dict | None = None) -> tuple[int, dict[str, str], bytes]:
        """One exchange on a fresh connection; a dict body is sent as JSON. (status, lower-cased headers, body)"""
        return http_exchange(self.port, method, path, body, headers, self.ssl_context)

    def get(self, path: str) -> tuple[int, dict[str, str], bytes]:
        return self.request("GET", path)

    def post_ok(self, path: str, body: dict) -> dict:
        """POST a JSON body that must succeed (200); the decoded JSON answer."""
        status, _, raw = self.request("POST", path, body)
        assert status == 200, raw
        return json.loads(raw)

    def scrape(self) -> dict[str, float]:
        """The /metrics samples, by name with labels, e.g. 'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"}'."""
        status, headers, body = self.get("/metrics")
        assert status == 200 and headers["content-type"].startswith("text/plain"), (status, body[:200])
        return parse_metrics(body.decode())

    def wait_for(self, predicate, what: str, timeout: float = WAIT_S) -> None:
        """wait_until(predicate), failing with `what` and the server's log."""
        wait_until(predicate, timeout, message=lambda: f"{what}; log:\n{self.log.read_text()}")

    def is_healthy(self) -> bool:
        try:
            return self.get("/health")[0] == 200
        except OSError:
            return False


def free_port() -> int:
    """A loopback port free at the moment of asking."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def http_exchange(port: int, method: str, path: str, body: bytes | dict | None = None,
                  headers: dict | None = None,
                  ssl_context: ssl.SSLContext | None = None) -> tuple[int, dict[str, str], bytes]:
    """One exchange with 127.0.0.1:port on a fresh connection (HTTPS with ssl_context); a dict body is sent as
    JSON. (status, lower-cased headers, body)"""
    if isinstance(body, dict):
        body, headers = json.dumps(body).encode(), {**JSON, **(headers or {})}
    conn = (http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S) if ssl_context is None
            else http.client.HTTPSConnection("127.0.0.1", port, timeout=WAIT_S, context=ssl_context))
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def start_server(tmp: Path, checkpoint: Path | None, *flags: str, env: dict | None = None,
                 timeout: float = START_TIMEOUT_S, port: int = 0, ssl_context: ssl.SSLContext | None = None,
                 launcher: tuple[str, ...] = (sys.executable, "-m", "server"), cwd: Path | None = None) -> RunningServer:
    """`python -m server --model checkpoint *flags` on a free port, once /health says 200.

    checkpoint None leaves --model out: the server takes its embedded default model. Without a
    --state-store flag the Responses API keeps its conversations in tmp/responses.db.
    port: a fixed port instead, e.g. to bring a replica back where a proxy expects it.
    ssl_context: the client's, for a server started with --ssl-certfile: HTTPS with it.
    launcher, cwd: another command that starts it (an installed `pagedserve`), from another directory.
    """
    runtime_dir, log = tmp / "runtime", tmp / "server.log"
    model = ["--model", str(checkpoint)] if checkpoint is not None else []
    if "--state-store" not in flags:  # never the user's own store under ~/.local/state
        flags = (*flags, "--state-store", f"sqlite://{(tmp / 'responses.db').resolve()}")
    command = [*launcher, *model, "--port", str(port), "--runtime-dir", str(runtime_dir), *flags]
    with open(log, "wb") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                   cwd=cwd)
    server = RunningServer(process, 0, log, runtime_dir, ssl_context)
    try:
        wait_until_ready(process, lambda: LISTENING.search(log.read_bytes()), "the server logged no port",
                         log.read_text, timeout, stop=lambda: stop_server(server))
        server.port = int(LISTENING.search(log.read_bytes()).group(1))
        wait_until_ready(process, server.is_healthy, "the server's /health never said 200", log.read_text, timeout,
                         stop=lambda: stop_server(server))
    except BaseException:
        stop_server(server)
        raise
    return server


def stop_server(server: RunningServer) -> None:
    """Kill the server if it still runs (its worker dies with it: PR_SET_PDEATHSIG)."""
    stop_process(server.process)


def watch_health(server: RunningServer, stop: threading.Event) -> list[int]:
    """Poll /health every 50 ms in a thread until `stop`; the statuses seen."""
    statuses: list[int] = []

    def poll() -> None:
        while not stop.is_set():
            statuses.append(server.get("/health")[0])
            stop.wait(0.05)

    threading.Thread(target=poll, daemon=True).start()
    return statuses
