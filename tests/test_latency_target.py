"""The latency-aware scheduler without a model: a cost model of known coefficients and a clock it drives.

The "machine" is a StepCostModel whose coefficients are set by hand: its
prediction of a step is the step's time on the simulated clock. The real
Scheduler, BlockManager and prefix cache run on plain token ids, with
the simulated paged cache of helpers/simulated_model.py checking every context read back.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from gpu_worker.kv.block_manager import BlockManager
from gpu_worker.native.row_ladder import ladder_rows
from gpu_worker.scheduling.latency_target import MIN_PREFILL_CHUNK, LatencyTarget
from gpu_worker.scheduling.scheduler import Scheduler
from gpu_worker.scheduling.scheduler_output import SchedulerOutput
from gpu_worker.scheduling.step_cost import CLIP_FACTOR, StepCostModel, StepShape, _nonnegative_least_squares
from shared.config import TARGET_ITL_AUTO_FACTOR

from helpers.simulated_model import VOCAB, SimulatedCache, make_seq, reference_output, run_step

# A CPU-like machine: 20 ms a step, 1 ms a token, 2 ms a sampled row, attention pairs cheap but not free.
MACHINE = np.array([0.020, 0.001, 0.002, 2e-8, 1e-7])


def machine_model(coefficients: np.ndarray = MACHINE) -> StepCostModel:
    model = StepCostModel()
    model.coefficients = [float(c) for c in coefficients]
    return model


def random_shape(rng: random.Random) -> StepShape:
    shape = StepShape()
    for _ in range(rng.randint(0, 24)):
        shape.add(1, rng.randint(0, 2000), True)
    for _ in range(rng.randint(0, 2)):
        num_new = rng.randint(2, 512)
        shape.add(num_new, rng.randint(0, 1000), rng.random() < 0.5)
    if not shape.num_tokens:
        shape.add(1, 10, True)
    return shape


def calibration_shapes() -> list[StepShape]:
    """Shapes like the engine's calibration (gpu_worker/engine/step_calibration.py): prefills alone, decodes alone."""
    shapes = []
    for context, num_new, batch in [(0, 16, 1), (0, 256, 1), (256, 64, 1), (1024, 64, 1), (32, 1, 1), (256, 1, 8),
                                    (1024, 1, 8), (256, 1, 32)]:
        shape = StepShape()
        for _ in range(batch):
            shape.add(num_new, context, True)
        shapes.append(shape)
    return shapes


def decode_only(output: SchedulerOutput, decoding: set[str]) -> StepShape:
    shape = StepShape()
    for item in output.scheduled:
        if item.seq.request_id in decoding:
            shape.add(1, item.seq.num_computed_tokens, True)
    return shape


# ---------------------------------------------------------------------------------------------- the cost model


def test_cost_model_learns_the_machine_from_its_steps():
    machine, model, rng = machine_model(), StepCostModel(), random.Random(0)
    model.calibrate([(shape, machine.predict(shape) * 1.5) for shape in calibration_shapes()])  # a poor start
    for _ in range(400):
        shape = random_shape(rng)
        model.observe(shape, machine.predict(shape))
    for _ in range(50):
        shape = random_shape(rng)
        assert model.predict(shape) == pytest.approx(machine.predict(shape), rel=0.05)
    assert all(c >= 0 for c in model.coefficients)


def test_one_slow_step_moves_the_model_a_little_and_a_slower_machine_is_followed():
    machine, model, rng = machine_model(), StepCostModel(), random.Random(1)
    model.calibrate([(shape, machine.predict(shape)) for shape in calibration_shapes()])
    for _ in range(300):
        shape = random_shape(rng)
        model.observe(shape, machine.predict(shape))
    probe = random_shape(rng)
    before = model.predict(probe)
    for _ in range(8):  # one refit's worth of steps, one of them stalled 50x by another process
        shape = random_shape(rng)
        model.observe(shape, machine.predict(shape) * (50 if _ == 0 else 1))
    assert model.predict(probe) == pytest.approx(before, rel=0.02)
    slower = machine_model(MACHINE * 1.6)
    for _ in range(1500):
        shape = random_shape(rng)
        model.observe(shape, slower.predict(shape))
    assert model.predict(probe) == pytest.approx(slower.predict(probe), rel=0.05)


