"""The paged KV cache memory: how many blocks fit the budget, and the per-layer tensors that hold them.

Sized once at start-up, never per request. On the CPU the budget is
`kv_cache_memory` (default DEFAULT_CPU_KV_CACHE_MEMORY); on CUDA, when no
budget is given, `gpu_memory_utilization` of the memory still free after the
weights are loaded.
"""

from __future__ import annotations

import torch

from shared.config import DEFAULT_CPU_KV_CACHE_MEMORY


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """One block of K and V across all layers."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element_size


def kv_cache_budget(device: torch.device, kv_cache_memory: int | None, gpu_memory_utilization: float) -> int:
    if kv_cache_memory is not None:
        return kv_cache_memory
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        return int(free_bytes * gpu_memory_utilization)
    return DEFAULT_CPU_KV_CACHE_MEMORY


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim].

    Zero-filled: padded reads of never-written slots are masked out, and a
    zero (unlike uninitialised memory) cannot turn a masked product into NaN.
    """
    cache = torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    return [(cache[layer, 0], cache[layer, 1]) for layer in range(num_layers)]
