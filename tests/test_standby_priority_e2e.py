"""A standby worker never competes with the worker in service for the CPU: real processes (`python -m server` with a
standby, its workers), their threads' priorities and CPU time read from /proc.

While a standby starts (torch's import, the model's load, the warm-up and
calibration), the threads that do that work run at SCHED_IDLE and nice 19,
and its session is weighed as nice 19 (Linux's autogroup, which splits the
CPU between sessions first where the processes sit in the root cgroup);
its main thread, which serves after a takeover, stays at normal priority
but does next to nothing, then or while the standby waits. Once the active
worker is killed, the standby takes over: the next token comes within
0.5 s, every thread of it that works runs at normal priority, its session
at nice 0, and the next standby starts at idle priority again.

First, the parts alone: the --standby flag, run_at_idle_priority
(gpu_worker/process/priority.py) and SessionNice (server/worker/process.py).
"""

from __future__ import annotations

import asyncio
import collections
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gpu_worker.process.priority import IDLE_NICE, run_at_idle_priority
from server.worker import process as worker_process
from server.worker.process import SessionNice
from shared.config import EngineConfig
from shared.worker_launch import WorkerArgs, parse_worker_args, worker_command

from helpers.completion_streams import mixed_completions, run_streams
from helpers.running_server import START_TIMEOUT_S, WAIT_S, RunningServer, start_server, stop_server
from helpers.tiny_tokenizer import make_served_checkpoint

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="per-thread scheduling policies are Linux's")

MODEL = "tiny"
NUM_STREAMS = 16
MAX_TOKENS = 900  # the streams outlast the takeover by seconds (400 no longer did, once steps got faster)
SERVER_FLAGS = ("--served-model-name", MODEL, "--device", "cpu", "--dtype", "float32", "--max-num-seqs",
                str(NUM_STREAMS), "--kv-cache-memory", "64MiB", "--shared-kv-cache", "--standby-workers", "1")
Priority = tuple[int, int]  # (scheduling policy, nice)
NORMAL: Priority = (os.SCHED_OTHER, 0)
IDLE: Priority = (getattr(os, "SCHED_IDLE", 5), 19)
SAMPLE_PERIOD_S = 0.01
TICK_S = 1 / os.sysconf("SC_CLK_TCK")
MIN_START_CPU_S = 0.5  # a start costs more: torch's import alone is about a second of CPU
MAX_IDLE_WAIT_CPU_S = 0.05  # what a loaded standby may spend at normal priority in a second of waiting
MAX_RECOVERY_S = 0.5  # kill -> the next token on the streams
STANDBY = re.compile(r"started standby engine worker pid (\d+) \(epoch (\d+)\)")


# ---------------------------------------------------------------------------------------------- the parts


@pytest.mark.parametrize("is_standby", [False, True])
def test_the_worker_command_line_says_standby(tmp_path, is_standby):
    argv = worker_command(WorkerArgs(tmp_path, 3, EngineConfig(model="m"), is_standby=is_standby))
    assert ("--standby" in argv) is is_standby
    assert parse_worker_args(argv[3:]).is_standby is is_standby  # argv[:3]: python -m gpu_worker


def own_priority() -> tuple[Priority, int]:
    """This thread's (policy, nice) and its thread id."""
    return (os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0)), threading.get_native_id()


def test_run_at_idle_priority_lowers_its_thread_and_the_threads_it_creates_and_no_other():
    before = own_priority()

    def work() -> tuple:
        child: list = []
        thread = threading.Thread(target=lambda: child.append(own_priority()))
        thread.start()
        thread.join()
        return own_priority(), child[0]

    (priority, tid), (child_priority, _) = run_at_idle_priority(work)
    assert priority == child_priority == (os.SCHED_IDLE, IDLE_NICE)
    assert tid != before[1] and own_priority() == before, "the caller's thread keeps its priority"


def test_run_at_idle_priority_raises_what_its_function_raised():
    def fail() -> None:
        raise ValueError("no such checkpoint")

    with pytest.raises(ValueError, match="no such checkpoint"):
        run_at_idle_priority(fail)


