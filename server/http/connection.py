"""One HTTP/1.1 connection: an asyncio Protocol that answers its requests in order, one task each.

Owns: feeding bytes to the RequestAssembler, the deadlines (headers, body,
keep-alive idle), flow control both ways, 100 Continue when its request's
turn comes, disconnect detection (while reading is paused too), releasing
the body budget its requests hold, running the handler and answering for it
when it fails.
Must not know: routes, JSON payloads, the engine; HTTP syntax (the assembler
and the Responder own that); listening and admission (HttpServer).
How: requests on a connection are answered one at a time, in order; requests
that arrive meanwhile (pipelining) queue up, and past MAX_PIPELINED the
connection stops reading and has the server's HangupWatcher watch its socket
instead. So a client that leaves is noticed at once either way
(connection_lost sets `disconnected`). A request that expects 100 Continue
gets it when it is next to be answered, and its body timeout counts from
that 100. While it waits for its turn no timer of its own runs: a pipelining
client legitimately waits as long as the responses ahead of it take (a
stream may run for minutes), and those bound the wait (each ends with its
handler, or with the write timeout for a client that reads nothing); the
waiting request holds none of the body budget, which is charged only for
body bytes that have arrived. At most one deadline is armed per connection,
chosen by what the connection is waiting for. A request's body
stays charged to the BodyBudget until its handler is done or the request is
dropped; one still arriving is released by the assembler.
A connection refused at accept (past the cap, or draining) is answered its
503 and then closed lingering: its write side shut after the answer, and
whatever the client sends meanwhile read and dropped, until the client
closes, LINGER_S pass or LINGER_MAX_BYTES arrive. Closing a socket with
unread bytes sends a reset, which can reach the client before the 503 does
and destroy it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections import deque
from typing import TYPE_CHECKING

from server.http.errors import ApiError, clip
from server.http.parser import ExpectContinue, HttpRequest, Phase, RequestAssembler, RequestError, new_request_id
from server.http.responder import ClientDisconnected, Responder, ResponseState

if TYPE_CHECKING:
    from server.http.server import HttpServer

log = logging.getLogger(__name__)

MAX_PIPELINED = 4  # requests queued behind the one being answered before the connection stops reading
LINGER_S = 2.0  # how long a refused connection reads (and drops) what its client still sends before it closes
LINGER_MAX_BYTES = 256 * 1024  # ... and how much of it
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class HttpConnection(asyncio.Protocol):
    """`refusal`: the error to answer at once, closing, instead of reading anything (decided at accept)."""

    def __init__(self, server: HttpServer, refusal: ApiError | None = None):
        limits = server.limits
        self._server = server
        self._limits = limits
        self._refusal = refusal
        self._lingering_bytes: int | None = None  # refused and closing lingering: the bytes read and dropped so far
        self._assembler = RequestAssembler(max_header_bytes=limits.max_header_bytes,
                                           max_header_count=limits.max_header_count,
                                           max_body_bytes=limits.max_body_bytes,
                                           body_budget=server.body_budget, check_head=self._check_head)
        self._pending: deque[HttpRequest | RequestError] = deque()  # ExpectContinue is a flag, never queued
        self._task: asyncio.Task | None = None  # the handler of the request being answered
        self._num_answered = 0
        self._expects_continue = False  # the request arriving waits for a 100 Continue not sent yet
        self._deadline: asyncio.TimerHandle | None = None
        self._deadline_key: tuple | None = None
        self._is_reading_paused = False
        self._maybe_transport: asyncio.Transport | None = None  # set by connection_made, the first call asyncio makes
        self._maybe_fd: int | None = None  # the socket's, set by connection_made unless refused
        self.disconnected = asyncio.Event()
        self._writable = asyncio.Event()
        self._writable.set()

    @property
    def is_draining(self) -> bool:
        return self._server.is_draining

    @property
    def is_idle(self) -> bool:
        return self._task is None and not self._pending and self._assembler.phase is Phase.IDLE

    @property
    def _transport(self) -> asyncio.Transport:
        if self._maybe_transport is None:
            raise RuntimeError("HttpConnection: expected a transport (connection_made), got none yet")
        return self._maybe_transport

    @property
    def _fd(self) -> int:
        """The socket's file descriptor, which the server's HangupWatcher watches while reading is paused."""
        if self._maybe_fd is None:
            raise RuntimeError("HttpConnection: expected a socket (connection_made, not refused), got none")
        return self._maybe_fd

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.Transport) -> None:
        self._maybe_transport = transport
        if self._refusal is not None:
            self._refuse(self._refusal)
            return
        if self.is_draining:  # admitted, then the drain began before asyncio connected it: close_if_idle skipped it
            transport.close()
            return
        sock = transport.get_extra_info("socket")
        self._maybe_fd = sock.fileno()
        with contextlib.suppress(OSError):  # notice peers that vanish without a FIN
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        self._arm_deadline()

    def data_received(self, data: bytes) -> None:
        if self._lingering_bytes is not None:  # refused: read only to be dropped
            self._lingering_bytes += len(data)
            if self._lingering_bytes > LINGER_MAX_BYTES:
                self._transport.close()
            return
        for event in self._assembler.feed(data):
            if isinstance(event, ExpectContinue):
                self._expects_continue = True
            else:  # a request whose body came without waiting, or a terminal error: no 100 then
                self._expects_continue = False
                self._pending.append(event)
        self._update_reading()
        self._arm_deadline()
        self._next()

    def eof_received(self) -> None:
        return None  # a half-close counts as leaving: close, which calls connection_lost

    def connection_lost(self, exc: Exception | None) -> None:
        self.disconnected.set()
        self._writable.set()  # wake a drain() so it sees the disconnect
        if self._is_reading_paused:
            self._server.hangups.forget(self._fd, self._on_hangup)
        self._assembler.close()
        for event in self._pending:
            self._release(event)
        self._pending.clear()
        self._cancel_deadline()
        self._server.forget(self)

    @property
    def write_buffer_bytes(self) -> int:
        """Response bytes written and waiting in the transport for the kernel to take them (a closing transport's
        too: it still holds them until it has flushed them or is aborted)."""
        transport = self._maybe_transport
        return 0 if transport is None else transport.get_write_buffer_size()

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
        """Answer the next queued request; with none queued, let the one arriving send its body (100 Continue)."""
        if self._task is not None or self.disconnected.is_set() or self._transport.is_closing():
            return
        if self._pending:
            event = self._pending.popleft()
            self._update_reading()
            if isinstance(event, RequestError):
                self._refuse(ApiError(event.status, event.message, headers=event.headers))
            else:
                self._task = asyncio.get_running_loop().create_task(self._run(event))
        elif self._expects_continue:
            self._expects_continue = False
            self._transport.write(CONTINUE)
        self._arm_deadline()

    def _refuse(self, error: ApiError) -> None:
        """Answer `error` and close lingering (the module docstring says why): what the client sends is dropped."""
        with contextlib.suppress(ClientDisconnected):
            Responder(self, new_request_id(), keep_alive=False).send_now(error.status, error.body(),
                                                                        headers=error.headers)
        transport = self._transport
        if transport.is_closing() or not transport.can_write_eof():  # TLS cannot half-close: close as before
            transport.close()
            return
        transport.write_eof()
        self._lingering_bytes = 0
        asyncio.get_running_loop().call_later(LINGER_S, transport.close)

    def _check_head(self, method: str, path: str, headers: dict[str, str]) -> RequestError | None:
        """The server's head check, as the assembler takes it."""
        check = self._server.check_head
        if check is None:
            return None
        try:
            error = check(method, path, headers)
        except Exception:
            log.exception("the head check failed on %s %s", method, clip(path))
            error = ApiError(500, "the server failed while checking the request")
        return None if error is None else RequestError(error.status, error.message, error.headers)

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
        except Exception:  # the response cannot be finished: close, so the client sees it cut
            log.exception("failed to finish the response to %s %s (request %s)", request.method,
                          clip(request.path), request.request_id)
            responder.keep_alive = False
        finally:
            self._task = None
            self._num_answered += 1
            self._release(request)
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
            log.exception("handler failed on %s %s (request %s)", request.method, clip(request.path),
                          request.request_id)
            return ApiError(500, "the server failed while answering the request")
        return None

    async def _settle(self, responder: Responder, error: ApiError | None) -> None:
        """Finish what the handler left: an error response, the end of its stream, or a 500."""
        if responder.state is ResponseState.NOT_STARTED:
            if error is None and self.disconnected.is_set():
                log.debug("request %s: the client left before its response", responder.request_id)
                return
            if error is None:
                log.error("handler returned without a response (request %s)", responder.request_id)
            await responder.send_error(error or ApiError(500, "the server sent no response"))
        elif responder.state is ResponseState.STREAMING:
            if error is not None:  # too late for a status: close without the last chunk, so the client sees a cut
                responder.keep_alive = False
            else:
                await responder.end_stream()

    def _release(self, event: HttpRequest | RequestError) -> None:
        """Return a request's body to the budget (the assembler charged it)."""
        if isinstance(event, HttpRequest):
            self._server.body_budget.release(len(event.body))

    # Flow control and deadlines

    def _update_reading(self) -> None:
        should_pause = len(self._pending) >= MAX_PIPELINED
        if should_pause == self._is_reading_paused or self._transport.is_closing():
            return
        self._is_reading_paused = should_pause
        if should_pause:
            self._transport.pause_reading()
            self._server.hangups.watch(self._fd, self._on_hangup)
        else:
            self._server.hangups.forget(self._fd, self._on_hangup)
            self._transport.resume_reading()

    def _on_hangup(self) -> None:
        """The client hung up while reading was paused: as with a half-close (eof_received), it has left."""
        self._transport.close()

    def _arm_deadline(self) -> None:
        """Keep the one deadline that fits what the connection now waits for.

        A head arriving has the header timeout and a body arriving the body timeout, whether or not a
        handler runs meanwhile (pipelining); a body that waits for our 100 Continue has none until it is
        sent; a connection with nothing in progress has the idle timeout. None while a handler runs and
        nothing else arrives.
        """
        phase, number, limits = self._assembler.phase, self._assembler.num_begun, self._limits
        if phase is Phase.HEAD:
            key, delay = ("headers", number), limits.header_timeout
        elif phase is Phase.BODY and not self._expects_continue:
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
        """Close now if nothing is in progress; one not connected yet is closed by connection_made (draining)."""
        if self.is_idle and self._maybe_transport is not None:
            self._transport.close()

    def abort(self) -> None:
        """Drop the connection now; one not connected yet is closed by connection_made (draining)."""
        if self._maybe_transport is not None:
            self._transport.abort()
