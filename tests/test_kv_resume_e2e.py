"""Worker faults under 16 streams of 300 tokens, with the KV cache in /dev/shm and a warm standby worker: real
processes (`python -m server`, its workers), the openai SDK as the client.

What must hold: after a worker dies or hangs mid-decode, is killed inside a
step (PAGEDSERVE_FAULT), or dies in the prefill, every stream still ends with
exactly 300 tokens and the very tokens of a fault-free run, in bfloat16 too
(the new worker adopts the KV blocks the dead one wrote instead of
recomputing them in other batches), and /metrics counts the restart and the
adopted tokens. The standby worker takes over; faults around it (a second
fault while its successor is still loading, two faults in quick succession,
the standby itself killed) lose nothing, and --max-worker-restarts still ends
a crash loop. The shared segment lives exactly as long as its server, and a
SIGKILLed server's segment is removed by the next server to start.

Each fault round runs on a server shared by the rounds of one checkpoint. A
PAGEDSERVE_FAULT spec is fixed when the server starts and names the worker
by epoch, so each step-fault round first retires idle workers (SIGKILL) until
the active one has the epoch its spec names: its step count then starts at 0
with the round. Rounds run in file order; epochs only grow.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import os
import re
import signal
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from shared.default_model import DEFAULT_MODEL_NAME

from helpers.completion_streams import Stream, run_streams
from helpers.metrics_scrape import rise, total
from helpers.processes import stop_process
from helpers.running_server import WAIT_S, RunningServer, start_server, stop_server, watch_health
from helpers.tiny_tokenizer import make_served_checkpoint

NUM_STREAMS = 16  # half greedy, half seeded sampling
MAX_TOKENS = 300
MID_DECODE_TOKENS = 60  # a signal is sent once every stream has this many tokens
HANG_TIMEOUT_S = 1.5
TINY_MODEL = "tiny"
# Random weights, sharpened by make_checkpoint: big enough that a changed KV row would change the text, small
# enough that a decode step of 16 streams takes a few ms on 2 cores.
BF16_SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=32)
# About 4x the steps' work, for the faults around the standby: the next standby starts a second after a takeover,
# and the streams must still be under way when it loads.
STANDBY_SHAPE = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
                     num_key_value_heads=2, head_dim=64)
# --target-itl-ms 0: every prompt is prefilled whole. The latency target cuts prompts into chunks that depend on
# when the requests arrived, and in bfloat16 another chunking is another text, fault or no fault (with it, two
# fault-free runs of the default model differ in 1-2 streams of 16). One compute thread: on two cores, a worker
# spinning on both leaves the frontend, the 16 client threads and a loading standby waiting (a round of the default
# model took 9-25 s on two threads under load, 3 s on one).
BASE_FLAGS = ("--device", "cpu", "--cpu-threads", "1", "--max-num-seqs", str(NUM_STREAMS), "--target-itl-ms", "0",
              "--kv-cache-memory", "64MiB", "--worker-hang-timeout", str(HANG_TIMEOUT_S))
FEATURE_FLAGS = ("--shared-kv-cache", "--standby-workers", "1")
# Many restarts in a row, each counted for a few seconds only, so the back-off stays short.
MANY_RESTARTS = ("--max-worker-restarts", "20", "--restart-window", "5")
SEGMENT = re.compile(r"pagedserve-kv-\d+-[0-9a-f]{8}")
OPENINGS = ["ROMEO: But soft, what light through yonder window breaks", "Once upon a time there was a small model",
            "What is the capital of France, asked the king", "The quick brown fox jumps over the lazy dog",
            "Now is the winter of our discontent made glorious summer", "A paged attention server keeps its cache",
            "Friends, Romans, countrymen, lend me your ears", "It said hello to the user and told a story"]
TAIL = ", and so the tale went on through the night, by the sea, until the morning came again and the"


# ---------------------------------------------------------------------------------------------- streams


def workload(model: str) -> list[dict]:
    """16 completions of MAX_TOKENS tokens (EOS ignored): even ones greedy, odd ones sampled with their own seed."""
    requests = []
    for i in range(NUM_STREAMS):
        sampling = {"temperature": 0.8, "seed": 7000 + i} if i % 2 else {"temperature": 0}
        requests.append({"model": model, "prompt": f"{OPENINGS[i % len(OPENINGS)]} ({i}){TAIL}",
                         "max_tokens": MAX_TOKENS, "logprobs": 0, "extra_body": {"ignore_eos": True}, **sampling})
    return requests


@dataclass
class Round:
    """The 16 streams of one round, under way in threads."""

    streams: list[Stream]
    futures: list[concurrent.futures.Future]
    events: list[str] = field(default_factory=list)  # what struck, and how far the streams were then

    def note(self, event: str) -> None:
        received = self.received()
        self.events.append(f"{event} at {min(received)}-{max(received)} tokens")

    def wait_mid_decode(self, server: RunningServer, tokens: int = MID_DECODE_TOKENS) -> None:
        server.wait_for(lambda: min(len(s.tokens) for s in self.streams) >= tokens, f"{tokens} tokens in every stream")

    def received(self) -> list[int]:
        return [len(s.tokens) for s in self.streams]

    def results(self) -> list[Stream]:
        return [future.result(timeout=WAIT_S) for future in self.futures]


def start_round(server: RunningServer, model: str) -> Round:
    return Round(*run_streams(server, workload(model)))


def differences(results: list[Stream], reference: list[Stream]) -> list[str]:
    """What sets each stream apart from the fault-free run: its length, finish, tokens or text; [] when none."""
    found = []
    for i, (got, expected) in enumerate(zip(results, reference)):
        if (got.finish_reason, got.completion_tokens, len(got.tokens)) != ("length", MAX_TOKENS, MAX_TOKENS):
            found.append(f"stream {i}: finish {got.finish_reason}, usage {got.completion_tokens} tokens, "
                         f"{len(got.tokens)} received (want length, {MAX_TOKENS}, {MAX_TOKENS})")
        elif got.tokens != expected.tokens or got.text != expected.text:
            k = next((k for k, (a, b) in enumerate(zip(got.tokens, expected.tokens)) if a != b), MAX_TOKENS)
            found.append(f"stream {i} ({'greedy' if i % 2 == 0 else 'sampled'}) differs from token {k}: "
                         f"{got.tokens[max(k - 4, 0):k + 4]} vs {expected.tokens[max(k - 4, 0):k + 4]}")
    return found


def assert_unchanged(round_: Round, reference: list[Stream], server: RunningServer) -> None:
    found = differences(round_.results(), reference)
    assert not found, (f"{NUM_STREAMS - len(found)}/{NUM_STREAMS} streams as in the fault-free run "
                       f"({'; '.join(round_.events)}):\n" + "\n".join(found) + f"\n{recovery_log(server)}")


# ---------------------------------------------------------------------------------------------- workers, metrics


@dataclass(frozen=True)
class Worker:
    pid: int
    epoch: int


def workers(server: RunningServer) -> list[Worker]:
    """The server's live worker processes (its `python -m gpu_worker` children, zombies left out), oldest epoch
    first: the active worker, then the standby started behind it."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state, ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # it exited meanwhile
        if int(ppid) == server.process.pid and state != "Z" and b"gpu_worker" in argv:
            found.append(Worker(int(entry.name), int(argv[argv.index(b"--epoch") + 1])))
    return sorted(found, key=lambda worker: worker.epoch)


