"""Fault injection: a TEST FACILITY that makes the worker hang, raise or exit inside an engine step.

Off unless the environment variable PAGEDSERVE_FAULT is set (the worker
inherits the frontend's environment, so setting it where the server starts
is enough). Never set it in production. When it is unset, step_hooks()
returns None at once and the worker runs untouched: zero cost.

    PAGEDSERVE_FAULT = SPEC[,SPEC...]
    SPEC = ACTION@N[:epoch=E]               after N engine steps (counted from READY)
         | ACTION-on-request=PREFIX[:epoch=E]  whenever a request whose id starts with PREFIX is in the step's batch
    ACTION = hang    sleep forever inside the step (the loop thread stops, so do its heartbeats)
           | raise   raise InjectedFault inside the step (the worker reports Fatal and exits 1)
           | exit    os._exit(1) inside the step (no Fatal, no clean-up)
           | fail    (-on-request only) raise InjectedFault while sampling such a request: that request fails
                     alone and the worker carries on
           | leak    take one KV block out of the pool and never give it back (what a sequence forgotten without
                     being freed would do); the worker carries on, and its idle block audit should report it
           | grow    from then on, allocate GROW_BYTES_PER_STEP of memory in every step and keep it (a leak in
                     the worker's own memory); the worker carries on until it is recycled or killed
           | pace    from then on, make every step last at least PACE_STEP_S (no fault: it keeps a small model's
                     streams under way long enough for a test's signal to land mid-stream on a fast machine)

`:epoch=E` limits a spec to the worker of that epoch (1 = the first worker),
so a restarted worker does not fault again: e.g. "hang@20:epoch=1,exit@20:epoch=2".

How: step_hooks() gives the Engine, at its construction, StepHooks
(gpu_worker/engine/step_hooks.py) that it arms once warmed up: one wraps its
forward pass in a FaultInjector that counts steps and looks at the scheduled
batch before running it, so a fault strikes after scheduling and before the
step's outputs are sent: mid-step, as a real fault would. A `fail` fault
wraps the engine's Sampler instead, and raises whenever a request with its
prefix is among the rows to sample.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpu_worker.engine.step_hooks import StepHooks
from gpu_worker.sequence import Sequence
from shared.sampling_params import SamplingParams

if TYPE_CHECKING:
    from gpu_worker.kv.block_manager import BlockManager

ENV_VAR = "PAGEDSERVE_FAULT"
ACTIONS = ("hang", "raise", "exit", "fail", "leak", "grow", "pace")
GROW_BYTES_PER_STEP = 4 * 2**20
PACE_STEP_S = 0.01
_GROW_FILL = b"\xa5"  # written, so that the pages are resident (zeros from calloc would not be)
_LEAKED_REQUEST_ID = "fault-injection-leaked-block"
FAULT_EXIT_CODE = 1
_HANG_SLEEP_S = 3600.0
_SPEC = re.compile(r"(?P<action>[a-z]+)(?:@(?P<steps>\d+)|-on-request=(?P<prefix>[^:,]+))(?::epoch=(?P<epoch>\d+))?")

logger = logging.getLogger("pagedserve.worker.fault")


class InjectedFault(RuntimeError):
    """Raised inside a step by a `raise` fault."""


@dataclass(frozen=True, slots=True)
class Fault:
    action: str
    after_steps: int | None = None  # fire at the start of step after_steps + 1
    request_prefix: str | None = None  # or: fire whenever such a request is in the batch
    epoch: int | None = None  # None: in every worker

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"fault action must be one of {', '.join(ACTIONS)}, got {self.action!r}")
        if (self.after_steps is None) == (self.request_prefix is None):
            raise ValueError(f"a fault needs exactly one of after_steps and request_prefix, got {self!r}")
        if self.action == "fail" and self.request_prefix is None:
            raise ValueError(f"a fail fault names its request (fail-on-request=PREFIX), got {self!r}")

    def is_due(self, num_steps_done: int, request_ids: list[str]) -> bool:
        if self.request_prefix is None:  # then after_steps is set (__post_init__)
            return num_steps_done == self.after_steps
        return any(request_id.startswith(self.request_prefix) for request_id in request_ids)


def parse_faults(text: str) -> list[Fault]:
    """'hang@5,exit-on-request=poison:epoch=2' -> Faults; ValueError naming the bad spec."""
    faults = []
    for spec in filter(None, (part.strip() for part in text.split(","))):
        match = _SPEC.fullmatch(spec)
        if match is None:
            raise ValueError(f"{ENV_VAR} specs look like hang@5, raise@5:epoch=1 or exit-on-request=poison, "
                             f"got {spec!r}")
        steps, epoch = match.group("steps"), match.group("epoch")
        faults.append(Fault(match.group("action"), None if steps is None else int(steps), match.group("prefix"),
                            None if epoch is None else int(epoch)))
    return faults


class FaultInjector:
    """Wraps one ModelRunner.execute: counts steps and fires the first due fault before the forward pass."""

    def __init__(self, faults: list[Fault], execute: Callable, block_manager: BlockManager) -> None:
        self.faults = faults
        self.num_steps_done = 0
        self._execute = execute
        self._block_manager = block_manager  # the engine's, for a leak
        self.is_growing = False
        self.is_paced = False
        self._grown: list[bytes] = []  # what a grow fault allocated: kept for the life of the process

    def execute(self, scheduled):
        request_ids = [s.seq.request_id for s in scheduled.scheduled]
        for fault in self.faults:
            if fault.is_due(self.num_steps_done, request_ids):
                self._fire(fault, request_ids)
        if self.is_growing:
            self._grown.append(_GROW_FILL * GROW_BYTES_PER_STEP)
        self.num_steps_done += 1
        if not self.is_paced:
            return self._execute(scheduled)
        started = time.monotonic()
        outputs = self._execute(scheduled)
        time.sleep(max(0.0, started + PACE_STEP_S - time.monotonic()))
        return outputs

    def _fire(self, fault: Fault, request_ids: list[str]) -> None:
        logger.warning("injected fault %s at step %d (batch %s)", fault.action, self.num_steps_done + 1, request_ids)
        if fault.action == "hang":
            while True:
                time.sleep(_HANG_SLEEP_S)
        if fault.action == "raise":
            raise InjectedFault(f"injected fault: raise at step {self.num_steps_done + 1}")
        if fault.action == "leak":
            self._leak_block()
            return
        if fault.action == "grow":
            self.is_growing = True
            return
        if fault.action == "pace":
            self.is_paced = True
            return
        os._exit(FAULT_EXIT_CODE)

    def _leak_block(self) -> None:
        """Allocate one block for a sequence that is then dropped without being freed."""
        leaked = Sequence(_LEAKED_REQUEST_ID, [0], SamplingParams(max_tokens=1), seed=0)
        self._block_manager.allocate(leaked, 1)  # one token: no full block, so nothing enters the prefix cache
        logger.warning("injected fault: KV block %d leaked", leaked.block_table[0])


class SamplerFault:
    """Wraps one Sampler: raises InjectedFault when a request with one of the prefixes is among the rows."""

    def __init__(self, prefixes: list[str], sample: Callable) -> None:
        self.prefixes = tuple(prefixes)
        self._sample = sample

    def __call__(self, logits, seqs, argmax=None):
        failing = [seq.request_id for seq in seqs if seq.request_id.startswith(self.prefixes)]
        if failing:
            raise InjectedFault(f"injected fault: sampling fails for {failing}")
        return self._sample(logits, seqs, argmax)


def step_hooks(epoch: int, environ: Mapping[str, str] = os.environ) -> StepHooks | None:
    """The Engine's StepHooks that arm the faults of $PAGEDSERVE_FAULT that apply to this epoch; None (and nothing
    touched) when there are none."""
    text = environ.get(ENV_VAR)
    if not text:
        return None
    faults = [f for f in parse_faults(text) if f.epoch in (None, epoch)]
    if not faults:
        return None
    logger.warning("%s=%r: fault injection armed (a test facility; never in production)", ENV_VAR, text)
    sampler_prefixes = tuple(f.request_prefix for f in faults if f.action == "fail" and f.request_prefix is not None)
    step_faults = [f for f in faults if f.action != "fail"]
    return StepHooks(
        execute=(lambda execute, block_manager: FaultInjector(step_faults, execute, block_manager).execute)
        if step_faults else None,
        sample=(lambda sample: SamplerFault(list(sampler_prefixes), sample)) if sampler_prefixes else None)
