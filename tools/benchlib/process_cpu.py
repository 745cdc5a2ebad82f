"""Where the cores went during a load: the CPU seconds of a server's frontend, its workers and the load generator.

On a small machine the load generator and the frontend run on the cores the
worker computes on, so a load's tokens/s is theirs as much as the worker's.
CpuMeter reads each process's user and system time from /proc (Linux,
through tools/benchlib/server_process.py) at the start and at the end of a
load: the frontend (the server's process), its children (the worker and any
standby), and this process (the load generator, when it runs here). A worker
that starts during the load counts from zero; one that exits before its end
is missed (its time is lost with its /proc entry). Elsewhere than Linux
there is nothing to read and CpuMeter.stop() returns None.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from tools.benchlib.server_process import process_cpu_ticks, worker_cpu_ticks

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True, slots=True)
class CpuSplit:
    """CPU seconds over one load."""

    frontend: float
    workers: float  # the frontend's children (the worker, any standby) together
    load_generator: float | None  # None: the load ran elsewhere

    def as_dict(self) -> dict[str, float | None]:
        return {"frontend": self.frontend, "workers": self.workers, "load_generator": self.load_generator}

    def describe(self, output_tokens: int) -> str:
        """Microseconds of CPU per output token, each side."""
        def per_token(seconds: float) -> str:
            return f"{seconds / max(output_tokens, 1) * 1e6:.0f}"

        parts = [f"frontend {per_token(self.frontend)}", f"worker {per_token(self.workers)}"]
        if self.load_generator is not None:
            parts.append(f"load generator {per_token(self.load_generator)}")
        return "CPU us/token: " + ", ".join(parts)


class CpuMeter:
    """start() before a load and stop() after it: the CPU the server at `pid` (and its children) used meanwhile,
    and this process's own when `counts_self` (the load generator runs here)."""

    def __init__(self, pid: int, counts_self: bool = True) -> None:
        self.pid, self.counts_self = pid, counts_self
        self._start: dict[int, float] = {}
        self._own_start = 0.0

    def start(self) -> None:
        self._start = self._snapshot()
        self._own_start = time.process_time()

    def stop(self) -> CpuSplit | None:
        end = self._snapshot()
        if self.pid not in end or self.pid not in self._start:
            return None
        workers = sum(seconds - self._start.get(pid, 0.0) for pid, seconds in end.items() if pid != self.pid)
        own = time.process_time() - self._own_start if self.counts_self else None
        return CpuSplit(end[self.pid] - self._start[self.pid], workers, own)

    def _snapshot(self) -> dict[int, float]:
        ticks = {**worker_cpu_ticks(self.pid), self.pid: process_cpu_ticks(self.pid)}
        return {pid: value / CLOCK_TICKS for pid, value in ticks.items() if value is not None}
