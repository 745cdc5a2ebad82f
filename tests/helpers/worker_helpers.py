"""Helpers of the tests that run a real worker process behind an EngineClient (tests/conftest.py has their
fixtures): the tiny engine's settings, requests, and bounds on every wait (helpers/waiting.py waits).

    from helpers.worker_helpers import START_TIMEOUT_S, greedy, module_loop, run_to_end
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from server.worker.request_state import RequestState
from shared.config import EngineConfig
from shared.sampling_params import SamplingParams

MAX_MODEL_LEN = 96
START_TIMEOUT_S = 60.0
WAIT_S = 20.0  # bound on any one wait, so a broken worker fails the test instead of hanging it
module_loop = pytest.mark.asyncio(loop_scope="module")


def tiny_engine_config(checkpoint: Path) -> EngineConfig:
    """The engine settings of the tests with a real worker, on a tiny checkpoint (tests/conftest.py's)."""
    return EngineConfig(model=str(checkpoint), dtype="float32", block_size=4, num_kv_blocks=128,
                        max_num_batched_tokens=32, max_num_seqs=8, max_model_len=MAX_MODEL_LEN)


def greedy(request_id: str, prompt: list[int], max_tokens: int, **params) -> RequestState:
    return RequestState(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, **params))


async def run_to_end(state: RequestState) -> int:
    """Wait until the request ends; returns how many updates delivered tokens."""
    num_updates = 0
    while not state.is_finished:
        seen = len(state.output_token_ids)
        await asyncio.wait_for(state.wait_for_update(), WAIT_S)
        num_updates += len(state.output_token_ids) > seen
    return num_updates
