"""A step as the C kernels' calls (gpu_worker/models/cpu_kernel_step.py) against the model's forward pass."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random

import pytest
import torch

from gpu_worker.attention.metadata import AttentionMetadata
from gpu_worker.engine.engine import Engine
from gpu_worker.models import layers
from gpu_worker.models.cpu_fused import load_cpu_fused_kernels
from gpu_worker.models.cpu_kernel_step import MAX_ROWS
from gpu_worker.models.cpu_kernel_step_build import build_cpu_kernel_step
from gpu_worker.models.cpu_linear import MIN_VECTOR_BITS
from gpu_worker.models.cpu_linear_bf16 import load_pair_linear_kernel
from shared.config import EngineConfig
from shared.cpu_tier import current_tier
from shared.sampling_params import SamplingParams

needs_the_kernels = pytest.mark.skipif(current_tier().vector_bits < MIN_VECTOR_BITS,
                                       reason="below AVX2 the float32 projections are oneDNN's, not the kernel's")


def make_engine(checkpoint, **overrides) -> Engine:
    settings = dict(model=str(checkpoint), dtype="float32", block_size=4, num_kv_blocks=512,
                    max_num_batched_tokens=64, max_num_seqs=12)
    return Engine(EngineConfig(**{**settings, **overrides}))


def add_requests(engine: Engine, count: int, seed: int, first: int = 0) -> None:
    """Prompts and outputs of many lengths, so that the batch grows and shrinks and crosses block edges."""
    rng = random.Random(seed)
    vocab_size = engine.runner.model_config.vocab_size
    for index in range(first, first + count):
        prompt = [rng.randrange(3, vocab_size) for _ in range(rng.randint(1, 40))]
        engine.add_request(f"r{index}", prompt, SamplingParams(max_tokens=rng.randint(2, 40), ignore_eos=True))


def assert_every_step_is_the_models(engine: Engine) -> None:
    """Run requests to the end, each step's hidden states through the kernel step and through the model, equal."""
    runner = engine.runner
    assert runner.kernel_step is not None
    add_requests(engine, 6, seed=5)
    decode_sizes, mixed_sizes = set(), set()
    for turn in itertools.count():
        if turn < 24 and turn % 2:  # a request arrives every other step: its prefill joins the running decodes
            add_requests(engine, 1, seed=turn, first=6 + turn)
        if not engine.has_work():
            break
        scheduled = engine.schedule()
        with torch.inference_mode():
            input_ids, positions, meta, _ = runner.prepare_inputs(scheduled)
            got = runner.kernel_step.forward(input_ids, positions, runner.kv_caches, meta).clone()
            expected = runner.model(input_ids, positions, runner.kv_caches, meta)
        assert torch.equal(got, expected), f"{len(scheduled.scheduled)} sequences, {input_ids.shape[0]} tokens"
        (mixed_sizes if meta.prefill_seqs else decode_sizes).add(input_ids.shape[0])
        engine.run(scheduled)
    assert len(decode_sizes) >= 6 and len(mixed_sizes) >= 6, (decode_sizes, mixed_sizes)


@needs_the_kernels
@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
@pytest.mark.parametrize("silu", ["torch", "kernel"])
def test_each_step_gives_the_models_hidden_states_bit_for_bit(checkpoint, silu, quantization):
    """Step by step, decodes alone and with prefill chunks, as the batch changes size: the kernel step's hidden
    states equal the model's own forward pass on the same inputs, with SiLU·up by torch's ops (the model's on
    x86-64) and by the kernel (from AVX2 on), and with float32, int8 and int4 projections."""
    engine = make_engine(checkpoint, quantization=quantization)
    runner = engine.runner
    silu_and_mul = load_cpu_fused_kernels().silu_and_mul if silu == "kernel" else layers.silu_and_mul
    for layer in runner.model.model.layers:
        layer.mlp.ops = dataclasses.replace(layer.mlp.ops, silu_and_mul=silu_and_mul)
    runner.kernel_step = build_cpu_kernel_step(runner.model)
    assert runner.kernel_step is not None and runner.kernel_step.silu_kernel == (silu == "kernel")
    assert_every_step_is_the_models(engine)
    # Every step, with prefill chunks or without, is one C call where every op is a C kernel; torch's SiLU·up runs
    # from Python between runs of them.
    programs = runner.kernel_step.programs
    assert {len(program.segments) for program in programs.values()} == (
        {1} if silu == "kernel" else {2 * len(runner.model.model.layers) + 1}), {
        key[2]: program.segments for key, program in programs.items()}


