"""App: the router, admission control and the endpoints that generate nothing.

Owns: which handler answers which method and path (404, 405 with Allow),
the API key check on /v1/* (401; check_head gives it to the HTTP server,
which refuses before reading the body), admission of generation requests (503
while no worker is ready, 429 when the waiting queue is full), and GET
/v1/models, POST /tokenize, POST /detokenize, GET /version, GET /health
(readiness; also GET and POST /ping, vLLM's name for it), GET /livez
(liveness), GET /load (vLLM's {"server_load": the generation requests in
flight}, which load balancers poll) and GET /metrics; it routes
/v1/responses, /v1/responses/{id} and /v1/responses/{id}/cancel to the
Responses API, and POST /reset_prefix_cache and, with a `profile_dir`, POST
/start_profile and /stop_profile to WorkerControl (api/worker_control.py),
and with --debug-memory GET /debug/memory to MemoryDebug (server/api/memory_debug.py);
without a `profile_dir` the profiling endpoints are unknown (404). The API
key applies to these three as to /v1/*: they change the worker's state.
Must not know: HTTP framing (server/http/), how completions and responses are
built (api/completions/, api/responses/), the worker's internals.
How: an App is the http.serve() handler. Routes are a dict of path ->
{method: handler}; an exact path match, then the method. Errors are raised
as ApiError and rendered by the HTTP layer in the OpenAI schema.

Admission (server/api/admission.py) counts sequences: a sequence in flight is
either running (one of at most max_num_seqs in the batch) or waiting in the
engine's queue. So at most max_num_seqs + max_waiting_requests sequences
are let in flight; a request holds one place per sequence it asks for (n
for each of its prompts) from the moment its body is parsed, and one that
does not fit gets 429 with Retry-After, before anything is tokenized or
queued; one asking for more than max_seqs_per_request gets 400. Readiness is the
GenerationService's `is_ready` (the Supervisor's: a worker is READY and, if
it has work, makes progress); it gates both /health and new generation requests,
so while a worker is restarting new requests get a prompt 503 with
Retry-After and the requests in flight wait for the next worker; while
workers die before READY, /health's 503 names their load error. GET and
DELETE of a stored response need only the state store, not a worker.
/health never queues work; /livez answers 200 whenever the event loop runs.
"""

from __future__ import annotations

import hmac
import time
import urllib.parse
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import orjson
from prometheus_client import CONTENT_TYPE_LATEST

from server.api.admission import Admission
from server.api.body_fields import get_field
from server.api.completions.handlers import CompletionsHandlers
from server.api.completions.params import parse_json_body
from server.api.memory_debug import MemoryDebug
from server.api.responses.handlers import ResponsesHandlers
from server.api.worker_control import WorkerControl
from server.generation.service import GenerationService, not_ready
from server.generation.tool_parsers import ToolParser
from server.http.errors import ApiError, clip, describe_value
from server.http.server import HttpRequest, Responder
from server.state_store.store import StateStore

Endpoint = Callable[[HttpRequest, Responder], Awaitable[None]]
AUTH_PREFIX = "/v1/"  # what --api-key guards; probes and scrapers reach /health, /livez, /metrics, /version freely
BEARER = "bearer "
RESPONSE_PATH = "/v1/responses/"  # + a response id
CANCEL_SUFFIX = "/cancel"  # after a response id
DEFAULT_MAX_SEQS_PER_REQUEST = 256
PROFILE_PATHS = ("/start_profile", "/stop_profile")
RESET_PATH = "/reset_prefix_cache"
MEMORY_DEBUG_PATH = "/debug/memory"


def package_version() -> str:
    try:
        return metadata.version("pagedserve")
    except metadata.PackageNotFoundError:
        return "0+unknown"