def test_a_fit_started_from_the_last_fits_terms_is_the_fit_from_scratch():
    """Each refit starts from the terms the last one left free; a start that no longer holds (a term it holds at 0
    would now lower the error, or one it frees comes out negative) must fall back to the fit from scratch."""
    rng = random.Random(2)
    model = StepCostModel()
    model.calibrate([(shape, machine_model().predict(shape)) for shape in calibration_shapes()])
    starts = [[0, 1, 2, 3, 4], [0, 1, 2, 3], [0, 1], [2, 3, 4], [0], []]
    for step in range(300):  # a machine whose token cost drifts down to nothing and back, so the free terms change
        drift = abs(1.0 - step / 150)
        shape = random_shape(rng)
        model.observe(shape, machine_model(MACHINE * [1, drift, 1, 1, 0.1]).predict(shape))
        gram = [[a + b for a, b in zip(anchor, row)] for anchor, row in zip(model._anchor_gram, model._gram)]
        moment = [a + b for a, b in zip(model._anchor_moment, model._moment)]
        scratch, free = _nonnegative_least_squares(gram, moment)
        assert model.coefficients == pytest.approx(scratch, rel=1e-6, abs=1e-12)
        for start in starts:
            coefficients, _ = _nonnegative_least_squares(gram, moment, start)
            assert coefficients == pytest.approx(scratch, rel=1e-6, abs=1e-12), (step, start, free)


def test_an_observation_enters_clipped_to_a_bounded_multiple_of_the_prediction():
    machine, model = machine_model(), StepCostModel()
    shape = StepShape()
    shape.add(64, 0, True)
    model.calibrate([(shape, machine.predict(shape))])
    clipped, raw = StepCostModel(), StepCostModel()
    clipped.calibrate([(shape, machine.predict(shape))])
    raw.calibrate([(shape, machine.predict(shape))])
    clipped.observe(shape, machine.predict(shape) * 1000)
    raw.observe(shape, machine.predict(shape) * CLIP_FACTOR)
    for _ in range(7):  # to the next refit
        clipped.observe(shape, machine.predict(shape))
        raw.observe(shape, machine.predict(shape))
    assert clipped.predict(shape) == pytest.approx(raw.predict(shape))


def test_max_chunk_is_the_largest_chunk_that_fits_the_time():
    model = machine_model()
    for context, seconds in [(0, 0.05), (500, 0.05), (3000, 0.2), (0, 0.0015)]:
        num = model.max_chunk(seconds, context, 10_000)
        assert model.chunk_seconds(num, context, False) <= seconds < model.chunk_seconds(num + 1, context, False)
    assert model.max_chunk(10.0, 0, 40) == 40
    assert model.max_chunk(0.0, 0, 40) == 0


# ---------------------------------------------------------------------------------------------- the scheduler


def run_workload(scheduler: Scheduler, requests: dict, arrivals: dict[int, list[str]], on_step=None) -> dict:
    """Step until every request is done, adding arrivals at their step; outputs by request id."""
    cache, done, step, arrival = SimulatedCache(scheduler.block_manager.block_size), {}, 0, 0
    while scheduler.has_work() or any(s >= step for s in arrivals):
        for request_id in arrivals.get(step, []):
            prompt, max_tokens, priority = requests[request_id]
            scheduler.add(make_seq(request_id, prompt, max_tokens, priority=priority, arrival=arrival))
            arrival += 1
        decoding = {s.request_id for s in scheduler.running if s.num_tokens - s.num_computed_tokens == 1}
        streams = StepShape()  # a decode of every sequence in the engine: what the automatic target is a multiple of
        for seq in (scheduler.running + scheduler.waiting)[:scheduler.max_num_seqs]:
            streams.add(1, seq.num_tokens - 1, True)
        output = scheduler.schedule()
        if on_step is not None:
            on_step(output, decoding, streams)
        for seq in run_step(scheduler, cache, output):
            done[seq.request_id] = seq.output_token_ids
        step += 1
    return done


