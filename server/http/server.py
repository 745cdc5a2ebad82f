"""The HTTP/1.1 server: limits, listening, admission of connections, and stopping.

Owns: HttpLimits; the listening socket (an Acceptor, which backs off while
accept() fails); admission: at most max_connections open at once, and past
that, or during a drain, a new connection is answered at once with 503,
Retry-After and Connection: close, and closed before a byte of it is read,
so a refused connection holds its descriptor no longer than that. Refusals
in flight (accepted, not yet closed) are bounded too: while open connections
and refusals in flight reach max_connections + REFUSAL_ALLOWANCE, nothing is
accepted and newcomers wait in the kernel's backlog, so a connect flood at
the cap cannot eat the descriptors kept in reserve (FD_RESERVE), which the
worker channel's ZeroMQ sockets need (libzmq aborts the process when its
accept() meets EMFILE). Also the
BodyBudget all connections share, the head check each one runs, the
HangupWatcher, and stopping (drain, wait_idle, abort, close).
Must not know: routes, JSON payloads, the engine; HTTP syntax (the assembler
and the Responder); one connection's workings (HttpConnection).
How: each accepted socket becomes an HttpConnection, admitted or carrying
its refusal, counted the moment it is accepted so that a burst cannot
overshoot the cap. A drain keeps listening, refusing newcomers with 503, so
clients and load balancers get an answer they can retry elsewhere instead of
a refused connection; idle connections close at once, busy ones after their
response; close() stops listening at the end. With an SSLContext
(server/http/tls.py) each accepted socket is handed to the loop for the TLS
handshake, within the header timeout, before its connection starts; one
whose first byte is not a TLS record (plain HTTP sent to the HTTPS port)
gets a plain-HTTP 400 saying to use https:// instead of a silent close. Runs
on any asyncio loop with add_reader; the app runs it on uvloop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from server.http.body_budget import BodyBudget
from server.http.connection import HttpConnection
from server.http.errors import RETRY_AFTER_S, ApiError
from server.http.parser import HttpRequest
from server.http.responder import ClientDisconnected, Responder
from server.http.sockets import Acceptor, HangupWatcher, default_max_connections, listening_socket

__all__ = ["CheckHead", "ClientDisconnected", "Handler", "HttpLimits", "HttpRequest", "HttpServer", "Responder",
           "serve"]

log = logging.getLogger(__name__)

Handler = Callable[[HttpRequest, Responder], Awaitable[None]]
# (method, path, headers) of a request whose head is complete -> the error to answer before its body is read
# (and then close, the body unread), or None to read the body and serve the request.
CheckHead = Callable[[str, str, dict[str, str]], ApiError | None]
DEFAULT_HOST = "127.0.0.1"  # where the server listens unless told (--host): this machine only
DEFAULT_PORT = 8000  # vLLM's (--port)
BUFFERED_BODIES = 32  # the default max_buffered_body_bytes, in bodies of max_body_bytes
# Refused connections that may be open (their 503 not yet written and closed) beyond max_connections;
# a quarter of FD_RESERVE, so that a flood at the cap leaves the rest of the reserve alone.
REFUSAL_ALLOWANCE = 16
TLS_HANDSHAKE_RECORD = b"\x16"  # the first byte a TLS client sends
PLAIN_HTTP_LINGER_S = 2.0  # how long a plain-HTTP client of a TLS port may send on after its 400


@dataclass(slots=True)
class HttpLimits:
    max_header_bytes: int = 16 * 1024  # request line + header fields
    max_header_count: int = 100
    max_body_bytes: int = 8 * 1024 * 1024
    # Request bodies all connections hold at once (arriving, queued or being handled); past it 503.
    # None: BUFFERED_BODIES x max_body_bytes.
    max_buffered_body_bytes: int | None = None
    max_connections: int | None = None  # open at once; None: the soft RLIMIT_NOFILE less a reserve, at start
    header_timeout: float = 10.0  # absolute: from a request's first byte to the end of its headers
    body_timeout: float = 30.0  # from the end of the headers (or the 100 Continue) to the end of the body
    idle_timeout: float = 5.0  # keep-alive: a connection with no request in progress is closed after this
    write_timeout: float = 30.0  # a client that reads nothing for this long while our buffer is full is dropped

    def __post_init__(self) -> None:
        if self.max_buffered_body_bytes is None:
            self.max_buffered_body_bytes = BUFFERED_BODIES * self.max_body_bytes
        for name in self.__slots__:
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"HttpLimits.{name} must be > 0, got {value!r}")
        if self.body_budget_bytes < self.max_body_bytes:
            raise ValueError(f"HttpLimits.max_buffered_body_bytes must be at least max_body_bytes "
                             f"({self.max_body_bytes}), got {self.max_buffered_body_bytes!r}")

    @property
    def body_budget_bytes(self) -> int:
        """max_buffered_body_bytes, or its default when None."""
        if self.max_buffered_body_bytes is None:
            return BUFFERED_BODIES * self.max_body_bytes
        return self.max_buffered_body_bytes


class HttpServer:
    """Listens and serves `handler`; `drain()`, `wait_idle()`, `abort()`, `close()` stop it.

    check_head: asked once a request's head is complete, before 100 Continue and before its body
    is read (see CheckHead).
    """

    def __init__(self, handler: Handler, limits: HttpLimits | None = None, check_head: CheckHead | None = None,
                 ssl_context: ssl.SSLContext | None = None):
        self.handler = handler
        self.ssl_context = ssl_context  # None: plain HTTP
        self.limits = limits or HttpLimits()
        self.check_head = check_head
        self.max_connections = self.limits.max_connections or default_max_connections()
        self.body_budget = BodyBudget(self.limits.body_budget_bytes)
        self.connections: set[HttpConnection] = set()
        self._refusing: set[HttpConnection] = set()  # accepted to be refused, not closed yet
        self.is_draining = False  # new connections get 503; the app may read it too
        self.port: int | None = None
        self._hangups: HangupWatcher | None = None  # made by start(), which needs a running loop
        self._acceptor: Acceptor | None = None
        self._connecting: set[asyncio.Task] = set()
        self._is_full = False
        self._all_closed = asyncio.Event()

    async def start(self, host: str = DEFAULT_HOST, port: int = 0, *, sock: socket.socket | None = None) -> None:
        if sock is None:
            sock = listening_socket(host, port)
        sock.setblocking(False)
        self._hangups = HangupWatcher()
        self._acceptor = Acceptor(sock, self._on_accept)
        # The bound port when port 0 was asked for; a Unix socket has none.
        self.port = sock.getsockname()[1] if sock.family != socket.AF_UNIX else None

    @property
    def hangups(self) -> HangupWatcher:
        """Watches the sockets of connections that stopped reading (see HttpConnection)."""
        if self._hangups is None:
            raise RuntimeError("HttpServer.hangups: expected a started server (start()), got one not started")
        return self._hangups

    def drain(self) -> None:
        """Refuse new connections with 503 (still listening); close idle ones now, the others after their response."""
        self.is_draining = True
        for conn in list(self.connections):
            conn.close_if_idle()

    def close(self) -> None:
        """Stop listening: the end of a drain (one begins here if none has)."""
        self.drain()
        if self._acceptor is not None:
            self._acceptor.close()
            self._acceptor = None
            self.hangups.close()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until every admitted connection has closed; False if some are still open after `timeout` s."""
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

    def held_bytes(self) -> dict[str, int]:
        """What the connections hold now: the request bodies charged to the budget, and the responses written but
        not yet taken by the kernel (a slow reader holds about one chunk: writing waits past the high-water mark)."""
        return {"request_bodies": self.body_budget.num_bytes,
                "write_buffers": sum(conn.write_buffer_bytes for conn in self.connections)}

    def forget(self, conn: HttpConnection) -> None:
        self.connections.discard(conn)
        self._refusing.discard(conn)
        if self._acceptor is not None and not self._is_at_accept_limit:
            self._acceptor.resume()
        if not self.connections:
            self._all_closed.set()

    @property
    def _is_at_accept_limit(self) -> bool:
        return len(self.connections) + len(self._refusing) >= self.max_connections + REFUSAL_ALLOWANCE

    def _on_accept(self, sock: socket.socket) -> None:
        refusal = self._refusal()
        conn = HttpConnection(self, refusal)
        (self.connections if refusal is None else self._refusing).add(conn)
        if self._is_at_accept_limit and self._acceptor is not None:  # the acceptor calls this: never None here
            self._acceptor.pause()
        task = asyncio.get_running_loop().create_task(self._connect(conn, sock))
        self._connecting.add(task)
        task.add_done_callback(self._connecting.discard)

    async def _connect(self, conn: HttpConnection, sock: socket.socket) -> None:
        try:
            if self.ssl_context is None:
                await asyncio.get_running_loop().connect_accepted_socket(lambda: conn, sock)
            elif await _sends_plain_http(sock, self.limits.header_timeout):
                await _answer_plain_http(sock)
                self.forget(conn)
            else:  # the handshake counts against the header timeout: a silent client holds a socket no longer
                await asyncio.get_running_loop().connect_accepted_socket(
                    lambda: conn, sock, ssl=self.ssl_context, ssl_handshake_timeout=self.limits.header_timeout)
        except OSError as exc:  # ssl.SSLError and TimeoutError too: its TLS handshake failed or timed out
            log.debug("a connection closed as it was accepted: %s", exc)
            sock.close()
            self.forget(conn)

    def _refusal(self) -> ApiError | None:
        """The 503 a new connection gets now, if any."""
        retry = {"Retry-After": RETRY_AFTER_S}
        if self.is_draining:
            return ApiError(503, "the server is shutting down; retry shortly", headers=retry)
        num_open = len(self.connections)
        if num_open < self.max_connections:
            self._is_full = False
            return None
        if not self._is_full:
            log.warning("%d connections open, the most allowed: new ones get 503 until some close", num_open)
            self._is_full = True
        return ApiError(503, f"the server has {num_open} connections open, at most {self.max_connections}; "
                             "retry shortly", headers=retry)


