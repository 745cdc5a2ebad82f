"""How many threads the worker's CPU work runs on: the CPUs this process may really use, unless told.

Owns the worker's torch/OpenMP thread count. Knows nothing of models.

Why not torch's own default: torch counts the machine's cores, but a
process under a CPU affinity mask (taskset, a cpuset) or a CPU quota (a
Kubernetes CPU limit, systemd's CPUQuota=) may use fewer. OpenMP threads
wait for each other at the end of every parallel region, so running more
threads than CPUs makes each step as slow as its most descheduled thread:
under a 2-CPU quota on a 64-core node, 64 threads spend most of each step
throttled. The default here is the smaller of the affinity mask and the
quota (rounded up to whole CPUs), unless OMP_NUM_THREADS says otherwise,
as it does for torch.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def default_threads() -> int:
    """OMP_NUM_THREADS when it is set to a count, else available_cpus()."""
    return requested_threads() or available_cpus()


def requested_threads() -> int | None:
    """OMP_NUM_THREADS when it is set to a count, else None."""
    requested = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(requested) if requested.isdigit() and int(requested) > 0 else None


def available_cpus() -> int:
    """CPUs this process may use: its affinity mask, capped by its cgroup's CPU quota when it has one."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    return max(1, min(cpus, math.ceil(quota))) if quota is not None else cpus


def cgroup_cpu_quota() -> float | None:
    """CPUs' worth of time per period this process's cgroup allows (cgroup v2 cpu.max, else v1 CFS), or None."""
    for limit in (_cgroup_v2_quota, _cgroup_v1_quota):
        try:
            quota = limit()
        except (OSError, ValueError):
            continue
        if quota is not None:
            return quota
    return None


def _cgroup_v2_quota() -> float | None:
    """`cpu.max` of this process's cgroup: "QUOTA PERIOD" in microseconds, QUOTA "max" when unlimited."""
    quota, period = (_own_cgroup_dir(CGROUP_ROOT, "") / "cpu.max").read_text().split()
    return None if quota == "max" else int(quota) / int(period)


def _cgroup_v1_quota() -> float | None:
    """cpu.cfs_quota_us / cpu.cfs_period_us of this process's cpu cgroup; a quota of -1 is unlimited."""
    directory = _own_cgroup_dir(CGROUP_ROOT / "cpu", "cpu")
    quota = int((directory / "cpu.cfs_quota_us").read_text())
    return None if quota <= 0 else quota / int((directory / "cpu.cfs_period_us").read_text())


def _own_cgroup_dir(mount: Path, controller: str) -> Path:
    """This process's cgroup under `mount` (from /proc/self/cgroup), or the mount itself when that path is not
    there (a container mounts its own cgroup as the root)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if (controller in controllers.split(",")) if controller else controllers == "":
            candidate = mount / path.lstrip("/")
            if candidate.is_dir():
                return candidate
    return mount
