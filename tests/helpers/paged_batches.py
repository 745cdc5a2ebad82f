"""A packed step over a paged KV cache, for the attention kernels' tests: what the model hands attention.

    from helpers.paged_batches import make_metadata, make_paged_batch
    batch = make_paged_batch([(0, 47), (999, 1)], block_size=16, num_heads=9, num_kv_heads=3, head_dim=64,
                             dtype=torch.bfloat16, sharing={1: 0}, shared_prefix=32)
    meta = make_metadata(block_tables, num_computed=[0, 5], query_lens=[7, 1], block_size=4)  # for a model's step

Each sequence is (cached tokens, new tokens). Its blocks are shuffled through
the cache, which holds garbage everywhere else (random values, or `fill`:
NaN shows a kernel that reads a slot no sequence owns); the cached positions
hold what earlier steps wrote; q, k and v are strided views of one
projection, as the model's are. A sequence in `sharing` reads the first
`shared_prefix` positions (whole blocks) from the blocks of the sequence it
maps to, as prefix caching makes it. helpers/dense_attention.py has the
reference every kernel's output on such a batch is checked against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker.attention.metadata import AttentionMetadata

NUM_SPARE_BLOCKS = 3  # blocks no sequence owns: a kernel must never read or write them


def make_metadata(block_tables: list[list[int]], num_computed: list[int], query_lens: list[int],
                  block_size: int, device: str = "cpu") -> AttentionMetadata:
    """Metadata for a packed step: sequence i has num_computed[i] cached tokens and query_lens[i] new ones."""
    seq_lens = [computed + new for computed, new in zip(num_computed, query_lens)]
    slots = [block_table[position // block_size] * block_size + position % block_size
             for block_table, computed, seq_len in zip(block_tables, num_computed, seq_lens)
             for position in range(computed, seq_len)]
    width = max(len(block_table) for block_table in block_tables)
    padded = [block_table + [0] * (width - len(block_table)) for block_table in block_tables]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32,
                                     device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=tuple(query_lens),
        seq_lens_cpu=tuple(seq_lens),
    )


@dataclass
class PagedBatch:
    q: torch.Tensor  # [num_tokens, num_heads, head_dim], a strided view, as the model hands it over
    k: torch.Tensor  # [num_tokens, num_kv_heads, head_dim], a strided view too
    v: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    meta: AttentionMetadata
    full_keys: list[torch.Tensor]  # per sequence [seq_len, num_kv_heads, head_dim], on the CPU
    full_values: list[torch.Tensor]

    @property
    def scale(self) -> float:
        return self.q.shape[2] ** -0.5

    @property
    def prefills(self) -> list[int]:
        return list(self.meta.prefill_seqs)

    def as_float32(self) -> PagedBatch:
        """The same values in float32, in copies of the caches."""
        return PagedBatch(self.q.float(), self.k.float(), self.v.float(), self.k_cache.float(), self.v_cache.float(),
                          self.meta, [keys.float() for keys in self.full_keys],
                          [values.float() for values in self.full_values])


def make_paged_batch(steps: list[tuple[int, int]], block_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                     dtype: torch.dtype, sharing: dict[int, int] | None = None, shared_prefix: int = 0,
                     seed: int = 0, fill: float | None = None, device: str = "cpu") -> PagedBatch:
    """Sequences of (cached, new) tokens in shuffled blocks, sequence s of `sharing` reading its first shared_prefix
    positions from the blocks of sequence sharing[s] (an earlier one).

    fill: what the slots no cached token holds contain; None, random values. device: where the tensors the
    kernels read go (q, k, v, the caches and the metadata); the full keys and values stay on the CPU.
    """
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    sharing = sharing or {}
    seq_lens = [cached + new for cached, new in steps]
    num_blocks = sum(-(-seq_len // block_size) for seq_len in seq_lens) + NUM_SPARE_BLOCKS
    pool = torch.randperm(num_blocks, generator=generator).tolist()
    tables, full_keys, full_values = [], [], []
    for seq, seq_len in enumerate(seq_lens):
        shared = shared_prefix if seq in sharing else 0
        own = -(-seq_len // block_size) - shared // block_size
        tables.append(tables[sharing[seq]][:shared // block_size] + pool[:own] if shared else pool[:own])
        pool = pool[own:]
        keys, values = randn(seq_len, num_kv_heads, head_dim), randn(seq_len, num_kv_heads, head_dim)
        if shared:
            keys[:shared], values[:shared] = full_keys[sharing[seq]][:shared], full_values[sharing[seq]][:shared]
        full_keys.append(keys)
        full_values.append(values)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if fill is None:
        k_cache, v_cache = randn(*shape), randn(*shape)
    else:
        k_cache, v_cache = torch.full(shape, fill, dtype=dtype), torch.full(shape, fill, dtype=dtype)
    for table, (cached, _), keys, values in zip(tables, steps, full_keys, full_values):
        for position in range(cached):  # what earlier steps left in the cache
            k_cache[table[position // block_size], position % block_size] = keys[position]
            v_cache[table[position // block_size], position % block_size] = values[position]
    qkv = randn(sum(new for _, new in steps), num_heads + 2 * num_kv_heads, head_dim)  # [num_tokens, all heads, d]
    qkv[:, num_heads:num_heads + num_kv_heads] = torch.cat([keys[cached:] for keys, (cached, _) in zip(full_keys, steps)])
    qkv[:, num_heads + num_kv_heads:] = torch.cat([values[cached:] for values, (cached, _) in zip(full_values, steps)])
    q, k, v = qkv.to(device).split([num_heads, num_kv_heads, num_kv_heads], dim=1)  # views of one projection
    meta = make_metadata(tables, [cached for cached, _ in steps], [new for _, new in steps], block_size, device)
    return PagedBatch(q, k, v, k_cache.to(device), v_cache.to(device), meta, full_keys, full_values)
