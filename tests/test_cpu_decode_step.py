"""The decode step as the C kernels' calls (gpu_worker/models/cpu_decode_step.py) against the model's forward pass."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from gpu_worker.engine.engine import Engine
from gpu_worker.models.cpu_decode_step import build_cpu_decode_step
from gpu_worker.models.cpu_fused import load_cpu_fused_kernels
from gpu_worker.models.cpu_linear import MIN_VECTOR_BITS
from shared.config import EngineConfig
from shared.cpu_tier import current_tier
from shared.sampling_params import SamplingParams

needs_the_kernels = pytest.mark.skipif(current_tier().vector_bits < MIN_VECTOR_BITS,
                                       reason="below AVX2 the float32 projections are oneDNN's, not the kernel's")


def make_engine(checkpoint, **overrides) -> Engine:
    settings = dict(model=str(checkpoint), dtype="float32", block_size=4, num_kv_blocks=512,
                    max_num_batched_tokens=64, max_num_seqs=12)
    return Engine(EngineConfig(**{**settings, **overrides}))


def add_requests(engine: Engine, count: int, seed: int) -> None:
    """Prompts and outputs of many lengths, so that the batch grows and shrinks and crosses block edges."""
    rng = random.Random(seed)
    vocab_size = engine.runner.model_config.vocab_size
    for index in range(count):
        prompt = [rng.randrange(3, vocab_size) for _ in range(rng.randint(1, 40))]
        engine.add_request(f"r{index}", prompt, SamplingParams(max_tokens=rng.randint(2, 40), ignore_eos=True))


@needs_the_kernels
@pytest.mark.parametrize("silu", ["torch", "kernel"])
def test_each_decode_step_gives_the_models_hidden_states_bit_for_bit(checkpoint, silu):
    """Step by step, as the batch changes size: the decode step's hidden states equal the model's own forward
    pass on the same inputs, with SiLU·up by torch's ops (the model's below AVX-512) and by the kernel."""
    engine = make_engine(checkpoint)
    runner = engine.runner
    if silu == "kernel":  # the model's layers take the kernel's SiLU·up, as on AVX-512
        kernel_ops = load_cpu_fused_kernels().layer_ops()
        for layer in runner.model.model.layers:
            layer.mlp.ops = kernel_ops
        runner.decode_step = build_cpu_decode_step(runner.model)
    assert runner.decode_step is not None and runner.decode_step.silu_kernel == (silu == "kernel")
    add_requests(engine, 14, seed=5)
    batch_sizes = set()
    while engine.has_work():
        scheduled = engine.schedule()
        if all(item.num_new_tokens == 1 for item in scheduled.scheduled):
            with torch.inference_mode():
                input_ids, positions, meta, _ = runner.prepare_inputs(scheduled)
                got = runner.decode_step.forward(input_ids, positions, runner.kv_caches, meta).clone()
                expected = runner.model(input_ids, positions, runner.kv_caches, meta)
            assert torch.equal(got, expected), f"batch of {len(scheduled.scheduled)}"
            batch_sizes.add(len(scheduled.scheduled))
        engine.run(scheduled)
    assert len(batch_sizes) >= 6, batch_sizes


@needs_the_kernels
def test_an_engine_decodes_through_it_the_same_tokens_as_without(checkpoint):
    """The whole engine, greedy, with the decode step and with the model's forward for every step."""
    outputs = []
    for use_decode_step in (True, False):
        engine = make_engine(checkpoint)
        assert engine.runner.decode_step is not None
        if not use_decode_step:
            engine.runner.decode_step = None
        add_requests(engine, 10, seed=9)
        tokens: dict[str, list[int]] = {}
        while engine.has_work():
            for update in engine.step():
                tokens.setdefault(update.request_id, []).extend(update.new_token_ids.tolist())
        outputs.append(tokens)
    assert outputs[0] == outputs[1] and sum(map(len, outputs[0].values())) > 100


@pytest.mark.parametrize("overrides", [{"dtype": "bfloat16"}, {"quantization": "int8"}],
                         ids=["bfloat16", "int8"])
def test_a_model_it_has_no_calls_for_decodes_through_its_own_forward(checkpoint, overrides, caplog):
    """bfloat16 weights, quantized projections: no decode step, and the log says why."""
    with caplog.at_level(logging.INFO, logger="pagedserve.worker.models"):
        engine = make_engine(checkpoint, **overrides)
    assert engine.runner.decode_step is None
    reasons = [r.getMessage() for r in caplog.records if r.getMessage().startswith("decode steps: the model's")]
    assert len(reasons) == 1 and ("bfloat16" in reasons[0] or "Quantized" in reasons[0]), reasons
