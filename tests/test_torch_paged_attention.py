"""torch paged attention against a dense causal attention computed in float64.

Tolerance: 1e-5 absolute in float32 (the difference is rounding in the
softmax and matmul order), 3e-2 in bfloat16.
"""

from __future__ import annotations

import math

import pytest
import torch

from gpu_worker.attention import torch_paged
from gpu_worker.attention.metadata import AttentionMetadata
from gpu_worker.attention.torch_paged import paged_attention

FLOAT32_TOLERANCE = 1e-5
BFLOAT16_TOLERANCE = 3e-2


def make_metadata(block_tables: list[list[int]], num_computed: list[int], query_lens: list[int],
                  block_size: int) -> AttentionMetadata:
    """Metadata for a packed step: sequence i has num_computed[i] cached tokens and query_lens[i] new ones."""
    seq_lens = [computed + new for computed, new in zip(num_computed, query_lens)]
    slots = [block_table[position // block_size] * block_size + position % block_size
             for block_table, computed, seq_len in zip(block_tables, num_computed, seq_lens)
             for position in range(computed, seq_len)]
    width = max(len(block_table) for block_table in block_tables)
    padded = [block_table + [0] * (width - len(block_table)) for block_table in block_tables]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(padded, dtype=torch.int32),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=tuple(query_lens),
        seq_lens_cpu=tuple(seq_lens),
    )


def shuffled_block_tables(seq_lens: list[int], block_size: int, num_blocks: int, seed: int) -> list[list[int]]:
    """Disjoint, non-contiguous block tables drawn from a shuffled pool."""
    pool = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = []
    for seq_len in seq_lens:
        count = -(-seq_len // block_size)
        tables.append(pool[:count])
        pool = pool[count:]
    return tables


def dense_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """q [query_len, heads, d] = the last query_len of keys/values [seq_len, kv_heads, d]; float64."""
    query_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    keys = keys.double().repeat_interleave(group, dim=1)  # [seq_len, heads, d]
    values = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * scale  # [heads, query_len, seq_len]
    query_positions = torch.arange(seq_len - query_len, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > query_positions, -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)  # [query_len, heads, d]


# (cached tokens before the step, new tokens) per sequence: prefill chunks with and
# without earlier context, decodes of several lengths, a one-token prompt.
MIXED_BATCH = [(5, 9), (19, 1), (0, 7), (0, 1), (32, 1), (16, 16), (3, 1), (40, 2)]


def run_mixed_batch(block_size: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype, seed: int = 0):
    head_dim, num_blocks = 8, 128
    torch.manual_seed(seed)
    num_computed = [computed for computed, _ in MIXED_BATCH]
    query_lens = [new for _, new in MIXED_BATCH]
    seq_lens = [computed + new for computed, new in MIXED_BATCH]
    block_tables = shuffled_block_tables(seq_lens, block_size, num_blocks, seed)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)  # garbage outside contexts
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    full_keys = [torch.randn(seq_len, num_kv_heads, head_dim).to(dtype) for seq_len in seq_lens]
    full_values = [torch.randn(seq_len, num_kv_heads, head_dim).to(dtype) for seq_len in seq_lens]
    for table, computed, keys, values in zip(block_tables, num_computed, full_keys, full_values):
        for position in range(computed):  # what earlier steps left in the cache
            k_cache[table[position // block_size], position % block_size] = keys[position]
            v_cache[table[position // block_size], position % block_size] = values[position]
    q = torch.randn(sum(query_lens), num_heads, head_dim).to(dtype)
    k = torch.cat([keys[computed:] for keys, computed in zip(full_keys, num_computed)])
    v = torch.cat([values[computed:] for values, computed in zip(full_values, num_computed)])
    meta = make_metadata(block_tables, num_computed, query_lens, block_size)
    scale = head_dim ** -0.5
    out = paged_attention(q, k, v, k_cache, v_cache, meta, scale)
    starts = meta.query_start_loc.tolist()
    expected = torch.cat([dense_attention(q[start:end], keys, values, scale)
                          for start, end, keys, values in zip(starts, starts[1:], full_keys, full_values)])
    return out, expected, (k, v, k_cache, v_cache, meta)


@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(8, 2), (4, 4), (6, 1)])
def test_mixed_batch_matches_dense_attention(block_size, num_heads, num_kv_heads):
    out, expected, _ = run_mixed_batch(block_size, num_heads, num_kv_heads, torch.float32)
    assert out.shape == expected.shape and out.dtype == torch.float32
    diff = (out.double() - expected).abs().max().item()
    assert diff < FLOAT32_TOLERANCE, f"max abs diff {diff}"


def test_new_kv_written_at_slot_mapping():
    _, _, (k, v, k_cache, v_cache, meta) = run_mixed_batch(4, 8, 2, torch.float32)
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    assert torch.equal(flat_k[meta.slot_mapping], k)
    assert torch.equal(flat_v[meta.slot_mapping], v)


def test_decode_groups_split_by_byte_cap(monkeypatch):
    # A cap of a few positions forces one decode group per sequence and more.
    monkeypatch.setattr(torch_paged, "DECODE_GATHER_BYTES", 40 * 2 * 8 * 4)
    out, expected, _ = run_mixed_batch(4, 8, 2, torch.float32)
    diff = (out.double() - expected).abs().max().item()
    assert diff < FLOAT32_TOLERANCE, f"max abs diff {diff}"


def test_decode_groups_are_consecutive_and_capped():
    seq_lens = [10, 20, 30, 40, 50]  # sorted ascending, as decode_attention hands them over
    groups = torch_paged._decode_groups(seq_lens, bytes_per_position=1 << 16)
    assert [seq for group in groups for seq in group] == list(range(len(seq_lens)))
    assert len(groups) > 1
    for group in groups:
        assert len(group) * seq_lens[group.stop - 1] * (1 << 16) <= torch_paged.DECODE_GATHER_BYTES


def test_bfloat16_matches_dense_attention():
    out, expected, _ = run_mixed_batch(16, 8, 2, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    diff = (out.double() - expected).abs().max().item()
    assert diff < BFLOAT16_TOLERANCE, f"max abs diff {diff}"
