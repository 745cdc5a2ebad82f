"""The sampling kernels on the CPU against their torch twins, side by side: top-p's cutoff and the token mask.

Same process, same inputs, at the rows a decode step samples (1, 16, 64)
over a 49,152-token vocabulary (SmolLM's): the top-p cutoff of softmaxed
logits at top_p 0.95 (cpu_top_p.c against a partial top-k and sort), and a
structured-output mask that allows a random half of the vocabulary
(cpu_token_mask.c against masked_fill). The two take turns, torch then the
kernel, and the printed figure is the median over turns of torch's time /
the kernel's (above 1: the kernel is faster). Under $PAGEDSERVE_CPU_ISA it
runs that tier's build, and torch's code for that tier:

    python -m tools.bench.kernels.bench_sampling_kernels
    PAGEDSERVE_CPU_ISA=avx2 python -m tools.bench.kernels.bench_sampling_kernels
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

# isort: off
import gpu_worker  # noqa: F401 - before torch: under $PAGEDSERVE_CPU_ISA it holds torch to that tier
# isort: on
import numpy as np
import torch

from gpu_worker.sampling import token_mask, top_p
from shared.cpu_tier import current_tier

VOCAB_SIZE = 49152
TOP_P = 0.95


def paired_ratio(reference: Callable[[], object], candidate: Callable[[], object], turns: int,
                 calls: int) -> tuple[float, float]:
    """(median of reference time / candidate time over turns, the reference's median seconds per call)."""
    ratios, reference_times = [], []
    for _ in range(turns):
        times = []
        for function in (reference, candidate):
            start = time.perf_counter()
            for _ in range(calls):
                function()
            times.append((time.perf_counter() - start) / calls)
        ratios.append(times[0] / times[1])
        reference_times.append(times[0])
    return statistics.median(ratios), statistics.median(reference_times)


def bench_top_p(rows: int, turns: int) -> str:
    kernel = top_p.load_kernel()
    assert kernel is not None, "the top-p kernel is not installed"
    logits = torch.randn(rows, VOCAB_SIZE, generator=torch.Generator().manual_seed(rows)) * 3
    probs, cutoff = logits.softmax(-1), torch.full((rows, 1), TOP_P)
    assert torch.equal(top_p.cutoff_on_cpu(kernel, probs, cutoff), top_p.cutoff_with_torch(probs, cutoff))
    ratio, seconds = paired_ratio(lambda: top_p.cutoff_with_torch(probs, cutoff),
                                  lambda: top_p.cutoff_on_cpu(kernel, probs, cutoff), turns, 20)
    return f"top-p cutoff  rows {rows:3d}  torch {seconds * 1e6:9.1f} us  kernel x {ratio:5.2f}"


def bench_token_mask(rows: int, turns: int) -> str:
    kernel = token_mask.load_kernel()
    assert kernel is not None, "the token mask kernel is not installed"
    generator = np.random.default_rng(rows)
    bitmask = generator.integers(-2**31, 2**31, size=(rows, (VOCAB_SIZE + 31) // 32), dtype=np.int64).astype(np.int32)
    logits, row_ids = torch.randn(rows, VOCAB_SIZE), list(range(rows))
    ratio, seconds = paired_ratio(lambda: token_mask.apply_with_torch(logits.clone(), row_ids, bitmask),
                                  lambda: token_mask.apply_on_cpu(kernel, logits.clone(), row_ids, bitmask), turns, 20)
    return f"token mask    rows {rows:3d}  torch {seconds * 1e6:9.1f} us  kernel x {ratio:5.2f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--turns", type=int, default=9)
    args = parser.parse_args(argv)
    print(f"CPU tier {current_tier().name}, torch threads {torch.get_num_threads()}, vocabulary {VOCAB_SIZE}, "
          f"median of {args.turns} paired turns; x = torch time / kernel time")
    for rows in args.rows:
        print(bench_top_p(rows, args.turns))
    for rows in args.rows:
        print(bench_token_mask(rows, args.turns))


if __name__ == "__main__":
    main()
