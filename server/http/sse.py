"""Server-sent events: the one encoder every streaming endpoint uses.

Owns: the bytes of an event (`data: ...\\n\\n`, after `event: <name>\\n` for a named
one, as the Responses API sends them), the end marker, the keep-alive
comment, the error event, and writing a stream of events with a ping
whenever it has been quiet for a while.
Must not know: sockets (it writes through a Responder), OpenAI payloads.
How: a stream's events are written as they come; a timer (not a task per
event) checks once per interval whether anything was written since, and
writes `: ping` if not. Clients (the openai SDK included) ignore comment
lines, and proxies such as nginx keep a stream open while bytes flow.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterable

import orjson

from server.http.errors import error_dict
from server.http.responder import ClientDisconnected, Responder

DONE = b"data: [DONE]\n\n"
PING = b": ping\n\n"
PING_INTERVAL = 15.0  # seconds of silence before a ping; well under nginx's 60 s proxy_read_timeout


def encode_event(data: bytes | dict | list, event: str | None = None) -> bytes:
    """One `data:` event; a dict or list is encoded as JSON, bytes are sent as they are.

    JSON has no raw line breaks; bytes that do are sent as one `data:` line per
    line, which the client joins back with "\\n". `event` names the event
    (an `event:` line first); unnamed events are "message" events to a client.
    """
    payload = data if isinstance(data, bytes) else orjson.dumps(data)
    if b"\n" not in payload and b"\r" not in payload:
        lines = b"data: " + payload + b"\n\n"
    else:
        lines = b"".join(b"data: " + line + b"\n" for line in payload.splitlines()) + b"\n"
    return lines if event is None else _event_line(event) + lines


def _event_line(event: str) -> bytes:
    if not event or any(c in event for c in "\r\n"):
        raise ValueError(f"an SSE event name must be one non-empty line, got {event!r}")
    return b"event: " + event.encode() + b"\n"


def encode_error(message: str, type: str = "server_error", param: str | None = None,
                 code: str | int | None = None) -> bytes:
    """The event that reports a failure after a stream has started: `data: {"error": {...}}`."""
    return encode_event(error_dict(message, type, param, code))


class _Pinger:
    """Writes PING to `responder` whenever `interval` s pass with nothing else written."""

    def __init__(self, responder: Responder, interval: float):
        self._responder = responder
        self._interval = interval
        self._loop = asyncio.get_running_loop()
        self.last_write = self._loop.time()
        self._handle = self._loop.call_later(interval, self._tick)

    def _tick(self) -> None:
        now = self._loop.time()
        if now - self.last_write >= self._interval:
            try:
                self._responder.write_nowait(PING)
            except ClientDisconnected:
                return  # the stream's next write reports it
            self.last_write = now
        self._handle = self._loop.call_at(self.last_write + self._interval, self._tick)

    def cancel(self) -> None:
        self._handle.cancel()


async def stream_with_keepalive(responder: Responder, events: AsyncIterable[bytes],
                                ping_interval: float = PING_INTERVAL) -> None:
    """Write each encoded event from `events` to a started stream, with pings while `events` is quiet.

    Returns when `events` is exhausted (the caller ends the stream). Raises
    ClientDisconnected on the first write after the client left; a producer
    that may wait long should also watch `responder.disconnected`.
    """
    pinger = _Pinger(responder, ping_interval)
    try:
        async for event in events:
            await responder.write(event)
            pinger.last_write = asyncio.get_running_loop().time()
    finally:
        pinger.cancel()


async def stream_events(responder: Responder, events: AsyncGenerator[bytes, None]) -> None:
    """The whole of an SSE response: start the stream, write `events` with keep-alive pings, end it.

    `events` is closed on the way out, whether it ran to its end or the client left.
    """
    await responder.start_stream()
    async with contextlib.aclosing(events):
        await stream_with_keepalive(responder, events)
    await responder.end_stream()
