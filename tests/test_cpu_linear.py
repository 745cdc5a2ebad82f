"""The linear kernel (cpu_linear.c) against F.linear in float64, on every CPU tier this machine runs: float32
weights, and int8 (per channel or in groups, as GGUF's Q8_0) and int4 (with or without zero points) ones
against the product with their dequantized weight (quantization.py).

Shapes are the engine's: the default model's and SmolLM-135M's fused projections, out_features that are
not a multiple of the column tile, and row counts from a decode step's 1 to a prefill chunk's 2,048, across
the register tile's remainders and the row blocks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.models.cpu_linear import MIN_VECTOR_BITS, TiledLinear, load_tiled_linear_kernel
from gpu_worker.models.quantization import QuantizedWeight, quantize
from gpu_worker.models.quantized_linear import QuantizedLinear
from shared.cpu_tier import CpuTier, current_tier, tier_named

from helpers.cpu_tiers import kernel_tier_params

SHAPES = [(640, 384), (384, 1024), (960, 576), (100, 96), (8, 32)]  # [out, in]; in a multiple of int4's groups
ROWS = [0, 1, 5, 7, 8, 16, 17, 97, 300, 2048]


@pytest.fixture(scope="module", params=kernel_tier_params())
def tier(request) -> CpuTier:
    return request.param


def _this_tiers_kernel():
    kernel = load_tiled_linear_kernel(current_tier())
    if kernel is None:
        pytest.skip(f"this machine's tier ({current_tier().name}) keeps oneDNN")
    return kernel


def _random(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _assert_matches_float64(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    reference = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert got.dtype == torch.float32 and got.shape == reference.shape
    # Sums of up to 1,024 products of unit normals (about 32 in size): float32 in any order stays within 1e-4.
    assert torch.allclose(got.double(), reference, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda shape: f"{shape[0]}x{shape[1]}")
def test_matches_the_float64_product_on_every_tier(tier, shape: tuple[int, int], rows: int) -> None:
    kernel = load_tiled_linear_kernel(tier)
    if kernel is None:
        assert tier.vector_bits < MIN_VECTOR_BITS, f"the {tier.name} build should load"
        pytest.skip(f"{tier.name} keeps oneDNN: its registers are narrower than the kernel's tile")
    weight, bias, x = _random(*shape, seed=rows), _random(shape[0], seed=1), _random(rows, shape[1], seed=2)
    _assert_matches_float64(TiledLinear(kernel, weight, bias)(x), x, weight, bias)
    _assert_matches_float64(TiledLinear(kernel, weight, None)(x), x, weight, None)


def asymmetric_int4(weight: torch.Tensor, group_size: int = 32) -> QuantizedWeight:
    """AWQ's kind of int4: per group, scale = (max - min) / 15 and an unsigned zero point z = round(-min / scale),
    n = round(w / scale) + z in [0, 15]; held as q = n - 8 and zero = z - 8."""
    groups = weight.view(weight.shape[0], -1, group_size)
    low, high = groups.amin(dim=2, keepdim=True), groups.amax(dim=2, keepdim=True)
    scales = (high - low) / 15
    zeros = torch.round(-low / scales).clamp(0, 15)
    n = (torch.round(groups / scales) + zeros).clamp(0, 15)
    return QuantizedWeight("int4", (n - 8).to(torch.int8).view_as(weight), scales.squeeze(2), group_size,
                           (zeros - 8).to(torch.int8).squeeze(2))


@pytest.mark.parametrize("scheme,group_size", [("int8", None), ("int4", None), ("int8", 32), ("int4-zero", 32)],
                         ids=["int8", "int4", "int8-groups-of-32", "int4-with-zero-points"])
@pytest.mark.parametrize("rows", [1, 3, 6, 7, 8, 16, 97, 2048])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda shape: f"{shape[0]}x{shape[1]}")
def test_quantized_weights_match_the_product_with_their_dequantized_weight(tier, shape: tuple[int, int], rows: int,
                                                                          scheme: str, group_size: int | None) -> None:
    kernel = load_tiled_linear_kernel(tier)
    if kernel is None:
        pytest.skip(f"{tier.name} keeps oneDNN: its registers are narrower than the kernel's tile")
    weight, bias, x = _random(*shape, seed=rows), _random(shape[0], seed=1), _random(rows, shape[1], seed=2)
    quantized = asymmetric_int4(weight) if scheme == "int4-zero" else quantize(weight, scheme, group_size)
    layer = QuantizedLinear(quantized, bias, kernel)
    _assert_matches_float64(layer(x), x, quantized.dequantized(), bias)


def test_rows_that_are_a_view_and_leading_dimensions_come_back_in_their_shape() -> None:
    kernel = _this_tiers_kernel()
    weight, wide = _random(48, 32, seed=3), _random(6, 64, seed=4)
    x = wide[:, :32]  # not contiguous, as a split of a fused projection's output is
    _assert_matches_float64(TiledLinear(kernel, weight, None)(x), x, weight, None)
    batched = _random(2, 3, 32, seed=5)
    got = TiledLinear(kernel, weight, None)(batched)
    assert got.shape == (2, 3, 48)
    _assert_matches_float64(got.reshape(6, 48), batched.reshape(6, 32), weight, None)


def test_threads_split_the_columns_without_changing_a_bit() -> None:
    kernel = _this_tiers_kernel()
    linear = TiledLinear(kernel, _random(960, 576, seed=6), None)
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


def test_a_dtype_other_than_float32_is_refused_by_name() -> None:
    linear = TiledLinear(_this_tiers_kernel(), _random(8, 16, seed=8), None)
    with pytest.raises(TypeError, match="float32, got torch.bfloat16"):
        linear(_random(2, 16, seed=9).to(torch.bfloat16))


def test_tiers_below_avx2_keep_onednn() -> None:
    assert load_tiled_linear_kernel(tier_named("x86-64")) is None


def _argmax_cases(out_features: int, in_features: int, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(weight, bias) per case: random; the best column tied between the first tile and the last (so between
    threads); NaN in two columns (the first NaN wins); every logit -inf (token 0, as torch answers)."""
    weight, bias = _random(out_features, in_features, seed=seed), _random(out_features, seed=seed + 1)
    tied_weight, tied_bias = weight.clone(), bias.clone()
    low, high = 3 % out_features, out_features - 2
    tied_weight[high], tied_bias[low], tied_bias[high] = tied_weight[low], 1e4, 1e4
    nan_bias = bias.clone()
    nan_bias[[high, low]] = float("nan")
    return {"random": (weight, bias), "tied": (tied_weight, tied_bias), "nan": (weight, nan_bias),
            "-inf": (weight, torch.full_like(bias, float("-inf")))}


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("rows", [0, 1, 7, 8, 17, 97, 130])
@pytest.mark.parametrize("shape", [(4096, 64), (1000, 96), (100, 32), (8, 32)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_the_argmax_taken_as_the_tiles_are_written_is_torchs_argmax_of_the_logits(
        tier, shape: tuple[int, int], rows: int, threads: int) -> None:
    """An LM head's greedy choice (forward_with_argmax): the same logits as forward, and each row's argmax of them
    exactly as torch.argmax gives it, ties and NaN included, however many threads split the columns."""
    kernel = load_tiled_linear_kernel(tier)
    if kernel is None:
        pytest.skip(f"{tier.name} keeps oneDNN: its registers are narrower than the kernel's tile")
    x = _random(rows, shape[1], seed=3)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for case, (weight, bias) in _argmax_cases(*shape, seed=rows).items():
            linear = TiledLinear(kernel, weight, bias)
            logits, argmax = linear.forward_with_argmax(x)
            assert torch.allclose(logits, linear(x), rtol=0, atol=0, equal_nan=True), case
            assert argmax.dtype == torch.int64 and torch.equal(argmax, logits.argmax(dim=-1)), case
            if case != "random":  # the case is what it says: the lowest of the tied or NaN columns, or token 0
                assert set(argmax.tolist()) <= {0 if case == "-inf" else 3 % shape[0]}, case
    finally:
        torch.set_num_threads(previous)
