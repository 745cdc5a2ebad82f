"""SchedulerOutput: what one step runs, each sequence with the tokens it computes; all the runner sees of scheduling."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpu_worker.scheduling.step_cost import StepShape
from gpu_worker.sequence import Sequence


@dataclass(slots=True)
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int
    is_sampling: bool  # this step brings the sequence up to date, so its last logits pick a new token

    @property
    def prompt_logprob_positions(self) -> range:
        """The prompt positions whose logprobs this step computes (before it has run)."""
        start = self.seq.num_computed_tokens
        return self.seq.prompt_logprob_positions(start, start + self.num_new_tokens)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    shape: StepShape = field(default_factory=StepShape)  # what the step holds, for the step-cost model

    def add(self, seq: Sequence, num_new_tokens: int) -> None:
        is_sampling = seq.num_computed_tokens + num_new_tokens == seq.num_tokens
        self.scheduled.append(ScheduledSequence(seq, num_new_tokens, is_sampling))
        self.shape.add(num_new_tokens, seq.num_computed_tokens, is_sampling)

    def add_decode(self, seq: Sequence) -> None:
        """add(seq, 1) for a sequence one token behind: it samples."""
        self.scheduled.append(ScheduledSequence(seq, 1, True))
        shape = self.shape
        shape.num_tokens += 1
        shape.num_samples += 1
        shape.decode_pairs += seq.num_computed_tokens + 1

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
