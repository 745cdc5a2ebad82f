"""StandbyWorker: a worker started ahead of need, loaded, warmed up and READY, that is sent nothing until the
active worker dies; then the EngineClient takes over its channel and process at once (`detach`).

Owns, while it waits, its WorkerChannel, its process, and two tasks: one that
reads its messages (its Ready, then heartbeats, which nobody needs but which
keep its socket drained) and one that awaits its exit. Must not know requests:
a standby holds none. A standby that exits while it waits is simply gone
(`exited`); the EngineClient starts another. Also here: the defaults of
--standby-workers and --shared-kv-cache (resolve_worker_sharing).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Coroutine
from pathlib import Path

from server.kv_segment import SEGMENT_DIR
from server.worker_process import WorkerChannel, WorkerStartError, seal_when_connected
from shared.protocol import Ready

_NVIDIA_DEVICE = "/dev/nvidiactl"
_STANDBY_MARGIN_BYTES = 512 << 20  # a worker's interpreter, torch and allocator caches beside its weights

logger = logging.getLogger("pagedserve.standby")


class StandbyWorker:
    """Spawned by `launch` (a coroutine that binds a channel and spawns a worker on it, or raises
    WorkerStartError), on a task of its own: whoever stops waiting for it leaves no process behind."""

    def __init__(self, launch: Coroutine[None, None, tuple[WorkerChannel, asyncio.subprocess.Process]]) -> None:
        self.channel: WorkerChannel | None = None
        self.process: asyncio.subprocess.Process | None = None
        self.info: Ready | None = None
        self.ready = asyncio.Event()  # its Ready came and its channel is sealed
        self.exited = asyncio.Event()  # it exited, or could not be spawned
        self.is_detached = False
        self._got_ready = asyncio.Event()
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
        if self._got_ready.is_set() and await seal_when_connected(self.channel, self.exited, deadline):
            self.ready.set()
            return True
        self.kill()
        return False

    def detach(self) -> tuple[WorkerChannel, asyncio.subprocess.Process, Ready]:
        """Hand the channel and the process of a ready standby over to whoever takes it into service."""
        self.is_detached = True
        self._receive_task.cancel()
        self._run_task.cancel()
        return self.channel, self.process, self.info

    def kill(self) -> None:
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()

    async def close(self) -> None:
        """Kill it (it holds nothing), reap it and close its channel."""
        self.kill()
        await self.exited.wait()
        self.kill()  # spawned after the first kill
        if self.process is not None and self.process.returncode is None:
            await self.process.wait()
        if self.channel is not None:
            self.channel.close()

    async def _run(self, launch) -> None:
        try:
            self.channel, self.process = await launch
        except WorkerStartError as exc:
            logger.error("cannot start a standby engine worker: %s", exc)
            self.exited.set()
            return
        logger.info("started standby engine worker pid %d (epoch %d)", self.process.pid, self.channel.epoch)
        self._receive_task = asyncio.create_task(self._receive())
        returncode = await self.process.wait()
        self._receive_task.cancel()
        self.exited.set()
        if not self.is_detached:
            logger.warning("the standby engine worker (pid %d, epoch %d) exited with status %d while it waited",
                           self.process.pid, self.channel.epoch, returncode)

    async def _receive(self) -> None:
        while True:
            msg = self.channel.accept(await self.channel.output.recv_multipart(copy=False))
            if isinstance(msg, Ready):
                self.info = msg
                self._got_ready.set()


def resolve_worker_sharing(device: str, model_dir: str, standby_workers: int | None,
                           shared_kv_cache: bool | None) -> tuple[int, bool, str]:
    """The standby count and whether the KV cache is shared, the defaults (None) made concrete; and why, for the
    log. Both default to on where the worker will run on the CPU (device cpu, or auto on a machine with no NVIDIA
    device), the standby only when the memory available holds a second worker (twice the checkpoint's weights,
    packed copy and all, and a margin)."""
    on_cpu = device == "cpu" or (device == "auto" and not os.path.exists(_NVIDIA_DEVICE))
    shared = on_cpu and SEGMENT_DIR.is_dir() if shared_kv_cache is None else shared_kv_cache
    if standby_workers is not None:
        return standby_workers, shared, "as asked"
    if not on_cpu:
        return 0, shared, "off by default on CUDA (--standby-workers 1 to have one)"
    needed = 2 * _checkpoint_bytes(Path(model_dir)) + _STANDBY_MARGIN_BYTES
    available = available_memory()
    if available is not None and available < needed:
        return 0, shared, f"off: {available >> 20} MiB of memory available, a standby needs about {needed >> 20} MiB"
    return 1, shared, "on by default on the CPU"


def available_memory() -> int | None:
    """Bytes this process could still allocate: MemAvailable, capped by the cgroup's memory.max; None unknown."""
    available = None
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    with contextlib.suppress(OSError, ValueError):
        limit, used = (Path("/sys/fs/cgroup", name).read_text().strip() for name in ("memory.max", "memory.current"))
        if limit != "max":
            room = int(limit) - int(used)
            available = room if available is None else min(available, room)
    return available


def _checkpoint_bytes(model_dir: Path) -> int:
    return sum(path.stat().st_size for path in model_dir.glob("*.safetensors"))
