"""A request's W3C Trace Context: its `traceparent` and `tracestate` headers, which its span joins (server/tracing.py).

Owns: which headers carry a caller's trace context.
Must not know: OpenTelemetry (imported only when tracing is on), routes, what a span holds.
How: the headers are kept as they came; OpenTelemetry's propagator parses (and checks) them when the span is
made, so a server that traces nothing pays two dictionary look-ups per request.
"""

from __future__ import annotations

from collections.abc import Mapping

TRACE_CONTEXT_HEADERS = ("traceparent", "tracestate")


def trace_context(headers: Mapping[str, str]) -> dict[str, str] | None:
    """The request's trace context headers (lower-case names, as the parser gives them); None without a traceparent,
    which a tracestate alone cannot stand for."""
    if "traceparent" not in headers:
        return None
    return {name: headers[name] for name in TRACE_CONTEXT_HEADERS if name in headers}