def oldest_epoch(server: RunningServer) -> int:
    """The epoch of the active worker, the oldest live one; 0 while there is none."""
    return min((worker.epoch for worker in workers(server)), default=0)


def is_gone(pid: int) -> bool:
    """No such process, or only its zombie (which holds no files or locks)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def standby_ready(server: RunningServer) -> bool:
    return total(server.scrape(), "pagedserve:standby_worker_ready") == 1


def is_steady(server: RunningServer) -> bool:
    """Healthy, with a loaded standby behind the active worker."""
    return server.is_healthy() and standby_ready(server) and len(workers(server)) == 2


def recovery_log(server: RunningServer) -> str:
    """The recovery metrics and the supervisor's log lines, for failure messages."""
    lines = [line for line in server.log.read_text().splitlines() if "supervisor" in line or "recover" in line]
    metrics = [f"{key} {value:g}" for key, value in server.scrape().items() if "recover" in key or "restart" in key
               or "standby" in key]
    return "metrics:\n" + "\n".join(metrics) + "\nlog:\n" + "\n".join(lines[-30:])


RECOVERY_FIGURES = re.compile(r"(\d+)\D*adopted\D*(\d+)\D*recomputed")


def recovery_figures(server: RunningServer) -> list[tuple[int, int]]:
    """(adopted, recomputed) tokens of each recovery the log has a line for, in order."""
    matches = map(RECOVERY_FIGURES.search, server.log.read_text().splitlines())
    return [(int(match[1]), int(match[2])) for match in matches if match]