def test_session_nice_is_set_and_set_back(tmp_path):
    async def run() -> list[int | None]:
        child = await asyncio.create_subprocess_exec("sleep", "30", start_new_session=True)
        try:
            seen = []
            for nice in (19, 0):
                SessionNice(child).set(nice)
                seen.append(session_nice(child.pid))
            return seen
        finally:
            child.kill()
            await child.wait()

    seen = asyncio.run(run())
    if seen == [None, None]:
        pytest.skip("no autogroup in this kernel")
    assert seen == [19, 0]


def test_session_nice_tries_again_when_the_kernel_refuses_for_its_rate_limit(monkeypatch, tmp_path):
    """Without CAP_SYS_ADMIN, Linux takes an autogroup's nice once per 100 ms, system-wide; EAGAIN else."""
    written: list[str] = []
    refusals = iter([True, True, False, True, False])

    class File:
        def __init__(self, path: str, mode: str) -> None:
            assert path == f"/proc/{os.getpid()}/autogroup" and mode == "w"

        def __enter__(self) -> File:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def write(self, text: str) -> None:
            if next(refusals):
                raise BlockingIOError(11, "Resource temporarily unavailable")
            written.append(text)

    class Process:
        pid, returncode = os.getpid(), None

    monkeypatch.setattr(worker_process, "open", File, raising=False)
    monkeypatch.setattr(worker_process, "_AUTOGROUP_RETRY_S", 0.01)

    async def run() -> None:
        session = SessionNice(Process())
        session.set(19)  # refused, then tried again: refused, then written
        await asyncio.sleep(0.1)
        session.set(5)
        session.set(0)  # before the retry of 5: that is dropped, and 0 written at once
        await asyncio.sleep(0.1)

    asyncio.run(run())
    assert written == ["19", "0"]


# ---------------------------------------------------------------------------------------------- /proc


def thread_states(pid: int) -> dict[int, tuple[Priority, float]]:
    """Each live thread of `pid`: its (policy, nice) and the CPU seconds it has used, from /proc/PID/task/TID/stat."""
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()  # fields[0] is stat's field 3, the state
        except OSError:
            continue  # the thread ended meanwhile
        utime, stime, nice, policy = int(fields[11]), int(fields[12]), int(fields[16]), int(fields[38])
        found[int(task.name)] = ((policy, nice), (utime + stime) * TICK_S)
    return found


def cpu_by_priority(pid: int, until: Callable[[], bool], min_s: float = 0.0) -> collections.Counter[Priority]:
    """CPU seconds the threads of `pid` use from now until until() holds (and at least min_s have passed), by the
    priority each had when sampled, every SAMPLE_PERIOD_S: a thread's use between two samples counts at the second
    one's priority; a thread seen for the first time brings all it used since it was created."""
    spent: collections.Counter[Priority] = collections.Counter()
    last = thread_states(pid)
    deadline, earliest = time.monotonic() + START_TIMEOUT_S, time.monotonic() + min_s
    while not until() or time.monotonic() < earliest:
        assert time.monotonic() < deadline, f"timed out watching pid {pid}: so far {dict(spent)}"
        time.sleep(SAMPLE_PERIOD_S)
        now = thread_states(pid)
        for tid, (priority, cpu_s) in now.items():
            spent[priority] += cpu_s - (last[tid][1] if tid in last else 0.0)
        last = now
    return spent


def session_nice(pid: int) -> int | None:
    """The nice value of pid's session as Linux's autogroup weighs it; None without autogroup."""
    try:
        return int(Path(f"/proc/{pid}/autogroup").read_text().split()[-1])  # "/autogroup-42 nice 19"
    except FileNotFoundError:
        return None


# ---------------------------------------------------------------------------------------------- the server's log


def standby_pid(server: RunningServer, epoch: int) -> int:
    """The pid of the standby of `epoch`, once the server has started it."""
    found: dict[int, int] = {}
    server.wait_for(lambda: found.update({int(e): int(p) for p, e in STANDBY.findall(server.log.read_text())})
                    or epoch in found, f"the standby of epoch {epoch}")
    return found[epoch]


