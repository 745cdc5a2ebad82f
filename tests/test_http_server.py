"""The HTTP server over real sockets on 127.0.0.1, on uvloop: raw sockets for the edge cases, curl
as a real client. The handler is the small echo/stream app of tests/helpers/http_echo_server.py."""

import asyncio
import contextlib
import time

import orjson
import pytest

from server.http.server import ClientDisconnected

from helpers.http_echo_server import GET_ECHO, App, assert_error, exchange, on_uvloop, read_response, running
from helpers.waiting import wait_until_async


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
        await wait_until_async(lambda: app.write_error is not None, timeout=1.0, interval=0.01,
                               message="the write to the closed connection to fail")
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
        # what the kernel has not taken of the last 1 MiB chunk (and its chunked framing), under the low-water mark
        assert 0 < server.held_bytes()["write_buffers"] < (1 << 20) + (64 << 10)
        status, _, body = await read_response(reader)
        assert status == 200 and len(body) == 16 << 20 and app.chunks_written == 16
        assert server.held_bytes()["write_buffers"] == 0
        writer.close()


@on_uvloop
async def test_a_body_arriving_is_held_as_it_arrives_and_given_back_when_answered():
    async with running(App()) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 600\r\n\r\n" + b"a" * 250)
        await wait_until_async(lambda: server.held_bytes()["request_bodies"] == 250)
        writer.write(b"b" * 350)
        status, _, body = await read_response(reader)
        assert status == 200 and len(orjson.loads(body)["body"]) == 600
        await wait_until_async(lambda: server.held_bytes() == {"request_bodies": 0, "write_buffers": 0})
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
