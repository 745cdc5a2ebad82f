"""The worker's CPU thread count: the affinity mask and the cgroup quota bound it, --cpu-threads overrides it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpu_worker.native import cpu_threads

from helpers.checkpoints import make_checkpoint

needs_affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this OS")


def _run_python(code: str) -> str:
    """Run code in a fresh interpreter without OMP_NUM_THREADS (which would decide the default instead)."""
    env = {name: value for name, value in os.environ.items() if name != "OMP_NUM_THREADS"}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
                          check=True, env=env)
    return done.stdout.strip()


@needs_affinity
def test_a_process_pinned_to_one_cpu_runs_one_thread(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path)
    out = _run_python(f"""
        import os, torch
        os.sched_setaffinity(0, {{sorted(os.sched_getaffinity(0))[0]}})
        from gpu_worker.native.cpu_threads import available_cpus
        from gpu_worker.engine.engine import Engine
        from shared.config import EngineConfig
        Engine(EngineConfig(model={str(path)!r}, num_kv_blocks=8))
        print(available_cpus(), torch.get_num_threads())
    """)
    assert out.splitlines()[-1] == "1 1"


def test_omp_num_threads_is_honoured_as_torch_honours_it(monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads.default_threads() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "")
    assert cpu_threads.default_threads() == cpu_threads.available_cpus()


def test_cpu_threads_overrides_the_default(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path)
    out = _run_python(f"""
        import torch
        from gpu_worker.engine.engine import Engine
        from shared.config import EngineConfig
        Engine(EngineConfig(model={str(path)!r}, num_kv_blocks=8, cpu_threads=1))
        print(torch.get_num_threads())
    """)
    assert out.splitlines()[-1] == "1"


@pytest.mark.parametrize("cpu_max,expected", [("max 100000", None), ("150000 100000", 1.5), ("50000 100000", 0.5)])
def test_cgroup_v2_quota_is_read_from_cpu_max(tmp_path: Path, monkeypatch, cpu_max: str, expected) -> None:
    (tmp_path / "cpu.max").write_text(cpu_max + "\n")
    monkeypatch.setattr(cpu_threads, "CGROUP_ROOT", tmp_path)
    assert cpu_threads.cgroup_cpu_quota() == expected


def test_a_fractional_quota_rounds_up_to_whole_cpus(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    monkeypatch.setattr(cpu_threads, "CGROUP_ROOT", tmp_path)
    assert cpu_threads.available_cpus() == min(2, len(os.sched_getaffinity(0)))


def test_cgroup_v1_quota_when_there_is_no_v2_file(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("200000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    monkeypatch.setattr(cpu_threads, "CGROUP_ROOT", tmp_path)
    assert cpu_threads.cgroup_cpu_quota() == 2.0
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_threads.cgroup_cpu_quota() is None


def test_cpu_threads_below_one_is_refused() -> None:
    from shared.config import EngineConfig

    with pytest.raises(ValueError, match="cpu_threads"):
        EngineConfig(model="unused", cpu_threads=0)