def retire_until(server: RunningServer, epoch: int) -> None:
    """SIGKILL idle active workers until the one of `epoch` is active, with a standby ready behind it."""
    while True:
        server.wait_for(lambda: is_steady(server), "a steady server: healthy, with a standby")
        active = workers(server)[0]
        assert active.epoch <= epoch, (f"the active worker is of epoch {active.epoch}, past {epoch} that the fault "
                                       "spec names: the rounds must run in file order")
        if active.epoch == epoch:
            return
        os.kill(active.pid, signal.SIGKILL)
        server.wait_for(lambda: is_gone(active.pid) and oldest_epoch(server) > active.epoch,
                        f"the worker after epoch {active.epoch}")


def terminate(server: RunningServer) -> int | None:
    """SIGTERM (the drain, which removes the server's segment) and its exit status; SIGKILL if it hangs on."""
    return stop_process(server.process, grace_s=WAIT_S)


def kill_leftovers(found: list[Worker]) -> None:
    """SIGKILL those of a stopped server's workers that outlived it, so that a failing test leaves none running."""
    for worker in found:
        if not is_gone(worker.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, signal.SIGKILL)


def shut_down(server: RunningServer) -> int | None:
    """terminate(), then kill_leftovers(); the exit status."""
    found = workers(server)
    status = terminate(server)
    kill_leftovers(found)
    return status


def bf16_checkpoint(tmp: Path, shape: dict = BF16_SHAPE) -> Path:
    return make_served_checkpoint(tmp, dtype=torch.bfloat16, **shape)


# ---------------------------------------------------------------------------------------------- 1: a fault per round


@dataclass(frozen=True)
class Fault:
    """One round's fault: a signal to the active worker mid-decode, or a PAGEDSERVE_FAULT spec for one epoch."""

    name: str
    cause: str  # the restart cause the supervisor counts
    mid_decode: bool
    signum: signal.Signals | None = None
    spec: str | None = None  # e.g. "exit@150"; ":epoch=E" is added
    epoch: int | None = None  # the worker of the spec


# A step-fault round starts on the worker its spec names (retire_until), so that worker's steps are the round's:
# "exit@1" strikes in the 2nd step, which prefills the prompts that came after the 1st (or, when all came in time
# for the 1st, is the first decode); "@150", 150 tokens into the streams.
FAULTS = [
    Fault("exit-in-prefill", "exit", mid_decode=False, spec="exit@1", epoch=2),
    Fault("exit-mid-decode", "exit", mid_decode=True, spec="exit@150", epoch=4),
    Fault("hang-mid-decode", "hang", mid_decode=True, spec="hang@150", epoch=6),
    Fault("sigkill-mid-decode", "signal", mid_decode=True, signum=signal.SIGKILL),
    Fault("sigstop-mid-decode", "hang", mid_decode=True, signum=signal.SIGSTOP),
]
# Every worker's steps held to at least 10 ms ("pace@0"): 300 tokens then take 3 s or more, however fast the machine,
# so a signal sent once the streams are under way lands before they end.
FAULT_ENV = {"PAGEDSERVE_FAULT": ",".join(["pace@0", *(f"{f.spec}:epoch={f.epoch}" for f in FAULTS if f.spec)])}


