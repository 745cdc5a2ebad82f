"""MemoryDebug: GET /debug/memory, a snapshot of what holds memory, behind --debug-memory (off by default).

Owns tracemalloc in the frontend (started with the flag: it costs every
allocation some time and memory, which is why it is off by default) and the
snapshot: the frontend's RSS and its top allocation sites, the worker's
latest memory split (from its stats). The worker's own detail (torch's
memory statistics) goes to the server's log: the snapshot sends the worker
SIGUSR2, which a worker started under --debug-memory answers by logging them
(gpu_worker/process/memory_report.py); the EngineClient starts every worker
so when the server runs with the flag (WorkerArgs.debug_memory in
shared/worker_launch.py). Must not know HTTP: the router serves the dict.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tracemalloc

from server.worker.engine_client import EngineClient
from shared.process_memory import resident_bytes
from shared.protocol import EngineStats

NUM_TOP_SITES = 25


class MemoryDebug:
    def __init__(self, engine_client: EngineClient) -> None:
        self.engine_client = engine_client

    @staticmethod
    def enable() -> None:
        """Start tracemalloc here (the workers hear of --debug-memory on their command line)."""
        tracemalloc.start()

    def snapshot(self) -> dict:
        current, peak = tracemalloc.get_traced_memory()
        sites = tracemalloc.take_snapshot().statistics("lineno")[:NUM_TOP_SITES]
        stats, pid = self.engine_client.totals.stats, self.engine_client.worker_pid
        worker_signalled = False
        if pid is not None and self.engine_client.is_ready:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR2)
                worker_signalled = True
        return {
            "frontend": {"rss_bytes": resident_bytes(), "traced_bytes": current, "traced_peak_bytes": peak,
                         "requests_in_flight": len(self.engine_client.in_flight),
                         "top_sites": [{"site": str(stat.traceback[0]), "bytes": stat.size, "count": stat.count}
                                       for stat in sites]},
            "worker": {"pid": pid, **{name: getattr(stats, name) for name in EngineStats.MEMORY},
                       "torch_memory_stats": "in the server's log" if worker_signalled else "no worker is ready"},
        }
