"""Supervisor: keeps one engine worker serving, through hangs, crashes and failed starts.

Owns the worker's lifecycle as the service sees it (IDLE -> STARTING ->
READY -> RESTARTING -> BACKOFF -> STARTING ..., ending in STOPPED or
FAILED), the restart policy, poison-request accounting, readiness and the
recovery counters. Must not know HTTP, systemd or torch: the frontend reads
`is_ready` and the counters, and hears of state changes through
`on_state_change(old, new, detail)`.

How it works: run() starts a worker through the EngineClient and waits for
READY, then watches it: an exit (the client's worker_exited), or no message
for hang_timeout seconds (a live worker heart-beats every 0.25 s from its
loop thread; a hung step or a SIGSTOP stops that) ends the watch. Then the
worker's process group is SIGKILLed and reaped, requests that keep dying
with their workers are failed (PoisonTracker), and after an exponential,
capped back-off a new worker is started; EngineClient.start() re-sends
every request still in flight with the tokens it already has. More than
max_worker_restarts counted deaths within restart_window (RestartBudget;
deaths blamed on a failed poison request are forgiven, see
deaths.py) make run() raise SupervisorGaveUp, so the frontend exits
non-zero and systemd or Kubernetes takes over. So does, at once, a worker
that dies before READY with the same fatal error at two starts in a row
(StartFailures, server/worker/start_failures.py): a truncated checkpoint
or a bad config.json, which no restart can mend. A start that fails because
the frontend has run out of file descriptors is no death: it is retried
after a pause, off the budget, until descriptors are free again.

With a standby worker ready (StandbyKeeper.has_ready_standby) there is no
back-off: taking it into service spawns nothing, and the restart budget
still bounds a crash loop. Each recovery ends with one log line once the
new worker has produced its first token: the time from detecting the fault
to that token (also a histogram in /metrics), whether a standby took over,
and how many positions of the requests in flight had their KV adopted and
how many were recomputed.

Recycling (RecyclePolicy, server/worker/recycling.py): a worker whose
unexplained memory passes --worker-memory-limit, or that has finished
--worker-max-requests requests, is replaced through the same path as a
dead one (a standby and the Resume on the shared KV cache when they exist,
else a new worker and a re-queue), counted under its own cause, logged with
the figures that triggered it, and never charged to the restart budget or
to any request. It is drained, not killed: while a standby is still
starting, the old worker serves on until it is ready; then the old one is
sent Shutdown and ends the step it is in, so that nothing it computed is
lost. With no standby on its way (none configured, or the next one not yet
spawned, a second after a takeover) the old worker is drained the same way
and a new one started at once, the requests in flight waiting for it. One
that does not exit within hang_timeout is killed. A memory limit that a
worker's first memory sample already passes is below a fresh worker's
footprint, which no recycle can bring under it: rather than replace workers
in a loop, the supervisor logs an error and turns the memory limits off.

What clients hear of a failure is generic; the worker's pid, epoch and
exception text go to the log only (and the load error of a worker that
could not start, to /health's 503, for whoever operates the server).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from server.worker.deaths import PoisonTracker, RestartBudget
from server.worker.engine_client import EngineClient
from server.worker.process import WorkerStartError
from server.worker.recycling import CAUSE_MEMORY, RECYCLE_CAUSES, RecyclePolicy
from server.worker.request_state import Requeue
from server.worker.restart_policy import RestartPolicy
from server.worker.start_failures import StartFailures
from shared.protocol import EngineStats
from shared.step_metrics import HistogramCounts

CAUSE_EXIT, CAUSE_SIGNAL, CAUSE_HANG, CAUSE_START_FAILURE = "exit", "signal", "hang", "start_failure"
RESTART_CAUSES = (CAUSE_EXIT, CAUSE_SIGNAL, CAUSE_HANG, CAUSE_START_FAILURE, *RECYCLE_CAUSES)
_WATCH_TICKS_PER_TIMEOUT = 8  # hang checks per hang_timeout: a hang is seen within 1/8 of it
_MAX_WATCH_TICK_S = 0.25
_RECYCLE_WATCH_TICK_S = 0.05  # with recycling on: a worker past --worker-max-requests overshoots it by little
DESCRIPTOR_RETRY_S = 1.0  # pause before retrying a start that ran out of file descriptors
RECOVERY_FIRST_TOKEN_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

logger = logging.getLogger("pagedserve.supervisor")


class SupervisorState(enum.Enum):
    IDLE = "idle"  # run() not called yet
    STARTING = "starting"  # a worker is loading; no READY yet
    READY = "ready"
    RESTARTING = "restarting"  # the worker died or hung: kill, reap, account
    BACKOFF = "backoff"  # waiting before the next start
    STOPPED = "stopped"  # stop() was called: final
    FAILED = "failed"  # gave up restarting: final (stop() may still close the client)


class SupervisorEvent(enum.Enum):
    RUN = "run"
    WORKER_READY = "worker ready"
    START_FAILED = "start failed"
    WORKER_EXITED = "worker exited"
    WORKER_HUNG = "worker hung"
    WORKER_RECYCLED = "worker recycled"
    BACK_OFF = "back off"
    BACKOFF_ELAPSED = "back-off elapsed"
    GIVE_UP = "give up"
    STOP = "stop"


S, E = SupervisorState, SupervisorEvent
_TRANSITIONS = {
    (S.IDLE, E.RUN): S.STARTING,
    (S.STARTING, E.WORKER_READY): S.READY,
    (S.STARTING, E.START_FAILED): S.RESTARTING,
    (S.READY, E.WORKER_EXITED): S.RESTARTING,
    (S.READY, E.WORKER_HUNG): S.RESTARTING,
    (S.READY, E.WORKER_RECYCLED): S.RESTARTING,
    (S.RESTARTING, E.BACK_OFF): S.BACKOFF,
    (S.RESTARTING, E.GIVE_UP): S.FAILED,
    (S.BACKOFF, E.BACKOFF_ELAPSED): S.STARTING,
    **{(state, E.STOP): S.STOPPED for state in S if state is not S.STOPPED},
}
del S, E


def next_state(state: SupervisorState, event: SupervisorEvent) -> SupervisorState:
    try:
        return _TRANSITIONS[state, event]
    except KeyError:
        raise RuntimeError(f"the supervisor cannot handle event '{event.value}' in state '{state.value}'") from None


class SupervisorGaveUp(RuntimeError):
    """Raised by run() when the worker cannot be brought back: the frontend should exit non-zero, logging why (the
    message, one line)."""


@dataclass(frozen=True, slots=True)
class _Recovery:
    detected: float  # time.monotonic() when the fault was detected
    took_standby: bool
    counts: tuple[int, int]  # the adopted and recomputed totals at READY, before the Resume was applied


def _how(took_standby: bool) -> str:
    return "a standby took over" if took_standby else "a new worker was started"


class Supervisor:
    def __init__(self, engine_client: EngineClient, policy: RestartPolicy = RestartPolicy(), *,
                 on_state_change: Callable[[SupervisorState, SupervisorState, str], None] | None = None,
                 recycle: RecyclePolicy = RecyclePolicy()) -> None:
        """engine_client: built `supervised=True` with the policy's start_timeout, so that a worker's exit
        leaves its requests in flight for this supervisor to re-send."""
        if not engine_client.supervised:
            raise ValueError("the engine client must be built with supervised=True: else it fails the requests in "
                             "flight when its worker exits, before they can be re-sent")
        self.engine_client = engine_client
        self.policy = policy
        self.recycle = recycle
        self.on_state_change = on_state_change
        self.state = SupervisorState.IDLE
        self.restarts_by_cause: dict[str, int] = dict.fromkeys(RESTART_CAUSES, 0)
        self.requests_requeued_total = 0  # requests kept in flight across a worker's death, summed over deaths
        self.requests_poisoned_total = 0
        self.last_recovery_seconds: float | None = None  # from detecting a death (or killing a hung worker) to READY
        self.backoff_seconds: float | None = None  # the latest back-off
        self.poison = PoisonTracker(policy.max_request_restarts)
        self.budget = RestartBudget(policy.max_worker_restarts, policy.restart_window)
        self.start_failures = StartFailures()
        self.restarts_forgiven_total = 0  # deaths taken off the budget: blamed on a request failed as poison
        self.deaths_excused_total = 0  # deaths counted against the worker, not its suspects (PoisonTracker.excuses)
        self._memory_sampled_epoch: int | None = None  # the worker whose first memory sample was checked
        self._took_standby = False
        self.recovery_first_token = HistogramCounts(RECOVERY_FIRST_TOKEN_BUCKETS)  # fault detected -> next token
        self._outage_start: float | None = None
        self._pending_recovery: _Recovery | None = None  # a worker recovered that has not produced a token yet
        self._ready_time = 0.0
        self._run_task: asyncio.Task | None = None

    @property
    def restarts_remaining(self) -> int:
        """Counted worker deaths the restart limit still allows within its window before the server gives up."""
        return max(0, self.policy.max_worker_restarts - self.budget.num_counted(time.monotonic()))

    # ------------------------------------------------------------------------------------------ what /health reads

    @property
    def is_ready(self) -> bool:
        """A worker is READY and, when it has work, made progress within hang_timeout. Queues nothing."""
        client = self.engine_client
        if self.state is not SupervisorState.READY or not client.is_ready:
            return False
        in_flight = client.in_flight
        if not in_flight:
            return True
        # Progress is due only from when there was work: the oldest request in flight, or this worker's READY.
        since = max(client.last_progress_time or 0.0, self._ready_time,
                    min(state.arrival_time for state in in_flight.values()))
        return time.monotonic() - since <= self.policy.hang_timeout

    # ------------------------------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        """Start the worker and keep one serving until stop() (returns) or the restart budget is spent (raises
        SupervisorGaveUp, after failing every request in flight)."""
        self._run_task = asyncio.current_task()
        self._move(SupervisorEvent.RUN, "starting the engine worker")
        try:
            while True:
                failure = await self._start_worker()
                if failure is None:
                    failure = await self._watch()
                await self._recover(*failure)
        except asyncio.CancelledError:
            if self.state is SupervisorState.STOPPED:
                return  # stop() cancelled us
            raise

    async def stop(self) -> None:
        """Stop supervising, stop the worker (EngineClient.close()) and fail what is still in flight."""
        if self.state is SupervisorState.STOPPED:
            return
        self._move(SupervisorEvent.STOP, "shutting down")
        task = self._run_task
        if task is not None and task is not asyncio.current_task() and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await self.engine_client.close()

    async def _start_worker(self) -> tuple[str, str] | None:
        """None once the worker is READY; else (cause, description) of the failed start."""
        while True:
            try:
                ready = await self.engine_client.start()
                break
            except WorkerStartError as exc:
                if not exc.out_of_descriptors:
                    self.start_failures.on_start_failed(exc.worker_exit)
                    return CAUSE_START_FAILURE, str(exc)
                logger.error("cannot start the engine worker: %s; retrying in %g s (not counted as a restart)",
                             exc, DESCRIPTOR_RETRY_S)
                await asyncio.sleep(DESCRIPTOR_RETRY_S)
        self._ready_time = time.monotonic()
        self.start_failures.reset()
        self.poison.on_worker_ready(self.engine_client.in_flight)
        if self._outage_start is not None:
            self.last_recovery_seconds = self._ready_time - self._outage_start
            if self.engine_client.in_flight:  # else no token is due: the next one would time the next request
                self._pending_recovery = _Recovery(self._outage_start, self._took_standby, self._recovery_counts())
            else:
                logger.warning("recovered: ready %.3f s after the fault was detected, with no request in flight; %s",
                               self.last_recovery_seconds, _how(self._took_standby))
            self._outage_start = None
        self._move(SupervisorEvent.WORKER_READY, f"pid {ready.pid}, epoch {ready.epoch}")
        return None

    async def _watch(self) -> tuple[str, str]:
        """Wait for the ready worker to exit or hang; returns (cause, description)."""
        client = self.engine_client
        tick = min(_RECYCLE_WATCH_TICK_S if self.recycle.is_on else _MAX_WATCH_TICK_S,
                   self.policy.hang_timeout / _WATCH_TICKS_PER_TIMEOUT)
        while True:
            try:
                await asyncio.wait_for(client.worker_exited.wait(), tick)
            except asyncio.TimeoutError:
                self._forgive_if_serving()
                self._note_recovery_done()
                recycle = self._recycle_due()
                if recycle is not None:
                    return await self._retire(*recycle)
                last_message_time = client.last_message_time
                if last_message_time is None:  # a ready worker has sent its Ready at least
                    raise RuntimeError("expected the ready engine worker's last message time, got none")
                silence = time.monotonic() - last_message_time
                if silence > self.policy.hang_timeout:
                    return CAUSE_HANG, (f"the engine worker (pid {client.worker_pid}, epoch {client.epoch}) sent "
                                        f"nothing for {silence:.1f} s (hang timeout {self.policy.hang_timeout:g} s)")
                continue
            exit_info = client.worker_exit
            if exit_info is None:  # the client notes the exit before it sets worker_exited
                raise RuntimeError("expected the engine worker's exit once worker_exited is set, got none")
            return (CAUSE_SIGNAL if exit_info.returncode < 0 else CAUSE_EXIT), exit_info.description

    def _recycle_due(self) -> tuple[str, str] | None:
        """(cause, figures) when the ready worker is due to be recycled and a standby, if one is on its way, is
        ready to take over; else None."""
        client = self.engine_client
        if not self.recycle.is_on:
            return None
        if self._memory_sampled_epoch != client.epoch and client.totals.stats.rss_bytes > 0:  # its first sample
            self._memory_sampled_epoch = client.epoch
            self._check_fresh_worker_fits(client.totals.stats)
        if client.standbys.standby is not None and not client.standbys.has_ready_standby:
            return None
        return self.recycle.due(client.totals.stats, client.num_requests_finished)

    def _check_fresh_worker_fits(self, stats: EngineStats) -> None:
        """Turn the memory limits off, with an error, when a worker passes one in its first sample."""
        due = self.recycle.due(stats, 0)
        if due is None or due[0] != CAUSE_MEMORY:
            return
        client = self.engine_client
        logger.error("the engine worker (pid %s, epoch %s) starts over a memory limit: %s. A new worker would start "
                     "there too, so memory recycling is off; set the limit above a fresh worker's memory",
                     client.worker_pid, client.epoch, due[1])
        self.recycle = replace(self.recycle, memory_limit=None, cuda_memory_limit=None)

    async def _retire(self, cause: str, figures: str) -> tuple[str, str]:
        """Drain the worker (Shutdown: it ends its step and exits), killing it after hang_timeout; (cause, what)."""
        client = self.engine_client
        description = f"the engine worker (pid {client.worker_pid}, epoch {client.epoch}) is recycled: {figures}"
        logger.warning("%s", description)
        client.retire_worker()
        try:
            await asyncio.wait_for(client.worker_exited.wait(), self.policy.hang_timeout)
        except asyncio.TimeoutError:
            logger.error("the recycled engine worker did not stop within %g s: killing it", self.policy.hang_timeout)
            client.kill_worker()
            await client.worker_exited.wait()
        return cause, description

    async def _recover(self, cause: str, description: str) -> None:
        """Kill and reap, fail poison requests, then back off (or give up). Returns when it is time to start."""
        event = {CAUSE_HANG: SupervisorEvent.WORKER_HUNG, CAUSE_START_FAILURE: SupervisorEvent.START_FAILED,
                 **dict.fromkeys(RECYCLE_CAUSES, SupervisorEvent.WORKER_RECYCLED)}.get(
            cause, SupervisorEvent.WORKER_EXITED)
        self._move(event, description)
        if self._outage_start is None:
            self._outage_start = time.monotonic()
            self._pending_recovery = None
        client = self.engine_client
        if cause == CAUSE_HANG:
            client.kill_worker()  # SIGKILL to the group: a hung CUDA context ignores SIGTERM; SIGSTOP does not stop it
            await client.worker_exited.wait()
        self.restarts_by_cause[cause] += 1
        is_recycle = cause in RECYCLE_CAUSES
        num_counted = 0 if is_recycle else self._charge(cause, description)
        if cause != CAUSE_START_FAILURE:  # a worker that never got ready was sent no request
            self.requests_requeued_total += len(client.in_flight)
            now = time.monotonic()
            for state in client.in_flight.values():
                state.requeues.append(Requeue(now, cause, description))
        policy = self.policy
        self.backoff_seconds = min(policy.backoff_max, policy.backoff_initial * 2 ** (num_counted - 1))
        self._took_standby = client.standbys.has_ready_standby
        if self._took_standby or is_recycle:
            self.backoff_seconds = 0.0  # nothing is spawned, the standby is loaded and waiting; or no fault to wait out
        budget = "not counted toward the restart limit" if is_recycle else (
            f"restart {num_counted} of at most {policy.max_worker_restarts} within {policy.restart_window:g} s")
        logger.warning("restarting the engine worker in %.2f s (%s; cause: %s): %s; %d requests in flight will be "
                       "re-sent", self.backoff_seconds, budget, cause, description, len(client.in_flight))
        self._move(SupervisorEvent.BACK_OFF, f"next start in {self.backoff_seconds:.2f} s after {cause}")
        await asyncio.sleep(self.backoff_seconds)
        self._move(SupervisorEvent.BACKOFF_ELAPSED, f"restart after {cause}")

    def _charge(self, cause: str, description: str) -> int:
        """Charge a death to its suspects (failing those now poison) and to the restart budget, giving up when it
        is spent or the worker cannot start at all; the deaths that count within the window, this one included."""
        suspects, poisoned = frozenset(), []
        if cause != CAUSE_START_FAILURE:  # a worker that never got ready was sent no request
            suspects = self._suspects()
            if self.poison.excuses(suspects, before_first_step=self.engine_client.first_progress_time is None):
                self.deaths_excused_total += 1
                logger.warning("the engine worker died before its first step with only the %d requests resumed from "
                               "its predecessor scheduled: the death is counted against the worker, not them",
                               len(suspects))
                poisoned = self._fail_poisoned(frozenset())
            else:
                poisoned = self._fail_poisoned(suspects)
        if self.start_failures.cannot_start:
            self._stop_trying(self.start_failures.describe(),
                              f"the same load error at {self.start_failures.num_in_a_row} starts in a row")
        now = time.monotonic()
        if self.budget.is_spent(now):
            self._give_up(cause, description)
        self.budget.record(now, suspects)
        self.budget.blame_poison(poisoned)  # this death too
        return self.budget.num_counted(now)

    def _suspects(self) -> frozenset[str]:
        """The requests in the step that died, as its Fatal names them; else all it had scheduled."""
        client = self.engine_client
        fatal = client.worker_exit.fatal if client.worker_exit is not None else None
        if fatal is not None and fatal.request_ids:
            return frozenset(fatal.request_ids)
        return frozenset(client.in_flight.scheduled_on_worker)

    def _fail_poisoned(self, suspects: frozenset[str]) -> list[str]:
        """Fail the requests that are now poison; their ids."""
        poisoned = self.poison.on_worker_death(self.engine_client.in_flight, suspects)
        for state in poisoned:
            logger.error("failing request %s: a suspect in %d consecutive engine worker deaths", state.request_id,
                         self.poison.max_deaths)
            state.fail(f"the engine worker failed {self.poison.max_deaths} times in a row while running this "
                       "request, so it was stopped to protect the server's other requests", error_type="server_error")
            self.engine_client.abort(state.request_id)  # out of flight: the next worker never sees it
            self.requests_poisoned_total += 1
        return [state.request_id for state in poisoned]

    def _recovery_counts(self) -> tuple[int, int]:
        client = self.engine_client
        return client.totals.total("num_adopted_tokens_total"), client.totals.total("num_recomputed_tokens_total")

    def _note_recovery_done(self) -> None:
        """Once the recovered worker has produced a token: observe the time since the fault and log the line."""
        recovery, client = self._pending_recovery, self.engine_client
        if recovery is None or client.first_progress_time is None:
            return
        self._pending_recovery = None
        seconds = client.first_progress_time - recovery.detected
        self.recovery_first_token.observe(seconds)
        adopted, recomputed = (now - before for now, before in zip(self._recovery_counts(), recovery.counts))
        logger.warning("recovered: first token %.3f s after the fault was detected; %s; KV of %d positions adopted, "
                       "%d recomputed", seconds, _how(recovery.took_standby), adopted, recomputed)

    def _forgive_if_serving(self) -> None:
        """Deaths blamed on failed poison requests leave the budget once this worker makes progress."""
        progress_time = self.engine_client.last_progress_time
        if self.budget.has_forgivable and progress_time is not None and progress_time > self._ready_time:
            num_forgiven = self.budget.on_progress()
            self.restarts_forgiven_total += num_forgiven
            logger.info("%d worker deaths blamed on failed poison requests no longer count toward the restart "
                        "limit: the engine worker is serving again", num_forgiven)

    def _give_up(self, cause: str, description: str) -> None:
        message = (f"the engine worker could not be kept running: {self.budget.num_counted(time.monotonic())} "
                   f"restarts within {self.policy.restart_window:g} s, then {cause} ({description})")
        logger.critical("giving up: %s", message)
        self._stop_trying(message, message)

    def _stop_trying(self, reason: str, detail: str) -> None:
        """FAILED: fail every request in flight and raise SupervisorGaveUp(reason), for the frontend to exit with."""
        self._move(SupervisorEvent.GIVE_UP, detail)
        self.engine_client.in_flight.fail_all("the engine worker could not be kept running (it failed repeatedly) and the "
                                    "server is shutting down; the request could not be completed")
        raise SupervisorGaveUp(reason)

    def _move(self, event: SupervisorEvent, detail: str) -> None:
        old, self.state = self.state, next_state(self.state, event)
        logger.info("supervisor %s -> %s (%s): %s", old.value, self.state.value, event.value, detail)
        if self.on_state_change is not None:
            self.on_state_change(old, self.state, detail)
