"""PrefixCacheResets: answers go to the resets in the order they were sent; a worker's exit fails the rest.

The happy path through a real server and worker is in test_vllm_endpoints.py.
"""

from __future__ import annotations

import asyncio

import pytest

from server.worker.prefix_cache_resets import PrefixCacheResets, ResetLost, ResetTimeout
from shared.protocol import PrefixCacheReset

SECRET = "0123456789abcdef0123456789abcdef"


def answer(num_freed_blocks: int) -> PrefixCacheReset:
    return PrefixCacheReset(epoch=1, secret=SECRET, num_freed_blocks=num_freed_blocks)


def test_answers_go_in_order_and_an_exit_fails_the_rest():
    async def scenario() -> None:
        resets = PrefixCacheResets()
        first, second, third = resets.expect(), resets.expect(), resets.expect()
        resets.finish(answer(3))
        assert (await resets.wait(first)).num_freed_blocks == 3
        resets.lose("exit code -9")
        for waiting in (second, third):
            with pytest.raises(ResetLost, match="exit code -9"):
                await resets.wait(waiting)
        resets.finish(answer(0))  # a late answer no one waits for is dropped

    asyncio.run(scenario())


def test_a_reset_that_times_out_keeps_its_place_for_the_late_answer():
    async def scenario() -> None:
        resets = PrefixCacheResets()
        late = resets.expect()
        with pytest.raises(ResetTimeout):
            await resets.wait(late, timeout=0.01)
        following = resets.expect()
        resets.finish(answer(1))  # the late answer to the first: not the following reset's
        resets.finish(answer(2))
        assert (await resets.wait(following)).num_freed_blocks == 2

    asyncio.run(scenario())
