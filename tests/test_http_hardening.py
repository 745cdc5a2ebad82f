"""The HTTP server against hostile or careless clients, over real sockets on 127.0.0.1 on uvloop:
Upgrade, which is served as plain HTTP/1.1."""

import orjson
from test_http_server import GET_ECHO, App, exchange, on_uvloop, running


@on_uvloop
async def test_upgrade_is_ignored_and_the_connection_serves_on():
    async with running(App()) as server:
        upgrade = (b"POST /echo HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABk"
                   b"\r\nContent-Length: 5\r\n\r\nhello")
        (first, second), is_closed = await exchange(server.port, upgrade + GET_ECHO, 2)
        assert first[0] == 200 and orjson.loads(first[2])["body"] == "hello" and "connection" not in first[1]
        assert second[0] == 200 and not is_closed