@pytest.mark.skipif(not current_tier().can_pack_bf16, reason="below AVX-512 bfloat16 projections are torch's own")
def test_a_bfloat16_models_steps_are_its_own_bit_for_bit(checkpoint):
    """bfloat16 weights in the pair kernel's tiles where bfloat16 is native, else in oneDNN's packed layout: the
    kernel step calls the same products, and its hidden states are the model's, decodes alone and with prefill
    chunks."""
    engine = make_engine(checkpoint, dtype="bfloat16")
    assert engine.runner.kernel_step is not None and engine.runner.kernel_step.dtype == torch.bfloat16
    assert_every_step_is_the_models(engine)


@needs_the_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_runner_hands_it_prefill_chunks_only_where_no_product_is_copied(checkpoint, dtype):
    """Up to MAX_ROWS tokens; where a projection is oneDNN's (bfloat16 without the pair kernel) only steps of
    decodes, whose products' copies into the step's buffers cost less than the model's module calls (a prefill
    chunk's do not)."""
    if dtype == "bfloat16" and not current_tier().can_pack_bf16:
        pytest.skip("below AVX-512 bfloat16 projections are torch's own")
    kernel_step = make_engine(checkpoint, dtype=dtype).runner.kernel_step
    assert kernel_step is not None

    def meta(query_lens: tuple[int, ...]) -> AttentionMetadata:
        empty = torch.zeros(0, dtype=torch.int32)
        return AttentionMetadata(empty, empty, empty, empty, max(query_lens), 64, query_lens, (64,) * len(query_lens))

    assert kernel_step.takes(4, meta((1, 1, 1, 1))) and not kernel_step.takes(MAX_ROWS + 1, meta((1,) * (MAX_ROWS + 1)))
    copied = dtype == "bfloat16" and load_pair_linear_kernel(current_tier()) is None
    assert kernel_step.copies_products == copied
    assert kernel_step.takes(12, meta((1, 1, 10))) == (not copied)


@needs_the_kernels
def test_a_step_past_its_rows_is_the_models(checkpoint):
    """A step of more than MAX_ROWS prompt tokens (three prompts prefilled at once) runs through the model (the
    kernel step refuses it)."""
    prompt_len = MAX_ROWS // 3 + 10
    engine = make_engine(checkpoint, max_num_batched_tokens=3 * prompt_len, num_kv_blocks=3 * prompt_len // 4 + 3)
    for index in range(3):
        engine.add_request(f"long{index}", [3 + (i + index) % 50 for i in range(prompt_len)], SamplingParams(max_tokens=1))
    scheduled = engine.schedule()
    with torch.inference_mode():
        input_ids, positions, meta, _ = engine.runner.prepare_inputs(scheduled)
        assert input_ids.shape[0] > MAX_ROWS and not engine.runner.kernel_step.takes(input_ids.shape[0], meta)
        with pytest.raises(ValueError, match=f"up to {MAX_ROWS} tokens"):
            engine.runner.kernel_step.forward(input_ids, positions, engine.runner.kv_caches, meta)
    assert [len(output.new_token_ids) for output in engine.run(scheduled)] == [1, 1, 1]


@needs_the_kernels
def test_an_engine_decodes_through_it_the_same_tokens_as_without(checkpoint):
    """The whole engine, greedy, with the kernel step and with the model's forward for every step."""
    outputs = []
    for use_kernel_step in (True, False):
        engine = make_engine(checkpoint)
        assert engine.runner.kernel_step is not None
        if not use_kernel_step:
            engine.runner.kernel_step = None
        add_requests(engine, 10, seed=9)
        tokens: dict[str, list[int]] = {}
        while engine.has_work():
            for update in engine.step():
                tokens.setdefault(update.request_id, []).extend(update.new_token_ids.tolist())
        outputs.append(tokens)
    assert outputs[0] == outputs[1] and sum(map(len, outputs[0].values())) > 100


def test_a_model_it_has_no_calls_for_runs_its_own_forward(checkpoint, caplog):
    """float16 weights (torch's projections, which no kernel takes): no kernel step, and the log says why."""
    with caplog.at_level(logging.INFO, logger="pagedserve.worker.models"):
        engine = make_engine(checkpoint, dtype="float16")
    assert engine.runner.kernel_step is None
    reasons = [r.getMessage() for r in caplog.records if r.getMessage().startswith("steps: the model's")]
    assert len(reasons) == 1 and "float16" in reasons[0], reasons
