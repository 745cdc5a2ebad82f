"""A server's processes as /proc shows them: a process's resident memory, the engine workers (the server's
children) and which of them serves the load. Linux only; only the standard library."""

from __future__ import annotations

import time
from pathlib import Path

CPU_SAMPLE_S = 0.3  # how long the server's children's CPU time is watched to tell the active worker


def rss_mib(pid: int) -> float | None:
    """The process's resident memory; None once it has exited (a zombie has no VmRSS)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    rss = [line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")]
    return int(rss[0]) / 1024 if rss else None


def stat_fields(stat: str) -> list[str]:
    """The fields of a /proc/PID/stat text from the 3rd on (state, ppid, ...): the command name before them is in
    parentheses and may hold spaces and parentheses itself."""
    return stat.rsplit(")", 1)[1].split()


def cpu_ticks(fields: list[str]) -> int:
    """utime + stime, in clock ticks, of stat_fields' list."""
    return int(fields[11]) + int(fields[12])


def process_cpu_ticks(pid: int) -> int | None:
    """The process's CPU time used, in clock ticks; None once it is gone."""
    try:
        return cpu_ticks(stat_fields(Path(f"/proc/{pid}/stat").read_text()))
    except OSError:
        return None


def worker_cpu_ticks(server_pid: int) -> dict[int, int]:
    """The server's live children (the engine workers): pid -> CPU time used, in clock ticks (from /proc/*/stat)."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_fields(stat.read_text())
        except OSError:
            continue
        if int(fields[1]) == server_pid and fields[0] not in ("Z", "X", "T", "t"):
            children[int(stat.parent.name)] = cpu_ticks(fields)
    return children


def active_worker_pid(server_pid: int) -> int:
    """The worker serving the load: the server's only child, or of several (a standby beside it) the busiest."""
    before = worker_cpu_ticks(server_pid)
    if len(before) <= 1:
        if not before:
            raise RuntimeError(f"the server (pid {server_pid}) has no worker process")
        return next(iter(before))
    time.sleep(CPU_SAMPLE_S)
    after = worker_cpu_ticks(server_pid)
    return max(after, key=lambda pid: after[pid] - before.get(pid, after[pid]))
