"""BlockManager.audit_idle: at idle every block is free or parked in the prefix cache; a leaked one is named."""

from __future__ import annotations

import pytest

from gpu_worker.kv.block_manager import BlockManager
from gpu_worker.sequence import Sequence
from shared.sampling_params import SamplingParams

BLOCK_SIZE = 4


def sequence(request_id: str, num_tokens: int) -> Sequence:
    return Sequence(request_id, list(range(10, 10 + num_tokens)), SamplingParams(max_tokens=4), seed=0)


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_an_idle_pool_whose_sequences_were_freed_passes(enable_prefix_caching):
    blocks = BlockManager(8, BLOCK_SIZE, enable_prefix_caching)
    assert blocks.audit_idle() is None
    for i in range(3):
        seq = sequence(f"r{i}", 9)
        blocks.allocate(seq, 9)
        blocks.free(seq)
    assert blocks.audit_idle() is None


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_a_block_held_by_no_live_sequence_fails_the_audit_and_is_named(enable_prefix_caching):
    blocks = BlockManager(8, BLOCK_SIZE, enable_prefix_caching)
    kept, leaked = sequence("kept", 5), sequence("leaked", 1)
    blocks.allocate(kept, 5)
    blocks.allocate(leaked, 1)
    blocks.free(kept)  # "leaked" is never freed
    problem = blocks.audit_idle()
    assert problem is not None
    assert f"7 free; 1 still referenced (ids [{leaked.block_table[0]}])" in problem
