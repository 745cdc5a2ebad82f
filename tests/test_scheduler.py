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

from gpu_worker.block_manager import BlockManager
from gpu_worker.scheduler import Scheduler, SchedulerOutput
from gpu_worker.sequence import Sequence, SequenceStatus
from shared.sampling_params import SamplingParams

EOS = 0
VOCAB = 1000


def next_token(context: list[int]) -> int:
    value = 7
    for token in context:
        value = (value * 31 + token) % 1_000_003
    return 1 + value % (VOCAB - 1)  # never EOS: lengths are set by max_tokens


def reference_output(prompt: list[int], max_tokens: int) -> list[int]:
    context = list(prompt)
    for _ in range(max_tokens):
        context.append(next_token(context))
    return context[len(prompt):]


class SimulatedCache:
    """slot -> (position, token): what a real KV cache would hold (K/V are a function of both)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[int, tuple[str, int, int]] = {}

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def write(self, seq: Sequence, start: int, end: int) -> None:
        for position in range(start, end):
            self.slots[self.slot(seq, position)] = (position, seq.token_id_at(position))

    def read_context(self, seq: Sequence, length: int) -> list[int]:
        entries = [self.slots[self.slot(seq, p)] for p in range(length)]
        assert all(e[0] == p for p, e in enumerate(entries)), f"{seq.request_id} read a slot of another position"
        return [e[1] for e in entries]


def check_block_accounting(scheduler: Scheduler) -> None:
    """Each block's reference count is its number of holders; a block held twice is a full, cached one."""
    manager = scheduler.block_manager
    holders: dict[int, int] = {}
    for seq in scheduler.running + scheduler.waiting:
        assert len(seq.block_table) * manager.block_size >= seq.num_computed_tokens
        assert len(set(seq.block_table)) == len(seq.block_table)
        for block_id in seq.block_table:
            holders[block_id] = holders.get(block_id, 0) + 1
    for block_id, count in holders.items():
        assert manager.ref_count(block_id) == count, f"block {block_id}: {count} holders"
        if count > 1:
            assert manager.prefix_cache is not None and block_id in manager.prefix_cache.cached_block_ids
    assert manager.num_free_blocks + len(holders) == manager.num_blocks


def run_step(scheduler: Scheduler, cache: SimulatedCache, output: SchedulerOutput | None = None) -> list[Sequence]:
    """Run one step (`output`, else the scheduler's next), check the block accounting; the finished sequences."""
    output = output or scheduler.schedule()
    sampled = []
    for scheduled in output.scheduled:
        seq = scheduled.seq
        start = seq.num_computed_tokens
        cache.write(seq, start, start + scheduled.num_new_tokens)
        if scheduled.is_sampling:
            sampled.append(next_token(cache.read_context(seq, seq.num_tokens)))
    assert output.num_batched_tokens <= scheduler.max_num_batched_tokens
    finished = scheduler.update(output, sampled, (EOS,))
    check_block_accounting(scheduler)
    assert len(scheduler.running) <= scheduler.max_num_seqs
    return finished


def make_seq(request_id: str, prompt: list[int], max_tokens: int, priority: int = 0, arrival: int = 0) -> Sequence:
    return Sequence(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0), seed=0,
                    priority=priority, arrival_order=arrival)


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
    finished = scheduler.update(output, [42, EOS], (EOS,))
    assert [s.request_id for s in finished] == ["s"] and stopper.finish_reason.value == "stop"
    finished = scheduler.update(scheduler.schedule(), [EOS], (EOS,))
    assert ignorer.finish_reason.value == "length" and ignorer.output_token_ids == [EOS, EOS]
