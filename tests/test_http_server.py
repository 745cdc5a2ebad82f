"""The HTTP server over real sockets on 127.0.0.1, on uvloop: raw sockets for the edge cases, curl
as a real client. The handler is a small echo/stream app defined here."""

import asyncio
import contextlib
import functools
import time

import orjson
import pytest
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


@on_uvloop
async def test_keep_alive_serves_two_requests_on_one_connection():
    async with running(App()) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(GET_ECHO)
        status, headers, body = await read_response(reader)
        assert status == 200 and orjson.loads(body)["query"] == "a=1" and "connection" not in headers
        writer.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\nhello")
        status, _, body = await read_response(reader)
        assert status == 200 and orjson.loads(body)["body"] == "hello"
        assert len(server.connections) == 1
        writer.close()


@on_uvloop
async def test_pipelined_requests_are_answered_in_order():
    async with running(App()) as server:  # more than MAX_PIPELINED: reading pauses and resumes
        data = b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 1\r\n\r\n1" + GET_ECHO
        data += b"".join(b"GET /echo?%d HTTP/1.1\r\nHost: t\r\n\r\n" % i for i in range(10))
        responses, is_closed = await exchange(server.port, data, 12)
        assert [orjson.loads(body)["query"] for _, _, body in responses] == ["", "a=1"] + [str(i) for i in range(10)]
        assert not is_closed


@on_uvloop
async def test_chunked_request_body():
    async with running(App()) as server:
        data = b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
        [(status, _, body)], is_closed = await exchange(server.port, data)
        assert status == 200 and orjson.loads(body)["body"] == "abcde" and not is_closed


