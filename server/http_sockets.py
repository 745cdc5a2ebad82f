"""The sockets beneath the HTTP transports: hang-ups while reading is paused.

Owns: noticing that the peer of a connection whose reading is paused has
hung up.
Must not know: HTTP (a hang-up goes to a callback).
How: HangupWatcher keeps one epoll instance, watched by the loop as one
reader, that reports EPOLLRDHUP and EPOLLHUP for the sockets it is given: a
transport whose reading is paused reads nothing, so without it a client's
FIN would go unseen until a write failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
from collections.abc import Callable


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
