"""Fewer compute threads while other busy processes share the worker's CPUs (gpu_worker/engine/cpu_contention.py).

The judgement itself is a function of the times and waits it is handed, tested here window by window. The wait
it is handed is the kernel's own: a process whose two busy threads share one CPU is seen waiting about half the
time. End to end, two servers computing on the same two CPUs each drop to one thread, say so in /metrics, and keep
streaming.
"""

import dataclasses
import json
import os
import subprocess
import sys
import threading

import pytest

from gpu_worker.engine.cpu_contention import (
    CONTENDED,
    MAX_PROBE_S,
    PROBE_S,
    WINDOW_S,
    ContendedThreads,
    contended_threads,
    run_delay_seconds,
)
from shared.config import EngineConfig
from shared.default_model import DEFAULT_MODEL_NAME

from helpers.running_server import start_server, stop_server
from helpers.waiting import wait_until

LINUX = sys.platform.startswith("linux")


class Windows:
    """A governor of `full` threads and what it is handed, window after window: the time, the run_delay so far."""

    def __init__(self, full: int = 4) -> None:
        self.governor = ContendedThreads(full, full)
        self.now = self.delay = 0.0
        assert self.governor.due(0.0)
        assert self.governor.observe(0.0, 0.0) is None  # the first call starts a window
        assert not self.governor.due(WINDOW_S / 2) and self.governor.due(WINDOW_S)

    def next(self, waited_share: float) -> int | None:
        """A window in which each compute thread waited `waited_share` of the time: the count asked for, or None."""
        self.delay += waited_share * WINDOW_S * self.governor.threads
        self.now += WINDOW_S
        return self.governor.observe(self.now, self.delay)


def test_a_contended_window_halves_the_count_down_to_one():
    windows = Windows()
    assert windows.next(CONTENDED + 0.1) == 2
    assert windows.next(CONTENDED + 0.1) == 1
    assert windows.next(0.9) is None and windows.governor.threads == 1


def test_the_frontends_share_of_waiting_keeps_the_count():
    windows = Windows()
    for _ in range(20):
        assert windows.next(0.2) is None  # what a server's own frontend and load cost its threads
    assert windows.governor.threads == 4


def test_the_count_comes_back_after_the_probe_and_stays_once_the_cpus_are_free():
    windows = Windows()
    assert windows.next(0.6) == 2
    lowered_at = windows.now
    while windows.now + WINDOW_S - lowered_at < PROBE_S:
        assert windows.next(0.1) is None
    assert windows.next(0.1) == 4  # tried again after PROBE_S
    assert windows.next(0.1) is None
    assert windows.governor.threads == 4 and windows.governor.probe_s == PROBE_S


def test_a_try_that_finds_the_cpus_still_busy_waits_twice_as_long_next_time():
    windows = Windows()
    assert windows.next(0.6) == 2
    waits = []
    for _ in range(6):
        lowered_at = windows.now
        while (count := windows.next(0.1)) is None:
            pass
        assert count == 4
        waits.append(windows.now - lowered_at)
        assert windows.next(0.6) == 2  # still contended: back down
    assert waits == [PROBE_S, 2 * PROBE_S, 4 * PROBE_S, 8 * PROBE_S, MAX_PROBE_S, MAX_PROBE_S]