@dataclass
class Served:
    server: RunningServer
    model: str
    reference: list[Stream]  # the workload's fault-free streams


@pytest.fixture(scope="module", params=["default-model", "bf16-random"])
def fault_server(request, tmp_path_factory) -> Served:
    """A server of the embedded default model (its own dtype, bfloat16) or of a random bfloat16 checkpoint, armed
    with FAULT_ENV, and the fault-free streams of its first worker."""
    tmp = tmp_path_factory.mktemp(request.param)
    if request.param == "default-model":
        checkpoint, model, flags = None, DEFAULT_MODEL_NAME, ()
    else:
        checkpoint, model, flags = bf16_checkpoint(tmp), TINY_MODEL, ("--served-model-name", TINY_MODEL)
    server = start_server(tmp, checkpoint, *flags, *BASE_FLAGS, *FEATURE_FLAGS, *MANY_RESTARTS, env=FAULT_ENV)
    try:
        server.wait_for(lambda: is_steady(server), "a steady server: healthy, with a standby")
        reference = start_round(server, model).results()
        assert all(len(s.tokens) == MAX_TOKENS for s in reference), [len(s.tokens) for s in reference]
        yield Served(server, model, reference)
    finally:
        shut_down(server)


def strike(server: RunningServer, round_: Round, fault: Fault) -> None:
    """Send the fault's signal to the active worker once every stream is mid-decode (a spec fault strikes alone)."""
    if fault.signum is None:
        return
    round_.wait_mid_decode(server)
    active = workers(server)[0]
    os.kill(active.pid, fault.signum)
    round_.note(f"{fault.signum.name} to the worker of epoch {active.epoch}")
    assert max(round_.received()) < MAX_TOKENS, f"the fault must strike mid-decode: {round_.events}"


@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_16_streams_of_300_tokens_come_through_a_worker_fault_unchanged(fault_server, fault):
    server, label = fault_server.server, {"model_name": fault_server.model}
    if fault.epoch is not None:
        retire_until(server, fault.epoch)
    server.wait_for(lambda: is_steady(server), "a steady server: healthy, with a standby")
    before, logged = server.scrape(), len(recovery_figures(server))
    round_ = start_round(server, fault_server.model)
    strike(server, round_, fault)
    round_.results()
    server.wait_for(server.is_healthy, "/health 200 after the recovery")
    after = server.scrape()

    assert_unchanged(round_, fault_server.reference, server)
    restarts = rise(before, after, "pagedserve:worker_restarts_total", **label)
    by_cause = rise(before, after, "pagedserve:worker_restarts_total", cause=fault.cause, **label)
    adopted = rise(before, after, "pagedserve:recovery_tokens_total", kind="adopted", **label)
    recomputed = rise(before, after, "pagedserve:recovery_tokens_total", kind="recomputed", **label)
    timed = rise(before, after, "pagedserve:worker_recovery_first_token_seconds_count", **label)
    figures = (f"restarts +{restarts:g} ({fault.cause}: +{by_cause:g}), tokens adopted +{adopted:g}, recomputed "
               f"+{recomputed:g}, first tokens timed +{timed:g}\n{recovery_log(server)}")
    assert restarts == by_cause == 1, f"one restart, cause {fault.cause}: {figures}"
    assert timed >= 1, f"the recovery's first token is timed: {figures}"
    if fault.mid_decode:
        assert adopted > 0, f"the new worker adopts the streams' KV: {figures}"
    # A retired idle worker's recovery ends, and is logged, with this round's first token: it adopted nothing.
    lines = recovery_figures(server)[logged:]
    assert lines and [sum(column) for column in zip(*lines)] == [adopted, recomputed], \
        f"a log line for the recovery, with its adopted and recomputed tokens: {lines}; {figures}"
    assert total(after, "pagedserve:requests_poisoned_total", **label) == 0


# ---------------------------------------------------------------------------------------------- 2: around the standby


