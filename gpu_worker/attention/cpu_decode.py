"""Decode attention on the CPU by a C kernel (cpu_decode.c) that reads K and V in place from the paged cache.

Owns loading the kernel and handing it a step's decode rows. Knows nothing
of models or scheduling; has the contract of torch_paged.decode_attention
(gather + SDPA), which stays the reference it is tested against and the
fallback: when the kernel cannot be built (no compiler) the CPU path is
torch_paged's alone, and inputs the kernel does not take (float16, a
head_dim that is not a multiple of 16, a head group or head_dim past its
buffers, non-contiguous caches) go there too. Inputs that disagree with each
other (q, out and the caches of different dtypes or head sizes, metadata
indexes past q or past the metadata's sequences) are a ValueError: neither
path can attend them, and the kernel would read or write out of bounds.

How it works: the kernel is compiled on first use (compiled_library.py),
loaded with ctypes and called with the tensors' data pointers; it runs on
as many OpenMP threads as torch uses, in torch's own OpenMP runtime (the
library links libgomp.so.1, which torch has already loaded). For bfloat16
the library says which path it was compiled with (AVX-512 BF16 dot products
where the CPU has them, else widening to float32), logged once at load; the
widening path stays callable (`with_widening`) to compare the two.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from gpu_worker.attention import torch_paged
from gpu_worker.attention.kernel_inputs import (
    KERNEL_DTYPES,
    AttentionCall,
    disagreement,
    int32_metadata,
    within_limits,
)
from gpu_worker.attention.metadata import AttentionMetadata
from gpu_worker.native.compiled_library import load_or_warn
from shared.cpu_tier import CpuTier

logger = logging.getLogger("pagedserve.worker.attention")

SOURCE = Path(__file__).with_name("cpu_decode.c")
# The C side's statuses: what was found, in sequence {seq} (where one was) of values {seq_len} and {row}.
STATUS_MESSAGES = {1: "sizes outside the kernel's limits", 2: "an unknown dtype",
                   3: "a seq_len outside 1..block_table width * block_size: seq_lens[{seq}] = {seq_len}",
                   4: "a block id outside the cache in block_tables[{seq}]",
                   5: "a seq id past the metadata's sequences: {seq}",
                   6: "a query row outside q: query_start_loc[{seq}] = {row}",
                   7: "a bfloat16 path this build does not have"}

CACHE_ARGUMENTS = slice(8, 10)  # where the k and v caches' pointers are in the kernel's arguments
_i64, _pointer = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = [ctypes.c_int, ctypes.c_int, _pointer, _i64, _i64, _pointer, _i64, _i64,  # dtype, bf16 path, q, out
             _pointer, _pointer,  # caches
             _i64, _i64, _i64, _i64, _i64, _i64,  # num_tokens, num_blocks, block_size, num_kv_heads, head_dim, group
             _pointer, _i64, _i64, _pointer, _pointer, _i64,  # tables, seq_lens, query_start_loc, num_seqs
             _pointer, _i64, ctypes.c_float, ctypes.c_int, _pointer]  # seq_ids, scale, num_threads, failed_decode


class Bf16Path(enum.IntEnum):
    """How the kernel attends bfloat16 caches (the C side's BF16_WIDENING, BF16_DOT_PRODUCTS)."""

    WIDENING = 0
    DOT_PRODUCTS = 1

    @property
    def description(self) -> str:
        return {Bf16Path.WIDENING: "widening to float32", Bf16Path.DOT_PRODUCTS: "AVX-512 BF16 dot products"}[self]


class CpuDecodeKernel:
    """The loaded library; `decode_attention` is a drop-in for torch_paged.decode_attention.

    bfloat16 runs on `bf16_path`: by default the path the library was compiled with (`compiled_bf16_path`).
    """

    def __init__(self, library: ctypes.CDLL, bf16_path: Bf16Path | None = None) -> None:
        self._library = library
        self._attend = library.pagedserve_decode_attention
        self._attend.argtypes = _ARGTYPES
        self._attend.restype = ctypes.c_int
        self.max_group = ctypes.c_int32.in_dll(library, "pagedserve_max_group").value
        self.max_head_dim = ctypes.c_int32.in_dll(library, "pagedserve_max_head_dim").value
        self.head_dim_multiple = ctypes.c_int32.in_dll(library, "pagedserve_head_dim_multiple").value
        self.compiled_bf16_path = Bf16Path(ctypes.c_int32.in_dll(library, "pagedserve_bf16_path").value)
        self.bf16_path = self.compiled_bf16_path if bf16_path is None else bf16_path
        if self.bf16_path not in (Bf16Path.WIDENING, self.compiled_bf16_path):
            raise ValueError(f"bf16_path should be {Bf16Path.WIDENING.name} or this build's "
                             f"{self.compiled_bf16_path.name}, got {self.bf16_path.name}")

    def with_widening(self) -> CpuDecodeKernel:
        """The same library with bfloat16 widened to float32: the path the dot products are compared with."""
        return CpuDecodeKernel(self._library, Bf16Path.WIDENING)

    def accepts(self, q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        """Whether the kernel takes these inputs (otherwise the torch path does, or they disagree: a ValueError)."""
        return disagreement(q, out, k_cache, v_cache) is None and self._supports(q, out, k_cache, v_cache)

    def _supports(self, q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        """For inputs that agree with each other: whether the kernel has code and buffers for them."""
        return within_limits(q, out, k_cache, v_cache, max_group=self.max_group, max_head_dim=self.max_head_dim,
                             head_dim_multiple=self.head_dim_multiple)

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                         decodes: Sequence[int], starts: Sequence[int], scale: float, out: torch.Tensor) -> None:
        """One new token per sequence in `decodes` (its row of q at starts[seq]); writes their outputs into out.

        q, out [num_tokens, num_heads, head_dim]; k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim].
        The kernel finds the rows itself, in meta.query_start_loc.
        """
        if (problem := disagreement(q, out, k_cache, v_cache)) is not None:
            raise ValueError(f"decode attention needs q, out and both caches of one dtype and head size, got {problem}")
        if not self._supports(q, out, k_cache, v_cache):
            torch_paged.decode_attention(q, k_cache, v_cache, meta, decodes, starts, scale, out)
            return
        self.call(q, out, k_cache, v_cache, meta, decodes, scale).run()

    def call(self, q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             meta: AttentionMetadata, decodes: Sequence[int], scale: float) -> AttentionCall:
        """decode_attention's kernel call on inputs it takes (`accepts`), to be run later while they stay alive and
        in place; its cache_arguments say where another layer's caches go."""
        num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
        tables, seq_lens, query_start_loc = int32_metadata(meta, "decode")
        seq_ids = torch.tensor(decodes, dtype=torch.int32)  # [num_decodes]
        failed_decode = ctypes.c_int64(-1)  # the kernel writes the index in decodes of a sequence it refused
        args = (
            KERNEL_DTYPES[q.dtype], self.bf16_path, q.data_ptr(), q.stride(0), q.stride(1),
            out.data_ptr(), out.stride(0), out.stride(1),
            k_cache.data_ptr(), v_cache.data_ptr(), q.shape[0], num_blocks, block_size, num_kv_heads, head_dim,
            q.shape[1] // num_kv_heads, tables.data_ptr(), tables.stride(0), tables.shape[1], seq_lens.data_ptr(),
            query_start_loc.data_ptr(), seq_lens.shape[0], seq_ids.data_ptr(), len(decodes), scale,
            torch.get_num_threads(), ctypes.addressof(failed_decode))
        return AttentionCall("decode", self._attend, args, CACHE_ARGUMENTS, (tables, seq_lens, query_start_loc, seq_ids),
                             failed_decode, tuple(decodes), q.shape[0], num_blocks, block_size, STATUS_MESSAGES)


@functools.cache
def load_cpu_decode_kernel(tier: CpuTier | None = None) -> CpuDecodeKernel | None:
    """The kernel's build for the tier (this process's by default); None (after one warning) if none loads."""
    library = load_or_warn(SOURCE, logger, "the CPU decode attention kernel", "the torch path", tier)
    if library is None:
        return None
    kernel = CpuDecodeKernel(library)
    logger.info("bf16 decode attention: %s", kernel.bf16_path.description)
    return kernel
