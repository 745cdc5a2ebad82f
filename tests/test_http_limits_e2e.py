"""The HTTP limits of a real `python -m server` (the embedded default model, on the CPU): the
connection cap under a small RLIMIT_NOFILE, and new connections during a SIGTERM drain."""

import functools
import re
import resource
import signal
import socket
import subprocess

import orjson
import pytest

from server.http_sockets import FD_RESERVE

from running_server import WAIT_S, start_server, stop_server

NOFILE = 160  # the server's whole descriptor budget: its connection cap is this less the reserve
CAP = re.compile(rb"at most (\d+) HTTP connections")


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


def test_new_connections_during_the_sigterm_drain_get_503_and_the_stream_finishes(tmp_path):
    server = start_server(tmp_path, None, "--shutdown-timeout", "30")
    try:
        stream = socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S)
        body = orjson.dumps({"prompt": "To be", "max_tokens": 40, "ignore_eos": True, "stream": True})
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
