"""Paged attention over a packed batch: a torch path (CPU, and the reference) and Triton kernels (CUDA).

Both implement `paged_attention(q, k, v, k_cache, v_cache, meta, scale)`;
see metadata.py for the batch and cache layout.
"""

from gpu_worker.attention.metadata import AttentionMetadata


def select_paged_attention(device_type: str):
    """The attention implementation for a device: Triton kernels on CUDA, torch elsewhere."""
    if device_type == "cuda":
        from gpu_worker.attention.triton_paged import paged_attention
    else:
        from gpu_worker.attention.torch_paged import paged_attention
    return paged_attention


__all__ = ["AttentionMetadata", "select_paged_attention"]
