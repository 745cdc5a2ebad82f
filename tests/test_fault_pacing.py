"""PAGEDSERVE_FAULT's `pace` (gpu_worker/process/fault_injection.py): from its step on, a real Engine's every step
lasts at least PACE_STEP_S, and its tokens are the unpaced engine's."""

from __future__ import annotations

import time

from gpu_worker.engine.engine import Engine
from gpu_worker.process.fault_injection import ENV_VAR, PACE_STEP_S, step_hooks
from shared.config import EngineConfig
from shared.sampling_params import SamplingParams

PACED_FROM = 3  # steps after READY


def run(checkpoint, environ: dict[str, str]) -> tuple[list[int], list[float]]:
    """One greedy request of 12 tokens: its tokens and each step's wall time."""
    engine = Engine(EngineConfig(model=str(checkpoint), dtype="float32"), hooks=step_hooks(1, environ))
    engine.warm_up()
    engine.add_request("r", [5, 6, 7, 8], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    tokens, times = [], []
    while engine.has_work():
        started = time.monotonic()
        for update in engine.step():
            tokens.extend(update.new_token_ids.tolist())
        times.append(time.monotonic() - started)
    return tokens, times


def test_paced_steps_last_their_floor_and_give_the_same_tokens(checkpoint):
    tokens, times = run(checkpoint, {ENV_VAR: f"pace@{PACED_FROM}"})
    unpaced_tokens, unpaced_times = run(checkpoint, {})
    assert tokens == unpaced_tokens and len(tokens) == 12
    assert min(times[PACED_FROM:]) >= PACE_STEP_S, times
    assert min(unpaced_times) < PACE_STEP_S, unpaced_times  # the floor is the pace's, not the model's
