"""Engine: requests in, tokens out, one step at a time.

Owns the Scheduler, the BlockManager, the ModelRunner and the Sampler, and
the map from request id to Sequence. A step reads: schedule -> execute ->
sample -> update -> outputs (one RequestUpdate per request that moved, the
very object the worker loop sends); `step()` does it all, while the worker loop
calls `schedule()` and `run()` apart, so as to tell the frontend which
requests a step holds before its forward pass. Used in-process by tests and
the offline benchmark, and by the worker loop.

On a CPU of four or more with no thread count asked for, it first times
the model's steps on a few thread counts and keeps the fastest
(thread_choice.py).

Also owns the StepCostModel the scheduler's latency target reads: it is
calibrated on a few made-up steps when the engine is built (before any
request), then taught by the time of every step `run()` executes, which is
also counted in `step_histograms` for /metrics.

With a shared KV cache (`use_kv_segment`, gpu_worker/kv/kv_segment.py), a
request re-sent after a worker death may bring the blocks that hold its KV
(a KVHold): the engine adopts them when they check out and computes only the
rest, and `kv_progress()` tells, after each step, what a successor would
need of each request's blocks.

Bad input raises ValueError at `add_request`, before anything is queued.
Past that, one request cannot take down the others: the forward pass is the
batch's (an exception there is the step's, and propagates), but sampling and
updating are per request. When sampling the batch raises, each row is
sampled alone (a row's draw does not depend on the batch, so the tokens are
the same), and a request whose sampling or update raises is failed alone:
taken out of the scheduler, its blocks freed, the exception logged with its
request id, and an output with the generic REQUEST_FAILED error returned.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import numpy as np
import torch

from gpu_worker.engine.step_calibration import calibration_steps, measure_steps
from gpu_worker.engine.step_hooks import StepHooks
from gpu_worker.engine.thread_choice import ThreadChoice, candidate_counts, choose_threads
from gpu_worker.kv.block_manager import BlockManager
from gpu_worker.kv.kv_segment import KVSegment
from gpu_worker.models.packed_linear import pads_rows
from gpu_worker.native.cpu_threads import available_cpus, requested_threads
from gpu_worker.runner.model_runner import ModelRunner
from gpu_worker.sampling.grammar import Grammars
from gpu_worker.sampling.sampler import Sampler, SamplerOutput
from gpu_worker.scheduling.latency_target import LatencyTarget
from gpu_worker.scheduling.scheduler import Scheduler
from gpu_worker.scheduling.scheduler_output import ScheduledSequence, SchedulerOutput
from gpu_worker.scheduling.step_cost import StepCostModel
from gpu_worker.sequence import Sequence
from shared.config import EngineConfig
from shared.kv_hold import KVHold, KVProgress
from shared.logprobs import TokenLogprobs
from shared.protocol import FAILED, EngineStats, RequestUpdate
from shared.sampling_params import SamplingParams
from shared.step_metrics import StepHistograms
from shared.vocabulary import SEED_BITS, TOKENIZER_FILE, FinishReason
from shared.wire import TOKEN_DTYPE, empty_token_ids

# Errors of the accelerator itself (a device-side assert, a lost context, memory): failing the request at hand
# would blame it for the device; they fail the step instead, and the supervisor's new worker re-runs its requests.
DEVICE_ERRORS = (torch.OutOfMemoryError, torch.AcceleratorError)
# What a failed request is told; the exception itself stays in the worker's log, beside the request id.
REQUEST_FAILED = "the engine failed while generating this request"
WARM_UP_REQUEST_ID = "warm-up"

logger = logging.getLogger("pagedserve.worker")


# One row's draw: its token and, when the request asked for them, its logprobs.
SampledToken = tuple[int, TokenLogprobs | None]


class Engine:
    def __init__(self, config: EngineConfig, hooks: StepHooks | None = None) -> None:
        self.runner = ModelRunner(config)
        model_config = self.runner.model_config
        self.eos_token_ids = tuple(model_config.eos_token_ids)
        self.max_model_len = config.max_model_len or model_config.max_context_len
        if self.max_model_len > model_config.max_context_len:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the {model_config.max_context_len} tokens "
                             f"this model serves (max_position_embeddings or sliding_window in {config.model}/config.json)")
        self.config = config
        self.block_manager = BlockManager(self.runner.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.sampler = Sampler(self.eos_token_ids)
        self.grammars = Grammars(Path(config.tokenizer_dir) / TOKENIZER_FILE, model_config.vocab_size,
                                 self.eos_token_ids)
        self.thread_choice = self._choose_threads(config)
        self.step_cost = StepCostModel()
        self.step_cost.calibrate(measure_steps(self.runner, self.sampler, calibration_steps(
            self.runner.num_kv_blocks, config.block_size, config.max_num_batched_tokens, config.max_num_seqs,
            self.max_model_len)))
        self.step_histograms = StepHistograms()
        self.scheduler = Scheduler(self.block_manager, config.max_num_batched_tokens, config.max_num_seqs,
                                   self.max_model_len,
                                   _latency_target(config, self.step_cost, pads_rows(self.runner.model)))
        self._seqs: dict[str, Sequence] = {}
        self._aborted_outputs: list[RequestUpdate] = []
        self._arrival_counter = itertools.count()
        self._seed_rng = random.Random(config.seed)
        self._hooks = hooks
        self._execute = self.runner.execute
        self._sampler: Callable = self.sampler

    def _choose_threads(self, config: EngineConfig) -> ThreadChoice | None:
        """On a CPU of MIN_CPUS or more with no thread count asked for (--cpu-threads, $OMP_NUM_THREADS), the count
        the model's steps run fastest on (thread_choice.py); None where the count stays as it was."""
        if self.runner.device.type != "cpu" or config.cpu_threads is not None or requested_threads() is not None:
            return None
        counts = candidate_counts(available_cpus())
        if len(counts) == 1:
            return None
        choice = choose_threads(self.runner, self.sampler, counts, config.max_num_batched_tokens,
                                config.max_num_seqs, self.max_model_len)
        logger.info("CPU threads: %s", choice.describe())
        return choice

    def warm_up(self) -> None:
        """One tiny greedy generation, so that the first real request pays no warm-up cost; then the step histograms
        start from nothing (/metrics counts the steps of requests) and the step hooks, if any, are armed."""
        # A fixed seed, so the engine's stream of seeds for unseeded requests is left as it was.
        self.add_request(WARM_UP_REQUEST_ID, [0], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, seed=0))
        while self.has_work():
            self.step()
        self.step_histograms = StepHistograms()
        if self._hooks is not None and self._hooks.execute is not None:
            self._execute = self._hooks.execute(self.runner.execute, self.block_manager)
        if self._hooks is not None and self._hooks.sample is not None:
            self._sampler = self._hooks.sample(self.sampler)

    def serving(self) -> torch.autograd.grad_mode.inference_mode:
        """The context a loop of steps runs in, the worker loop's whole life: inference mode, held, so that no step
        enters and leaves it (ModelRunner.execute enters it only when it is not held: ~50 us of a decode step's host
        time, its code cold after the forward pass), and the sampler's torch calls skip autograd's bookkeeping."""
        return torch.inference_mode()

    def use_kv_segment(self, path) -> KVSegment:
        """Move the KV cache into the shared segment at `path` (OSError when it cannot be mapped), with a fresh
        block manager that stamps serials there. Only before any request: what the warm-up cached is forgotten."""
        if self.has_work():
            raise RuntimeError("the KV cache moves to a shared segment only while the engine is idle")
        segment = self.runner.use_kv_segment(path)
        self.block_manager.use_serials(segment.serials)
        return segment

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    output_token_ids: list[int] | tuple[int, ...] = (), priority: int = 0,
                    kv: KVHold | None = None) -> int:
        """Queue a request. `output_token_ids` resumes one whose output so far is already known, and `kv` the
        blocks a dead worker held for it (left alone while prompt logprobs are owed: their positions are computed
        again). Returns how many positions' KV were adopted from `kv`."""
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        self._check_tokens("prompt_token_ids", prompt_token_ids)
        self._check_tokens("output_token_ids", output_token_ids)
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must hold at least one token, got an empty prompt")
        vocab_size = self.runner.model_config.vocab_size  # a top-k above it would fail the step, not the request
        if params.prompt_logprobs is not None and params.prompt_logprobs > vocab_size:
            raise ValueError(f"prompt_logprobs asks for {params.prompt_logprobs} alternatives per token, more than "
                             f"the vocabulary's {vocab_size} tokens")
        num_tokens = len(prompt_token_ids) + len(output_token_ids)
        if num_tokens >= self.max_model_len:
            raise ValueError(f"the prompt is {num_tokens} tokens but max_model_len is {self.max_model_len}, "
                             "which must leave room for at least one generated token")
        seq = Sequence(request_id, list(prompt_token_ids), params,
                       seed=params.seed if params.seed is not None else self._seed_rng.getrandbits(SEED_BITS),
                       priority=priority, arrival_order=next(self._arrival_counter),
                       output_token_ids=list(output_token_ids), num_resumed_outputs=len(output_token_ids))
        if params.grammar is not None:
            seq.grammar = self.grammars.state(params.grammar, output_token_ids)  # GrammarError is a ValueError
        self.scheduler.add(seq)
        self._seqs[request_id] = seq
        # Adopted KV is not computed again, so it would leave prompt logprobs still owed unscored: recompute those.
        if (kv is not None and not seq.needs_prompt_logprobs
                and self.block_manager.adopt(seq, kv.block_ids, kv.serials, kv.num_computed)):
            return kv.num_computed
        return 0

    def _check_tokens(self, name: str, token_ids: list[int] | tuple[int, ...]) -> None:
        vocab_size = self.runner.model_config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{name} must be token ids in [0, {vocab_size}), got {bad[:5]!r}")

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; its final output comes with the next step."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.abort(seq)
        self._aborted_outputs.append(RequestUpdate(request_id, empty_token_ids(), FinishReason.ABORT.value))
        return True

    def kv_progress(self, scheduled: SchedulerOutput) -> list[KVProgress]:
        """With a shared KV cache, where each request of a step that has just run stands (KVProgress); the block
        table and its serials only when it changed. [] with a private cache."""
        serials = self.block_manager.serials
        if serials is None:
            return []
        progress = []
        for seq in itertools.chain((item.seq for item in scheduled.scheduled), scheduled.preempted):
            if seq.is_finished:
                continue
            if len(seq.block_table) == seq.num_reported_blocks:
                progress.append(KVProgress(seq.request_id, seq.num_computed_tokens))
                continue
            block_ids = np.array(seq.block_table, dtype=np.int32)
            progress.append(KVProgress(seq.request_id, seq.num_computed_tokens, block_ids, serials[block_ids]))
            seq.num_reported_blocks = len(block_ids)
        return progress

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._aborted_outputs)

    def stats(self) -> EngineStats:
        """The engine's own part of the worker's EngineStats, a fresh object that the worker fills in with its
        counters and memory."""
        blocks = self.block_manager
        return EngineStats(num_running=self.num_running, num_waiting=self.num_waiting, kv_cache_usage=blocks.usage,
                           num_preemptions_total=self.scheduler.num_preemptions,
                           prefix_cache_queries_total=blocks.num_prefix_query_tokens,
                           prefix_cache_hits_total=blocks.num_prefix_hit_tokens,
                           num_cached_blocks=blocks.prefix_cache.num_cached_blocks if blocks.prefix_cache else 0,
                           step_histograms=self.step_histograms.to_wire(), step_cost=self.step_cost.as_dict())

    def audit_idle_blocks(self) -> str | None:
        """With no request in the engine, what is wrong with the block pool (a block still referenced); None."""
        return self.block_manager.audit_idle()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix; how many blocks that freed."""
        return self.block_manager.reset_prefix_cache()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def step(self) -> list[RequestUpdate]:
        return self.run(self.schedule())

    def schedule(self) -> SchedulerOutput:
        """Pick the next step's batch; `run` it next (and before any other call that changes the engine)."""
        return self.scheduler.schedule()

    def run(self, scheduled: SchedulerOutput) -> list[RequestUpdate]:
        """Execute a scheduled step: forward, sample, update; the outputs of the step (and of aborts before it)."""
        outputs, self._aborted_outputs = self._aborted_outputs, []
        if scheduled.is_empty:
            return outputs
        start = time.perf_counter()
        step = self._execute(scheduled)  # raises for the whole batch
        items = scheduled.scheduled
        sampling = [item.seq for item in items if item.is_sampling]
        sampled = self._sample_batch(step.logits, sampling, step.argmax)
        if (sampled is not None and len(sampling) == len(items) and not step.prompt_logprobs
                and sampled.logprobs.count(None) == len(sampling)):
            outputs += self._advance_tokens(items, sampled.token_ids)  # the everyday decode step
        else:
            samples = iter(list(zip(sampled.token_ids, sampled.logprobs)) if sampled is not None else
                           [self._sample_alone(step.logits[row:row + 1], seq) for row, seq in enumerate(sampling)])
            for index, item in enumerate(items):
                sample = next(samples) if item.is_sampling else None
                if isinstance(sample, Exception):
                    output = self._fail(item.seq, sample)
                else:
                    output = self._advance(item, sample, step.prompt_logprobs.get(index))
                if output is not None:
                    outputs.append(output)
        self._observe(scheduled, time.perf_counter() - start)
        return outputs

    def _observe(self, scheduled: SchedulerOutput, seconds: float) -> None:
        """Count the step in the histograms, and teach the cost model (after reading its prediction)."""
        predicted = self.step_cost.observe(scheduled.shape, seconds)
        self.step_histograms.observe_step(scheduled.shape.num_tokens, seconds, predicted)

    def _sample_batch(self, logits: torch.Tensor, seqs: list[Sequence],
                      argmax: torch.Tensor | None) -> SamplerOutput | None:
        """The batch's tokens (and logprobs where asked for); None if sampling the batch raised, which is then
        sampled row by row (a row's draw does not depend on the batch, so its token is the same)."""
        try:
            return self._sampler(logits, seqs, argmax)
        except DEVICE_ERRORS:
            raise  # the device is out of memory or broken, not the request: the step fails, its requests re-run
        except Exception as exc:  # noqa: BLE001 - one request's parameters must not fail the others
            logger.warning("sampling a batch of %d failed (%s: %s); sampling each request alone", len(seqs),
                           type(exc).__name__, exc)
        return None

    def _sample_alone(self, logits: torch.Tensor, seq: Sequence) -> SampledToken | Exception:
        try:
            sampled = self._sampler(logits, [seq])
            return sampled.token_ids[0], sampled.logprobs[0]
        except DEVICE_ERRORS:
            raise
        except Exception as exc:  # noqa: BLE001 - handed back, to fail this request alone
            return exc

    def _advance_tokens(self, items: list[ScheduledSequence], token_ids: list[int]) -> list[RequestUpdate]:
        """_advance for a step whose every sequence sampled a token and asked for no logprobs, in one loop: each
        request's update holds its row of one array of the step's tokens."""
        outputs = []
        advance, eos_token_ids = self.scheduler.advance, self.eos_token_ids
        tokens = np.array(token_ids, dtype=TOKEN_DTYPE)
        for row, (item, token_id) in enumerate(zip(items, token_ids)):
            seq = item.seq
            try:
                finish_reason = None
                if advance(item, token_id, eos_token_ids):
                    del self._seqs[seq.request_id]
                    finish_reason = cast(FinishReason, seq.finish_reason).value  # set by the scheduler as it finished
                outputs.append(RequestUpdate.sampled(seq.request_id, tokens[row:row + 1], finish_reason))
            except Exception as exc:  # noqa: BLE001 - one request's update must not fail the others
                outputs.append(self._fail(seq, exc))
        return outputs

    def _advance(self, item: ScheduledSequence, sample: SampledToken | None,
                 prompt_logprobs: tuple[int, list[TokenLogprobs]] | None) -> RequestUpdate | None:
        """Move one request past the step; its output if it sampled a token or scored prompt tokens (the first
        position scored and their logprobs). A request whose update raises fails."""
        seq = item.seq
        try:
            token_id, logprobs = sample if sample is not None else (None, None)
            is_finished = self.scheduler.advance(item, token_id, self.eos_token_ids)
            if is_finished:
                del self._seqs[seq.request_id]
            reason = seq.finish_reason if is_finished else None  # set by the scheduler when it finished
            finish_reason = None if reason is None else reason.value
            if prompt_logprobs is None:
                if token_id is None:
                    return None
                if logprobs is None:  # one token, nothing else
                    return RequestUpdate.sampled(seq.request_id, np.array([token_id], dtype=TOKEN_DTYPE), finish_reason)
                prompt_start, prompt_entries = 1, None
            else:
                prompt_start, prompt_entries = prompt_logprobs
                seq.prompt_logprobs_next = prompt_start + len(prompt_entries)
            # RequestUpdate turns a list of token ids into its int32 array (half the cost of handing it an array,
            # which it must then check); the field has but one type, the array's, hence the cast.
            return RequestUpdate(seq.request_id, cast(np.ndarray, [] if token_id is None else [token_id]),
                                 finish_reason, logprobs=None if logprobs is None else [logprobs],
                                 prompt_logprobs=prompt_entries, prompt_logprobs_start=prompt_start)
        except Exception as exc:  # noqa: BLE001 - one request's update must not fail the others
            return self._fail(seq, exc)

    def _fail(self, seq: Sequence, exc: Exception) -> RequestUpdate:
        """Take a request whose step raised out of the engine, free its blocks, log why; its final output."""
        logger.error("request %s failed: %s: %s", seq.request_id, type(exc).__name__, exc, exc_info=exc)
        self.scheduler.fail(seq)
        self._seqs.pop(seq.request_id, None)
        return RequestUpdate(seq.request_id, empty_token_ids(), error=REQUEST_FAILED, error_kind=FAILED)


def _latency_target(config: EngineConfig, step_cost: StepCostModel, pads_rows: bool) -> LatencyTarget | None:
    """--target-itl-ms: None is automatic, 0 the fixed token budget, else that many milliseconds."""
    if config.target_itl_ms == 0:
        return None
    return LatencyTarget(step_cost, None if config.target_itl_ms is None else config.target_itl_ms / 1000, pads_rows)

