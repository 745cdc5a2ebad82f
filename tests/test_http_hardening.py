"""The HTTP server against hostile or careless clients, over real sockets on 127.0.0.1 on uvloop:
100 Continue in a pipeline, Upgrade, hang-ups while reading is paused, and what gets logged."""

import asyncio
import contextlib
import logging
import time

import orjson
from test_http_server import GET_ECHO, App, exchange, on_uvloop, read_response, running

from server.http import HttpRequest, Responder


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


async def connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def wait_until(predicate, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


@on_uvloop
async def test_100_continue_for_a_pipelined_request_comes_when_its_turn_does():
    app = App()
    async with running(app, body_timeout=0.3) as server:
        reader, writer = await connect(server.port)
        writer.write(b"GET /stream HTTP/1.1\r\nHost: t\r\n\r\n"
                     b"POST /echo HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\n")
        await reader.readuntil(b'data: {"n":1}\n\n')
        await asyncio.sleep(0.5)  # longer than the body timeout: it must not run while the client waits for us
        app.release.set()
        stream_end = await reader.readuntil(b"0\r\n\r\n")  # no 100 inside the stream
        assert b"100 Continue" not in stream_end
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 1.0) == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"abc")
        status, _, body = await read_response(reader)
        assert status == 200 and orjson.loads(body)["body"] == "abc"
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
        await wait_until(lambda: app.disconnect_seen_at is not None, 5.0)
        assert app.disconnect_seen_at - closed_at < 1.0
        assert await server.wait_idle(1.0)


@on_uvloop
async def test_a_client_that_leaves_before_its_response_logs_no_error(caplog):
    app = WaitingApp()
    caplog.set_level(logging.DEBUG)
    async with running(app) as server:
        reader, writer = await connect(server.port)
        writer.write(b"GET /wait HTTP/1.1\r\nHost: t\r\n\r\n")
        await asyncio.sleep(0.1)
        writer.close()
        await wait_until(lambda: app.disconnect_seen_at is not None)
        await server.wait_idle(1.0)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert "the client left before its response" in caplog.text


@on_uvloop
async def test_client_text_in_a_log_line_is_clipped(caplog):
    async with running(WaitingApp()) as server:
        [response], _ = await exchange(server.port, b"GET /boom/" + b"p" * 5000 + b" HTTP/1.1\r\nHost: t\r\n\r\n")
        assert response[0] == 500
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(record.getMessage()) < 300 and "/boom/" + "p" * 94 + "..." in record.getMessage()
