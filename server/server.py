"""Server: the frontend's lifecycle — load the tokenizer, listen, supervise the worker, serve, shut down.

Owns: the order of start-up and shutdown, the signals (SIGINT, SIGTERM), the
runtime directory, the open-files limit (the soft one raised to the hard one
at start-up, which also sizes the HTTP connection cap), the systemd
notifications and the exit status.
Must not know: routes or payloads (App), HTTP framing (server/http/), the wire
protocol (EngineClient), how the restart policy is applied (Supervisor).
How the parts are wired: the EngineClient (supervised, with the policy's
start timeout), the Supervisor (with the RestartPolicy), the Metrics, the
GenerationService (the Supervisor's readiness, the Metrics' on_request_done,
and the RequestTracer's after it with --otlp-traces-endpoint) and the App
(the service) are each built once, with what they need, before anything
listens; none of them is edited afterwards. Without that flag OpenTelemetry
is never imported.
How: the tokenizer, chat template and the requests' generation defaults
(generation_config.json, logged with where they came from) load first (a
bad checkpoint fails before anything listens). --device auto is then made
cpu or cuda, once for every worker, and the standby and shared-KV defaults
with it (server/worker/sharing.py). Then HTTP listens at once, so probes see /health
503 while the model loads, and the Supervisor starts the worker; on the
first READY the generation endpoints open (and systemd hears READY=1): the
GenerationService reads the worker's limits from its Ready. The
Supervisor restarts a worker that hangs or dies, re-sending the requests in
flight; while no worker is ready, /health and new generation requests get
503 with Retry-After. The server runs until a signal (exit 0) or until the
Supervisor gives up (exit 1: systemd or Kubernetes start a fresh one).
The conversation store of the Responses API opens before anything listens
too (a bad or unreachable store is a start-up error) and closes last.
Shutdown: STOPPING=1, drain (still listening, new connections get 503 with
Retry-After and /health with them), let the responses in progress finish
(up to shutdown_timeout), fail the rest with a clear error, stop listening
(and remove the --uds socket file), stop the worker, remove the runtime directory and the shared KV cache's
segment (server/worker/kv_segment.py), which every path out removes. The
tracer, when there is one, sends its last spans after that, on every path out.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from server.api.cors import Cors, CorsPolicy
from server.api.memory_debug import MemoryDebug
from server.api.root_path import RootPathHandler, check_root_path
from server.api.router import DEFAULT_MAX_SEQS_PER_REQUEST, App, ModelCard
from server.generation.chat_template import ChatTemplate, load_chat_template
from server.generation.generation_defaults import (
    FROM_CHECKPOINT,
    GenerationDefaults,
    check_override,
    generation_config_path,
    load_generation_defaults,
)
from server.generation.request import DEFAULT_MAX_LOGPROBS, DEFAULT_MAX_RESPONSE_BYTES
from server.generation.service import GenerationService, OnRequestDone
from server.generation.tokenizer import Tokenizer
from server.generation.tool_parsers import get_tool_parser
from server.http.server import DEFAULT_HOST, DEFAULT_PORT, HttpLimits, HttpServer, serve
from server.http.sockets import listening_unix_socket, raise_open_files_limit
from server.http.tls import TlsConfig
from server.metrics import Metrics
from server.sd_notify import SystemdNotifier, supervisor_status_hook
from server.state_store.store import StateStore, StateStoreError, default_store_url, opened_state_store, parse_store_url
from server.worker.engine_client import EngineClient
from server.worker.kv_segment import KVSegmentFile
from server.worker.recycling import RecyclePolicy
from server.worker.request_state import RequestState
from server.worker.restart_policy import RestartPolicy
from server.worker.runtime_dir import RuntimeDir
from server.worker.sharing import available_memory, resolve_device, resolve_worker_sharing
from server.worker.supervisor import Supervisor, SupervisorGaveUp, SupervisorState
from shared.config import EngineConfig

if TYPE_CHECKING:
    from server.tracing import RequestTracer  # imported only with --otlp-traces-endpoint

logger = logging.getLogger("pagedserve.server")

EXIT_OK = 0
EXIT_FAILED = 1
ABORT_GRACE_S = 1.0  # after the drain timed out: time for the failed responses to reach their clients


@dataclass(slots=True)
class ServerConfig:
    engine: EngineConfig
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    served_model_names: tuple[str, ...] = ()  # the first is what responses report; default: the --model path
    api_keys: tuple[str, ...] = ()  # a request's Bearer token must be one of them; none: /v1/* is open
    chat_template: str | None = None  # the template's text (--chat-template, read); overrides the checkpoint's
    trust_request_chat_template: bool = False  # render with a request's own chat_template; else it is a 400
    tool_call_parser: str | None = None  # serve tool_choice "auto", reading calls in this format; None: a 400
    max_waiting_requests: int = 1024
    max_num_seqs_per_request: int = DEFAULT_MAX_SEQS_PER_REQUEST  # n x prompts of one request
    runtime_dir: Path | None = None
    http_limits: HttpLimits = field(default_factory=HttpLimits)
    shutdown_timeout: float = 20.0  # how long responses in progress may take to finish on SIGTERM
    restart_policy: RestartPolicy = field(default_factory=RestartPolicy)
    recycle_policy: RecyclePolicy = field(default_factory=RecyclePolicy)  # when a healthy worker is replaced anyway
    state_store: str = field(default_factory=default_store_url)  # the Responses API's: sqlite:///... or redis://...
    debug_memory: bool = False  # GET /debug/memory, tracemalloc in the frontend, SIGUSR2 snapshots in the worker
    profile_dir: Path | None = None  # where /stop_profile writes the worker's profiles; None: no profiling endpoints
    cors: CorsPolicy | None = None  # which browser origins may call the API; None: CORS off
    standby_workers: int | None = None  # 0 or 1; None: 1 on the CPU when memory allows (resolve_worker_sharing)
    shared_kv_cache: bool | None = None  # the KV cache in shared memory; None: on the CPU
    max_logprobs: int | None = DEFAULT_MAX_LOGPROBS  # alternatives per token a request may ask for; None: the vocabulary
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES  # the largest whole response a request may ask for
    generation_config: str = FROM_CHECKPOINT  # where request defaults come from: auto, vllm (none) or a directory
    override_generation_config: dict = field(default_factory=dict)  # merged over them (parse_override's)
    tls: TlsConfig | None = None  # serve HTTPS with this certificate; None: plain HTTP
    root_path: str | None = None  # the prefix a path-routing proxy may leave on request paths
    uds: Path | None = None  # listen on this Unix socket instead of host:port (removed on exit)
    otlp_traces_endpoint: str | None = None  # send one OpenTelemetry span per request there; None: no tracing

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port!r}")
        if self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {self.max_waiting_requests!r}")
        if self.max_num_seqs_per_request < 1:
            raise ValueError(f"max_num_seqs_per_request must be >= 1, got {self.max_num_seqs_per_request!r}")
        if not self.shutdown_timeout > 0:
            raise ValueError(f"shutdown_timeout must be > 0 seconds, got {self.shutdown_timeout!r}")
        if self.standby_workers not in (None, 0, 1):
            raise ValueError(f"standby_workers must be 0 or 1, got {self.standby_workers!r}")
        if not all(self.served_model_names):
            raise ValueError(f"served_model_names must be non-empty names, got {self.served_model_names!r}")
        if not all(self.api_keys):
            raise ValueError("api_keys must be non-empty keys, got an empty one")
        if self.root_path is not None:
            check_root_path(self.root_path)
        parse_store_url(self.state_store)
        check_override(self.override_generation_config)
        if self.max_response_bytes < 1:
            raise ValueError(f"max_response_bytes must be positive, got {self.max_response_bytes!r}")
        if self.max_logprobs is not None and self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0 or None (the vocabulary's size), got {self.max_logprobs!r}")

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name requests may give the model; /v1/models lists each."""
        return self.served_model_names or (self.engine.model,)

    @property
    def model_name(self) -> str:
        """The name responses and metrics report."""
        return self.model_names[0]


