"""WorkerTotals: what the workers counted, added up across every worker so far, and the current one's latest stats.

A worker's counters start from zero; when the next worker starts,
roll_over() adds what the last one counted to the totals of those before
it, so that /metrics counters never go backwards across a restart.
"""

from __future__ import annotations

from shared.protocol import EngineStats, Outputs
from shared.step_metrics import StepHistograms


class WorkerTotals:
    def __init__(self) -> None:
        self.stats = EngineStats()  # the current worker's latest, from Outputs or Heartbeat
        self._replaced = dict.fromkeys(EngineStats.CUMULATIVE, 0)  # what the workers before it counted
        self._replaced_step_histograms = StepHistograms()
        self.num_prompt_tokens = 0  # over every worker, from their Outputs
        self.num_generation_tokens = 0

    def total(self, name: str) -> int:
        """One of EngineStats.CUMULATIVE over every worker so far, the current one's as of its latest stats."""
        return self._replaced[name] + getattr(self.stats, name)

    def step_histograms(self) -> StepHistograms:
        """The step histograms of every worker so far, the current one's as of its latest stats."""
        total = StepHistograms()
        total.add(self._replaced_step_histograms)
        total.add(self.stats.histograms())
        return total

    def roll_over(self) -> None:
        """A new worker starts: what the last one counted joins the totals, and its stats start from nothing."""
        for name in EngineStats.CUMULATIVE:
            self._replaced[name] += getattr(self.stats, name)
        self._replaced_step_histograms.add(self.stats.histograms())
        self.stats = EngineStats()

    def record(self, outputs: Outputs) -> None:
        if outputs.stats is not None:  # else unchanged since the worker last sent them
            self.stats = outputs.stats
        self.num_prompt_tokens += outputs.num_prompt_tokens
        self.num_generation_tokens += outputs.num_generation_tokens
