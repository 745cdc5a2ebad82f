"""Paged attention in plain torch: the CPU path and the reference the Triton kernels are checked against.

Owns writing a step's new k/v into the paged cache and attending over each
sequence's whole context. Knows nothing of models or scheduling; sizes come
from the metadata's host tuples, so nothing here waits on the device.

How it works: decode rows (one new token) are batched — sorted by context
length, grouped, each group's blocks gathered into a padded
[num_seqs, context, num_kv_heads, head_dim] tensor and attended in one
scaled_dot_product_attention call with a padding mask. Grouped-query heads
ride along as extra query rows of their kv head, so kv is never repeated.
Each sequence with several new tokens (a prefill chunk) gets its own call
with a causal mask offset by the context it already has. On the CPU the
decode rows normally go to the C kernel of cpu_decode.py instead (passed in
as `decode`) and the prefill rows to the C kernel of cpu_prefill.py (passed
in as `prefill`), which read the cache in place; decode_attention and
prefill_attention here are their reference and fallback.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from gpu_worker.attention.metadata import AttentionMetadata

# Cap on one decode group's gathered k (and again v). Small enough that a
# group's k and v stay in the last-level cache between the gather that
# writes them and the attention that reads them (and that the buffers come
# from malloc's free lists, not fresh page-faulting mappings): at batch 64,
# contexts 300-700, a decode step ran 3x faster with 4 MiB than with 16 MiB
# (32 MiB L3); 1 MiB and below lose again to per-group overheads.
DECODE_GATHER_BYTES = 4 << 20

# decode_attention's signature: (q, k_cache, v_cache, meta, decodes, starts, scale, out) -> None.
DecodeAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, Sequence[int], Sequence[int], float,
                            torch.Tensor], None]
# prefill_attention's signature: (q, k, v, k_cache, v_cache, meta, prefills, starts, scale, out) -> None.
PrefillAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata,
                             Sequence[int], Sequence[int], float, torch.Tensor], None]


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    decode: DecodeAttention | None = None, prefill: PrefillAttention | None = None) -> torch.Tensor:
    """Write k/v at meta.slot_mapping, then causal attention of each sequence's new tokens over its context.

    q [num_tokens, num_heads, head_dim]; k, v [num_tokens, num_kv_heads, head_dim];
    k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim].
    Returns [num_tokens, num_heads, head_dim] in q's dtype. `decode` attends
    the decode rows (default: decode_attention below; the C kernel of
    cpu_decode.py plugs in here), `prefill` the rows of sequences with
    several new tokens (default: prefill_attention below; the C kernel of
    cpu_prefill.py plugs in here).
    """
    write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty_like(q)  # [num_tokens, num_heads, head_dim]
    starts, decodes, prefills = meta.query_starts_cpu, meta.decode_seqs, meta.prefill_seqs
    if decodes:
        (decode or decode_attention)(q, k_cache, v_cache, meta, decodes, starts, scale, out)
    if prefills:
        (prefill or prefill_attention)(q, k, v, k_cache, v_cache, meta, prefills, starts, scale, out)
    return out


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Store each new token's k/v [num_tokens, num_kv_heads, head_dim] at its flat cache slot."""
    num_kv_heads, head_dim = k_cache.shape[2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)  # view: raises if not in place
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def _decode_groups(seq_lens: list[int], bytes_per_position: int) -> list[range]:
    """Split sequences sorted by context length (ascending) into consecutive ranges whose padded gather fits the cap."""
    groups: list[range] = []
    for seq, seq_len in enumerate(seq_lens):
        # Sorted ascending, so the sequence being added sets the group's padded length.
        if groups and (len(groups[-1]) + 1) * seq_len * bytes_per_position <= DECODE_GATHER_BYTES:
            groups[-1] = range(groups[-1].start, seq + 1)
        else:
            groups.append(range(seq, seq + 1))
    return groups


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """cache [num_blocks, block_size, kvh, d], block_ids [n, num_ids] -> first `length` positions [n, length, kvh, d]."""
    n, num_ids = block_ids.shape
    blocks = cache.index_select(0, block_ids.reshape(-1))  # [n * num_ids, block_size, kvh, d]
    return blocks.view(n, num_ids * cache.shape[1], *cache.shape[2:])[:, :length]


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                     decodes: Sequence[int], starts: Sequence[int], scale: float, out: torch.Tensor) -> None:
    """One new token per sequence in `decodes` (its row of q at starts[seq]); writes their outputs into out.

    Sequences are sorted by context length once per call, so every group is a
    slice of the sorted block tables, queries and padding mask.
    """
    (num_heads, head_dim), (block_size, num_kv_heads) = q.shape[1:], k_cache.shape[1:3]
    order = sorted(decodes, key=lambda seq: meta.seq_lens_cpu[seq])
    seq_lens = [meta.seq_lens_cpu[seq] for seq in order]
    row_index = torch.tensor([starts[seq] for seq in order], device=q.device)  # [n]
    block_tables = meta.block_tables.index_select(0, torch.tensor(order, device=q.device))  # [n, max_blocks]
    positions = torch.arange(seq_lens[-1], device=q.device)  # [longest]
    valid = positions[None, :] < torch.tensor(seq_lens, device=q.device)[:, None]  # [n, longest]
    # The query heads sharing a kv head become that head's query rows.
    queries = q.index_select(0, row_index).view(len(order), num_kv_heads, num_heads // num_kv_heads, head_dim)
    attended = torch.empty_like(queries)  # [n, kvh, group_heads, d]
    bytes_per_position = k_cache[0, 0].numel() * k_cache.element_size()
    for group in _decode_groups(seq_lens, bytes_per_position):
        rows, max_len = slice(group.start, group.stop), seq_lens[group.stop - 1]
        block_ids = block_tables[rows, :-(-max_len // block_size)]  # [group, blocks]
        keys = _gather_blocks(k_cache, block_ids, max_len).transpose(1, 2)  # [group, kvh, max_len, d]
        values = _gather_blocks(v_cache, block_ids, max_len).transpose(1, 2)  # [group, kvh, max_len, d]
        attended[rows] = F.scaled_dot_product_attention(
            queries[rows], keys, values, attn_mask=valid[rows, None, None, :max_len], scale=scale)
    out.index_copy_(0, row_index, attended.view(len(order), num_heads, head_dim))


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, prefills: Sequence[int], starts: Sequence[int], scale: float,
                      out: torch.Tensor) -> None:
    """Each sequence in `prefills` (its new rows of q from starts[seq]) over its context; writes their outputs into out.

    One SDPA call per sequence, over its k/v as they are when the whole
    context is new, else over a gather copy of its cached blocks.
    """
    for seq in prefills:
        rows = slice(starts[seq], starts[seq] + meta.query_lens_cpu[seq])
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], k_cache, v_cache,
                                       meta.block_tables[seq], meta.seq_lens_cpu[seq], scale)


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, scale: float) -> torch.Tensor:
    """One sequence's query_len new tokens (the last of its seq_len) over its context -> [query_len, heads, d]."""
    query_len = q.shape[0]
    if query_len == seq_len:  # the whole context is new: use k/v as they are, plain causal mask
        keys, values, mask = k, v, None
    else:
        block_ids = block_table[None, :-(-seq_len // k_cache.shape[1])]  # [1, blocks]
        keys = _gather_blocks(k_cache, block_ids, seq_len)[0]  # [seq_len, kvh, d]
        values = _gather_blocks(v_cache, block_ids, seq_len)[0]  # [seq_len, kvh, d]
        query_positions = torch.arange(seq_len - query_len, seq_len, device=q.device)  # [query_len]
        mask = torch.arange(seq_len, device=q.device)[None, :] <= query_positions[:, None]  # [query_len, seq_len]
    # Repeating kv heads (rather than enable_gqa) and 4-d inputs keep SDPA on its CPU flash kernel.
    group = q.shape[1] // keys.shape[1]
    keys = keys.transpose(0, 1).repeat_interleave(group, dim=0)  # [heads, seq_len, d]
    values = values.transpose(0, 1).repeat_interleave(group, dim=0)  # [heads, seq_len, d]
    attended = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys[None], values[None],
        attn_mask=mask, is_causal=mask is None, scale=scale)  # [1, heads, query_len, d]
    return attended[0].transpose(0, 1)
