"""Paged attention over a packed batch: a torch path (CPU, and the reference), C decode and prefill kernels
(CPU) and Triton kernels (CUDA).

All implement `paged_attention(q, k, v, k_cache, v_cache, meta, scale)`;
see metadata.py for the batch and cache layout.
"""

import logging
from functools import partial

from gpu_worker.attention.metadata import AttentionMetadata
from shared.cpu_tier import CpuTier, current_tier

logger = logging.getLogger("pagedserve.worker.attention")
# The kernels' vectors are 16 floats with AVX-512, else 8: whole registers from avx2 up, two SSE registers on
# x86-64, where the prefill kernel ran at 0.52-0.71x the torch path on long prompts (the decode kernel at
# 1.05-1.29x; BENCHMARKS.md).
PREFILL_KERNEL_MIN_VECTOR_BITS = 256


def select_paged_attention(device_type: str, tier: CpuTier | None = None):
    """The attention implementation for a device: Triton kernels on CUDA; elsewhere the torch path, with its
    decode rows attended by the C decode kernel and its prefill rows by the C prefill kernel where the CPU tier
    (this process's by default) has registers as wide as that kernel's vectors."""
    if device_type == "cuda":
        from gpu_worker.attention.triton_paged import paged_attention
        return paged_attention
    from gpu_worker.attention.cpu_decode import load_cpu_decode_kernel
    from gpu_worker.attention.cpu_prefill import load_cpu_prefill_kernel
    from gpu_worker.attention.torch_paged import paged_attention
    tier = tier or current_tier()
    kernels = {}
    if (decode := load_cpu_decode_kernel()) is not None:
        kernels["decode"] = decode.decode_attention
    if tier.vector_bits < PREFILL_KERNEL_MIN_VECTOR_BITS:
        logger.info("attention: prefill on the torch path, faster on this CPU tier (%s, %d-bit vectors) than the C "
                    "kernel", tier.name, tier.vector_bits)
    elif (prefill := load_cpu_prefill_kernel()) is not None:
        kernels["prefill"] = prefill.prefill_attention
    return partial(paged_attention, **kernels) if kernels else paged_attention


__all__ = ["AttentionMetadata", "select_paged_attention"]
