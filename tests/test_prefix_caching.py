"""Automatic prefix caching: shared blocks change no output, counters add up, eviction is LRU.

Scheduler-level tests run on plain token ids through the simulated paged
cache of helpers/simulated_model.py (a wrongly shared or stale block reads back the
wrong context); engine-level tests compare outputs with caching on and off
on a real (tiny, sharpened) model.
"""

from __future__ import annotations

import random

import pytest

from gpu_worker.engine.engine import Engine
from gpu_worker.engine.generate import generate
from gpu_worker.kv.block_manager import BlockManager
from gpu_worker.scheduling.scheduler import Scheduler
from shared.config import EngineConfig
from shared.sampling_params import SamplingParams

from helpers.simulated_model import SimulatedCache, make_seq, reference_output, run_step

BLOCK_SIZE = 4


def make_scheduler(num_blocks: int = 64, budget: int = 64) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BLOCK_SIZE), max_num_batched_tokens=budget, max_num_seqs=16,
                     max_model_len=128)


def run_all(scheduler: Scheduler, cache: SimulatedCache) -> dict[str, list[int]]:
    finished = {}
    while scheduler.has_work():
        finished.update({seq.request_id: seq.output_token_ids for seq in run_step(scheduler, cache)})
    return finished


def test_hit_counters_match_a_hand_computed_script():
    scheduler, cache = make_scheduler(), SimulatedCache(BLOCK_SIZE)
    manager = scheduler.block_manager
    prompt = list(range(10, 20))  # 10 tokens: blocks [10..13] [14..17] and a partial [18, 19]
    scheduler.add(make_seq("a", prompt, 3))
    run_all(scheduler, cache)
    # a computed positions 0..11 (prompt + two of its three outputs): blocks 0, 1, 2 are full and cached.
    assert (manager.num_prefix_query_tokens, manager.num_prefix_hit_tokens) == (10, 0)
    assert manager.prefix_cache.num_cached_blocks == 3

    scheduler.add(make_seq("b", prompt[:8] + [7, 7], 2, arrival=1))  # shares blocks 0 and 1
    scheduler.add(make_seq("c", prompt, 2, arrival=2))  # could reuse 9 tokens, but the last is always computed
    scheduler.add(make_seq("d", prompt[:8], 2, arrival=3))  # 8 tokens: only block 0 may come from the cache
    scheduler.add(make_seq("e", [5] + prompt[1:8], 2, arrival=4))  # first block differs: nothing chains
    outputs = run_all(scheduler, cache)
    assert manager.num_prefix_query_tokens == 10 + 10 + 10 + 8 + 8
    assert manager.num_prefix_hit_tokens == 8 + 8 + 4 + 0
    for request_id, prompt_used in [("b", prompt[:8] + [7, 7]), ("c", prompt), ("d", prompt[:8])]:
        assert outputs[request_id] == reference_output(prompt_used, 2)
    assert manager.num_free_blocks == manager.num_blocks
    assert all(manager.ref_count(b) == 0 for b in range(manager.num_blocks))


def test_requests_admitted_together_share_the_prompt_blocks():
    scheduler = make_scheduler()
    prompt = list(range(30, 47))  # 17 tokens: 4 full blocks
    seqs = [make_seq(f"n{i}", prompt, 4, arrival=i) for i in range(4)]
    for seq in seqs:
        scheduler.add(seq)
    run_step(scheduler, SimulatedCache(BLOCK_SIZE))
    first_blocks = [seq.block_table[:4] for seq in seqs]
    assert all(blocks == first_blocks[0] for blocks in first_blocks), "n copies should share the prompt's blocks"
    assert all(scheduler.block_manager.ref_count(b) == 4 for b in first_blocks[0])
    assert len({seq.block_table[4] for seq in seqs}) == 4, "each copy writes its own partial last block"


