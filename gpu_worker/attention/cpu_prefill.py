"""Prefill attention on the CPU by a C kernel (cpu_prefill.c) that reads K and V in place from the paged cache.

Owns loading the kernel and handing it a step's prefill rows (sequences with
several new tokens: whole prompts, chunks of long prompts, chunks over a
cached prefix). Knows nothing of models or scheduling; has the contract of
torch_paged.prefill_attention (gather + repeated kv heads + SDPA), which
stays the reference it is tested against and the fallback: when the kernel
cannot be built (no compiler) the CPU path is torch_paged's alone, and inputs
the kernel does not take (float16, a head_dim that is not a multiple of 16,
a head group or head_dim past its buffers, non-contiguous caches) go there
too. Inputs that disagree with each other (q, out and the caches of
different dtypes or head sizes, metadata indexes past q or past the
metadata's sequences) are a ValueError: neither path can attend them, and
the kernel would read or write out of bounds.

How it works: the kernel is compiled on first use (compiled_library.py),
loaded with ctypes and called with the tensors' data pointers; it runs on as
many OpenMP threads as torch uses, in torch's own OpenMP runtime.

Routing: every sequence of inputs the kernel takes goes to it; none is kept
on SDPA, because the kernel was faster in every case measured
(tools/bench/kernels/bench_prefill_attention.py: SmolLM-135M's shape, 2 threads, AMD EPYC
with avx512_bf16; median of paired torch / kernel time ratios): prompts of 8
to 2,048 tokens x1.6 to x4.0 in float32 and x2.1 to x4.3 in bfloat16, the
least at 8 tokens (fixed costs) and at 2,048 (where SDPA's GEMMs do best,
x2.5 / x2.9); a chunk of 256 over 1,024 cached tokens x2.2 / x2.8, of 2 over
1,000 x2.7 / x3.3; a batch of five prefills x2.6 / x3.4.
"""

from __future__ import annotations

import ctypes
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

SOURCE = Path(__file__).with_name("cpu_prefill.c")
# The C side's statuses: what was found, in sequence {seq} (where one was) of values {seq_len} and {rows}
# (query_start_loc[seq] and [following]).
STATUS_MESSAGES = {1: "sizes outside the kernel's limits", 2: "an unknown dtype",
                   3: "a seq_len outside query_len..block_table width * block_size: seq_lens[{seq}] = {seq_len}",
                   4: "a block id outside the cache in block_tables[{seq}]",
                   5: "a seq id past the metadata's sequences: {seq}",
                   6: "query rows outside q (or none): query_start_loc[{seq}], [{following}] = {rows}",
                   7: "no memory for the work list"}

CACHE_ARGUMENTS = slice(7, 9)  # where the k and v caches' pointers are in the kernel's arguments
_i64, _pointer = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = [ctypes.c_int, _pointer, _i64, _i64, _pointer, _i64, _i64, _pointer, _pointer,  # dtype, q, out, caches
             _i64, _i64, _i64, _i64, _i64, _i64,  # num_tokens, num_blocks, block_size, num_kv_heads, head_dim, group
             _pointer, _i64, _i64, _pointer, _pointer, _i64,  # tables, seq_lens, query_start_loc, num_seqs
             _pointer, _i64, ctypes.c_float, ctypes.c_int, _pointer]  # seq_ids, scale, num_threads, failed_prefill


class CpuPrefillKernel:
    """The loaded library; `prefill_attention` is a drop-in for torch_paged.prefill_attention."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._attend = library.pagedserve_prefill_attention
        self._attend.argtypes = _ARGTYPES
        self._attend.restype = ctypes.c_int
        self.max_group = ctypes.c_int32.in_dll(library, "pagedserve_prefill_max_group").value
        self.max_head_dim = ctypes.c_int32.in_dll(library, "pagedserve_prefill_max_head_dim").value
        self.head_dim_multiple = ctypes.c_int32.in_dll(library, "pagedserve_prefill_head_dim_multiple").value

    def accepts(self, q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        """Whether the kernel takes these inputs (otherwise the torch path does, or they disagree: a ValueError)."""
        return disagreement(q, out, k_cache, v_cache) is None and self._supports(q, out, k_cache, v_cache)

    def _supports(self, q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        """For inputs that agree with each other: whether the kernel has code and buffers for them."""
        return within_limits(q, out, k_cache, v_cache, max_group=self.max_group, max_head_dim=self.max_head_dim,
                             head_dim_multiple=self.head_dim_multiple)

    def prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, meta: AttentionMetadata, prefills: Sequence[int],
                          starts: Sequence[int], scale: float, out: torch.Tensor) -> None:
        """Each sequence in `prefills` (its new rows of q from starts[seq]) over its context; writes into out.

        q, out [num_tokens, num_heads, head_dim]; k, v [num_tokens, num_kv_heads, head_dim];
        k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim], which already hold k and v.
        The kernel reads k/v from the cache only and finds the rows itself, in meta.query_start_loc;
        k, v and starts are for the torch path, where inputs past the kernel go.
        """
        if (problem := disagreement(q, out, k_cache, v_cache)) is not None:
            raise ValueError(f"prefill attention needs q, out and both caches of one dtype and head size, got {problem}")
        if not self._supports(q, out, k_cache, v_cache):
            torch_paged.prefill_attention(q, k, v, k_cache, v_cache, meta, prefills, starts, scale, out)
            return
        self.call(q, out, k_cache, v_cache, meta, prefills, scale).run()

    def call(self, q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             meta: AttentionMetadata, prefills: Sequence[int], scale: float) -> AttentionCall:
        """prefill_attention's kernel call on inputs it takes (`accepts`), whose caches already hold the new rows'
        k and v, to be run later while they stay alive and in place; its cache_arguments say where another
        layer's caches go."""
        num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
        tables, seq_lens, query_start_loc = int32_metadata(meta, "prefill")
        seq_ids = torch.tensor(prefills, dtype=torch.int32)  # [num_prefills]
        failed_prefill = ctypes.c_int64(-1)  # the kernel writes the index in prefills of a sequence it refused
        args = (
            KERNEL_DTYPES[q.dtype], q.data_ptr(), q.stride(0), q.stride(1), out.data_ptr(), out.stride(0), out.stride(1),
            k_cache.data_ptr(), v_cache.data_ptr(), q.shape[0], num_blocks, block_size, num_kv_heads, head_dim,
            q.shape[1] // num_kv_heads, tables.data_ptr(), tables.stride(0), tables.shape[1], seq_lens.data_ptr(),
            query_start_loc.data_ptr(), seq_lens.shape[0], seq_ids.data_ptr(), len(prefills), scale,
            torch.get_num_threads(), ctypes.addressof(failed_prefill))
        return AttentionCall("prefill", self._attend, args, CACHE_ARGUMENTS, (tables, seq_lens, query_start_loc, seq_ids),
                             failed_prefill, tuple(prefills), q.shape[0], num_blocks, block_size, STATUS_MESSAGES)


@functools.cache
def load_cpu_prefill_kernel(tier: CpuTier | None = None) -> CpuPrefillKernel | None:
    """The kernel's build for the tier (this process's by default); None (after one warning) if none loads."""
    library = load_or_warn(SOURCE, logger, "the CPU prefill attention kernel", "the torch path", tier)
    return None if library is None else CpuPrefillKernel(library)
