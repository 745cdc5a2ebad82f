"""WorkerControl: the endpoints that act on the engine worker instead of generating: profiling, the prefix cache.

Owns: POST /start_profile and /stop_profile (vLLM's; 409 when the profile's
state does not allow it, 504 when the worker does not answer) and POST
/reset_prefix_cache (200 with an empty body once the worker has emptied its
cache, as vLLM's; 503 with Retry-After while no worker is ready or when it
exits first).
Must not know: routes and the API key (the router's), HTTP framing, how the
worker profiles or resets (EngineClient's messages and the worker's).
"""

from __future__ import annotations

import logging
from pathlib import Path

import orjson

from server.generation.service import not_ready
from server.http.errors import RETRY_AFTER_S, ApiError
from server.http.server import HttpRequest, Responder
from server.worker.engine_client import EngineClient
from server.worker.prefix_cache_resets import ResetLost, ResetTimeout
from server.worker.profiling import ProfileConflict, ProfileTimeout
from shared.protocol import ProfileResult

NUM_LOGGED_OPERATORS = 15

logger = logging.getLogger("pagedserve.app")


class WorkerControl:
    def __init__(self, engine_client: EngineClient, profile_dir: Path | None):
        """profile_dir: where /stop_profile has the worker write its profiles; None: the router offers no profiling."""
        self.engine_client = engine_client
        self.profile_dir = profile_dir.absolute() if profile_dir is not None else None  # the worker's cwd may differ

    async def reset_prefix_cache(self, request: HttpRequest, responder: Responder) -> None:
        """Empty the worker's prefix cache; the requests running keep their blocks."""
        if not self.engine_client.is_ready:
            raise not_ready()
        try:
            reset = await self.engine_client.control.reset_prefix_cache()
        except ResetLost as exc:
            raise ApiError(503, f"{exc}; retry shortly", headers={"Retry-After": RETRY_AFTER_S}) from None
        except ResetTimeout as exc:
            raise ApiError(504, str(exc)) from None
        logger.info("prefix cache reset: %d cached blocks freed", reset.num_freed_blocks)
        await responder.send(200, b"", content_type=None)

    async def start_profile(self, request: HttpRequest, responder: Responder) -> None:
        if not self.engine_client.is_ready:
            raise not_ready()
        try:
            self.engine_client.control.start_profile()
        except ProfileConflict as exc:
            raise ApiError(409, str(exc)) from None
        await responder.send(200, orjson.dumps({"status": "profiling"}))

    async def stop_profile(self, request: HttpRequest, responder: Responder) -> None:
        if self.profile_dir is None:
            raise RuntimeError("expected a profile directory for /stop_profile, got none")
        try:
            result = await self.engine_client.control.stop_profile(str(self.profile_dir))
        except ProfileConflict as exc:
            raise ApiError(409, str(exc)) from None
        except ProfileTimeout as exc:
            raise ApiError(504, str(exc)) from None
        if result.error is not None:
            raise ApiError(500, f"the engine worker could not write its profile: {result.error}")
        logger.info("profile of %d engine steps in %.2f s: %s; top operators by self CPU time:\n%s", result.num_steps,
                    result.seconds, result.table_path, _format_operators(result))
        await responder.send(200, orjson.dumps({"status": "stopped", "table": result.table_path,
                                                "trace": result.trace_path, "steps": result.num_steps,
                                                "seconds": round(result.seconds, 3), "table_text": result.table}))


def _format_operators(result: ProfileResult) -> str:
    return "\n".join(f"  {op.name[:50]:<50} {op.num_calls:>8} calls {op.self_cpu_ms:>10.1f} ms"
                     for op in result.top_operators[:NUM_LOGGED_OPERATORS])
