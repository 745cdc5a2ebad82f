"""The HTTP server against hostile or careless clients, over real sockets on 127.0.0.1 on uvloop:
the connection cap, accept() out of descriptors, the shared body budget, refusals decided from
the head, 100 Continue in a pipeline, Upgrade, hang-ups while reading is paused, the drain, and
what gets logged."""

import asyncio
import contextlib
import gc
import logging
import os
import resource
import socket
import time

import orjson

from server.http.errors import ApiError
from server.http.server import REFUSAL_ALLOWANCE, HttpRequest, HttpServer, Responder
from server.http.sockets import ACCEPT_BACKOFF_MAX_S, ACCEPT_BATCH
from server.http.sse import encode_event

from helpers.http_echo_server import GET_ECHO, App, assert_error, exchange, on_uvloop, read_response, running
from helpers.waiting import wait_until_async


class WaitingApp(App):
    """Also /wait: answers nothing until the client leaves (or 5 s pass); and any /boom/... path fails."""

    async def __call__(self, request: HttpRequest, responder: Responder) -> None:
        if request.path.startswith("/boom/"):
            raise RuntimeError("the handler broke")
        await super().__call__(request, responder)

    async def route_wait(self, request, responder):
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(responder.disconnected.wait(), 5.0)
        self.disconnect_seen_at = time.monotonic()


POST_EXPECTING_100 = b"POST /echo HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\n"


async def connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def behind_a_stream(port: int, pipelined: bytes = b"") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection whose first request is a /stream with its first event read; `pipelined` was sent behind it."""
    reader, writer = await connect(port)
    writer.write(b"GET /stream HTTP/1.1\r\nHost: t\r\n\r\n" + pipelined)
    await reader.readuntil(b'data: {"n":1}\n\n')
    return reader, writer


def assert_refused_503(response, says: str) -> None:
    assert_error(response, 503, says)
    assert response[1]["retry-after"] == "1" and response[1]["connection"] == "close"


@on_uvloop
async def test_connections_past_the_cap_get_503_and_are_closed():
    async with running(App(), max_connections=2) as server:
        held = [await connect(server.port) for _ in range(2)]
        await wait_until_async(lambda: len(server.connections) == 2)
        [refused], is_closed = await exchange(server.port, GET_ECHO)
        assert_refused_503(refused, "2 connections open, at most 2")
        assert is_closed and len(server.connections) == 2
        held.pop()[1].close()
        await wait_until_async(lambda: len(server.connections) == 1)
        [(status, _, _)], _ = await exchange(server.port, GET_ECHO)
        assert status == 200


@on_uvloop
async def test_a_connect_flood_at_the_cap_holds_at_most_the_refusal_allowance_of_descriptors(monkeypatch):
    fds_after_accept = []
    on_accept = HttpServer._on_accept

    def counting_on_accept(server, sock):
        on_accept(server, sock)
        fds_after_accept.append(len(os.listdir("/proc/self/fd")))

    monkeypatch.setattr(HttpServer, "_on_accept", counting_on_accept)
    loop = asyncio.get_running_loop()
    async with running(App(), max_connections=4) as server:
        held = [await connect(server.port) for _ in range(4)]
        await wait_until_async(lambda: len(server.connections) == 4)
        flood = [socket.socket() for _ in range(ACCEPT_BATCH)]  # more than one accept() batch could take
        for client in flood:
            client.setblocking(False)
            client.connect_ex(("127.0.0.1", server.port))
        baseline = len(os.listdir("/proc/self/fd"))  # every client's descriptor, the server's 4 admitted ones
        fds_after_accept.clear()

        async def answer(client: socket.socket) -> bytes:
            reply = b""
            while chunk := await loop.sock_recv(client, 4096):
                reply += chunk
            client.close()
            return reply

        replies = await asyncio.gather(*(answer(client) for client in flood))
        assert all(reply.startswith(b"HTTP/1.1 503 ") and b"at most 4" in reply for reply in replies)
        assert len(fds_after_accept) == len(flood)
        assert max(fds_after_accept) - baseline <= REFUSAL_ALLOWANCE
        for _, writer in held:
            writer.close()
        await wait_until_async(lambda: not server.connections)
        [(status, _, _)], _ = await exchange(server.port, GET_ECHO)
        assert status == 200


@contextlib.contextmanager
def descriptors_exhausted():
    """Open files until open() fails (under a lowered soft limit), then give them all back."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 32, hard))
    held = []
    try:
        with contextlib.suppress(OSError):
            while True:
                held.append(os.open("/dev/null", os.O_RDONLY))
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@on_uvloop
async def test_accept_backs_off_while_descriptors_run_out_and_then_serves_the_backlog(caplog):
    loop = asyncio.get_running_loop()
    async with running(App()) as server:
        clients = [socket.socket() for _ in range(3)]  # their descriptors come first
        for client in clients:
            client.setblocking(False)
        with descriptors_exhausted():
            for client in clients:
                client.connect_ex(("127.0.0.1", server.port))  # the kernel completes the handshake
            cpu_before = time.process_time()
            await asyncio.sleep(0.5)
            assert time.process_time() - cpu_before < 0.2  # backing off, not spinning on accept()
            for client in clients:  # waiting in the backlog: neither answered nor reset
                try:
                    client.recv(1)
                except BlockingIOError:
                    continue
                raise AssertionError("a connection was closed while descriptors were short")
        started = time.monotonic()
        for client in clients:
            await loop.sock_sendall(client, GET_ECHO)
            reply = await asyncio.wait_for(loop.sock_recv(client, 4096), ACCEPT_BACKOFF_MAX_S + 1)
            assert reply.startswith(b"HTTP/1.1 200 OK"), reply
            client.close()
        assert time.monotonic() - started < ACCEPT_BACKOFF_MAX_S + 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "Too many open files" in warnings[0]


