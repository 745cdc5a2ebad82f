"""The Supervisor with real worker processes behind an EngineClient: hangs, crashes, poison requests, crash loops,
and the systemd notify protocol. No HTTP here.

Every recovered request must end with exactly the tokens of a fault-free in-process Engine run. That holds
token for token only because the path is deterministic and the logits are decisive: float32 on the CPU, and
a sharpened checkpoint (tests/helpers/checkpoints.py) whose top logits are units apart, so a last-bit difference
between batch compositions (the restarted worker re-prefills in other batches than the reference did)
cannot flip a greedy pick or move a seeded draw across a boundary. The seeded draws themselves are keyed by
(seed, output index), so the k-th token of a resumed request is drawn with the same noise as without the
restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import random
import shutil
import signal
import socket
import tempfile
import time

import pytest

from server.__main__ import main
from server.sd_notify import SystemdNotifier, notify_address, supervisor_status_hook, watchdog_interval
from server.worker.deaths import PoisonTracker, RestartBudget
from server.worker.engine_client import EngineClient
from server.worker.process import WorkerExit
from server.worker.request_state import RequestState
from server.worker.restart_policy import RestartPolicy
from server.worker.runtime_dir import RuntimeDir
from server.worker.start_failures import StartFailures
from server.worker.supervisor import (
    Supervisor,
    SupervisorEvent,
    SupervisorGaveUp,
    SupervisorState,
    next_state,
)
from shared.config import EngineConfig
from shared.protocol import Fatal
from shared.sampling_params import SamplingParams
from shared.vocabulary import MIN_HANG_TIMEOUT_S

from helpers.waiting import wait_until_async

START_TIMEOUT_S = 60.0
WAIT_S = 45.0  # bound on any one wait, so a broken supervisor fails the test instead of hanging it
HANG_TIMEOUT_S = 2.0
wait_until = functools.partial(wait_until_async, timeout=WAIT_S)  # this module's longer bound
NUM_REQUESTS = 16  # half greedy, half seeded sampling
MAX_TOKENS = 32  # 512 tokens in all: the fault, sent at 32, strikes with most of them still to come
HEALTHY_MAX_TOKENS = 32  # the poison test's healthy requests: long enough to be mid-way when the poison arrives


@pytest.fixture(scope="module")
def engine_config(checkpoint) -> EngineConfig:
    return EngineConfig(model=str(checkpoint), dtype="float32", device="cpu", block_size=4, num_kv_blocks=256,
                        max_num_batched_tokens=64, max_num_seqs=16, max_model_len=128)


def workload() -> list[tuple[str, list[int], SamplingParams]]:
    rng = random.Random(11)
    requests = []
    for i in range(NUM_REQUESTS):
        prompt = [rng.randrange(3, 512) for _ in range(rng.randint(4, 12))]
        if i % 2:
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=1000 + i, ignore_eos=True)
        else:
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        requests.append((f"{'seeded' if i % 2 else 'greedy'}-{i}", prompt, params))
    return requests


def healthy_workload() -> list[tuple[str, list[int], SamplingParams]]:
    return [(f"healthy-{i}", prompt, SamplingParams(max_tokens=HEALTHY_MAX_TOKENS, temperature=0, ignore_eos=True))
            for i, (_, prompt, _) in enumerate(workload()[:4])]


@pytest.fixture(scope="module")
def expected(engine_config) -> dict[str, list[int]]:
    """Request id -> the fault-free in-process Engine's tokens, for workload() and healthy_workload()."""
    from gpu_worker.engine.engine import Engine
    from gpu_worker.engine.generate import generate  # torch, in the test process only

    engine = Engine(engine_config)
    requests = workload() + healthy_workload()
    completions = generate(engine, [prompt for _, prompt, _ in requests], [params for _, _, params in requests])
    return {request_id: c.token_ids for (request_id, _, _), c in zip(requests, completions)}


