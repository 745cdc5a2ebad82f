"""StartFailures: tells a worker that can never start from one whose start is worth retrying.

Owns the rule: a worker that dies before READY with the same fatal error (its
Fatal's "ExceptionType: message") at MAX_SAME_LOAD_ERRORS starts in a row
fails for a reason that restarts do not change (a truncated checkpoint, a
bad config.json, a dtype it cannot serve), so the supervisor gives up at
once instead of spending its restart budget and minutes of back-off.
Must not know: how workers are spawned or talked to, the supervisor's states.
How: transient causes never count, and break a run of the same error: a
start with no Fatal (a worker killed by a signal or the OOM killer, or
killed for sending no READY within the start timeout), and a Fatal for want
of memory or of file descriptors (MemoryError, CUDA's OutOfMemoryError,
EMFILE, ENFILE, ENOMEM); those stay under the restart budget's rules. A
worker that gets ready ends any run.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass

from server.worker.process import WorkerExit

MAX_SAME_LOAD_ERRORS = 2  # the same error at this many starts in a row: no restart can help
TRANSIENT_ERROR_TYPES = frozenset({"MemoryError", "OutOfMemoryError"})
TRANSIENT_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOMEM)


def load_error(worker_exit: WorkerExit | None) -> str | None:
    """The fatal error a worker that failed to start reported ("CheckpointError: ..."), unless it is transient;
    None when it sent none or a signal ended it."""
    if worker_exit is None or worker_exit.fatal is None or worker_exit.signal_name is not None:
        return None
    message = worker_exit.fatal.message
    return None if is_transient(message) else message


def is_transient(message: str) -> bool:
    """Whether a Fatal's message, e.g. "OSError: [Errno 24] Too many open files", tells of a want that may pass."""
    exception_type = message.partition(":")[0]
    return exception_type in TRANSIENT_ERROR_TYPES or any(f"[Errno {code}]" in message for code in TRANSIENT_ERRNOS)


@dataclass(slots=True)
class StartFailures:
    """The run of failed starts with the same load error; `cannot_start` once it is MAX_SAME_LOAD_ERRORS long."""

    error: str | None = None  # the load error of the current run; None: no run
    num_in_a_row: int = 0

    def on_start_failed(self, worker_exit: WorkerExit | None) -> None:
        """A start failed; `worker_exit`: how its worker ended (None when it was never spawned)."""
        error = load_error(worker_exit)
        if error is None:
            self.reset()  # a transient cause breaks the run
        elif error == self.error:
            self.num_in_a_row += 1
        else:
            self.error, self.num_in_a_row = error, 1

    def reset(self) -> None:
        """No run any more: a worker got ready."""
        self.error, self.num_in_a_row = None, 0

    @property
    def cannot_start(self) -> bool:
        return self.num_in_a_row >= MAX_SAME_LOAD_ERRORS

    def describe(self) -> str:
        """One line naming the cause, for the log and the exit."""
        return (f"the engine worker cannot start: {self.error} (the same error at {self.num_in_a_row} starts in a row); "
                "giving up")