def test_only_a_count_nobody_asked_for_on_the_cpu_is_governed(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert contended_threads("cuda", False, 2) is None
    assert contended_threads("cpu", True, 2) is None  # --cpu-threads
    assert contended_threads("cpu", False, 1) is None
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert contended_threads("cpu", False, 2) is None
    monkeypatch.delenv("OMP_NUM_THREADS")
    governed = contended_threads("cpu", False, 2)
    assert (governed is not None) == (LINUX and run_delay_seconds() is not None)


def test_a_count_carried_over_to_a_later_worker_is_not_one_asked_for():
    asked = EngineConfig(model="unused", cpu_threads=2)
    assert asked.cpu_threads_asked is True
    default = EngineConfig(model="unused")
    assert default.cpu_threads_asked is False
    # The frontend gives the workers after the first its count (EngineClient._keep_thread_count): still governed.
    carried = dataclasses.replace(default, cpu_threads=2)
    assert carried.cpu_threads == 2 and carried.cpu_threads_asked is False
    assert EngineConfig(**json.loads(json.dumps(dataclasses.asdict(carried)))).cpu_threads_asked is False


BUSY_PAIR = """
import os, threading, time
import torch
from gpu_worker.engine.cpu_contention import run_delay_seconds
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
torch.set_num_threads(1)
a = torch.randn(256, 256)
def busy(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        a @ a  # releases the GIL: both threads want the one CPU
start, delay = time.monotonic(), run_delay_seconds()
threads = [threading.Thread(target=busy, args=(1.5,)) for _ in range(2)]
for t in threads: t.start()
for t in threads: t.join()
print((run_delay_seconds() - delay) / (time.monotonic() - start))
"""


@pytest.mark.skipif(not LINUX or run_delay_seconds() is None, reason="run_delay is read from /proc (Linux)")
def test_two_busy_threads_on_one_cpu_are_seen_waiting():
    done = subprocess.run([sys.executable, "-c", BUSY_PAIR], capture_output=True, text=True, timeout=120, check=True)
    # Seconds waited per second, both threads together: each runs half the time on the one CPU, so about 1, and
    # more where other processes use that CPU too.
    waited = float(done.stdout.strip().splitlines()[-1])
    assert waited > 0.5, done.stdout


def _pinned_launcher(cpus: set[int]) -> tuple[str, ...]:
    """`python -m server` pinned to `cpus`, which its worker inherits."""
    code = (f"import os, runpy; os.sched_setaffinity(0, {cpus!r}); "
            "runpy.run_module('server', run_name='__main__', alter_sys=True)")
    return (sys.executable, "-c", code)


def _stream_until(server, stop: threading.Event, failures: list) -> None:
    client = server.client()
    while not stop.is_set():
        try:
            stream = client.completions.create(model=DEFAULT_MODEL_NAME, prompt="To be, or not to be", max_tokens=200,
                                               temperature=0, stream=True, extra_body={"ignore_eos": True})
            for _ in stream:
                pass
        except Exception as exc:  # noqa: BLE001 - reported by the test
            failures.append(repr(exc))
            return


@pytest.mark.skipif(not LINUX or len(os.sched_getaffinity(0)) < 2 or run_delay_seconds() is None,
                    reason="needs two CPUs to pin both servers to, and run_delay from /proc (Linux)")
def test_two_servers_on_the_same_two_cpus_each_drop_to_one_thread(tmp_path):
    cpus = set(sorted(os.sched_getaffinity(0))[:2])
    env = {"OMP_NUM_THREADS": ""}
    servers = []
    stop, failures, loads = threading.Event(), [], []
    try:
        for name in ("a", "b"):
            (tmp_path / name).mkdir()
            servers.append(start_server(tmp_path / name, None, "--standby-workers", "0", env=env,
                                        launcher=_pinned_launcher(cpus)))
        gauge = 'pagedserve:worker_cpu_threads{model_name="' + DEFAULT_MODEL_NAME + '"}'
        for server in servers:
            assert b"2 compute threads" in server.log.read_bytes(), server.log.read_text()
            wait_until(lambda s=server: s.scrape()[gauge] == 2.0, timeout=30,
                       message="/metrics to show the worker's two compute threads (its first stats)")
            for _ in range(6):
                loads.append(threading.Thread(target=_stream_until, args=(server, stop, failures), daemon=True))
        for load in loads:
            load.start()
        for server in servers:
            wait_until(lambda s=server: b"CPU threads: 2 -> 1" in s.log.read_bytes(), timeout=120,
                       message="each worker to drop to one compute thread")
            wait_until(lambda s=server: s.scrape()[gauge] == 1.0, timeout=30,
                       message="/metrics to show the worker's one compute thread")
    finally:
        stop.set()
        try:
            for load in loads:
                if load.ident is not None:  # started
                    load.join(60)
        finally:
            for server in servers:
                stop_server(server)
    assert not failures, failures