class Transitions:
    """on_state_change recorder: (new state, detail, tokens of each request in flight) per change."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor
        self.seen: list[tuple[SupervisorState, str, dict[str, int]]] = []
        self.backoffs: list[float] = []
        self.was_ready_outside_ready = False

    def __call__(self, old: SupervisorState, new: SupervisorState, detail: str) -> None:
        in_flight = {rid: len(s.output_token_ids) for rid, s in self.supervisor.engine_client.in_flight.items()}
        self.seen.append((new, detail, in_flight))
        if new is SupervisorState.BACKOFF:
            self.backoffs.append(self.supervisor.backoff_seconds)
        self.was_ready_outside_ready |= new is not SupervisorState.READY and self.supervisor.is_ready

    def at(self, state: SupervisorState) -> list[tuple[str, dict[str, int]]]:
        return [(detail, in_flight) for new, detail, in_flight in self.seen if new is state]


@contextlib.asynccontextmanager
async def supervised(config: EngineConfig, **options):
    """A running Supervisor over a fresh EngineClient, READY on entry; stopped on exit."""
    with RuntimeDir.create() as runtime_dir:
        client = EngineClient(config, runtime_dir.path, supervised=True, start_timeout=START_TIMEOUT_S,
                              shutdown_timeout=2.0)
        policy = RestartPolicy(**{"hang_timeout": HANG_TIMEOUT_S, "backoff_initial": 0.05, **options})
        supervisor = Supervisor(client, policy)
        transitions = Transitions(supervisor)
        supervisor.on_state_change = transitions
        task = asyncio.create_task(supervisor.run())
        try:
            await wait_until(lambda: supervisor.is_ready or task.done(), timeout=START_TIMEOUT_S)
            assert supervisor.is_ready, f"the first worker did not start: {task}"
            yield supervisor, task, transitions
        finally:
            await supervisor.stop()
        assert list(runtime_dir.path.iterdir()) == [], "socket files left behind"


def add_all(supervisor: Supervisor, requests) -> list[RequestState]:
    states = [RequestState(request_id, prompt, params) for request_id, prompt, params in requests]
    for state in states:
        supervisor.engine_client.add(state)
    return states


async def stream(state: RequestState) -> list[int]:
    """What a streaming handler would send: each update's tokens past those already sent."""
    sent: list[int] = []
    while not state.is_finished:
        await asyncio.wait_for(state.wait_for_update(), WAIT_S)
        sent += state.output_token_ids[len(sent):]
    return sent


def num_tokens(states: list[RequestState]) -> int:
    return sum(len(s.output_token_ids) for s in states)


# (how the worker is made to fail, PAGEDSERVE_FAULT for its first epoch, the restart cause the supervisor logs)
FAULTS = {
    "sigstop": (None, "hang"),  # frozen: no heartbeats, like a wedged GPU
    "injected-hang": ("hang@8:epoch=1", "hang"),  # sleeps forever inside step 9
    "sigkill": (None, "signal"),
    "raise-in-step": ("raise@8:epoch=1", "exit"),  # Fatal, exit status 1
}


def test_the_restart_policy_refuses_a_hang_timeout_that_a_live_idle_worker_could_reach():
    assert RestartPolicy(hang_timeout=MIN_HANG_TIMEOUT_S).hang_timeout == MIN_HANG_TIMEOUT_S
    with pytest.raises(ValueError, match="hang_timeout must be >= 1 seconds"):
        RestartPolicy(hang_timeout=MIN_HANG_TIMEOUT_S / 2)
    with pytest.raises(SystemExit) as exited:  # the CLI says so before anything starts
        main(["--worker-hang-timeout", str(MIN_HANG_TIMEOUT_S / 2)])
    assert exited.value.code == 2


@pytest.mark.asyncio
async def test_a_supervisor_takes_only_a_client_that_leaves_recovery_to_it(engine_config):
    with RuntimeDir.create() as runtime_dir:
        client = EngineClient(engine_config, runtime_dir.path)
        with pytest.raises(ValueError, match="supervised=True"):
            Supervisor(client)
        await client.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("fault", FAULTS)
