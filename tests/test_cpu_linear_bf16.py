"""The bfloat16 pair kernel (cpu_linear_bf16.c) against the float64 product of the same bfloat16 values, on every
CPU tier this machine runs: where bfloat16 is native (AVX-512 BF16) it must agree to within one rounding of the
result to bfloat16; on every other tier it must not load, so bfloat16 weights stay oneDNN's.

Shapes are the engine's: the default model's and SmolLM-135M's fused projections, out_features that are not a
multiple of the column tile, and row counts from a decode step's 1 to a prefill chunk's 2,048, across the
register tile's remainders and the row blocks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.models.cpu_linear_bf16 import PairTiledLinear, load_pair_linear_kernel
from gpu_worker.models.packed_linear import PackedLinear, pack_linears
from shared.cpu_tier import CpuTier, current_tier, tier_named

from helpers.cpu_tiers import kernel_tier_params

SHAPES = [(640, 384), (384, 1024), (960, 576), (100, 96), (8, 32)]  # [out, in]
ROWS = [0, 1, 5, 7, 8, 16, 17, 97, 300, 2048]


@pytest.fixture(scope="module", params=kernel_tier_params())
def tier(request) -> CpuTier:
    return request.param


def _this_tiers_kernel():
    kernel = load_pair_linear_kernel(current_tier())
    if kernel is None:
        pytest.skip(f"this machine's tier ({current_tier().name}) has no native bfloat16: oneDNN keeps it")
    return kernel


def _random(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _assert_matches_float64(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    reference = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert got.dtype == torch.bfloat16 and got.shape == reference.shape
    # float32 sums of bfloat16 products (exact in float32) are within ~1e-5 of the float64 ones, so the result is
    # the reference rounded to bfloat16 (a relative 2^-8 at most), or the next value when a sum lies that close to
    # a rounding boundary: within 2^-7 relative, plus the float32 sums' own error near zero.
    assert torch.allclose(got.double(), reference, rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda shape: f"{shape[0]}x{shape[1]}")
def test_matches_the_float64_product_where_bfloat16_is_native_and_is_absent_elsewhere(
        tier, shape: tuple[int, int], rows: int) -> None:
    kernel = load_pair_linear_kernel(tier)
    if kernel is None:
        assert not (tier.has_native_bf16 and tier.has_wide_vectors), f"the {tier.name} build should load"
        pytest.skip(f"{tier.name} has no native bfloat16: oneDNN keeps it")
    weight, bias, x = _random(*shape, seed=rows), _random(shape[0], seed=1), _random(rows, shape[1], seed=2)
    _assert_matches_float64(PairTiledLinear(kernel, weight, bias)(x), x, weight, bias)
    _assert_matches_float64(PairTiledLinear(kernel, weight, None)(x), x, weight, None)


def test_rows_that_are_a_view_and_leading_dimensions_come_back_in_their_shape() -> None:
    kernel = _this_tiers_kernel()
    weight, wide = _random(48, 32, seed=3), _random(6, 64, seed=4)
    x = wide[:, :32]  # not contiguous, as a split of a fused projection's output is
    _assert_matches_float64(PairTiledLinear(kernel, weight, None)(x), x, weight, None)
    batched = _random(2, 3, 32, seed=5)
    got = PairTiledLinear(kernel, weight, None)(batched)
    assert got.shape == (2, 3, 48)
    _assert_matches_float64(got.reshape(6, 48), batched.reshape(6, 32), weight, None)


def test_threads_split_the_columns_without_changing_a_bit() -> None:
    linear = PairTiledLinear(_this_tiers_kernel(), _random(960, 576, seed=6), None)
    x = _random(16, 576, seed=7)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = linear(x)
        torch.set_num_threads(2)
        split = linear(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, split), "each column is summed by one thread in the same order"


def test_a_float32_input_or_an_odd_in_features_is_refused_by_name() -> None:
    kernel = _this_tiers_kernel()
    linear = PairTiledLinear(kernel, _random(8, 16, seed=8), None)
    with pytest.raises(TypeError, match="bfloat16, got torch.float32"):
        linear(_random(2, 16, seed=9).float())
    with pytest.raises(ValueError, match="even in_features"):
        PairTiledLinear(kernel, _random(8, 15, seed=10), None)


def test_packing_a_bfloat16_model_takes_the_pair_kernel_where_it_loads_and_onednn_elsewhere() -> None:
    model = nn.Sequential(nn.Linear(64, 96, dtype=torch.bfloat16), nn.Linear(95, 32, dtype=torch.bfloat16))
    tier = current_tier()
    pack_linears(model, tier)
    if load_pair_linear_kernel(tier) is None:
        expected = PackedLinear if tier.can_pack_bf16 else nn.Linear
        assert all(type(layer) is expected for layer in model), [type(layer) for layer in model]
    else:  # an odd in_features has no pairs: that layer stays oneDNN's
        assert [type(layer) for layer in model] == [PairTiledLinear, PackedLinear]



def test_amx_keeps_onednns_matrix_tiles() -> None:
    """On AMX oneDNN computes bfloat16 in matrix tiles, 5x this kernel's rate at prefill rows (a 16-core Xeon)."""
    assert load_pair_linear_kernel(tier_named("amx")) is None


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("rows", [0, 1, 7, 8, 17, 97, 130])
@pytest.mark.parametrize("shape", [(4096, 64), (1000, 96), (100, 32), (8, 32)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_the_argmax_taken_as_the_tiles_are_written_is_torchs_argmax_of_the_logits(
        shape: tuple[int, int], rows: int, threads: int) -> None:
    """An LM head's greedy choice (forward_with_argmax): the same bfloat16 logits as forward, and each row's argmax
    of their float32 values exactly as torch.argmax gives it, ties and NaN included, however many threads split the
    columns: random logits; the best column tied between the first tile and the last (so between threads); NaN in
    two columns (the first NaN wins); every logit -inf (token 0, as torch answers)."""
    kernel = _this_tiers_kernel()
    out_features, in_features = shape
    weight, bias, x = _random(*shape, seed=rows), _random(out_features, seed=4), _random(rows, in_features, seed=5)
    low, high = 3 % out_features, out_features - 2
    tied_weight, tied_bias = weight.clone(), bias.clone()
    tied_weight[high], tied_bias[low], tied_bias[high] = tied_weight[low], 1e4, 1e4
    nan_bias = bias.clone()
    nan_bias[[high, low]] = float("nan")
    cases = {"random": (weight, bias), "tied": (tied_weight, tied_bias), "nan": (weight, nan_bias),
             "-inf": (weight, torch.full_like(bias, float("-inf")))}
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for case, (case_weight, case_bias) in cases.items():
            linear = PairTiledLinear(kernel, case_weight, case_bias)
            logits, argmax = linear.forward_with_argmax(x)
            assert torch.allclose(logits.float(), linear(x).float(), rtol=0, atol=0, equal_nan=True), case
            assert argmax.dtype == torch.int64 and torch.equal(argmax, logits.float().argmax(dim=-1)), case
            if case != "random":  # the case is what it says: the lowest of the tied or NaN columns, or token 0
                assert set(argmax.tolist()) <= {0 if case == "-inf" else low}, case
    finally:
        torch.set_num_threads(previous)
