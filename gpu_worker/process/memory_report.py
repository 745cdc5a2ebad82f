"""MemoryReport: what the worker's resident memory is made of, as far as the worker can tell.

Owns the split of the process's RSS into what is explained and the rest:
the weights (their bytes, when they live in host memory), the KV cache in
host memory (all of it is resident: a private cache is zero-filled when
allocated, and a worker maps the shared segment with MAP_POPULATE), and the C
allocator's cache (what glibc's malloc keeps of freed memory: torch's CPU
allocator caches nothing itself, and calls malloc). The unexplained part,
RSS minus those, holds the interpreter, the libraries' code and data, and
whatever grows by mistake: it is what --worker-memory-limit watches.
On CUDA the device memory is reported beside it, not in it: torch's
allocated and reserved bytes (reserved minus allocated is its cache).
Must not know: the wire, the frontend.
How: a sample reads /proc/self/statm and asks glibc (mallinfo2); the worker
takes one at most every SAMPLE_INTERVAL_S, so a busy loop pays for it rarely.
Under --debug-memory (the server's flag, on the worker's command line:
WorkerArgs.debug_memory, shared/worker_launch.py) the worker answers
SIGUSR2 by logging a fresh sample, the bytes malloc has handed out (the C
and C++ heaps: where growth that is not the interpreter's shows first, as
oneDNN's kernel caches did), and torch's memory statistics
(CUDA's allocator; the CPU has none to report).
"""

from __future__ import annotations

import ctypes
import logging
import signal
import time
from dataclasses import dataclass

import torch

from shared.process_memory import resident_bytes

SAMPLE_INTERVAL_S = 0.1
_MIB = 2**20

logger = logging.getLogger("pagedserve.worker.memory")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo2():
    """glibc's mallinfo2 (2.33 and later), or None where there is none."""
    try:
        function = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    function.restype = _MallInfo2
    return function


_MALLINFO2 = _mallinfo2()


def malloc_in_use_bytes() -> int | None:
    """Bytes glibc's malloc has handed out and not had back (its heaps' and its mmap'ed blocks'); None without glibc."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return int(info.uordblks + info.hblkhd)


def malloc_free_bytes() -> int:
    """Bytes glibc's malloc holds free in its heaps (kept for reuse, not returned to the system); 0 without glibc."""
    return 0 if _MALLINFO2 is None else int(_MALLINFO2().fordblks)


@dataclass(frozen=True, slots=True)
class MemorySample:
    rss_bytes: int
    weights_bytes: int  # of weights in host memory; 0 when they are on the accelerator
    kv_cache_bytes: int  # a KV cache in host memory, all resident
    allocator_cache_bytes: int  # freed memory malloc keeps
    cuda_allocated_bytes: int = 0
    cuda_reserved_bytes: int = 0

    @property
    def unexplained_bytes(self) -> int:
        return max(0, self.rss_bytes - self.weights_bytes - self.kv_cache_bytes - self.allocator_cache_bytes)


class MemoryReport:
    """Samples the worker's memory; `sample()` returns the latest, refreshed at most every SAMPLE_INTERVAL_S."""

    def __init__(self, engine) -> None:
        self.engine = engine
        runner = engine.runner
        on_host = runner.device.type == "cpu"
        self.weights_bytes = sum(t.nbytes for t in (*runner.model.parameters(), *runner.model.buffers())) \
            if on_host else 0
        self.is_cuda = runner.device.type == "cuda"
        self._latest: MemorySample | None = None
        self._latest_time = 0.0

    def sample(self) -> MemorySample:
        now = time.monotonic()
        if self._latest is None or now - self._latest_time >= SAMPLE_INTERVAL_S:
            self._latest, self._latest_time = self._take(), now
        return self._latest

    def _take(self) -> MemorySample:
        cuda = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved()) if self.is_cuda else (0, 0)
        return MemorySample(resident_bytes() or 0, self.weights_bytes, self._kv_cache_bytes(),
                            malloc_free_bytes(), *cuda)

    def _kv_cache_bytes(self) -> int:
        runner = self.engine.runner
        if runner.device.type != "cpu":
            return 0
        return sum(k_cache.nbytes + v_cache.nbytes for k_cache, v_cache in runner.kv_caches)

    def torch_memory_stats(self) -> dict:
        """torch's allocator statistics, for a debug snapshot: CUDA's when on CUDA, else an empty dict."""
        return dict(torch.cuda.memory_stats()) if self.is_cuda else {}

    def log_snapshot(self, *_signal_args: object) -> None:
        """A fresh sample and torch's memory statistics, in the log (the SIGUSR2 handler under --debug-memory)."""
        sample = self._take()
        in_use = malloc_in_use_bytes()
        logger.warning("memory snapshot: RSS %.1f MiB = weights %.1f + KV cache %.1f + malloc's cache %.1f + "
                       "unexplained %.1f; malloc's bytes in use %s; CUDA allocated %.1f MiB, reserved %.1f MiB; "
                       "torch memory stats: %s",
                       sample.rss_bytes / _MIB, sample.weights_bytes / _MIB, sample.kv_cache_bytes / _MIB,
                       sample.allocator_cache_bytes / _MIB, sample.unexplained_bytes / _MIB,
                       "unknown" if in_use is None else f"{in_use / _MIB:.1f} MiB",
                       sample.cuda_allocated_bytes / _MIB, sample.cuda_reserved_bytes / _MIB,
                       self.torch_memory_stats() or "none on the CPU")

    def install_debug_signal(self, debug_memory: bool) -> bool:
        """Log a snapshot on SIGUSR2 when the worker was started with --debug-memory (`debug_memory`, from
        its WorkerArgs); whether it was."""
        if not debug_memory:
            return False
        signal.signal(signal.SIGUSR2, self.log_snapshot)
        return True
