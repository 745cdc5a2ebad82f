"""The CPU draw kernel (cpu_draw.c) against torch's race, the reference: the same token for every row.

The kernel computes the noise of sampling/noise.py with a logarithm of its
own, so two tokens whose races end within a few ulp could go either way;
every row here is also checked to be decisive in float64 (the winner's lead
over the runner-up is far above float32 rounding), so an equal token is the
kernel being right, not lucky.
"""

from __future__ import annotations

import random

import pytest
import torch

from gpu_worker.sampling.draw import (
    draw,
    draw_filtered_on_cpu,
    draw_on_cpu,
    draw_with_torch,
    filter_and_draw,
    greedy_tokens,
    kernel_race_terms,
    load_argmax_kernel,
    load_filtered_kernel,
    load_kernel,
)
from gpu_worker.sampling.filters import filter_logits
from gpu_worker.sampling.noise import draw_key, exponential_noise
from shared.sampling_params import SamplingParams

from helpers.cpu_tiers import kernel_tier_params


@pytest.fixture(scope="module", params=kernel_tier_params())
def tier(request):
    return request.param


@pytest.fixture(scope="module")
def kernel(tier):
    """The kernel's build for each CPU tier this machine runs."""
    function = load_kernel(tier)
    assert function is not None, "the draw kernel is not installed; pip install -e . builds it"
    return function


def keys_for(num_rows: int, output_index: int = 0) -> list[int]:
    return [draw_key(seed * 7919, output_index) for seed in range(num_rows)]


def decisive_rows(logits: torch.Tensor, keys: list[int]) -> torch.Tensor:
    """Rows whose race, in float64, is won by more than 1e-4: [num_rows] bool."""
    scores = logits.double() - exponential_noise(keys, logits.shape[1], logits.device).double().log()
    top2 = scores.topk(min(2, scores.shape[1]), dim=-1).values
    return (top2[:, 0] - top2[:, -1] > 1e-4) | (scores.shape[1] == 1)


def test_the_kernels_race_terms_are_torchs_within_a_few_ulp(tier):
    """log(E) for every uniform 65,537 tokens give, through the kernel's two logarithms against torch's: within
    4 ulp of a value of magnitude 1 or more (E near 1, where log(E) nears 0, carries E's own rounding)."""
    keys = keys_for(64)
    expected = exponential_noise(keys, 65_537, torch.device("cpu")).log()
    got = kernel_race_terms(keys, 65_537, tier)
    assert ((got - expected).abs() <= 4 * 2.0 ** -23 * expected.abs().clamp(min=1)).all()
    assert float(expected.min()) < -15 and float(expected.max()) > 2.5  # both logarithms' whole range


@pytest.mark.parametrize("vocab_size", [1, 7, 37, 4096, 49152])
@pytest.mark.parametrize("scale", [0.0, 1.0, 5.0], ids=["uniform", "mild", "peaked"])
def test_the_kernel_draws_the_token_torch_does(kernel, vocab_size, scale):
    logits = torch.randn(24, vocab_size, generator=torch.Generator().manual_seed(vocab_size)) * scale
    keys = keys_for(24, output_index=vocab_size)
    decisive = decisive_rows(logits, keys)
    assert decisive.float().mean() > 0.9
    got, expected = draw_on_cpu(kernel, logits, keys), draw_with_torch(logits, keys)
    assert torch.equal(got[decisive], expected[decisive])


def test_filtered_rows_draw_only_tokens_their_filters_keep(kernel):
    """After top_p most of a row is -inf: the kernel skips those runs and still picks torch's token."""
    logits = torch.randn(64, 4096, generator=torch.Generator().manual_seed(5)) * 3
    filtered = filter_logits(logits, [SamplingParams(temperature=0.8, top_p=0.9)] * 64)
    for output_index in range(5):
        keys = keys_for(64, output_index)
        got = draw_on_cpu(kernel, filtered, keys)
        assert filtered.gather(1, got[:, None]).isfinite().all()
        decisive = decisive_rows(filtered, keys)
        assert torch.equal(got[decisive], draw_with_torch(filtered, keys)[decisive])


