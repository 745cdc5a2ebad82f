"""Paged attention on CUDA: two Triton kernels behind the torch path's signature.

Owns: writing the step's new keys/values into the paged KV cache (store_kv) and
attention of a packed batch (prefill chunks and decodes mixed) over that cache,
in one launch each. Knows nothing of models or scheduling: everything it reads
comes from AttentionMetadata (see metadata.py for the layouts).

How it works: store_kv copies token t's k/v rows to cache slot
slot_mapping[t]. The attention kernel then reads every key, old and new,
from the cache through the block table, so a prefill chunk that continues a
partly cached sequence and a decode are the same case. It never syncs to the
host: grid sizes come from the metadata's host copies, so it can later be
captured in a CUDA graph. The reference it is tested against is torch_paged.py
and a dense causal attention (tests/test_triton_attention.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from gpu_worker.attention.metadata import AttentionMetadata

MIN_DOT_SIZE = 16  # tl.dot needs every dimension >= 16
MIN_HEAD_DIM = MIN_DOT_SIZE
MAX_HEAD_DIM = 256
DECODE_ROWS = MIN_DOT_SIZE  # query rows (tokens x heads of a group) per program when every sequence decodes
PREFILL_ROWS = 64  # ... when any sequence prefills (halved for fp32)
KEY_TILE_BYTES = 8192  # one [BLOCK_N, HEAD_DIM] key (and value) tile
MAX_KEYS_PER_STEP = 64
LOG2_E = 1.4426950408889634
NO_SCORE: tl.constexpr = tl.constexpr(-1.0e30)  # running max before any key: finite, so masked rows never give NaN


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cache_block, stride_cache_offset, stride_cache_head,
    NUM_KV_HEADS: tl.constexpr, KV_HEADS_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
):
    """Write new token t's k and v ([num_kv_heads, head_dim] each) into cache slot slot_mapping[t].

    Grid: (num_tokens,). k_cache and v_cache share one layout (same strides).
    """
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)  # int64
    heads = tl.arange(0, KV_HEADS_P2)[:, None]  # [KV_HEADS_P2, 1]
    dims = tl.arange(0, HEAD_DIM)[None, :]  # [1, HEAD_DIM]
    mask = heads < NUM_KV_HEADS  # [KV_HEADS_P2, 1]
    k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)  # [KV_HEADS_P2, HEAD_DIM]
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)  # [KV_HEADS_P2, HEAD_DIM]
    cache_offsets = (
        (slot // PAGE_SIZE) * stride_cache_block + (slot % PAGE_SIZE) * stride_cache_offset
        + heads * stride_cache_head + dims
    )  # [KV_HEADS_P2, HEAD_DIM]
    tl.store(k_cache_ptr + cache_offsets, k, mask=mask)
    tl.store(v_cache_ptr + cache_offsets, v, mask=mask)


@triton.jit
def _paged_attention_kernel(
    q_ptr, out_ptr, k_cache_ptr, v_cache_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cache_block, stride_cache_offset, stride_cache_head, stride_table_seq,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Causal attention of one query tile of one sequence against its paged context.

    Grid: (num_seqs, num_kv_heads, cdiv(max_query_len, BLOCK_Q)), BLOCK_Q = BLOCK_M // GROUP_P2.
    A program takes BLOCK_Q new tokens of its sequence times the GROUP query
    heads that share its kv head, flattened into BLOCK_M rows (row r is token
    r // GROUP_P2, head r % GROUP_P2), so a decode fills its rows with the
    group's heads instead of wasting them. It walks the context in BLOCK_N key
    positions at a time, looking each position's page up in the block table,
    and keeps a running max, denominator and fp32 output (online softmax),
    stopping after the last key its tile may see. New token j of a sequence
    with query_len new tokens and seq_len context sits at position
    seq_len - query_len + j and sees keys 0..that position.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_P2
    first_token = tl.program_id(2) * BLOCK_Q
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    if first_token >= query_len:  # a tile past this sequence's new tokens (grid sized by the longest)
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_start = seq_len - query_len  # position of the first new token

    rows = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    tokens = first_token + rows // GROUP_P2  # [BLOCK_M] index among the sequence's new tokens
    heads = kv_head * GROUP + rows % GROUP_P2  # [BLOCK_M] query head
    row_valid = (tokens < query_len) & (rows % GROUP_P2 < GROUP)  # [BLOCK_M]
    positions = context_start + tokens  # [BLOCK_M]
    dims = tl.arange(0, HEAD_DIM)  # [HEAD_DIM]

    q_offsets = (query_start + tokens)[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_valid[:, None], other=0.0).to(DOT_DTYPE)  # [BLOCK_M, HEAD_DIM]

    running_max = tl.full([BLOCK_M], NO_SCORE, tl.float32)  # [BLOCK_M]
    denominator = tl.zeros([BLOCK_M], tl.float32)  # [BLOCK_M]
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)  # [BLOCK_M, HEAD_DIM]
    num_visible = tl.minimum(context_start + first_token + BLOCK_Q, seq_len)  # keys 0..num_visible-1
    for key_start in range(0, num_visible, BLOCK_N):
        keys = key_start + tl.arange(0, BLOCK_N)  # [BLOCK_N] context positions
        key_valid = keys < num_visible  # [BLOCK_N]
        pages = tl.load(block_tables_ptr + seq * stride_table_seq + keys // PAGE_SIZE, mask=key_valid, other=0)
        slots = pages.to(tl.int64) * stride_cache_block + (keys % PAGE_SIZE) * stride_cache_offset  # [BLOCK_N]
        kv_offsets = slots[:, None] + kv_head * stride_cache_head + dims[None, :]  # [BLOCK_N, HEAD_DIM]
        k = tl.load(k_cache_ptr + kv_offsets, mask=key_valid[:, None], other=0.0).to(DOT_DTYPE)  # [BLOCK_N, HEAD_DIM]
        v = tl.load(v_cache_ptr + kv_offsets, mask=key_valid[:, None], other=0.0)  # [BLOCK_N, HEAD_DIM]

        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        visible = key_valid[None, :] & (keys[None, :] <= positions[:, None])  # [BLOCK_M, BLOCK_N]
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))  # [BLOCK_M]
        rescale = tl.exp2(running_max - new_max)  # [BLOCK_M]
        probs = tl.exp2(scores - new_max[:, None])  # [BLOCK_M, BLOCK_N]
        denominator = denominator * rescale + tl.sum(probs, axis=1)
        probs = probs.to(v.dtype).to(DOT_DTYPE)  # rounded to the cache dtype, as the tensor cores take it
        acc = acc * rescale[:, None] + tl.dot(probs, v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        running_max = new_max

    out = acc / tl.where(row_valid, denominator, 1.0)[:, None]  # [BLOCK_M, HEAD_DIM]
    out_offsets = (query_start + tokens)[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


@dataclass(frozen=True, slots=True)
class AttentionTiles:
    """Tile sizes of one attention launch: BLOCK_M query rows (tokens x group heads), BLOCK_N keys."""

    block_m: int
    block_n: int
    num_warps: int


def attention_tiles(head_dim: int, group: int, dtype: torch.dtype, max_query_len: int) -> AttentionTiles:
    """Small row tiles when every sequence decodes (one token each), larger ones when any prefills.

    Sized from ptxas -v on sm_90 (head_dim 16..256, groups 1..8): bf16/fp16
    tiles spill no registers, fp32 ones at most 24 bytes. Not yet tuned for speed.
    """
    is_fp32 = dtype == torch.float32  # fp32 dots run on CUDA cores and hold twice the bytes
    rows = DECODE_ROWS if max_query_len == 1 else PREFILL_ROWS // (2 if is_fp32 else 1)
    key_tile_elements = KEY_TILE_BYTES // (4 if is_fp32 else 2)
    block_n = min(max(key_tile_elements // head_dim, MIN_DOT_SIZE), MAX_KEYS_PER_STEP)
    return AttentionTiles(block_m=max(rows, triton.next_power_of_2(group)), block_n=block_n,
                          num_warps=4 if max_query_len == 1 else 8)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k/v [num_tokens, num_kv_heads, head_dim] into their slots of the paged caches."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _launcher(_store_kv_kernel, (num_tokens,))(
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, KV_HEADS_P2=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, PAGE_SIZE=k_cache.shape[1],
    )


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
           scale: float, tiles: AttentionTiles) -> torch.Tensor:
    """Causal attention of q [num_tokens, num_heads, head_dim] over the paged caches (already holding the new k/v)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    group_p2 = triton.next_power_of_2(group)
    out = torch.empty_like(q)  # [num_tokens, num_heads, head_dim]
    if q.shape[0] == 0:
        return out
    dot_dtype = _dot_dtype(q)
    grid = (meta.num_seqs, num_kv_heads, triton.cdiv(meta.max_query_len, tiles.block_m // group_p2))
    _launcher(_paged_attention_kernel, grid)(
        q, out, k_cache, v_cache,
        meta.block_tables, meta.seq_lens, meta.query_start_loc, scale * LOG2_E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0),
        GROUP=group, GROUP_P2=group_p2, HEAD_DIM=head_dim, PAGE_SIZE=k_cache.shape[1],
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, DOT_DTYPE=dot_dtype,
        DOT_PRECISION="ieee" if dot_dtype == tl.float32 else "tf32",  # fp32 dots stay fp32 (no TF32 rounding)
        num_warps=tiles.num_warps,
    )
    return out


def _launcher(kernel: JITFunction, grid: tuple[int, ...]) -> Callable[..., None]:
    """`kernel[grid]` as it is at run time: a launcher that takes the kernel's arguments, plain Python values for
    its tl.constexpr parameters, and launch options such as num_warps. Triton's typing says `kernel[grid]` has
    the kernel's own signature (tl.constexpr parameters, no options), which is not what it accepts."""
    return cast(Callable[..., None], kernel[grid])


def _dot_dtype(q: torch.Tensor) -> tl.dtype:
    """tl.dot's operand type: q's own, except bf16 on CPU tensors, i.e. in Triton's interpreter.

    The interpreter keeps bf16 as uint16 and its tl.dot multiplies the bit
    patterns (triton-lang/triton#11584), so there the operands go up to fp32;
    products of bf16 values are exact in fp32, as on the GPU's tensor cores.
    """
    if q.dtype == torch.bfloat16 and q.device.type == "cpu":
        return tl.float32
    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[q.dtype]


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Store the step's k/v in the caches, then attend; returns [num_tokens, num_heads, head_dim] in q's dtype."""
    check_inputs(q, k, v, k_cache, v_cache)
    store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    tiles = attention_tiles(q.shape[2], q.shape[1] // k.shape[1], q.dtype, meta.max_query_len)
    return attend(q, k_cache, v_cache, meta, scale, tiles)


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor) -> None:
    """Raise ValueError unless the shapes, dtypes and strides are ones the kernels handle."""
    head_dim = q.shape[-1]
    if head_dim & (head_dim - 1) or not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be a power of two in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], got {head_dim}")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2] != head_dim:
        raise ValueError(f"k and v must be [num_tokens={q.shape[0]}, num_kv_heads, {head_dim}], "
                         f"got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"num_heads ({q.shape[1]}) must be a multiple of num_kv_heads ({k.shape[1]})")
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride() or k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, {k.shape[1]}, {head_dim}] "
                         f"with equal strides, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"q must be float32, float16 or bfloat16, got {q.dtype}")
    if len({q.dtype, k.dtype, v.dtype, k_cache.dtype, v_cache.dtype}) != 1:
        raise ValueError(f"q, k, v and the caches must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}, "
                         f"{k_cache.dtype}, {v_cache.dtype}")
    if any(t.stride(-1) != 1 for t in (q, k, v, k_cache, v_cache)):
        raise ValueError("q, k, v and the caches must be contiguous along head_dim (stride 1)")
