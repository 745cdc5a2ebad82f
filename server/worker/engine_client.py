"""EngineClient: the frontend's side of the worker: spawn it, send it requests, route what it sends back.

Owns the worker process (its own process group), its WorkerChannel (the two
sockets bound in the runtime directory), and the requests in flight
(request id -> RequestState). Never imports torch: the frontend stays small
and quick.

start() binds a fresh channel, spawns `python -m gpu_worker` with the next
epoch and the channel's fresh secret (on its stdin) and waits for Ready;
once the worker holds both connections it seals the channel (removes the
socket files), so that nothing else can connect and no listener is left to
accept (WorkerChannel.seal says why that matters when file descriptors run
out). add() puts a request in flight; it is sent as an Add once a worker is
ready, and on every Ready each request in flight is (re)sent with its
prompt, the tokens it already has and what remains of max_tokens /
min_tokens: a first send and a re-queue after a worker death are one code
path. A receive task takes the worker's messages (the channel drops any
without the current epoch and secret; num_dropped_messages_total counts
them), routes Outputs to RequestState.append() (prompt logprobs first to
add_prompt_logprobs(), whose gap fails that request alone; fail() for a
request the worker refused, an invalid_request_error, or failed, a
server_error) and keeps the latest stats; a watch task awaits the exit. A request re-sent once all its prompt
logprobs have come is sent without asking for them again.

Profiling: start_profile() sends StartProfile to the ready worker and
stop_profile() sends StopProfile and awaits the worker's ProfileResult, in a
ProfileSession (server/worker/profiling.py) that a worker's exit ends, so that
a stop never waits on a dead worker. reset_prefix_cache() likewise sends
ResetPrefixCache and awaits its PrefixCacheReset (PrefixCacheResets,
server/worker/prefix_cache_resets.py), which a worker's exit fails.

Whom to blame for a worker's death: once it has exited,
`scheduled_on_worker` holds the requests in flight that it had scheduled
(its scheduled ledger names each, noted before its first forward pass, and
the client reads it before setting worker_exited), and a Fatal raised in a
step names that step's requests (`worker_exit.fatal.request_ids`). A request
that only waited in the worker's queue is in neither.

Standby (num_standby_workers=1): once a worker is ready, a second one is
started behind it (StandbyWorker) and left waiting; start() after a death
takes it into service at once instead of spawning and loading a new one,
and starts the next standby a moment later. With a shared KV cache
(kv_segment, the file server/worker/kv_segment.py manages), every worker maps the
same pool, the Outputs tell each request's blocks (RequestState.kv), and the
requests in flight go to the next worker as one Resume that carries them, so
that it adopts their KV instead of recomputing it.

Recycling: retire_worker() asks the ready worker to stop (Shutdown): it
ends the step it is in, sends that step's Outputs, and exits 0; the requests
in flight stay, for the next worker, as after any exit.
`num_requests_finished` counts the requests the current worker finished.

When a ready worker exits (crash, kill, Fatal, a retirement, or an unasked-for clean
exit) and the client is `supervised`, the requests in flight stay: the
Supervisor owns recovery, start() again, which re-sends them, or fail_all().
Unsupervised, nothing will restart the worker, so the client fails every
request in flight, and every one added later, with the exit's description.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
import os
import random
import signal
import time
import types
from collections.abc import Mapping
from pathlib import Path

import zmq
import zmq.asyncio

from server.worker.prefix_cache_resets import PrefixCacheResets
from server.worker.process import (
    WorkerChannel,
    WorkerExit,
    WorkerStartError,
    WorkerState,
    check_descriptors_to_start,
    seal_when_connected,
    spawn_worker,
)
from server.worker.profiling import ProfileSession
from server.worker.request_state import RequestState
from server.worker.restart_policy import DEFAULT_START_TIMEOUT_S
from server.worker.standby import StandbyWorker
from shared.config import EngineConfig
from shared.protocol import (
    FAILED,
    REFUSED,
    Abort,
    Add,
    EngineStats,
    Fatal,
    Heartbeat,
    Message,
    Outputs,
    PrefixCacheReset,
    ProfileResult,
    Ready,
    RequestUpdate,
    ResetPrefixCache,
    Resume,
    Shutdown,
    StartProfile,
    StopProfile,
    encode,
)
from shared.step_metrics import StepHistograms
from shared.vocabulary import SEED_BITS, FinishReason
from shared.wire import as_token_ids
from shared.worker_launch import INPUT_SOCKET, OUTPUT_SOCKET, WorkerArgs, socket_path

DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0
_DRAIN_AFTER_EXIT_MS = 100  # what a dead worker flushed before exiting (its last Outputs, its Fatal) is still read
# After a standby took over: the next one starts this much later, leaving the cores to the resumed requests first.
NEXT_STANDBY_DELAY_S = 1.0
STANDBY_RETRY_MAX_S = 30.0  # the longest pause between attempts to start a standby that keeps failing
_OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE)

logger = logging.getLogger("pagedserve.engine_client")


class EngineClient:
    def __init__(self, engine_config: EngineConfig, runtime_dir: Path, *,
                 supervised: bool = False, start_timeout: float = DEFAULT_START_TIMEOUT_S,
                 shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
                 kv_segment: Path | None = None, num_standby_workers: int = 0) -> None:
        if num_standby_workers not in (0, 1):
            raise ValueError(f"num_standby_workers must be 0 or 1, got {num_standby_workers!r}")
        self.engine_config = engine_config
        self.runtime_dir = Path(runtime_dir)
        self.kv_segment = kv_segment
        self.num_standby_workers = num_standby_workers
        for name in (INPUT_SOCKET, OUTPUT_SOCKET):
            socket_path(self.runtime_dir, name, 2**31)  # a path too long for a Unix socket fails here, not at bind
        self.start_timeout = start_timeout
        self.shutdown_timeout = shutdown_timeout
        self.state = WorkerState.IDLE
        self.epoch = 0  # the current worker's; 1 for the first
        self._last_epoch = 0  # the last one spawned: the current worker's, or its standby's
        self.worker_info: Ready | None = None  # the current worker's Ready: max_model_len, vocab_size, ...
        self.worker_exit: WorkerExit | None = None  # the last worker's exit
        # The Fatal's message of the last worker that died before READY (a load error); None once one is ready.
        self.start_error: str | None = None
        self.worker_exited = asyncio.Event()  # set when the current worker has exited (cleared by start())
        self.stats = EngineStats()  # the latest, from Outputs or Heartbeat
        # What the workers before the current one counted: EngineStats.CUMULATIVE and the step histograms.
        self._replaced_totals = dict.fromkeys(EngineStats.CUMULATIVE, 0)
        self._replaced_step_histograms = StepHistograms()
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        self.num_dropped_messages_total = 0  # received but not from the current worker (WorkerChannel.accept)
        self.last_message_time: float | None = None  # time.monotonic() of the current worker's last message
        self.last_progress_time: float | None = None  # ... of its last Outputs with generated tokens
        self.first_progress_time: float | None = None  # ... of its first
        self.num_requests_finished = 0  # by the current worker
        self.is_retiring = False  # retire_worker() asked the current worker to stop
        self.standby: StandbyWorker | None = None
        self._standby_task: asyncio.Task | None = None  # keeps a standby started while a worker is ready
        self.supervised = supervised  # a Supervisor restarts the worker: an exit fails nothing by itself
        self._in_flight: dict[str, RequestState] = {}
        self._scheduled: set[str] = set()  # what the current worker's ledger named when it exited; pruned as they end
        self._seed_rng = random.Random(engine_config.seed)  # seeds requests that bring none, as the Engine would
        self._context = zmq.asyncio.Context()
        # libzmq starts its threads with the first socket, and aborts the process if it cannot open their epoll
        # descriptor then (src/epoll.cpp): start them now, while descriptors are plentiful, not in a later start().
        self._context.socket(zmq.PUSH).close(linger=0)
        self._channel: WorkerChannel | None = None
        self._process: asyncio.subprocess.Process | None = None
        self._receive_task: asyncio.Task | None = None
        self._watch_task: asyncio.Task | None = None
        self._ready = asyncio.Event()
        self._fatal: Fatal | None = None
        self.profile = ProfileSession()
        self.prefix_cache_resets = PrefixCacheResets()

    def total(self, name: str) -> int:
        """One of EngineStats.CUMULATIVE over every worker so far, the current one's as of its latest stats."""
        return self._replaced_totals[name] + getattr(self.stats, name)

    def step_histograms(self) -> StepHistograms:
        """The step histograms of every worker so far, the current one's as of its latest stats."""
        total = StepHistograms()
        total.add(self._replaced_step_histograms)
        total.add(self.stats.histograms())
        return total

    @property
    def is_ready(self) -> bool:
        return self.state is WorkerState.READY

    @property
    def in_flight(self) -> Mapping[str, RequestState]:
        """Requests sent (or to be sent) to the worker and not finished, by request id; read-only."""
        return types.MappingProxyType(self._in_flight)

    @property
    def scheduled_on_worker(self) -> frozenset[str]:
        """Ids of the requests in flight that the current worker scheduled at least once, known once it has exited
        (its ledger is read before worker_exited is set); requests that only waited in its queue are not here.
        Kept after the exit, for whoever decides whom the death is blamed on; cleared by start()."""
        return frozenset(self._scheduled.intersection(self._in_flight))

    @property
    def worker_pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    # ------------------------------------------------------------------------------------------ worker lifecycle

    async def start(self) -> Ready:
        """Bring up the next worker: the standby when one is up or starting, else a new one with the next epoch;
        wait for its Ready, then send it every request in flight (one Resume).

        Raises WorkerStartError when the worker exits first, or sends no Ready
        within start_timeout (it is then killed), or cannot be spawned; its
        `out_of_descriptors` is True when that was for want of file
        descriptors, which a later start may find again. Requests in flight
        stay in flight. May be called again once the worker has exited."""
        self._move_to(WorkerState.STARTING)
        for name in EngineStats.CUMULATIVE:
            self._replaced_totals[name] += getattr(self.stats, name)
        self._replaced_step_histograms.add(self.stats.histograms())
        self.stats = EngineStats()
        self.worker_info, self.worker_exit, self._fatal = None, None, None
        self.first_progress_time = None
        self.num_requests_finished = 0
        self.is_retiring = False
        self._scheduled.clear()
        self._ready.clear()
        self.worker_exited.clear()
        self._channel = None
        if not await self._take_standby():
            await self._spawn()
        info = self.worker_info
        if info is None:  # both return only once the worker's Ready came
            raise RuntimeError("the engine worker started without a Ready message")
        self.start_error = None
        self._move_to(WorkerState.READY)
        resumed = self._resume_in_flight(with_kv=info.kv_shared)
        self._keep_standby(delay=NEXT_STANDBY_DELAY_S if resumed else 0.0)
        return info

    async def _take_standby(self) -> bool:
        """Put the standby (waiting for it if it is still starting) into service; False when there is none, or it
        died or timed out first."""
        standby, self.standby = self.standby, None
        self._stop_keeping_standby()
        if standby is not None:
            standby.hurry()
        if standby is None or not await standby.wait_ready(self.start_timeout):
            if standby is not None:
                await standby.close()
            return False
        channel, process, self.worker_info = standby.detach()
        self._channel, self._process = channel, process
        self.epoch = channel.epoch
        self._ready.set()
        self.last_message_time = time.monotonic()
        logger.info("the standby engine worker pid %d (epoch %d) takes over", process.pid, self.epoch)
        self._receive_task = asyncio.create_task(self._receive(channel))
        self._watch_task = asyncio.create_task(self._watch(process, channel))
        return True

    async def _spawn(self) -> None:
        """Spawn a worker with the next epoch and wait for its Ready (WorkerStartError when it fails)."""
        deadline = time.monotonic() + self.start_timeout
        try:
            channel, process = await self._launch()
        except WorkerStartError:
            self._move_to(WorkerState.EXITED)
            raise
        self._channel, self._process = channel, process
        self.epoch = channel.epoch
        logger.info("started engine worker pid %d (epoch %d)", process.pid, self.epoch)
        self._receive_task = asyncio.create_task(self._receive(channel))
        self._watch_task = asyncio.create_task(self._watch(process, channel))
        await self._wait_for_ready()
        await self._seal_channel(channel, deadline)

    async def _launch(self, is_standby: bool = False) -> tuple[WorkerChannel, asyncio.subprocess.Process]:
        """Bind a channel for the next epoch and spawn a worker on it (a standby, which starts at idle CPU priority,
        when `is_standby`). WorkerStartError when it cannot."""
        self._last_epoch += 1
        channel = None
        try:
            check_descriptors_to_start()
            channel = WorkerChannel(self._context, self.runtime_dir, self._last_epoch)
            process = await spawn_worker(WorkerArgs(self.runtime_dir, self._last_epoch, self.engine_config,
                                                    self.kv_segment, is_standby=is_standby), channel.secret)
        except (OSError, zmq.ZMQError) as exc:
            if channel is not None:
                channel.close()
            raise WorkerStartError(f"could not start the engine worker: {exc}", None,
                                   out_of_descriptors=exc.errno in _OUT_OF_DESCRIPTORS) from exc
        return channel, process

    def _resume_in_flight(self, with_kv: bool) -> bool:
        """Send the new worker every request in flight, in one Resume, with their KV holds when it shares the
        cache (`with_kv`). Whether there were any."""
        adds = [add for state in list(self._in_flight.values())
                if (add := self._add_message(state, with_kv=with_kv)) is not None]
        if adds:
            self._send(Resume(adds))
        return bool(adds)

    @property
    def has_ready_standby(self) -> bool:
        return self.standby is not None and self.standby.is_ready

    def _keep_standby(self, delay: float) -> None:
        """Have a standby started (after `delay` seconds) and restarted should it die while it waits."""
        if self.num_standby_workers and self._standby_task is None:
            self._standby_task = asyncio.create_task(self._standby_keeper(delay), name="standby keeper")

    def _stop_keeping_standby(self) -> None:
        if self._standby_task is not None and self._standby_task is not asyncio.current_task():
            self._standby_task.cancel()
        self._standby_task = None

    async def _standby_keeper(self, delay: float) -> None:
        retry = 1.0
        await asyncio.sleep(delay)
        while self.state is WorkerState.READY:
            self.standby = standby = StandbyWorker(self._launch(is_standby=True))
            if await standby.wait_ready(self.start_timeout):
                retry = 1.0
                await standby.exited.wait()
            if self.standby is standby:
                self.standby = None
                await standby.close()
            await asyncio.sleep(retry)
            retry = min(STANDBY_RETRY_MAX_S, 2 * retry)

    async def _wait_for_ready(self) -> None:
        waits = {asyncio.create_task(self._ready.wait()), asyncio.create_task(self.worker_exited.wait())}
        try:
            done, _ = await asyncio.wait(waits, timeout=self.start_timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                task.cancel()
        if self.state is WorkerState.STARTING and self.worker_info is not None:
            return
        if not done:
            self.kill_worker()
            await self.worker_exited.wait()
            raise WorkerStartError(f"the engine worker sent no READY within {self.start_timeout:g} s and was killed",
                                   self.worker_exit)
        await self.worker_exited.wait()
        raise WorkerStartError(f"the engine worker did not start: {self._last_exit.description}", self.worker_exit)

    async def _seal_channel(self, channel: WorkerChannel, deadline: float) -> None:
        """Seal the channel once the worker holds both connections: Ready came on the output, and the input's
        connection follows (the worker makes it first) unless the worker dies or start_timeout runs out."""
        if not await seal_when_connected(channel, self.worker_exited, deadline):
            self.kill_worker()
            await self.worker_exited.wait()
            raise WorkerStartError("the engine worker sent READY but did not connect to its input socket: "
                                   f"{self._last_exit.description}", self.worker_exit)

    def retire_worker(self) -> None:
        """Ask the ready worker to stop after the step it is in (Shutdown); its exit follows, with the requests in
        flight left for the next worker."""
        if self.state is not WorkerState.READY:
            raise RuntimeError(f"cannot retire the engine worker: it is {self.state.name}, not READY")
        self.is_retiring = True
        self._send(Shutdown())

    def kill_worker(self) -> None:
        """SIGKILL the worker's whole process group (a hung CUDA context ignores SIGTERM); its exit follows."""
        if self._process is None or self._process.returncode is not None:
            return  # once reaped, its pid (and group id) may belong to someone else
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._process.pid, signal.SIGKILL)

    async def close(self) -> None:
        """Stop the worker (Shutdown; SIGKILL to its group after shutdown_timeout), fail what is still in flight,
        remove the socket files and the worker's ledger."""
        if self.state is WorkerState.CLOSED:
            return
        self._move_to(WorkerState.CLOSED)
        self._stop_keeping_standby()
        if self.standby is not None:
            await self.standby.close()
            self.standby = None
        if self._watch_task is not None and not self._watch_task.done():
            self._send(Shutdown())
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._watch_task), self.shutdown_timeout)
        self.kill_worker()  # when Shutdown was not enough
        if self._watch_task is not None:
            await self._watch_task
        self.fail_all("the server is shutting down; the request was not completed")
        self._close_channel()
        self._context.destroy(linger=0)

    async def _watch(self, process: asyncio.subprocess.Process, channel: WorkerChannel) -> None:
        returncode = await process.wait()
        await self._drain_output(channel)
        self._scheduled.update(channel.read_scheduled())
        self._close_channel()
        self.worker_exit = worker_exit = WorkerExit(self.epoch, process.pid, returncode, self._fatal)
        self.profile.lose(worker_exit.description)
        self.prefix_cache_resets.lose(worker_exit.description)
        was_ready = self.state is WorkerState.READY
        if self.state is not WorkerState.CLOSED:
            self._move_to(WorkerState.EXITED)
        self.worker_exited.set()
        if not was_ready:
            self.start_error = worker_exit.fatal.message if worker_exit.fatal is not None else None
            return  # start() reports a worker that never got ready; close() expects the exit
        if self.is_retiring:
            logger.info("retired: %s", worker_exit.description)
        else:
            logger.warning("%s", worker_exit.description)
        if not self.supervised:
            self.fail_all(f"{worker_exit.description}; the request could not be completed")

    @property
    def _last_exit(self) -> WorkerExit:
        """The last worker's exit, known once worker_exited is set (and the state is EXITED)."""
        if self.worker_exit is None:
            raise RuntimeError(f"expected the engine worker's exit to be known, got none (state {self.state.name})")
        return self.worker_exit

    def _move_to(self, new_state: WorkerState) -> None:
        self.state = self.state.move_to(new_state)

    def _close_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()

    # ------------------------------------------------------------------------------------------ requests

    def add(self, state: RequestState) -> None:
        """Put a request in flight: sent now if a worker is ready, else with the next worker's Ready.

        A request without a seed is given one here, so that a re-queue draws the same tokens."""
        if self.state is WorkerState.CLOSED:
            raise RuntimeError(f"cannot add request {state.request_id}: the engine client is closed")
        if state.request_id in self._in_flight:
            raise ValueError(f"request id {state.request_id!r} is already in flight")
        if state.params.seed is None:
            state.params = dataclasses.replace(state.params, seed=self._seed_rng.getrandbits(SEED_BITS))
        if self.state is WorkerState.EXITED and not self.supervised:
            state.fail(f"{self._last_exit.description}; no engine worker is running")
            return
        self._in_flight[state.request_id] = state
        if self.state is WorkerState.READY:
            self._send_add(state)

    def abort(self, request_id: str) -> None:
        """Take a request out of flight now (a re-queue never revives it) and stop it in the worker, which frees
        its KV blocks within a step. Unless it already ended, its finish reason becomes "abort"."""
        state = self._in_flight.pop(request_id, None)
        self._scheduled.discard(request_id)
        if state is None:
            return
        if not state.is_finished:
            state.append([], None, FinishReason.ABORT.value)
        if self.state is WorkerState.READY:
            self._send(Abort((request_id,)))

    def fail_all(self, message: str) -> None:
        """Fail every request in flight with `message` and forget them."""
        states, self._in_flight = list(self._in_flight.values()), {}
        self._scheduled.clear()
        for state in states:
            state.fail(message)

    def _send_add(self, state: RequestState) -> None:
        add = self._add_message(state, with_kv=False)
        if add is not None:
            self._send(add)

    def _add_message(self, state: RequestState, with_kv: bool) -> Add | None:
        """The request with what remains of it: the tokens it has, the rest of max_tokens and min_tokens, its
        prompt logprobs unless all have come, and (with_kv) its KV hold. None, and the request finished, when
        nothing remains to generate."""
        num_done = len(state.output_token_ids)
        if num_done >= state.params.max_tokens:  # nothing left to generate (it reached max_tokens right then)
            del self._in_flight[state.request_id]
            state.append([], None, FinishReason.LENGTH.value)
            return None
        params = dataclasses.replace(state.params, max_tokens=state.params.max_tokens - num_done,
                                     min_tokens=max(0, state.params.min_tokens - num_done))
        if state.has_all_prompt_logprobs:  # nothing left to compute of them: the new worker may use its cache
            params = dataclasses.replace(params, prompt_logprobs=None)
        return Add(state.request_id, as_token_ids("prompt_token_ids", state.prompt_token_ids), params,
                   as_token_ids("output_token_ids", state.output_token_ids), state.priority, state.kv if with_kv else None)

    # ------------------------------------------------------------------------------------------ profiling

    def start_profile(self) -> None:
        """Have the ready worker profile its steps. ProfileConflict when it already does."""
        if not self.is_ready:
            raise RuntimeError(f"cannot start profiling: the engine worker is {self.state.name}, not READY")
        self.profile.start(self.epoch)
        self._send(StartProfile())

    async def stop_profile(self, profile_dir: str) -> ProfileResult:
        """Stop the worker's profiler and wait for its ProfileResult (written into profile_dir, an absolute path).
        ProfileConflict when it is not profiling or exits first; ProfileTimeout when it does not answer."""
        result = self.profile.stop()
        self._send(StopProfile(profile_dir))
        return await self.profile.wait(result)

    # ------------------------------------------------------------------------------------------ prefix cache

    async def reset_prefix_cache(self) -> PrefixCacheReset:
        """Have the ready worker forget every cached prefix, and wait until it has. ResetLost when it exits
        first; ResetTimeout when it does not answer."""
        if not self.is_ready:
            raise RuntimeError(f"cannot reset the prefix cache: the engine worker is {self.state.name}, not READY")
        answer = self.prefix_cache_resets.expect()
        self._send(ResetPrefixCache())
        return await self.prefix_cache_resets.wait(answer)

    def _send(self, msg: Message) -> None:
        if self._channel is None:  # start() cleared it and no worker has one yet: as good as a dead worker
            logger.warning("no engine worker to send %s to", msg.KIND)
            return
        try:
            self._channel.input.send_multipart(encode(msg), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            # No worker connected: it just died. Its exit is noticed next, and the requests in flight are
            # re-sent to its successor (or failed), so nothing is lost by dropping this message.
            logger.warning("no engine worker to send %s to", msg.KIND)

    # ------------------------------------------------------------------------------------------ receiving

    async def _receive(self, channel: WorkerChannel) -> None:
        while True:
            self._handle(channel, await channel.output.recv_multipart(copy=False))
            await asyncio.sleep(0)  # a ready recv does not yield: let the woken handlers run between steps

    async def _drain_output(self, channel: WorkerChannel) -> None:
        """After the exit: stop the receive task and read what the worker sent before dying."""
        if self._receive_task is not None:  # _spawn and _take_standby start it before the watch task
            self._receive_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._receive_task
        while await channel.output.poll(_DRAIN_AFTER_EXIT_MS):  # polls for POLLIN, the default
            self._handle(channel, await channel.output.recv_multipart(copy=False))

    def _handle(self, channel: WorkerChannel, frames: list[zmq.Frame]) -> None:
        msg = channel.accept(frames)
        if msg is None:
            self.num_dropped_messages_total += 1
            return
        self.last_message_time = time.monotonic()
        match msg:
            case Ready():
                self.worker_info = msg
                self._ready.set()
            case Outputs():
                self._route(msg)
            case Heartbeat():
                self.stats = msg.stats
            case ProfileResult():
                self.profile.finish(msg)
            case PrefixCacheReset():
                self.prefix_cache_resets.finish(msg)
            case Fatal():
                self._fatal = msg
                logger.error("the engine worker reported a fatal error: %s", msg.message)  # it logged the traceback

    def _take_prompt_logprobs(self, state: RequestState, update: RequestUpdate) -> bool:
        """Record the update's prompt logprobs. Ones that would leave a gap are the worker's error: the request
        fails (and is stopped in the worker) and False is returned; the receive loop and the other requests go on."""
        if update.prompt_logprobs is None:
            return True
        try:
            state.add_prompt_logprobs(update.prompt_logprobs_start, update.prompt_logprobs)
        except RuntimeError as exc:
            logger.error("%s", exc)
            del self._in_flight[state.request_id]
            self._send(Abort((state.request_id,)))
            state.fail(f"{exc}; the request could not be completed")
            return False
        return True

    def _route(self, outputs: Outputs) -> None:
        self.stats = outputs.stats
        if outputs.num_generation_tokens:  # a step ran: refusals and aborts alone are no progress
            self.last_progress_time = self.last_message_time
            if self.first_progress_time is None:
                self.first_progress_time = self.last_message_time
        self.num_prompt_tokens_total += outputs.num_prompt_tokens
        self.num_generation_tokens_total += outputs.num_generation_tokens
        for update in outputs.requests:
            state = self._in_flight.get(update.request_id)
            if state is None:
                continue  # aborted here already
            if update.error_kind == REFUSED:
                state.fail(f"the engine refused the request: {update.error}", error_type="invalid_request_error")
            elif update.error_kind == FAILED:
                state.fail(f"{update.error}; the request could not be completed", error_type="server_error")
            elif not self._take_prompt_logprobs(state, update):
                continue  # failed, and out of flight already
            else:
                state.append(update.new_token_ids.tolist(), update.logprobs, update.finish_reason)
            if update.is_finished:
                del self._in_flight[update.request_id]
                self.num_requests_finished += 1
        for progress in outputs.kv_progress:
            state = self._in_flight.get(progress.request_id)
            if state is not None:
                state.kv = progress.apply_to(state.kv)
