"""Idle CPU priority for a standby worker's start: its imports, model load and warm-up never take a core from serving.

Owns the loading thread of a standby (`run_at_idle_priority`). Knows
nothing of models: it runs whatever it is given.

Linux keeps the scheduling policy and the nice value per thread, and a new
thread inherits its creator's. Lowering them is always allowed, but an
unprivileged thread cannot come back: SCHED_IDLE -> SCHED_OTHER and nice
19 -> 0 both need CAP_SYS_NICE or an RLIMIT_NICE above its default 0
(sched(7), setpriority(2)). So the standby's main thread, which serves once
the standby takes over, never lowers itself. The heavy start runs on a
thread of its own that first lowers itself to SCHED_IDLE (and nice 19, what
tools show, and all that is left should SCHED_IDLE be refused): torch is
imported there, and the OpenMP team it computes with belongs to it
(libgomp keeps one team per thread that opens a parallel region) and
inherits its priority. When the start is done that thread exits, its team
with it, and the main thread goes on at normal priority: its first step
after a takeover makes its own team, at normal priority too.

Threads the start creates that outlive it keep the idle priority: torch's
pthreadpool (made by torch.set_num_threads, for QNNPACK/XNNPACK) and
numpy's OpenBLAS threads (numpy too is imported there). No step of ours
runs on either.

Per-thread priority counts between threads of one CPU cgroup (a systemd
unit, a container). Where the processes sit in the root cgroup with
autogroup on (a login session), Linux first splits the CPU between
sessions, and each worker has one of its own; the frontend weighs that
one down while the worker stands by (server/worker/standby.py).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

IDLE_NICE = 19  # the lowest priority a nice value gives
_Result = TypeVar("_Result")


def run_at_idle_priority(function: Callable[[], _Result], name: str = "standby-start") -> _Result:
    """function() on a new thread at idle priority, whose result it returns or whose exception it raises.

    Off Linux, where nice is per process and so could not come back, function() runs here at normal priority."""
    if not sys.platform.startswith("linux"):
        return function()
    outcome: list = []

    def run() -> None:
        lower_this_thread()
        try:
            outcome.append((True, function()))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, which decides
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    is_ok, value = outcome[0]
    if not is_ok:
        raise value
    return value


def lower_this_thread() -> None:
    """SCHED_IDLE and nice IDLE_NICE for the calling thread alone, and the threads it goes on to create."""
    tid = threading.get_native_id()
    os.setpriority(os.PRIO_PROCESS, tid, IDLE_NICE)  # Linux: `who` a thread id names that thread alone
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except OSError:
        pass  # refused (a seccomp filter, say): nice 19 alone still leaves the cores to serving
