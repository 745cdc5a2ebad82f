"""RestartPolicy: how the supervisor judges and restarts a worker, with its defaults and checks in one place.

The CLI's flags (--worker-start-timeout, --worker-hang-timeout,
--max-request-restarts, --max-worker-restarts, --restart-window) build one;
the Supervisor reads it and the EngineClient takes its start_timeout. A
hang timeout shorter than MIN_HANG_TIMEOUT_S (shared/vocabulary.py) would
call a live, idle worker hung between two heartbeats, so it is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.vocabulary import MIN_HANG_TIMEOUT_S

DEFAULT_START_TIMEOUT_S = 300.0  # a large checkpoint can take minutes to load


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    start_timeout: float = DEFAULT_START_TIMEOUT_S  # from spawning a worker to its READY
    hang_timeout: float = 30.0  # silence (no output, no heartbeat) after which a worker counts as hung
    max_request_restarts: int = 2  # consecutive worker deaths a request may be in flight for (poison)
    max_worker_restarts: int = 5  # within restart_window; one more and the server exits non-zero
    restart_window: float = 300.0
    backoff_initial: float = 0.5  # before the first restart; doubles with each death counted in the window
    backoff_max: float = 30.0

    def __post_init__(self) -> None:
        for name in ("start_timeout", "restart_window", "backoff_max"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)!r}")
        if not self.hang_timeout >= MIN_HANG_TIMEOUT_S:
            raise ValueError(f"hang_timeout must be >= {MIN_HANG_TIMEOUT_S:g} seconds (a worker's heartbeats may be "
                             f"that far apart), got {self.hang_timeout!r}")
        if not 0 <= self.backoff_initial <= self.backoff_max:
            raise ValueError(f"backoff_initial must be in [0, backoff_max={self.backoff_max}], "
                             f"got {self.backoff_initial!r}")
        if self.max_request_restarts < 1:
            raise ValueError(f"max_request_restarts must be >= 1, got {self.max_request_restarts!r}")
        if self.max_worker_restarts < 0:
            raise ValueError(f"max_worker_restarts must be >= 0, got {self.max_worker_restarts!r}")
