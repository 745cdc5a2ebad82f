"""What the frontend knows of a worker process: how it is spawned and talked to, its state, how it ended.

The talking is a WorkerChannel: the two sockets of one worker start, the
test of what arrives on them, and the worker's scheduled ledger, read once
it has exited. The rest: spawn_worker, the check that enough file
descriptors are free to start one, the CPU weight of a worker's session
(SessionNice), the lifecycle states, WorkerExit and WorkerStartError.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import errno
import hmac
import logging
import os
import resource
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import zmq
import zmq.asyncio

from shared.protocol import WORKER_MESSAGES, Fatal, ProtocolError, WorkerMessage, decode
from shared.scheduled_ledger import ledger_path, read_ledger, remove_ledger
from shared.worker_launch import (
    INPUT_SOCKET,
    OUTPUT_SOCKET,
    WorkerArgs,
    ipc_address,
    new_secret,
    secret_line,
    socket_path,
    worker_command,
)

logger = logging.getLogger("pagedserve.worker_process")
_Socket = TypeVar("_Socket", bound=zmq.Socket)  # a synchronous or an asyncio socket, returned as it came


# Descriptors a worker start may need: two sockets and their listeners, the worker's two connections, the pipes and
# the pidfd of the spawn, with room to spare. Whatever else the frontend opens (HTTP connections above all) must
# leave at least this many free under RLIMIT_NOFILE, or a start is refused rather than risk running out half-way.
START_DESCRIPTOR_RESERVE = 32
_CONNECT_POLL_S = 0.01
_OPEN_DESCRIPTORS_DIR = "/proc/self/fd"
_AUTOGROUP_FILE = "/proc/{pid}/autogroup"
# Linux lets a process without CAP_SYS_ADMIN set an autogroup's nice once per 100 ms, system-wide (EAGAIN else).
_AUTOGROUP_RETRY_S = 0.1
_AUTOGROUP_ATTEMPTS = 20


def num_free_descriptors() -> int | None:
    """How many more files this process may open under its RLIMIT_NOFILE soft limit; None when it cannot tell
    (no limit, or no /proc). OSError (EMFILE) when not even the one needed to count them is free."""
    soft_limit, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft_limit == resource.RLIM_INFINITY or not os.path.isdir(_OPEN_DESCRIPTORS_DIR):
        return None
    return soft_limit - (len(os.listdir(_OPEN_DESCRIPTORS_DIR)) - 1)  # less the one listdir itself had open


def check_descriptors_to_start() -> None:
    """OSError (EMFILE) when fewer than START_DESCRIPTOR_RESERVE descriptors are free, before anything is opened."""
    num_free = num_free_descriptors()
    if num_free is not None and num_free < START_DESCRIPTOR_RESERVE:
        raise OSError(errno.EMFILE, f"only {num_free} file descriptors are free under RLIMIT_NOFILE, and starting "
                                    f"the engine worker needs up to {START_DESCRIPTOR_RESERVE}")


async def spawn_worker(args: WorkerArgs, secret: str) -> asyncio.subprocess.Process:
    """Start `python -m gpu_worker` in a process group of its own and hand it `secret` on its stdin.

    A pipe and not the command line: argv is readable by every local user in /proc.
    """
    process = await asyncio.create_subprocess_exec(*worker_command(args), stdin=asyncio.subprocess.PIPE,
                                                   start_new_session=True)
    stdin = process.stdin
    if stdin is None:
        raise RuntimeError("expected the engine worker's stdin as a pipe (stdin=PIPE), got none")
    stdin.write(secret_line(secret))
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # it died at once: its exit says why
        await stdin.drain()
    stdin.close()
    return process


class SessionNice:
    """The nice value by which Linux weighs the CPU claim of a worker's session, as a whole (its autogroup).

    Where processes sit in the root CPU cgroup with autogroup on (a login
    session; not a systemd unit or a container, whose cgroup is one), Linux
    splits the CPU between sessions before it looks at the nice values and
    policies of their threads, and every worker leads a session of its own
    (spawn_worker): only this weight then keeps a standby off the cores of
    the worker in service. Unlike a thread's nice value, an unprivileged
    process may set it back to 0. Set from the event loop; a write refused
    by the kernel's rate limit is tried again, with the latest value, a
    moment later; without autogroup (no such file) nothing is done.
    """

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self._process = process
        self.nice = 0
        self._retry: asyncio.TimerHandle | None = None

    def set(self, nice: int) -> None:
        self.nice = nice
        if self._retry is not None:
            self._retry.cancel()
        self._write(_AUTOGROUP_ATTEMPTS)

    def _write(self, num_attempts_left: int) -> None:
        self._retry = None
        if self._process.returncode is not None:
            return  # reaped: its pid may be another process's by now
        try:
            with open(_AUTOGROUP_FILE.format(pid=self._process.pid), "w") as file:
                file.write(str(self.nice))
        except BlockingIOError:
            if num_attempts_left > 1:
                self._retry = asyncio.get_running_loop().call_later(_AUTOGROUP_RETRY_S, self._write,
                                                                    num_attempts_left - 1)
            else:
                logger.warning("could not set the nice value of engine worker pid %d's session to %d: the kernel "
                               "kept refusing (EAGAIN)", self._process.pid, self.nice)
        except OSError as exc:  # no autogroup in this kernel, or the process is gone
            logger.debug("cannot set the nice value of engine worker pid %d's session: %s", self._process.pid, exc)


class WorkerChannel:
    """The frontend's two sockets to one worker start, the test of what comes in on them, and the worker's ledger.

    Bound fresh for each start, so nothing queued for a dead worker reaches its
    successor; sealed once the worker holds both connections; closed when it
    has exited, which removes its scheduled ledger too. A message counts only
    with this start's epoch and secret, compared in constant time: until the
    channel is sealed, any local process of the same user can connect to the
    output socket. Of the messages dropped, the first is logged and the rest
    only counted, since whoever sends them could otherwise flood the log.
    """

    def __init__(self, context: zmq.asyncio.Context, runtime_dir: Path, epoch: int) -> None:
        self.runtime_dir = runtime_dir
        self.epoch = epoch
        self.ledger_path = ledger_path(runtime_dir, epoch)  # the worker writes it, read_scheduled() reads it
        self.secret = new_secret()  # handed to the worker on its stdin (spawn_worker)
        self.num_dropped = 0
        self._sockets: list[zmq.Socket] = []
        try:
            self.input = self._bind(zmq.Socket(context, zmq.PUSH), INPUT_SOCKET)  # synchronous: sends never block
            self.output = self._bind(context.socket(zmq.PULL), OUTPUT_SOCKET)
        except zmq.ZMQError:
            self.close()
            raise

    def _bind(self, socket: _Socket, name: str) -> _Socket:
        self._sockets.append(socket)
        socket.setsockopt(zmq.LINGER, 0)
        # No high-water mark: a send never fails while a worker is connected.
        socket.setsockopt(zmq.SNDHWM if socket.type == zmq.PUSH else zmq.RCVHWM, 0)
        socket.bind(ipc_address(self.runtime_dir, name, self.epoch))
        return socket

    @property
    def is_input_connected(self) -> bool:
        """The worker holds the input connection: its PUSH can send."""
        return bool(self.input.poll(0, zmq.POLLOUT))

    def accept(self, frames: list[zmq.Frame]) -> WorkerMessage | None:
        """The message in `frames` if this worker sent it; else None, and the drop is counted."""
        try:
            msg = decode(frames)
        except ProtocolError as exc:
            return self._drop(f"a malformed message ({exc})")
        if not isinstance(msg, WORKER_MESSAGES):
            return self._drop(f"a {msg.KIND} message, which the worker does not send")
        if msg.epoch != self.epoch or not hmac.compare_digest(msg.secret.encode(), self.secret.encode()):
            return self._drop(f"a {msg.KIND} message without this worker's epoch and secret")
        return msg

    def _drop(self, what: str) -> None:
        self.num_dropped += 1
        if self.num_dropped == 1:
            logger.warning("dropped %s on the engine worker's channel (epoch %d); further drops are counted, not "
                           "logged", what, self.epoch)

    def read_scheduled(self) -> list[str]:
        """The requests the worker noted in its scheduled ledger: read once it has exited, before close().

        A ledger that cannot be read (no file descriptor free, a malformed line) is logged, and names none."""
        try:
            return read_ledger(self.ledger_path)
        except (OSError, ValueError) as exc:
            logger.error("cannot read the engine worker's scheduled ledger (epoch %d), so its death is blamed on no "
                         "request: %s", self.epoch, exc)
            return []

    def seal(self) -> None:
        """Remove the socket files, once the worker holds both connections: nothing else can connect any more.

        Nor is a connection left for libzmq to accept while the server runs, and that matters: when accept()
        on an ipc listener fails with EMFILE, libzmq aborts the whole process (an assertion in
        src/ipc_listener.cpp, up to libzmq 4.3.5 and its master), which a client holding many connections could
        otherwise bring about. Connections made stay.
        """
        for name in (INPUT_SOCKET, OUTPUT_SOCKET):
            with contextlib.suppress(FileNotFoundError):
                socket_path(self.runtime_dir, name, self.epoch).unlink()

    def close(self) -> None:
        for socket in self._sockets:
            if not socket.closed:
                socket.close(linger=0)
        self.seal()
        remove_ledger(self.ledger_path)


async def seal_when_connected(channel: WorkerChannel, exited: asyncio.Event, deadline: float) -> bool:
    """Seal the channel once the worker holds its input connection too (it makes it before sending Ready, so
    that follows at once); False when the worker exits or time.monotonic() passes `deadline` first."""
    while not channel.is_input_connected:
        if exited.is_set() or time.monotonic() > deadline:
            return False
        await asyncio.sleep(_CONNECT_POLL_S)
    channel.seal()
    return True


class WorkerState(enum.Enum):
    """The EngineClient's worker, as the frontend sees it."""

    IDLE = "idle"  # none started yet
    STARTING = "starting"  # spawned, no READY yet
    READY = "ready"
    EXITED = "exited"  # gone; start() may spawn the next one
    CLOSED = "closed"  # the client was closed: final

    def move_to(self, new_state: WorkerState) -> WorkerState:
        if (self, new_state) not in _ALLOWED_MOVES:
            raise RuntimeError(f"the engine worker cannot go from {self.value} to {new_state.value}")
        return new_state


