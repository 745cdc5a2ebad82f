"""CPU decode attention: the torch path (gather + SDPA) vs the C kernel that reads the paged cache in place.

Same process, same inputs, SmolLM-135M's attention shape (9 query heads, 3 kv
heads, head_dim 64). Each case fills one cache per layer (cycled through, so
that, as in a real model, a layer's cache is not left in the CPU's caches by
the previous call), times one decode step of a batch per layer for each
path, and prints the time per layer call, the ratio and the max difference
between the two outputs.

    python tools/bench_attention.py                 # both workloads, float32 and bfloat16
    python tools/bench_attention.py --repeats 3     # a quicker look

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

import torch

from gpu_worker.attention import torch_paged
from gpu_worker.attention.cpu_decode import load_cpu_decode_kernel
from gpu_worker.attention.metadata import AttentionMetadata

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 9, 3, 64


@dataclass(slots=True)
class DecodeStep:
    q: torch.Tensor  # [num_seqs, num_heads, head_dim]
    caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer, [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata


def decode_step(seq_lens: list[int], shared_prefix: int, block_size: int, num_layers: int, dtype: torch.dtype,
                seed: int) -> DecodeStep:
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
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    generator = torch.Generator().manual_seed(seed)
    caches = [(torch.randn(shape, generator=generator).to(dtype), torch.randn(shape, generator=generator).to(dtype))
              for _ in range(num_layers)]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(len(seq_lens), dtype=torch.int64),  # unused: only the attention is timed
        query_start_loc=torch.arange(len(seq_lens) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([table + [0] * (width - len(table)) for table in tables], dtype=torch.int32),
        max_query_len=1, max_seq_len=max(seq_lens), query_lens_cpu=(1,) * len(seq_lens), seq_lens_cpu=tuple(seq_lens))
    q = torch.randn(len(seq_lens), NUM_HEADS, HEAD_DIM, generator=generator).to(dtype)
    return DecodeStep(q, caches, meta)


def time_per_layer(decode: torch_paged.DecodeAttention, step: DecodeStep, repeats: int) -> tuple[float, torch.Tensor]:
    """Median seconds of one layer's decode attention over `repeats` passes through all layers; the last output."""
    decodes = list(range(step.meta.num_seqs))
    out = torch.empty_like(step.q)  # [num_seqs, num_heads, head_dim]
    scale = HEAD_DIM ** -0.5
    times = []
    for _ in range(repeats + 1):  # the first pass warms up
        start = time.perf_counter()
        for k_cache, v_cache in step.caches:
            decode(step.q, k_cache, v_cache, step.meta, decodes, decodes, scale, out)
        times.append((time.perf_counter() - start) / len(step.caches))
    return statistics.median(times[1:]), out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--layers", type=int, default=8, help="caches cycled through (8 of the mixed case: ~200 MB)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    kernel = load_cpu_decode_kernel()
    if kernel is None:
        sys.exit("the C kernel did not build (see the warning above); nothing to compare")
    rng = random.Random(args.seed)
    workloads = {
        "mixed 300-700": ([rng.randint(300, 700) for _ in range(args.batch)], 0),
        "shared prefix 1024": ([1024 + rng.randint(32, 128) + rng.randint(1, 64) for _ in range(args.batch)], 1024),
    }
    print(f"batch {args.batch}, heads {NUM_HEADS}/{NUM_KV_HEADS} kv, head_dim {HEAD_DIM}, block_size {args.block_size}, "
          f"threads {torch.get_num_threads()}, {args.layers} layers cycled, median of {args.repeats}")
    for name, (seq_lens, shared_prefix) in workloads.items():
        for dtype in (torch.float32, torch.bfloat16):
            step = decode_step(seq_lens, shared_prefix, args.block_size, args.layers, dtype, args.seed)
            torch_s, torch_out = time_per_layer(torch_paged.decode_attention, step, args.repeats)
            kernel_s, kernel_out = time_per_layer(kernel.decode_attention, step, args.repeats)
            diff = (torch_out.double() - kernel_out.double()).abs().max().item()
            print(f"{name:19s} {str(dtype).removeprefix('torch.'):8s}  torch {torch_s * 1e3:7.2f} ms  "
                  f"kernel {kernel_s * 1e3:7.2f} ms  x{torch_s / kernel_s:5.2f}  max diff {diff:.1e}")


if __name__ == "__main__":
    main()
