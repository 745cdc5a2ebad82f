"""The HTTP/1.1 server: limits, listening, and stopping.

Owns: HttpLimits; the listening socket; the set of open connections; the
HangupWatcher they share; stopping (close, wait_idle, abort).
Must not know: routes, JSON payloads, the engine; HTTP syntax (the assembler
and the Responder); one connection's workings (HttpConnection).
How: the loop's create_server makes an HttpConnection per accepted socket.
close() stops listening, closes idle connections at once and busy ones after
their response; wait_idle() waits for them. Runs on any asyncio loop with
add_reader; the app runs it on uvloop.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from server.http_connection import HttpConnection
from server.http_parser import HttpRequest
from server.http_responder import ClientDisconnected, Responder
from server.http_sockets import HangupWatcher

__all__ = ["ClientDisconnected", "Handler", "HttpLimits", "HttpRequest", "HttpServer", "Responder", "serve"]

Handler = Callable[[HttpRequest, Responder], Awaitable[None]]


@dataclass(slots=True)
class HttpLimits:
    max_header_bytes: int = 16 * 1024  # request line + header fields
    max_header_count: int = 100
    max_body_bytes: int = 8 * 1024 * 1024
    header_timeout: float = 10.0  # absolute: from a request's first byte to the end of its headers
    body_timeout: float = 30.0  # from the end of the headers (or the 100 Continue) to the end of the body
    idle_timeout: float = 5.0  # keep-alive: a connection with no request in progress is closed after this
    write_timeout: float = 30.0  # a client that reads nothing for this long while our buffer is full is dropped

    def __post_init__(self) -> None:
        for name in self.__slots__:
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"HttpLimits.{name} must be > 0, got {value!r}")


class HttpServer:
    """Listens and serves `handler`; `close()` stops listening, `wait_idle()` waits for open connections."""

    def __init__(self, handler: Handler, limits: HttpLimits | None = None):
        self.handler = handler
        self.limits = limits or HttpLimits()
        self.connections: set[HttpConnection] = set()
        self.is_draining = False
        self.port: int | None = None
        self.hangups: HangupWatcher | None = None
        self._server: asyncio.Server | None = None
        self._all_closed = asyncio.Event()

    async def start(self, host: str | None = "127.0.0.1", port: int | None = 0, *,
                    sock: socket.socket | None = None) -> None:
        loop = asyncio.get_running_loop()
        self.hangups = HangupWatcher()
        if sock is not None:
            self._server = await loop.create_server(lambda: HttpConnection(self), sock=sock)
        else:
            self._server = await loop.create_server(lambda: HttpConnection(self), host, port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]  # the bound one when port 0 was asked for

    def close(self) -> None:
        """Stop accepting; close idle connections now and the others after their current response."""
        self.is_draining = True
        if self._server is not None:
            self._server.close()
            self._server = None
            self.hangups.close()
        for conn in list(self.connections):
            conn.close_if_idle()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until every connection has closed; False if some are still open after `timeout` s."""
        if not self.connections:
            return True
        self._all_closed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._all_closed.wait(), timeout)
        return not self.connections

    def abort(self) -> None:
        """Drop every connection now (after a drain timed out)."""
        for conn in list(self.connections):
            conn.abort()

    def forget(self, conn: HttpConnection) -> None:
        self.connections.discard(conn)
        if not self.connections:
            self._all_closed.set()


async def serve(handler: Handler, host: str | None = "127.0.0.1", port: int | None = 8000,
                limits: HttpLimits | None = None, *, sock: socket.socket | None = None) -> HttpServer:
    """Start serving `handler` on host:port (port 0: any free port; see `.port`) or on `sock`."""
    server = HttpServer(handler, limits)
    await server.start(host, port, sock=sock)
    return server
