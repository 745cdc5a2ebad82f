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
path. A receive task takes the worker's messages (the channel drops any without
the current epoch and secret; num_dropped_messages_total counts them) and
routes them to the parts that own them; a watch task awaits the exit.

The parts, one job each: `in_flight` (InFlightRequests, server/worker/in_flight.py):
the requests in flight, what Outputs do to them, the messages that re-send
them; `totals` (WorkerTotals): stats added up across workers; `standbys`
(StandbyKeeper): a warm standby kept behind the worker in service;
`control` (WorkerControl): profiling and prefix-cache resets.

Standby (num_standby_workers=1): start() after a death takes the standby
into service at once instead of spawning and loading a new one, and the next
standby starts a moment later. With a shared KV cache (kv_segment, the file
server/worker/kv_segment.py manages), every worker maps the same pool, the
Outputs tell each request's blocks (RequestState.kv), and the requests in
flight go to the next worker as one Resume that carries them, so that it
adopts their KV instead of recomputing it.

Recycling: retire_worker() asks the ready worker to stop (Shutdown): it
ends the step it is in, sends that step's Outputs, and exits 0; the requests
in flight stay, for the next worker, as after any exit.
`num_requests_finished` counts the requests the current worker finished.

Whom to blame for a worker's death: once it has exited,
`in_flight.scheduled_on_worker` names the requests it had scheduled (its
ledger is read before worker_exited is set), and a Fatal raised in a step
names that step's requests (`worker_exit.fatal.request_ids`).

When a ready worker exits (crash, kill, Fatal, a retirement, or an unasked-for clean
exit) and the client is `supervised`, the requests in flight stay: the
Supervisor owns recovery, start() again, which re-sends them, or
in_flight.fail_all(). Unsupervised, nothing will restart the worker, so the
client fails every request in flight, and every one added later, with the
exit's description.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
import os
import signal
import time
from pathlib import Path

import zmq
import zmq.asyncio

from server.worker.control_calls import WorkerControl
from server.worker.in_flight import InFlightRequests
from server.worker.process import (
    WorkerChannel,
    WorkerExit,
    WorkerStartError,
    WorkerState,
    check_descriptors_to_start,
    seal_when_connected,
    spawn_worker,
)
from server.worker.request_state import RequestState
from server.worker.restart_policy import DEFAULT_START_TIMEOUT_S
from server.worker.standby_keeper import StandbyKeeper
from server.worker.worker_totals import WorkerTotals
from shared.config import EngineConfig
from shared.protocol import (
    Abort,
    Fatal,
    Heartbeat,
    Message,
    Outputs,
    PrefixCacheReset,
    ProfileResult,
    Ready,
    Shutdown,
    encode,
)
from shared.vocabulary import FinishReason
from shared.worker_launch import INPUT_SOCKET, OUTPUT_SOCKET, WorkerArgs, socket_path

DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0
_DRAIN_AFTER_EXIT_MS = 100  # what a dead worker flushed before exiting (its last Outputs, its Fatal) is still read
# After a standby took over: the next one starts this much later, leaving the cores to the resumed requests first.
NEXT_STANDBY_DELAY_S = 1.0
_OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE)

logger = logging.getLogger("pagedserve.engine_client")