def test_batched_shared_prefix_run_matches_one_at_a_time_with_preemption():
    rng = random.Random(3)
    system_prompt = [rng.randrange(1, 1000) for _ in range(13)]
    scheduler, cache = make_scheduler(num_blocks=30, budget=16), SimulatedCache(BLOCK_SIZE)
    requests = {f"r{i}": (system_prompt + [rng.randrange(1, 1000) for _ in range(rng.randint(1, 9))],
                          rng.randint(1, 20)) for i in range(20)}
    for i, (request_id, (prompt, max_tokens)) in enumerate(requests.items()):
        scheduler.add(make_seq(request_id, prompt, max_tokens, priority=i % 2, arrival=i))
    outputs = run_all(scheduler, cache)
    assert scheduler.num_preemptions > 0 and scheduler.block_manager.num_prefix_hit_tokens > 0
    for request_id, (prompt, max_tokens) in requests.items():
        assert outputs[request_id] == reference_output(prompt, max_tokens)


def test_eviction_takes_least_recently_used_cached_blocks_first():
    manager = BlockManager(num_blocks=6, block_size=BLOCK_SIZE)
    old, new = make_seq("old", list(range(1, 9)), 1), make_seq("new", list(range(50, 58)), 1)
    for seq in (old, new):  # each caches two full blocks, then lets them go: old's are the least recent
        manager.allocate(seq, seq.num_tokens)
        manager.free(seq)
    filler = make_seq("filler", list(range(100, 116)), 1)
    manager.allocate(filler, 8)  # the two never-used blocks go first: every cached block survives
    assert [hits_for(manager, p) for p in (range(1, 9), range(50, 58))] == [2, 2]
    filler.num_computed_tokens = 8
    manager.allocate(filler, 8)  # two more: the least recently used cached blocks, old's, are evicted
    assert [hits_for(manager, p) for p in (range(1, 9), range(50, 58))] == [0, 2]


def hits_for(manager: BlockManager, prompt: range) -> int:
    """Blocks a new request with `prompt` (plus one token) would take from the cache; leaves no trace."""
    probe = make_seq("probe", list(prompt) + [0], 1)
    manager.acquire_cached_prefix(probe)
    hits = len(probe.block_table)
    manager.free(probe)
    return hits


