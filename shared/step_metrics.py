"""StepHistograms: the worker's per-step histograms, counted in the worker and exported by the frontend.

The worker counts every step it runs (its tokens, its time, the time its
step-cost model predicted and the ratio of the two) into fixed buckets, and
sends the counts since it started with every Outputs and Heartbeat. The
frontend adds up the counts of the workers it has replaced, so the exported
histograms never go down across a restart. Bucket edges are upper bounds, as
Prometheus has them; each histogram's last count is for +Inf.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

# vLLM's edges for vllm:iteration_tokens_total, in tokens.
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
STEP_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                        2.0, 5.0, 10.0)
# Actual over predicted step time: 1 is a perfect prediction.
PREDICTION_RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)

# The terms of the worker's step-cost model (gpu_worker/scheduling/step_cost.py), whose coefficients the stats carry.
STEP_COST_TERMS = ("step", "token", "sample", "prefill_pair", "decode_pair")

BUCKETS = {"iteration_tokens": ITERATION_TOKENS_BUCKETS, "step_seconds": STEP_SECONDS_BUCKETS,
           "predicted_step_seconds": STEP_SECONDS_BUCKETS, "step_prediction_ratio": PREDICTION_RATIO_BUCKETS}


@dataclass(slots=True)
class HistogramCounts:
    """Counts per bucket (the last for +Inf) and the sum of the observed values."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float, count: int = 1) -> None:
        """`count` observations of `value` (one bucket search for them all)."""
        self.counts[bisect.bisect_left(self.buckets, value)] += count
        self.total += value * count

    def add(self, other: HistogramCounts) -> None:
        self.counts = [a + b for a, b in zip(self.counts, other.counts)]
        self.total += other.total

    def cumulative_counts(self) -> list[tuple[float, int]]:
        """(upper bound, count of values <= it) pairs, math.inf last: Prometheus's bucket samples."""
        running, pairs = 0, []
        for bound, count in zip((*self.buckets, math.inf), self.counts):
            running += count
            pairs.append((bound, running))
        return pairs


class StepHistograms:
    """One HistogramCounts per name in BUCKETS; to and from the wire as {name: [counts..., sum]}."""

    def __init__(self) -> None:
        self.histograms = {name: HistogramCounts(buckets) for name, buckets in BUCKETS.items()}

    def observe_step(self, num_tokens: int, seconds: float, predicted_seconds: float | None) -> None:
        self.histograms["iteration_tokens"].observe(num_tokens)
        self.histograms["step_seconds"].observe(seconds)
        if predicted_seconds:
            self.histograms["predicted_step_seconds"].observe(predicted_seconds)
            self.histograms["step_prediction_ratio"].observe(seconds / predicted_seconds)

    def add(self, other: StepHistograms) -> None:
        for name, histogram in self.histograms.items():
            histogram.add(other.histograms[name])

    def to_wire(self) -> dict[str, list[float]]:
        return {name: [*h.counts, h.total] for name, h in self.histograms.items()}

    @classmethod
    def from_wire(cls, wire: dict) -> StepHistograms:
        """Raises ValueError, naming the histogram, unless `wire` holds every histogram with the right counts."""
        if not isinstance(wire, dict) or set(wire) != set(BUCKETS):
            raise ValueError(f"step_histograms must name {sorted(BUCKETS)}, got {str(wire):.100}")
        histograms = cls()
        for name, values in wire.items():
            histogram = histograms.histograms[name]
            if (not isinstance(values, list) or len(values) != len(histogram.counts) + 1
                    or not set(map(type, values[:-1])) <= {int} or min(values[:-1], default=0) < 0  # no bool either
                    or not isinstance(values[-1], (int, float)) or not math.isfinite(values[-1])):
                raise ValueError(f"step_histograms[{name!r}] must be {len(histogram.counts)} counts >= 0 and a sum, "
                                 f"got {str(values):.100}")
            histogram.counts, histogram.total = values[:-1], float(values[-1])
        return histograms
