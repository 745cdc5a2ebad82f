"""This machine's ceilings: the matmul rate for a dtype and the memory read bandwidth, measured in a few seconds.

Both run on torch's threads, as the engine does. The matmul rate multiplies an
activation of MATMUL_ROWS rows by a stack of distinct weight matrices whose
total size (MATMUL_STACK_BYTES) is far above the last-level cache, so every
product streams its weights from memory as a model's linear layers do; at 256
rows the product is still compute-bound. The bandwidth sums a 1 GiB tensor
(one read of every byte). Each is the best of a few passes.
"""

from __future__ import annotations

import time

import torch

MATMUL_ROWS = 256
MATMUL_SHAPE = (2048, 4096)  # [in_features, out_features] of each weight matrix
MATMUL_STACK_BYTES = 512 * 2**20
BANDWIDTH_BYTES = 2**30
NUM_PASSES = 3


def matmul_rate(dtype: torch.dtype) -> float:
    """FLOP/s of [MATMUL_ROWS, in] @ [in, out] products over a stack of weights that do not fit in cache."""
    in_features, out_features = MATMUL_SHAPE
    num_weights = MATMUL_STACK_BYTES // (in_features * out_features * dtype.itemsize)
    weights = [torch.randn(in_features, out_features).to(dtype) for _ in range(num_weights)]
    x = torch.randn(MATMUL_ROWS, in_features).to(dtype)  # [rows, in_features]
    flops = 2 * MATMUL_ROWS * in_features * out_features * num_weights
    with torch.inference_mode():
        return flops / _best_seconds(lambda: [torch.matmul(x, w) for w in weights])


def memory_bandwidth() -> float:
    """Read bytes/s: summing a BANDWIDTH_BYTES float32 tensor reads each byte once."""
    data = torch.ones(BANDWIDTH_BYTES // 4)
    return BANDWIDTH_BYTES / _best_seconds(data.sum)


def _best_seconds(work) -> float:
    work()  # warm up threads and the allocator
    best = float("inf")
    for _ in range(NUM_PASSES):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return best