def mixed_requests(seed: int, count: int, max_prompt: int) -> tuple[dict, dict[int, list[str]]]:
    rng = random.Random(seed)
    requests, arrivals = {}, {}
    for i in range(count):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, max_prompt))]
        requests[f"r{i}"] = (prompt, rng.randint(1, 30), rng.randint(0, 2))
        arrivals.setdefault(0 if i < 4 else rng.randint(1, 120), []).append(f"r{i}")
    return requests, arrivals


@pytest.mark.parametrize("target_seconds", [0.03, 0.08, None])
@pytest.mark.parametrize("pads_rows", [False, True])
def test_a_step_with_decodes_stays_under_the_target(target_seconds, pads_rows):
    cost = machine_model()
    target = LatencyTarget(cost, target_seconds, pads_rows)
    scheduler = Scheduler(BlockManager(2000, 16), max_num_batched_tokens=2048, max_num_seqs=64, max_model_len=4096,
                          latency_target=target)
    requests, arrivals = mixed_requests(3, 40, 1500)
    counts = {"with decodes": 0, "with decodes and prefill": 0, "prefill alone": 0}

    def check(output: SchedulerOutput, decoding: set[str], streams: StepShape) -> None:
        decodes = decode_only(output, decoding)
        prefill_tokens = output.num_batched_tokens - decodes.num_tokens
        if not decodes.num_tokens:
            counts["prefill alone"] += 1
            return
        counts["with decodes"] += 1
        counts["with decodes and prefill"] += prefill_tokens > 0
        predicted, limit = cost.predict(output.shape), target.limit(streams)
        prefills = [s for s in output.scheduled if s.seq.request_id not in decoding]
        if predicted > limit * (1 + 1e-9):  # allowed only as the first prefill's guaranteed minimum
            assert len(prefills) == 1 and prefills[0].num_new_tokens <= MIN_PREFILL_CHUNK, (predicted, limit)
        elif pads_rows and prefills and not prefills[-1].is_sampling:  # its chunk was cut: no padded row
            assert ladder_rows(output.num_batched_tokens) == output.num_batched_tokens, output.num_batched_tokens

    outputs = run_workload(scheduler, requests, arrivals, check)
    for request_id, (prompt, max_tokens, _) in requests.items():
        assert outputs[request_id] == reference_output(prompt, max_tokens)
    assert counts["with decodes and prefill"] > 20 and counts["prefill alone"] > 0, counts


def test_a_chunk_cut_for_time_ends_its_step_on_a_rung_when_rows_are_padded():
    """One stream decodes; the time left fits 37 prompt tokens, a step of 38 rows, which would run as 40."""
    cost = machine_model(np.array([0.020, 0.001, 0.0, 0.0, 0.0]))
    decode = StepShape.of_decodes(1, 100)
    seconds = cost.predict(decode) + 37.5 * 0.001
    for pads_rows, granted in ((False, 37), (True, 35)):
        allowance = LatencyTarget(cost, seconds, pads_rows).prefill_allowance(decode, decode)
        assert allowance.grant(0, 1000, 2048) == granted, pads_rows  # 1 + 35 = 36 rows, a rung
    allowance = LatencyTarget(cost, seconds, True).prefill_allowance(decode, decode)
    assert allowance.grant(0, 30, 2048) == 30, "a chunk that ends its prompt is not cut"


def test_with_nothing_decoding_prefill_fills_the_token_budget():
    scheduler = Scheduler(BlockManager(500, 16), max_num_batched_tokens=1024, max_num_seqs=8, max_model_len=4096,
                          latency_target=LatencyTarget(machine_model(), 0.01))
    for i in range(3):
        scheduler.add(make_seq(f"p{i}", [5 + i] * 600, 4, arrival=i))
    assert scheduler.schedule().num_batched_tokens == 1024