@on_uvloop
async def test_bodies_past_the_shared_budget_get_503_and_their_bytes_come_back():
    async with running(App(), max_body_bytes=1000, max_buffered_body_bytes=2000) as server:
        budget = server.body_budget
        uploads = []
        for _ in range(2):  # two bodies on their way hold all but 20 bytes of the budget
            reader, writer = await connect(server.port)
            writer.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n\r\n" + b"a" * 990)
            uploads.append((reader, writer))
        await wait_until_async(lambda: budget.num_bytes == 1980)
        [refused], is_closed = await exchange(server.port, b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 500"
                                                           b"\r\n\r\n" + b"b" * 500)
        assert_refused_503(refused, "more do not fit")
        assert is_closed
        uploads.pop(0)[1].close()  # a client that leaves mid-body gives its bytes back
        await wait_until_async(lambda: budget.num_bytes == 990)
        [(status, _, body)], _ = await exchange(server.port, b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 500"
                                                             b"\r\n\r\n" + b"b" * 500)
        assert status == 200 and orjson.loads(body)["body"] == "b" * 500
        reader, writer = uploads.pop()
        writer.write(b"a" * 10)
        status, _, body = await read_response(reader)
        assert status == 200 and len(orjson.loads(body)["body"]) == 1000
        await wait_until_async(lambda: budget.num_bytes == 0)  # answered requests give theirs back
        writer.close()


@on_uvloop
async def test_heads_that_announce_big_bodies_hold_no_budget_and_leave_uploads_served():
    async with running(App()) as server:  # the defaults: bodies up to 8 MiB, 32 of them held at once
        announcers = []
        for _ in range(40):  # a head costs ~60 bytes; were its announced body charged, 32 would fill the budget
            reader, writer = await connect(server.port)
            writer.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 8388608\r\n\r\n")
            announcers.append((reader, writer))
        await wait_until_async(lambda: len(server.connections) == 40)
        await asyncio.sleep(0.1)  # their heads read
        assert server.body_budget.num_bytes == 0
        [(status, _, body)], _ = await exchange(server.port, b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 2"
                                                             b"\r\n\r\nok")
        assert status == 200 and orjson.loads(body)["body"] == "ok"
        for _, writer in announcers:
            writer.close()
        await wait_until_async(lambda: len(server.connections) == 0)


def key_required(method: str, path: str, headers: dict[str, str]) -> ApiError | None:
    if "authorization" not in headers:
        return ApiError(401, f"no key for {method} {path}", headers={"WWW-Authenticate": "Bearer"})
    return None


@on_uvloop
async def test_a_head_refused_by_the_check_is_answered_without_100_continue_and_its_body_unread():
    async with running(App(), check_head=key_required) as server:
        reader, writer = await connect(server.port)
        writer.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 5000000\r\n\r\n")
        status, headers, body = await asyncio.wait_for(read_response(reader), 1.0)  # never a 100 first
        assert_error((status, headers, body), 401, "no key for POST /echo")
        assert headers["www-authenticate"] == "Bearer" and headers["connection"] == "close"
        assert await reader.read() == b"" and server.body_budget.num_bytes == 0
        writer.close()
        reader, writer = await connect(server.port)
        writer.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nAuthorization: k\r\nExpect: 100-continue\r\n"
                     b"Content-Length: 2\r\n\r\n")
        assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"ok")
        assert (await read_response(reader))[0] == 200
        writer.close()


@on_uvloop
async def test_100_continue_for_a_pipelined_request_comes_when_its_turn_does():
    app = App()
    async with running(app, body_timeout=0.3) as server:
        reader, writer = await behind_a_stream(server.port, POST_EXPECTING_100)
        await asyncio.sleep(0.5)  # longer than the body timeout: it must not run while the client waits for us
        assert server.body_budget.num_bytes == 0  # nor does the waiting body hold any of the budget
        app.release.set()
        stream_end = await reader.readuntil(b"0\r\n\r\n")  # no 100 inside the stream
        assert b"100 Continue" not in stream_end
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 1.0) == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"abc")
        status, _, body = await read_response(reader)
        assert status == 200 and orjson.loads(body)["body"] == "abc"
        writer.close()


