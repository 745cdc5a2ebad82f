"""The HTTP server's tests' own app and raw-socket client, over real sockets on 127.0.0.1 on uvloop.

    @on_uvloop
    async def test_x():
        async with running(App(), max_header_bytes=1024) as server:  # HttpLimits fields
            responses, is_closed = await exchange(server.port, GET_ECHO)
            assert_error(responses[0], 404, "no route")

App is a small echo/stream app; running serves it on a free port and aborts
what is left at the end; exchange sends raw bytes and reads whole responses
by their framing, so a test sees exactly what went over the wire.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time

import orjson
import uvloop

from server.http.errors import ApiError
from server.http.server import ClientDisconnected, HttpLimits, HttpRequest, Responder, serve
from server.http.sse import DONE, encode_event

TEST_TIMEOUT = 10.0


def on_uvloop(test):
    @functools.wraps(test)
    def run(*args, **kwargs):
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(asyncio.wait_for(test(*args, **kwargs), TEST_TIMEOUT))
    return run


class App:
    """Routes: /echo, /stream (waits for `release` between its events), /hang, /boom, /api-error, /silent."""

    def __init__(self):
        self.release = asyncio.Event()
        self.disconnect_seen_at: float | None = None
        self.write_error: Exception | None = None
        self.chunks_written = 0

    async def __call__(self, request: HttpRequest, responder: Responder) -> None:
        route = getattr(self, "route_" + request.path.strip("/").replace("-", "_"), None)
        if route is None:
            raise ApiError(404, f"no route {request.path}")
        await route(request, responder)

    async def route_echo(self, request, responder):
        await responder.send(200, orjson.dumps({
            "method": request.method, "path": request.path, "query": request.query, "body": request.body.decode(),
            "request_id": request.request_id, "header_id": request.headers.get("x-request-id")}))

    async def route_stream(self, request, responder):
        await responder.start_stream()
        await responder.write(encode_event({"n": 1}))
        await self.release.wait()
        await responder.write(encode_event({"n": 2}))
        await responder.write(DONE)
        await responder.end_stream()

    async def route_hang(self, request, responder):
        await responder.start_stream()
        await responder.write(encode_event({"n": 1}))
        await responder.disconnected.wait()
        self.disconnect_seen_at = time.monotonic()
        try:
            await responder.write(encode_event({"n": 2}))
        except ClientDisconnected as exc:
            self.write_error = exc

    async def route_flood(self, request, responder):  # 16 MiB to a client that may not read
        await responder.start_stream(content_type="application/octet-stream")
        try:
            for _ in range(16):
                await responder.write(b"x" * (1 << 20))
                self.chunks_written += 1
        except ClientDisconnected as exc:
            self.write_error = exc
            raise
        await responder.end_stream()

    async def route_boom(self, request, responder):
        raise RuntimeError("the handler broke")

    async def route_api_error(self, request, responder):
        raise ApiError(429, "the waiting queue is full", headers={"Retry-After": "1"})

    async def route_silent(self, request, responder):
        return


@contextlib.asynccontextmanager
async def running(app, check_head=None, **limits):
    server = await serve(app, "127.0.0.1", 0, HttpLimits(**limits), check_head=check_head)
    try:
        yield server
    finally:
        server.close()
        server.abort()
        await server.wait_idle(1.0)


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict, bytes]:
    """One response: (status, headers with lower-case names, body), the body by its framing."""
    status = int((await reader.readline()).split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.lower()] = value.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = bytearray()
        while size := int((await reader.readline()).split(b";")[0], 16):
            body += await reader.readexactly(size)
            assert await reader.readexactly(2) == b"\r\n"
        assert await reader.readline() == b"\r\n"
        body = bytes(body)
    else:
        body = await reader.readexactly(int(headers.get("content-length", "0")))
    return status, headers, body


async def exchange(port: int, data: bytes, num_responses: int = 1) -> tuple[list, bool]:
    """Send raw bytes, read responses; also whether the server then closed the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    responses = [await read_response(reader) for _ in range(num_responses)]
    try:
        is_closed = await asyncio.wait_for(reader.read(1), 0.2) == b""
    except TimeoutError:
        is_closed = False
    except ConnectionResetError:  # closed while our request was still unread
        is_closed = True
    writer.close()
    return responses, is_closed


def assert_error(response, status: int, says: str = "") -> None:
    got_status, headers, body = response
    assert got_status == status, body
    assert headers["content-type"] == "application/json" and len(headers["x-request-id"]) == 32
    error = orjson.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and says in error["message"]


GET_ECHO = b"GET /echo?a=1 HTTP/1.1\r\nHost: t\r\n\r\n"
