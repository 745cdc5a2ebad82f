"""An OTLP/HTTP trace receiver in the test process: what a collector would get from a server run with
--otlp-traces-endpoint.

    with OtlpReceiver() as receiver:
        server = start_server(tmp, checkpoint, "--otlp-traces-endpoint", receiver.endpoint)
        ...
        [span] = receiver.wait_for_spans(lambda s: s.name == "llm_request", 1, "the request's span")
        attributes_of(span)["gen_ai.usage.prompt_tokens"]

A thread serves POST /v1/traces on a free loopback port and decodes each body
(ExportTraceServiceRequest, gzipped or not) into OpenTelemetry's protobuf
Spans, kept with their resource's attributes.
"""

from __future__ import annotations

import gzip
import threading
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from helpers.waiting import wait_until

TRACES_PATH = "/v1/traces"
WAIT_S = 10.0


def attributes_of(item: Span) -> dict[str, object]:
    """A span's (or resource's) attributes as plain values: str, int, float, bool, or lists of them."""
    return _attributes(item.attributes)


def _attributes(key_values: Iterable[KeyValue]) -> dict[str, object]:
    return {kv.key: _plain(kv.value) for kv in key_values}


def _plain(value: AnyValue) -> object:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_plain(item) for item in value.array_value.values]
    return getattr(value, kind) if kind is not None else None


class OtlpReceiver:
    def __init__(self):
        self.spans: list[Span] = []
        self.resources: list[dict[str, object]] = []  # each received span's resource attributes, by position
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != TRACES_PATH:
                    self.send_error(404)
                    return
                receiver._take(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: object) -> None:
                pass  # no line per export on the test's stderr

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}{TRACES_PATH}"

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _take(self, request: ExportTraceServiceRequest) -> None:
        with self._lock:
            for resource_spans in request.resource_spans:
                resource = _attributes(resource_spans.resource.attributes)
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend(scope_spans.spans)
                    self.resources.extend(resource for _ in scope_spans.spans)

    def find(self, predicate: Callable[[Span], bool]) -> list[Span]:
        with self._lock:
            return [span for span in self.spans if predicate(span)]

    def wait_for_spans(self, predicate: Callable[[Span], bool], count: int, what: str) -> list[Span]:
        """The `count` spans received that satisfy `predicate`, once that many have come (else the test fails)."""
        wait_until(lambda: len(self.find(predicate)) >= count, WAIT_S,
                   message=lambda: f"{what}: {len(self.find(predicate))} of {count} spans received")
        found = self.find(predicate)
        assert len(found) == count, f"{what}: expected {count} spans, got {len(found)}"
        return found
