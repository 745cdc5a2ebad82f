"""The CPU layer kernels (cpu_fused.py) against layers.py's torch ops, alone and inside the model; their fallback.

Tolerances: float32, 1e-5 (relative and absolute) for RMSNorm and SiLU * up,
whose sums and exp differ from torch's in order and in the last bit; exact
where the arithmetic is the same (the residual add, rotary). bfloat16: within
one bfloat16 step of the torch op, which rounds the same intermediates to
bfloat16 that the kernel rounds. Shapes: odd row counts, widths that are not
multiples of 16, head_dim 64 and 128, grouped (GQA) and plain heads.
"""

from __future__ import annotations

import sys

import pytest
import torch

from gpu_worker.attention import select_paged_attention
from gpu_worker.attention.torch_paged import write_kv_cache
from gpu_worker.models import layers
from gpu_worker.models.config import read_model_config
from gpu_worker.models.cpu_fused import SOURCE, CpuFusedKernels
from gpu_worker.models.layers import TORCH_LAYER_OPS, RotaryEmbedding, select_layer_ops
from gpu_worker.models.llama import LlamaForCausalLM
from gpu_worker.models.loader import load_weights
from gpu_worker.native.compiled_library import load_kernel_library
from shared.cpu_tier import CpuTier

from helpers.checkpoints import make_checkpoint
from helpers.cpu_tiers import kernel_tier_params
from helpers.paged_batches import make_metadata

DTYPES = (torch.float32, torch.bfloat16)
FLOAT32_TOLERANCE = 1e-5
EPS = 1e-5
ROWS = (1, 7, 33)
HIDDEN_SIZES = (64, 200, 576)  # 200: not a multiple of 16
HEAD_LAYOUTS = ((9, 3, 64), (4, 4, 128), (6, 2, 64))  # num_heads, num_kv_heads, head_dim
BLOCK_SIZE, NUM_BLOCKS = 4, 8


@pytest.fixture(scope="module", params=kernel_tier_params())
def tier(request) -> CpuTier:
    """Each CPU tier this machine runs: every test of the kernels runs on each tier's build."""
    return request.param


@pytest.fixture(scope="module", params=["one thread", "torch's threads"])
def kernels(request, tier) -> CpuFusedKernels:
    """The kernels on the calling thread alone, and on torch's threads at any size (rows split between them)."""
    library = load_kernel_library(SOURCE, tier)
    return CpuFusedKernels(library, parallel_min_elements=sys.maxsize if request.param == "one thread" else 0)