async def test_every_request_completes_token_for_token_through_a_worker_failure(engine_config, expected, fault,
                                                                               monkeypatch):
    injected, cause = FAULTS[fault]
    # A signal's workers paced (every step 10 ms or more), so that it lands mid-generation however fast they run.
    monkeypatch.setenv("PAGEDSERVE_FAULT", injected or "pace@0")
    async with supervised(engine_config) as (supervisor, _, transitions):
        first_pid = supervisor.engine_client.worker_pid
        states = add_all(supervisor, workload())
        streams = [asyncio.create_task(stream(s)) for s in states]
        if injected is None:
            # mid-generation: polled every millisecond, for the rest takes the paced worker 300 ms or more
            await wait_until(lambda: num_tokens(states) >= 32, interval=0.001)
            os.kill(first_pid, signal.SIGSTOP if fault == "sigstop" else signal.SIGKILL)
        sent = await asyncio.wait_for(asyncio.gather(*streams), WAIT_S)
        for state, tokens in zip(states, sent):
            assert state.error is None, f"{state.request_id}: {state.error}"
            assert tokens == state.output_token_ids == expected[state.request_id], state.request_id
        [(detail, in_flight_at_death)] = transitions.at(SupervisorState.RESTARTING)
        assert any(0 < n < MAX_TOKENS for n in in_flight_at_death.values()), "the fault must strike mid-generation"
        assert supervisor.restarts_by_cause == {"exit": 0, "signal": 0, "hang": 0, "start_failure": 0, "memory": 0,
                                                "max_requests": 0} | {cause: 1}
        assert supervisor.requests_requeued_total == len(in_flight_at_death) > 0
        assert supervisor.requests_poisoned_total == 0
        assert 0 < supervisor.last_recovery_seconds < START_TIMEOUT_S
        assert supervisor.engine_client.worker_pid != first_pid and supervisor.engine_client.epoch == 2
        assert supervisor.is_ready and not transitions.was_ready_outside_ready
    with pytest.raises(ProcessLookupError):
        os.killpg(first_pid, 0)  # the old worker's whole group is gone


