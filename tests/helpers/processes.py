"""A real process a test starts: wait until it is ready, or stop it and fail with its log; stop it, gently first.

    process = subprocess.Popen(command, ...)
    wait_until_ready(process, is_ready, "redis-server did not answer on port 6379", read_log, timeout=10.0,
                     stop=lambda: stop_process(process, grace_s=10.0))
    stop_process(process, grace_s=10.0)  # SIGTERM, then SIGKILL if it lingers; grace_s None: SIGKILL at once

The servers, redis and nginx of tests/helpers start and stop through these two, each with its own
readiness check, log and way of stopping.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable

from helpers.waiting import wait_until


def wait_until_ready(process: subprocess.Popen, is_ready: Callable[[], object], failure: str,
                     read_log: Callable[[], str], timeout: float, stop: Callable[[], object],
                     interval: float = 0.05) -> None:
    """Poll is_ready() every `interval` s until it is true. If the process exits first or `timeout` s pass,
    stop() it and raise an AssertionError: `failure`, the exit status and the log read after the stop."""
    try:
        wait_until(is_ready, timeout, interval, failure, give_up=lambda: process.poll() is not None)
    except AssertionError:
        stop()
        raise AssertionError(f"{failure} (exit status {process.poll()}); log:\n{read_log()}") from None


def stop_process(process: subprocess.Popen, grace_s: float | None = None, kill_group: bool = False) -> int | None:
    """Stop the process if it still runs and reap it; its exit status.

    grace_s: SIGTERM and this long to exit before SIGKILL; None, SIGKILL at once. kill_group: the SIGKILL goes
    to the process's whole group (one started with start_new_session, e.g. a master and its workers).
    """
    if process.poll() is not None:
        return process.returncode
    if grace_s is not None:
        process.terminate()
        try:
            return process.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    if kill_group:
        os.killpg(process.pid, signal.SIGKILL)  # the leader is unreaped, so its group id is still its own
    else:
        process.kill()
    return process.wait()
