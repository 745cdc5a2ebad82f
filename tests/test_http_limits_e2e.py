"""The HTTP limits of a real `python -m server` (the embedded default model, on the CPU): the
connection cap under a small RLIMIT_NOFILE, uploads refused from their head before their body
with the frontend's memory measured, and new connections during a SIGTERM drain."""

import asyncio
import concurrent.futures
import functools
import os
import re
import resource
import signal
import socket
import subprocess
import time

import orjson
import pytest

from server.http.sockets import FD_RESERVE

from helpers.running_server import WAIT_S, start_server, stop_server

NOFILE = 160  # the server's whole descriptor budget: its connection cap is this less the reserve
CAP = re.compile(rb"at most (\d+) HTTP connections")
API_KEY = "sekrit"
UPLOAD_BYTES = 8 * 1024 * 1024  # the default --max-body-size: each would be read whole, were it read
NUM_UPLOADS = 40
MAX_RSS_GROWTH = 32 * 1024 * 1024  # buffering the uploads would take NUM_UPLOADS x 8 MiB = 320 MiB


def limit_open_files(limit: int) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))


def head_of(sock: socket.socket) -> bytes:
    """Read up to the end of a response head (a body, if any, may follow in what was read)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def rss_bytes(pid: int, field: str) -> int:
    """VmRSS (now) or VmHWM (the peak) of a process, in bytes."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


@pytest.fixture
def limited_server(tmp_path, monkeypatch):
    """A server started under RLIMIT_NOFILE = NOFILE (soft and hard, so start-up cannot raise it)."""
    monkeypatch.setattr(subprocess, "Popen", functools.partial(subprocess.Popen,
                                                               preexec_fn=lambda: limit_open_files(NOFILE)))
    server = start_server(tmp_path, None, "--timeout-keep-alive", "60")
    monkeypatch.undo()
    yield server
    stop_server(server)


def test_connections_past_the_descriptor_cap_get_503_and_the_server_recovers(limited_server):
    server = limited_server
    cap = int(CAP.search(server.log.read_bytes()).group(1))
    assert cap == NOFILE - FD_RESERVE
    held = [socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S) for _ in range(cap)]
    try:
        for _ in range(10):  # accepted in order, so these come past the cap
            with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S) as extra:
                extra.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
                head = head_of(extra)
            assert head.startswith(b"HTTP/1.1 503 ") and b"Retry-After: 1\r\n" in head, head
            assert b"Connection: close\r\n" in head and b"connections open, at most %d" % cap in head
        assert server.process.poll() is None
    finally:
        for sock in held:
            sock.close()
    server.wait_for(server.is_healthy, "/health 200 once the clients closed")
    assert b"new ones get 503 until some close" in server.log.read_bytes()


async def upload_without_the_key(port: int, waits_for_100: bool) -> tuple[bytes, float]:
    """A POST of UPLOAD_BYTES with Expect: 100-continue: (the first response head, seconds to it).

    A client that waits sends its body only after a 100; one that does not sends it at once.
    """
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    started = time.monotonic()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                 b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % UPLOAD_BYTES)
    body = b" " * UPLOAD_BYTES
    try:
        if not waits_for_100:
            writer.write(body)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
        elapsed = time.monotonic() - started
        if head.startswith(b"HTTP/1.1 100") and waits_for_100:  # the body the server asked for
            writer.write(body)
            await writer.drain()
            await reader.readuntil(b"\r\n\r\n")
        return head, elapsed
    finally:
        writer.close()


