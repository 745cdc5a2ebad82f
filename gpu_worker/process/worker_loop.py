"""WorkerLoop: the worker process's main loop, an Engine between two ZMQ sockets.

Owns the conversation with the frontend: applies Add / Resume / Abort /
Shutdown to the Engine, ResetPrefixCache to its BlockManager (answered at
once with a PrefixCacheReset: between steps, no block is being written) and
StartProfile / StopProfile to its StepProfiler, steps it, and sends one
Outputs message per step for every request that advanced or whose KV
progressed (and a ProfileResult for each StopProfile).
Knows token ids, never text; knows nothing of HTTP.

Before a step's forward pass, the loop notes the step's requests that this
worker has not run before in its ScheduledLedger (shared/scheduled_ledger.py),
a file that outlives any death of the process: should the step hang or kill
the process, the frontend knows whom the step held. While a step runs,
`step_request_ids` names its requests, for the Fatal that the process's main
sends if the step raises.

One thread does everything, heartbeats included: when nothing else went out
for HEARTBEAT_INTERVAL_S, the loop itself sends a Heartbeat (after a step, or
when an idle poll times out). A hung step therefore stops the heartbeats,
which is how the supervisor tells a hung worker from a busy one. For the same
reason a stopped profile is written on a side thread (StepProfiler), and its
ProfileResult goes out from the loop once it is done.

Whenever the engine goes idle (it had work and has none left), the loop
audits the block accounting (BlockManager.audit_idle): a block neither free
nor held by the prefix cache is an error in the log and a count in the stats
(pagedserve:kv_block_audit_failures_total), never silent. The stats also
carry the worker's memory, split by MemoryReport into what is explained
(weights, the KV cache's resident part, malloc's cache) and the rest. They
go out with every Heartbeat, but with an Outputs only when a request
started or finished in its step, or the running or waiting count changed,
or STATS_INTERVAL_S passed: to build, encode and parse them with each step
cost more than its tokens.

With a shared KV cache, each Outputs also carries the step's KV progress
(Engine.kv_progress), and a Resume (every request of a dead worker, re-sent
at once) is applied whole before the next step: each request adopts what it
can of the blocks it held, and the tokens adopted and those left to
recompute are counted in the stats.

A request the Engine refuses (add_request raised ValueError, e.g. a prompt
longer than max_model_len) is answered with an Outputs entry whose `error`
is the engine's message (error_kind REFUSED); one the Engine failed inside a
step (its sampling or update raised) with the Engine's generic message
(error_kind FAILED). Either way the worker carries on. Any other exception
is left to propagate: the process reports it as Fatal and exits.
"""

from __future__ import annotations

import logging
import time

import torch
import zmq

from gpu_worker.engine.cpu_contention import CONTENDED, contended_threads, run_delay_seconds
from gpu_worker.engine.engine import Engine
from gpu_worker.process.memory_report import MemoryReport
from gpu_worker.process.step_profiler import StepProfiler
from shared.protocol import (
    REFUSED,
    Abort,
    Add,
    EngineStats,
    Heartbeat,
    Message,
    Outputs,
    PrefixCacheReset,
    ProfileResult,
    ProtocolError,
    RequestUpdate,
    ResetPrefixCache,
    Resume,
    Shutdown,
    StartProfile,
    StopProfile,
    decode,
    encode,
)
from shared.scheduled_ledger import ScheduledLedger
from shared.vocabulary import HEARTBEAT_INTERVAL_S, STATS_INTERVAL_S
from shared.wire import empty_token_ids

_IDLE_POLL_MS = int(HEARTBEAT_INTERVAL_S * 1000)

logger = logging.getLogger("pagedserve.worker")


