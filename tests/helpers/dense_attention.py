"""The slow reference every paged attention kernel is checked against: a dense causal attention, one sequence at a
time, on the whole context; and the tolerances the torch path meets against it.

    from helpers.dense_attention import FLOAT32_TOLERANCE, assert_close_to_reference, dense_reference
    expected = dense_reference(batch)  # float64, [num_tokens, num_heads, head_dim]
    assert_close_to_reference(out, expected)

Tolerance: 1e-5 absolute in float32 (the difference is rounding in the
softmax and matmul order), 3e-2 in bfloat16 for the torch path, which rounds
along the way. A kernel that accumulates in float32 and rounds once stays
within one bfloat16 step (2^-8 relative) plus the float32 tolerance.
"""

from __future__ import annotations

import math

import torch

from helpers.paged_batches import PagedBatch

FLOAT32_TOLERANCE = 1e-5
BFLOAT16_TOLERANCE = 3e-2
BFLOAT16_RELATIVE_STEP = 2.0 ** -8


def dense_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                    dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """q [query_len, heads, d] = the last query_len of keys/values [seq_len, kv_heads, d]; computed in dtype."""
    query_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    keys = keys.to(dtype).repeat_interleave(group, dim=1)  # [seq_len, heads, d]
    values = values.to(dtype).repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.cpu().to(dtype), keys) * scale  # [heads, query_len, seq_len]
    query_positions = torch.arange(seq_len - query_len, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > query_positions, -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)  # [query_len, heads, d]


def dense_reference(batch: PagedBatch, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """dense_attention for every sequence of the batch, on the CPU in dtype: [num_tokens, num_heads, head_dim]."""
    starts = batch.meta.query_start_loc.tolist()
    return torch.cat([dense_attention(batch.q[start:end], keys, values, batch.scale, dtype)
                      for start, end, keys, values in zip(starts, starts[1:], batch.full_keys, batch.full_values)])


def assert_close_to_reference(out: torch.Tensor, expected: torch.Tensor) -> None:
    """float32 out within FLOAT32_TOLERANCE of expected; bfloat16 within one bfloat16 step of it, plus that."""
    diff = (out.double() - expected).abs()
    if out.dtype == torch.float32:
        assert diff.max().item() < FLOAT32_TOLERANCE, f"max abs diff {diff.max().item()}"
    else:
        excess = (diff - BFLOAT16_RELATIVE_STEP * expected.abs() - FLOAT32_TOLERANCE).max().item()
        assert excess <= 0, f"off by more than one bfloat16 step: max excess {excess}"
