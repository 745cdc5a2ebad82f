"""systemd's notify protocol, without libsystemd: READY=1, STATUS=, WATCHDOG=1, STOPPING=1, EXTEND_TIMEOUT_USEC=.

Owns the one datagram socket to $NOTIFY_SOCKET and the watchdog ping task.
Must not know HTTP or the engine; supervisor_status_hook() is the one
bridge from the Supervisor's state changes.

The protocol (sd_notify(3)): each message is one datagram of newline-
separated KEY=VALUE lines to the AF_UNIX socket named by $NOTIFY_SOCKET; a
leading '@' names the Linux abstract namespace. When $NOTIFY_SOCKET is unset
(not under systemd) every call is a no-op. A send never blocks and never
raises: losing a status line must not take the server down.

Watchdog: with WatchdogSec= systemd sets $WATCHDOG_USEC (and $WATCHDOG_PID);
we ping at half that interval from the event loop, so a wedged loop stops
pinging and systemd kills and restarts the service. The worker's health is
the supervisor's job, not the watchdog's.

Typical use in the frontend's main:

    notifier = SystemdNotifier.from_environ()
    supervisor = Supervisor(client, ..., on_state_change=supervisor_status_hook(notifier, start_timeout=...))
    watchdog = notifier.start_watchdog()   # None when no watchdog is asked for
    ... on SIGTERM: notifier.stopping(); drain; await supervisor.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable, Mapping

from server.worker.supervisor import SupervisorState

_START_TIMEOUT_MARGIN_S = 30.0  # EXTEND_TIMEOUT_USEC beyond the worker's start timeout: time to send READY=1

logger = logging.getLogger("pagedserve.sd_notify")


def notify_address(environ: Mapping[str, str] = os.environ) -> str | None:
    """$NOTIFY_SOCKET as a socket address ('@name' -> '\\0name'), or None when unset."""
    address = environ.get("NOTIFY_SOCKET")
    if not address:
        return None
    return "\0" + address[1:] if address.startswith("@") else address


def watchdog_interval(environ: Mapping[str, str] = os.environ, pid: int | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings: half of $WATCHDOG_USEC; None when no watchdog is asked of this process."""
    text = environ.get("WATCHDOG_USEC")
    watchdog_pid = environ.get("WATCHDOG_PID")
    if not text:
        return None
    if watchdog_pid and watchdog_pid != str(pid if pid is not None else os.getpid()):
        return None  # the watchdog is some other process's (e.g. we are a child that inherited the environment)
    try:
        usec = int(text)
    except ValueError:
        logger.warning("ignoring WATCHDOG_USEC=%r: expected a whole number of microseconds", text)
        return None
    return usec / 2 / 1e6 if usec > 0 else None


class SystemdNotifier:
    def __init__(self, address: str | None, watchdog_interval: float | None = None) -> None:
        self.address = address
        self.watchdog_interval = watchdog_interval if address is not None else None
        self._socket: socket.socket | None = None
        if address is not None:
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._socket.setblocking(False)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> SystemdNotifier:
        return cls(notify_address(environ), watchdog_interval(environ))

    def notify(self, *lines: str) -> bool:
        """Send one datagram of KEY=VALUE lines; False when disabled or the send failed (logged, never raised)."""
        if self._socket is None or self.address is None:  # both or neither: the socket exists for the address
            return False
        try:
            self._socket.sendto("\n".join(lines).encode(), self.address)
        except OSError as exc:
            logger.warning("could not notify systemd at %r: %s", self.address, exc)
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        return self.notify("READY=1", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={text}")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def stopping(self, status: str | None = None) -> bool:
        return self.notify("STOPPING=1", *([f"STATUS={status}"] if status else []))

    def extend_timeout(self, seconds: float) -> bool:
        """Ask systemd for `seconds` more from now to finish starting (or stopping)."""
        return self.notify(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}")

    def start_watchdog(self) -> asyncio.Task | None:
        """A task pinging WATCHDOG=1 every watchdog_interval from this event loop; None when not asked for."""
        if self.watchdog_interval is None:
            return None
        return asyncio.create_task(self._ping_watchdog(self.watchdog_interval), name="systemd-watchdog")

    async def _ping_watchdog(self, interval: float) -> None:
        while True:
            self.watchdog()
            await asyncio.sleep(interval)

    def close(self) -> None:
        if self._socket is not None:
            with contextlib.suppress(OSError):
                self._socket.close()
            self._socket = None


def supervisor_status_hook(notifier: SystemdNotifier, *, start_timeout: float
                           ) -> Callable[[SupervisorState, SupervisorState, str], None]:
    """An on_state_change for the Supervisor: STATUS= on every change, EXTEND_TIMEOUT_USEC while the first worker
    loads, READY=1 when the first worker is READY."""
    is_ready_sent = False

    def on_state_change(old: SupervisorState, new: SupervisorState, detail: str) -> None:
        nonlocal is_ready_sent
        status = f"engine worker {new.value}: {detail}"
        if new is SupervisorState.STARTING and not is_ready_sent:
            notifier.extend_timeout(start_timeout + _START_TIMEOUT_MARGIN_S)
        if new is SupervisorState.READY and not is_ready_sent:
            is_ready_sent = True
            notifier.ready(status)
        else:
            notifier.status(status)

    return on_state_change