@pytest.mark.asyncio
async def test_a_poison_request_is_failed_and_healthy_requests_complete(engine_config, expected, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_FAULT", "exit-on-request=poison")  # every worker dies when it steps it
    async with supervised(engine_config, max_request_restarts=2) as (supervisor, task, transitions):
        healthy = add_all(supervisor, healthy_workload())
        streams = [asyncio.create_task(stream(s)) for s in healthy]
        await wait_until(lambda: all(len(s.output_token_ids) >= 3 for s in healthy))  # generating when it arrives
        [poison] = add_all(supervisor, [("poison-1", [7, 8, 9, 10], SamplingParams(max_tokens=8, temperature=0))])
        await asyncio.wait_for(asyncio.gather(*streams), WAIT_S)
        for state in healthy:
            assert state.error is None and state.output_token_ids == expected[state.request_id], state.request_id
        # The healthy requests can finish on the second worker before it steps the poison and dies of it.
        await wait_until(lambda: poison.error is not None)
        assert poison.error_type == "server_error" and poison.output_token_ids == []
        assert "failed 2 times in a row" in poison.error
        assert str(supervisor.engine_client.worker_pid) not in poison.error, "a client hears no pid or exit status"
        assert "poison-1" not in supervisor.engine_client.in_flight
        # 2 deaths counted against it, and one more if the second worker died in its first step (resumed
        # requests only, excused once): whether the re-sent poison is in that step is the scheduler's choice
        assert supervisor.restarts_by_cause["exit"] == 2 + supervisor.deaths_excused_total
        assert supervisor.deaths_excused_total <= 1 and supervisor.requests_poisoned_total == 1
        await wait_until(lambda: supervisor.is_ready)
        assert not task.done()


@pytest.mark.asyncio
async def test_requests_queued_behind_a_poison_request_are_not_blamed(engine_config, monkeypatch):
    """One sequence runs at a time: the poison kills two workers while four others wait, never scheduled.
    Only the poison is failed; the four then complete."""
    monkeypatch.setenv("PAGEDSERVE_FAULT", "raise-on-request=poison")  # each worker's Fatal names the step
    config = dataclasses.replace(engine_config, max_num_seqs=1)
    async with supervised(config, max_request_restarts=2) as (supervisor, task, transitions):
        [poison] = add_all(supervisor, [("poison-1", [7, 8, 9, 10], SamplingParams(max_tokens=8, temperature=0))])
        queued = add_all(supervisor, healthy_workload())
        await asyncio.wait_for(asyncio.gather(*(stream(s) for s in queued)), WAIT_S)
        assert poison.error is not None and all(s.error is None for s in queued)
        assert [len(s.output_token_ids) for s in queued] == [HEALTHY_MAX_TOKENS] * 4
        assert supervisor.requests_poisoned_total == 1 and supervisor.restarts_by_cause["exit"] == 3
        assert supervisor.deaths_excused_total == 1, "the second worker died in its first step, with the poison alone"
        assert not task.done()


@pytest.mark.asyncio
async def test_poison_requests_do_not_spend_the_restart_budget(engine_config, monkeypatch):
    """Two poison requests cost three worker deaths each (the second excused as the worker's), six in all,
    with a budget of five: the server used to give up. Their deaths are forgiven once a new worker serves a
    healthy request, so it stays up."""
    monkeypatch.setenv("PAGEDSERVE_FAULT", "exit-on-request=poison")
    async with supervised(engine_config, max_request_restarts=2, max_worker_restarts=5) as (supervisor, task, _):
        for i in range(2):
            [poison] = add_all(supervisor, [(f"poison-{i}", [7, 8, 9], SamplingParams(max_tokens=4, temperature=0))])
            await wait_until(lambda: poison.error is not None)
            [healthy] = add_all(supervisor, healthy_workload()[i:i + 1])
            assert len(await asyncio.wait_for(stream(healthy), WAIT_S)) == HEALTHY_MAX_TOKENS
            await wait_until(lambda: supervisor.budget.num_counted(time.monotonic()) == 0)
        assert supervisor.restarts_by_cause["exit"] == 6 and supervisor.restarts_forgiven_total == 6
        assert not task.done() and supervisor.is_ready


@pytest.mark.asyncio
async def test_a_worker_that_dies_on_every_request_still_makes_the_server_give_up(engine_config, monkeypatch):
    """Forgiveness needs a worker that serves again; one that dies whatever it is given never does."""
    monkeypatch.setenv("PAGEDSERVE_FAULT", "exit-on-request=poison")
    async with supervised(engine_config, max_request_restarts=2, max_worker_restarts=3) as (supervisor, task, _):
        for i in range(2):
            [poison] = add_all(supervisor, [(f"poison-{i}", [7, 8, 9], SamplingParams(max_tokens=4, temperature=0))])
            await wait_until(lambda: poison.error is not None or task.done())
        await asyncio.wait({task}, timeout=WAIT_S)
        with pytest.raises(SupervisorGaveUp):
            task.result()
        assert supervisor.restarts_forgiven_total == 0


@pytest.mark.asyncio
async def test_a_worker_that_cannot_restart_backs_off_then_gives_up(engine_config, tmp_path, monkeypatch):
    # Paced (every step 10 ms or more), so that the kill lands while "stranded" still generates however fast it runs.
    monkeypatch.setenv("PAGEDSERVE_FAULT", "pace@0")
    model_dir = tmp_path / "model"
    shutil.copytree(engine_config.model, model_dir)
    config = EngineConfig(**{**{f: getattr(engine_config, f) for f in engine_config.__dataclass_fields__},
                             "model": str(model_dir)})
    async with supervised(config, max_worker_restarts=2, backoff_initial=0.2) as (supervisor, task, transitions):
        [state] = add_all(supervisor, [("stranded", [5, 6, 7], SamplingParams(max_tokens=100, temperature=0,
                                                                                ignore_eos=True))])
        await wait_until(lambda: len(state.output_token_ids) >= 1)
        model_dir.rename(tmp_path / "model-gone")  # the next worker cannot load it
        os.kill(supervisor.engine_client.worker_pid, signal.SIGKILL)
        await wait_until(lambda: not supervisor.is_ready)
        readiness = []
        while not task.done():
            readiness.append(supervisor.is_ready)
            await asyncio.sleep(0.05)
        with pytest.raises(SupervisorGaveUp, match=r"cannot start: CheckpointError: .*checkpoint directory not found "
                                                    r"\(the same error at 2 starts in a row\)"):
            task.result()
        assert not any(readiness) and supervisor.state is SupervisorState.FAILED
        assert transitions.backoffs == [0.2, 0.4], "the back-off doubles"
        assert supervisor.restarts_by_cause == {"exit": 0, "signal": 1, "hang": 0, "start_failure": 2, "memory": 0,
                                                "max_requests": 0}
        assert "could not be kept running" in state.error and state.error_type == "server_error"
        assert not supervisor.engine_client.in_flight


@pytest.mark.asyncio
async def test_systemd_hears_ready_watchdog_status_and_stopping(engine_config, monkeypatch):
    directory = tempfile.mkdtemp(prefix="sdn-", dir="/tmp")  # a short path: sun_path holds 108 bytes
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(f"{directory}/notify")
    receiver.setblocking(False)
    monkeypatch.setenv("NOTIFY_SOCKET", f"{directory}/notify")
    monkeypatch.setenv("WATCHDOG_USEC", "200000")  # ping every 0.1 s
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    loop = asyncio.get_running_loop()
    notifier = SystemdNotifier.from_environ()
    assert notifier.watchdog_interval == 0.1
    messages: list[str] = []

    async def receive_until(line: str, count: int = 1) -> None:
        while messages.count(line) < count:
            data = await asyncio.wait_for(loop.sock_recv(receiver, 4096), WAIT_S)
            messages.extend(data.decode().split("\n"))

    try:
        with RuntimeDir.create() as runtime_dir:
            client = EngineClient(engine_config, runtime_dir.path, supervised=True, start_timeout=START_TIMEOUT_S)
            supervisor = Supervisor(client, on_state_change=supervisor_status_hook(notifier, start_timeout=60.0))
            task = asyncio.create_task(supervisor.run())
            await receive_until("READY=1")
            assert supervisor.is_ready
            assert messages[:2] == [f"EXTEND_TIMEOUT_USEC={90 * 10**6}",  # start_timeout + a margin for READY=1
                                    "STATUS=engine worker starting: starting the engine worker"]
            assert any(m.startswith("STATUS=engine worker ready: pid ") for m in messages)
            watchdog = notifier.start_watchdog()
            started = time.monotonic()
            await receive_until("WATCHDOG=1", count=4)
            assert time.monotonic() - started < 1.5, "pings come every 0.1 s"
            watchdog.cancel()  # nobody reads while we stop; a full socket queue would drop the lines below
            notifier.stopping("draining")
            await supervisor.stop()
            await receive_until("STATUS=engine worker stopped: shutting down")
            assert "STOPPING=1" in messages and "STATUS=draining" in messages
            assert task.done() and task.exception() is None
    finally:
        notifier.close()
        receiver.close()
        shutil.rmtree(directory)


def test_sd_notify_is_a_no_op_without_systemd_and_reads_its_environment(tmp_path):
    assert not SystemdNotifier.from_environ({}).ready()
    assert notify_address({"NOTIFY_SOCKET": "@pagedserve"}) == "\0pagedserve"
    assert notify_address({"NOTIFY_SOCKET": "/run/systemd/notify"}) == "/run/systemd/notify"
    assert watchdog_interval({}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}, pid=2) is None, "another's watchdog"
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "2"}, pid=2) == 15.0
    name = f"pagedserve-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as receiver:
        receiver.bind("\0" + name)  # the abstract namespace, as '@name' in $NOTIFY_SOCKET
        notifier = SystemdNotifier.from_environ({"NOTIFY_SOCKET": "@" + name})
        assert notifier.status("loading") and notifier.extend_timeout(1.5)
        assert receiver.recv(100) == b"STATUS=loading" and receiver.recv(100) == b"EXTEND_TIMEOUT_USEC=1500000"
        notifier.close()
    gone = SystemdNotifier(str(tmp_path / "nobody-listens"))
    assert not gone.watchdog(), "a failed send is reported, never raised"
    gone.close()


