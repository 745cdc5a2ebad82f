"""Paged attention over a packed batch: a torch path (CPU, and the reference), a C decode kernel (CPU)
and Triton kernels (CUDA).

All implement `paged_attention(q, k, v, k_cache, v_cache, meta, scale)`;
see metadata.py for the batch and cache layout.
"""

from functools import partial

from gpu_worker.attention.metadata import AttentionMetadata


def select_paged_attention(device_type: str):
    """The attention implementation for a device: Triton kernels on CUDA; elsewhere the torch path,
    with its decode rows attended by the C kernel when that builds."""
    if device_type == "cuda":
        from gpu_worker.attention.triton_paged import paged_attention
        return paged_attention
    from gpu_worker.attention.cpu_decode import load_cpu_decode_kernel
    from gpu_worker.attention.torch_paged import paged_attention
    kernel = load_cpu_decode_kernel()
    return paged_attention if kernel is None else partial(paged_attention, decode=kernel.decode_attention)


__all__ = ["AttentionMetadata", "select_paged_attention"]