def test_uploads_without_the_key_get_401_before_their_body_and_memory_stays_flat(tmp_path):
    server = start_server(tmp_path, None, "--api-key", API_KEY)
    try:
        pid = server.process.pid
        rss_before = rss_bytes(pid, "VmRSS")
        with open(f"/proc/{pid}/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # VmHWM restarts from VmRSS: the peak measured is this test's

        async def uploads():
            return await asyncio.gather(*(upload_without_the_key(server.port, waits_for_100=i % 2 == 0)
                                          for i in range(NUM_UPLOADS)))

        results = asyncio.run(uploads())
        for head, elapsed in results:
            assert head.startswith(b"HTTP/1.1 401 "), head  # no 100 Continue before it
            assert b"WWW-Authenticate: Bearer\r\n" in head and b"Connection: close\r\n" in head
            assert elapsed < 2.0
        peak = rss_bytes(pid, "VmHWM")
        assert peak - rss_before < MAX_RSS_GROWTH, f"RSS grew {(peak - rss_before) >> 20} MiB"
        status, _, body = server.request("POST", "/v1/completions", {"prompt": "To be", "max_tokens": 2},
                                         headers={"Authorization": f"Bearer {API_KEY}"})
        assert status == 200, body
    finally:
        stop_server(server)


def test_new_connections_during_the_sigterm_drain_get_503_and_the_stream_finishes(tmp_path):
    # Steps held to 10 ms (PAGEDSERVE_FAULT=pace@0), so the stream outlasts the requests sent during the drain on
    # however fast a machine (unpaced, the default model's 40 tokens were once done before /health was asked).
    server = start_server(tmp_path, None, "--shutdown-timeout", "30", env={"PAGEDSERVE_FAULT": "pace@0"})
    try:
        stream = socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S)
        body = orjson.dumps({"prompt": "To be", "max_tokens": 200, "ignore_eos": True, "stream": True})
        stream.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        received = head_of(stream)
        assert received.startswith(b"HTTP/1.1 200 "), received
        server.process.send_signal(signal.SIGTERM)
        server.wait_for(lambda: b"SIGTERM: shutting down" in server.log.read_bytes(), "the drain")
        for path in ("/health", "/v1/models"):
            status, headers, error = server.get(path)
            assert status == 503 and headers["retry-after"] == "1" and headers["connection"] == "close", error
            assert orjson.loads(error)["error"]["type"] == "service_unavailable"
        while chunk := stream.recv(65536):
            received += chunk
        assert received.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")  # the stream in flight finished
        assert server.process.wait(WAIT_S) == 0
        with pytest.raises(ConnectionRefusedError):  # stopped listening at the end
            server.get("/health")
    finally:
        stop_server(server)


def test_a_worker_restart_with_every_connection_held_neither_aborts_nor_loses_the_stream(limited_server):
    """The frontend used to die of SIGABRT here: the restart's sockets ran into EMFILE and libzmq asserted. Now
    the connection cap keeps descriptors in reserve, a start that still finds too few waits without spending
    the restart budget, and the stream in flight is re-sent to the new worker and ends with all its tokens."""
    server = limited_server
    first_worker = server.worker_pid
    body = orjson.dumps({"prompt": "To be", "max_tokens": 64, "ignore_eos": True, "stream": True, "logprobs": 0})
    stream = socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S)
    stream.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    received = head_of(stream)
    assert received.startswith(b"HTTP/1.1 200 "), received
    # As many connections as the process may hold descriptors: those past the cap get a 503 and are closed.
    held = [socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S) for _ in range(NOFILE)]
    try:
        os.kill(first_worker, signal.SIGKILL)
        time.sleep(3.0)
        assert server.process.poll() is None, server.log.read_text()
    finally:
        for sock in held:
            sock.close()
    while not received.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):  # the last event, then the last chunk
        chunk = stream.recv(65536)
        assert chunk, f"the stream was cut: {received[-300:]!r}"
        received += chunk
    stream.close()
    choices = [orjson.loads(line[6:])["choices"][0] for line in received.split(b"\n") if line.startswith(b"data: {")]
    assert choices[-1]["finish_reason"] == "length"
    assert sum(len(choice["logprobs"]["tokens"]) for choice in choices if choice["logprobs"]) == 64
    server.wait_for(server.is_healthy, "/health 200 with a new worker")
    assert server.worker_pid != first_worker and server.process.poll() is None
    assert b"ipc_listener" not in server.log.read_bytes()  # libzmq's assertion, the abort it used to be


def refused_or_reset(port: int, request: bytes) -> bytes | str:
    """Connect, send the whole request at once, read to the end: the bytes the server answered, or how it failed."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
            sock.sendall(request)
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
            return answer
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"


def test_every_connection_past_the_cap_that_sends_a_request_gets_its_503(tmp_path):
    """Many at once, each request in the same write as its connect, and again while the worker restarts: none reset."""
    cap, burst = 8, 64
    server = start_server(tmp_path, None, "--max-connections", str(cap), "--standby-workers", "0",
                          "--timeout-keep-alive", "60")
    body = orjson.dumps({"model": "pagedserve-shakespeare", "prompt": "KING", "max_tokens": 64, "stream": True})
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n" % len(body)) + body
    held = []
    try:
        for _ in range(cap):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
            assert head_of(sock).startswith(b"HTTP/1.1 200 ")
            held.append(sock)
        for during_restart in (False, True):
            if during_restart:
                os.kill(server.worker_pid, signal.SIGKILL)
            with concurrent.futures.ThreadPoolExecutor(burst) as pool:
                answers = list(pool.map(lambda _: refused_or_reset(server.port, request), range(burst)))
            for answer in answers:
                assert isinstance(answer, bytes) and answer.startswith(b"HTTP/1.1 503 "), (during_restart, answer)
                assert b"Retry-After: 1\r\n" in answer and b"connections open, at most 8" in answer, answer
    finally:
        for sock in held:
            sock.close()
        stop_server(server)