def test_supervisor_states_move_only_along_allowed_transitions():
    state = SupervisorState.IDLE
    for event in (SupervisorEvent.RUN, SupervisorEvent.WORKER_READY, SupervisorEvent.WORKER_HUNG,
                  SupervisorEvent.BACK_OFF, SupervisorEvent.BACKOFF_ELAPSED, SupervisorEvent.START_FAILED,
                  SupervisorEvent.GIVE_UP, SupervisorEvent.STOP):
        state = next_state(state, event)
    assert state is SupervisorState.STOPPED
    with pytest.raises(RuntimeError, match="cannot handle event 'worker hung' in state 'backoff'"):
        next_state(SupervisorState.BACKOFF, SupervisorEvent.WORKER_HUNG)
    with pytest.raises(RuntimeError, match="'stop' in state 'stopped'"):
        next_state(SupervisorState.STOPPED, SupervisorEvent.STOP)


def test_poison_tracker_spares_requests_that_were_generating_or_never_scheduled():
    tracker = PoisonTracker(max_deaths=2)
    busy, stuck, queued = (RequestState(rid, [1, 2], SamplingParams(max_tokens=50))
                           for rid in ("busy", "stuck", "queued"))
    in_flight = {"busy": busy, "stuck": stuck, "queued": queued}
    suspects = {"busy", "stuck"}  # "queued" never entered a step
    tracker.on_worker_ready(in_flight)
    busy.append([3, 4, 5], None, None)
    assert tracker.on_worker_death(in_flight, suspects) == []
    assert (tracker.deaths("busy"), tracker.deaths("stuck"), tracker.deaths("queued")) == (0, 1, 0)
    tracker.on_worker_ready(in_flight)
    busy.append([6], None, None)  # one token (a resumed request's re-prefill) is not progress
    assert tracker.on_worker_death(in_flight, suspects) == [stuck] and tracker.deaths("busy") == 1
    assert tracker.deaths("queued") == 0


