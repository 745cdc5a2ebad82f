"""torch paged attention against a dense causal attention computed in float64.

Tolerance: 1e-5 absolute in float32 (the difference is rounding in the
softmax and matmul order), 3e-2 in bfloat16 (helpers/dense_attention.py).
"""

from __future__ import annotations

import pytest
import torch

from gpu_worker.attention import torch_paged
from gpu_worker.attention.torch_paged import paged_attention

from helpers.dense_attention import BFLOAT16_TOLERANCE, FLOAT32_TOLERANCE, dense_reference
from helpers.paged_batches import PagedBatch, make_paged_batch

# (cached tokens before the step, new tokens) per sequence: prefill chunks with and
# without earlier context, decodes of several lengths, a one-token prompt.
MIXED_BATCH = [(5, 9), (19, 1), (0, 7), (0, 1), (32, 1), (16, 16), (3, 1), (40, 2)]


def run_mixed_batch(block_size: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype,
                    seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, PagedBatch]:
    """The torch path's output on MIXED_BATCH (head_dim 8), the dense reference's, and the batch."""
    batch = make_paged_batch(MIXED_BATCH, block_size, num_heads, num_kv_heads, 8, dtype, seed=seed)
    out = paged_attention(batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    return out, dense_reference(batch), batch


@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(8, 2), (4, 4), (6, 1)])
def test_mixed_batch_matches_dense_attention(block_size, num_heads, num_kv_heads):
    out, expected, _ = run_mixed_batch(block_size, num_heads, num_kv_heads, torch.float32)
    assert out.shape == expected.shape and out.dtype == torch.float32
    diff = (out.double() - expected).abs().max().item()
    assert diff < FLOAT32_TOLERANCE, f"max abs diff {diff}"


def test_new_kv_written_at_slot_mapping():
    _, _, batch = run_mixed_batch(4, 8, 2, torch.float32)
    flat_k = batch.k_cache.view(-1, *batch.k_cache.shape[2:])
    flat_v = batch.v_cache.view(-1, *batch.v_cache.shape[2:])
    assert torch.equal(flat_k[batch.meta.slot_mapping], batch.k)
    assert torch.equal(flat_v[batch.meta.slot_mapping], batch.v)


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


@pytest.mark.parametrize("query_lens", [(1,), (1, 1, 1, 1), (3, 1, 1), (1, 1, 5), (7,)])
def test_the_metadata_derives_each_sequences_rows_and_kind_from_its_query_lengths(query_lens):
    """The derived host fields, whether the step decodes only (its own fast path) or holds prefill chunks."""
    from gpu_worker.attention.metadata import AttentionMetadata

    empty = torch.zeros(0, dtype=torch.int32)
    meta = AttentionMetadata(slot_mapping=empty, query_start_loc=empty, seq_lens=empty, block_tables=empty,
                             max_query_len=max(query_lens), max_seq_len=9, query_lens_cpu=query_lens,
                             seq_lens_cpu=(9,) * len(query_lens))
    starts = [0]
    for query_len in query_lens:
        starts.append(starts[-1] + query_len)
    assert meta.query_starts_cpu == tuple(starts)
    assert meta.decode_seqs == tuple(i for i, n in enumerate(query_lens) if n == 1)
    assert meta.prefill_seqs == tuple(i for i, n in enumerate(query_lens) if n > 1)
