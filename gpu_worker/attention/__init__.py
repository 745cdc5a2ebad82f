"""Paged attention over a packed batch: a torch path (CPU, and the reference), C decode and prefill kernels
(CPU) and Triton kernels (CUDA).

All implement `paged_attention(q, k, v, k_cache, v_cache, meta, scale)`;
see metadata.py for the batch and cache layout.
"""

import logging
from functools import partial

from gpu_worker.attention.metadata import AttentionMetadata
from shared.cpu_tier import WIDE_VECTOR_BITS, CpuTier, current_tier

logger = logging.getLogger("pagedserve.worker.attention")


def select_paged_attention(device_type: str, tier: CpuTier | None = None):
    """The attention implementation for a device: Triton kernels on CUDA; elsewhere the torch path,
    with its decode rows and its prefill rows attended by the C kernels that build, on a CPU tier
    (this process's by default) whose vectors hold theirs."""
    if device_type == "cuda":
        from gpu_worker.attention.triton_paged import paged_attention
        return paged_attention
    from gpu_worker.attention.cpu_decode import load_cpu_decode_kernel
    from gpu_worker.attention.cpu_prefill import load_cpu_prefill_kernel
    from gpu_worker.attention.torch_paged import paged_attention
    tier = tier or current_tier()
    if not tier.has_wide_vectors:  # the kernels ran at 0.2-0.9x the torch path on avx2 and x86-64 (BENCHMARKS.md)
        logger.info("attention: the torch path, faster on this CPU tier (%s, %d-bit vectors) than the C kernels, "
                    "whose vectors are %d bits", tier.name, tier.vector_bits, WIDE_VECTOR_BITS)
        return paged_attention
    kernels = {}
    if (decode := load_cpu_decode_kernel()) is not None:
        kernels["decode"] = decode.decode_attention
    if (prefill := load_cpu_prefill_kernel()) is not None:
        kernels["prefill"] = prefill.prefill_attention
    return partial(paged_attention, **kernels) if kernels else paged_attention


__all__ = ["AttentionMetadata", "select_paged_attention"]
