"""AttentionMetadata: where each token of a packed batch reads and writes the paged KV cache.

A step's batch is packed: the new tokens of every scheduled sequence are laid
end to end (a prefill chunk is many tokens, a decode is one). Sequence i owns
rows query_start_loc[i]:query_start_loc[i + 1] of q/k/v. Its context after
this step is seq_lens[i] tokens, the last (query_start_loc[i+1] -
query_start_loc[i]) of which are the new ones; a new token at context
position p attends to context positions 0..p (causal).

KV cache layout, per layer: k_cache and v_cache are each
[num_blocks, block_size, num_kv_heads, head_dim]. Token position p of
sequence i lives in block block_tables[i, p // block_size] at offset
p % block_size; slot_mapping gives each new token's flat slot
(block * block_size + offset) in a [num_blocks * block_size, ...] view.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: flat cache slot of each new token
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: row offsets of each sequence's new tokens
    seq_lens: torch.Tensor  # [num_seqs] int32: context length of each sequence after this step
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: tuple[int, ...]  # host copies, so the CPU path never syncs to read them
    seq_lens_cpu: tuple[int, ...]
    # Derived once per step, for every layer's attention to read: each sequence's first row (query_start_loc
    # on the host, num_seqs + 1 entries), the sequences with one new token (the decodes) and those with more.
    query_starts_cpu: tuple[int, ...] = field(init=False)
    decode_seqs: tuple[int, ...] = field(init=False)
    prefill_seqs: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        if self.max_query_len == 1:  # every sequence decodes (the everyday step): no pass over the lengths
            num_seqs = len(self.query_lens_cpu)
            self.query_starts_cpu = tuple(range(num_seqs + 1))
            self.decode_seqs, self.prefill_seqs = tuple(range(num_seqs)), ()
            return
        self.query_starts_cpu = tuple(accumulate(self.query_lens_cpu, initial=0))
        self.decode_seqs = tuple(seq for seq, query_len in enumerate(self.query_lens_cpu) if query_len == 1)
        self.prefill_seqs = tuple(seq for seq, query_len in enumerate(self.query_lens_cpu) if query_len > 1)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)