def random(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def assert_matches(ours: torch.Tensor, reference: torch.Tensor, exact: bool = False) -> None:
    """float32: exact, or within FLOAT32_TOLERANCE; bfloat16: within one bfloat16 step of the reference's value."""
    assert ours.dtype == reference.dtype and ours.shape == reference.shape
    if exact:
        assert torch.equal(ours, reference), f"max diff {(ours.double() - reference.double()).abs().max().item()}"
    elif ours.dtype == torch.float32:
        torch.testing.assert_close(ours, reference, rtol=FLOAT32_TOLERANCE, atol=FLOAT32_TOLERANCE)
    else:
        step = bfloat16_step(reference)
        diff = (ours.double() - reference.double()).abs()
        assert (diff <= step).all(), f"{(diff > step).sum().item()} values off by more than one bfloat16 step"


def bfloat16_step(values: torch.Tensor) -> torch.Tensor:
    """The distance from each bfloat16 value to the next one away from zero (the smallest subnormal at zero)."""
    magnitude = values.double().abs()
    exponent = torch.floor(torch.log2(magnitude.clamp(min=2.0 ** -126)))
    return torch.pow(2.0, exponent - 7)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", ROWS)
@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
def test_add_rms_norm_matches_torch(kernels, dtype, num_rows, hidden):
    x, residual = random(num_rows, hidden, dtype=dtype, seed=1), random(num_rows, hidden, dtype=dtype, seed=2, scale=4)
    weight = random(hidden, dtype=dtype, seed=3) * 0.1 + 1
    expected_normed, expected_residual = layers.add_rms_norm(x, residual, weight, EPS)
    normed, summed = kernels.add_rms_norm(x.clone(), residual.clone(), weight, EPS)
    assert_matches(summed, expected_residual, exact=True)
    assert_matches(normed, expected_normed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", ROWS)
@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
def test_rms_norm_matches_torch(kernels, dtype, num_rows, hidden):
    x, weight = random(num_rows, hidden, dtype=dtype, seed=4, scale=3), random(hidden, dtype=dtype, seed=5) + 1
    assert_matches(kernels.rms_norm(x, weight, EPS), layers.rms_norm(x, weight, EPS))


def test_add_rms_norm_works_in_place_on_strided_rows(kernels):
    """Rows apart in memory (a column slice): the sum lands in residual, the normed rows over x, nothing else moves."""
    hidden = 72
    x_buffer, residual_buffer = random(5, 100, dtype=torch.float32, seed=6), random(5, 90, dtype=torch.float32, seed=7)
    x, residual = x_buffer[:, :hidden], residual_buffer[:, 10:10 + hidden]
    weight = random(hidden, dtype=torch.float32, seed=8)
    expected_normed, expected_residual = layers.add_rms_norm(x, residual, weight, EPS)
    untouched = x_buffer[:, hidden:].clone(), residual_buffer[:, :10].clone(), residual_buffer[:, 10 + hidden:].clone()
    normed, summed = kernels.add_rms_norm(x, residual, weight, EPS)
    assert normed.data_ptr() == x.data_ptr() and summed.data_ptr() == residual.data_ptr()
    assert_matches(summed, expected_residual, exact=True)
    assert_matches(normed, expected_normed)
    after = x_buffer[:, hidden:], residual_buffer[:, :10], residual_buffer[:, 10 + hidden:]
    assert all(torch.equal(before, now) for before, now in zip(untouched, after))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", ROWS)
@pytest.mark.parametrize("intermediate", (40, 344, 1536))
def test_silu_and_mul_matches_torch(kernels, dtype, num_rows, intermediate):
    gate_up = random(num_rows, 2 * intermediate, dtype=dtype, seed=9, scale=4)
    assert_matches(kernels.silu_and_mul(gate_up), layers.silu_and_mul(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch_at_the_edges_of_exp(kernels, dtype):
    """Gates where e^-gate overflows (silu is -0), is subnormal, or is exactly 1, and a NaN."""
    gate = torch.tensor([-200.0, -100.0, -88.8, -88.0, -87.5, -20.0, -1e-30, 0.0, 1e-30, 20.0, 87.5, 88.5, 100.0, 200.0])
    up = torch.linspace(-3, 3, gate.numel())
    gate_up = torch.cat((gate, up))[None, :].to(dtype)  # [1, 2 * 14]
    assert_matches(kernels.silu_and_mul(gate_up), layers.silu_and_mul(gate_up))
    with_nan = torch.tensor([[float("nan"), 1.0, 2.0, 3.0]], dtype=dtype)  # gates nan, 1; ups 2, 3
    silu_nan, silu_one = kernels.silu_and_mul(with_nan)[0]
    assert silu_nan.isnan() and silu_one == layers.silu_and_mul(with_nan)[0, 1]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", ROWS)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", HEAD_LAYOUTS)
def test_apply_rotary_turns_q_and_k_in_place_in_the_qkv_buffer(kernels, dtype, num_rows, num_heads, num_kv_heads,
                                                               head_dim):
    qkv = random(num_rows, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=10)
    qk = qkv[:, :(num_heads + num_kv_heads) * head_dim].view(num_rows, num_heads + num_kv_heads, head_dim)
    v_before = qkv[:, (num_heads + num_kv_heads) * head_dim:].clone()
    rotary = RotaryEmbedding(head_dim, 500000.0, None, torch.device("cpu"))
    cos, sin = rotary.compute(torch.arange(num_rows) * 37 + 5, dtype)  # each [num_rows, head_dim]
    expected = layers.apply_rotary(qk, cos, sin)
    rotated = kernels.apply_rotary(qk, cos, sin)
    assert rotated.data_ptr() == qkv.data_ptr()
    assert_matches(rotated, expected, exact=True)
    assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_dim:], v_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", ROWS)
def test_write_kv_stores_each_rows_k_and_v_at_its_slot_as_index_copy_does(kernels, dtype, num_rows):
    """k and v as the model hands them, views of the qkv buffer's rows; the slots anywhere in the cache."""
    num_heads, num_kv_heads, head_dim = 4, 2, 8
    qkv = random(num_rows, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=20)
    k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(num_rows, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(num_rows, num_kv_heads, head_dim)
    caches = [random(6, 16, num_kv_heads, head_dim, dtype=dtype, seed=seed) for seed in (21, 22)]
    slots = torch.randperm(6 * 16, generator=torch.Generator().manual_seed(num_rows))[:num_rows]
    expected = [cache.clone() for cache in caches]
    write_kv_cache(k, v, *expected, slots)
    kernels.write_kv(k, v, *caches, slots)
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(caches, expected))


def test_write_kv_refuses_a_slot_outside_the_cache_and_writes_nothing(kernels):
    k, v = random(3, 2, 8, dtype=torch.float32, seed=23), random(3, 2, 8, dtype=torch.float32, seed=24)
    caches = [torch.zeros(2, 4, 2, 8) for _ in range(2)]
    for bad_slot in (8, -1):
        with pytest.raises(ValueError, match="a slot outside the KV cache"):
            kernels.write_kv(k, v, *caches, torch.tensor([0, 1, bad_slot]))
        assert not any(cache.any() for cache in caches)


def test_inputs_the_kernels_do_not_take_go_to_torch(kernels):
    """float16, and a last dim that is not contiguous: the torch ops' answers, inputs left as they were (the KV
    write's caches written as torch writes them)."""
    x, residual = random(3, 32, dtype=torch.float16, seed=11), random(3, 32, dtype=torch.float16, seed=12)
    weight = random(32, dtype=torch.float16, seed=13)
    for ours, reference in zip(kernels.add_rms_norm(x, residual, weight, EPS), layers.add_rms_norm(x, residual, weight, EPS)):
        assert torch.equal(ours, reference)
    gate_up = random(16, 5, dtype=torch.float32, seed=14).t()  # [5, 16], each row strided
    assert torch.equal(kernels.silu_and_mul(gate_up), layers.silu_and_mul(gate_up))
    qk = random(2, 3, 8, dtype=torch.float16, seed=15)
    cos, sin = random(2, 8, dtype=torch.float16, seed=16), random(2, 8, dtype=torch.float16, seed=17)
    assert torch.equal(kernels.apply_rotary(qk, cos, sin), layers.apply_rotary(qk, cos, sin))
    caches = [torch.zeros(2, 4, 3, 8, dtype=torch.float16) for _ in range(2)]
    expected = [cache.clone() for cache in caches]
    kernels.write_kv(qk, qk, *caches, torch.tensor([5, 2]))
    write_kv_cache(qk, qk, *expected, torch.tensor([5, 2]))
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(caches, expected))


def test_cuda_gets_the_torch_ops_and_the_cpu_the_kernels_that_beat_them_on_its_tier(tier):
    assert select_layer_ops("cuda", tier) is TORCH_LAYER_OPS
    ops = select_layer_ops("cpu", tier)
    assert all(isinstance(op.__self__, CpuFusedKernels) for op in (ops.rms_norm, ops.add_rms_norm, ops.apply_rotary))
    kernels = ops.rms_norm.__self__
    if tier.vector_bits >= 512:
        assert ops.silu_and_mul == kernels.silu_and_mul
    elif tier.vector_bits >= 256:  # the kernel on float32 rows, torch's op on bfloat16's
        assert ops.silu_and_mul == kernels.silu_and_mul_float32
        gate_up = random(3, 16, dtype=torch.bfloat16, seed=18)
        assert torch.equal(ops.silu_and_mul(gate_up), layers.silu_and_mul(gate_up))
    else:
        assert ops.silu_and_mul is TORCH_LAYER_OPS.silu_and_mul


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_model_on_the_kernels_matches_the_model_on_torch_ops(kernels, tmp_path, dtype):
    """A prefill then decodes, packed: the same greedy tokens; logits within 1e-4 in float32 and, in bfloat16,
    within one bfloat16 step of the largest logit (the ops round alike, so they are in fact equal)."""
    path = make_checkpoint(tmp_path, "qwen2", dtype=dtype)  # biases, tied embeddings, GQA
    logits = {name: run_model(path, dtype, ops) for name, ops in (("torch", TORCH_LAYER_OPS), ("kernels", kernels.layer_ops()))}
    assert torch.equal(logits["kernels"].argmax(-1), logits["torch"].argmax(-1))
    tolerance = 1e-4 if dtype == torch.float32 else bfloat16_step(logits["torch"].abs().max()).item()
    assert (logits["kernels"] - logits["torch"]).abs().max().item() <= tolerance


def run_model(path, dtype: torch.dtype, ops: layers.LayerOps) -> torch.Tensor:
    """Logits [num_tokens, vocab] of a prefill of two prompts, then a decode step of each."""
    config = read_model_config(path)
    model = LlamaForCausalLM(config, select_paged_attention("cpu"), dtype, torch.device("cpu"), ops=ops)
    load_weights(model, path)
    shape = (NUM_BLOCKS, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
    kv_caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(config.num_hidden_layers)]
    a, b = torch.randint(3, 512, (13,), generator=torch.Generator().manual_seed(0)).tolist(), list(range(20, 29))
    steps = [([a, b], [0, 0], [13, 9], [[0, 1, 2, 3], [4, 5, 6]]),  # block tables grow by a block each
             ([a[:1], b[:1]], [13, 9], [1, 1], [[0, 1, 2, 3], [4, 5, 6]])]
    logits = []
    with torch.inference_mode():
        for token_lists, computed, new, tables in steps:
            meta = make_metadata(tables, computed, new, BLOCK_SIZE)
            input_ids = torch.tensor([t for tokens in token_lists for t in tokens])
            positions = torch.tensor([p for start, n in zip(computed, new) for p in range(start, start + n)])
            logits.append(model.compute_logits(model(input_ids, positions, kv_caches, meta)))
    return torch.cat(logits)


def test_the_library_refuses_sizes_it_cannot_walk():
    """The C side's own checks, behind the Python ones: rows that overlap, an odd head_dim, an unknown dtype."""
    x = torch.zeros(4, 8)
    library = load_kernel_library(SOURCE)
    CpuFusedKernels(library)  # declares the functions' argument types
    assert library.pagedserve_rms_norm(0, x.data_ptr(), 4, x.data_ptr(), x.data_ptr(), 8, 4, 8, EPS, 1) == 1
    assert library.pagedserve_apply_rotary(0, x.data_ptr(), 8, 1, x.data_ptr(), x.data_ptr(), 8, 4, 7, 1) == 1
    assert library.pagedserve_silu_and_mul(7, x.data_ptr(), 8, x.data_ptr(), 4, 4, 4, 1) == 2
    assert library.pagedserve_add_rms_norm(0, x.data_ptr(), 8, x.data_ptr(), 8, x.data_ptr(), 4, 8, EPS, 0) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_table_rows_equal_cos_sin_computed_per_forward(dtype):
    rotary = RotaryEmbedding(64, 10000.0, {"rope_type": "linear", "factor": 2.0}, torch.device("cpu"))
    for max_position in (5, 17, 300, 1000):  # the table grows past its power of two three times
        positions = torch.randint(0, max_position, (40,))
        cos, sin = rotary(positions, dtype, max_position)
        expected_cos, expected_sin = rotary.compute(positions, dtype)
        assert torch.equal(cos, expected_cos) and torch.equal(sin, expected_sin)
