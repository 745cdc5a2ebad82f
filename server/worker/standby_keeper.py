"""StandbyKeeper: one standby worker kept started behind the worker in service, and handed over when it is wanted.

While a worker serves, keep() has a StandbyWorker started (after a delay:
after a takeover the resumed requests get the cores first) and started again
should it die while it waits, with a back-off up to STANDBY_RETRY_MAX_S
between attempts that keep failing; an attempt refused for want of file
descriptors is made again as soon as enough are free (checked every
DESCRIPTOR_POLL_S), not after the back-off. While the last attempt failed
and none is ready the server has lost its standby (`is_missing`, logged once
as it happens and once as it ends). take() hands the standby over (ready or
still starting) and stops keeping one until the next keep().
Must not know requests or the channel's messages: `launch` spawns a worker.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from server.worker.process import START_DESCRIPTOR_RESERVE, num_free_descriptors
from server.worker.standby import Launch, StandbyWorker

STANDBY_RETRY_MAX_S = 30.0  # the longest pause between attempts to start a standby that keeps failing
DESCRIPTOR_POLL_S = 0.5  # how often a standby start refused for want of descriptors looks for free ones

logger = logging.getLogger("pagedserve.standby")


class StandbyKeeper:
    def __init__(self, launch: Callable[[], Launch], start_timeout: float, is_serving: Callable[[], bool]) -> None:
        self._launch = launch
        self._start_timeout = start_timeout
        self._is_serving = is_serving  # keep a standby only while this says a worker is in service
        self.standby: StandbyWorker | None = None
        self.is_missing = False  # the last attempt to start one failed, and none is ready
        self._task: asyncio.Task | None = None

    @property
    def has_ready_standby(self) -> bool:
        return self.standby is not None and self.standby.is_ready

    def keep(self, delay: float) -> None:
        """Have a standby started (after `delay` seconds) and restarted should it die while it waits."""
        if self._task is None:
            self._task = asyncio.create_task(self._keeper(delay), name="standby keeper")

    def take(self) -> StandbyWorker | None:
        """The standby, ready or starting, for service (None when there is none); none is kept until keep()."""
        standby, self.standby = self.standby, None
        self._stop()
        return standby

    async def close(self) -> None:
        standby = self.take()
        if standby is not None:
            await standby.close()

    def _stop(self) -> None:
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()
        self._task = None

    async def _keeper(self, delay: float) -> None:
        retry = 1.0
        await asyncio.sleep(delay)
        while self._is_serving():
            self.standby = standby = StandbyWorker(self._launch())
            if await standby.wait_ready(self._start_timeout):
                retry = 1.0
                self._found()
                await standby.exited.wait()
            else:
                self._lost(standby)
            if self.standby is standby:
                self.standby = None
                await standby.close()
            if standby.start_error is not None and standby.start_error.out_of_descriptors:
                await _descriptors_to_start()
                continue
            await asyncio.sleep(retry)
            retry = min(STANDBY_RETRY_MAX_S, 2 * retry)

    def _lost(self, standby: StandbyWorker) -> None:
        if not self.is_missing:
            why = standby.start_error or "it exited or timed out while it loaded"
            logger.warning("no standby engine worker: a worker death now costs a full restart, and the KV of the "
                           "requests in flight is recomputed unless shared; trying to start one again (%s)", why)
        self.is_missing = True

    def _found(self) -> None:
        if self.is_missing:
            logger.warning("a standby engine worker is ready again")
        self.is_missing = False


async def _descriptors_to_start() -> None:
    """Return once a worker start's descriptors are free (at once when the count cannot be known)."""
    while (num_free := num_free_descriptors()) is not None and num_free < START_DESCRIPTOR_RESERVE:
        await asyncio.sleep(DESCRIPTOR_POLL_S)
