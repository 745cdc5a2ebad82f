"""The sockets beneath the HTTP transports: accepting with back-off, hang-ups while paused, descriptors.

Owns: accept() on the listening socket and what happens when it fails for
want of resources; noticing that the peer of a connection whose reading is
paused has hung up; the process's open-files limit (raised to the hard limit
at start-up) and the connection cap derived from it.
Must not know: HTTP (an accepted socket goes to a callback, a hang-up too).
How: Acceptor watches the listening socket (add_reader) and accepts up to
ACCEPT_BATCH connections per wake-up. When accept() fails — out of
descriptors (EMFILE, ENFILE), out of kernel memory (ENOBUFS, ENOMEM), or
anything else — it stops watching for a back-off that doubles from
ACCEPT_BACKOFF_MIN_S up to ACCEPT_BACKOFF_MAX_S, then watches again:
connections that arrive meanwhile wait in the kernel's backlog and are
served once descriptors are free. It never spins (the socket stays readable
while a connection waits, so it must not be watched during the back-off) and
never stops listening on its own; its owner may pause() it while it can take
no more connections, and resume() it. Neither event loop does this well: uvloop's
libuv, short of descriptors, accepts every waiting connection and closes it
unanswered (its reserved-descriptor trick), and on an accept error libuv
passes up, uvloop closes the listening socket for good, without a word;
asyncio pauses for 1 s but logs a traceback for every failed accept,
hundreds a second.
HangupWatcher keeps one epoll instance, watched by the loop as one reader,
that reports EPOLLRDHUP and EPOLLHUP for the sockets it is given: a transport
whose reading is paused reads nothing, so without it a client's FIN would
go unseen until a write failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import select
import socket
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

ACCEPT_BATCH = 64  # connections accepted per wake-up, so that one busy listener cannot starve the loop
ACCEPT_BACKOFF_MIN_S = 0.05
ACCEPT_BACKOFF_MAX_S = 1.0
LISTEN_BACKLOG = 1024  # connections the kernel holds for us, e.g. during a back-off
# Descriptors kept free beside the connections: the worker channel's ZeroMQ
# sockets, the state store's files or sockets, logs, the event loop's own.
FD_RESERVE = 64
DEFAULT_MAX_CONNECTIONS_CAP = 16384  # when the descriptor limit is huge, memory is the bound
NOFILE_WHEN_UNLIMITED = 1 << 20  # Linux's default fs.nr_open, the most a soft limit may be


def raise_open_files_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit, as servers do; (soft limit before, soft limit now)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = NOFILE_WHEN_UNLIMITED if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):  # a limit above fs.nr_open: keep the soft one
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def default_max_connections() -> int:
    """The soft RLIMIT_NOFILE less FD_RESERVE, at most DEFAULT_MAX_CONNECTIONS_CAP (and at least 1)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return DEFAULT_MAX_CONNECTIONS_CAP
    return max(1, min(soft - FD_RESERVE, DEFAULT_MAX_CONNECTIONS_CAP))


def listening_socket(host: str, port: int) -> socket.socket:
    """A non-blocking TCP socket listening on host:port (port 0: any free one)."""
    family, type_, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def listening_unix_socket(path: Path) -> socket.socket:
    """A non-blocking Unix socket listening at `path`; a socket file left there by a server that is gone is
    replaced, anything else there (a live server's socket, another file) is an OSError naming it."""
    if path.is_socket() and not _is_accepting(path):
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on the Unix socket {path}: {exc.strerror}") from exc
    return sock


def _is_accepting(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        return probe.connect_ex(str(path)) == 0


class Acceptor:
    """Accepts connections on a listening socket for `on_accept`, backing off while accept() fails."""

    def __init__(self, sock: socket.socket, on_accept: Callable[[socket.socket], None]):
        self._sock = sock
        self._on_accept = on_accept
        self._loop = asyncio.get_running_loop()
        self._backoff_s = 0.0  # 0 while accepting; else the pause after the last failure
        self._resume: asyncio.TimerHandle | None = None
        self.is_paused = False  # by the owner, until resume()
        self._loop.add_reader(sock.fileno(), self._accept)

    def close(self) -> None:
        """Stop accepting and close the listening socket."""
        if self._resume is not None:
            self._resume.cancel()
        elif not self.is_paused:
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()

    def pause(self) -> None:
        """Accept nothing until resume(): new connections wait in the kernel's backlog."""
        if self.is_paused:
            return
        self.is_paused = True
        if self._resume is None:  # watching (during a back-off nothing is)
            self._loop.remove_reader(self._sock.fileno())

    def resume(self) -> None:
        if not self.is_paused:
            return
        self.is_paused = False
        if self._resume is None:  # a back-off in progress watches again when it ends
            self._loop.add_reader(self._sock.fileno(), self._accept)

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            if self.is_paused:  # by on_accept, for the connection just accepted
                return
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue  # the client left before it was accepted
            except OSError as exc:
                self._back_off(exc)
                return
            if self._backoff_s:
                log.info("accepting connections again")
                self._backoff_s = 0.0
            conn.setblocking(False)
            self._on_accept(conn)

    def _back_off(self, exc: OSError) -> None:
        is_first = not self._backoff_s
        self._backoff_s = min(max(2 * self._backoff_s, ACCEPT_BACKOFF_MIN_S), ACCEPT_BACKOFF_MAX_S)
        log.log(logging.WARNING if is_first else logging.DEBUG,
                "cannot accept connections (%s); retrying in %g s, meanwhile they wait in the backlog",
                exc, self._backoff_s)
        self._loop.remove_reader(self._sock.fileno())
        self._resume = self._loop.call_later(self._backoff_s, self._watch)

    def _watch(self) -> None:
        self._resume = None
        if not self.is_paused:
            self._loop.add_reader(self._sock.fileno(), self._accept)


class HangupWatcher:
    """Calls back when the peer of a watched socket hangs up (FIN or RST), whether or not the socket is read."""

    def __init__(self):
        self._loop = asyncio.get_running_loop()
        self._epoll = select.epoll()
        self._callbacks: dict[int, Callable[[], None]] = {}
        self._loop.add_reader(self._epoll.fileno(), self._on_ready)

    def watch(self, fd: int, on_hangup: Callable[[], None]) -> None:
        if self._epoll.closed:
            return
        try:
            self._epoll.register(fd, select.EPOLLRDHUP)
        except FileExistsError:  # left by a closed socket whose number fd now is
            self._epoll.modify(fd, select.EPOLLRDHUP)
        self._callbacks[fd] = on_hangup

    def forget(self, fd: int, on_hangup: Callable[[], None]) -> None:
        """Stop watching fd, if it is still watched for `on_hangup` (its number may belong to another by now)."""
        if self._epoll.closed or self._callbacks.get(fd) != on_hangup:
            return
        del self._callbacks[fd]
        with contextlib.suppress(OSError):  # closed already: epoll dropped it itself
            self._epoll.unregister(fd)

    def close(self) -> None:
        self._loop.remove_reader(self._epoll.fileno())
        self._epoll.close()
        self._callbacks.clear()

    def _on_ready(self) -> None:
        for fd, _ in self._epoll.poll(0):
            on_hangup = self._callbacks.pop(fd, None)
            with contextlib.suppress(OSError):
                self._epoll.unregister(fd)
            if on_hangup is not None:
                on_hangup()
