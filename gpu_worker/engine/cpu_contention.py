"""Fewer compute threads while other busy processes hold the worker's CPUs, and back up once they let go.

Why: every parallel region of a step ends with its threads waiting for each
other, so a step runs at the pace of its most descheduled thread. Where
another busy process computes on the same CPUs (a second server, any
program using every core), each region waits for a scheduler slice: two
servers of the 4-layer model on one 2-core machine, each on 2 threads,
served 238 + 240 output tokens/s; each on 1 thread, 1,693 + 1,937; one alone
on 2 threads 3,057 (BENCHMARKS.md). The frontend's own share does not do
this: under its load the compute threads wait for a CPU 15-20% of the time,
against 53-55% beside a second server.

How: the worker loop hands `observe` the time and the seconds its threads
have spent runnable but waiting for a CPU (`run_delay_seconds`, from
/proc/self/task/*/schedstat) at most every WINDOW_S. Where that wait, per
compute thread, was above CONTENDED over the window, the count is halved
(down to 1). A count below the worker's own is doubled again after a
probe interval; a doubling that finds the CPUs still contended is halved at
the next window and the next try waits twice as long, up to MAX_PROBE_S.
A count asked for (--cpu-threads, $OMP_NUM_THREADS) is kept as it is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from gpu_worker.native.cpu_threads import requested_threads

WINDOW_S = 2.0  # the time each judgement covers
CONTENDED = 0.35  # the share of a window a compute thread may wait for a CPU before the count is halved
PROBE_S = 30.0  # how long a lowered count is kept before the worker's own is tried again, at first
MAX_PROBE_S = 480.0


def run_delay_seconds() -> float | None:
    """Seconds this process's threads have spent runnable but waiting for a CPU, summed over them; None where
    the kernel does not say (not Linux, or no schedstats)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    total, read = 0, False
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/schedstat") as stat:
                total += int(stat.read().split()[1])  # on-CPU ns, run_delay ns, timeslices
            read = True
        except (OSError, IndexError, ValueError):  # a thread that ended since the listing
            continue
    return total / 1e9 if read else None


def contended_threads(device_type: str, asked: bool, threads: int) -> ContendedThreads | None:
    """The governor of a worker that computes on `threads` CPU threads nobody asked for (`asked`: --cpu-threads,
    EngineConfig.cpu_threads_asked; $OMP_NUM_THREADS), where the kernel reports run_delay; else None (the count
    stays as it is). A count the frontend carried over from an earlier worker is not one asked for."""
    if device_type != "cpu" or asked or requested_threads() is not None or threads < 2:
        return None
    return ContendedThreads(threads, threads) if run_delay_seconds() is not None else None


@dataclass(slots=True)
class ContendedThreads:
    """The worker's compute thread count, lowered while its CPUs are contended. `full` is its own count."""

    full: int
    threads: int
    probe_s: float = PROBE_S
    _window_start: float | None = None
    _delay_start: float = 0.0
    _lowered_at: float = 0.0
    _probing: bool = False  # the count was just raised back: a contended window lowers it with a longer wait

    def due(self, now: float) -> bool:
        """Whether a window has passed since the last judgement (or none was made): time to read run_delay."""
        return self._window_start is None or now - self._window_start >= WINDOW_S

    def observe(self, now: float, run_delay: float) -> int | None:
        """Judge the window that ends now, given the process's run_delay seconds so far: the new count where it
        changes, else None. The first call only starts a window."""
        if self._window_start is None:
            self._window_start, self._delay_start = now, run_delay
            return None
        waited = (run_delay - self._delay_start) / max(now - self._window_start, 1e-9) / self.threads
        self._window_start, self._delay_start = now, run_delay
        if waited > CONTENDED and self.threads > 1:
            if self._probing:
                self.probe_s = min(2 * self.probe_s, MAX_PROBE_S)
            self.threads, self._lowered_at, self._probing = max(1, self.threads // 2), now, False
            return self.threads
        if self._probing:
            self._probing = False
            if self.threads == self.full:
                self.probe_s = PROBE_S  # the CPUs are the worker's again
        if self.threads < self.full and now - self._lowered_at >= self.probe_s:
            self.threads, self._probing = min(self.full, 2 * self.threads), True
            return self.threads
        return None
