"""CPU decode attention: the torch path (gather + SDPA) vs the C kernel that reads the paged cache in place.

Same process, same inputs, SmolLM-135M's attention shape (9 query heads, 3 kv
heads, head_dim 64; --shape tiny-4l: the 4-layer test model's 4 and 2).
Each case fills one cache per layer (cycled through, so that, as in a real
model, a layer's cache is not left in the CPU's caches by the previous call)
and times one decode step of a batch per layer for each path, the paths
taking turns pass by pass, in reverse order every other pass (a shared
machine's load moves them alike). Before each path's pass 256 MiB are read through, so that every
path starts from the same cold caches: without it the path after the torch
path ran 14% slower than the same kernel after another path, and a kernel
compared with itself read 0.86x (0.97-1.02 with it). It prints the median
time per layer call, the median of the per-pass ratios and the max
difference between the outputs. For bfloat16 it also runs the kernel's
widening path (each row widened to float32, the kernel before AVX-512 BF16
dot products) and prints the kernel's ratio to it; on a CPU without AVX-512
BF16 both are the widening path.

    python -m tools.bench.kernels.bench_attention                 # both workloads, float32 and bfloat16
    python -m tools.bench.kernels.bench_attention --repeats 3     # a quicker look
    git worktree add /tmp/pagedserve-base <commit>
    python -m tools.bench.kernels.bench_attention --batch 16 --baseline /tmp/pagedserve-base

With --baseline the kernel of another checkout (compiled from its own
source for this CPU's tier) runs beside this one's, in the same process and
on the same inputs, and its ratio to this kernel is printed too.

Next to each kernel's time: the KV it read per second (each sequence's
context, K and V, every position once), as a share of the machine's read
bandwidth measured at the start of the run (tools/benchlib/machine_limits.py;
a shared prefix is counted for every sequence that reads it, so from the
CPU's caches the share passes 100%), and its time per tile of 16 keys (of
all kv heads) on each thread, beside that tile's arithmetic at the
machine's float32 matmul rate, also measured at the start.

With --warm the caches are not flushed and each path runs an untimed pass
of its own first: with --layers 1 and a batch whose KV fits the CPU's
caches, that is the kernel's rate when memory is no limit, its arithmetic
and its instructions alone (the ratios between paths are looser warm: one
kernel against its own copy reads 0.90-1.06, against 0.97-1.02 cold):

    python -m tools.bench.kernels.bench_attention --shape tiny-4l --batch 16 --layers 1 --warm --threads 1

Workloads: "mixed" — 64 sequences with contexts 300-700 in disjoint blocks;
"shared prefix" — 64 sequences of about 1,100 tokens whose first 1,024
tokens are the same cached blocks (prefix caching).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from gpu_worker.attention import torch_paged
from gpu_worker.attention.cpu_decode import CpuDecodeKernel, load_cpu_decode_kernel
from gpu_worker.attention.metadata import AttentionMetadata
from gpu_worker.native.compiled_library import default_cache_dir, default_compiler, load_library

from tools.benchlib.machine_limits import matmul_rate, memory_bandwidth

SHAPES = {"smollm-135m": (9, 3), "tiny-4l": (4, 2)}  # query heads, kv heads
HEAD_DIM = 64
TILE_KEYS = 16  # keys a tile of the kernel's walk takes (AVX-512; 8 below it): the per-tile figure's unit
CACHE_FLUSH_BYTES = 256 << 20  # read before each path's pass: several times a server CPU's last-level cache


@dataclass(slots=True)
class DecodeStep:
    q: torch.Tensor  # [num_seqs, num_heads, head_dim]
    caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer, [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata


def decode_step(seq_lens: list[int], shared_prefix: int, block_size: int, num_layers: int, dtype: torch.dtype,
                seed: int, heads: tuple[int, int]) -> DecodeStep:
    """One decode token per sequence; the first shared_prefix positions (whole blocks) use the same blocks."""
    rng = random.Random(seed)
    num_shared = shared_prefix // block_size
    own = [-(-seq_len // block_size) - num_shared for seq_len in seq_lens]
    pool = list(range(num_shared, num_shared + sum(own)))
    rng.shuffle(pool)
    tables, taken = [], 0
    for count in own:
        tables.append(list(range(num_shared)) + pool[taken:taken + count])
        taken += count
    width = max(len(table) for table in tables)
    num_blocks = num_shared + sum(own)
    num_heads, num_kv_heads = heads
    shape = (num_blocks, block_size, num_kv_heads, HEAD_DIM)
    generator = torch.Generator().manual_seed(seed)
    caches = [(torch.randn(shape, generator=generator).to(dtype), torch.randn(shape, generator=generator).to(dtype))
              for _ in range(num_layers)]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(len(seq_lens), dtype=torch.int64),  # unused: only the attention is timed
        query_start_loc=torch.arange(len(seq_lens) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([table + [0] * (width - len(table)) for table in tables], dtype=torch.int32),
        max_query_len=1, max_seq_len=max(seq_lens), query_lens_cpu=(1,) * len(seq_lens), seq_lens_cpu=tuple(seq_lens))
    q = torch.randn(len(seq_lens), num_heads, HEAD_DIM, generator=generator).to(dtype)
    return DecodeStep(q, caches, meta)


@dataclass(slots=True)
class Timing:
    seconds: list[float]  # per pass, of one layer's call
    out: torch.Tensor  # the last output, [num_seqs, num_heads, head_dim]


def time_paths(paths: dict[str, torch_paged.DecodeAttention], step: DecodeStep, repeats: int,
               warm: bool = False) -> dict[str, Timing]:
    """Seconds of one layer's decode attention per path, over `repeats` passes through all layers, paths in turn;
    each pass from cold caches, or with `warm` after an untimed pass of its own, and the paths' order reversed every
    other pass: warm, a kernel timed straight after another path on the same cache ran 1.2-1.7x faster than that
    path, on what it left in the CPU's caches; with both, one kernel against its own copy reads 0.90-1.06."""
    decodes = list(range(step.meta.num_seqs))
    timings = {name: Timing([], torch.empty_like(step.q)) for name in paths}
    scale = HEAD_DIM ** -0.5
    flush = torch.ones(0 if warm else CACHE_FLUSH_BYTES // 4)
    for turn in range(repeats + 1):  # the first pass warms up
        for name, decode in list(paths.items())[::1 if turn % 2 else -1]:
            out = timings[name].out
            flush.sum()  # the same cold caches for every path (nothing read with warm)
            for k_cache, v_cache in step.caches if warm else ():  # warm: from what its own untimed call left
                decode(step.q, k_cache, v_cache, step.meta, decodes, decodes, scale, out)
            start = time.perf_counter()
            for k_cache, v_cache in step.caches:
                decode(step.q, k_cache, v_cache, step.meta, decodes, decodes, scale, out)
            timings[name].seconds.append((time.perf_counter() - start) / len(step.caches))
    for timing in timings.values():
        del timing.seconds[0]
    return timings


def median_ratio(slower: Timing, faster: Timing) -> float:
    """The median over passes of slower / faster: each pair ran back to back, under the same load."""
    return statistics.median(a / b for a, b in zip(slower.seconds, faster.seconds))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--layers", type=int, default=8, help="caches cycled through (8 of the mixed case: ~200 MB)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--baseline", type=Path, help="another checkout whose decode kernel runs beside this one's")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm-135m", help="the attention's heads")
    parser.add_argument("--warm", action="store_true",
                        help="no cache flush: each path's pass after an untimed one of its own")
    parser.add_argument("--threads", type=int, help="torch's thread count, the kernel's (default: torch's own)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    kernel = load_cpu_decode_kernel()
    if kernel is None:
        sys.exit("the C kernel did not build (see the warning above); nothing to compare")
    baseline = None
    if args.baseline is not None:
        source = args.baseline / "gpu_worker" / "attention" / "cpu_decode.c"
        baseline = CpuDecodeKernel(load_library(source, default_cache_dir(), default_compiler()))
    rng = random.Random(args.seed)
    workloads = {
        "mixed 300-700": ([rng.randint(300, 700) for _ in range(args.batch)], 0),
        "shared prefix 1024": ([1024 + rng.randint(32, 128) + rng.randint(1, 64) for _ in range(args.batch)], 1024),
    }
    heads = SHAPES[args.shape]
    bandwidth, flops = memory_bandwidth(), matmul_rate(torch.float32)
    print(f"memory bandwidth {bandwidth / 1e9:.1f} GB/s (read), float32 matmul {flops / 1e9:.1f} GFLOP/s, measured "
          f"now; batch {args.batch}, heads "
          f"{heads[0]}/{heads[1]} kv, head_dim {HEAD_DIM}, block_size {args.block_size}, "
          f"threads {torch.get_num_threads()}, {args.layers} layers cycled, median of {args.repeats}, "
          f"{'warm' if args.warm else 'cold'} caches; bfloat16 kernel: {kernel.bf16_path.description}")
    for name, (seq_lens, shared_prefix) in workloads.items():
        for dtype in (torch.float32, torch.bfloat16):
            step = decode_step(seq_lens, shared_prefix, args.block_size, args.layers, dtype, args.seed, heads)
            paths = {"torch": torch_paged.decode_attention, "kernel": kernel.decode_attention}
            if dtype == torch.bfloat16:
                paths["widening"] = kernel.with_widening().decode_attention
            if baseline is not None:
                paths["baseline"] = baseline.decode_attention
            timings = time_paths(paths, step, args.repeats, args.warm)
            print(f"{name:19s} {str(dtype).removeprefix('torch.'):8s}  " + report(timings))
            print(f"{'':29s}kernel reads {rate(step, timings['kernel'], bandwidth, flops)}")


def rate(step: DecodeStep, timing: Timing, bandwidth: float, flops: float) -> str:
    """The KV a call read per second (and its share of `bandwidth`, bytes/s), and its time per tile of TILE_KEYS keys
    (of every kv head) on each thread, beside that tile's arithmetic at `flops` (FLOP/s on all threads): per query
    head and key, a head_dim dot product and a head_dim multiply-add of the value, 4 * head_dim FLOPs."""
    k_cache = step.caches[0][0]
    row_bytes = k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size()  # a position's K (or V), all kv heads
    seconds = statistics.median(timing.seconds)
    tiles = sum(-(-seq_len // TILE_KEYS) for seq_len in step.meta.seq_lens_cpu)
    read = 2 * row_bytes * sum(step.meta.seq_lens_cpu) / seconds
    threads = torch.get_num_threads()
    tile_flops = 4 * step.q.shape[1] * step.q.shape[2] * TILE_KEYS
    return (f"{read / 1e9:6.1f} GB/s ({read / bandwidth:4.0%} of the machine's), "
            f"{seconds * threads / tiles * 1e9:6.0f} ns per tile of {TILE_KEYS} keys on a thread "
            f"(its arithmetic at the float32 matmul rate: {tile_flops * threads / flops * 1e9:.0f} ns)")


def report(timings: dict[str, Timing]) -> str:
    """The kernel against the torch path and, where they ran, against the widening path and the baseline's kernel."""
    torch_path, kernel = timings["torch"], timings["kernel"]
    diff = (torch_path.out.double() - kernel.out.double()).abs().max().item()
    line = (f"torch {statistics.median(torch_path.seconds) * 1e3:7.2f} ms  "
            f"kernel {statistics.median(kernel.seconds) * 1e3:7.2f} ms  x{median_ratio(torch_path, kernel):5.2f}  "
            f"max diff {diff:.1e}")
    if (widening := timings.get("widening")) is not None:
        diff = (widening.out.double() - kernel.out.double()).abs().max().item()
        line += (f"  | widening {statistics.median(widening.seconds) * 1e3:7.2f} ms  kernel vs widening "
                 f"x{median_ratio(widening, kernel):5.2f}  max diff {diff:.1e}")
    if (baseline := timings.get("baseline")) is not None:
        diff = (baseline.out.double() - kernel.out.double()).abs().max().item()
        line += (f"  | baseline {statistics.median(baseline.seconds) * 1e3:7.2f} ms  kernel vs baseline "
                 f"x{median_ratio(baseline, kernel):5.2f}  max diff {diff:.1e}")
    return line


if __name__ == "__main__":
    main()
