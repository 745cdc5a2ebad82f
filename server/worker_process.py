"""What the frontend knows of a worker process: how it is spawned, its lifecycle state, how it ended, a failed start."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import signal
from dataclasses import dataclass

from shared.protocol import Fatal
from shared.worker_launch import WorkerArgs, secret_line, worker_command


async def spawn_worker(args: WorkerArgs, secret: str) -> asyncio.subprocess.Process:
    """Start `python -m gpu_worker` in a process group of its own and hand it `secret` on its stdin.

    A pipe and not the command line: argv is readable by every local user in /proc.
    """
    process = await asyncio.create_subprocess_exec(*worker_command(args), stdin=asyncio.subprocess.PIPE,
                                                   start_new_session=True)
    process.stdin.write(secret_line(secret))
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # it died at once: its exit says why
        await process.stdin.drain()
    process.stdin.close()
    return process


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
    """The worker exited, or sent no READY in time, before it was ready."""

    def __init__(self, message: str, worker_exit: WorkerExit | None) -> None:
        super().__init__(message)
        self.worker_exit = worker_exit
