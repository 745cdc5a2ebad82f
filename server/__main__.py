"""`pagedserve` / `python -m server`: the command line of the OpenAI-compatible server.

Parses the flags (vLLM's spelling where vLLM has one), sets up logging and
runs a Server on uvloop; the exit status is the Server's.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import uvloop

from server.api.cors import add_cors_arguments, cors_policy_from_args
from server.generation.chat_template import chat_template_source
from server.generation.generation_defaults import FROM_CHECKPOINT, KEYS, NEUTRAL, parse_override
from server.generation.request import DEFAULT_MAX_RESPONSE_BYTES
from server.generation.tool_parsers import TOOL_PARSERS
from server.http.server import BUFFERED_BODIES, HttpLimits
from server.http.sockets import DEFAULT_MAX_CONNECTIONS_CAP, FD_RESERVE
from server.http.tls import CERT_REQS, TlsConfig
from server.server import Server, ServerConfig
from server.state_store.store import default_store_url
from server.worker.recycling import RecyclePolicy
from server.worker.restart_policy import RestartPolicy
from shared.config import field_defaults, parse_memory_size
from shared.cpu_tier import current_tier
from shared.default_model import DEFAULT_MODEL_NAME
from shared.engine_args import add_engine_arguments, engine_config_from_args
from shared.sampling_params import SamplingParams
from shared.vocabulary import MIN_HANG_TIMEOUT_S

API_KEY_ENV = "PAGEDSERVE_API_KEY"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# --uvicorn-log-level's values, as vLLM takes them; uvicorn's "trace" is below debug, which logging has not.
LOG_LEVELS = {"critical": logging.CRITICAL, "error": logging.ERROR, "warning": logging.WARNING, "info": logging.INFO,
              "debug": logging.DEBUG, "trace": logging.DEBUG}
SERVER_DEFAULTS = field_defaults(ServerConfig)  # a flag that sets a ServerConfig field defaults to the field's default
NEUTRAL_SAMPLING = field_defaults(SamplingParams)  # what --generation-config vllm leaves a request


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="Serve a Hugging Face checkpoint over the "
                                     "OpenAI API (completions, chat completions, responses, streaming).")
    parser.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                        help="the model, as `vllm serve MODEL` takes it: the same as --model")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default=SERVER_DEFAULTS["host"],
                        help="address to listen on (0.0.0.0: every interface)")
    server.add_argument("--port", type=int, default=SERVER_DEFAULTS["port"], help="port to listen on (0: any free port)")
    server.add_argument("--uds", type=Path, default=SERVER_DEFAULTS["uds"],
                        help="listen on this Unix socket instead of --host/--port (a socket file a server that is "
                             "gone left there is replaced; removed on exit)")
    server.add_argument("--root-path", default=SERVER_DEFAULTS["root_path"],
                        help="the path prefix a path-routing proxy serves this server under, e.g. /llm: a request "
                             "path that begins with it is routed without it (default: none)")
    server.add_argument("--served-model-name", nargs="+", action="extend", metavar="NAME", default=None,
                        help="the names clients may send as the model, each listed by /v1/models; responses and "
                             "metrics report the first (default: --model as given)")
    server.add_argument("--api-key", nargs="+", action="extend", metavar="KEY", default=None,
                        help=f"require 'Authorization: Bearer KEY' on /v1/*, KEY any of those given (default: "
                             f"${API_KEY_ENV}; none: open)")
    server.add_argument("--chat-template", metavar="FILE_OR_TEMPLATE", default=SERVER_DEFAULTS["chat_template"],
                        help="the chat template, instead of the checkpoint's: a jinja2 file, or the template itself "
                             "(a value that names no file and has '{%%' or '{{' in it)")
    server.add_argument("--trust-request-chat-template", action="store_true",
                        default=SERVER_DEFAULTS["trust_request_chat_template"],
                        help="render a chat request with its own chat_template when it has one (default: such a "
                             "request is refused with 400, as in vLLM: a template is code the server runs)")
    server.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="serve tool_choice \"auto\": the model may call the request's tools, and its calls are "
                             "read out of its text by --tool-call-parser (without it, \"auto\" with tools is a 400)")
    server.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=SERVER_DEFAULTS["tool_call_parser"],
                        help="the format the model writes tool calls in: hermes (Hermes, Qwen2.5: <tool_call>{...}"
                             "</tool_call>) or llama3_json (Llama 3.1/3.2: {\"name\": ..., \"parameters\": ...})")
    server.add_argument("--generation-config", metavar=f"{FROM_CHECKPOINT}|{NEUTRAL}|DIR",
                        default=SERVER_DEFAULTS["generation_config"],
                        help=f"defaults for the sampling fields a request leaves out ({', '.join(KEYS)}; "
                             f"max_new_tokens is max_tokens): {FROM_CHECKPOINT} takes the checkpoint's "
                             f"generation_config.json, {NEUTRAL} ignores it (temperature "
                             f"{NEUTRAL_SAMPLING['temperature']:g}, top_p {NEUTRAL_SAMPLING['top_p']:g}, no top_k...), "
                             f"DIR takes DIR/generation_config.json (default: {SERVER_DEFAULTS['generation_config']})")
    server.add_argument("--override-generation-config", metavar="JSON", type=str, default=None,
                        help="a JSON object of those fields merged over --generation-config's, e.g. "
                             "'{\"temperature\": 0.5}' (null: back to the neutral value)")
    server.add_argument("--max-logprobs", type=int, metavar="N", default=SERVER_DEFAULTS["max_logprobs"],
                        help="the most alternatives per token a request may ask for: completions' logprobs, chat's "
                             "top_logprobs, prompt_logprobs; more get 400 (-1: the vocabulary's size; default: "
                             f"{SERVER_DEFAULTS['max_logprobs']}, as vLLM's)")
    server.add_argument("--max-waiting-requests", type=int, default=SERVER_DEFAULTS["max_waiting_requests"],
                        help="sequences that may wait beyond the --max-num-seqs running ones; more get 429 "
                             "(a request holds n for each of its prompts)")
    server.add_argument("--max-num-seqs-per-request", type=int, default=SERVER_DEFAULTS["max_num_seqs_per_request"],
                        help="most sequences (n x prompts) one request may ask for; more get 400")
    server.add_argument("--runtime-dir", type=Path, default=SERVER_DEFAULTS["runtime_dir"],
                        help="private (0700) directory for the worker's sockets (default: a fresh one under "
                             "$XDG_RUNTIME_DIR or the temp dir, removed on exit)")
    server.add_argument("--shutdown-timeout", type=float, default=SERVER_DEFAULTS["shutdown_timeout"],
                        help="seconds responses in progress may take to finish after SIGTERM")
    server.add_argument("--state-store", metavar="URL", default=None,
                        help="where the Responses API keeps conversations: sqlite:///absolute/path.db, or "
                             "redis://host:port/db to share them between replicas (default: a SQLite file, "
                             f"{default_store_url()})")
    server.add_argument("--profile-dir", type=Path, default=SERVER_DEFAULTS["profile_dir"],
                        help="enable POST /start_profile and /stop_profile (vLLM's VLLM_TORCH_PROFILER_DIR): the "
                             "worker's steps under torch.profiler, each profile written here as an operator table and "
                             "a chrome trace (created 0700 if missing; default: off, the endpoints are 404)")
    server.add_argument("--debug-memory", action="store_true", default=SERVER_DEFAULTS["debug_memory"],
                        help="enable GET /debug/memory (under the API key): the frontend's RSS and top allocation "
                             "sites (tracemalloc, which slows every allocation: off by default) and the worker's "
                             "memory split; it also has the worker log torch's memory statistics")
    server.add_argument("--otlp-traces-endpoint", metavar="URL", default=SERVER_DEFAULTS["otlp_traces_endpoint"],
                        help="send one OpenTelemetry span per request (llm_request, with its queued, prefill, decode "
                             "and requeued phases) to this OTLP collector, e.g. http://127.0.0.1:4318/v1/traces "
                             "($OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: http/protobuf, the default, or grpc); needs "
                             "pip install 'pagedserve[otel]' (default: off)")
    resilience = parser.add_argument_group("resilience (the supervisor of the engine worker)")
    defaults = RestartPolicy()
    resilience.add_argument("--worker-start-timeout", type=float, default=defaults.start_timeout,
                            help="seconds a worker may take from spawn to READY (model load) before it is killed")
    resilience.add_argument("--worker-hang-timeout", type=float, default=defaults.hang_timeout,
                            help="seconds of silence (no output, no heartbeat) after which a worker counts as hung "
                                 f"and is killed and replaced (at least {MIN_HANG_TIMEOUT_S:g})")
    resilience.add_argument("--max-request-restarts", type=int, default=defaults.max_request_restarts,
                            help="consecutive worker failures a request may be in flight for before it is failed "
                                 "as a poison request")
    resilience.add_argument("--max-worker-restarts", type=int, default=defaults.max_worker_restarts,
                            help="worker restarts allowed within --restart-window; one more and the server exits "
                                 "non-zero")
    resilience.add_argument("--restart-window", type=float, default=defaults.restart_window,
                            help="seconds over which --max-worker-restarts is counted")
    resilience.add_argument("--standby-workers", type=int, choices=(0, 1), default=SERVER_DEFAULTS["standby_workers"],
                            help="a second worker, loaded and warmed up, that takes over at once when the active one "
                                 "dies or hangs (default: 1 on the CPU when the memory available holds it, 0 on CUDA)")
    resilience.add_argument("--worker-memory-limit", type=parse_memory_size, default=None, metavar="SIZE",
                            help="replace the worker (drained, through the standby when there is one) once its "
                                 "unexplained memory, its RSS less the weights, the KV cache and malloc's cache, "
                                 "passes SIZE, e.g. 2GiB or 1500MB; not counted toward --max-worker-restarts "
                                 "(default: no limit)")
    resilience.add_argument("--worker-cuda-memory-limit", type=parse_memory_size, default=None, metavar="SIZE",
                            help="on CUDA, replace the worker the same way once the device memory torch's "
                                 "allocator has reserved (the KV cache included) passes SIZE, e.g. 75GiB; not "
                                 "counted toward --max-worker-restarts (default: no limit)")
    resilience.add_argument("--worker-max-requests", type=int, default=None, metavar="N",
                            help="replace the worker (drained, through the standby when there is one) once it has "
                                 "finished N requests, as gunicorn's --max-requests; not counted toward "
                                 "--max-worker-restarts (default: never)")
    resilience.add_argument("--shared-kv-cache", action=argparse.BooleanOptionalAction,
                            default=SERVER_DEFAULTS["shared_kv_cache"],
                            help="keep the KV cache in shared memory (/dev/shm), so that the next worker resumes the "
                                 "requests in flight on their KV instead of recomputing it: the same text, sooner "
                                 "(default: on for the CPU)")
    http = parser.add_argument_group("http limits")
    defaults = HttpLimits()
    http.add_argument("--max-body-size", type=parse_memory_size, default=defaults.max_body_bytes,
                      help="largest request body, e.g. 8MiB (larger: 413)")
    http.add_argument("--max-response-size", type=parse_memory_size, default=DEFAULT_MAX_RESPONSE_BYTES,
                      help="largest whole (not streamed) response a request may ask for, estimated from it before "
                           "any work, e.g. 256MiB (larger: 400; default: 64MiB)")
    http.add_argument("--max-header-size", type=parse_memory_size, default=defaults.max_header_bytes,
                      help="largest request line + headers (larger: 431)")
    http.add_argument("--max-buffered-body-bytes", type=parse_memory_size, default=None,
                      help=f"request bodies all connections may hold at once, e.g. 256MiB; a body that does not fit "
                           f"gets 503 (default: {BUFFERED_BODIES} x --max-body-size)")
    http.add_argument("--max-connections", type=int, default=None,
                      help=f"open connections at once; more get 503 (default: the open-files limit, raised to its "
                           f"hard limit at start-up, less {FD_RESERVE}, at most {DEFAULT_MAX_CONNECTIONS_CAP})")
    http.add_argument("--timeout-header", type=float, default=defaults.header_timeout,
                      help="seconds from a request's first byte to the end of its headers (then 408)")
    http.add_argument("--timeout-body", type=float, default=defaults.body_timeout,
                      help="seconds from the end of the headers to the end of the body (then 408)")
    http.add_argument("--timeout-keep-alive", type=float, default=defaults.idle_timeout,
                      help="seconds an idle keep-alive connection stays open")
    http.add_argument("--timeout-write", type=float, default=defaults.write_timeout,
                      help="seconds a client may read nothing while its response waits, before it is dropped")
    add_cors_arguments(parser)
    tls = parser.add_argument_group("tls (https)")
    tls.add_argument("--ssl-certfile", type=Path, default=None,
                     help="serve HTTPS with this PEM certificate (chain), with --ssl-keyfile (default: plain HTTP)")
    tls.add_argument("--ssl-keyfile", type=Path, default=None, help="the PEM private key of --ssl-certfile")
    tls.add_argument("--ssl-ca-certs", type=Path, default=None,
                     help="PEM CA certificates that clients' certificates must chain to: with it, clients must show "
                          "one (see --ssl-cert-reqs)")
    tls.add_argument("--ssl-cert-reqs", type=int, choices=sorted(CERT_REQS), default=None,
                     help="whether clients show a certificate, as Python's ssl numbers it: 0 none asked, 1 optional "
                          "(checked when shown), 2 required (default: 2 with --ssl-ca-certs, else 0)")
    add_engine_arguments(parser)
    logs = parser.add_argument_group("logging (vLLM's flags)")
    logs.add_argument("--uvicorn-log-level", choices=tuple(LOG_LEVELS), default="info",
                      help="the server's log level (there is no uvicorn here: it sets the level of every log line)")
    logs.add_argument("--disable-log-requests", action="store_true",
                      help="accepted: requests are never logged here, one line each or otherwise")
    logs.add_argument("--disable-log-stats", action="store_true",
                      help="accepted: there are no periodic stats lines in the log here; /metrics has them")
    return parser


def take_model_tag(args: argparse.Namespace) -> None:
    """The positional MODEL becomes --model; both given and different is an error. --api-key and
    --served-model-name take several values, so a MODEL written after them is read as one of theirs: with no
    model given, a last value that names a directory is that mistake, and an error says so (rather than serving
    the embedded model, with the path as an API key)."""
    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise ValueError(f"the model is given twice: {args.model_tag!r} as MODEL and {args.model!r} as --model")
    args.model = args.model or args.model_tag
    for flag, values in (("--api-key", args.api_key), ("--served-model-name", args.served_model_name)):
        if args.model is None and values and Path(values[-1]).expanduser().is_dir():
            raise ValueError(f"{values[-1]!r} is read as a value of {flag}, which takes several: put MODEL first "
                             f"(pagedserve MODEL {flag} ...), or give it as --model")


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    take_model_tag(args)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser: the format the model writes calls in")
    limits = HttpLimits(max_header_bytes=args.max_header_size, max_body_bytes=args.max_body_size,
                        max_buffered_body_bytes=args.max_buffered_body_bytes, max_connections=args.max_connections,
                        header_timeout=args.timeout_header, body_timeout=args.timeout_body,
                        idle_timeout=args.timeout_keep_alive, write_timeout=args.timeout_write)
    return ServerConfig(engine=engine_config_from_args(args), host=args.host, port=args.port,
                        served_model_names=tuple(args.served_model_name or [args.model or DEFAULT_MODEL_NAME]),
                        api_keys=api_keys_from_args(args),
                        chat_template=chat_template_source(args.chat_template) if args.chat_template else None,
                        trust_request_chat_template=args.trust_request_chat_template,
                        tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
                        max_waiting_requests=args.max_waiting_requests,
                        max_num_seqs_per_request=args.max_num_seqs_per_request,
                        runtime_dir=args.runtime_dir, http_limits=limits, shutdown_timeout=args.shutdown_timeout,
                        restart_policy=restart_policy_from_args(args),
                        recycle_policy=RecyclePolicy(memory_limit=args.worker_memory_limit,
                                                    max_requests=args.worker_max_requests,
                                                    cuda_memory_limit=args.worker_cuda_memory_limit),
                        standby_workers=args.standby_workers, shared_kv_cache=args.shared_kv_cache,
                        state_store=args.state_store or default_store_url(),
                        profile_dir=args.profile_dir, debug_memory=args.debug_memory, max_logprobs=max_logprobs_from_args(args),
                        max_response_bytes=args.max_response_size,
                        generation_config=args.generation_config,
                        override_generation_config=parse_override(args.override_generation_config or "{}"),
                        cors=cors_policy_from_args(args), tls=tls_config_from_args(args), root_path=args.root_path,
                        uds=args.uds, otlp_traces_endpoint=args.otlp_traces_endpoint)


def max_logprobs_from_args(args: argparse.Namespace) -> int | None:
    """--max-logprobs: N, or None for vLLM's -1 (the vocabulary's size)."""
    if args.max_logprobs < -1:
        raise ValueError(f"--max-logprobs must be >= 0, or -1 for the vocabulary's size, got {args.max_logprobs}")
    return None if args.max_logprobs == -1 else args.max_logprobs


def api_keys_from_args(args: argparse.Namespace) -> tuple[str, ...]:
    """--api-key's keys, else $PAGEDSERVE_API_KEY's one; none: the API is open."""
    if args.api_key:
        return tuple(args.api_key)
    return (os.environ[API_KEY_ENV],) if os.environ.get(API_KEY_ENV) else ()


def tls_config_from_args(args: argparse.Namespace) -> TlsConfig | None:
    """The --ssl-* flags' TlsConfig; None without a certificate (plain HTTP)."""
    if (args.ssl_certfile is None) != (args.ssl_keyfile is None):
        raise ValueError("--ssl-certfile and --ssl-keyfile go together: HTTPS needs the certificate and its key")
    if args.ssl_certfile is None:
        if args.ssl_ca_certs is not None or args.ssl_cert_reqs is not None:
            raise ValueError("--ssl-ca-certs and --ssl-cert-reqs need HTTPS: --ssl-certfile and --ssl-keyfile")
        return None
    cert_reqs = None if args.ssl_cert_reqs is None else CERT_REQS[args.ssl_cert_reqs]
    return TlsConfig(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs, cert_reqs)


def restart_policy_from_args(args: argparse.Namespace) -> RestartPolicy:
    return RestartPolicy(start_timeout=args.worker_start_timeout, hang_timeout=args.worker_hang_timeout,
                         max_request_restarts=args.max_request_restarts, max_worker_restarts=args.max_worker_restarts,
                         restart_window=args.restart_window)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = server_config_from_args(args)
        current_tier()  # a $PAGEDSERVE_CPU_ISA this CPU cannot run is refused here, not by each worker it starts
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=LOG_LEVELS[args.uvicorn_log_level], format=LOG_FORMAT)
    return uvloop.run(Server(config).run())


if __name__ == "__main__":
    sys.exit(main())
