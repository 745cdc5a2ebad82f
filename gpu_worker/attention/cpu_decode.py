"""Decode attention on the CPU by a C kernel (cpu_decode.c) that reads K and V in place from the paged cache.

Owns loading the kernel and handing it a step's decode rows. Knows nothing
of models or scheduling; has the contract of torch_paged.decode_attention
(gather + SDPA), which stays the reference it is tested against and the
fallback: when the kernel cannot be built (no compiler) the CPU path is
torch_paged's alone, and inputs the kernel does not take (float16, a
head_dim that is not a multiple of 16, a head group or head_dim past its
buffers, non-contiguous caches) go there too.

How it works: the kernel is compiled on first use (compiled_library.py),
loaded with ctypes and called with the tensors' data pointers; it runs on
as many OpenMP threads as torch uses, in torch's own OpenMP runtime (the
library links libgomp.so.1, which torch has already loaded).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from gpu_worker.attention import torch_paged
from gpu_worker.attention.compiled_library import LibraryBuildError, default_cache_dir, default_compiler, load_library
from gpu_worker.attention.metadata import AttentionMetadata

logger = logging.getLogger("pagedserve.worker.attention")

SOURCE = Path(__file__).with_name("cpu_decode.c")
KERNEL_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the C side's CACHE_FLOAT32, CACHE_BFLOAT16
STATUS_MESSAGES = {1: "sizes outside the kernel's limits", 2: "an unknown dtype",
                   3: "a seq_len outside 1..block_table width * block_size", 4: "a block id outside the cache"}

_i64, _pointer = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = [ctypes.c_int, _pointer, _i64, _i64, _pointer, _i64, _i64, _pointer, _pointer,  # dtype, q, out, caches
             _i64, _i64, _i64, _i64, _i64,  # num_blocks, block_size, num_kv_heads, head_dim, group
             _pointer, _i64, _i64, _pointer, _pointer, _pointer, _i64,  # tables, seq_lens, query_start_loc, seq_ids
             ctypes.c_float, ctypes.c_int]  # scale, num_threads


class CpuDecodeKernel:
    """The loaded library; `decode_attention` is a drop-in for torch_paged.decode_attention."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._attend = library.pagedserve_decode_attention
        self._attend.argtypes = _ARGTYPES
        self._attend.restype = ctypes.c_int
        self.max_group = ctypes.c_int32.in_dll(library, "pagedserve_max_group").value
        self.max_head_dim = ctypes.c_int32.in_dll(library, "pagedserve_max_head_dim").value
        self.head_dim_multiple = ctypes.c_int32.in_dll(library, "pagedserve_head_dim_multiple").value

    def accepts(self, q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        """Whether the kernel takes these inputs (otherwise the torch path does)."""
        num_heads, head_dim = q.shape[1:]
        return (q.dtype in KERNEL_DTYPES and out.dtype == k_cache.dtype == v_cache.dtype == q.dtype
                and q.device.type == out.device.type == k_cache.device.type == v_cache.device.type == "cpu"
                and k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
                and q.stride(2) == out.stride(2) == 1 and out.shape == q.shape
                and head_dim <= self.max_head_dim and head_dim % self.head_dim_multiple == 0
                and num_heads % k_cache.shape[2] == 0 and num_heads // k_cache.shape[2] <= self.max_group)

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                         decodes: list[int], starts: list[int], scale: float, out: torch.Tensor) -> None:
        """One new token per sequence in `decodes` (its row of q at starts[seq]); writes their outputs into out.

        q, out [num_tokens, num_heads, head_dim]; k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim].
        The kernel finds the rows itself, in meta.query_start_loc.
        """
        if not self.accepts(q, out, k_cache, v_cache):
            torch_paged.decode_attention(q, k_cache, v_cache, meta, decodes, starts, scale, out)
            return
        num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
        tables, seq_lens, query_start_loc = (_int32(t) for t in (meta.block_tables, meta.seq_lens, meta.query_start_loc))
        seq_ids = torch.tensor(decodes, dtype=torch.int32)  # [num_decodes]
        status = self._attend(
            KERNEL_DTYPES[q.dtype], q.data_ptr(), q.stride(0), q.stride(1), out.data_ptr(), out.stride(0), out.stride(1),
            k_cache.data_ptr(), v_cache.data_ptr(), num_blocks, block_size, num_kv_heads, head_dim,
            q.shape[1] // num_kv_heads, tables.data_ptr(), tables.stride(0), tables.shape[1], seq_lens.data_ptr(),
            query_start_loc.data_ptr(), seq_ids.data_ptr(), len(decodes), scale, torch.get_num_threads())
        if status:
            raise ValueError(f"decode attention needs valid metadata for a cache of {num_blocks} blocks of "
                             f"{block_size}, got {STATUS_MESSAGES.get(status, f'status {status}')}")


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t.to(device="cpu", dtype=torch.int32).contiguous()


@functools.cache
def load_cpu_decode_kernel() -> CpuDecodeKernel | None:
    """The kernel, built on first use into the cache directory; None (after one warning) if it cannot be built."""
    try:
        return CpuDecodeKernel(load_library(SOURCE, default_cache_dir(), default_compiler()))
    except LibraryBuildError as error:
        logger.warning("the CPU decode attention kernel is unavailable, using the torch path: %s", error)
        return None
