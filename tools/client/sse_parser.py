"""Server-sent events, sans I/O: the parser a client uses to read an SSE stream.

The server's side is server/http/sse.py (the encoder); this is the other end,
for clients such as the failover client (failover_stream.py). Bytes in, events out, no
sockets: feed it whatever the connection delivered.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SseEvent:
    data: str  # the event's data: lines, joined with "\n"
    type: str = "message"  # its event: line, if it had one


class SseParser:
    """Server-sent events, sans I/O: feed() bytes as they arrive, get back the events they complete.

    `data:` lines are joined with "\n", `event:` names the type, comment lines
    (`: ping`) and other fields are skipped, and a blank line ends an event.
    Lines end with "\n" or "\r\n".
    """

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []
        self._type: str | None = None

    def feed(self, chunk: bytes) -> list[SseEvent]:
        *lines, self._buffer = (self._buffer + chunk).split(b"\n")
        events = [self._line(line.removesuffix(b"\r").decode()) for line in lines]
        return [event for event in events if event is not None]

    def _line(self, line: str) -> SseEvent | None:
        if not line:
            event = SseEvent("\n".join(self._data), self._type or "message") if self._data else None
            self._data, self._type = [], None
            return event
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._type = value
        return None
