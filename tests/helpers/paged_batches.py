"""A packed step over a paged KV cache, for the attention kernels' tests: what the model hands attention.

    from helpers.paged_batches import make_paged_batch
    batch = make_paged_batch([(0, 47), (999, 1)], block_size=16, num_heads=9, num_kv_heads=3, head_dim=64,
                             dtype=torch.bfloat16, sharing={1: 0}, shared_prefix=32)

Each sequence is (cached tokens, new tokens). Its blocks are shuffled through
the cache, which holds garbage everywhere else; the cached positions hold
what earlier steps wrote; q is a strided view of one projection, as the
model's is. A sequence in `sharing` reads the first `shared_prefix` positions
(whole blocks) from the blocks of the sequence it maps to, as prefix caching
makes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker.attention.metadata import AttentionMetadata

from test_torch_paged_attention import make_metadata


@dataclass
class PagedBatch:
    q: torch.Tensor  # [num_tokens, num_heads, head_dim], a strided view, as the model hands it over
    k: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    meta: AttentionMetadata
    full_keys: list[torch.Tensor]  # per sequence [seq_len, num_kv_heads, head_dim]
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
                     seed: int = 0) -> PagedBatch:
    """Sequences of (cached, new) tokens in shuffled blocks, sequence s of `sharing` reading its first shared_prefix
    positions from the blocks of sequence sharing[s] (an earlier one)."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    sharing = sharing or {}
    seq_lens = [cached + new for cached, new in steps]
    num_blocks = sum(-(-seq_len // block_size) for seq_len in seq_lens) + 3
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
    k_cache, v_cache = randn(*shape), randn(*shape)
    for table, (cached, _), keys, values in zip(tables, steps, full_keys, full_values):
        for position in range(cached):  # what earlier steps left in the cache
            k_cache[table[position // block_size], position % block_size] = keys[position]
            v_cache[table[position // block_size], position % block_size] = values[position]
    qkv = randn(sum(new for _, new in steps), num_heads + 2 * num_kv_heads, head_dim)  # q is a view of one projection
    k = torch.cat([keys[cached:] for keys, (cached, _) in zip(full_keys, steps)])
    v = torch.cat([values[cached:] for values, (cached, _) in zip(full_values, steps)])
    meta = make_metadata(tables, [cached for cached, _ in steps], [new for _, new in steps], block_size)
    return PagedBatch(qkv[:, :num_heads], k, v, k_cache, v_cache, meta, full_keys, full_values)
