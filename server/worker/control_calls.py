"""WorkerControl: the operator's calls to the worker in service, each a message sent and an answer awaited.

Profiling: start_profile() sends StartProfile; stop_profile() sends
StopProfile and awaits the worker's ProfileResult, in a ProfileSession
(server/worker/profiling.py). reset_prefix_cache() sends ResetPrefixCache and
awaits its PrefixCacheReset (server/worker/prefix_cache_resets.py). A
worker's exit ends both waits (lose()), so that no call waits on a dead
worker. Must not know the worker's process or sockets: `send` sends, the
EngineClient routes the answers here (finish()).
"""

from __future__ import annotations

from collections.abc import Callable

from server.worker.prefix_cache_resets import PrefixCacheResets
from server.worker.process import WorkerState
from server.worker.profiling import ProfileSession
from shared.protocol import (
    Message,
    PrefixCacheReset,
    ProfileResult,
    ResetPrefixCache,
    StartProfile,
    StopProfile,
)


class WorkerControl:
    def __init__(self, send: Callable[[Message], None], worker_state: Callable[[], tuple[WorkerState, int]]) -> None:
        self._send = send
        self._worker_state = worker_state  # the worker's state and epoch, now
        self.profile = ProfileSession()
        self.prefix_cache_resets = PrefixCacheResets()

    def start_profile(self) -> None:
        """Have the ready worker profile its steps. ProfileConflict when it already does."""
        epoch = self._ready_epoch("start profiling")
        self.profile.start(epoch)
        self._send(StartProfile())

    async def stop_profile(self, profile_dir: str) -> ProfileResult:
        """Stop the worker's profiler and wait for its ProfileResult (written into profile_dir, an absolute path).
        ProfileConflict when it is not profiling or exits first; ProfileTimeout when it does not answer."""
        result = self.profile.stop()
        self._send(StopProfile(profile_dir))
        return await self.profile.wait(result)

    async def reset_prefix_cache(self) -> PrefixCacheReset:
        """Have the ready worker forget every cached prefix, and wait until it has. ResetLost when it exits
        first; ResetTimeout when it does not answer."""
        self._ready_epoch("reset the prefix cache")
        answer = self.prefix_cache_resets.expect()
        self._send(ResetPrefixCache())
        return await self.prefix_cache_resets.wait(answer)

    def finish(self, answer: ProfileResult | PrefixCacheReset) -> None:
        """A worker's answer to one of the calls."""
        if isinstance(answer, ProfileResult):
            self.profile.finish(answer)
        else:
            self.prefix_cache_resets.finish(answer)

    def lose(self, description: str) -> None:
        """The worker exited: every call waiting on it fails, saying why."""
        self.profile.lose(description)
        self.prefix_cache_resets.lose(description)

    def _ready_epoch(self, what: str) -> int:
        state, epoch = self._worker_state()
        if state is not WorkerState.READY:
            raise RuntimeError(f"cannot {what}: the engine worker is {state.name}, not READY")
        return epoch
