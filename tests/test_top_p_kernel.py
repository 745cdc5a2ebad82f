"""The CPU top-p kernel (cpu_top_p.c) against torch's sort-based cutoff, the reference: equal, bit for bit.

Rows peaked and flat, with ties (rounded logits), with excluded tokens
(probability 0), a vocabulary from 1 token to 49,152, top_p from one that
rounds to 0 in float32 to 1, and rows that are a strided view of a wider
tensor.
"""

from __future__ import annotations

import pytest
import torch

from gpu_worker.sampling.filters import filter_logits
from gpu_worker.sampling.top_p import (
    TOP_P_CANDIDATES,
    cutoff_on_cpu,
    cutoff_with_torch,
    exclude_outside_nucleus,
    load_kernel,
    top_p_cutoff,
)
from shared.sampling_params import SamplingParams

from helpers.cpu_tiers import kernel_tier_params


@pytest.fixture(scope="module", params=kernel_tier_params())
def kernel(request):
    """The kernel's build for each CPU tier this machine runs."""
    function = load_kernel(request.param)
    assert function is not None, "the top-p kernel is not installed; pip install -e . builds it"
    return function


def probabilities(num_rows: int, vocab_size: int, scale: float, seed: int, *, ties: bool = False,
                  excluded: float = 0.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab_size, generator=generator) * scale
    if ties:
        logits = logits.round()
    num_excluded = int(vocab_size * excluded)
    if num_excluded:
        logits[:, 1:1 + num_excluded] = float("-inf")
    return logits.softmax(dim=-1)


@pytest.mark.parametrize("vocab_size", [1, 2, 37, TOP_P_CANDIDATES + 44, 4096, 49152])
@pytest.mark.parametrize("scale", [0.05, 1.0, 6.0, 40.0], ids=["flat", "mild", "peaked", "one-hot"])
@pytest.mark.parametrize("shape", ["plain", "ties", "excluded"])
def test_the_kernel_finds_the_cutoff_the_sort_does(kernel, vocab_size, scale, shape):
    probs = probabilities(12, vocab_size, scale, seed=vocab_size, ties=shape == "ties",
                          excluded=0.5 if shape == "excluded" else 0.0)
    top_p = torch.tensor([[0.001], [0.1], [0.3], [0.5], [0.8], [0.9], [0.95], [0.99], [0.999], [0.9999999], [1.0],
                          [1e-46]], dtype=torch.float32)  # the last rounds to 0 in float32: the best token alone
    assert torch.equal(cutoff_on_cpu(kernel, probs, top_p), cutoff_with_torch(probs, top_p))


@pytest.mark.parametrize("vocab_size", [1, 37, 4096])
def test_the_kernel_excludes_what_the_masked_fill_does(kernel, vocab_size):
    """With logits, the kernel sets -inf where torch's masked_fill of probs < cutoff does, and nowhere else;
    the rows it writes have a stride of their own."""
    generator = torch.Generator().manual_seed(vocab_size)
    logits = (torch.randn(12, vocab_size, generator=generator) * 3).round()  # ties at the cutoff
    logits[3, : vocab_size // 2] = float("-inf")
    logits[5] = float("-inf")  # no cutoff (NaN): nothing more excluded
    probs = logits.softmax(dim=-1)
    top_p = torch.linspace(0.05, 1.0, 12)[:, None]
    expected = logits.masked_fill(probs < cutoff_with_torch(probs, top_p), float("-inf"))
    got = torch.full((12, vocab_size + 5), 7.0)[:, :vocab_size]
    got.copy_(logits)
    cutoff_on_cpu(kernel, probs, top_p, got)
    assert torch.equal(got, expected)


def test_the_nucleus_is_excluded_in_place_on_either_path():
    logits = torch.randn(4, 300) * 2
    probs, top_p = logits.softmax(dim=-1), torch.full((4, 1), 0.8)
    on_kernel, transposed = logits.clone(), logits.t().contiguous().t()  # rows of stride 1: torch's path
    exclude_outside_nucleus(on_kernel, probs, top_p)
    exclude_outside_nucleus(transposed, probs, top_p)
    assert torch.equal(on_kernel, transposed) and on_kernel.isneginf().any() and on_kernel.isfinite().any()


def test_rows_of_a_wider_tensor_are_read_with_their_stride(kernel):
    wide = probabilities(6, 600, 2.0, seed=7)
    probs = wide[:, :300] / wide[:, :300].sum(dim=-1, keepdim=True)  # not a view, but rows of stride 300
    strided = torch.zeros(6, 512)[:, :300]  # rows of stride 512
    strided.copy_(probs)
    top_p = torch.full((6, 1), 0.9)
    assert strided.stride(0) == 512
    assert torch.equal(cutoff_on_cpu(kernel, strided, top_p), cutoff_with_torch(probs, top_p))


def test_a_row_of_nan_has_no_cutoff_as_with_the_sort(kernel):
    """softmax of a row whose logits are all -inf (or NaN) is NaN: no cutoff (NaN), and the other rows as ever."""
    probs = probabilities(3, 50, 2.0, seed=3)
    probs[1] = torch.full((50,), float("-inf")).softmax(dim=-1)
    top_p = torch.full((3, 1), 0.9)
    got, expected = cutoff_on_cpu(kernel, probs, top_p), cutoff_with_torch(probs, top_p)
    assert got[1].isnan().all() and expected[1].isnan().all()
    assert torch.equal(got[[0, 2]], expected[[0, 2]])


def test_a_row_of_only_excluded_tokens_goes_through_the_filters(kernel):
    logits = torch.randn(3, 40)
    logits[1] = float("-inf")
    filtered = filter_logits(logits, [SamplingParams(top_p=0.9)] * 3)
    assert filtered[1].isneginf().all() and torch.isfinite(filtered[[0, 2]]).any(dim=-1).all()


def test_rows_the_kernel_cannot_read_go_to_torch():
    transposed = torch.full((8, 1), 1 / 8).t()  # one row, stride (1, 1): contiguous for torch, not for the kernel
    assert torch.equal(top_p_cutoff(transposed, torch.tensor([[0.5]])), cutoff_with_torch(transposed.contiguous(),
                                                                                          torch.tensor([[0.5]])))


def test_bad_sizes_are_refused_by_the_kernel(kernel):
    probs, cutoffs, top_p = torch.full((2, 4), 0.25), torch.empty(2, 1), torch.full((2, 1), 0.5)
    for row_stride, vocab_size in ((3, 4), (4, 0)):
        assert kernel(probs.data_ptr(), row_stride, 2, vocab_size, top_p.data_ptr(), cutoffs.data_ptr(), None, 0,
                      1) == 1
    logits = torch.zeros(2, 4)  # logits rows narrower than the vocabulary
    assert kernel(probs.data_ptr(), 4, 2, 4, top_p.data_ptr(), cutoffs.data_ptr(), logits.data_ptr(), 3, 1) == 1
