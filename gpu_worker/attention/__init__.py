"""Paged attention over a packed batch: a torch path (CPU, and the reference), C decode and prefill kernels
(CPU) and Triton kernels (CUDA).

All implement `paged_attention(q, k, v, k_cache, v_cache, meta, scale)`;
see metadata.py for the batch and cache layout.
"""

from functools import partial

from gpu_worker.attention.metadata import AttentionMetadata


def select_paged_attention(device_type: str):
    """The attention implementation for a device: Triton kernels on CUDA; elsewhere the torch path,
    with its decode rows and its prefill rows attended by the C kernels that build."""
    if device_type == "cuda":
        from gpu_worker.attention.triton_paged import paged_attention
        return paged_attention
    from gpu_worker.attention.cpu_decode import load_cpu_decode_kernel
    from gpu_worker.attention.cpu_prefill import load_cpu_prefill_kernel
    from gpu_worker.attention.torch_paged import paged_attention
    kernels = {}
    if (decode := load_cpu_decode_kernel()) is not None:
        kernels["decode"] = decode.decode_attention
    if (prefill := load_cpu_prefill_kernel()) is not None:
        kernels["prefill"] = prefill.prefill_attention
    return partial(paged_attention, **kernels) if kernels else paged_attention


__all__ = ["AttentionMetadata", "select_paged_attention"]
