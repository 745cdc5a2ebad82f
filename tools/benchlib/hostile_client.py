"""The hostile client of bench_recovery --hostile (tools/bench/serving/): a catalogue of bad requests, the attacker that
sends them, and a sampler of the server's /health latency and resident memory.

Each bad request is one a hostile or careless client sends to stop, stall or bloat a server: sampling values
that vanish in float32, integers past 64 bits, a blow-up of n x prompts, 8 MB prompts, an unauthenticated
8 MiB upload, a 100 KB model name, transfer codings and heads HTTP/1.1 forbids, a client that leaves
mid-stream, a chat role that does not exist. Only the standard library.
"""

from __future__ import annotations

import gzip
import http.client
import json
import socket
import threading
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from tools.benchlib.server_process import rss_mib
from tools.benchlib.stats import percentile
from tools.benchlib.target import Target, auth_header

HOSTILE_INTERVAL_S = 1.0  # one bad request per second
SAMPLE_INTERVAL_S = 0.1  # /health latency and the frontend's RSS
PROBE_TIMEOUT_S = 30.0
EXPECT_WAIT_S = 1.0  # how long the uploader waits for an answer to Expect: 100-continue before it sends anyway
BIG_PROMPT_CHARS = 8_000_000
UPLOAD_BYTES = 8 * 1024 * 1024
LONG_MODEL_NAME_CHARS = 100_000
STATUS_LINE = b"HTTP/1.1 "


def connect(target: Target) -> socket.socket:
    """A plain TCP connection for the probes that send raw bytes (Target.head)."""
    return socket.create_connection((target.host, target.port), timeout=PROBE_TIMEOUT_S)


def post_json(target: Target, path: str, body: dict) -> str:
    """One POST on a fresh connection; its status code."""
    conn = http.client.HTTPConnection(target.host, target.port, timeout=PROBE_TIMEOUT_S)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json", **auth_header(target.api_key)})
        response = conn.getresponse()
        response.read()
        return str(response.status)
    finally:
        conn.close()


def raw_exchange(target: Target, data: bytes) -> str:
    """Send raw bytes and read until the server closes; the final status code."""
    with connect(target) as sock:
        sock.sendall(data)
        return final_status(read_until_close(sock))