def test_a_death_before_the_first_step_with_only_resumed_requests_is_the_workers_once_in_a_row():
    tracker = PoisonTracker(max_deaths=2)
    resumed, new = (RequestState(rid, [1, 2], SamplingParams(max_tokens=50)) for rid in ("resumed", "new"))
    tracker.on_worker_ready({"resumed": resumed})  # "new" arrives after this worker's READY
    assert not tracker.excuses({"resumed", "new"}, before_first_step=True), "a new request came in with it"
    assert not tracker.excuses({"resumed"}, before_first_step=False), "it had stepped"
    assert not tracker.excuses(set(), before_first_step=True), "nobody to excuse"
    assert tracker.excuses({"resumed"}, before_first_step=True)
    assert not tracker.excuses({"resumed"}, before_first_step=True), "not twice in a row: a poison stays findable"
    assert tracker.excuses({"resumed"}, before_first_step=True)


def test_restart_budget_forgives_only_deaths_blamed_on_poison_and_only_after_progress():
    budget = RestartBudget(max_restarts=3, window=60.0)
    budget.record(0.0, {"poison", "innocent"})
    budget.record(1.0, {"poison"})
    budget.record(2.0, set())  # died idle: nobody to blame
    assert budget.is_spent(2.0)
    budget.blame_poison(["poison"])
    assert budget.is_spent(2.0), "forgiven only once a worker has served again"
    assert budget.on_progress() == 2 and budget.num_counted(2.0) == 1
    assert budget.num_counted(62.5) == 0, "deaths leave the window"


def died_at_load(message: str | None, returncode: int = 1) -> WorkerExit:
    """How a worker that failed to start ended: with a Fatal of `message`, or (None) without a word."""
    return WorkerExit(1, 41, returncode, None if message is None else Fatal(1, "secret", message, "Traceback ..."))


BAD_HEADER = "CheckpointError: model.safetensors: not a readable safetensors file"


def test_start_failures_end_only_on_the_same_load_error_twice_in_a_row():
    failures = StartFailures()
    failures.on_start_failed(died_at_load(BAD_HEADER))
    assert not failures.cannot_start
    failures.on_start_failed(died_at_load(BAD_HEADER))
    assert failures.cannot_start
    assert failures.describe() == (f"the engine worker cannot start: {BAD_HEADER} (the same error at 2 starts in a "
                                   "row); giving up")
    failures.reset()  # a worker got ready
    failures.on_start_failed(died_at_load(BAD_HEADER))
    failures.on_start_failed(died_at_load("CheckpointError: config.json: not valid JSON"))
    assert not failures.cannot_start, "another error starts a new run"


@pytest.mark.parametrize("transient", [
    died_at_load(None, returncode=-9),  # killed by a signal (the OOM killer's SIGKILL), or for a start timeout
    died_at_load(BAD_HEADER, returncode=-9),  # its Fatal, then a signal
    died_at_load(None),  # exited without a word
    died_at_load("OSError: [Errno 24] Too many open files"),
    died_at_load("MemoryError: "),
    died_at_load("OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"),
    None,  # never spawned
])
def test_a_transient_start_failure_breaks_a_run_and_never_counts(transient):
    failures = StartFailures()
    for worker_exit in (died_at_load(BAD_HEADER), transient, died_at_load(BAD_HEADER), transient, transient):
        failures.on_start_failed(worker_exit)
        assert not failures.cannot_start


def test_fault_specs_parse_and_reject_typos():
    from gpu_worker.process.fault_injection import Fault, parse_faults

    assert parse_faults("hang@5, raise@3:epoch=1,exit-on-request=poison") == [
        Fault("hang", 5), Fault("raise", 3, epoch=1), Fault("exit", request_prefix="poison")]
    for bad in ("hang", "sleep@5", "hang@x", "exit-on-request="):
        with pytest.raises(ValueError, match="PAGEDSERVE_FAULT|fault action"):
            parse_faults(bad)
