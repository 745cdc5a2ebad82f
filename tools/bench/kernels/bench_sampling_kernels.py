"""The sampling kernels on the CPU against their torch twins, side by side: the draw, the argmax, top-p's cutoff
and the token mask.

Same process, same inputs, at the rows a decode step samples (1, 16, 64)
over a vocabulary of --vocab-size tokens (49,152 by default, SmolLM's):
temperature 0.8 and top_p 0.95 from logits to token (cpu_draw.c's one call
against filter_logits and torch's race), the greedy argmax (cpu_draw.c
against torch's argmax), a float32 LM head's greedy choice (the tiled kernel's
product then that argmax, against the product taking the argmax as it
writes the logits; the floor there is reading the weight once), the top-p
cutoff of softmaxed logits (cpu_top_p.c
against a partial top-k and sort), and a structured-output mask that allows
a random half of the vocabulary (cpu_token_mask.c against masked_fill).
The two take turns, torch then the kernel, and the printed figure is the
median over turns of torch's time / the kernel's (above 1: the kernel is
faster). Each line also gives the kernel's time against the floor of
reading its rows once at the memory bandwidth measured in the same run.
Under $PAGEDSERVE_CPU_ISA it runs that tier's build, and torch's code for
that tier:

    python -m tools.bench.kernels.bench_sampling_kernels
    python -m tools.bench.kernels.bench_sampling_kernels --vocab-size 4096
    PAGEDSERVE_CPU_ISA=x86-64 python -m tools.bench.kernels.bench_sampling_kernels
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

from gpu_worker.models.cpu_linear import TiledLinear, load_tiled_linear_kernel
from gpu_worker.sampling import draw, token_mask, top_p
from gpu_worker.sampling.filters import filter_logits
from gpu_worker.sampling.noise import draw_key
from shared.cpu_tier import current_tier
from shared.sampling_params import SamplingParams

from tools.benchlib.machine_limits import memory_bandwidth

TEMPERATURE = 0.8
TOP_P = 0.95
LM_HEAD_HIDDEN = 576  # SmolLM-135M's


def paired_ratio(reference: Callable[[], object], candidate: Callable[[], object], turns: int,
                 calls: int) -> tuple[float, float, float]:
    """(median of reference time / candidate time over turns, the reference's and the candidate's median seconds
    per call)."""
    ratios, reference_times, candidate_times = [], [], []
    for _ in range(turns):
        times = []
        for function in (reference, candidate):
            start = time.perf_counter()
            for _ in range(calls):
                function()
            times.append((time.perf_counter() - start) / calls)
        ratios.append(times[0] / times[1])
        reference_times.append(times[0])
        candidate_times.append(times[1])
    return statistics.median(ratios), statistics.median(reference_times), statistics.median(candidate_times)


def line(name: str, rows: int, measured: tuple[float, float, float], floor_seconds: float) -> str:
    ratio, torch_seconds, kernel_seconds = measured
    return (f"{name:13s} rows {rows:3d}  torch {torch_seconds * 1e6:9.1f} us  kernel {kernel_seconds * 1e6:9.1f} us"
            f"  x {ratio:5.2f}  (floor {floor_seconds * 1e6:7.1f} us, {floor_seconds / kernel_seconds:4.0%})")


def bench_draw(rows: int, vocab_size: int, turns: int, bandwidth: float) -> str:
    kernel = draw.load_filtered_kernel()
    assert kernel is not None, "the draw kernel is not installed"
    logits = torch.randn(rows, vocab_size, generator=torch.Generator().manual_seed(rows)) * 3
    params = [SamplingParams(temperature=TEMPERATURE, top_p=TOP_P)] * rows
    keys = [draw_key(seed, 0) for seed in range(rows)]
    measured = paired_ratio(lambda: draw.draw_with_torch(filter_logits(logits, params), keys),
                            lambda: draw.draw_filtered_on_cpu(kernel, logits, params, keys), turns, 10)
    return line("draw (t, p)", rows, measured, logits.nbytes / bandwidth)


def bench_argmax(rows: int, vocab_size: int, turns: int, bandwidth: float) -> str:
    assert draw.load_argmax_kernel() is not None, "the draw kernel is not installed"
    logits = torch.randn(rows, vocab_size, generator=torch.Generator().manual_seed(rows))
    assert torch.equal(draw.greedy_tokens(logits), logits.argmax(dim=-1))
    measured = paired_ratio(lambda: logits.argmax(dim=-1), lambda: draw.greedy_tokens(logits), turns, 20)
    return line("argmax", rows, measured, logits.nbytes / bandwidth)


def bench_lm_head_argmax(rows: int, vocab_size: int, turns: int, bandwidth: float) -> str:
    """The greedy choice of a float32 LM head (hidden LM_HEAD_HIDDEN) on the tiled kernel: its product then the argmax
    kernel's pass over the logits, against the product taking the argmax as it writes them (forward_with_argmax)."""
    kernel = load_tiled_linear_kernel(current_tier())
    assert kernel is not None, "the linear kernel is not installed (below AVX2 the LM head is oneDNN's)"
    generator = torch.Generator().manual_seed(rows)
    lm_head = TiledLinear(kernel, torch.randn(vocab_size, LM_HEAD_HIDDEN, generator=generator) * 0.05, None)
    hidden = torch.randn(rows, LM_HEAD_HIDDEN, generator=generator)
    logits, argmax = lm_head.forward_with_argmax(hidden)
    assert torch.equal(argmax, logits.argmax(dim=-1))
    measured = paired_ratio(lambda: draw.greedy_tokens(lm_head(hidden)), lambda: lm_head.forward_with_argmax(hidden),
                            turns, 10)
    ratio, apart, taken = measured
    floor = lm_head.packed_weight.nbytes / bandwidth
    return (f"LM head argmax rows {rows:3d}  then the argmax {apart * 1e6:9.1f} us  taken as written {taken * 1e6:9.1f}"
            f" us  x {ratio:5.2f}  (floor {floor * 1e6:7.1f} us, {floor / taken:4.0%})")