def has_sent_ready(server: RunningServer, pid: int) -> bool:
    return re.search(rf"worker\[{pid}\] epoch \d+ INFO ready:", server.log.read_text()) is not None


def has_taken_over(server: RunningServer, pid: int) -> bool:
    return re.search(rf"the standby engine worker pid {pid} \(epoch \d+\) takes over", server.log.read_text()) is not None


# ---------------------------------------------------------------------------------------------- checks


def assert_starts_at_idle_priority(server: RunningServer, pid: int) -> None:
    """The start of standby `pid` is done at idle priority; its main thread does next to nothing meanwhile."""
    spent = cpu_by_priority(pid, lambda: has_sent_ready(server, pid))
    figures = {priority: round(seconds, 2) for priority, seconds in spent.items()}
    assert spent[IDLE] >= MIN_START_CPU_S, f"standby {pid}'s start runs at (SCHED_IDLE, 19): {figures}"
    assert spent[NORMAL] <= 0.1 * spent[IDLE], f"standby {pid} starts at normal priority too: {figures}"
    # The loading thread is sampled between its two changes at times (nice 19 first, then SCHED_IDLE).
    assert sum(spent.values()) - spent[IDLE] - spent[NORMAL] <= 2 * TICK_S, figures
    assert session_nice(pid) in (19, None), f"standby {pid}'s session: nice {session_nice(pid)}"


def next_token_after_kill(server: RunningServer, streams: list, active_pid: int) -> float:
    """SIGSTOP the active worker, let the tokens it sent arrive, then SIGKILL it: seconds to the next token."""
    os.kill(active_pid, signal.SIGSTOP)
    received = -1
    while received != (received := sum(len(s.pieces) for s in streams)):
        time.sleep(0.3)
    killed_at = time.monotonic()
    os.kill(active_pid, signal.SIGKILL)
    server.wait_for(lambda: sum(len(s.pieces) for s in streams) > received, "a token after the kill")
    return time.monotonic() - killed_at


def test_a_standby_starts_at_idle_priority_and_takes_over_at_normal_priority(tmp_path):
    server = start_server(tmp_path, make_served_checkpoint(tmp_path), *SERVER_FLAGS)
    try:
        active = server.worker_pid
        standby = standby_pid(server, epoch=2)
        assert_starts_at_idle_priority(server, standby)
        assert session_nice(active) in (0, None), "the worker in service is not weighed down"
        assert all(priority == NORMAL for priority, _ in thread_states(active).values()), thread_states(active)

        streams, futures = run_streams(server, mixed_completions(MODEL, NUM_STREAMS, MAX_TOKENS))
        server.wait_for(lambda: all(len(s.pieces) >= 8 for s in streams), "every stream under way")
        waiting = cpu_by_priority(standby, lambda: True, min_s=1.0)
        assert waiting[NORMAL] <= MAX_IDLE_WAIT_CPU_S, f"a loaded standby works while it waits: {dict(waiting)}"

        recovery_s = next_token_after_kill(server, streams, active)
        server.wait_for(lambda: has_taken_over(server, standby), "the standby to take over")
        serving = cpu_by_priority(standby, lambda: True, min_s=0.5)
        assert recovery_s <= MAX_RECOVERY_S, f"kill -> next token took {recovery_s:.2f} s"
        assert serving[NORMAL] >= 0.2 and sum(serving.values()) - serving[NORMAL] <= 2 * TICK_S, \
            f"the standby in service works at normal priority: {dict(serving)}"
        assert thread_states(standby)[standby][0] == NORMAL, "its main thread, which runs the steps"
        assert session_nice(standby) in (0, None), f"its session: nice {session_nice(standby)}"

        assert_starts_at_idle_priority(server, standby_pid(server, epoch=3))
        results = [future.result(timeout=WAIT_S) for future in futures]
        assert [r.completion_tokens for r in results] == [MAX_TOKENS] * NUM_STREAMS
    finally:
        stop_server(server)
