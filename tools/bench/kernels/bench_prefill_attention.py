"""CPU prefill attention: the torch path (gather + repeated kv heads + SDPA) vs the C kernel that reads the paged cache in place.

Same process, same inputs, SmolLM-135M's attention shape (9 query heads, 3 kv
heads, head_dim 64, block_size 16). Each case fills one cache per layer
(cycled through, as a model's layers are), then times the two paths paired
and interleaved — torch, kernel, torch, kernel ... — so that whatever else
runs on the machine slows both alike; it prints each path's median time per
layer call, the median of the per-pair ratios (torch / kernel: above 1 the
kernel is faster) and the max difference between the two outputs.

    python -m tools.bench.kernels.bench_prefill_attention                # every case, float32 and bfloat16
    python -m tools.bench.kernels.bench_prefill_attention --pairs 5      # a quicker look

Cases: whole prompts of 8, 128, 512 and 2,048 tokens; a chunk of 256 new
tokens over 1,024 cached ones (chunked prefill, or a prompt after a
prefix-cache hit) and one of 2 over 1,000; a mixed batch of prefills (two short prompts, a 512 prompt, a chunk of
256 over 1,024 and a chunk of 64 over 300).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from gpu_worker.attention import torch_paged
from gpu_worker.attention.cpu_prefill import CpuPrefillKernel, load_cpu_prefill_kernel
from gpu_worker.attention.metadata import AttentionMetadata

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 9, 3, 64
CASES = {  # (cached tokens, new tokens) per sequence
    "prompt 8": [(0, 8)],
    "prompt 128": [(0, 128)],
    "prompt 512": [(0, 512)],
    "prompt 2048": [(0, 2048)],
    "chunk 256 over 1024": [(1024, 256)],
    "chunk 2 over 1000": [(1000, 2)],
    "mixed": [(0, 48), (0, 100), (0, 512), (1024, 256), (300, 64)],
}


@dataclass(slots=True)
class PrefillStep:
    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]: the new tokens' own, which only the torch path reads
    v: torch.Tensor
    caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer, [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata


def prefill_step(steps: list[tuple[int, int]], block_size: int, num_layers: int, dtype: torch.dtype,
                 seed: int) -> PrefillStep:
    """Each sequence's context in shuffled blocks of every layer's cache, its new tokens' k/v written there too."""
    rng = random.Random(seed)
    seq_lens = [cached + new for cached, new in steps]
    counts = [-(-seq_len // block_size) for seq_len in seq_lens]
    pool = list(range(sum(counts)))
    rng.shuffle(pool)
    tables = [pool[sum(counts[:i]):sum(counts[:i + 1])] for i in range(len(counts))]
    width = max(counts)
    shape = (len(pool), block_size, NUM_KV_HEADS, HEAD_DIM)
    generator = torch.Generator().manual_seed(seed)
    caches = [(torch.randn(shape, generator=generator).to(dtype), torch.randn(shape, generator=generator).to(dtype))
              for _ in range(num_layers)]
    slots = torch.tensor([table[position // block_size] * block_size + position % block_size
                          for table, (cached, new) in zip(tables, steps) for position in range(cached, cached + new)])
    k = torch.randn(len(slots), NUM_KV_HEADS, HEAD_DIM, generator=generator).to(dtype)  # [num_tokens, kvh, d]
    v = torch.randn(len(slots), NUM_KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
    for k_cache, v_cache in caches:  # as paged_attention does before it attends, in every layer
        torch_paged.write_kv_cache(k, v, k_cache, v_cache, slots)
    query_lens = [new for _, new in steps]
    meta = AttentionMetadata(
        slot_mapping=slots, query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()],
                                                         dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([table + [0] * (width - len(table)) for table in tables], dtype=torch.int32),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), query_lens_cpu=tuple(query_lens),
        seq_lens_cpu=tuple(seq_lens))
    q = torch.randn(sum(query_lens), NUM_HEADS, HEAD_DIM, generator=generator).to(dtype)
    return PrefillStep(q, k, v, caches, meta)


def time_layers(prefill: torch_paged.PrefillAttention, step: PrefillStep, out: torch.Tensor) -> float:
    """Seconds per layer of one pass of `prefill` through all layers' caches."""
    prefills = list(range(step.meta.num_seqs))
    starts, scale = step.meta.query_starts_cpu, HEAD_DIM ** -0.5
    start = time.perf_counter()
    for k_cache, v_cache in step.caches:
        prefill(step.q, step.k, step.v, k_cache, v_cache, step.meta, prefills, starts, scale, out)
    return (time.perf_counter() - start) / len(step.caches)


def compare(kernel: CpuPrefillKernel, step: PrefillStep, pairs: int) -> str:
    """Paired, interleaved timings of the torch path and the kernel."""
    torch_out, kernel_out = torch.empty_like(step.q), torch.empty_like(step.q)  # [num_tokens, num_heads, head_dim]
    torch_times, kernel_times = [], []
    for pair in range(pairs + 1):  # the first pair warms up
        torch_s = time_layers(torch_paged.prefill_attention, step, torch_out)
        kernel_s = time_layers(kernel.prefill_attention, step, kernel_out)
        if pair:
            torch_times.append(torch_s)
            kernel_times.append(kernel_s)
    ratio = statistics.median(t / k for t, k in zip(torch_times, kernel_times))
    diff = (torch_out.double() - kernel_out.double()).abs().max().item()
    return (f"torch {statistics.median(torch_times) * 1e3:8.3f} ms  kernel {statistics.median(kernel_times) * 1e3:8.3f} "
            f"ms  x{ratio:5.2f}  max diff {diff:.1e}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4, help="caches cycled through")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--pairs", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    kernel = load_cpu_prefill_kernel()
    if kernel is None:
        sys.exit("the C kernel did not build (see the warning above); nothing to compare")
    print(f"heads {NUM_HEADS}/{NUM_KV_HEADS} kv, head_dim {HEAD_DIM}, block_size {args.block_size}, "
          f"threads {torch.get_num_threads()}, {args.layers} layers cycled, median of {args.pairs} pairs")
    for name, steps in CASES.items():
        for dtype in (torch.float32, torch.bfloat16):
            step = prefill_step(steps, args.block_size, args.layers, dtype, args.seed)
            print(f"{name:20s} {str(dtype).removeprefix('torch.'):8s}  {compare(kernel, step, args.pairs)}")


if __name__ == "__main__":
    main()
