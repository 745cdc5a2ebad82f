"""ProfileSession: the frontend's record of whether the worker is profiling its steps, and the wait for its answer.

Owns the profile's lifecycle as the frontend sees it: IDLE -> PROFILING
(StartProfile sent to the worker of an epoch) -> STOPPING (StopProfile sent,
a future waits for the ProfileResult) -> IDLE. A profile lives in its
worker's memory, so when that worker exits it is lost: whatever the state,
the session goes back to IDLE, a waiting stop fails with ProfileConflict,
and so does the next stop, saying what was lost and why. The worker that
replaces it starts unprofiled.
Must not know: HTTP (the router turns ProfileConflict into 409), sockets and the
wire (EngineClient sends the messages and routes the result here).
"""

from __future__ import annotations

import asyncio
import enum
import logging

from shared.protocol import ProfileResult

# Writing takes about 15 ms per step profiled (on a side thread: the worker serves on), so this covers some 40,000
# steps; a worker that dies or hangs meanwhile ends the wait sooner (its exit, or its hang timeout).
STOP_TIMEOUT_S = 600.0

logger = logging.getLogger("pagedserve.engine_client")


class ProfileConflict(Exception):
    """The request does not fit the profile's state: a start while profiling, a stop while not."""


class ProfileTimeout(Exception):
    """The worker did not answer a StopProfile in time."""


class ProfileState(enum.Enum):
    IDLE = "idle"
    PROFILING = "profiling"
    STOPPING = "stopping"


class ProfileSession:
    def __init__(self) -> None:
        self.state = ProfileState.IDLE
        self.epoch: int | None = None  # the profiled worker's, while not IDLE
        self._lost: str | None = None  # why the last profile ended without a result, until the next start
        self._result: asyncio.Future[ProfileResult] | None = None  # while STOPPING

    def start(self, epoch: int) -> None:
        """The worker of `epoch` is to profile from now on (the caller sends StartProfile)."""
        if self.state is not ProfileState.IDLE:
            raise ProfileConflict(f"the engine worker (epoch {self.epoch}) is already profiling; POST "
                                  "/stop_profile first")
        self.state, self.epoch, self._lost = ProfileState.PROFILING, epoch, None

    def stop(self) -> asyncio.Future[ProfileResult]:
        """The future the worker's ProfileResult will complete (the caller sends StopProfile)."""
        if self.state is ProfileState.STOPPING:
            raise ProfileConflict("a /stop_profile is already waiting for the engine worker's profile")
        if self.state is ProfileState.IDLE:
            raise ProfileConflict(self._lost or "the engine worker is not profiling; POST /start_profile first")
        self.state = ProfileState.STOPPING
        self._result = asyncio.get_running_loop().create_future()
        return self._result

    async def wait(self, result: asyncio.Future[ProfileResult], timeout: float = STOP_TIMEOUT_S) -> ProfileResult:
        """The ProfileResult, or ProfileConflict when the worker exits first, or ProfileTimeout."""
        try:
            return await asyncio.wait_for(asyncio.shield(result), timeout)
        except asyncio.TimeoutError:
            self._end(f"the engine worker (epoch {self.epoch}) did not answer /stop_profile within {timeout:g} s")
            raise ProfileTimeout(self._lost) from None

    def finish(self, result: ProfileResult) -> None:
        """The worker's answer arrived: the waiting stop gets it."""
        waiting = self._result  # set whenever the state is STOPPING
        if self.state is not ProfileState.STOPPING or waiting is None:
            logger.warning("dropped a profile result no /stop_profile waits for (it timed out)")
            return
        waiting.set_result(result)
        self.state, self.epoch, self._result = ProfileState.IDLE, None, None

    def lose(self, description: str) -> None:
        """The profiled worker exited: its profile is gone."""
        if self.state is ProfileState.IDLE:
            return
        logger.warning("the profile of engine worker epoch %d is lost: %s", self.epoch, description)
        self._end(f"the profile was lost: the engine worker (epoch {self.epoch}) exited while profiling "
                  f"({description}); POST /start_profile to profile the worker that replaced it")

    def _end(self, lost: str) -> None:
        if self._result is not None and not self._result.done():
            self._result.set_exception(ProfileConflict(lost))
            self._result.exception()  # retrieved: only a stop still waiting would have read it
        self.state, self.epoch, self._result, self._lost = ProfileState.IDLE, None, None, lost
