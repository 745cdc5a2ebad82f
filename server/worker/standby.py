"""StandbyWorker: a worker started ahead of need, loaded, warmed up and READY, that is sent nothing until the
active worker dies; then the EngineClient takes over its channel and process at once (`detach`).

Owns, while it waits, its WorkerChannel, its process, and two tasks: one that
spawns it and then awaits its exit, and one that reads its messages (its
Ready, then heartbeats, which nobody needs but which keep its socket
drained). Must not know requests: a standby holds none. A standby that exits
while it waits is simply gone (`exited`); the EngineClient starts another.

A standby never competes with the worker in service for the CPU: it starts
with --standby, which has it import, load and warm up on a thread at idle
priority (gpu_worker/process/priority.py), and its session is weighed as nice
STANDBY_SESSION_NICE (SessionNice) from its spawn until it is wanted in
service (`hurry`, which `detach` does too), when it goes back to 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine

from server.worker.process import SessionNice, WorkerChannel, WorkerStartError, seal_when_connected
from shared.protocol import Ready

logger = logging.getLogger("pagedserve.standby")
Launch = Coroutine[None, None, tuple[WorkerChannel, asyncio.subprocess.Process]]
STANDBY_SESSION_NICE = 19  # the lowest priority a nice value gives


class StandbyWorker:
    """Spawned by `launch` (a coroutine that binds a channel and spawns a worker on it, or raises
    WorkerStartError), on a task of its own: whoever stops waiting for it leaves no process behind."""

    def __init__(self, launch: Launch) -> None:
        self.channel: WorkerChannel | None = None
        self.process: asyncio.subprocess.Process | None = None
        self.info: Ready | None = None
        self._session_nice: SessionNice | None = None  # once spawned
        self._nice = STANDBY_SESSION_NICE  # its session's
        self.ready = asyncio.Event()  # its Ready came and its channel is sealed
        self.exited = asyncio.Event()  # it exited, or could not be spawned
        self.is_detached = False
        self.start_error: WorkerStartError | None = None  # why it could not be spawned, if it could not
        self._got_ready = asyncio.Event()
        self._spawned = asyncio.Event()  # spawned, or failed to be
        self._receive_task: asyncio.Task | None = None
        self._run_task = asyncio.create_task(self._run(launch))

    @property
    def is_ready(self) -> bool:
        return self.ready.is_set() and not self.exited.is_set()

    async def wait_ready(self, timeout: float) -> bool:
        """Wait for its Ready (then seal its channel); False, and the process killed, when it exits, cannot be
        spawned or times out first."""
        deadline = time.monotonic() + timeout
        waits = {asyncio.create_task(self._got_ready.wait()), asyncio.create_task(self.exited.wait())}
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                task.cancel()
        channel = self.channel  # set once spawned, so whenever its Ready came
        if self._got_ready.is_set() and channel is not None and await seal_when_connected(channel, self.exited,
                                                                                          deadline):
            self.ready.set()
            return True
        self.kill()
        return False

    def detach(self) -> tuple[WorkerChannel, asyncio.subprocess.Process, Ready]:
        """Hand the channel and the process of a ready standby over to whoever takes it into service."""
        channel, process, info = self.channel, self.process, self.info
        if channel is None or process is None or info is None or self._receive_task is None:
            raise RuntimeError("StandbyWorker.detach: expected a standby that sent Ready, got one without")
        self.hurry()
        self.is_detached = True
        self._receive_task.cancel()
        self._run_task.cancel()
        return channel, process, info

    def hurry(self) -> None:
        """Weigh its session like any other from now on: it is wanted in service, loaded or not yet."""
        if self._nice == 0:
            return
        self._nice = 0
        if self._session_nice is not None:
            self._session_nice.set(self._nice)

    def kill(self) -> None:
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()

    async def close(self) -> None:
        """Kill it (it holds nothing), reap it and close its channel; one still being spawned once it is."""
        await self._spawned.wait()
        self.kill()
        await self.exited.wait()
        if self.channel is not None:
            self.channel.close()

    async def _run(self, launch: Launch) -> None:
        try:
            channel, process = await launch
            self.channel, self.process = channel, process
            self._session_nice = SessionNice(process)
            self._session_nice.set(self._nice)
        except WorkerStartError as exc:
            logger.error("cannot start a standby engine worker: %s", exc)
            self.start_error = exc
            self.exited.set()
            return
        finally:
            self._spawned.set()
        logger.info("started standby engine worker pid %d (epoch %d)", process.pid, channel.epoch)
        self._receive_task = receive_task = asyncio.create_task(self._receive(channel))
        returncode = await process.wait()
        receive_task.cancel()
        self.exited.set()
        if not self.is_detached:
            logger.warning("the standby engine worker (pid %d, epoch %d) exited with status %d while it waited",
                           process.pid, channel.epoch, returncode)

    async def _receive(self, channel: WorkerChannel) -> None:
        while True:
            msg = channel.accept(await channel.output.recv_multipart(copy=False))
            if isinstance(msg, Ready):
                self.info = msg
                self._got_ready.set()