@pytest.mark.parametrize("data, status, says", [
    (b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 5000\r\n\r\n", 413, "at most 1000 bytes"),
    (b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n3e9\r\n" + b"x" * 1001 + b"\r\n0\r\n\r\n", 413,
     "1000"),
    (b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400,
     "Content-Length"),
    (b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n", 501, "chunked alone"),
    (b"GET /echo HTTP/1.1\r\n\r\n", 400, "Host"),
    (b"GET /echo HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400, "one Host"),
    (b"GARBAGE\r\n\r\n", 400, "parse error"),
    (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", 400, "parse error"),  # a TLS hello, say
    (b"GET /echo HTTP/1.1\r\nHost: t\r\nX-Bad: a\x00b\r\n\r\n", 400, "parse error"),
    (b"GET /echo HTTP/1.1\r\nHost: t\r\nX-Big: " + b"v" * 2000 + b"\r\n\r\n", 431, "at most 1024 bytes"),
])
@on_uvloop
async def test_bad_requests_get_an_error_and_close(data, status, says):
    async with running(App(), max_body_bytes=1000, max_header_bytes=1024) as server:
        [response], is_closed = await exchange(server.port, data + GET_ECHO)
        assert_error(response, status, says)
        assert response[1]["connection"] == "close" and is_closed


@on_uvloop
async def test_slow_headers_are_cut_with_408_at_the_deadline():
    async with running(App(), header_timeout=0.5) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        started = time.monotonic()

        async def trickle():
            with contextlib.suppress(ConnectionError):
                for byte in GET_ECHO:  # one byte every 50 ms: each byte in time, the whole head not
                    writer.write(bytes([byte]))
                    await asyncio.sleep(0.05)
        trickler = asyncio.create_task(trickle())
        response = await read_response(reader)
        elapsed = time.monotonic() - started
        assert_error(response, 408, "within 0.5 s")
        assert 0.45 < elapsed < 0.9 and await reader.read(1) == b""
        trickler.cancel()
        writer.close()


@on_uvloop
async def test_slow_body_is_cut_with_408():
    async with running(App(), body_timeout=0.3) as server:
        started = time.monotonic()
        [response], is_closed = await exchange(server.port, b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\nab")
        assert_error(response, 408, "request body within 0.3 s")
        assert is_closed and time.monotonic() - started < 0.6


@on_uvloop
async def test_idle_keep_alive_connection_is_closed():
    async with running(App(), idle_timeout=0.3) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(GET_ECHO)
        assert (await read_response(reader))[0] == 200
        started = time.monotonic()
        assert await reader.read(1) == b""
        assert 0.25 < time.monotonic() - started < 0.8
        writer.close()


@on_uvloop
async def test_curl_reads_a_stream_before_the_handler_ends():
    app = App()
    async with running(app) as server:
        curl = await asyncio.create_subprocess_exec("curl", "-sS", "-N", f"http://127.0.0.1:{server.port}/stream",
                                                    stdout=asyncio.subprocess.PIPE)
        first = await asyncio.wait_for(curl.stdout.readuntil(b"\n\n"), 5.0)
        assert first == b'data: {"n":1}\n\n' and not app.release.is_set()  # the handler is still waiting
        app.release.set()
        rest, _ = await curl.communicate()
        assert rest == b'data: {"n":2}\n\ndata: [DONE]\n\n' and curl.returncode == 0


@on_uvloop
async def test_curl_reuses_its_connection():
    async with running(App()) as server:
        url = f"http://127.0.0.1:{server.port}/echo"
        curl = await asyncio.create_subprocess_exec("curl", "-sS", "-v", url, url, "-d", "x",
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await curl.communicate()
        assert out.count(b'"method":"POST"') == 2 and b"Re-using existing connection" in err


@on_uvloop
async def test_curl_gets_100_continue_without_waiting():
    async with running(App()) as server:
        started = time.monotonic()
        curl = await asyncio.create_subprocess_exec(
            "curl", "-sS", "-H", "Expect: 100-continue", "--data-binary", "@-", f"http://127.0.0.1:{server.port}/echo",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        out, _ = await curl.communicate(b"z" * 5000)
        assert orjson.loads(out)["body"] == "z" * 5000 and time.monotonic() - started < 0.9  # curl waits 1 s otherwise


@on_uvloop
async def test_client_disconnect_mid_stream_is_seen_within_a_second():
    app = App()
    async with running(app) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /hang HTTP/1.1\r\nHost: t\r\n\r\n")
        await reader.readuntil(b'data: {"n":1}\n\n')
        writer.close()
        closed_at = time.monotonic()
        while app.write_error is None and time.monotonic() - closed_at < 1.0:
            await asyncio.sleep(0.01)
        assert app.disconnect_seen_at is not None and app.disconnect_seen_at - closed_at < 1.0
        assert isinstance(app.write_error, ClientDisconnected)
        assert await server.wait_idle(1.0)


@on_uvloop
async def test_a_slow_reader_holds_the_writer_back():
    app = App()
    async with running(app) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port, limit=1 << 16)
        writer.write(b"GET /flood HTTP/1.1\r\nHost: t\r\n\r\n")
        await asyncio.sleep(0.3)
        assert app.chunks_written < 8  # the kernel buffers a few MiB; then write() waits
        status, _, body = await read_response(reader)
        assert status == 200 and len(body) == 16 << 20 and app.chunks_written == 16
        writer.close()


@on_uvloop
async def test_a_reader_that_stalls_past_the_write_timeout_is_dropped():
    app = App()
    async with running(app, write_timeout=0.3) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /flood HTTP/1.1\r\nHost: t\r\n\r\n")
        await asyncio.sleep(0.8)
        assert isinstance(app.write_error, ClientDisconnected) and "0.3 s" in str(app.write_error)
        writer.close()


@pytest.mark.parametrize("sent, echoed", [("client-id.7", True), ("x" * 129, False), (None, False)])
@on_uvloop
async def test_request_id_is_echoed_capped_or_generated(sent, echoed):
    async with running(App()) as server:
        header = f"X-Request-Id: {sent}\r\n".encode() if sent else b""
        [(status, headers, body)], _ = await exchange(server.port, b"GET /echo HTTP/1.1\r\nHost: t\r\n" + header + b"\r\n")
        response_id = headers["x-request-id"]
        assert status == 200 and orjson.loads(body)["request_id"] == response_id
        assert response_id == sent if echoed else len(response_id) == 32


@on_uvloop
async def test_handler_failures_are_answered_and_the_connection_survives(caplog):
    async with running(App()) as server:
        data = b"".join(b"GET /%s HTTP/1.1\r\nHost: t\r\n\r\n" % path for path in (b"boom", b"api-error", b"silent"))
        data += b"GET /nowhere HTTP/1.1\r\nHost: t\r\nX-Request-Id: mine\r\n\r\n" + GET_ECHO
        (boom, busy, silent, missing, echo), is_closed = await exchange(server.port, data, 5)
        assert_error(boom, 500, "failed")
        assert orjson.loads(boom[2])["error"]["type"] == "server_error"
        assert_error(busy, 429, "queue is full")
        assert busy[1]["retry-after"] == "1" and orjson.loads(busy[2])["error"]["type"] == "rate_limit_error"
        assert_error(silent, 500, "no response")
        assert missing[0] == 404 and missing[1]["x-request-id"] == "mine"
        assert echo[0] == 200 and not is_closed
    errors = [record.getMessage() for record in caplog.records if record.levelname == "ERROR"]
    assert len(errors) == 2 and "handler failed on GET /boom" in errors[0] and "without a response" in errors[1]


@on_uvloop
async def test_connection_close_and_http10_close_after_the_response():
    async with running(App()) as server:
        for head in (b"GET /echo HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n", b"GET /echo HTTP/1.0\r\n\r\n"):
            [(status, headers, _)], is_closed = await exchange(server.port, head + GET_ECHO)
            assert status == 200 and headers["connection"] == "close" and is_closed


@on_uvloop
async def test_head_request_gets_no_body():
    async with running(App()) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"HEAD /echo HTTP/1.1\r\nHost: t\r\n\r\n" + GET_ECHO)
        status_line = await reader.readline()
        head = await reader.readuntil(b"\r\n\r\n")
        assert b"200" in status_line and b"Content-Length: " in head
        assert (await reader.readline()).startswith(b"HTTP/1.1 200")  # the next response, no body between
        writer.close()


@on_uvloop
async def test_close_stops_accepting_and_lets_a_stream_finish():
    app = App()
    async with running(app) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /stream HTTP/1.1\r\nHost: t\r\n\r\n")
        await reader.readuntil(b'data: {"n":1}\n\n')
        server.close()
        with pytest.raises(ConnectionError):
            await asyncio.open_connection("127.0.0.1", server.port)
        assert not await server.wait_idle(0.2)
        app.release.set()
        rest = await reader.read()  # the stream ends, then the connection closes
        assert rest.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
        assert await server.wait_idle(1.0)
        writer.close()
