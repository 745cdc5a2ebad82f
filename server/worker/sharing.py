"""The defaults of --standby-workers and --shared-kv-cache, from what the frontend can see without torch: the
device asked for, whether an NVIDIA device node exists, /dev/shm, and the memory available."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from server.worker.kv_segment import SEGMENT_DIR

_NVIDIA_DEVICE = "/dev/nvidiactl"
_STANDBY_MARGIN_BYTES = 512 << 20  # a worker's interpreter, torch and allocator caches beside its weights


def resolve_worker_sharing(device: str, model_dir: str, standby_workers: int | None, shared_kv_cache: bool | None,
                           available: int | None) -> tuple[int, bool, str]:
    """The standby count and whether the KV cache is shared, the defaults (None) made concrete; and why, for the
    log. Both default to on where the worker will run on the CPU (device cpu, or auto on a machine with no NVIDIA
    device), the standby only when the memory available holds a second worker (twice the checkpoint's weights,
    packed copy and all, and a margin). `available`: bytes of memory available (available_memory()), None unknown."""
    on_cpu = device == "cpu" or (device == "auto" and not os.path.exists(_NVIDIA_DEVICE))
    shared = on_cpu and SEGMENT_DIR.is_dir() if shared_kv_cache is None else shared_kv_cache
    if standby_workers is not None:
        return standby_workers, shared, "as asked"
    if not on_cpu:
        return 0, shared, "off by default on CUDA (--standby-workers 1 to have one)"
    needed = 2 * _checkpoint_bytes(Path(model_dir)) + _STANDBY_MARGIN_BYTES
    if available is not None and available < needed:
        return 0, shared, f"off: {available >> 20} MiB of memory available, a standby needs about {needed >> 20} MiB"
    return 1, shared, "on by default on the CPU"


def available_memory() -> int | None:
    """Bytes this process could still allocate: MemAvailable, capped by the cgroup's memory.max; None unknown."""
    available = None
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    with contextlib.suppress(OSError, ValueError):
        limit, used = (Path("/sys/fs/cgroup", name).read_text().strip() for name in ("memory.max", "memory.current"))
        if limit != "max":
            room = int(limit) - int(used)
            available = room if available is None else min(available, room)
    return available


def _checkpoint_bytes(model_dir: Path) -> int:
    return sum(path.stat().st_size for path in model_dir.glob("*.safetensors"))