def test_a_row_of_only_excluded_tokens_draws_token_0_as_argmax_does(kernel):
    logits = torch.randn(3, 20)
    logits[1] = float("-inf")
    keys = keys_for(3)
    got = draw_on_cpu(kernel, logits, keys)
    assert int(got[1]) == 0 == int(draw_with_torch(logits, keys)[1])


def test_a_rows_token_does_not_depend_on_its_batch_or_the_threads(kernel):
    logits = torch.randn(40, 1000, generator=torch.Generator().manual_seed(2)) * 2
    keys = keys_for(40, output_index=3)
    together = draw_on_cpu(kernel, logits, keys)
    alone = torch.cat([draw_on_cpu(kernel, logits[row:row + 1], keys[row:row + 1]) for row in range(40)])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = draw_on_cpu(kernel, logits, keys)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, alone) and torch.equal(together, one_thread)
    assert len(set(together.tolist())) > 20  # not trivially equal


def test_rows_of_a_wider_tensor_are_read_with_their_stride(kernel):
    wide = torch.randn(6, 600, generator=torch.Generator().manual_seed(4))
    keys = keys_for(6)
    strided = wide[:, :300]
    assert strided.stride(0) == 600
    assert torch.equal(draw_on_cpu(kernel, strided, keys), draw_on_cpu(kernel, strided.contiguous(), keys))


def test_rows_the_kernel_cannot_read_go_to_torch():
    logits = torch.randn(300, 4).t()  # rows of stride (1, 4): not the kernel's
    keys = keys_for(4)
    assert torch.equal(draw(logits, keys), draw_with_torch(logits.contiguous(), keys))


def test_bad_input_is_refused(kernel):
    logits, tokens = torch.zeros(2, 4), torch.empty(2, dtype=torch.int64)
    keys = torch.zeros(2, dtype=torch.int64)
    for row_stride, vocab_size in ((3, 4), (4, 0)):
        assert kernel(logits.data_ptr(), row_stride, 2, vocab_size, keys.data_ptr(), tokens.data_ptr(), 1) == 1
    with pytest.raises(ValueError, match="a key for each"):
        draw_on_cpu(kernel, logits, [1])


# --- temperature, top-p and the draw in one call ---------------------------------------------------------------


@pytest.fixture(scope="module")
def filtered_kernel(tier):
    function = load_filtered_kernel(tier)
    assert function is not None, "the draw kernel is not installed; pip install -e . builds it"
    return function


def mixed_params(num_rows: int, seed: int) -> list[SamplingParams]:
    rng = random.Random(seed)
    return [unchecked(temperature=rng.choice([0.3, 0.8, 1.0, 1.7, 1e-40, 1e39]),
                      top_p=rng.choice([1.0, 0.95, 0.9, 0.5, 0.99999999, 1e-46])) for _ in range(num_rows)]


def unchecked(**fields) -> SamplingParams:
    """SamplingParams past its own checks: the extremes the filters must still handle."""
    params = SamplingParams()
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    return params


