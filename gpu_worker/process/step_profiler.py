"""StepProfiler: torch.profiler around the worker's steps, on and off at the frontend's word.

Owns one profiling session at a time: started by StartProfile, stopped by
StopProfile, after which two files go into the directory the message names
(created 0700 if missing): `worker-<epoch>-<UTC time>.txt`, a header line
(steps and wall seconds profiled) and the operators with the most self CPU
time, and `....json`, the chrome trace of the whole session, where each step
is a `worker step` range. Knows nothing of sockets or HTTP: WorkerLoop hands it
the messages and sends the ProfileResults it takes back.

The files are written on a side thread: turning a profile's events into the
table takes about 15 ms per step profiled, seconds for a long profile, and
the loop must go on stepping and heart-beating meanwhile, or the supervisor
takes it for hung. The thread hands its ProfileResult back through a Future
that the loop polls; sending stays on the loop's thread. A profile that
cannot be written is the profile's failure, not the worker's: the result
then carries the error and the worker serves on. Shapes are not recorded
(record_shapes=False), which keeps the profiler's own cost per operator
small.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from concurrent.futures import Future
from datetime import datetime, timezone
from pathlib import Path

import torch

from shared.protocol import OperatorTime, ProfileResult

NUM_TABLE_OPERATORS = 40  # rows of the table written and sent back
PROFILE_DIR_MODE = 0o700  # what the operator table reveals of the model is the server owner's business
STEP_RANGE = "worker step"  # one name for every step: its self time is what no torch operator covers
_SORT_KEY = "self_cpu_time_total"
_TIME_FORMAT = "%Y%m%dT%H%M%S.%fZ"  # microseconds: two sessions of one worker in one second keep their files

logger = logging.getLogger("pagedserve.worker")


class StepProfiler:
    def __init__(self, device_type: str, epoch: int, secret: str) -> None:
        self.activities = [torch.profiler.ProfilerActivity.CPU]
        if device_type == "cuda":
            self.activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.epoch = epoch
        self.secret = secret
        self._profiler: torch.profiler.profile | None = None  # None: not profiling
        self._num_steps = 0
        self._start_time = 0.0
        self._writing: collections.deque[Future[ProfileResult]] = collections.deque()  # stopped, being written

    @property
    def is_profiling(self) -> bool:
        return self._profiler is not None

    def start(self) -> None:
        if self.is_profiling:
            logger.warning("asked to start profiling while profiling already; the profile goes on")
            return
        self._profiler = torch.profiler.profile(activities=self.activities, record_shapes=False)
        self._profiler.start()
        self._num_steps, self._start_time = 0, time.monotonic()
        logger.info("profiling the steps")

    def step(self) -> contextlib.AbstractContextManager:
        """Around one step: a named range in the trace while profiling, nothing otherwise."""
        if not self.is_profiling:
            return contextlib.nullcontext()
        self._num_steps += 1
        return torch.profiler.record_function(STEP_RANGE)

    def stop(self, profile_dir: str) -> None:
        """Stop the profiler; its files are written into profile_dir on a side thread, so that the loop steps and
        heart-beats meanwhile. take_results() hands over the answer once it is written."""
        written: Future[ProfileResult] = Future()
        self._writing.append(written)
        profiler, self._profiler = self._profiler, None
        if profiler is None:
            written.set_result(self._failed("this worker is not profiling (it received no START_PROFILE)"))
            return
        profiler.stop()
        session = (profiler, self._num_steps, time.monotonic() - self._start_time)
        threading.Thread(target=self._write, args=(*session, profile_dir, written), name="profile-writer",
                         daemon=True).start()

    def take_results(self) -> list[ProfileResult]:
        """The answers to the StopProfiles whose profiles are written since the last call, in their order."""
        results = []
        while self._writing and self._writing[0].done():
            results.append(self._writing.popleft().result())
        return results

    def _write(self, profiler: torch.profiler.profile, num_steps: int, seconds: float, profile_dir: str,
               written: Future[ProfileResult]) -> None:
        try:
            written.set_result(self._write_files(profiler, num_steps, seconds, profile_dir))
        except Exception as exc:  # noqa: BLE001 - on this thread it would vanish, and the frontend wait in vain
            logger.exception("could not write the profile into %s", profile_dir)
            written.set_result(self._failed(f"could not write the profile into {profile_dir}: {exc}", num_steps,
                                            seconds))

    def _write_files(self, profiler: torch.profiler.profile, num_steps: int, seconds: float,
                     profile_dir: str) -> ProfileResult:
        averages = profiler.key_averages()
        header = f"# {num_steps} steps profiled in {seconds:.3f} s wall time (worker epoch {self.epoch})"
        table = f"{header}\n{averages.table(sort_by=_SORT_KEY, row_limit=NUM_TABLE_OPERATORS)}\n"
        name = f"worker-{self.epoch}-{datetime.now(timezone.utc).strftime(_TIME_FORMAT)}"
        table_path, trace_path = Path(profile_dir, f"{name}.txt"), Path(profile_dir, f"{name}.json")
        table_path.parent.mkdir(mode=PROFILE_DIR_MODE, parents=True, exist_ok=True)
        table_path.write_text(table)
        profiler.export_chrome_trace(str(trace_path))
        logger.info("profile of %d steps written to %s and %s", num_steps, table_path, trace_path)
        events = sorted(averages, key=lambda event: event.self_cpu_time_total, reverse=True)
        operators = [OperatorTime(event.key, event.count, event.self_cpu_time_total / 1e3)
                     for event in events[:NUM_TABLE_OPERATORS]]
        return ProfileResult(self.epoch, self.secret, num_steps, seconds, str(table_path), str(trace_path), table,
                             operators)

    def _failed(self, error: str, num_steps: int = 0, seconds: float = 0.0) -> ProfileResult:
        return ProfileResult(self.epoch, self.secret, num_steps, seconds, error=error)
