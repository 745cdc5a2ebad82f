"""The worker's compute threads on a CPU of four or more, when none were asked for: the fastest of a few counts,
timed on the model at start-up.

Why measure: every parallel region of a step ends with its threads waiting
for each other, so a step of a small model, whose regions each hold a few
microseconds of work, can get slower with more threads while a large
model's matrix products still get faster. On a 16-core Xeon (BENCHMARKS.md)
the 4-layer model's offline run took 5.5 s on 16 threads and 1.8 s on 8,
and through HTTP 16 threads served 0.19x the tokens of 8, while the
machine's matrix products ran twice as fast on 16. Which count wins depends
on the model and the machine, so it is timed: a decode step of up to 16
sequences plus a 64-token prefill, at every count from all the CPUs down
to a quarter of them, alternating rounds, the best time of each count; a
count slower than one above it ends the descent, so that a large model,
which wants every thread, pays for timing two counts, not all. A
smaller count is taken only where it is at least TIE_MARGIN faster, so
that timing noise alone never takes threads away.

Two or three CPUs keep all of them: there the frontend's share is small
and one thread lost is a third or half of the arithmetic (on two cores one
thread served 0.94x the tokens of two through HTTP, BENCHMARKS.md#threads).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker.engine.step_calibration import calibration_steps, measure_steps
from gpu_worker.runner.model_runner import ModelRunner
from gpu_worker.sampling.sampler import Sampler

MIN_CPUS = 4  # fewer CPUs than this keep them all
HALVINGS = 2  # counts tried below the CPUs: 16 -> 16, 8, 4
TIE_MARGIN = 0.05  # a smaller count must be this much faster than the count chosen above it
ROUNDS = 2
DECODE_SEQS, DECODE_CONTEXT, PREFILL_TOKENS = 16, 128, 64


@dataclass(slots=True, frozen=True)
class ThreadChoice:
    threads: int
    seconds: dict[int, float]  # each count tried: its best time of the measured steps, summed

    def describe(self) -> str:
        times = ", ".join(f"{count}: {seconds * 1000:.1f} ms" for count, seconds in self.seconds.items())
        return f"{self.threads} compute threads, the fastest of ({times})"


def candidate_counts(cpus: int) -> list[int]:
    """The thread counts tried on `cpus` CPUs, most first: [cpus] below MIN_CPUS, else it and its halvings."""
    if cpus < MIN_CPUS:
        return [cpus]
    return sorted({max(1, cpus >> halving) for halving in range(HALVINGS + 1)}, reverse=True)


def choose_threads(runner: ModelRunner, sampler: Sampler, counts: list[int], max_num_batched_tokens: int,
                   max_num_seqs: int, max_model_len: int) -> ThreadChoice:
    """Time the model's steps at each of `counts` (most first), each step cut to the engine's limits, and leave
    torch at the count chosen."""
    context = min(DECODE_CONTEXT, max_model_len - 1)
    steps = [[(context, 1)] * min(DECODE_SEQS, max_num_seqs),
             [(0, min(PREFILL_TOKENS, max_num_batched_tokens, max_model_len))]]
    steps = calibration_steps(runner.num_kv_blocks, runner.block_size, max_num_batched_tokens, max_num_seqs,
                              max_model_len, steps) or [[(0, 1)]]
    best: dict[int, float] = {}
    for _ in range(ROUNDS):
        for count in counts:
            torch.set_num_threads(count)
            seconds = sum(time for _, time in measure_steps(runner, sampler, steps))
            best[count] = min(seconds, best.get(count, seconds))
            if count != counts[0] and seconds > min(best.values()) * (1 + TIE_MARGIN):
                break  # halving made it slower: halving again is not timed
        counts = [count for count in counts if count in best]
    chosen = fastest(counts, best)
    torch.set_num_threads(chosen)
    return ThreadChoice(chosen, best)


def fastest(counts: list[int], seconds: dict[int, float]) -> int:
    """The count of `counts` (most first) with the least seconds, a smaller count only where it is at least
    TIE_MARGIN faster than the count chosen so far."""
    chosen = counts[0]
    for count in counts[1:]:
        if seconds[count] < seconds[chosen] * (1 - TIE_MARGIN):
            chosen = count
    return chosen