async def _sends_plain_http(sock: socket.socket, timeout: float) -> bool:
    """Whether a client of a TLS port opens with something other than a TLS record (a request in plain HTTP,
    whose first byte is a method's letter), peeked at once it comes; TimeoutError when nothing comes in time."""
    loop = asyncio.get_running_loop()
    readable = loop.create_future()
    loop.add_reader(sock.fileno(), lambda: readable.done() or readable.set_result(None))
    try:
        await asyncio.wait_for(readable, timeout)
    finally:
        loop.remove_reader(sock.fileno())
    first = sock.recv(1, socket.MSG_PEEK)
    return bool(first) and first != TLS_HANDSHAKE_RECORD


async def _answer_plain_http(sock: socket.socket) -> None:
    """Tell a plain-HTTP client of a TLS port, in plain HTTP, to use HTTPS; then close lingering (what it sent
    stays unread otherwise, and closing over it would send a reset that can overtake the answer)."""
    error = ApiError(400, "this port serves HTTPS: the request was sent in plain HTTP; use an https:// URL")
    body = error.body()
    head = (f"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n").encode()
    loop = asyncio.get_running_loop()

    async def read_to_the_end() -> None:
        while await loop.sock_recv(sock, 65536):
            pass

    try:
        await loop.sock_sendall(sock, head + body)
        sock.shutdown(socket.SHUT_WR)
        await asyncio.wait_for(read_to_the_end(), PLAIN_HTTP_LINGER_S)
    except (OSError, asyncio.TimeoutError):
        pass
    finally:
        sock.close()


async def serve(handler: Handler, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, limits: HttpLimits | None = None, *,
                sock: socket.socket | None = None, check_head: CheckHead | None = None,
                ssl_context: ssl.SSLContext | None = None) -> HttpServer:
    """Start serving `handler` on host:port (port 0: any free port; see `.port`) or on `sock`; over TLS with
    `ssl_context`."""
    server = HttpServer(handler, limits, check_head, ssl_context)
    await server.start(host, port, sock=sock)
    return server
