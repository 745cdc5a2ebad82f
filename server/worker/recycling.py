"""RecyclePolicy: when a healthy worker is replaced anyway, before it hurts anyone.

Owns the limits (--worker-memory-limit on the worker's unexplained memory,
--worker-cuda-memory-limit on the device memory torch's CUDA allocator has
reserved, --worker-max-requests on the requests it finished, as gunicorn's
and uWSGI's max-requests) and the judgement `due`, with the figures that
triggered it for the log. Must not know processes or the supervisor's states.
How: the Supervisor asks `due` at each tick of its watch, from the worker's
latest stats (their memory split, gpu_worker/process/memory_report.py) and the
EngineClient's count of requests the worker finished; a recycle then goes
through the supervisor's replacement path, off the restart budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.protocol import EngineStats

CAUSE_MEMORY, CAUSE_MAX_REQUESTS = "memory", "max_requests"
RECYCLE_CAUSES = (CAUSE_MEMORY, CAUSE_MAX_REQUESTS)
_MIB = 2**20


@dataclass(frozen=True, slots=True)
class RecyclePolicy:
    memory_limit: int | None = None  # bytes of unexplained worker memory; None: no limit
    max_requests: int | None = None  # requests a worker finishes before it is replaced; None: no limit
    cuda_memory_limit: int | None = None  # bytes of CUDA memory reserved by torch's allocator; None: no limit

    def __post_init__(self) -> None:
        for name in ("memory_limit", "cuda_memory_limit"):
            limit = getattr(self, name)
            if limit is not None and limit < 1:
                raise ValueError(f"{name} must be >= 1 byte, or None for no limit, got {limit!r}")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, or None for no limit, got {self.max_requests!r}")

    @property
    def is_on(self) -> bool:
        return any(limit is not None for limit in (self.memory_limit, self.cuda_memory_limit, self.max_requests))

    def due(self, stats: EngineStats, num_requests_finished: int) -> tuple[str, str] | None:
        """(cause, the figures that triggered it) when the worker should be replaced now; else None."""
        if self.memory_limit is not None and stats.unexplained_bytes > self.memory_limit:
            return CAUSE_MEMORY, (f"its unexplained memory is {stats.unexplained_bytes / _MIB:.0f} MiB, over the limit "
                                  f"of {self.memory_limit / _MIB:.0f} MiB (RSS {stats.rss_bytes / _MIB:.0f} MiB: "
                                  f"weights {stats.weights_bytes / _MIB:.0f}, KV cache {stats.kv_cache_bytes / _MIB:.0f}"
                                  f", malloc's cache {stats.allocator_cache_bytes / _MIB:.0f})")
        if self.cuda_memory_limit is not None and stats.cuda_reserved_bytes > self.cuda_memory_limit:
            return CAUSE_MEMORY, (f"the CUDA memory reserved by torch's allocator is "
                                  f"{stats.cuda_reserved_bytes / _MIB:.0f} MiB, over the limit of "
                                  f"{self.cuda_memory_limit / _MIB:.0f} MiB (allocated "
                                  f"{stats.cuda_allocated_bytes / _MIB:.0f} MiB)")
        if self.max_requests is not None and num_requests_finished >= self.max_requests:
            return CAUSE_MAX_REQUESTS, (f"it finished {num_requests_finished} requests (limit "
                                        f"{self.max_requests})")
        return None