class EngineClient:
    def __init__(self, engine_config: EngineConfig, runtime_dir: Path, *,
                 supervised: bool = False, start_timeout: float = DEFAULT_START_TIMEOUT_S,
                 shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
                 kv_segment: Path | None = None, num_standby_workers: int = 0, debug_memory: bool = False) -> None:
        if num_standby_workers not in (0, 1):
            raise ValueError(f"num_standby_workers must be 0 or 1, got {num_standby_workers!r}")
        self.engine_config = engine_config
        self.runtime_dir = Path(runtime_dir)
        self.kv_segment = kv_segment
        self.num_standby_workers = num_standby_workers
        self.debug_memory = debug_memory  # the workers log a memory snapshot on SIGUSR2 (--debug-memory)
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
        self.totals = WorkerTotals()
        self.num_dropped_messages_total = 0  # received but not from the current worker (WorkerChannel.accept)
        self.last_message_time: float | None = None  # time.monotonic() of the current worker's last message
        self.last_progress_time: float | None = None  # ... of its last Outputs with generated tokens
        self.first_progress_time: float | None = None  # ... of its first
        self.num_requests_finished = 0  # by the current worker
        self.is_retiring = False  # retire_worker() asked the current worker to stop
        self.supervised = supervised  # a Supervisor restarts the worker: an exit fails nothing by itself
        self.in_flight = InFlightRequests(engine_config.seed, self._send)
        self.standbys = StandbyKeeper(lambda: self._launch(is_standby=True), start_timeout, lambda: self.is_ready)
        self.control = WorkerControl(self._send, lambda: (self.state, self.epoch))
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

    @property
    def is_ready(self) -> bool:
        return self.state is WorkerState.READY

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
        self.totals.roll_over()
        self.worker_info, self.worker_exit, self._fatal = None, None, None
        self.first_progress_time = None
        self.num_requests_finished = 0
        self.is_retiring = False
        self.in_flight.forget_scheduled()
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
        if self.kv_segment is not None and not info.kv_shared:
            logger.warning("engine worker %d keeps its KV cache private: it could not map the shared segment %s "
                           "(its log says why); so will every worker after it, and a successor recomputes the KV "
                           "of the requests in flight", info.pid, self.kv_segment)
            self.kv_segment = None  # one decision for the server: no later worker maps a segment this one could not
        resume = self.in_flight.resume(with_kv=info.kv_shared)
        if resume is not None:
            self._send(resume)
        if self.num_standby_workers:
            self.standbys.keep(delay=NEXT_STANDBY_DELAY_S if resume is not None else 0.0)
        return info

    async def _take_standby(self) -> bool:
        """Put the standby (waiting for it if it is still starting) into service; False when there is none, or it
        died or timed out first."""
        standby = self.standbys.take()
        if standby is None:
            return False
        standby.hurry()
        if not await standby.wait_ready(self.start_timeout):
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
                                                    self.kv_segment, is_standby=is_standby,
                                                    debug_memory=self.debug_memory), channel.secret)
        except (OSError, zmq.ZMQError) as exc:
            if channel is not None:
                channel.close()
            raise WorkerStartError(f"could not start the engine worker: {exc}", None,
                                   out_of_descriptors=exc.errno in _OUT_OF_DESCRIPTORS) from exc
        return channel, process

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
        await self.standbys.close()
        if self._watch_task is not None and not self._watch_task.done():
            self._send(Shutdown())
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._watch_task), self.shutdown_timeout)
        self.kill_worker()  # when Shutdown was not enough
        if self._watch_task is not None:
            await self._watch_task
        self.in_flight.fail_all("the server is shutting down; the request was not completed")
        self._close_channel()
        self._context.destroy(linger=0)

    async def _watch(self, process: asyncio.subprocess.Process, channel: WorkerChannel) -> None:
        returncode = await process.wait()
        await self._drain_output(channel)
        self.in_flight.note_scheduled(channel.read_scheduled())
        self._close_channel()
        self.worker_exit = worker_exit = WorkerExit(self.epoch, process.pid, returncode, self._fatal)
        self.control.lose(worker_exit.description)
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
            self.in_flight.fail_all(f"{worker_exit.description}; the request could not be completed")

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
        """Put a request in flight (InFlightRequests.add seeds it): sent now if a worker is ready, else with the next
        worker's Ready."""
        if self.state is WorkerState.CLOSED:
            raise RuntimeError(f"cannot add request {state.request_id}: the engine client is closed")
        if self.state is WorkerState.EXITED and not self.supervised:
            state.fail(f"{self._last_exit.description}; no engine worker is running")
            return
        self.in_flight.add(state)
        if self.state is WorkerState.READY:
            add = self.in_flight.add_message(state, with_kv=False)
            if add is not None:
                self._send(add)

    def abort(self, request_id: str) -> None:
        """Take a request out of flight now (a re-queue never revives it) and stop it in the worker, which frees
        its KV blocks within a step. Unless it already ended, its finish reason becomes "abort"."""
        state = self.in_flight.pop(request_id)
        if state is None:
            return
        if not state.is_finished:
            state.append([], None, FinishReason.ABORT.value)
        if self.state is WorkerState.READY:
            self._send(Abort((request_id,)))

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
                self._keep_thread_count(msg)
                self._ready.set()
            case Outputs():
                self._route(msg)
            case Heartbeat():
                self.totals.stats = msg.stats
            case ProfileResult() | PrefixCacheReset():
                self.control.finish(msg)
            case Fatal():
                self._fatal = msg
                logger.error("the engine worker reported a fatal error: %s", msg.message)  # it logged the traceback

    def _keep_thread_count(self, ready: Ready) -> None:
        """A worker that chose its CPU threads by timing them (gpu_worker/engine/thread_choice.py) chose for those
        after it: the standby, timed while this worker serves, would time a busy CPU, and a restart would pay the
        timing again."""
        if ready.cpu_threads and self.engine_config.cpu_threads is None:
            self.engine_config = dataclasses.replace(self.engine_config, cpu_threads=ready.cpu_threads)

    def _route(self, outputs: Outputs) -> None:
        self.totals.record(outputs)
        if outputs.num_generation_tokens:  # a step ran: refusals and aborts alone are no progress
            self.last_progress_time = self.last_message_time
            if self.first_progress_time is None:
                self.first_progress_time = self.last_message_time
        self.num_requests_finished += self.in_flight.route(outputs)