_ALLOWED_MOVES = {
    (WorkerState.IDLE, WorkerState.STARTING),
    (WorkerState.STARTING, WorkerState.READY),
    (WorkerState.STARTING, WorkerState.EXITED),  # died or timed out before READY
    (WorkerState.READY, WorkerState.EXITED),
    (WorkerState.EXITED, WorkerState.STARTING),  # a restart
    *((state, WorkerState.CLOSED) for state in WorkerState if state is not WorkerState.CLOSED),
}


@dataclass(frozen=True, slots=True)
class WorkerExit:
    """How one worker ended."""

    epoch: int
    pid: int
    returncode: int  # negative: killed by signal -returncode (asyncio's convention)
    fatal: Fatal | None = None  # the worker's own report of the error, when it sent one

    @property
    def signal_name(self) -> str | None:
        if self.returncode >= 0:
            return None
        try:
            return signal.Signals(-self.returncode).name
        except ValueError:
            return f"signal {-self.returncode}"

    @property
    def description(self) -> str:
        """One line for logs and error messages, e.g. 'the engine worker (pid 41, epoch 2) was killed by SIGKILL'."""
        how = (f"was killed by {self.signal_name}" if self.signal_name is not None
               else f"exited with status {self.returncode}")
        if self.fatal is not None:
            how += f" after a fatal error: {self.fatal.message}"
        return f"the engine worker (pid {self.pid}, epoch {self.epoch}) {how}"


class WorkerStartError(RuntimeError):
    """The worker could not be spawned, or exited or sent no READY in time before it was ready.

    `worker_exit`: how it ended, None when it was never spawned. `out_of_descriptors`: the start failed for want
    of file descriptors (EMFILE or ENFILE, or fewer free than START_DESCRIPTOR_RESERVE), nothing was spawned, and
    a start once descriptors are freed (clients gone) may well succeed: no fault of the worker's.
    """

    def __init__(self, message: str, worker_exit: WorkerExit | None, *, out_of_descriptors: bool = False) -> None:
        super().__init__(message)
        self.worker_exit = worker_exit
        self.out_of_descriptors = out_of_descriptors
