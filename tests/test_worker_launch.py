"""The worker's launch contract (shared/worker_launch.py): what the frontend puts on a worker's command line comes
back out of it, --debug-memory and the resolved device included, and reaches the part of the worker that acts on
it; nothing travels in the environment."""

from __future__ import annotations

import os
import signal
import subprocess
import tracemalloc
from types import SimpleNamespace

import pytest

from server.api.memory_debug import MemoryDebug
from shared.config import EngineConfig
from shared.worker_launch import WorkerArgs, device_probe_command, parse_worker_args, worker_command


@pytest.mark.parametrize("debug_memory", [False, True])
def test_debug_memory_travels_on_the_command_line(tmp_path, debug_memory):
    argv = worker_command(WorkerArgs(tmp_path, 2, EngineConfig(model="m"), debug_memory=debug_memory))
    assert ("--debug-memory" in argv) is debug_memory
    assert parse_worker_args(argv[3:]).debug_memory is debug_memory  # argv[:3]: python -m gpu_worker


def test_the_engine_config_arrives_as_sent(tmp_path):
    config = EngineConfig(model="m", device="cpu", block_size=4, kv_cache_memory="2MiB", target_itl_ms=50)
    args = WorkerArgs(tmp_path, 7, config, tmp_path / "segment", parent_pid=1234, is_standby=True, debug_memory=True)
    assert parse_worker_args(worker_command(args)[3:]) == args


def test_enabling_memory_debugging_leaves_the_environment_alone():
    before = dict(os.environ)
    try:
        MemoryDebug.enable()
        assert tracemalloc.is_tracing()
    finally:
        tracemalloc.stop()
    assert dict(os.environ) == before


@pytest.mark.parametrize("debug_memory", [False, True])
def test_the_worker_answers_sigusr2_only_under_debug_memory(debug_memory):
    import torch

    from gpu_worker.process.memory_report import MemoryReport

    model = torch.nn.Linear(2, 2)
    runner = SimpleNamespace(device=torch.device("cpu"), model=model, kv_caches=[])
    report = MemoryReport(SimpleNamespace(runner=runner))
    previous = signal.getsignal(signal.SIGUSR2)
    try:
        assert report.install_debug_signal(debug_memory) is debug_memory
        assert (signal.getsignal(signal.SIGUSR2) == report.log_snapshot) is debug_memory
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_the_device_probe_answers_as_the_worker_decides():
    from gpu_worker.runner.model_runner import select_device

    probe = subprocess.run(device_probe_command(), capture_output=True, text=True, timeout=300, check=True)
    assert probe.stdout.split() == [select_device("auto").type]
