"""StepHooks: wrappers an Engine puts around its own forward pass and sampling once warmed up.

Fault injection's way in (gpu_worker/process/fault_injection.py, tests
only): the engine hands each hook its own callable and steps with what the
hook returns, so nothing outside the engine replaces its parts. Armed by
Engine.warm_up(), so that the hooks count steps from READY.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpu_worker.kv.block_manager import BlockManager


@dataclass(frozen=True)
class StepHooks:
    # (the runner's execute, the engine's block manager) -> what the engine's steps execute instead
    execute: Callable[[Callable, BlockManager], Callable] | None = None
    # (the engine's sampler) -> what samples instead, called as the sampler is: (logits, seqs, argmax)
    sample: Callable[[Callable], Callable] | None = None