@pytest.mark.parametrize("vocab_size", [1, 7, 37, 4096, 49152])
def test_one_call_filters_and_draws_what_the_filters_and_the_draw_do(filtered_kernel, vocab_size):
    """Against filter_logits then torch's race: the same token on every decisive row, and never a token the
    filters exclude, over temperatures from ones that round to 0 or inf to ordinary, and top_p from one that
    rounds to 0 to one that rounds to 1."""
    logits = torch.randn(48, vocab_size, generator=torch.Generator().manual_seed(vocab_size)) * 4
    logits[5, : vocab_size // 2] = float("-inf")
    logits[7, 0] = float("nan")
    logits[9, -1] = float("inf")
    logits[11] = float("-inf")
    params, keys = mixed_params(48, vocab_size), keys_for(48, output_index=2)
    filtered = filter_logits(logits, params)
    decisive = decisive_rows(filtered, keys)
    assert decisive.float().mean() > 0.8
    got = draw_filtered_on_cpu(filtered_kernel, logits, params, keys)
    assert filtered.gather(1, got[:, None]).squeeze(1)[filtered.isfinite().any(dim=-1)].isfinite().all()
    assert torch.equal(got[decisive], draw_with_torch(filtered, keys)[decisive])
    assert int(got[11]) == 0  # nothing to draw: token 0, as argmax of a row of -inf


def test_filter_and_draw_takes_the_kernel_only_for_temperature_and_top_p(filtered_kernel):
    """Rows that ask for min_p or top_k go through filter_logits and the draw; the tokens agree either way."""
    logits = torch.randn(16, 500, generator=torch.Generator().manual_seed(8)) * 3
    keys = keys_for(16)
    plain = [SamplingParams(temperature=0.9, top_p=0.9)] * 16
    with_top_k = [SamplingParams(temperature=0.9, top_p=0.9, top_k=500)] * 16  # keeps all: the same tokens
    assert torch.equal(filter_and_draw(logits, plain, keys), filter_and_draw(logits, with_top_k, keys))
    reference = draw_with_torch(filter_logits(logits, plain), keys)
    decisive = decisive_rows(filter_logits(logits, plain), keys)
    assert torch.equal(filter_and_draw(logits, plain, keys)[decisive], reference[decisive])


def test_the_filtering_kernel_refuses_bad_sizes(filtered_kernel):
    logits, tokens = torch.zeros(2, 4), torch.empty(2, dtype=torch.int64)
    keys, temperature, top_p = torch.zeros(2, dtype=torch.int64), torch.ones(2), torch.ones(2)
    for row_stride, vocab_size in ((3, 4), (4, 0)):
        assert filtered_kernel(logits.data_ptr(), row_stride, 2, vocab_size, temperature.data_ptr(),
                               top_p.data_ptr(), keys.data_ptr(), tokens.data_ptr(), 1) == 1
    with pytest.raises(ValueError, match="a key for each"):
        draw_filtered_on_cpu(filtered_kernel, logits, [SamplingParams()] * 2, [1])


# --- the greedy choice -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab_size", [1, 7, 37, 4096, 49152])
def test_the_argmax_kernel_picks_torchs_token_ties_nan_and_all(tier, vocab_size):
    """Index for index torch's argmax: ties to the lowest token, NaN above everything (the first NaN), +inf above
    any finite logit, a row of -inf token 0; rows of a wider tensor read with their stride."""
    kernel = load_argmax_kernel(tier)
    assert kernel is not None, "the draw kernel is not installed; pip install -e . builds it"
    logits = (torch.randn(12, vocab_size + 3, generator=torch.Generator().manual_seed(vocab_size)) * 2).round()
    logits = logits[:, :vocab_size]  # ties in every row; rows of stride vocab_size + 3
    logits[1] = float("-inf")
    logits[2, vocab_size // 2:] = float("nan")
    logits[3, -1] = float("inf")
    logits[4, 0] = float("nan")
    logits[4, -1] = float("nan")
    logits[5] = 7.0  # one tie across the whole row
    tokens = torch.empty(12, dtype=torch.int64)
    assert kernel(logits.data_ptr(), logits.stride(0), 12, vocab_size, tokens.data_ptr(), 2) == 0
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_greedy_tokens_is_argmax_on_every_path():
    logits = torch.randn(5, 300)
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
    transposed = torch.randn(300, 5).t()  # rows of stride (1, 5): torch's path
    assert torch.equal(greedy_tokens(transposed), transposed.argmax(dim=-1))
    assert greedy_tokens(torch.empty(0, 300)).shape == (0,)
