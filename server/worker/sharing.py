"""The device the workers run on (--device auto made concrete, once, for every worker), and the defaults of
--standby-workers and --shared-kv-cache that follow from it, /dev/shm and the memory available; all of it
without importing torch."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path

from server.worker.kv_segment import SEGMENT_DIR
from shared.config import RESOLVED_DEVICES
from shared.worker_launch import device_probe_command

logger = logging.getLogger("pagedserve.sharing")

_NVIDIA_DEVICE = "/dev/nvidiactl"
_STANDBY_MARGIN_BYTES = 512 << 20  # a worker's interpreter, torch and allocator caches beside its weights


async def resolve_device(device: str, timeout: float) -> str:
    """The device every worker runs on, "cpu" or "cuda": `device` (EngineConfig.device) with auto decided here,
    once, before the first worker starts, and handed to each in its EngineConfig (shared/worker_launch.py), so
    that the defaults resolve_worker_sharing draws from the device and the worker's own choice cannot disagree.

    auto means what the worker's select_device (gpu_worker/runner/model_runner.py) decides: cuda when torch sees
    a GPU. The frontend never imports torch, so it cannot ask torch itself, and an NVIDIA device node alone is no
    answer: a CPU build of torch, an empty CUDA_VISIBLE_DEVICES or a driver torch cannot use leave the worker on
    the CPU on a GPU machine. So: without /dev/nvidiactl torch can see no NVIDIA GPU, and the answer is cpu at no
    cost (every CPU machine). With it, select_device itself answers, run in a child process with this interpreter
    and this environment, as a worker would be (device_probe_command): one import of torch, a few seconds, once
    per server start, on GPU machines only, before anything listens. Should that child fail or take more than
    `timeout` seconds, the device node decides (cuda), with a warning: a torch that cannot be imported fails the
    worker too, which then says why."""
    if device != "auto":
        return device
    if not os.path.exists(_NVIDIA_DEVICE):
        logger.info("device auto: cpu (no NVIDIA GPU: no %s)", _NVIDIA_DEVICE)
        return "cpu"
    resolved, problem = await _probe_device(timeout)
    if resolved is None:
        logger.warning("device auto: cuda, as %s exists; could not ask torch: %s", _NVIDIA_DEVICE, problem)
        return "cuda"
    logger.info("device auto: %s (as torch sees it)", resolved)
    return resolved


async def _probe_device(timeout: float) -> tuple[str | None, str]:
    """What device_probe_command prints, "cpu" or "cuda"; else None and what went wrong."""
    try:
        process = await asyncio.create_subprocess_exec(*device_probe_command(), stdin=asyncio.subprocess.DEVNULL,
                                                       stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    except OSError as exc:
        return None, str(exc)
    try:
        stdout, stderr = await asyncio.wait_for(process.communicate(), timeout)
    except asyncio.TimeoutError:
        return None, f"no answer within {timeout:g} s"
    finally:
        if process.returncode is None:  # timed out, or the server is stopping: no child is left behind
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
    answer = stdout.decode(errors="replace").strip().splitlines()[-1:]
    if process.returncode == 0 and answer and answer[0] in RESOLVED_DEVICES:
        return answer[0], ""
    error = stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit status {process.returncode}"]
    return None, error[0]


def resolve_worker_sharing(device: str, model_dir: str, standby_workers: int | None, shared_kv_cache: bool | None,
                           available: int | None) -> tuple[int, bool, str]:
    """The standby count and whether the KV cache is shared, the defaults (None) made concrete; and why, for the
    log. Both default to on where the worker runs on the CPU, the standby only when the memory available holds a
    second worker (twice the checkpoint's weights, packed copy and all, and a margin). `device`: the resolved one,
    cpu or cuda (resolve_device); `available`: bytes of memory available (available_memory()), None unknown."""
    if device not in RESOLVED_DEVICES:
        raise ValueError(f"expected the device resolved to one of {', '.join(RESOLVED_DEVICES)} (resolve_device), "
                         f"got {device!r}")
    on_cpu = device == "cpu"
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
