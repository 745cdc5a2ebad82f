"""tools/benchlib/process_cpu.py: the CPU seconds of a real process tree, read from /proc around a stretch of work."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools.benchlib.process_cpu import CLOCK_TICKS, CpuMeter, CpuSplit
from tools.benchlib.server_process import cpu_ticks, process_cpu_ticks, stat_fields, worker_cpu_ticks

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="process CPU is read from /proc (Linux)")

BURN_S = 0.3
# A parent (the "frontend") that starts a child (the "worker"); the child burns BURN_S of CPU once the file `go`
# exists, then writes `done`; both then sleep until killed.
TREE = f"""
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", '''
import os, sys, time
go, done = sys.argv[1], sys.argv[2]
while not os.path.exists(go):
    time.sleep(0.01)
start = time.process_time()
while time.process_time() - start < {BURN_S}:
    pass
open(done, "w").close()
time.sleep(60)
''', sys.argv[1], sys.argv[2]])
print(child.pid, flush=True)
time.sleep(60)
"""


def _wait_for(path: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.01)


def test_the_meter_counts_a_descendants_cpu_to_the_workers(tmp_path):
    go, done = tmp_path / "go", tmp_path / "done"
    parent = subprocess.Popen([sys.executable, "-c", TREE, str(go), str(done)], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert child in worker_cpu_ticks(parent.pid)
        meter = CpuMeter(parent.pid)
        meter.start()
        go.touch()
        _wait_for(done)
        split = meter.stop()
        assert split is not None
        assert split.workers >= BURN_S - 0.05, split  # the clock ticks at 1/SC_CLK_TCK: a tick's slack
        assert split.frontend < BURN_S / 2, split  # the parent only slept
        assert split.load_generator is not None and split.load_generator >= 0
        assert process_cpu_ticks(child) / CLOCK_TICKS >= split.workers - 0.05
    finally:
        parent.kill()
        parent.wait()


def test_a_server_that_is_gone_has_no_split_and_no_cpu():
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    meter = CpuMeter(process.pid, counts_self=False)
    meter.start()
    process.wait()
    assert meter.stop() is None
    assert process_cpu_ticks(process.pid) is None


def test_the_stat_line_is_read_past_a_command_name_with_spaces_and_parentheses():
    stat = "123 (a) b (c)) S 1 123 123 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 1 0 100 1000 10"
    assert cpu_ticks(stat_fields(stat)) == 250 + 50


def test_per_token_figures_name_each_side():
    split = CpuSplit(frontend=0.5, workers=2.0, load_generator=0.25)
    assert split.describe(1000) == "CPU us/token: frontend 500, worker 2000, load generator 250"
    assert CpuSplit(0.5, 2.0, None).describe(1000) == "CPU us/token: frontend 500, worker 2000"
