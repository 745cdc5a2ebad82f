"""The SSE encoder, checked by a line-by-line decoder fed the whole stream, byte by byte and with
a partial next event; the keep-alive pinger with a short interval; then both over a real socket."""

import asyncio
import time

import orjson
import pytest

from server.http.server import ClientDisconnected, HttpRequest, Responder
from server.http.sse import DONE, PING, encode_error, encode_event, stream_with_keepalive

from helpers.http_echo_server import on_uvloop, running


class SseDecoder:
    """What a client does (the openai SDK's rules): lines; `data:` lines joined by \\n; `:` lines ignored."""

    def __init__(self):
        self.buffer = b""
        self.data: list[bytes] = []
        self.events: list[bytes] = []
        self.num_comments = 0

    def feed(self, chunk: bytes) -> None:
        self.buffer += chunk
        while b"\n" in self.buffer:
            line, self.buffer = self.buffer.split(b"\n", 1)
            if line == b"":
                if self.data:
                    self.events.append(b"\n".join(self.data))
                self.data = []
            elif line.startswith(b":"):
                self.num_comments += 1
            else:
                field, _, value = line.partition(b":")
                assert field == b"data", line
                self.data.append(value[1:] if value.startswith(b" ") else value)


EVENTS = [{"id": "cmpl-1", "choices": [{"text": "a\nb \u00e9"}]}, b"plain", b"two\nlines", b"", {"x": [1, 2]}]
STREAM = b"".join(encode_event(e) for e in EVENTS) + PING + DONE
EXPECTED = [orjson.dumps(e) if isinstance(e, dict) else e for e in EVENTS] + [b"[DONE]"]


@pytest.mark.parametrize("mode", ["whole", "bytewise", "trailing"])
def test_events_decode_back(mode):
    decoder = SseDecoder()
    pieces = [STREAM[i:i + 1] for i in range(len(STREAM))] if mode == "bytewise" else [STREAM]
    if mode == "trailing":
        pieces.append(encode_event({"next": 1})[:-1])  # the next event, not yet finished
    for piece in pieces:
        decoder.feed(piece)
    assert decoder.events == EXPECTED and decoder.num_comments == 1


def test_encoded_bytes():
    assert encode_event({"a": 1}) == b'data: {"a":1}\n\n'
    assert encode_event(b"[DONE]") == DONE == b"data: [DONE]\n\n"
    assert encode_event(b"x\r\ny") == b"data: x\ndata: y\n\n"
    assert PING == b": ping\n\n"


def test_error_event_has_the_openai_schema():
    event = encode_error("the worker died", code="worker_failed")
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert orjson.loads(event[6:]) == {"error": {"message": "the worker died", "type": "server_error", "param": None,
                                                 "code": "worker_failed"}}


class FakeResponder:
    def __init__(self, disconnect_after: int | None = None):
        self.writes: list[tuple[float, bytes]] = []
        self.disconnect_after = disconnect_after

    def write_nowait(self, data: bytes) -> None:
        if self.disconnect_after is not None and len(self.writes) >= self.disconnect_after:
            raise ClientDisconnected("gone")
        self.writes.append((time.monotonic(), data))

    async def write(self, data: bytes) -> None:
        self.write_nowait(data)


async def paced(events: list[bytes], gaps: list[float]):
    for event, gap in zip(events, gaps):
        await asyncio.sleep(gap)
        yield event


@on_uvloop
async def test_pings_fill_the_silences_and_only_them():
    responder = FakeResponder()
    await stream_with_keepalive(responder, paced([b"e1", b"e2", b"e3"], [0.0, 0.35, 0.05]), ping_interval=0.1)
    sent = [data for _, data in responder.writes]
    assert sent[0] == b"e1" and sent[-2:] == [b"e2", b"e3"]
    assert sent[1:-2] == [PING] * len(sent[1:-2]) and 2 <= len(sent[1:-2]) <= 3
    times = [t for t, _ in responder.writes]
    assert all(b - a < 0.25 for a, b in zip(times, times[1:]))  # never quiet much past the interval
    await asyncio.sleep(0.25)
    assert len(responder.writes) == len(sent)  # no pings once the stream is done


@on_uvloop
async def test_no_pings_while_events_flow():
    responder = FakeResponder()
    await stream_with_keepalive(responder, paced([b"e"] * 15, [0.02] * 15), ping_interval=0.1)
    assert [data for _, data in responder.writes] == [b"e"] * 15


@on_uvloop
async def test_a_gone_client_ends_the_stream():
    responder = FakeResponder(disconnect_after=1)
    with pytest.raises(ClientDisconnected):
        await stream_with_keepalive(responder, paced([b"e1", b"e2"], [0.0, 0.05]), ping_interval=0.1)


@on_uvloop
async def test_stream_with_pings_over_a_real_socket():
    async def handler(request: HttpRequest, responder: Responder) -> None:
        await responder.start_stream()
        events = paced([encode_event(e) for e in EVENTS] + [DONE], [0.0, 0.25, 0.0, 0.0, 0.0, 0.0])
        await stream_with_keepalive(responder, events, ping_interval=0.1)
        await responder.end_stream()

    async with running(handler) as server:
        curl = await asyncio.create_subprocess_exec("curl", "-sS", "-N", f"http://127.0.0.1:{server.port}/",
                                                    stdout=asyncio.subprocess.PIPE)
        out, _ = await curl.communicate()
    decoder = SseDecoder()
    decoder.feed(out)
    assert decoder.events == EXPECTED and decoder.num_comments >= 2 and decoder.buffer == b""
