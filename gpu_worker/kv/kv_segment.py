"""The KV cache in a shared-memory segment: the worker's side (the frontend creates, locks and removes the file,
server/worker/kv_segment.py).

Layout of the file: one int64 allocation serial per block (the BlockManager
stamps them, shared/kv_hold.py says why), padded to a page, then the pool
itself, [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] in
the model's dtype, exactly as allocate_kv_cache lays out a private one. The
first worker finds the file empty and sizes it, reserving every page at once
(posix_fallocate), so a full /dev/shm shows as an error at start-up and never
as a SIGBUS in the middle of a step; a reservation that would leave the file
system with less than free_margin() free is not made, and when it is not
(or fails) the file is left empty, holding nothing, the worker keeps a
private cache, and the frontend hands no later worker the segment. Every
later worker of the server finds it that size and maps it as it is, with
whatever KV its predecessors left, or, finding it empty, tries the
reservation again; a file of the right size whose pages are not all
reserved (never written so by this server, but a file system can hold one)
is reserved before it is mapped, or refused.
Every worker maps all of its pages at once (MAP_POPULATE): they are shared,
so a standby's mapping costs page tables, not a second copy.
"""

from __future__ import annotations

import errno
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

_PAGE = mmap.PAGESIZE
# Map every page up front: faulting the pool in page by page during steps cost a fresh worker 4% of its
# throughput in its first minutes, and a standby taking over would pay it in the middle of a recovery.
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
SERIAL_DTYPE = np.dtype("<i8")
FREE_MARGIN_MAX = 256 << 20


def segment_size(num_blocks: int, block_bytes: int) -> int:
    return _serials_bytes(num_blocks) + num_blocks * block_bytes


def _serials_bytes(num_blocks: int) -> int:
    return -(-num_blocks * SERIAL_DTYPE.itemsize // _PAGE) * _PAGE


def _reserve_or_empty(fd: int, size: int) -> None:
    """Size an empty segment to `size` bytes with every page reserved, leaving its file system at least
    free_margin() free; otherwise (an OSError) leave it empty, holding nothing, rather than a file with holes."""
    fs = os.fstatvfs(fd)
    free, margin = fs.f_bavail * fs.f_frsize, free_margin(fs.f_blocks * fs.f_frsize)
    if free - size < margin:
        raise OSError(errno.ENOSPC, f"a KV cache segment of {size >> 20} MiB would leave {max(free - size, 0) >> 20} "
                                    f"MiB of its file system free ({free >> 20} MiB now), under the {margin >> 20} "
                                    f"MiB kept for other processes")
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError:
        os.ftruncate(fd, 0)
        raise


def free_margin(file_system_bytes: int) -> int:
    """What a segment leaves free of its file system (a /dev/shm shared with every process of the machine): a
    sixteenth of it, at most FREE_MARGIN_MAX."""
    return min(file_system_bytes // 16, FREE_MARGIN_MAX)


@dataclass(eq=False)
class KVSegment:
    """A mapped segment: the blocks' serials and the per-layer (k_cache, v_cache) views of the pool."""

    path: Path
    serials: np.ndarray  # int64 [num_blocks]
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    _mapping: mmap.mmap


def map_kv_segment(path: Path, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                   dtype: torch.dtype) -> KVSegment:
    """Map the segment at `path` (sizing it first when it is empty). OSError when it cannot be: no room left in
    its file system, or a size that another geometry made."""
    element_size = torch.empty((), dtype=dtype).element_size()
    block_bytes = 2 * num_layers * block_size * num_kv_heads * head_dim * element_size
    size = segment_size(num_blocks, block_bytes)
    fd = os.open(path, os.O_RDWR)
    try:
        stat = os.fstat(fd)
        if stat.st_size == 0:
            _reserve_or_empty(fd, size)
        elif stat.st_size != size:
            raise OSError(f"the KV cache segment {path} is {stat.st_size} bytes, this worker's cache needs {size}")
        elif stat.st_blocks * 512 < size:  # sized but not wholly reserved: mapped, its holes would be SIGBUSes
            os.posix_fallocate(fd, 0, size)
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED | _MAP_POPULATE, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    serials_bytes = _serials_bytes(num_blocks)
    serials = np.frombuffer(mapping, dtype=SERIAL_DTYPE, count=num_blocks)
    pool = torch.frombuffer(mapping, dtype=dtype, offset=serials_bytes, count=size // element_size
                            - serials_bytes // element_size)
    pool = pool.view(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    return KVSegment(path, serials, [(pool[layer, 0], pool[layer, 1]) for layer in range(num_layers)], mapping)