class Server:
    def __init__(self, config: ServerConfig):
        self.config = config
        self._stop = asyncio.Event()
        self._http: HttpServer | None = None
        self._generation: GenerationService | None = None
        self._tracer: RequestTracer | None = None
        self._notifier = SystemdNotifier.from_environ()
        self._open_files = (0, 0)  # the soft RLIMIT_NOFILE before and after start-up raised it

    async def run(self) -> int:
        """Serve until SIGINT/SIGTERM (returns 0) or a failure (logged; returns 1)."""
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self._on_signal, signum)
        self._open_files = raise_open_files_limit()
        try:
            self._tracer = request_tracer(self.config)
            tokenizer = Tokenizer.from_dir(self.config.engine.tokenizer_dir)
            chat_template = load_chat_template(self.config.engine.tokenizer_dir, tokenizer.chat_template,
                                               self.config.chat_template)
            defaults = self._generation_defaults()
            store_url = parse_store_url(self.config.state_store)
            async with opened_state_store(store_url) as state_store:
                logger.info("conversation state (the Responses API) in %s", store_url)
                await self._resolve_device()
                standby, shared = self._worker_sharing()
                with (RuntimeDir.create(self.config.runtime_dir) as runtime_dir,
                      self._kv_segment() if shared else contextlib.nullcontext() as segment):
                    return await self._serve(runtime_dir.path, segment, standby, tokenizer, chat_template,
                                             defaults, state_store)
        except (OSError, ValueError, StateStoreError) as exc:  # no tokenizer, bad template or generation config,
            # port taken, bad dir or store
            logger.error("cannot start: %s", exc)
            return EXIT_FAILED
        finally:
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(signum)
            self._notifier.close()
            if self._tracer is not None:
                self._tracer.shutdown()  # the spans not sent yet

    def _on_signal(self, signum: int) -> None:
        if self._stop.is_set() and self._http is not None:
            logger.warning("%s again: dropping open connections now", signal.Signals(signum).name)
            self._http.abort()
            return
        logger.info("%s: shutting down", signal.Signals(signum).name)
        self._notifier.stopping(f"{signal.Signals(signum).name}: draining")
        self._stop.set()

    def _supervisor(self, engine_client: EngineClient) -> Supervisor:
        policy = self.config.restart_policy
        status_hook = supervisor_status_hook(self._notifier, start_timeout=policy.start_timeout)
        opened = False

        def on_state_change(old: SupervisorState, new: SupervisorState, detail: str) -> None:
            nonlocal opened
            status_hook(old, new, detail)
            if new is SupervisorState.READY and not opened:
                opened = True
                info = engine_client.worker_info
                if info is None:  # a READY supervisor's worker has sent its Ready
                    raise RuntimeError("expected the ready engine worker's Ready, got none")
                logger.info("engine ready: %s on %s (%s), max_model_len %d, %d KV blocks of %d tokens (%s); "
                            "serving", self.config.engine.model, info.device, info.dtype, info.max_model_len,
                            info.num_kv_blocks, info.block_size, "shared" if info.kv_shared else "private")

        return Supervisor(engine_client, policy, on_state_change=on_state_change, recycle=self.config.recycle_policy)

    def _generation_defaults(self) -> GenerationDefaults:
        """The request defaults (--generation-config, --override-generation-config), logged with where each came
        from."""
        config = self.config
        path = generation_config_path(config.generation_config, config.engine.model)
        defaults = load_generation_defaults(path, config.override_generation_config)
        if path is None or not path.is_file():
            logger.info("default sampling parameters: the neutral ones (%s)",
                        "--generation-config vllm" if path is None else f"no {path}")
        else:
            logger.info("default sampling parameters have been overridden by the model's Hugging Face generation "
                        "config %s (a request's own values win; --generation-config vllm ignores the file)", path)
        if config.override_generation_config:
            logger.info("--override-generation-config %s merged over them",
                        json.dumps(config.override_generation_config))
        logger.info("default sampling parameters in use: %s", defaults.describe())
        return defaults

    async def _resolve_device(self) -> None:
        """--device auto made cpu or cuda, once (resolve_device): what the sharing defaults and every worker see."""
        engine = self.config.engine
        device = await resolve_device(engine.device, self.config.restart_policy.start_timeout)
        if device != engine.device:
            self.config = dataclasses.replace(self.config, engine=dataclasses.replace(engine, device=device))

    def _worker_sharing(self) -> tuple[int, bool]:
        """How many standby workers, and whether the KV cache is shared (its file then removed on every way out)."""
        config = self.config
        standby, shared, why = resolve_worker_sharing(config.engine.device, config.engine.model,
                                                      config.standby_workers, config.shared_kv_cache,
                                                      available_memory())
        logger.info("standby engine worker: %s (%s); KV cache %s", "yes" if standby else "none", why,
                    "shared" if shared else "private to each worker")
        return standby, shared

    def _kv_segment(self) -> contextlib.AbstractContextManager[KVSegmentFile | None]:
        """The shared KV cache's file; when it cannot be made and sharing was only the default, a private cache."""
        try:
            return KVSegmentFile.create()
        except OSError as exc:
            if self.config.shared_kv_cache:
                raise
            logger.warning("the KV cache stays private to each worker: cannot create its file in shared memory: %s",
                           exc)
            return contextlib.nullcontext()

    async def _serve(self, runtime_dir: Path, segment: KVSegmentFile | None, num_standby_workers: int,
                     tokenizer: Tokenizer, chat_template: ChatTemplate | None, defaults: GenerationDefaults,
                     state_store: StateStore) -> int:
        config = self.config
        engine_client = EngineClient(config.engine, runtime_dir, supervised=True,
                                     start_timeout=config.restart_policy.start_timeout,
                                     kv_segment=segment and segment.path, num_standby_workers=num_standby_workers,
                                     debug_memory=config.debug_memory)
        supervisor = self._supervisor(engine_client)
        memory_debug = None
        if config.debug_memory:
            MemoryDebug.enable()
            memory_debug = MemoryDebug(engine_client)
        metrics = Metrics(engine_client, config.model_name, supervisor)
        on_request_done: OnRequestDone = metrics.on_request_done
        if self._tracer is not None:
            on_request_done = each_of(metrics.on_request_done, self._tracer.on_request_done)
        generation = GenerationService(engine_client, tokenizer, config.model_name, chat_template,
                                       model_aliases=config.model_names[1:],
                                       is_ready=lambda: supervisor.is_ready, on_request_done=on_request_done,
                                       trust_request_chat_template=config.trust_request_chat_template,
                                       defaults=defaults, max_logprobs=config.max_logprobs,
                                       max_response_bytes=config.max_response_bytes)
        self._generation = generation
        models = tuple(ModelCard(name, config.engine.model) for name in config.model_names)
        app = App(generation, models, metrics.render,
                  max_waiting_requests=config.max_waiting_requests, max_seqs_per_request=config.max_num_seqs_per_request,
                  api_keys=config.api_keys, state_store=state_store, profile_dir=config.profile_dir,
                  tool_call_parser=None if config.tool_call_parser is None else get_tool_parser(config.tool_call_parser),
                  memory_debug=memory_debug)
        watchdog = None
        try:
            ssl_context = config.tls.server_context() if config.tls is not None else None
            handler, check_head = app, app.check_head
            if config.root_path is not None:  # paths lose the prefix before anything reads them
                root_path = RootPathHandler(app, app.check_head, config.root_path)
                handler, check_head = root_path, root_path.check_head
            if config.cors is not None:
                cors = Cors(handler, check_head, config.cors)
                handler, check_head = cors.handler, cors.check_head
            sock = listening_unix_socket(config.uds) if config.uds is not None else None
            self._http = await serve(handler, config.host, config.port, config.http_limits, sock=sock,
                                     check_head=check_head, ssl_context=ssl_context)
            metrics.watch_connections(self._http.held_bytes)
            scheme = "http" if ssl_context is None else "https"
            address = (f"{scheme}://{config.host}:{self._http.port}" if config.uds is None
                       else f"the Unix socket {config.uds} ({scheme})")
            logger.info("listening on %s (model %r; /health is 503 until the engine is ready)", address,
                        config.model_name)
            logger.info("at most %d HTTP connections (open files: soft limit %d, %d before start-up) and %d bytes of "
                        "request bodies buffered", self._http.max_connections, self._open_files[1],
                        self._open_files[0], config.http_limits.max_buffered_body_bytes)
            watchdog = self._notifier.start_watchdog()
            return await self._supervise(supervisor)
        finally:
            if watchdog is not None:
                watchdog.cancel()
            await self._shut_down(supervisor)

    async def _supervise(self, supervisor: Supervisor) -> int:
        """Run the supervisor until a signal (0) or until it gives up or fails (1)."""
        run = asyncio.create_task(supervisor.run(), name="supervisor")
        stopped = asyncio.create_task(self._stop.wait())
        await asyncio.wait({run, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not run.done():
            return EXIT_OK  # a signal; _shut_down stops the supervisor (and with it the run task)
        try:
            run.result()
        except SupervisorGaveUp as exc:
            logger.critical("exiting: %s", exc)
            self._notifier.stopping(f"giving up: {exc}")
            return EXIT_FAILED
        except Exception:
            logger.exception("the supervisor failed; exiting")
            return EXIT_FAILED
        return EXIT_OK

    async def _shut_down(self, supervisor: Supervisor) -> None:
        engine_client = supervisor.engine_client
        if self._http is not None:
            self._http.drain()
            if not await self._http.wait_idle(self.config.shutdown_timeout):
                logger.warning("responses still open after %g s; failing them", self.config.shutdown_timeout)
                engine_client.in_flight.fail_all(f"the server is shutting down and the request did not finish within "
                                       f"{self.config.shutdown_timeout:g} s")
                if not await self._http.wait_idle(ABORT_GRACE_S):
                    self._http.abort()
            self._http.close()
            if self.config.uds is not None:
                self.config.uds.unlink(missing_ok=True)
        if self._generation is not None:
            self._generation.close()  # prompts queued for tokenizing have no client left to answer
        if not engine_client.is_ready:
            engine_client.kill_worker()  # one still loading reads no Shutdown, and has nothing to lose
        await supervisor.stop()  # also closes the engine client: Shutdown, reap, socket files removed
        logger.info("stopped")


def request_tracer(config: ServerConfig) -> RequestTracer | None:
    """--otlp-traces-endpoint's tracer; None without it. A ValueError says what is missing."""
    if config.otlp_traces_endpoint is None:
        return None
    try:
        from server.tracing import RequestTracer
    except ImportError as exc:
        raise ValueError(f"--otlp-traces-endpoint needs OpenTelemetry: pip install 'pagedserve[otel]' ({exc})") from None
    tracer = RequestTracer(config.otlp_traces_endpoint, config.model_name)
    logger.info("tracing: a span per request sent to %s (OpenTelemetry, OTLP)", config.otlp_traces_endpoint)
    return tracer


def each_of(*callbacks: OnRequestDone) -> OnRequestDone:
    """One on_request_done that calls each of `callbacks` in turn."""
    def on_request_done(state: RequestState, outcome: str) -> None:
        for callback in callbacks:
            callback(state, outcome)
    return on_request_done