def read_until_close(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def final_status(answer: bytes) -> str:
    """The status code of the first response in `answer` that is not a 100 Continue."""
    for response in answer.split(STATUS_LINE)[1:]:
        if not response.startswith(b"100"):
            return response[:3].decode(errors="replace")
    return "closed without an answer" if not answer else f"no status line: {answer[:20]!r}"


def gzip_chunked(target: Target, body: dict) -> str:
    data = gzip.compress(json.dumps(body).encode())
    head = target.head("/v1/completions", ["Transfer-Encoding: gzip, chunked"])
    return raw_exchange(target, head + b"%x\r\n" % len(data) + data + b"\r\n0\r\n\r\n")


def without_host(target: Target, body: dict) -> str:
    data = json.dumps(body).encode()
    return raw_exchange(target, target.head("/v1/completions", [f"Content-Length: {len(data)}"], host=False) + data)


def unauthenticated_upload(target: Target) -> str:
    """8 MiB announced with Expect: 100-continue and no API key: a 401 should come before any of it is sent."""
    head = target.head("/v1/completions", [f"Content-Length: {UPLOAD_BYTES}", "Expect: 100-continue"], auth=False)
    with connect(target) as sock:
        sock.sendall(head)
        sock.settimeout(EXPECT_WAIT_S)
        try:
            early = sock.recv(65536)
        except TimeoutError:
            early = b""
        sock.settimeout(PROBE_TIMEOUT_S)
        if early and not early.startswith(STATUS_LINE + b"100"):
            return f"{final_status(early)} before the body"
        sock.sendall(b"0" * UPLOAD_BYTES)
        answer = final_status(early + read_until_close(sock))
    return f"{'100 Continue' if early else f'no answer in {EXPECT_WAIT_S:g} s'}, {answer} after the body"


def disconnect_mid_response(target: Target) -> str:
    """A long streamed completion, left after its first event."""
    body = json.dumps({"model": target.model, "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True,
                       "stream": True}).encode()
    with connect(target) as sock:
        sock.sendall(target.head("/v1/completions", [f"Content-Length: {len(body)}"]) + body)
        received = b""
        while b"data: " not in received:
            chunk = sock.recv(65536)
            if not chunk:
                return f"{final_status(received)}, closed before the first event"
            received += chunk
    return f"{final_status(received)}, left after the first event"


def hostile_requests(target: Target) -> list[tuple[str, Callable[[], str]]]:
    """(name, send it and return what came back), in the order the hostile client cycles through them."""
    completion = {"model": target.model, "prompt": "Hi", "max_tokens": 4}
    chat = {"model": target.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    response = {"model": target.model, "input": "Hi", "max_output_tokens": 4, "store": False}
    big_prompt = ("the quick brown fox jumps over the lazy dog " * (BIG_PROMPT_CHARS // 44 + 1))[:BIG_PROMPT_CHARS]
    upload = [("8 MiB upload without the API key, Expect: 100-continue", lambda: unauthenticated_upload(target))]
    return [
        ("top_p 1e-46, /v1/completions", lambda: post_json(target, "/v1/completions", {**completion, "top_p": 1e-46})),
        ("top_p 1e-46, /v1/chat/completions", lambda: post_json(target, "/v1/chat/completions", {**chat, "top_p": 1e-46})),
        ("top_p 1e-46, /v1/responses", lambda: post_json(target, "/v1/responses", {**response, "top_p": 1e-46})),
        ("temperature 1e-40", lambda: post_json(target, "/v1/completions", {**completion, "temperature": 1e-40})),
        ("logit_bias key 10**20", lambda: post_json(target, "/v1/completions",
                                                    {**completion, "logit_bias": {str(10**20): 1}})),
        ('prompt ["a"] * 1000, n 20', lambda: post_json(target, "/v1/completions",
                                                        {"model": target.model, "prompt": ["a"] * 1000, "n": 20})),
        ("8 MB prompt, /tokenize", lambda: post_json(target, "/tokenize", {"model": target.model, "prompt": big_prompt})),
        ("8 MB prompt, /v1/completions", lambda: post_json(target, "/v1/completions", {**completion, "prompt": big_prompt})),
        *(upload if target.api_key else []),
        ("100 KB model name", lambda: post_json(target, "/v1/completions",
                                                {**completion, "model": "m" * LONG_MODEL_NAME_CHARS})),
        ("Transfer-Encoding: gzip, chunked", lambda: gzip_chunked(target, completion)),
        ("HTTP/1.1 without Host", lambda: without_host(target, completion)),
        ("client leaves mid-stream", lambda: disconnect_mid_response(target)),
        ("chat role 'wizard'", lambda: post_json(target, "/v1/chat/completions",
                                                 {**chat, "messages": [{"role": "wizard", "content": "Hi"}]})),
        ("64 prompts x n 4 x prompt_logprobs 20 (a huge response)", lambda: post_json(target, "/v1/completions", {
            **completion, "prompt": [big_prompt[:2000]] * 64, "n": 4, "prompt_logprobs": 20, "logprobs": 20})),
        ("tool parameters of type string", lambda: post_json(target, "/v1/chat/completions", {
            **chat, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]})),
        ("a JSON schema that allows nothing", lambda: post_json(target, "/v1/chat/completions", {
            **chat, "response_format": {"type": "json_schema", "json_schema": {"name": "loop", "schema": {
                "$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}}}})),
    ]


def failure_name(exc: Exception) -> str:
    if isinstance(exc, TimeoutError):
        return f"no answer in {PROBE_TIMEOUT_S:g} s"
    if isinstance(exc, http.client.RemoteDisconnected):
        return "closed without an answer"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    return f"{type(exc).__name__}: {exc}"[:60]


def attack(requests: list[tuple[str, Callable[[], str]]], duration: float) -> list[tuple[str, str, float]]:
    """One request every HOSTILE_INTERVAL_S for `duration` s, each from its own thread so that a slow answer
    delays no other; (name, outcome, seconds) of each, once all are answered or have given up."""
    results: list[tuple[str, str, float]] = []

    def send(name: str, request: Callable[[], str]) -> None:
        start = time.monotonic()
        try:
            outcome = request()
        except Exception as exc:  # noqa: BLE001 - what the hostile request got, reported
            outcome = failure_name(exc)
        results.append((name, outcome, time.monotonic() - start))

    threads, start = [], time.monotonic()
    for i in range(int(duration / HOSTILE_INTERVAL_S)):
        time.sleep(max(0.0, start + i * HOSTILE_INTERVAL_S - time.monotonic()))
        threads.append(threading.Thread(target=send, args=requests[i % len(requests)], daemon=True))
        threads[-1].start()
    for thread in threads:
        thread.join(PROBE_TIMEOUT_S * 2)
    return results


class Sampler:
    """The server process's RSS and /health latency every SAMPLE_INTERVAL_S, from its own thread.

    Each /health probe is sent on schedule from a thread of its own, on a fresh connection (as a
    load balancer's probe): while the server's event loop is stuck, the probes due meanwhile all
    wait, and all count, rather than one slow sample standing for the whole stall.
    """

    def __init__(self, base_url: str, server_pid: int):
        self.url, self.server_pid = urlsplit(base_url), server_pid
        self.health: list[tuple[float, int]] = []  # (seconds, status; 0: no answer)
        self.rss_mib: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._probes: list[threading.Thread] = []

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join(PROBE_TIMEOUT_S)
        for probe in self._probes:
            probe.join(PROBE_TIMEOUT_S)

    def _run(self) -> None:
        while True:
            rss = rss_mib(self.server_pid)
            self.rss_mib += [rss] if rss is not None else []
            self._probes.append(threading.Thread(target=self._probe, daemon=True))
            self._probes[-1].start()
            if self._stop.wait(SAMPLE_INTERVAL_S):
                return

    def _probe(self) -> None:
        start = time.monotonic()
        conn = http.client.HTTPConnection(self.url.hostname, self.url.port, timeout=PROBE_TIMEOUT_S)
        try:
            conn.request("GET", "/health")
            response = conn.getresponse()
            response.read()
            status = response.status
        except (OSError, http.client.HTTPException):  # no answer, or no HTTP one: both count as not 200
            status = 0
        finally:
            conn.close()
        self.health.append((time.monotonic() - start, status))

    def latency_row(self, label: str) -> str:
        seconds = sorted(s for s, _ in self.health)
        if not seconds:
            return f"| {label} | 0 | - | - | - | - |"
        not_ok = sum(status != 200 for _, status in self.health)
        p50, p99 = (percentile(seconds, q) * 1000 for q in (50, 99))
        return f"| {label} | {len(seconds)} | {p50:.1f} ms | {p99:.1f} ms | {seconds[-1] * 1000:.1f} ms | {not_ok} |"

