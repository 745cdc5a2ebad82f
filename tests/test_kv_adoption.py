"""Adopting a dead worker's KV blocks: the BlockManager's serial checks and free-block accounting, the engine's
outputs when a request resumes on adopted blocks, and the segment file's life (server/worker/kv_segment.py).

The engine test runs two engines on one shared segment, one after the other, as two workers would: the first
generates part of each request, the second is handed what the first reported and must produce exactly the
tokens an uninterrupted run produces, in bfloat16, where recomputing the KV in one batched pass may not."""

from __future__ import annotations

import fcntl
import os

import numpy as np
import pytest

from gpu_worker.engine.engine import Engine
from gpu_worker.engine.generate import generate
from gpu_worker.kv.block_manager import BlockManager
from server.worker.kv_segment import SEGMENT_PREFIX, KVSegmentFile, remove_stale_segments
from shared.config import EngineConfig
from shared.default_model import DEFAULT_MODEL_DIR
from shared.kv_hold import KVHold
from shared.sampling_params import SamplingParams

from helpers.simulated_model import make_seq

BLOCK_SIZE = 4


def manager_with_segment_serials(num_blocks: int = 16) -> BlockManager:
    return BlockManager(num_blocks, BLOCK_SIZE, serials=np.zeros(num_blocks, dtype=np.int64))


def reported(manager: BlockManager, seq) -> KVHold:
    ids = np.array(seq.block_table, dtype=np.int32)
    return KVHold(ids, manager.serials[ids].copy(), seq.num_computed_tokens)


def held_by_a_dead_worker(num_tokens: int = 10) -> tuple[np.ndarray, KVHold, list[int]]:
    """A worker's block manager runs one sequence of num_tokens (all computed but the last): the segment's
    serials, the sequence's hold, and its tokens."""
    dead = manager_with_segment_serials()
    tokens = list(range(1, num_tokens + 1))
    seq = make_seq("a", tokens, max_tokens=8)
    dead.allocate(seq, num_tokens - 1)
    seq.num_computed_tokens = num_tokens - 1
    return dead.serials, reported(dead, seq), tokens


def test_blocks_that_kept_their_serials_are_adopted_and_counted_in_use():
    serials, hold, tokens = held_by_a_dead_worker()
    manager = BlockManager(16, BLOCK_SIZE, serials=serials)
    seq = make_seq("a", tokens, max_tokens=8)
    assert manager.adopt(seq, hold.block_ids, hold.serials, hold.num_computed)
    assert seq.block_table == hold.block_ids.tolist() and seq.num_computed_tokens == 9
    assert manager.num_free_blocks == 16 - 3
    other = make_seq("b", [7] * 20, max_tokens=1)
    manager.allocate(other, 20)
    assert not set(other.block_table) & set(seq.block_table), "an adopted block was handed out again"
    assert manager.serials[other.block_table].min() > hold.serials.max(), "serials never repeat"
    manager.free(seq)
    manager.free(other)
    assert manager.num_free_blocks == 16


def test_a_block_reallocated_after_the_report_refuses_the_adoption():
    serials, hold, tokens = held_by_a_dead_worker()
    serials[hold.block_ids[1]] += 100  # the dead worker gave the block to someone else in a step never reported
    manager = BlockManager(16, BLOCK_SIZE, serials=serials)
    seq = make_seq("a", tokens, max_tokens=8)
    assert not manager.adopt(seq, hold.block_ids, hold.serials, hold.num_computed)
    assert seq.block_table == [] and seq.num_computed_tokens == 0 and manager.num_free_blocks == 16


@pytest.mark.parametrize("case", ["private cache", "out of range", "too few blocks", "nothing computed"])
def test_holds_that_cannot_be_trusted_are_refused(case):
    serials, hold, tokens = held_by_a_dead_worker()
    manager = BlockManager(16, BLOCK_SIZE, serials=None if case == "private cache" else serials)
    block_ids, num_computed = hold.block_ids.copy(), hold.num_computed
    if case == "out of range":
        block_ids[0] = 16
    elif case == "too few blocks":
        block_ids, num_computed = block_ids[:2], 9
    elif case == "nothing computed":
        num_computed = 0
    assert not manager.adopt(make_seq("a", tokens, max_tokens=8), block_ids, hold.serials[:len(block_ids)],
                             num_computed)


