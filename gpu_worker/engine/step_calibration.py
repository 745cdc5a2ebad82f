"""Calibration: a few steps of known shapes, timed at start-up, for the StepCostModel to start from.

Runs real forward passes and sampling through the ModelRunner on made-up
sequences, with a BlockManager of its own over the same, still empty, KV
pool (whose blocks it writes and gives back), so that neither the engine's
scheduler nor its prefix cache ever sees them. Each step runs twice and the
faster time counts: the first run of a shape pays one-time costs (a matrix
library's kernels for a new row count). Shapes that do not fit the engine's
limits (pool, token budget, sequences, context) are left out.
"""

from __future__ import annotations

import time

from gpu_worker.kv.block_manager import BlockManager, num_blocks_for
from gpu_worker.runner.model_runner import ModelRunner
from gpu_worker.sampling.sampler import Sampler
from gpu_worker.scheduling.scheduler_output import SchedulerOutput
from gpu_worker.scheduling.step_cost import StepShape
from gpu_worker.sequence import Sequence
from shared.sampling_params import SamplingParams

REPEATS = 2
# Each step: (context tokens already cached, new tokens) per sequence.
PREFILLS = [[(0, 16)], [(0, 64)], [(0, 256)], [(256, 64)], [(1024, 64)]]
DECODES = [[(context, 1)] * batch for batch in (1, 8, 32) for context in (32, 256, 1024)]
_GREEDY = SamplingParams(max_tokens=1, temperature=0)


def calibration_steps(num_blocks: int, block_size: int, max_num_batched_tokens: int, max_num_seqs: int,
                      max_model_len: int, steps: list[list[tuple[int, int]]] | None = None
                      ) -> list[list[tuple[int, int]]]:
    """The steps of `steps` (default: PREFILLS and DECODES) that fit the engine's limits."""
    def fits(step: list[tuple[int, int]]) -> bool:
        return (sum(new for _, new in step) <= max_num_batched_tokens and len(step) <= max_num_seqs
                and all(context + new <= max_model_len for context, new in step)
                and sum(num_blocks_for(context + new, block_size) for context, new in step) <= num_blocks)
    return [step for step in (PREFILLS + DECODES if steps is None else steps) if fits(step)]


def measure_steps(runner: ModelRunner, sampler: Sampler, steps: list[list[tuple[int, int]]]
                  ) -> list[tuple[StepShape, float]]:
    """(shape, seconds) of each step, forward pass and sampling."""
    blocks = BlockManager(runner.num_kv_blocks, runner.block_size, enable_prefix_caching=False)
    observations = []
    for step in steps:
        output = SchedulerOutput()
        for index, (context, new) in enumerate(step):
            seq = Sequence(f"calibration-{index}", [0] * (context + new), _GREEDY, seed=0)
            blocks.allocate(seq, context + new)
            seq.num_computed_tokens = context
            output.add(seq, new)
        observations.append((output.shape, min(_time_step(runner, sampler, output) for _ in range(REPEATS))))
        for item in output.scheduled:
            blocks.free(item.seq)
    return observations


def _time_step(runner: ModelRunner, sampler: Sampler, output: SchedulerOutput) -> float:
    start = time.perf_counter()
    step = runner.execute(output)
    sampler(step.logits, [item.seq for item in output.scheduled if item.is_sampling], step.argmax)
    return time.perf_counter() - start
