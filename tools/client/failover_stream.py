"""StreamReader: one replica's answer to a streamed call, sans I/O: which events may reach the caller, and when.

A replica streams one of two shapes. Chat and text completions send
`data: {...}` chunks with the output in `choices` and end with
`data: [DONE]`; an error is `data: {"error": {...}}`. The Responses API
(POST /v1/responses) sends named events (`event: response.created`,
`data: {"type": "response.created", "sequence_number": 0, ...}`) with the
output in `response.output_text.delta` events, and ends with the event
`response.completed`, `response.incomplete` or `response.failed`, which
carries the finished response and is delivered; an error is the event
`{"type": "error", "code": ..., "message": ..., "param": ...}`.

Owns: telling the two shapes apart, which events carry output, where a
stream ends, what an error event says. Must not know: sockets, replicas,
retries (failover_client.py decides those).
How: feed() the bytes as they arrive; it returns the events the caller may
have now. Those before the first that carries output (the chat role chunk,
response.created ...) are held back and released with it, so that a stream
that breaks before any output can be tried again from its start with
nothing shown twice; a stream that ends with no output releases them at its
end. An error event raises ErrorEvent, a data: line that is not a JSON
object ValueError.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

from tools.client.sse_parser import SseEvent, SseParser

DONE = "[DONE]"  # the data: line that ends a chat or completions stream
RESPONSE_ENDS = frozenset({"response.completed", "response.incomplete", "response.failed"})
RESPONSE_OUTPUT = "response.output_text.delta"
RESPONSE_ERROR = "error"  # the type (and SSE event name) of a Responses stream's error event
CALLER_FAULT = "invalid_request_error"  # the error kind that says the request, not the replica, is at fault


class ErrorEvent(Exception):
    """An event that reports an error: `error` is its OpenAI error object, `kind` what failed (its type, or for a
    Responses error event its code, such as "server_error" or "service_unavailable")."""

    def __init__(self, error: dict, kind: str | None):
        self.error, self.kind = error, kind
        super().__init__(f"{kind}: {error.get('message')}")

    @property
    def is_callers_fault(self) -> bool:
        return self.kind == CALLER_FAULT


@dataclass(frozen=True, slots=True)
class StreamEvent:
    payload: dict | None  # the event as the caller gets it; None for data: [DONE], which is not delivered
    is_output: bool = False  # it carries generated output
    is_last: bool = False  # the stream ends with it


class StreamReader:
    """One replica's stream, either shape: feed() bytes, get the events to release; `is_complete` once it ended."""

    def __init__(self) -> None:
        self.is_complete = False
        self._parser = SseParser()
        self._held: list[StreamEvent] = []  # read, not yet released
        self._has_output = False

    def feed(self, chunk: bytes) -> Iterator[StreamEvent]:
        """The events the caller may have now, the stream's last one included, none after it. They come one by one
        as they are read, so an error event (ErrorEvent) or a bad line (ValueError) is raised in its place among them."""
        for sse in self._parser.feed(chunk):
            if self.is_complete:
                return
            event = read_event(sse)
            self.is_complete, self._has_output = event.is_last, self._has_output or event.is_output
            self._held.append(event)
            if self._has_output or self.is_complete:
                released, self._held = self._held, []
                yield from released


def read_event(sse: SseEvent) -> StreamEvent:
    """What one SSE event of either shape is to the caller; ErrorEvent if it reports an error."""
    if sse.data == DONE:
        return StreamEvent(None, is_last=True)
    payload = json.loads(sse.data)
    if not isinstance(payload, dict):
        raise ValueError(f"expected a JSON object in a data: line, got {sse.data[:80]!r}")
    if isinstance(payload.get("error"), dict):
        raise ErrorEvent(payload["error"], payload["error"].get("type"))
    event_type = payload.get("type")
    if sse.type == RESPONSE_ERROR or event_type == RESPONSE_ERROR:
        raise ErrorEvent(payload, payload.get("code"))
    if isinstance(event_type, str):  # a Responses event; chat and completions chunks have no type
        return StreamEvent(payload, event_type == RESPONSE_OUTPUT and bool(payload.get("delta")),
                           event_type in RESPONSE_ENDS)
    return StreamEvent(payload, _chunk_carries_output(payload))


def _chunk_carries_output(chunk: dict) -> bool:
    """Whether a chat or completions chunk holds output (text, a content delta, a finish), unlike the role chunk."""
    for choice in chunk.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        if choice.get("text") or choice.get("finish_reason") or choice.get("logprobs"):
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict) and any(value for key, value in delta.items() if key != "role"):
            return True
    return False
