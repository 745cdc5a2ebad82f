"""Scheduler and BlockManager driven without a model, on plain token ids.

A toy "model" writes each computed token into a simulated paged cache (one
entry per slot) and, when a sequence samples, reads the sequence's whole
context back through its block table: a wrong slot, a block wrongly shared
by two live sequences or a stale block after preemption shows up as a
context that differs from the sequence's tokens. The next token is a pure function of the
context, so the batched run must equal a one-request-at-a-time loop.
"""

from __future__ import annotations

import random

import pytest

from gpu_worker.kv.block_manager import BlockManager
from gpu_worker.scheduling.scheduler import Scheduler
from gpu_worker.sequence import Sequence, SequenceStatus
from shared.sampling_params import SamplingParams

from helpers.simulated_model import EOS, VOCAB, SimulatedCache, advance_all, make_seq, reference_output, run_step


@pytest.mark.parametrize("num_blocks", [24, 400])
def test_batched_run_matches_one_at_a_time_with_preemption_and_chunking(num_blocks):
    rng = random.Random(0)
    block_size = 4
    scheduler = Scheduler(BlockManager(num_blocks, block_size), max_num_batched_tokens=24, max_num_seqs=8,
                          max_model_len=96)
    cache = SimulatedCache(block_size)
    requests = {f"r{i}": ([rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 40))], rng.randint(1, 40))
                for i in range(30)}
    pending = list(requests.items())
    done: dict[str, list[int]] = {}
    arrival = 0
    while pending or scheduler.has_work():
        for _ in range(rng.randint(0, 3)):  # new requests join between steps
            if pending:
                request_id, (prompt, max_tokens) = pending.pop(0)
                scheduler.add(make_seq(request_id, prompt, max_tokens, priority=rng.randint(0, 2), arrival=arrival))
                arrival += 1
        for seq in run_step(scheduler, cache):
            assert seq.finish_reason.value == "length"
            done[seq.request_id] = seq.output_token_ids
    for request_id, (prompt, max_tokens) in requests.items():
        assert done[request_id] == reference_output(prompt, max_tokens)
    assert scheduler.block_manager.num_free_blocks == num_blocks
    if num_blocks == 24:
        assert scheduler.num_preemptions > 0, "the small pool was meant to force preemption"


def test_priority_orders_admission_then_arrival():
    scheduler = Scheduler(BlockManager(100, 4), max_num_batched_tokens=8, max_num_seqs=1, max_model_len=64)
    scheduler.add(make_seq("late-urgent", [1, 2], 1, priority=0, arrival=2))
    scheduler.add(make_seq("early-normal", [1, 2], 1, priority=1, arrival=0))
    scheduler.add(make_seq("early-urgent", [1, 2], 1, priority=0, arrival=1))
    order = []
    while scheduler.has_work():
        order += [s.request_id for s in run_step(scheduler, SimulatedCache(4)) if s.is_finished]
    assert order == ["early-urgent", "late-urgent", "early-normal"]


def test_preemption_picks_lowest_priority_latest_arrival_and_resumes():
    block_size = 4
    scheduler = Scheduler(BlockManager(6, block_size), max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64)
    cache = SimulatedCache(block_size)
    scheduler.add(make_seq("a", [5] * 7, 10, priority=0, arrival=0))
    scheduler.add(make_seq("b", [6] * 7, 10, priority=1, arrival=1))
    scheduler.add(make_seq("c", [7] * 3, 10, priority=0, arrival=2))
    run_step(scheduler, cache)  # all three prefill: 2 + 2 + 1 blocks of 6
    preempted = []
    while not preempted:
        output_before = {s.request_id for s in scheduler.waiting}
        run_step(scheduler, cache)
        preempted = [s.request_id for s in scheduler.waiting if s.request_id not in output_before]
    assert preempted == ["b"]
    finished = {}
    while scheduler.has_work():
        finished.update({s.request_id: s.output_token_ids for s in run_step(scheduler, cache)})
    assert finished["b"] == reference_output([6] * 7, 10)


def test_abort_frees_blocks_whether_waiting_or_running():
    scheduler = Scheduler(BlockManager(10, 4), max_num_batched_tokens=8, max_num_seqs=1, max_model_len=64)
    running, waiting = make_seq("run", [1] * 6, 5), make_seq("wait", [2] * 6, 5, arrival=1)
    scheduler.add(running)
    scheduler.add(waiting)
    run_step(scheduler, SimulatedCache(4))
    assert running.status is SequenceStatus.RUNNING and running.block_table
    scheduler.abort(running)
    scheduler.abort(waiting)
    assert running.finish_reason.value == waiting.finish_reason.value == "abort"
    assert scheduler.block_manager.num_free_blocks == 10 and not scheduler.has_work()


def test_request_that_can_never_fit_is_rejected_when_added():
    scheduler = Scheduler(BlockManager(4, 4), max_num_batched_tokens=8, max_num_seqs=4, max_model_len=64)
    with pytest.raises(ValueError, match="cache holds only 4"):
        scheduler.add(make_seq("huge", [1] * 10, 20))
    scheduler.add(make_seq("fits", [1] * 10, 7))  # 16 tokens of context at most: exactly 4 blocks


def test_stop_token_and_eos_finish_with_stop_unless_ignored():
    scheduler = Scheduler(BlockManager(10, 4), max_num_batched_tokens=8, max_num_seqs=4, max_model_len=64)
    stopper = Sequence("s", [1, 2], SamplingParams(max_tokens=5, stop_token_ids=(42,)), seed=0)
    ignorer = Sequence("i", [1, 2], SamplingParams(max_tokens=2, ignore_eos=True), seed=0, arrival_order=1)
    scheduler.add(stopper)
    scheduler.add(ignorer)
    output = scheduler.schedule()
    finished = advance_all(scheduler, output, [42, EOS])
    assert [s.request_id for s in finished] == ["s"] and stopper.finish_reason.value == "stop"
    finished = advance_all(scheduler, scheduler.schedule(), [EOS])
    assert ignorer.finish_reason.value == "length" and ignorer.output_token_ids == [EOS, EOS]
