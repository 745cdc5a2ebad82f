"""A gated MLP's gate and up projection packed in pairs (cpu_linear.c's paired tiles) against the same weights
unpaired, on every CPU tier this machine runs: the product bit for bit, and SiLU·up taken as the tiles are
computed bit for bit the per-row kernel's (cpu_fused.c) on that product, within float32 rounding of torch's.

Halves whose width is not a whole number of vectors (padded), biases, row counts across the register tile's
remainders and the row blocks, one thread and torch's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.models.cpu_fused import SOURCE as FUSED_SOURCE
from gpu_worker.models.cpu_fused import CpuFusedKernels
from gpu_worker.models.cpu_linear import TiledLinear, load_tiled_linear_kernel
from gpu_worker.native.compiled_library import load_kernel_library
from shared.cpu_tier import CpuTier

from helpers.cpu_tiers import kernel_tier_params

SHAPES = [(2 * 688, 256), (2 * 40, 64), (2 * 1536, 576), (2 * 3, 32)]  # [2 * half, in]: 40 and 3 pad a vector
ROWS = [1, 5, 16, 17, 97, 300]


@pytest.fixture(scope="module", params=kernel_tier_params())
def tier(request) -> CpuTier:
    return request.param


def random(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def run(call) -> None:
    kernel, args = call
    assert kernel(*args) == 0


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda shape: f"{shape[0]}x{shape[1]}")
def test_paired_tiles_give_the_unpaired_product_and_its_silu_and_mul_to_the_bit(tier, shape, rows, threads):
    kernel = load_tiled_linear_kernel(tier)
    if kernel is None:
        pytest.skip(f"{tier.name} keeps oneDNN: its registers are narrower than the kernel's tile")
    fused = CpuFusedKernels(load_kernel_library(FUSED_SOURCE, tier))
    weight, bias, x = random(*shape, seed=rows), random(shape[0], seed=1), random(rows, shape[1], seed=2)
    half = shape[0] // 2
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for with_bias in (bias, None):
            plain, paired = TiledLinear(kernel, weight, with_bias), TiledLinear(kernel, weight, with_bias, True)
            product = plain(x)  # [rows, 2 * half]: gate's columns, then up's
            assert torch.equal(paired(x), product)
            activation = torch.full((rows, half), float("nan"))
            run(paired.silu_and_mul_call(x, activation))
            assert torch.equal(activation, fused.silu_and_mul(product))
            gate, up = product.double().chunk(2, dim=1)
            torch.testing.assert_close(activation.double(), F.silu(gate) * up, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(previous_threads)


def test_a_paired_projection_has_even_rows_and_no_argmax(tier):
    kernel = load_tiled_linear_kernel(tier)
    if kernel is None:
        pytest.skip(f"{tier.name} keeps oneDNN")
    with pytest.raises(ValueError, match="an even number of rows, got 7"):
        TiledLinear(kernel, random(7, 32, seed=0), None, paired_halves=True)
    paired = TiledLinear(kernel, random(8, 32, seed=0), None, paired_halves=True)
    with pytest.raises(ValueError, match="no argmax"):
        paired.forward_with_argmax(random(2, 32, seed=1))
    with pytest.raises(ValueError, match="paired gate and up projection only"):
        TiledLinear(kernel, random(8, 32, seed=0), None).silu_and_mul_call(random(2, 32, seed=1), torch.empty(2, 4))