@dataclass(slots=True)
class ModelCard:
    """What /v1/models says of the one model served."""

    name: str  # the served model name clients send as "model"
    root: str  # the checkpoint it was loaded from
    created: int = field(default_factory=lambda: int(time.time()))
    permission_id: str = field(default_factory=lambda: f"modelperm-{uuid.uuid4().hex}")

    def to_dict(self, max_model_len: int | None) -> dict:
        """max_model_len: the current worker's context; None before the first worker is ready."""
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "pagedserve",
                "root": self.root, "parent": None, "max_model_len": max_model_len,
                "permission": [self._permission()]}

    def _permission(self) -> dict:
        """vLLM's permission entry: what a client may do with the model (sample, logprobs, view), the same for all."""
        return {"id": self.permission_id, "object": "model_permission", "created": self.created,
                "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
                "group": None, "is_blocking": False}


class App:
    """The HTTP handler: `await app(request, responder)`.

    Built once, before any worker is ready: generation endpoints answer 503
    until the GenerationService's readiness says otherwise. The Responses
    API is served when a `state_store` is given.
    """

    def __init__(self, generation: GenerationService, models: tuple[ModelCard, ...],
                 render_metrics: Callable[[], bytes], *, max_waiting_requests: int,
                 max_seqs_per_request: int = DEFAULT_MAX_SEQS_PER_REQUEST, api_keys: tuple[str, ...] = (),
                 state_store: StateStore | None = None, profile_dir: Path | None = None,
                 tool_call_parser: type[ToolParser] | None = None, memory_debug: MemoryDebug | None = None):
        """models: what /v1/models lists, one card per name the model is served under.
        api_keys: the keys a Bearer token may be (any one of them); none: /v1/* is open.
        render_metrics: the /metrics body in Prometheus' text format.
        profile_dir: where /stop_profile has the worker write its profiles; None: no profiling endpoints.
        tool_call_parser: reads tool calls out of the output for tool_choice "auto"; None: "auto" is a 400.
        memory_debug: serves GET /debug/memory (--debug-memory); None: that path is unknown (404)."""
        if max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {max_waiting_requests!r}")
        self.generation = generation
        self.engine_client = generation.engine_client
        self.tokenizer = generation.tokenizer
        self.model_cards = {card.name: card for card in models}
        self._render_metrics = render_metrics
        self.completions_handlers = CompletionsHandlers(generation, tool_call_parser)
        self.admission = Admission(self.engine_client.engine_config.max_num_seqs + max_waiting_requests,
                                   max_seqs_per_request)
        self._api_keys = tuple(key.encode() for key in api_keys)
        self.worker_control = WorkerControl(self.engine_client, profile_dir)
        self._routes: dict[str, dict[str, Endpoint]] = {
            "/v1/completions": {"POST": self.completions},
            "/v1/chat/completions": {"POST": self.chat_completions},
            "/v1/models": {"GET": self.models},
            "/tokenize": {"POST": self.tokenize},
            "/detokenize": {"POST": self.detokenize},
            "/version": {"GET": self.version},
            "/health": {"GET": self.health},
            "/ping": {"GET": self.health, "POST": self.health},
            "/load": {"GET": self.load},
            "/livez": {"GET": self.livez},
            "/metrics": {"GET": self.metrics_text},
            RESET_PATH: {"POST": self.worker_control.reset_prefix_cache},
        }
        self.responses = ResponsesHandlers(generation, state_store, tool_call_parser) if state_store is not None else None
        if self.responses is not None:
            self._routes["/v1/responses"] = {"POST": self.create_response}
        # Beyond /v1/*, under the API key: what changes the worker's state.
        self._guarded_paths = (RESET_PATH, *(PROFILE_PATHS if profile_dir is not None else ()),
                               *((MEMORY_DEBUG_PATH,) if memory_debug is not None else ()))
        if memory_debug is not None:
            self._routes[MEMORY_DEBUG_PATH] = {"GET": self._memory_snapshot(memory_debug)}
        if profile_dir is not None:
            self._routes["/start_profile"] = {"POST": self.worker_control.start_profile}
            self._routes["/stop_profile"] = {"POST": self.worker_control.stop_profile}

    async def __call__(self, request: HttpRequest, responder: Responder) -> None:
        if self._is_guarded(request.path):
            self._authorize(request.headers)
        await self._route(request)(request, responder)

    def check_head(self, method: str, path: str, headers: dict[str, str]) -> ApiError | None:
        """The HTTP server's head check: the 401 a request earns before its body is read, or None."""
        if self._is_guarded(path):
            try:
                self._authorize(headers)
            except ApiError as error:
                return error
        return None

    def _route(self, request: HttpRequest) -> Endpoint:
        path = request.path
        if path.startswith("/v1/models/"):
            path = "/v1/models/{model}"
            methods = {"GET": self.model_by_name}
        elif path.startswith(RESPONSE_PATH) and path.endswith(CANCEL_SUFFIX) and self.responses is not None:
            path = RESPONSE_PATH + "{response_id}" + CANCEL_SUFFIX
            methods = {"POST": self.cancel_response}
        elif path.startswith(RESPONSE_PATH) and self.responses is not None:
            path = RESPONSE_PATH + "{response_id}"
            methods = {"GET": self.retrieve_response, "DELETE": self.delete_response}
        else:
            methods = self._routes.get(path)
        if methods is None:
            raise ApiError(404, f"no such route: {request.method} {clip(request.path)}; see /v1/models, "
                                "/v1/completions, /v1/chat/completions, /v1/responses")
        endpoint = methods.get(request.method) or (methods.get("GET") if request.method == "HEAD" else None)
        if endpoint is None:
            allowed = ", ".join(sorted(methods) + (["HEAD"] if "GET" in methods else []))
            raise ApiError(405, f"{path} takes {allowed}, got {request.method}", headers={"Allow": allowed})
        return endpoint

    def _is_guarded(self, path: str) -> bool:
        return path.startswith(AUTH_PREFIX) or path in self._guarded_paths

    def _authorize(self, headers: dict[str, str]) -> None:
        if not self._api_keys:
            return
        header = headers.get("authorization", "")
        token = header[len(BEARER):].strip() if header[:len(BEARER)].lower() == BEARER else ""
        # Every key is compared, so the time taken does not tell which one came close.
        matches = [hmac.compare_digest(token.encode(), key) for key in self._api_keys]
        if not any(matches):
            raise ApiError(401, "expected 'Authorization: Bearer <api key>' with the server's API key, "
                                f"got {'a wrong key' if token else 'none'}", headers={"WWW-Authenticate": "Bearer"})

    # ------------------------------------------------------------------------------------------ generation

    async def completions(self, request: HttpRequest, responder: Responder) -> None:
        self.generation.check_ready()
        await self.completions_handlers.completions(request, responder, self.admission.admit)

    async def chat_completions(self, request: HttpRequest, responder: Responder) -> None:
        self.generation.check_ready()
        await self.completions_handlers.chat_completions(request, responder, self.admission.admit)

    @property
    def _responses(self) -> ResponsesHandlers:
        """The /v1/responses handlers, whose routes exist only with a state store."""
        if self.responses is None:
            raise RuntimeError("expected the /v1/responses handlers (a state store), got none")
        return self.responses

    async def create_response(self, request: HttpRequest, responder: Responder) -> None:
        await self._responses.create(self.admission.admit, request, responder)

    async def retrieve_response(self, request: HttpRequest, responder: Responder) -> None:
        await self._responses.retrieve(request.path.removeprefix(RESPONSE_PATH), responder)

    async def delete_response(self, request: HttpRequest, responder: Responder) -> None:
        await self._responses.delete(request.path.removeprefix(RESPONSE_PATH), responder)

    async def cancel_response(self, request: HttpRequest, responder: Responder) -> None:
        await self._responses.cancel(request.path.removeprefix(RESPONSE_PATH).removesuffix(CANCEL_SUFFIX))

    # ------------------------------------------------------------------------------------------ the rest

    async def models(self, request: HttpRequest, responder: Responder) -> None:
        max_model_len = self.generation.max_model_len
        await _send_json(responder, {"object": "list",
                                     "data": [card.to_dict(max_model_len) for card in self.model_cards.values()]})

    async def model_by_name(self, request: HttpRequest, responder: Responder) -> None:
        # The SDK percent-encodes the id in the path ("org/name with space" -> org%2Fname%20with%20space).
        name = urllib.parse.unquote(request.path.removeprefix("/v1/models/"))
        self.generation.check_model(name)
        await _send_json(responder, self.model_cards[name].to_dict(self.generation.max_model_len))

    async def tokenize(self, request: HttpRequest, responder: Responder) -> None:
        body = parse_json_body(request.body)
        self.generation.check_model(body.get("model"))
        if "messages" in body:
            add_generation_prompt = get_field(body, "add_generation_prompt", bool, "a boolean", True)
            text = self.generation.render_chat(body["messages"], add_generation_prompt)
            default_special = False  # the template places the BOS
        elif isinstance(body.get("prompt"), str):
            text, default_special = body["prompt"], True
        else:
            raise ApiError(400, f"expected 'prompt' (a string) or 'messages', got prompt="
                                f"{describe_value(body.get('prompt'))}", param="prompt")
        add_special_tokens = body.get("add_special_tokens", default_special)
        if not isinstance(add_special_tokens, bool):
            raise ApiError(400, f"add_special_tokens must be true or false, got {describe_value(add_special_tokens)}",
                           param="add_special_tokens")
        return_token_strs = get_field(body, "return_token_strs", bool, "a boolean", False)
        tokens = await self.generation.encode(text, add_special_tokens=add_special_tokens)
        await _send_json(responder, {"tokens": tokens, "count": len(tokens), "max_model_len": self.generation.max_model_len,
                                     "token_strs": self.tokenizer.token_strs(tokens) if return_token_strs else None})

    async def detokenize(self, request: HttpRequest, responder: Responder) -> None:
        body = parse_json_body(request.body)
        self.generation.check_model(body.get("model"))
        tokens, vocab_size, max_model_len = body.get("tokens"), self.tokenizer.vocab_size, self.generation.max_model_len
        if isinstance(tokens, list) and max_model_len is not None and len(tokens) > max_model_len:
            raise ApiError(400, f"tokens holds {len(tokens)} token ids, more than this model's context of "
                                f"{max_model_len}", param="tokens")
        if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < vocab_size for t in tokens):
            raise ApiError(400, f"tokens must be a list of token ids in [0, {vocab_size}), got "
                                f"{describe_value(tokens)}", param="tokens")
        await _send_json(responder, {"prompt": self.tokenizer.decode(tokens, skip_special_tokens=False)})

    async def version(self, request: HttpRequest, responder: Responder) -> None:
        await _send_json(responder, {"version": package_version()})

    async def health(self, request: HttpRequest, responder: Responder) -> None:
        """Readiness: 200 with an empty body while a worker is ready, else 503, naming the load error the last
        worker died of when it could not start; never touches the engine."""
        if not self.generation.is_ready():
            raise _not_ready_since(self.engine_client.start_error)
        await responder.send(200, b"", content_type=None)

    async def livez(self, request: HttpRequest, responder: Responder) -> None:
        """Liveness: 200 while this event loop runs, whatever the worker's state."""
        await responder.send(200, b"", content_type=None)

    async def load(self, request: HttpRequest, responder: Responder) -> None:
        """The generation requests admitted and not yet answered, whether the worker runs them or they wait."""
        await _send_json(responder, {"server_load": self.admission.num_requests})

    @staticmethod
    def _memory_snapshot(memory_debug: MemoryDebug) -> Endpoint:
        async def memory_snapshot(request: HttpRequest, responder: Responder) -> None:
            await _send_json(responder, memory_debug.snapshot())

        return memory_snapshot

    async def metrics_text(self, request: HttpRequest, responder: Responder) -> None:
        await responder.send(200, self._render_metrics(), content_type=CONTENT_TYPE_LATEST)


def _not_ready_since(start_error: str | None) -> ApiError:
    """The 503 of not_ready(), which says why the last worker could not start when it did not."""
    error = not_ready()
    if start_error is None:
        return error
    return ApiError(503, f"{error.message}; the last engine worker could not start: {start_error}",
                    headers=error.headers)


async def _send_json(responder: Responder, payload: dict) -> None:
    await responder.send(200, orjson.dumps(payload))
