"""Responder: how a handler answers one request — a whole body, or a chunked stream.

Owns: the response head (status line, Content-Length or chunked framing,
Connection, X-Request-Id, Date), chunk framing, and the state of one response
(NOT_STARTED -> COMPLETE, or NOT_STARTED -> STREAMING -> COMPLETE).
Must not know: sockets or timers (the connection does), routes, JSON payloads.
How: writes go through the connection, which raises ClientDisconnected once
the client is gone and makes `drain()` wait while the transport's buffer is
above its high-water mark, so a slow reader slows the handler down instead of
growing the buffer.
"""

from __future__ import annotations

import asyncio
import enum
from email.utils import formatdate
from http import HTTPStatus
from typing import Protocol

from server.http.errors import ApiError

EVENT_STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
CHUNKED_END = b"0\r\n\r\n"
# Set by the Responder itself; a handler's value for these is dropped.
RESERVED_HEADERS = frozenset({"content-length", "transfer-encoding", "connection", "x-request-id", "date"})


class ClientDisconnected(ConnectionError):
    """The client closed the connection (or stopped reading) before the response was written."""


class Connection(Protocol):
    """What a Responder needs from its connection (server.http.connection.HttpConnection)."""

    disconnected: asyncio.Event

    @property
    def is_draining(self) -> bool: ...

    def write(self, *parts: bytes) -> None: ...

    async def drain(self) -> None: ...


class ResponseState(enum.Enum):
    NOT_STARTED = "not started"
    STREAMING = "streaming"
    COMPLETE = "complete"


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


def encode_head(status: int, fields: list[tuple[str, str]]) -> bytes:
    """The status line and header fields of a response, ending with the blank line."""
    lines = [f"HTTP/1.1 {status} {_reason(status)}\r\n"]
    for name, value in fields:
        if any(c in name or c in value for c in "\r\n\0"):  # no response splitting
            raise ValueError(f"response header must not contain CR, LF or NUL, got {name!r}: {value!r}")
        lines.append(f"{name}: {value}\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("latin-1")


def has_no_body(status: int) -> bool:
    return status < 200 or status in (204, 304)


class Responder:
    """Answers one request: either `send()` once, or `start_stream()`, `write()`..., `end_stream()`."""

    def __init__(self, conn: Connection, request_id: str, *, keep_alive: bool = True,
                 http_version: str = "1.1", is_head: bool = False):
        self.request_id = request_id
        self.state = ResponseState.NOT_STARTED
        self.keep_alive = keep_alive  # final once the head is written: the connection stays open after
        self._conn = conn
        self._is_http10 = http_version == "1.0"
        self._is_head = is_head  # a HEAD request gets the head only
        self._is_chunked = False
        # Fields every response from here carries, over the handler's own (the CORS headers of an allowed origin).
        self.common_headers: dict[str, str] = {}

    @property
    def disconnected(self) -> asyncio.Event:
        """Set when the client goes away; `await responder.disconnected.wait()` to abort work."""
        return self._conn.disconnected

    @property
    def is_disconnected(self) -> bool:
        return self._conn.disconnected.is_set()

    async def send(self, status: int, body: bytes, content_type: str | None = "application/json",
                   headers: dict[str, str] | None = None) -> None:
        """The whole response at once, with Content-Length. Raises ClientDisconnected if the client is gone.
        content_type None: no Content-Type field (an empty body is of no type)."""
        self.send_now(status, body, content_type, headers)
        await self._conn.drain()

    async def send_error(self, error: ApiError) -> None:
        """`error` as its status and the OpenAI error body."""
        await self.send(error.status, error.body(), headers=error.headers)

    def send_now(self, status: int, body: bytes, content_type: str | None = "application/json",
                 headers: dict[str, str] | None = None) -> None:
        """send() without waiting for the transport to drain."""
        self._move(ResponseState.NOT_STARTED, ResponseState.COMPLETE, "send()")
        if has_no_body(status):
            head = self._head(status, {}, headers, [])
            body = b""
        else:
            fields = {} if content_type is None else {"Content-Type": content_type}
            head = self._head(status, fields, headers, [("Content-Length", str(len(body)))])
        if self._is_head or not body:
            self._conn.write(head)
        else:
            self._conn.write(head, body)

    async def start_stream(self, status: int = 200, content_type: str = "text/event-stream",
                           headers: dict[str, str] | None = None) -> None:
        """Send the head of a streamed response; the body follows with write() and end_stream()."""
        self._move(ResponseState.NOT_STARTED, ResponseState.STREAMING, "start_stream()")
        fields = {"Content-Type": content_type}
        if content_type.startswith("text/event-stream"):
            fields |= EVENT_STREAM_HEADERS
        # HTTP/1.0 knows no chunked coding: its stream ends when the connection closes.
        self._is_chunked = not self._is_http10
        if not self._is_chunked:
            self.keep_alive = False
        framing = [("Transfer-Encoding", "chunked")] if self._is_chunked else []
        self._conn.write(self._head(status, fields, headers, framing))
        await self._conn.drain()

    async def write(self, data: bytes) -> None:
        """One chunk of the stream. Waits while the client reads slowly; raises ClientDisconnected if it left."""
        self.write_nowait(data)
        await self._conn.drain()

    def write_nowait(self, data: bytes) -> None:
        """write() without waiting for the buffer to drain: for small control chunks such as SSE pings."""
        if self.state is not ResponseState.STREAMING:
            raise RuntimeError(f"write() needs a response started with start_stream(), got one {self.state.value}")
        if self.is_disconnected:
            raise ClientDisconnected("the client closed the connection")
        if not data or self._is_head:
            return  # an empty chunk would end a chunked body
        if self._is_chunked:
            self._conn.write(b"%x\r\n" % len(data), data, b"\r\n")
        else:
            self._conn.write(data)

    async def end_stream(self) -> None:
        """Finish the stream (the connection stays open for the next request). A gone client is no error here."""
        self._move(ResponseState.STREAMING, ResponseState.COMPLETE, "end_stream()")
        if self._is_chunked and not self._is_head and not self.is_disconnected:
            self._conn.write(CHUNKED_END)

    def _move(self, expected: ResponseState, new: ResponseState, action: str) -> None:
        if self.state is not expected:
            raise RuntimeError(f"{action} needs a response {expected.value}, got one {self.state.value}")
        self.state = new

    def _head(self, status: int, fields: dict[str, str], extra: dict[str, str] | None,
              framing: list[tuple[str, str]]) -> bytes:
        self.keep_alive = self.keep_alive and not self._conn.is_draining
        if self.is_disconnected:
            raise ClientDisconnected("the client closed the connection")
        merged: dict[str, tuple[str, str]] = {}  # by lower-case name: a handler's field replaces ours
        for name, value in (*fields.items(), *(extra or {}).items(), *self.common_headers.items()):
            if name.lower() not in RESERVED_HEADERS:
                merged[name.lower()] = (name, value)
        lines = [*merged.values(), *framing, ("X-Request-Id", self.request_id), ("Date", formatdate(usegmt=True))]
        if not self.keep_alive:
            lines.append(("Connection", "close"))
        elif self._is_http10:
            lines.append(("Connection", "keep-alive"))
        return encode_head(status, lines)
