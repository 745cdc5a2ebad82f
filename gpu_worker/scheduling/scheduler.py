"""Scheduler: continuous batching of sequences under a token budget and a KV block pool.

Owns the waiting queue and the running list and decides, each step, how
many new tokens each sequence computes. It knows token ids and block counts,
never tensors or text. Running sequences are served first, highest priority
(lowest value) and earliest arrival first; waiting ones then join while
budget, sequence slots and blocks last. When blocks run out, the
lowest-priority, latest-arrived running sequence is preempted by recompute:
its blocks are freed and it goes back to the waiting queue, to be prefilled
again (prompt and output so far) when blocks free up.

With a LatencyTarget, a step that holds decodes carries only the prefill
tokens the target leaves time for (gpu_worker/scheduling/latency_target.py): the
running decodes are counted first, then prefill chunks, running ones before
waiting ones, are sized from what is left. Each step's shape goes out with
it, for the engine to time it against the model.
"""

from __future__ import annotations

import bisect

from gpu_worker.kv.block_manager import BlockManager, num_blocks_for
from gpu_worker.scheduling.latency_target import LatencyTarget, PrefillAllowance
from gpu_worker.scheduling.scheduler_output import ScheduledSequence, SchedulerOutput
from gpu_worker.scheduling.step_cost import StepShape
from gpu_worker.sequence import Sequence, SequenceStatus
from shared.vocabulary import FinishReason


def _queue_key(seq: Sequence) -> tuple[int, int]:
    return (seq.priority, seq.arrival_order)