@pytest.fixture(scope="module")
def standby_server(tmp_path_factory) -> Served:
    """A random bfloat16 checkpoint's server with a standby, and the fault-free streams of its first worker."""
    tmp = tmp_path_factory.mktemp("standby")
    server = start_server(tmp, bf16_checkpoint(tmp, STANDBY_SHAPE), "--served-model-name", TINY_MODEL, *BASE_FLAGS,
                          *FEATURE_FLAGS, *MANY_RESTARTS)
    try:
        server.wait_for(lambda: is_steady(server), "a steady server: healthy, with a standby")
        yield Served(server, TINY_MODEL, start_round(server, TINY_MODEL).results())
    finally:
        shut_down(server)


def kill_active(server: RunningServer, round_: Round | None = None) -> Worker:
    """SIGKILL the active worker (noted in round_); it, once the server has reaped it."""
    active = workers(server)[0]
    os.kill(active.pid, signal.SIGKILL)
    if round_ is not None:
        round_.note(f"SIGKILL to the worker of epoch {active.epoch}")
    server.wait_for(lambda: is_gone(active.pid), f"the server to reap worker {active.pid}")
    return active


def finish_round(served: Served, round_: Round, before: dict[str, float], num_restarts: range) -> None:
    """Every stream as in the fault-free run, a number of restarts in num_restarts, and the server steady again."""
    server = served.server
    assert_unchanged(round_, served.reference, server)
    restarts = rise(before, server.scrape(), "pagedserve:worker_restarts_total", model_name=served.model)
    assert restarts in num_restarts, f"restarts +{restarts:g}, want {num_restarts}\n{recovery_log(server)}"
    server.wait_for(lambda: is_steady(server), "a steady server again: healthy, with a standby")


def test_a_second_fault_while_the_new_standby_is_still_loading(standby_server):
    server = standby_server.server
    server.wait_for(lambda: is_steady(server), "a steady server: healthy, with a standby")
    before = server.scrape()
    round_ = start_round(server, standby_server.model)
    round_.wait_mid_decode(server, tokens=10)
    first = kill_active(server, round_)
    resumed_at = sum(round_.received())
    server.wait_for(lambda: sum(round_.received()) >= resumed_at + NUM_STREAMS and len(workers(server)) == 2,
                    "the streams to go on, and a new standby to start")
    ready, alive = standby_ready(server), workers(server)
    second = kill_active(server, round_)
    assert not ready and len(alive) == 2 and max(round_.received()) < MAX_TOKENS, (
        f"the standby started after {first} died is still loading, and the streams are under way, when {second} "
        f"dies: standby ready {ready}, workers {alive}, {round_.events}")
    finish_round(standby_server, round_, before, num_restarts=range(2, 3))


def test_two_faults_in_quick_succession(standby_server):
    server = standby_server.server
    server.wait_for(lambda: is_steady(server), "a steady server: healthy, with a standby")
    before = server.scrape()
    round_ = start_round(server, standby_server.model)
    round_.wait_mid_decode(server)
    first = kill_active(server, round_)
    server.wait_for(lambda: oldest_epoch(server) > first.epoch, "the standby to be the oldest worker")
    kill_active(server, round_)  # whether or not it has taken over yet
    # A standby killed before it took over is no restart: the supervisor then starts a new worker.
    finish_round(standby_server, round_, before, num_restarts=range(1, 3))


def test_the_standby_killed_while_idle_is_replaced_and_then_takes_over(standby_server):
    server = standby_server.server
    server.wait_for(lambda: is_steady(server), "a steady server: healthy, with a standby")
    active, standby = workers(server)
    stop_polling = threading.Event()
    health = watch_health(server, stop_polling)
    os.kill(standby.pid, signal.SIGKILL)
    server.wait_for(lambda: is_gone(standby.pid), f"the server to reap the standby {standby.pid}")
    server.wait_for(lambda: is_steady(server), "a new standby")
    stop_polling.set()
    assert set(health) == {200}, f"/health stays 200 while only the standby dies: {sorted(set(health))}"
    assert workers(server)[0] == active, "the active worker serves on"
    before = server.scrape()
    round_ = start_round(server, standby_server.model)
    round_.wait_mid_decode(server)
    kill_active(server, round_)
    finish_round(standby_server, round_, before, num_restarts=range(1, 2))


