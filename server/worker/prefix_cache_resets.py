"""PrefixCacheResets: the POST /reset_prefix_cache requests waiting for the worker to answer.

Owns one future per ResetPrefixCache sent, in the order they were sent: the
worker answers each with one PrefixCacheReset, in the same order (one socket
each way keeps it), so the oldest waiting future takes the next answer. A
worker that exits answers none of them: they fail with ResetLost, and the
worker that replaces it starts with an empty cache anyway.
Must not know: HTTP (the router turns ResetLost and ResetTimeout into 503 and
504), sockets and the wire (EngineClient sends the messages and routes the
answers here).
"""

from __future__ import annotations

import asyncio
import collections
import logging

from shared.protocol import PrefixCacheReset

RESET_TIMEOUT_S = 30.0  # the worker answers between two steps; a step takes well under a second

logger = logging.getLogger("pagedserve.engine_client")


class ResetLost(Exception):
    """The worker exited before it answered the reset."""


class ResetTimeout(Exception):
    """The worker did not answer the reset in time."""


class PrefixCacheResets:
    def __init__(self) -> None:
        self._waiting: collections.deque[asyncio.Future[PrefixCacheReset]] = collections.deque()

    def expect(self) -> asyncio.Future[PrefixCacheReset]:
        """The future the answer to a ResetPrefixCache about to be sent will complete."""
        answer = asyncio.get_running_loop().create_future()
        self._waiting.append(answer)
        return answer

    async def wait(self, answer: asyncio.Future[PrefixCacheReset],
                   timeout: float = RESET_TIMEOUT_S) -> PrefixCacheReset:
        """The worker's answer, or ResetLost when it exits first, or ResetTimeout."""
        try:
            return await asyncio.wait_for(asyncio.shield(answer), timeout)
        except asyncio.TimeoutError:
            answer.cancel()  # it keeps its place: the late answer still goes to it, and is dropped
            raise ResetTimeout(f"the engine worker did not answer /reset_prefix_cache within {timeout:g} s") from None

    def finish(self, reset: PrefixCacheReset) -> None:
        """The worker's next answer: the oldest waiting reset gets it."""
        if not self._waiting:
            logger.warning("dropped a prefix cache reset that no request waits for")
            return
        answer = self._waiting.popleft()
        if not answer.done():
            answer.set_result(reset)

    def lose(self, description: str) -> None:
        """The worker exited: no reset sent to it will be answered."""
        waiting, self._waiting = self._waiting, collections.deque()
        for answer in waiting:
            if not answer.done():
                answer.set_exception(ResetLost(f"the engine worker exited before it reset its prefix cache "
                                               f"({description})"))
                answer.exception()  # retrieved: only a reset still waiting would have read it
