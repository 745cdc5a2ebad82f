"""LatencyTarget: how long a step that holds decodes may take, and so how many prefill tokens it may carry.

Every running stream waits for the whole of each step, so a step that
carries someone's long prompt delays every stream's next token. The
scheduler therefore puts the running decodes in first, then gives prefill
chunks only the time the target leaves over, as the StepCostModel predicts
it (Sarathi-Serve's stall-free batching, with the chunk sized by time rather
than by a fixed token count). When nothing decodes, no stream can stall:
prefill then has the whole token budget.

The target is `target_seconds`, or, by default, TARGET_ITL_AUTO_FACTOR x the
predicted time of a decode step of every sequence in the engine, the
waiting ones included: the step their streams are heading for, and so about
the usual gap between their tokens once they are all decoding. A fixed
number of milliseconds would be out of reach for a large batch on a slow
machine and loose for a small one on a fast machine; a multiple of the
streams' own step keeps a stream's slowest gaps within a bounded multiple of
its usual gap on any hardware and load. Counting the waiting sequences in
matters when many arrive at once: the few that decode first would otherwise
hold the prefill of all the others to their own small step, and the load
would take longer than it needs to.

No prompt starves: the first prefill in the scheduler's order (priority,
then arrival) gets at least MIN_PREFILL_CHUNK tokens every step, even when
the decodes alone fill the target, so it finishes in a bounded number of
steps; the ones behind it wait their turn rather than overtake it. That
minimum is the only way a step that holds decodes may be predicted past the
target.
"""

from __future__ import annotations

import math

from gpu_worker.native.row_ladder import rung_at_or_below
from gpu_worker.scheduling.step_cost import StepCostModel, StepShape
from shared.config import TARGET_ITL_AUTO_FACTOR

MIN_PREFILL_CHUNK = 16


class PrefillAllowance:
    """The prefill time one step has left, handed out chunk by chunk in the scheduler's order.

    With `pads_rows` (the model computes on rows padded to the row ladder, on
    the CPU) a chunk cut short for time is cut a little more, so that the
    step's rows end on a rung: the padding would otherwise cost up to 1/8 more
    time than the cost model, which counts tokens, predicts.
    """

    def __init__(self, cost_model: StepCostModel, seconds: float, num_decode_rows: int = 0,
                 pads_rows: bool = False) -> None:
        self.cost_model = cost_model
        self.seconds_left = seconds  # math.inf: no limit
        self.num_rows = num_decode_rows  # the step's rows: its decodes, then each chunk granted
        self.pads_rows = pads_rows
        self._has_served_head = False

    def grant(self, num_context_tokens: int, num_remaining: int, num_budget_tokens: int) -> int:
        """How many of a sequence's `num_remaining` prompt tokens to compute now, at most `num_budget_tokens`."""
        num_wanted = min(num_remaining, num_budget_tokens)
        if math.isinf(self.seconds_left):
            return num_wanted
        num = self.cost_model.max_chunk(self.seconds_left, num_context_tokens, num_wanted)
        least = 0
        if not self._has_served_head:
            least = min(num_wanted, MIN_PREFILL_CHUNK)
            num = max(num, least)
            self._has_served_head = True
        if self.pads_rows and 0 < num < num_wanted:
            num = max(rung_at_or_below(self.num_rows + num) - self.num_rows, least)
        if num:
            self.seconds_left -= self.cost_model.chunk_seconds(num, num_context_tokens, num == num_remaining)
            self.num_rows += num
        return num


class LatencyTarget:
    def __init__(self, cost_model: StepCostModel, target_seconds: float | None, pads_rows: bool = False) -> None:
        self.cost_model = cost_model
        self.target_seconds = target_seconds  # None: TARGET_ITL_AUTO_FACTOR x the decodes' own step time
        self.pads_rows = pads_rows  # the model pads a step's rows to the row ladder: chunks end steps on a rung

    def limit(self, streams: StepShape) -> float:
        """The longest a step may take while `streams` (one decode per sequence in the engine) are served."""
        if self.target_seconds is not None:
            return self.target_seconds
        return TARGET_ITL_AUTO_FACTOR * self.cost_model.predict(streams)

    def prefill_allowance(self, decodes: StepShape, streams: StepShape) -> PrefillAllowance:
        """What prefill may add to a step that holds `decodes`: unlimited with none, or before any step is known.

        `streams` is the decode step of every sequence in the engine, waiting
        ones included: the step their streams are heading for, which the
        automatic target is a multiple of.
        """
        if not decodes.num_tokens or not self.cost_model.is_fitted:
            return PrefillAllowance(self.cost_model, math.inf)
        return PrefillAllowance(self.cost_model, self.limit(streams) - self.cost_model.predict(decodes),
                                decodes.num_tokens, self.pads_rows)
