"""The HTTP/1.1 server: one asyncio Protocol per connection, one task per request.

Owns: connections — feeding bytes to the RequestAssembler, the deadlines
(headers, body, keep-alive idle), flow control both ways, disconnect
detection, running the handler and answering for it when it fails, and
stopping (close, wait_idle).
Must not know: routes, JSON payloads, the engine; nor HTTP syntax (the
assembler and the Responder own that).
How: requests on a connection are answered one at a time, in order; requests
that arrive meanwhile (pipelining) queue up, and past MAX_PIPELINED the
connection stops reading. Reading otherwise goes on while a handler runs, so
a client that leaves is noticed at once (connection_lost sets
`disconnected`). At most one deadline is armed per connection, chosen by
what the connection is waiting for. Runs on any asyncio loop; the app runs
it on uvloop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from server.errors import ApiError
from server.http_parser import Event, ExpectContinue, HttpRequest, Phase, RequestAssembler, RequestError, new_request_id
from server.http_responder import ClientDisconnected, Responder, ResponseState

__all__ = ["ClientDisconnected", "Handler", "HttpLimits", "HttpRequest", "HttpServer", "Responder", "serve"]

log = logging.getLogger(__name__)

Handler = Callable[[HttpRequest, Responder], Awaitable[None]]
MAX_PIPELINED = 4  # requests queued behind the one being answered before the connection stops reading
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


@dataclass(slots=True)
class HttpLimits:
    max_header_bytes: int = 16 * 1024  # request line + header fields
    max_header_count: int = 100
    max_body_bytes: int = 8 * 1024 * 1024
    header_timeout: float = 10.0  # absolute: from a request's first byte to the end of its headers
    body_timeout: float = 30.0  # from the end of the headers to the end of the body
    idle_timeout: float = 5.0  # keep-alive: a connection with no request in progress is closed after this
    write_timeout: float = 30.0  # a client that reads nothing for this long while our buffer is full is dropped

    def __post_init__(self) -> None:
        for name in self.__slots__:
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"HttpLimits.{name} must be > 0, got {value!r}")


class HttpConnection(asyncio.Protocol):
    def __init__(self, server: HttpServer):
        limits = server.limits
        self._server = server
        self._limits = limits
        self._assembler = RequestAssembler(max_header_bytes=limits.max_header_bytes,
                                           max_header_count=limits.max_header_count,
                                           max_body_bytes=limits.max_body_bytes)
        self._pending: deque[Event] = deque()
        self._task: asyncio.Task | None = None  # the handler of the request being answered
        self._num_answered = 0
        self._deadline: asyncio.TimerHandle | None = None
        self._deadline_key: tuple | None = None
        self._is_reading_paused = False
        self._transport: asyncio.Transport | None = None
        self.disconnected = asyncio.Event()
        self._writable = asyncio.Event()
        self._writable.set()

    @property
    def is_draining(self) -> bool:
        return self._server.is_draining

    @property
    def is_idle(self) -> bool:
        return self._task is None and not self._pending and self._assembler.phase is Phase.IDLE

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        with contextlib.suppress(AttributeError, OSError):  # notice peers that vanish without a FIN
            transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        self._server.connections.add(self)
        self._arm_deadline()

    def data_received(self, data: bytes) -> None:
        for event in self._assembler.feed(data):
            if isinstance(event, ExpectContinue):
                if self._task is None and not self._pending:  # else the client sends the body after its own wait
                    self._transport.write(CONTINUE)
            else:
                self._pending.append(event)
        self._update_reading()
        self._arm_deadline()
        self._next()

    def eof_received(self) -> None:
        return None  # a half-close counts as leaving: close, which calls connection_lost

    def connection_lost(self, exc: Exception | None) -> None:
        self.disconnected.set()
        self._writable.set()  # wake a drain() so it sees the disconnect
        self._pending.clear()
        self._cancel_deadline()
        self._server.forget(self)

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    # What a Responder uses

    def write(self, *parts: bytes) -> None:
        if self.disconnected.is_set() or self._transport.is_closing():
            raise ClientDisconnected("the client closed the connection")
        self._transport.writelines(parts)

    async def drain(self) -> None:
        if not self._writable.is_set():
            try:
                await asyncio.wait_for(self._writable.wait(), self._limits.write_timeout)
            except TimeoutError:
                self._transport.abort()
                raise ClientDisconnected(f"the client read nothing for {self._limits.write_timeout:g} s") from None
        if self.disconnected.is_set():
            raise ClientDisconnected("the client closed the connection")

    # Answering requests, one at a time

    def _next(self) -> None:
        if self._task is not None or not self._pending or self.disconnected.is_set():
            return
        event = self._pending.popleft()
        self._update_reading()
        if isinstance(event, RequestError):
            self._answer_error(event)
        else:
            self._task = asyncio.get_running_loop().create_task(self._run(event))
        self._arm_deadline()

    def _answer_error(self, event: RequestError) -> None:
        error = ApiError(event.status, event.message)
        with contextlib.suppress(ClientDisconnected):
            Responder(self, new_request_id(), keep_alive=False).send_now(error.status, error.body())
        self._transport.close()

    async def _run(self, request: HttpRequest) -> None:
        responder = Responder(self, request.request_id, keep_alive=request.keep_alive,
                              http_version=request.http_version, is_head=request.method == "HEAD")
        try:
            await self._settle(responder, await self._call_handler(request, responder))
        except ClientDisconnected:
            pass
        except asyncio.CancelledError:
            self._transport.close()
            raise
        finally:
            self._task = None
            self._num_answered += 1
        if not responder.keep_alive or self.is_draining:
            self._transport.close()
        elif not self.disconnected.is_set():
            self._arm_deadline()
            self._next()

    async def _call_handler(self, request: HttpRequest, responder: Responder) -> ApiError | None:
        """Run the handler; the error to answer with if it failed."""
        try:
            await self._server.handler(request, responder)
        except ClientDisconnected:
            pass
        except ApiError as exc:
            return exc
        except Exception:
            log.exception("handler failed on %s %s (request %s)", request.method, request.path, request.request_id)
            return ApiError(500, "the server failed while answering the request")
        return None

    async def _settle(self, responder: Responder, error: ApiError | None) -> None:
        """Finish what the handler left: an error response, the end of its stream, or a 500."""
        if responder.state is ResponseState.NOT_STARTED:
            if error is None:
                log.error("handler returned without a response (request %s)", responder.request_id)
            await responder.send_error(error or ApiError(500, "the server sent no response"))
        elif responder.state is ResponseState.STREAMING:
            if error is not None:  # too late for a status: close without the last chunk, so the client sees a cut
                responder.keep_alive = False
            else:
                await responder.end_stream()

    # Flow control and deadlines

    def _update_reading(self) -> None:
        should_pause = len(self._pending) >= MAX_PIPELINED
        if should_pause != self._is_reading_paused and not self._transport.is_closing():
            self._is_reading_paused = should_pause
            if should_pause:
                self._transport.pause_reading()
            else:
                self._transport.resume_reading()

    def _arm_deadline(self) -> None:
        """Keep the one deadline that fits what the connection now waits for (none while a handler runs)."""
        phase, number, limits = self._assembler.phase, self._assembler.num_begun, self._limits
        if phase is Phase.HEAD:
            key, delay = ("headers", number), limits.header_timeout
        elif phase is Phase.BODY:
            key, delay = ("body", number), limits.body_timeout
        elif self.is_idle:
            key, delay = ("idle", self._num_answered), limits.idle_timeout
        else:
            key, delay = None, 0.0
        if key == self._deadline_key or self.disconnected.is_set():
            return
        self._cancel_deadline()
        self._deadline_key = key
        if key is not None:
            self._deadline = asyncio.get_running_loop().call_later(delay, self._on_deadline, key[0], delay)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self._deadline_key = None

    def _on_deadline(self, kind: str, delay: float) -> None:
        self._deadline = self._deadline_key = None
        if kind == "idle":
            self._transport.close()
            return
        self._assembler.close()
        self._pending.append(RequestError(408, f"expected the request {kind} within {delay:g} s, got them "
                                               "incomplete"))
        self._next()

    def close_if_idle(self) -> None:
        if self.is_idle:
            self._transport.close()

    def abort(self) -> None:
        self._transport.abort()


class HttpServer:
    """Listens and serves `handler`; `close()` stops listening, `wait_idle()` waits for open connections."""

    def __init__(self, handler: Handler, limits: HttpLimits | None = None):
        self.handler = handler
        self.limits = limits or HttpLimits()
        self.connections: set[HttpConnection] = set()
        self.is_draining = False
        self.port: int | None = None
        self._server: asyncio.Server | None = None
        self._all_closed = asyncio.Event()

    async def start(self, host: str | None = "127.0.0.1", port: int | None = 0, *,
                    sock: socket.socket | None = None) -> None:
        loop = asyncio.get_running_loop()
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