def test_max_worker_restarts_still_ends_a_crash_loop_with_a_standby(tmp_path):
    server = start_server(tmp_path, make_served_checkpoint(tmp_path), *BASE_FLAGS, *FEATURE_FLAGS,
                          "--max-worker-restarts", "2", "--restart-window", "60")
    try:
        [segment] = segments_of(server)
        for restart in (1, 2):
            server.wait_for(lambda: is_steady(server), f"a steady server before fault {restart}")
            kill_active(server)
            server.wait_for(lambda: server.is_healthy() or server.process.poll() is not None, "/health 200")
            assert server.process.poll() is None, f"restart {restart} of at most 2 is allowed"
        server.wait_for(lambda: is_steady(server), "a steady server before the fault that spends the budget")
        kill_active(server)
        assert server.process.wait(timeout=WAIT_S) != 0, "giving up exits non-zero"
        assert "giving up" in server.log.read_text()
        assert not segment.exists(), "giving up removes the segment"
    finally:
        shut_down(server)


# ---------------------------------------------------------------------------------------------- 3: the segment


def segments_of(server: RunningServer) -> list[Path]:
    """The /dev/shm segments named after the server's pid."""
    return sorted(path for path in Path("/dev/shm").glob(f"pagedserve-kv-{server.process.pid}-*")
                  if SEGMENT.fullmatch(path.name))


def is_locked(path: Path) -> bool:
    """Whether another process holds a flock on the file."""
    with open(path, "rb") as file:
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(file, fcntl.LOCK_UN)
        return False


def test_the_segment_lives_while_the_server_runs_and_sigterm_removes_it(tmp_path):
    server = start_server(tmp_path, make_served_checkpoint(tmp_path), *BASE_FLAGS)  # the default: a shared cache
    found = workers(server)
    try:
        segments = segments_of(server)
        assert len(segments) == 1, f"one segment of the server: {sorted(os.listdir('/dev/shm'))}"
        info = segments[0].stat()
        assert (stat.S_IMODE(info.st_mode), info.st_uid) == (0o600, os.getuid())
        assert is_locked(segments[0]), "the server holds the segment's lock"
        assert terminate(server) == 0, server.log.read_text()
        assert not segments[0].exists(), "the drain removes the segment"
        assert all(is_gone(worker.pid) for worker in found), "the drain stops every worker"
    finally:
        shut_down(server)
        kill_leftovers(found)


def test_a_sigkilled_servers_segment_stays_until_the_next_start_removes_it(tmp_path):
    checkpoint = make_served_checkpoint(tmp_path)
    for name in ("live", "killed", "next"):
        (tmp_path / name).mkdir()
    live = start_server(tmp_path / "live", checkpoint, *BASE_FLAGS)
    killed = start_server(tmp_path / "killed", checkpoint, *BASE_FLAGS)
    killed.wait_for(lambda: is_steady(killed), "a standby behind the worker")
    orphans = workers(killed)
    servers = [live, killed]
    try:
        [killed_segment] = segments_of(killed)
        stop_server(killed)  # SIGKILL: no clean-up
        killed.wait_for(lambda: all(is_gone(w.pid) for w in orphans), "the killed server's workers to die with it",
                        timeout=10)
        assert killed_segment.exists(), "nothing removes a SIGKILLed server's segment"
        assert not is_locked(killed_segment), "its lock died with it"
        servers.append(start_server(tmp_path / "next", checkpoint, *BASE_FLAGS))
        assert not killed_segment.exists(), "the next server to start removes the stale segment"
        assert len(segments_of(live)) == 1, "a live server's segment stays"
        for server in (live, servers[-1]):
            [segment] = segments_of(server)
            assert terminate(server) == 0 and not segment.exists()
    finally:
        for server in servers:
            shut_down(server)
        kill_leftovers(orphans)