class WorkerLoop:
    def __init__(self, engine: Engine, inbox: zmq.Socket, outbox: zmq.Socket, ledger: ScheduledLedger, epoch: int,
                 secret: str) -> None:
        self.engine = engine
        self.inbox = inbox  # PULL: Add, Resume, Abort, Shutdown, StartProfile, StopProfile, ResetPrefixCache
        # PUSH: Outputs, Heartbeat, ProfileResult, PrefixCacheReset (Ready and Fatal: the process's main)
        self.outbox = outbox
        self.ledger = ledger
        self.epoch = epoch
        self.secret = secret  # this start's, from the frontend: it goes in every message sent
        self.is_stopping = False
        self.profiler = StepProfiler(engine.runner.device.type, epoch, secret)
        self.step_request_ids: tuple[str, ...] = ()  # the requests of the step being run; () between steps
        self._refused: list[RequestUpdate] = []  # answered with the next Outputs
        self._prompt_lengths: dict[str, int] = {}  # requests that have not produced a token yet
        self._kv_progress: list = []  # the last step's, sent with its Outputs
        self._scheduled: dict[str, float] = {}  # requests first run since the last Outputs -> that step's start
        self.num_adopted_tokens_total = 0  # of resumed requests: positions a dead worker computed, adopted
        self.num_recomputed_tokens_total = 0  # ... and computed again
        self.num_block_audit_failures_total = 0
        self.memory = MemoryReport(engine)
        self._was_busy = False  # the engine had work at the last turn of the loop: going idle means an audit
        self._last_send_time = time.monotonic()
        self._stats_time, self._stats_counts = 0.0, (-1, -1)  # when stats() last ran, and its running and waiting
        # Fewer compute threads while other busy processes share the CPUs (cpu_contention.py); None: as they are.
        self.contention = contended_threads(engine.runner.device.type, bool(engine.config.cpu_threads_asked),
                                            torch.get_num_threads())

    def run(self) -> None:
        """Inbox -> step -> outputs -> heartbeat, until a Shutdown arrives, in the engine's serving context."""
        with self.engine.serving():
            self._serve()

    def _serve(self) -> None:
        while not self.is_stopping:
            self._drain_inbox(timeout_ms=0 if self.engine.has_work() else _IDLE_POLL_MS)
            if self.is_stopping:
                break
            busy = self.engine.has_work()
            outputs = self._step() if busy else []
            if busy and self.contention is not None:
                self._govern_threads()
            self._audit_if_idle()
            self._send_outputs(outputs)
            self._send_profile_results()
            self._heartbeat_if_quiet()

    def _step(self) -> list[RequestUpdate]:
        """Schedule, note the requests new to this worker in the ledger, then run the step."""
        with self.profiler.step():
            started = time.monotonic()
            scheduled = self.engine.schedule()
            request_ids = tuple(s.seq.request_id for s in scheduled.scheduled)
            # a disk that fails here is no fault of these requests: not named yet
            for request_id in self.ledger.note(request_ids):
                self._scheduled[request_id] = started
            self.step_request_ids = request_ids
            outputs = self.engine.run(scheduled)
            self._kv_progress = self.engine.kv_progress(scheduled)
        self.step_request_ids = ()
        return outputs

    def _govern_threads(self) -> None:
        """Once a window has passed, judge it (cpu_contention.py) and set the compute thread count it asks for."""
        assert self.contention is not None
        now = time.monotonic()
        if not self.contention.due(now) or (run_delay := run_delay_seconds()) is None:
            return
        before = self.contention.threads
        count = self.contention.observe(now, run_delay)
        if count is None:
            return
        torch.set_num_threads(count)
        if count < before:
            logger.warning("CPU threads: %d -> %d: the compute threads waited for a CPU over %.0f%% of the last "
                           "window; another busy process shares these CPUs (pin them apart, or set --cpu-threads)",
                           before, count, 100 * CONTENDED)
        else:
            logger.info("CPU threads: %d -> %d: trying more again", before, count)

    def _audit_if_idle(self) -> None:
        """Audit the block accounting once each time the engine goes from busy to idle."""
        was_busy, self._was_busy = self._was_busy, self.engine.has_work()
        if not was_busy or self._was_busy:
            return
        problem = self.engine.audit_idle_blocks()
        if problem is not None:
            self.num_block_audit_failures_total += 1
            logger.error("KV block audit failed: %s", problem)

    def _drain_inbox(self, timeout_ms: int) -> None:
        """Apply every message waiting in the inbox, waiting up to timeout_ms for the first one."""
        if timeout_ms and not self.inbox.poll(timeout_ms):
            return
        while not self.is_stopping:
            try:
                frames = self.inbox.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._apply(decode(frames))

    def _apply(self, msg: Message) -> None:
        match msg:
            case Add():
                self._add(msg)
            case Resume():
                for add in msg.adds:
                    self._resume(add)
            case Abort():
                for request_id in msg.request_ids:
                    self.engine.abort(request_id)  # its final output (reason "abort") comes with the next step
            case Shutdown():
                self.is_stopping = True
            case StartProfile():
                self.profiler.start()
            case StopProfile():
                self.profiler.stop(msg.profile_dir)  # answered once written, by _send_profile_results
            case ResetPrefixCache():
                num_freed_blocks = self.engine.reset_prefix_cache()
                logger.info("prefix cache reset: %d cached blocks freed", num_freed_blocks)
                self._send(PrefixCacheReset(self.epoch, self.secret, num_freed_blocks))
            case _:
                raise ProtocolError(f"the worker takes ADD, RESUME, ABORT, SHUTDOWN, START_PROFILE, STOP_PROFILE and "
                                    f"RESET_PREFIX_CACHE messages, got {msg.KIND}")

    def _add(self, msg: Add) -> int | None:
        """Queue the request; how many positions of its KV were adopted, or None when it was refused."""
        try:
            num_adopted = self.engine.add_request(msg.request_id, msg.prompt_token_ids.tolist(), msg.params,
                                                  output_token_ids=msg.output_token_ids.tolist(),
                                                  priority=msg.priority, kv=msg.kv)
        except ValueError as exc:
            logger.info("refused request %s: %s", msg.request_id, exc)
            self._refused.append(RequestUpdate(msg.request_id, empty_token_ids(), error=str(exc), error_kind=REFUSED))
            return None
        self._prompt_lengths[msg.request_id] = len(msg.prompt_token_ids)
        return num_adopted

    def _resume(self, msg: Add) -> None:
        """Queue a request a dead worker held, and count the positions of it the dead worker had computed: those
        whose KV is adopted, and those computed again. A request with output had all but its last token
        computed; one without, what its KV hold says (nothing when it has none: its prompt was never done)."""
        num_adopted = self._add(msg)
        if num_adopted is None:
            return
        num_outputs = len(msg.output_token_ids)
        num_done = (msg.kv.num_computed if msg.kv is not None
                    else len(msg.prompt_token_ids) + num_outputs - 1 if num_outputs else 0)
        self.num_adopted_tokens_total += num_adopted
        self.num_recomputed_tokens_total += max(0, num_done - num_adopted)

    def _send_outputs(self, outputs: list[RequestUpdate]) -> None:
        """One Outputs message for the step (and any refusals since the last one); nothing when nothing moved."""
        updates = self._refused + outputs
        self._refused = []
        kv_progress, self._kv_progress = self._kv_progress, []
        scheduled, self._scheduled = self._scheduled, {}
        if updates or kv_progress or scheduled:
            self._send(Outputs(self.epoch, self.secret, updates, self._stats_if_due(updates, scheduled),
                               self._count_prompt_tokens(outputs), kv_progress, scheduled))
        self.ledger.forget(u.request_id for u in updates if u.is_finished)

    def _count_prompt_tokens(self, outputs: list[RequestUpdate]) -> int:
        """Prompt tokens of the requests whose first token came in this step, where vLLM counts them too."""
        total = 0
        for out in outputs:
            if len(out.new_token_ids):
                total += self._prompt_lengths.pop(out.request_id, 0)
            elif out.is_finished:  # an abort before any token: not computed
                self._prompt_lengths.pop(out.request_id, None)
        return total

    def _send_profile_results(self) -> None:
        for result in self.profiler.take_results():
            self._send(result)

    def _stats_if_due(self, updates: list[RequestUpdate], scheduled: dict[str, float]) -> EngineStats | None:
        """The stats for this step's Outputs when a request started or finished in the step, when the running or
        waiting count differs from the stats last sent (an arrival, a preemption), or when STATS_INTERVAL_S has
        passed since; else None (for the frontend: unchanged). So a request's counts and totals are exact once
        its last token arrives."""
        changed = (bool(scheduled) or any(update.is_finished for update in updates)
                   or (self.engine.num_running, self.engine.num_waiting) != self._stats_counts)
        if not changed and time.monotonic() - self._stats_time < STATS_INTERVAL_S:
            return None
        return self.stats()

    def _heartbeat_if_quiet(self) -> None:
        if time.monotonic() - self._last_send_time >= HEARTBEAT_INTERVAL_S:
            self._send(Heartbeat(self.epoch, self.secret, self.stats()))

    def _send(self, msg: Outputs | Heartbeat | ProfileResult | PrefixCacheReset) -> None:
        self.outbox.send_multipart(encode(msg), copy=False)
        self._last_send_time = time.monotonic()

    def stats(self) -> EngineStats:
        """The engine's stats (a fresh object each call) with the worker's counters and memory filled in."""
        stats, memory = self.engine.stats(), self.memory.sample()
        self._stats_time, self._stats_counts = time.monotonic(), (stats.num_running, stats.num_waiting)
        stats.num_adopted_tokens_total = self.num_adopted_tokens_total
        stats.num_recomputed_tokens_total = self.num_recomputed_tokens_total
        stats.num_block_audit_failures_total = self.num_block_audit_failures_total
        stats.cpu_threads = torch.get_num_threads() if self.engine.runner.device.type == "cpu" else 0
        stats.rss_bytes, stats.weights_bytes = memory.rss_bytes, memory.weights_bytes
        stats.kv_cache_bytes, stats.allocator_cache_bytes = memory.kv_cache_bytes, memory.allocator_cache_bytes
        stats.unexplained_bytes = memory.unexplained_bytes
        stats.cuda_allocated_bytes, stats.cuda_reserved_bytes = memory.cuda_allocated_bytes, memory.cuda_reserved_bytes
        return stats
