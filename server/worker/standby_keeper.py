"""StandbyKeeper: one standby worker kept started behind the worker in service, and handed over when it is wanted.

While a worker serves, keep() has a StandbyWorker started (after a delay:
after a takeover the resumed requests get the cores first) and started again
should it die while it waits, with a back-off up to STANDBY_RETRY_MAX_S
between attempts that keep failing. take() hands the standby over (ready or
still starting) and stops keeping one until the next keep().
Must not know requests or the channel's messages: `launch` spawns a worker.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from server.worker.standby import Launch, StandbyWorker

STANDBY_RETRY_MAX_S = 30.0  # the longest pause between attempts to start a standby that keeps failing


class StandbyKeeper:
    def __init__(self, launch: Callable[[], Launch], start_timeout: float, is_serving: Callable[[], bool]) -> None:
        self._launch = launch
        self._start_timeout = start_timeout
        self._is_serving = is_serving  # keep a standby only while this says a worker is in service
        self.standby: StandbyWorker | None = None
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
                await standby.exited.wait()
            if self.standby is standby:
                self.standby = None
                await standby.close()
            await asyncio.sleep(retry)
            retry = min(STANDBY_RETRY_MAX_S, 2 * retry)