def test_a_block_two_requests_shared_is_adopted_by_both():
    serials, hold, tokens = held_by_a_dead_worker()
    manager = BlockManager(16, BLOCK_SIZE, serials=serials)
    first, second = make_seq("a", tokens, max_tokens=8), make_seq("b", tokens[:8] + [99], max_tokens=8)
    assert manager.adopt(first, hold.block_ids, hold.serials, 9)
    assert manager.adopt(second, hold.block_ids[:2], hold.serials[:2], 8)
    assert manager.ref_count(int(hold.block_ids[0])) == 2 and manager.num_free_blocks == 16 - 3
    manager.free(first)
    assert manager.num_free_blocks == 16 - 2
    manager.free(second)
    assert manager.num_free_blocks == 16


def test_a_second_engine_on_the_segment_resumes_with_the_uninterrupted_tokens(tmp_path):
    """The default model in its bfloat16: 16 requests, half greedy and half sampled, interrupted after 100 steps.
    (Resumed by recomputing instead, one of the 16 diverged on the machine this was written on.)"""
    config = EngineConfig(model=str(DEFAULT_MODEL_DIR), device="cpu", num_kv_blocks=512)
    prompts = [[5 + i, 20 + i, 30 + 2 * i] for i in range(16)]
    params = [SamplingParams(max_tokens=200, temperature=0.8 * (i % 2), seed=i, ignore_eos=True) for i in range(16)]
    path = tmp_path / "segment"
    path.touch()
    # A cold engine of its own: a prefix cache warmed by this run would change how the prompts are computed.
    expected = [out.token_ids for out in generate(Engine(config), prompts, params)]
    first = Engine(config)
    first.use_kv_segment(path)
    request_ids = [f"r{i}" for i in range(16)]
    for request_id, prompt, request_params in zip(request_ids, prompts, params):
        first.add_request(request_id, prompt, request_params)
    holds: dict[str, KVHold | None] = dict.fromkeys(request_ids)
    outputs: dict[str, list[int]] = {request_id: [] for request_id in request_ids}
    for _ in range(100):  # the "worker" dies after 100 steps, its reports received
        scheduled = first.schedule()
        for out in first.run(scheduled):
            outputs[out.request_id] += out.new_token_ids.tolist()
        for progress in first.kv_progress(scheduled):
            holds[progress.request_id] = progress.apply_to(holds[progress.request_id])
    del first
    second = Engine(config)
    second.use_kv_segment(path)
    for request_id, prompt, request_params in zip(request_ids, prompts, params):
        done = outputs[request_id]
        resumed = SamplingParams(max_tokens=200 - len(done), temperature=request_params.temperature,
                                 seed=request_params.seed, ignore_eos=True)
        num_adopted = second.add_request(request_id, prompt, resumed, output_token_ids=done, kv=holds[request_id])
        assert num_adopted == len(prompt) + len(done) - 1, "every position the dead engine computed is adopted"
    while second.has_work():
        for out in second.step():
            outputs[out.request_id] += out.new_token_ids.tolist()
    assert [outputs[request_id] for request_id in request_ids] == expected


def test_a_segment_lives_while_its_server_holds_it_and_a_stale_one_is_removed(tmp_path):
    live = KVSegmentFile.create(tmp_path)
    assert live.path.name.startswith(f"{SEGMENT_PREFIX}{os.getpid()}-") and live.path.stat().st_mode & 0o777 == 0o600
    stale = tmp_path / f"{SEGMENT_PREFIX}1-deadbeef"
    stale.write_bytes(b"\0" * 4096)  # a SIGKILLed server's: nobody holds its lock
    assert remove_stale_segments(tmp_path) == [stale]
    assert live.path.exists(), "a live server's segment is left alone"
    fd = os.open(live.path, os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    live.remove()
    assert not live.path.exists()
