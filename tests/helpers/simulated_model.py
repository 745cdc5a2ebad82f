"""The scheduler driven without a model, on plain token ids: a toy model and the paged cache it reads through.

    from helpers.simulated_model import SimulatedCache, make_seq, reference_output, run_step
    cache = SimulatedCache(block_size)
    scheduler.add(make_seq("a", prompt, max_tokens))
    finished = run_step(scheduler, cache)  # also checks every block's reference count
    assert finished[0].output_token_ids == reference_output(prompt, max_tokens)

The toy model writes each computed token into a simulated paged cache (one
entry per slot) and, when a sequence samples, reads the sequence's whole
context back through its block table: a wrong slot, a block wrongly shared
by two live sequences or a stale block after preemption shows up as a
context that differs from the sequence's tokens. The next token is a pure
function of the context, so a batched run must equal reference_output, a
one-request-at-a-time loop.
"""

from __future__ import annotations

from gpu_worker.scheduling.scheduler import Scheduler
from gpu_worker.scheduling.scheduler_output import SchedulerOutput
from gpu_worker.sequence import Sequence
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
        self.slots: dict[int, tuple[int, int]] = {}

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
    finished = advance_all(scheduler, output, sampled)
    check_block_accounting(scheduler)
    assert len(scheduler.running) <= scheduler.max_num_seqs
    return finished



def advance_all(scheduler: Scheduler, output: SchedulerOutput, sampled_token_ids: list[int]) -> list[Sequence]:
    """Advance every scheduled sequence past the step, as the engine does, one sampled token per sampling
    sequence in order; the sequences that finished."""
    sampled = iter(sampled_token_ids)
    return [scheduled.seq for scheduled in output.scheduled
            if scheduler.advance(scheduled, next(sampled) if scheduled.is_sampling else None, (EOS,))]


def make_seq(request_id: str, prompt: list[int], max_tokens: int, priority: int = 0, arrival: int = 0) -> Sequence:
    return Sequence(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0), seed=0,
                    priority=priority, arrival_order=arrival)
