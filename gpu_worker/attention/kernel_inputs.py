"""The checks the CPU attention kernels' wrappers (cpu_decode.py, cpu_prefill.py) make alike before a call.

Owns what both kernels ask of their inputs: which dtypes they take, when q, out
and the caches disagree with each other, when they fit a kernel's buffers, the
metadata as the int32 tensors the kernels read, and a call made ready to run
later (AttentionCall) with what its failure means. Knows nothing of a
kernel's library or of what it computes: each wrapper reads its own limits
from its library and passes them in.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpu_worker.attention.metadata import AttentionMetadata
from gpu_worker.native.profiled_range import call_named, profiling

KERNEL_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the C side's CACHE_FLOAT32, CACHE_BFLOAT16


def disagreement(q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> str | None:
    """What makes q, out [num_tokens, num_heads, head_dim] and the caches [..., num_kv_heads, head_dim] disagree, if anything."""
    if not q.dtype == out.dtype == k_cache.dtype == v_cache.dtype:
        return f"dtypes q {q.dtype}, out {out.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}"
    if q.dim() != 3 or out.shape != q.shape or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        return (f"shapes q {tuple(q.shape)}, out {tuple(out.shape)}, k_cache {tuple(k_cache.shape)}, "
                f"v_cache {tuple(v_cache.shape)}")
    if q.shape[2] != k_cache.shape[3] or k_cache.shape[2] == 0 or q.shape[1] % k_cache.shape[2]:
        return f"{q.shape[1]} query heads of {q.shape[2]} for {k_cache.shape[2]} kv heads of {k_cache.shape[3]}"
    return None


def within_limits(q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                  max_group: int, max_head_dim: int, head_dim_multiple: int) -> bool:
    """For inputs that agree with each other: whether a kernel with these limits has code and buffers for them."""
    num_heads, head_dim = q.shape[1:]
    return (q.dtype in KERNEL_DTYPES
            and q.device.type == out.device.type == k_cache.device.type == v_cache.device.type == "cpu"
            and k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(2) == out.stride(2) == 1
            and head_dim <= max_head_dim and head_dim % head_dim_multiple == 0
            and num_heads // k_cache.shape[2] <= max_group)


def int32_metadata(meta: AttentionMetadata, attention: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """meta's block_tables, seq_lens and query_start_loc as contiguous int32 CPU tensors, checked to count the same
    sequences (a ValueError that names the `attention`, "decode" or "prefill", otherwise)."""
    tables, seq_lens, query_start_loc = (as_int32(t) for t in (meta.block_tables, meta.seq_lens, meta.query_start_loc))
    num_seqs = seq_lens.shape[0]
    if tables.shape[0] != num_seqs or query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(f"{attention} attention needs metadata with {num_seqs} block table rows and {num_seqs + 1} "
                         f"query_start_loc entries for {num_seqs} seq_lens, got {tables.shape[0]} and "
                         f"{query_start_loc.shape[0]}")
    return tables, seq_lens, query_start_loc


def as_int32(t: torch.Tensor) -> torch.Tensor:
    return t.to(device="cpu", dtype=torch.int32).contiguous()


@dataclass(slots=True, frozen=True)
class AttentionCall:
    """One attention kernel call: the kernel, its arguments, and the tensors they point into (kept alive here)."""

    attention: str  # "decode" or "prefill", for messages
    kernel: Callable[..., int]
    args: tuple
    cache_arguments: slice  # where the k and v caches' pointers are in args: another layer's go there
    metadata: tuple[torch.Tensor, ...]  # block tables, seq_lens, query_start_loc, seq ids: int32
    failed_seq: ctypes.c_int64  # the kernel writes the index in seq_ids of a sequence it refused
    seq_ids: tuple[int, ...]
    num_rows: int
    num_blocks: int
    block_size: int
    status_messages: dict[int, str]  # the kernel's, formatted with seq, seq_len, row, following and rows

    def run(self) -> None:
        """The call, now (named pagedserve::<attention>_attention in a running profile); a refusal is a ValueError."""
        name = f"pagedserve::{self.attention}_attention"
        if status := call_named(name, self.kernel, self.args) if profiling() else self.kernel(*self.args):
            raise self.error(status)

    def error(self, status: int) -> ValueError:
        """What a non-zero status from the kernel means, naming the sequence it refused where there is one."""
        _, seq_lens, query_start_loc, _ = self.metadata
        num_seqs = seq_lens.shape[0]
        failed = self.failed_seq.value
        seq = self.seq_ids[failed] if 0 <= failed < len(self.seq_ids) else None
        valid = seq if seq is not None and 0 <= seq < num_seqs else None  # the refused sequence, when in range
        problem = self.status_messages.get(status, f"status {status}").format(
            seq=seq, seq_len=None if valid is None else int(seq_lens[valid]),
            row=None if valid is None else int(query_start_loc[valid]), following=None if valid is None else valid + 1,
            rows=None if valid is None else query_start_loc[valid:valid + 2].tolist())
        return ValueError(f"{self.attention} attention needs valid metadata for q of {self.num_rows} rows, {num_seqs} "
                          f"sequences and a cache of {self.num_blocks} blocks of {self.block_size}, got {problem}")