@on_uvloop
async def test_the_body_timeout_of_a_pipelined_request_that_expects_100_counts_from_its_100():
    app = App()
    async with running(app, body_timeout=0.3) as server:
        reader, writer = await behind_a_stream(server.port, POST_EXPECTING_100)
        app.release.set()
        await reader.readuntil(b"0\r\n\r\n")
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 1.0) == b"HTTP/1.1 100 Continue\r\n\r\n"
        started = time.monotonic()
        status, headers, _ = await asyncio.wait_for(read_response(reader), 1.0)  # the body never comes
        assert status == 408 and headers["connection"] == "close" and 0.25 < time.monotonic() - started < 0.6
        writer.close()


@on_uvloop
async def test_the_header_timeout_of_a_pipelined_request_runs_while_the_one_before_it_is_answered():
    app = App()
    async with running(app, header_timeout=0.2) as server:
        reader, writer = await behind_a_stream(server.port, b"GET /echo HTTP/1.1\r\nHo")
        await asyncio.sleep(0.4)
        writer.write(b"st: t\r\n\r\n")  # too late: the head was due while the stream ran
        app.release.set()
        await reader.readuntil(b"0\r\n\r\n")
        status, headers, _ = await asyncio.wait_for(read_response(reader), 1.0)
        assert status == 408 and headers["connection"] == "close"
        writer.close()


@on_uvloop
async def test_upgrade_is_ignored_and_the_connection_serves_on():
    async with running(App()) as server:
        upgrade = (b"POST /echo HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABk"
                   b"\r\nContent-Length: 5\r\n\r\nhello")
        (first, second), is_closed = await exchange(server.port, upgrade + GET_ECHO, 2)
        assert first[0] == 200 and orjson.loads(first[2])["body"] == "hello" and "connection" not in first[1]
        assert second[0] == 200 and not is_closed


@on_uvloop
async def test_a_client_that_leaves_while_reading_is_paused_is_noticed():
    app = WaitingApp()
    async with running(app) as server:
        reader, writer = await connect(server.port)
        writer.write(b"GET /wait HTTP/1.1\r\nHost: t\r\n\r\n" + GET_ECHO * 6)  # enough queued to pause reading
        await asyncio.sleep(0.2)
        writer.close()
        closed_at = time.monotonic()
        await wait_until_async(lambda: app.disconnect_seen_at is not None, 5.0)
        assert app.disconnect_seen_at - closed_at < 1.0
        assert await server.wait_idle(1.0)


@on_uvloop
async def test_a_drain_answers_newcomers_503_until_close_stops_listening():
    app = App()
    async with running(app) as server:
        reader, writer = await behind_a_stream(server.port)
        server.drain()
        [refused], is_closed = await exchange(server.port, b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        assert_refused_503(refused, "shutting down")
        assert is_closed
        assert not await server.wait_idle(0.2)  # newcomers do not count: the stream does
        app.release.set()
        assert (await reader.read()).endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")  # then the connection closes
        assert await server.wait_idle(1.0)
        server.close()
        try:
            await connect(server.port)
        except ConnectionRefusedError:
            pass
        else:
            raise AssertionError("still listening after close()")
        writer.close()


@on_uvloop
async def test_a_client_that_leaves_before_its_response_logs_no_error(caplog):
    app = WaitingApp()
    caplog.set_level(logging.DEBUG)
    async with running(app) as server:
        reader, writer = await connect(server.port)
        writer.write(b"GET /wait HTTP/1.1\r\nHost: t\r\n\r\n")
        await asyncio.sleep(0.1)
        writer.close()
        await wait_until_async(lambda: app.disconnect_seen_at is not None)
        await server.wait_idle(1.0)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert "the client left before its response" in caplog.text


async def unended_stream(request: HttpRequest, responder: Responder) -> None:
    await responder.start_stream()
    await responder.write(encode_event({"n": 1}))  # and returns: the connection ends the stream


@on_uvloop
async def test_a_response_that_cannot_be_finished_closes_the_connection_and_is_logged_once(caplog, monkeypatch):
    async def failing_end_stream(responder):
        raise RuntimeError("the end of the stream could not be written")

    monkeypatch.setattr(Responder, "end_stream", failing_end_stream)
    async with running(unended_stream) as server:
        reader, writer = await connect(server.port)
        writer.write(b"GET /stream HTTP/1.1\r\nHost: t\r\nX-Request-Id: cut-1\r\n\r\n")
        reply = await asyncio.wait_for(reader.read(), 1.0)  # closed
        assert reply.startswith(b"HTTP/1.1 200 OK") and not reply.endswith(b"0\r\n\r\n")
        writer.close()
        await server.wait_idle(1.0)
        gc.collect()  # a task whose exception was never retrieved says so when it is collected
        await asyncio.sleep(0)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "request cut-1" in errors[0], errors


@on_uvloop
async def test_client_text_in_a_log_line_is_clipped(caplog):
    async with running(WaitingApp()) as server:
        [response], _ = await exchange(server.port, b"GET /boom/" + b"p" * 5000 + b" HTTP/1.1\r\nHost: t\r\n\r\n")
        assert response[0] == 500
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(record.getMessage()) < 300 and "/boom/" + "p" * 94 + "..." in record.getMessage()
