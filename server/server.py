"""Server: the frontend's lifecycle — load the tokenizer, listen, start the worker, serve, shut down.

Owns: the order of start-up and shutdown, the signals (SIGINT, SIGTERM), the
runtime directory, and the exit status.
Must not know: routes or payloads (App), HTTP framing (http.py), the wire
protocol (EngineClient).
How: the tokenizer and chat template load first (a bad checkpoint fails
before anything listens). Then HTTP listens at once, so probes see /health
503 while the model loads, and the worker starts; on its Ready the
generation endpoints open. The server runs until a signal (exit 0) or until
the worker exits: nothing restarts it yet, so the server exits 1 and lets
systemd or Kubernetes start a fresh one. Shutdown: stop listening, let the
responses in progress finish (up to shutdown_timeout), stop the worker,
remove the runtime directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from dataclasses import dataclass, field
from pathlib import Path

from server.app import App, ModelCard
from server.chat_template import ChatTemplate, load_chat_template
from server.engine_client import EngineClient
from server.http import HttpLimits, HttpServer, serve
from server.metrics import Metrics
from server.openai_api import OpenAIHandlers
from server.runtime_dir import RuntimeDir
from server.tokenizer import Tokenizer
from server.worker_process import WorkerStartError
from shared.config import EngineConfig

logger = logging.getLogger("pagedserve.server")

EXIT_OK = 0
EXIT_FAILED = 1


@dataclass(slots=True)
class ServerConfig:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # default: the --model path as given
    api_key: str | None = None
    chat_template: Path | None = None  # overrides the checkpoint's
    max_waiting_requests: int = 1024
    runtime_dir: Path | None = None
    http_limits: HttpLimits = field(default_factory=HttpLimits)
    shutdown_timeout: float = 20.0  # how long responses in progress may take to finish on SIGTERM

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port!r}")
        if self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {self.max_waiting_requests!r}")
        if not self.shutdown_timeout > 0:
            raise ValueError(f"shutdown_timeout must be > 0, got {self.shutdown_timeout!r}")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.model


class Server:
    def __init__(self, config: ServerConfig):
        self.config = config
        self._stop = asyncio.Event()
        self._http: HttpServer | None = None

    async def run(self) -> int:
        """Serve until SIGINT/SIGTERM (returns 0) or a failure (logged; returns 1)."""
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self._on_signal, signum)
        try:
            tokenizer = Tokenizer.from_dir(self.config.engine.model)
            chat_template = load_chat_template(self.config.engine.model, tokenizer.chat_template,
                                               self.config.chat_template)
            with RuntimeDir.create(self.config.runtime_dir) as runtime_dir:
                return await self._serve(runtime_dir.path, tokenizer, chat_template)
        except (OSError, ValueError) as exc:  # no tokenizer, bad template file, port taken, bad runtime dir
            logger.error("cannot start: %s", exc)
            return EXIT_FAILED
        finally:
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(signum)

    def _on_signal(self, signum: int) -> None:
        if self._stop.is_set() and self._http is not None:
            logger.warning("%s again: dropping open connections now", signal.Signals(signum).name)
            self._http.abort()
            return
        logger.info("%s: shutting down", signal.Signals(signum).name)
        self._stop.set()

    async def _serve(self, runtime_dir: Path, tokenizer: Tokenizer, chat_template: ChatTemplate | None) -> int:
        config = self.config
        engine_client = EngineClient(config.engine, runtime_dir)
        metrics = Metrics(engine_client, config.model_name)
        app = App(engine_client, tokenizer, ModelCard(config.model_name, config.engine.model), metrics,
                  max_waiting_requests=config.max_waiting_requests, api_key=config.api_key,
                  chat_template=chat_template)
        try:
            self._http = await serve(app, config.host, config.port, config.http_limits)
            logger.info("listening on http://%s:%d (model %r; /health is 503 until the engine is ready)",
                        config.host, self._http.port, config.model_name)
            return await self._run_engine(engine_client, app, tokenizer, chat_template)
        finally:
            await self._shut_down(engine_client)

    async def _run_engine(self, engine_client: EngineClient, app: App, tokenizer: Tokenizer,
                          chat_template: ChatTemplate | None) -> int:
        """Start the worker, open generation on its Ready, then wait for a signal or the worker's exit."""
        start = asyncio.create_task(engine_client.start())
        if not await _first_of(start, self._stop):
            return EXIT_OK
        try:
            info = start.result()
        except WorkerStartError as exc:
            logger.error("%s", exc)
            return EXIT_FAILED
        app.model.max_model_len = info.max_model_len
        app.generation = OpenAIHandlers(engine_client, tokenizer, self.config.model_name, info.max_model_len,
                                        chat_template, on_request_done=app.metrics.on_request_done)
        logger.info("engine ready: %s on %s (%s), max_model_len %d, %d KV blocks of %d tokens; serving",
                    self.config.engine.model, info.device, info.dtype, info.max_model_len, info.num_kv_blocks,
                    info.block_size)
        exited = asyncio.create_task(engine_client.worker_exited.wait())
        if not await _first_of(exited, self._stop):
            return EXIT_OK
        logger.error("the engine worker is gone and this server does not restart it; exiting")
        return EXIT_FAILED

    async def _shut_down(self, engine_client: EngineClient) -> None:
        if self._http is not None:
            self._http.close()
            if not await self._http.wait_idle(self.config.shutdown_timeout):
                logger.warning("responses still open after %g s; dropping them", self.config.shutdown_timeout)
                self._http.abort()
        if not engine_client.is_ready:
            engine_client.kill_worker()  # one still loading reads no Shutdown, and has nothing to lose
        await engine_client.close()
        logger.info("stopped")


async def _first_of(task: asyncio.Task, stop: asyncio.Event) -> bool:
    """Wait for `task` or `stop`; True if the task finished first. A task still running is cancelled."""
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if task.done():
        return True
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, WorkerStartError):
        await task
    return False