def _num_remaining(seq: Sequence) -> int:
    return seq.num_tokens - seq.num_computed_tokens


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int, latency_target: LatencyTarget | None = None) -> None:
        self.block_manager = block_manager
        self.latency_target = latency_target  # None: every step may fill the token budget
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.waiting: list[Sequence] = []  # sorted by (priority, arrival)
        self.running: list[Sequence] = []  # sorted by (priority, arrival)
        self.num_preemptions = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def check_can_fit(self, seq: Sequence) -> None:
        """Reject up front a sequence the pool could never hold, so scheduling cannot deadlock on it."""
        max_context = min(seq.num_tokens + seq.sampling_params.max_tokens - 1, self.max_model_len)
        needed = num_blocks_for(max_context, self.block_manager.block_size)
        if needed > self.block_manager.num_blocks:
            raise ValueError(f"request {seq.request_id} needs up to {needed} KV blocks "
                             f"({max_context} tokens) but the cache holds only {self.block_manager.num_blocks}")

    def add(self, seq: Sequence) -> None:
        self.check_can_fit(seq)
        bisect.insort(self.waiting, seq, key=_queue_key)

    def abort(self, seq: Sequence) -> None:
        queue = self.running if seq.status is SequenceStatus.RUNNING else self.waiting
        queue.remove(seq)
        self._finish(seq, FinishReason.ABORT)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work.

        Invariant: every sequence's num_computed_tokens catches up with its
        num_tokens, at most max_num_batched_tokens new tokens per step. A
        decode is the one-token case, a prefill chunk the many-token case,
        and a preempted sequence simply starts again from zero. With a
        latency target, prefill chunks are cut to the time the decodes leave.
        """
        output = SchedulerOutput()
        allowance = self._prefill_allowance()
        budget = self._schedule_running(output, self.max_num_batched_tokens, allowance)
        if not output.preempted:
            self._schedule_waiting(output, budget, allowance)
        return output

    def _prefill_allowance(self) -> PrefillAllowance | None:
        """What the latency target leaves prefill in this step; None without a target, or when nothing prefills."""
        if self.latency_target is None:
            return None
        num_decodes = decode_context = stream_context = 0
        for seq in self.running:
            num_computed, num_tokens = seq.num_computed_tokens, seq.num_tokens
            if num_tokens - num_computed == 1:
                num_decodes += 1
                decode_context += num_computed
            stream_context += num_tokens - 1
        if num_decodes == len(self.running) and not self.waiting:
            return None  # every sequence decodes: no chunk to size
        num_streams = min(len(self.running) + len(self.waiting), self.max_num_seqs)
        for seq in self.waiting[:max(0, num_streams - len(self.running))]:
            stream_context += seq.num_tokens - 1
        return self.latency_target.prefill_allowance(StepShape.of_decodes(num_decodes, decode_context),
                                                     StepShape.of_decodes(num_streams, stream_context))

    def _schedule_running(self, output: SchedulerOutput, budget: int, allowance: PrefillAllowance | None) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_remaining = seq.num_tokens - seq.num_computed_tokens
            if num_remaining == 1 and self.block_manager.fits_next_token(seq):  # most decodes: nothing to allocate
                output.add_decode(seq)
                budget -= 1
                index += 1
                continue
            num_new_tokens = min(num_remaining, budget)
            if num_new_tokens > 1 and allowance is not None:
                num_new_tokens = allowance.grant(seq.num_computed_tokens, num_remaining, budget)
                if not num_new_tokens:
                    index += 1  # keeps its blocks; its prompt goes on in a later step
                    continue
            while not self.block_manager.can_allocate(seq, num_new_tokens):
                victim = self.running[-1]  # lowest priority, latest arrival; not yet scheduled this step
                self._preempt(victim)
                output.preempted.append(victim)
                if victim is seq:
                    return budget
            self.block_manager.allocate(seq, num_new_tokens)
            output.add(seq, num_new_tokens)
            budget -= num_new_tokens
            index += 1
        return budget

    def _schedule_waiting(self, output: SchedulerOutput, budget: int, allowance: PrefillAllowance | None) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            is_adopted = bool(seq.block_table)  # resumed on blocks a dead worker left: it waits holding them
            if not is_adopted:
                self.block_manager.acquire_cached_prefix(seq)
            num_new_tokens = min(_num_remaining(seq), budget)
            if allowance is not None and num_new_tokens > 1:
                num_new_tokens = allowance.grant(seq.num_computed_tokens, _num_remaining(seq), budget)
            if not num_new_tokens or not self.block_manager.can_allocate(seq, num_new_tokens):
                if not is_adopted:
                    self.block_manager.free(seq)  # give the cached prefix back until it can run
                break
            self.waiting.pop(0)
            if not is_adopted:
                self.block_manager.record_prefix_lookup(seq)
            self.block_manager.allocate(seq, num_new_tokens)
            seq.move_to(SequenceStatus.RUNNING)
            bisect.insort(self.running, seq, key=_queue_key)
            output.add(seq, num_new_tokens)
            budget -= num_new_tokens

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.move_to(SequenceStatus.WAITING)
        self.num_preemptions += 1
        bisect.insort(self.waiting, seq, key=_queue_key)

    def advance(self, scheduled: ScheduledSequence, token_id: int | None, eos_token_ids: tuple[int, ...]) -> bool:
        """Advance one scheduled sequence past this step, `token_id` its new output when it was sampling (else None).

        One sequence at a time, so that the engine can fail a sequence whose update raises and advance the rest.
        Returns whether the sequence finished.
        """
        seq = scheduled.seq
        seq.num_computed_tokens += scheduled.num_new_tokens
        if not scheduled.is_sampling:
            return False
        if token_id is None:
            raise ValueError(f"sequence {seq.request_id} sampled in this step, but no token came for it")
        seq.append_output(token_id)
        reason = self._finish_reason(seq, token_id, eos_token_ids)
        if reason is None:
            return False
        self.running.remove(seq)
        self._finish(seq, reason)
        return True

    def fail(self, seq: Sequence) -> None:
        """Take out a sequence whose step raised, wherever the error left it, and free its blocks."""
        for queue in (self.running, self.waiting):
            if seq in queue:
                queue.remove(seq)
        if not seq.is_finished:  # a finished one has given its blocks back already
            self._finish(seq, FinishReason.ERROR)

    def _finish_reason(self, seq: Sequence, token_id: int, eos_token_ids: tuple[int, ...]) -> FinishReason | None:
        params = seq.sampling_params
        num_outputs = len(seq.output_token_ids)
        num_new_outputs = num_outputs - seq.num_resumed_outputs
        if num_new_outputs >= params.min_tokens and (
                token_id in params.stop_token_ids or (not params.ignore_eos and token_id in eos_token_ids)):
            return FinishReason.STOP
        if seq.grammar is not None and seq.grammar.is_finished:
            return FinishReason.STOP  # the output is complete: nothing but EOS could follow
        if num_new_outputs >= params.max_tokens or len(seq.prompt_token_ids) + num_outputs >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.block_manager.free(seq)
        seq.move_to(SequenceStatus.FINISHED)
        seq.finish_reason = reason
