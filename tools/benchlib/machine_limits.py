"""This machine's ceilings: the matmul rate for a dtype and the memory read bandwidth, measured in a few seconds.

Both run on torch's threads, as the engine does. The matmul rate multiplies an
activation of MATMUL_ROWS rows by a stack of distinct weight matrices whose
total size (MATMUL_STACK_BYTES) is far above the last-level cache, so every
product streams its weights from memory as a model's linear layers do; at 256
rows the product is still compute-bound. It is measured two ways, torch.matmul
and oneDNN's linear on weights packed into its blocked layout (what the
worker's CPU linear layers run, gpu_worker/models/packed_linear.py), and the
machine's rate is the faster: on an AVX-512 machine torch.matmul in float32
reaches well under half of what the packed kernels do, so a ceiling taken
from it alone would flatter every figure measured against it. The bandwidth
sums a 1 GiB tensor (one read of every byte). Each is the best of a few passes.

On a CUDA device (`device_limits("cuda", dtype)`): an 8192^3 matrix product
on random data and a 1 GiB device-to-device copy counting bytes read plus
written, each the median of timed runs after warm-ups, timed with CUDA events.
"""

from __future__ import annotations

import os
import statistics
import time

from shared.cpu_tier import limit_libraries

limit_libraries(os.environ)  # before torch's import: under $PAGEDSERVE_CPU_ISA, the ceilings of that tier

import torch  # noqa: E402

MATMUL_ROWS = 256
MATMUL_SHAPE = (2048, 4096)  # [in_features, out_features] of each weight matrix
MATMUL_STACK_BYTES = 512 * 2**20
BANDWIDTH_BYTES = 2**30
NUM_PASSES = 3
CUDA_MATMUL_SIZE = 8192
CUDA_COPY_BYTES = 2**30
CUDA_WARM_UPS = 3
CUDA_REPEATS = 10


def device_limits(device: str, dtype: torch.dtype) -> tuple[float, float]:
    """(matmul FLOP/s, memory bytes/s) of this machine's CPU or its CUDA device."""
    if device == "cuda":
        return cuda_matmul_rate(dtype), cuda_copy_bandwidth()
    return matmul_rate(dtype), memory_bandwidth()


def cuda_matmul_rate(dtype: torch.dtype) -> float:
    """FLOP/s of a CUDA_MATMUL_SIZE^3 product of random matrices on the GPU."""
    a, b = (torch.randn(CUDA_MATMUL_SIZE, CUDA_MATMUL_SIZE, device="cuda", dtype=dtype) for _ in range(2))
    return 2 * CUDA_MATMUL_SIZE**3 / _cuda_median_seconds(lambda: torch.matmul(a, b))


def cuda_copy_bandwidth() -> float:
    """Bytes/s read plus written by a CUDA_COPY_BYTES device-to-device copy."""
    source = torch.randn(CUDA_COPY_BYTES // 4, device="cuda")  # [elements], float32
    target = torch.empty_like(source)
    return 2 * CUDA_COPY_BYTES / _cuda_median_seconds(lambda: target.copy_(source))


def _cuda_median_seconds(work) -> float:
    for _ in range(CUDA_WARM_UPS):
        work()
    times = []
    for _ in range(CUDA_REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def matmul_rate(dtype: torch.dtype) -> float:
    """The machine's FLOP/s for this dtype: the faster of matmul_rates'."""
    return max(matmul_rates(dtype).values())


def matmul_rates(dtype: torch.dtype) -> dict[str, float]:
    """FLOP/s of [MATMUL_ROWS, in] @ [in, out] products over a stack of weights that do not fit in cache, by
    torch.matmul and (where this torch has it) by oneDNN's linear on packed weights."""
    in_features, out_features = MATMUL_SHAPE
    num_weights = MATMUL_STACK_BYTES // (in_features * out_features * dtype.itemsize)
    weights = [torch.randn(in_features, out_features).to(dtype) for _ in range(num_weights)]  # [in, out] each
    x = torch.randn(MATMUL_ROWS, in_features).to(dtype)  # [rows, in_features]
    flops = 2 * MATMUL_ROWS * in_features * out_features * num_weights
    rates = {}
    with torch.inference_mode():
        rates["torch.matmul"] = flops / _best_seconds(lambda: [torch.matmul(x, w) for w in weights])
        if torch.backends.mkldnn.is_available():
            packed = [torch.ops.mkldnn._reorder_linear_weight(w.t().contiguous()) for w in weights]  # [out, in]
            del weights
            rates["oneDNN packed"] = flops / _best_seconds(
                lambda: [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") for w in packed])
    return rates


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