def test_short_prompts_arriving_every_step_never_starve_a_long_one():
    """The decodes alone overrun this target, so prefill runs on the guaranteed minimum, oldest prompt first."""
    cost = machine_model()
    scheduler = Scheduler(BlockManager(4000, 16), max_num_batched_tokens=2048, max_num_seqs=256, max_model_len=8192,
                          latency_target=LatencyTarget(cost, 0.001))
    cache = SimulatedCache(16)
    scheduler.add(make_seq("busy", [3] * 8, 5000, arrival=0))
    run_step(scheduler, cache)
    long_prompt = [7] * 1200
    scheduler.add(make_seq("long", long_prompt, 3, arrival=1))
    computed, finished, step = [], {}, 0
    while "long" not in finished:
        scheduler.add(make_seq(f"short{step}", [9, step % 50 + 1], 2, arrival=2 + step))
        long_seq = next(s for s in scheduler.running + scheduler.waiting if s.request_id == "long")
        computed.append(long_seq.num_computed_tokens)
        finished.update({s.request_id: s.output_token_ids for s in run_step(scheduler, cache)})
        step += 1
    assert all(b - a >= MIN_PREFILL_CHUNK for a, b in zip(computed, computed[1:]) if b < len(long_prompt))
    assert step <= -(-len(long_prompt) // MIN_PREFILL_CHUNK) + 3
    assert finished["long"] == reference_output(long_prompt, 3)


@pytest.mark.parametrize("num_blocks", [60, 600])
def test_priorities_preemption_and_prefix_caching_work_under_a_target(num_blocks):
    shared_prefix = [11] * 48
    rng = random.Random(5)
    requests, arrivals = {}, {}
    for i in range(30):
        prompt = (shared_prefix if i % 2 else []) + [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 120))]
        requests[f"r{i}"] = (prompt, rng.randint(1, 25), rng.randint(0, 2))
        arrivals.setdefault(0 if i < 5 else rng.randint(1, 80), []).append(f"r{i}")
    scheduler = Scheduler(BlockManager(num_blocks, 4), max_num_batched_tokens=256, max_num_seqs=12, max_model_len=512,
                          latency_target=LatencyTarget(machine_model(), 0.04))
    outputs = run_workload(scheduler, requests, arrivals)
    for request_id, (prompt, max_tokens, _) in requests.items():
        assert outputs[request_id] == reference_output(prompt, max_tokens)
    assert scheduler.block_manager.num_prefix_hit_tokens > 0
    if num_blocks == 60:
        assert scheduler.num_preemptions > 0, "the small pool was meant to force preemption"


def test_a_later_more_urgent_prompt_is_prefilled_first():
    scheduler = Scheduler(BlockManager(500, 16), max_num_batched_tokens=2048, max_num_seqs=8, max_model_len=4096,
                          latency_target=LatencyTarget(machine_model(), 0.001))
    cache = SimulatedCache(16)
    scheduler.add(make_seq("busy", [3] * 8, 100, arrival=0))
    run_step(scheduler, cache)
    scheduler.add(make_seq("normal", [4] * 200, 2, priority=1, arrival=1))
    scheduler.add(make_seq("urgent", [5] * 200, 2, priority=0, arrival=2))
    output = scheduler.schedule()
    prefilled = {s.seq.request_id: s.num_new_tokens for s in output.scheduled if s.seq.request_id != "busy"}
    assert prefilled == {"urgent": MIN_PREFILL_CHUNK}


def test_the_automatic_target_is_a_multiple_of_the_streams_own_decode_step():
    cost = machine_model()
    streams = StepShape()
    for _ in range(8):
        streams.add(1, 300, True)
    assert LatencyTarget(cost, None).limit(streams) == pytest.approx(TARGET_ITL_AUTO_FACTOR * cost.predict(streams))
    assert LatencyTarget(cost, 0.25).limit(streams) == 0.25


def test_waiting_prompts_count_as_streams_in_the_automatic_target():
    """64 prompts at once: the few decoding first must not hold the others' prefill to their own small step."""
    cost = machine_model()
    scheduler = Scheduler(BlockManager(2000, 16), max_num_batched_tokens=512, max_num_seqs=64, max_model_len=4096,
                          latency_target=LatencyTarget(cost, None))
    cache = SimulatedCache(16)
    for i in range(64):
        scheduler.add(make_seq(f"r{i}", [3 + i] * 300, 50, arrival=i))
    run_step(scheduler, cache)  # nothing decodes yet: the whole budget
    decoding = [s for s in scheduler.running if s.num_tokens - s.num_computed_tokens == 1]
    output = scheduler.schedule()
    few = StepShape()
    for seq in decoding:
        few.add(1, seq.num_tokens - 1, True)
    assert 0 < len(decoding) < 8 and cost.predict(output.shape) > TARGET_ITL_AUTO_FACTOR * cost.predict(few)