def bench_top_p(rows: int, vocab_size: int, turns: int, bandwidth: float) -> str:
    kernel = top_p.load_kernel()
    assert kernel is not None, "the top-p kernel is not installed"
    logits = torch.randn(rows, vocab_size, generator=torch.Generator().manual_seed(rows)) * 3
    probs, cutoff = logits.softmax(-1), torch.full((rows, 1), TOP_P)
    assert torch.equal(top_p.cutoff_on_cpu(kernel, probs, cutoff), top_p.cutoff_with_torch(probs, cutoff))
    measured = paired_ratio(lambda: top_p.cutoff_with_torch(probs, cutoff),
                            lambda: top_p.cutoff_on_cpu(kernel, probs, cutoff), turns, 20)
    return line("top-p cutoff", rows, measured, probs.nbytes / bandwidth)


def bench_token_mask(rows: int, vocab_size: int, turns: int, bandwidth: float) -> str:
    kernel = token_mask.load_kernel()
    assert kernel is not None, "the token mask kernel is not installed"
    generator = np.random.default_rng(rows)
    bitmask = generator.integers(-2**31, 2**31, size=(rows, (vocab_size + 31) // 32), dtype=np.int64).astype(np.int32)
    logits, row_ids = torch.randn(rows, vocab_size), list(range(rows))
    measured = paired_ratio(lambda: token_mask.apply_with_torch(logits.clone(), row_ids, bitmask),
                            lambda: token_mask.apply_on_cpu(kernel, logits.clone(), row_ids, bitmask), turns, 20)
    return line("token mask", rows, measured, 2 * logits.nbytes / bandwidth)  # the clone's read and write


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--vocab-size", type=int, default=49152)
    parser.add_argument("--turns", type=int, default=9)
    args = parser.parse_args(argv)
    bandwidth = memory_bandwidth()
    print(f"CPU tier {current_tier().name}, torch threads {torch.get_num_threads()}, vocabulary {args.vocab_size}, "
          f"median of {args.turns} paired turns; x = torch time / kernel time; memory bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s, the floor is reading the rows once")
    for bench in (bench_draw, bench_argmax, bench_lm_head_argmax, bench_top_p, bench_token_mask):
        for rows in args.rows:
            print(bench(rows, args.vocab_size, args.turns, bandwidth))


if __name__ == "__main__":
    main()
