"""RequestTracer: one OpenTelemetry span per request choice, with its phases, sent over OTLP (--otlp-traces-endpoint).

Owns: the span "llm_request" (vLLM's name, kind SERVER, vLLM's gen_ai.* attribute names) from a choice's
arrival to its end, its children "queued", "prefill", "decode" and one "requeued" per worker death it lived
through, the span exporter (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: http/protobuf, or grpc when its package is
installed) and the BatchSpanProcessor that sends the spans.
Must not know: HTTP (a request's trace context comes as RequestState.trace_context), the wire protocol,
metrics, where the times come from.
How: nothing is traced while a request runs: on_request_done builds the whole tree at once from the
RequestState's times (time.monotonic(), the worker's scheduled_time too: one clock on one machine), moved
to the epoch by one offset taken at start. A caller's W3C traceparent makes the span a child of the
caller's. The processor's thread exports (OTEL_BSP_* tune it), never the event loop; shutdown() flushes.
This module imports OpenTelemetry at its top: the server imports it only when tracing is on.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from server.worker.request_state import RequestState

PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
HTTP_PROTOBUF, GRPC = "http/protobuf", "grpc"
GRPC_PACKAGE = "opentelemetry-exporter-otlp-proto-grpc"
SERVICE = "pagedserve"  # the service.name spans carry, unless OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES set one
REQUEST_SPAN = "llm_request"  # vLLM's
NS_PER_S = 1_000_000_000

Attributes = dict[str, AttributeValue]


@dataclass(frozen=True, slots=True)
class Phase:
    """One child span of a request's: its name, when (time.monotonic() seconds) and what it carries."""

    name: str
    start: float
    end: float
    attributes: Attributes = field(default_factory=dict)


def phases(state: RequestState, end: float) -> list[Phase]:
    """The request's phases as far as it got: queued until a worker first ran it, prefill until its first token,
    decode until its last; and one requeued per worker death, until the request was next scheduled or gave its
    first token after it (an instant when neither came later: a death mid-decode)."""
    scheduled, first, last = state.scheduled_time, state.first_token_time, state.last_token_time
    spans = [Phase("queued", state.arrival_time, next((t for t in (scheduled, first) if t is not None), end))]
    if scheduled is not None:
        spans.append(Phase("prefill", scheduled, first if first is not None else end))
    if first is not None and last is not None:
        spans.append(Phase("decode", first, last))
    for requeue in state.requeues:
        resumed = min((t for t in (scheduled, first) if t is not None and t > requeue.time), default=requeue.time)
        spans.append(Phase("requeued", requeue.time, resumed, {"pagedserve.restart.cause": requeue.cause,
                                                               "pagedserve.restart.description": requeue.description}))
    return spans


def request_attributes(state: RequestState, outcome: str, end: float, model_name: str) -> Attributes:
    """The llm_request span's attributes: vLLM's names (and OpenTelemetry's gen_ai conventions), latencies in
    seconds; a latency whose ends the request never reached is left out."""
    params, arrival = state.params, state.arrival_time
    scheduled, first, last = state.scheduled_time, state.first_token_time, state.last_token_time
    attributes: Attributes = {
        "gen_ai.request.id": state.request_id, "gen_ai.response.model": model_name,
        "gen_ai.request.temperature": params.temperature, "gen_ai.request.top_p": params.top_p,
        "gen_ai.request.max_tokens": params.max_tokens,
        "gen_ai.usage.prompt_tokens": len(state.prompt_token_ids),
        "gen_ai.usage.completion_tokens": len(state.output_token_ids),
        "gen_ai.response.finish_reasons": (outcome,), "gen_ai.latency.e2e": end - arrival,
        "pagedserve.restarts": len(state.requeues)}
    latencies = {"gen_ai.latency.time_in_queue": (arrival, scheduled),
                 "gen_ai.latency.time_to_first_token": (arrival, first),
                 "gen_ai.latency.time_in_model_prefill": (scheduled, first),
                 "gen_ai.latency.time_in_model_decode": (first, last),
                 "gen_ai.latency.time_in_model_inference": (scheduled, last)}
    for name, (since, until) in latencies.items():
        if since is not None and until is not None:
            attributes[name] = until - since
    return attributes


class RequestTracer:
    def __init__(self, endpoint: str, model_name: str):
        """endpoint: the collector's URL (http/protobuf: the whole path, e.g. http://127.0.0.1:4318/v1/traces);
        model_name: what gen_ai.response.model reports. A ValueError names what is wrong with the set-up."""
        self._provider = TracerProvider(resource=_resource())
        self._provider.add_span_processor(BatchSpanProcessor(span_exporter(endpoint)))
        self._tracer = self._provider.get_tracer(SERVICE)
        self._model_name = model_name
        self._propagator = TraceContextTextMapPropagator()
        self._epoch_offset_ns = time.time_ns() - time.monotonic_ns()  # a monotonic time + this = the epoch's

    def on_request_done(self, state: RequestState, outcome: str) -> None:
        """Send the choice's span tree (GenerationService's on_request_done); the outcome "error" or a failed
        state makes its status ERROR."""
        end = time.monotonic()
        parent = self._propagator.extract(state.trace_context or {})  # none (or not valid): a new trace
        span = self._tracer.start_span(REQUEST_SPAN, context=parent, kind=SpanKind.SERVER,
                                       start_time=self._epoch_ns(state.arrival_time),
                                       attributes=request_attributes(state, outcome, end, self._model_name))
        if state.error is not None or outcome == "error":
            span.set_status(Status(StatusCode.ERROR, state.error))
        within = trace.set_span_in_context(span)
        for phase in phases(state, end):
            child = self._tracer.start_span(phase.name, context=within, start_time=self._epoch_ns(phase.start),
                                            attributes=phase.attributes)
            child.end(end_time=self._epoch_ns(phase.end))
        span.end(end_time=self._epoch_ns(end))

    def shutdown(self) -> None:
        """Send the spans not sent yet (blocking, bounded by the exporter's timeout) and stop the processor."""
        self._provider.shutdown()

    def _epoch_ns(self, monotonic_s: float) -> int:
        return self._epoch_offset_ns + round(monotonic_s * NS_PER_S)


def span_exporter(endpoint: str) -> SpanExporter:
    """The OTLP exporter $OTEL_EXPORTER_OTLP_TRACES_PROTOCOL asks for (default http/protobuf)."""
    protocol = os.environ.get(PROTOCOL_ENV, HTTP_PROTOBUF)
    if protocol == HTTP_PROTOBUF:
        if urlparse(endpoint).scheme not in ("http", "https"):
            raise ValueError(f"--otlp-traces-endpoint must be an http:// or https:// URL for {HTTP_PROTOBUF}, such as "
                             f"http://127.0.0.1:4318/v1/traces, got {endpoint!r}")
        return OTLPSpanExporter(endpoint=endpoint)
    if protocol == GRPC:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # pyright: ignore[reportMissingImports]
                OTLPSpanExporter as GrpcSpanExporter,
            )
        except ImportError as exc:
            raise ValueError(f"{PROTOCOL_ENV}={GRPC} needs the package {GRPC_PACKAGE} (pip install {GRPC_PACKAGE}), "
                             f"which is not installed: {exc}") from None
        return GrpcSpanExporter(endpoint=endpoint)
    raise ValueError(f"{PROTOCOL_ENV} must be {HTTP_PROTOBUF} or {GRPC}, got {protocol!r}")


def _resource() -> Resource:
    """The environment's resource (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES), named pagedserve unless it names
    itself."""
    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: SERVICE}))
    return resource