def test_reset_frees_parked_blocks_and_keeps_running_ones():
    manager = BlockManager(num_blocks=8, block_size=BLOCK_SIZE)
    done, running = make_seq("done", list(range(1, 9)), 1), make_seq("running", list(range(50, 58)), 1)
    for seq in (done, running):
        manager.allocate(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens
    manager.free(done)  # its two full blocks are parked
    running_blocks = list(running.block_table)
    assert manager.reset_prefix_cache() == 2
    assert manager.prefix_cache.num_cached_blocks == 0 and manager.prefix_cache.num_evictable == 0
    assert [hits_for(manager, p) for p in (range(1, 9), range(50, 58))] == [0, 0]
    assert running.block_table == running_blocks and all(manager.ref_count(b) == 1 for b in running_blocks)
    assert manager.num_free_blocks == 8 - 2
    manager.free(running)  # its blocks are no longer cached: they go back to the free queue, not the cache
    assert manager.num_free_blocks == 8 and manager.prefix_cache.num_evictable == 0
    again = make_seq("again", list(range(1, 9)), 1)
    manager.allocate(again, again.num_tokens)  # caching goes on after a reset
    assert manager.prefix_cache.num_cached_blocks == 2


def test_caching_off_shares_nothing():
    scheduler = Scheduler(BlockManager(64, BLOCK_SIZE, enable_prefix_caching=False), 64, 16, 128)
    cache = SimulatedCache(BLOCK_SIZE)
    for i in range(3):
        scheduler.add(make_seq(f"s{i}", list(range(1, 14)), 2, arrival=i))
    run_all(scheduler, cache)
    assert scheduler.block_manager.num_prefix_hit_tokens == 0


def engine_pair(checkpoint, **overrides) -> tuple[Engine, Engine]:
    settings = {**dict(model=str(checkpoint), dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=200,
                       max_num_batched_tokens=48, max_num_seqs=16), **overrides}
    return (Engine(EngineConfig(**settings, enable_prefix_caching=True)),
            Engine(EngineConfig(**settings, enable_prefix_caching=False)))


def shared_prefix_cases(vocab_size: int) -> dict[str, list[list[int]]]:
    rng = random.Random(11)
    tokens = lambda n: [rng.randrange(3, vocab_size) for _ in range(n)]  # noqa: E731
    system = tokens(21)
    turn1, reply1, turn2, reply2, turn3 = tokens(7), tokens(9), tokens(5), tokens(6), tokens(8)
    base = tokens(15)
    return {
        "system prompt x32": [system + tokens(rng.randint(1, 12)) for _ in range(32)],
        "multi-turn chat": [system + turn1, system + turn1 + reply1 + turn2,
                            system + turn1 + reply1 + turn2 + reply2 + turn3],
        "n=4": [base] * 4,
        "differ in the last token": [base + [t] for t in (3, 4, 5, 6)],
        "exact multiples of the block size": [base[:12], base[:12] + tokens(4), base[:8]],
    }


@pytest.mark.parametrize("case", ["system prompt x32", "multi-turn chat", "n=4", "differ in the last token",
                                  "exact multiples of the block size"])
def test_outputs_equal_with_caching_on_and_off(checkpoint, case):
    cached, uncached = engine_pair(checkpoint)
    prompts = shared_prefix_cases(cached.runner.model_config.vocab_size)[case]
    params = [SamplingParams(max_tokens=12, temperature=0) if i % 2 else
              SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    # Twice through the cached engine: the second pass finds everything of the first in the cache.
    for _ in range(2):
        assert [c.token_ids for c in generate(cached, prompts, params)] == \
               [c.token_ids for c in generate(uncached, prompts, params)]
    manager = cached.block_manager
    assert manager.num_prefix_hit_tokens > 0
    assert manager.num_free_blocks == manager.num_blocks
    assert all(manager.ref_count(b) == 0 for b in range(manager.num_blocks))


def test_small_pool_evicts_and_stays_correct(checkpoint):
    cached, uncached = engine_pair(checkpoint, num_kv_blocks=24, max_num_batched_tokens=16)
    prompts = shared_prefix_cases(cached.runner.model_config.vocab_size)["system prompt x32"][:12]
    params = SamplingParams(max_tokens=10, temperature=0)
    assert [c.token_ids for c in generate(cached, prompts, params)] == \
           [c.token_ids for c in generate(uncached, prompts, params)]
    assert cached.block_manager.num_prefix_hit_tokens > 0 and cached.block_manager.prefix_cache.num_evictions > 0
    assert cached.block_manager.num_free_blocks == cached.block_manager.num_blocks


def test_a_decode_the_block_manager_lets_pass_is_one_allocate_would_do_nothing_for():
    """fits_next_token, the scheduler's shortcut for most decodes, holds exactly when allocate would take no block
    and cache none: checked token by token across block edges, against allocate run on a twin sequence."""
    shortcut, full = BlockManager(16, 4), BlockManager(16, 4)
    seq, twin = make_seq("a", list(range(3, 9)), 30), make_seq("b", list(range(3, 9)), 30)
    for manager, sequence in ((shortcut, seq), (full, twin)):
        manager.allocate(sequence, 6)
        sequence.num_computed_tokens = 6
    for token in range(20):
        fits = shortcut.fits_next_token(seq)
        free_before, cached_before = full.num_free_blocks, full.prefix_cache.num_cached_blocks
        full.allocate(twin, 1)
        assert fits == (full.num_free_blocks == free_before
                        and full.prefix_cache.num_cached_blocks == cached_before), token
        if not fits:
            shortcut.allocate(seq, 1)
        for sequence in (seq, twin):
            sequence.output_token_ids.append(100 + token)
            sequence.num_computed_tokens += 1
    assert seq.block_table == twin.block_table
