"""--otlp-traces-endpoint as a collector sees it: `python -m server` sends one span tree per request over
OTLP/HTTP to a receiver in the test process (helpers/otlp_receiver.py), spoken to by the openai SDK.

One server serves the module, on the embedded default model (no checkpoint to build: no torch in the test
process), with OTEL_BSP_SCHEDULE_DELAY=100 (spans leave within a tenth of a second) and two faults of the
worker's test facility (PAGEDSERVE_FAULT): every Responses API request fails, so that one test sees an
ERROR span, and the first worker hangs at step HANG_AT_STEP. The killed request needs more steps than
that, so it cannot finish on the first worker: a SIGKILL any time after its first token strikes
mid-stream, before or during the hang. The tests before it take fewer steps than that together.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from helpers.otlp_receiver import OtlpReceiver, attributes_of
from helpers.running_server import RunningServer, start_server, stop_server
from helpers.test_device import TEST_DEVICE

MODEL = "tiny"
MAX_TOKENS = 6
LONG_MAX_TOKENS = 48  # the killed request's
HANG_AT_STEP = 32  # more steps than the other tests take together, fewer than LONG_MAX_TOKENS
SERVER_FLAGS = ("--served-model-name", MODEL, "--device", TEST_DEVICE, "--dtype", "float32", "--num-kv-blocks", "256",
                "--worker-hang-timeout", "60", "--standby-workers", "0")  # one worker loading at a time: sooner here
SERVER_ENV = {"OTEL_BSP_SCHEDULE_DELAY": "100", "PAGEDSERVE_FAULT": f"hang@{HANG_AT_STEP}:epoch=1,fail-on-request=resp_"}
PHASES = ["queued", "prefill", "decode"]
S = 1e-9  # seconds per nanosecond


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as running:
        yield running


@pytest.fixture(scope="module")
def server(tmp_path_factory, receiver) -> Iterator[RunningServer]:
    running = start_server(tmp_path_factory.mktemp("tracing"), None, *SERVER_FLAGS,
                           "--otlp-traces-endpoint", receiver.endpoint, env=SERVER_ENV)
    yield running
    stop_server(running)


def request_span(receiver: OtlpReceiver, request_id: str) -> Span:
    [span] = receiver.wait_for_spans(
        lambda s: s.name == "llm_request" and attributes_of(s)["gen_ai.request.id"] == request_id, 1,
        f"the llm_request span of {request_id}")
    return span


def children(receiver: OtlpReceiver, parent: Span, count: int) -> list[Span]:
    """The parent's `count` child spans, by start (then end: an instant first)."""
    found = receiver.wait_for_spans(lambda s: s.parent_span_id == parent.span_id, count,
                                    f"the children of {parent.name}")
    assert all(child.trace_id == parent.trace_id for child in found)
    return sorted(found, key=lambda s: (s.start_time_unix_nano, s.end_time_unix_nano))


def stream_completion(server: RunningServer, max_tokens: int, on_first_chunk=lambda: None,
                      **sampling: Any) -> tuple[str, dict]:
    """A streamed completion read to its end: its id and its usage (on_first_chunk() runs as the first one comes)."""
    chunks = server.client().completions.create(model=MODEL, prompt="ROMEO:", max_tokens=max_tokens, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}, **sampling)
    ids, finish_reasons, usage = set(), [], None
    for i, chunk in enumerate(chunks):
        if i == 0:
            on_first_chunk()
        ids.add(chunk.id)
        finish_reasons += [choice.finish_reason for choice in chunk.choices if choice.finish_reason]
        usage = chunk.usage or usage
    assert len(ids) == 1 and finish_reasons == ["length"] and usage is not None
    assert usage.completion_tokens == max_tokens
    return ids.pop(), usage.model_dump()


def test_a_streamed_request_is_one_server_span_with_its_phases_in_order(server, receiver):
    completion_id, usage = stream_completion(server, MAX_TOKENS, temperature=0.5, top_p=0.9, seed=7)
    span = request_span(receiver, f"{completion_id}-0")
    assert span.kind == Span.SpanKind.SPAN_KIND_SERVER and span.parent_span_id == b""  # a trace of its own
    assert span.status.code != Status.STATUS_CODE_ERROR
    assert receiver.resources[receiver.spans.index(span)]["service.name"] == "pagedserve"
    attributes = attributes_of(span)
    assert {name: attributes[name] for name in ("gen_ai.response.model", "gen_ai.request.temperature",
                                                "gen_ai.request.top_p", "gen_ai.request.max_tokens",
                                                "gen_ai.usage.prompt_tokens", "gen_ai.usage.completion_tokens",
                                                "gen_ai.response.finish_reasons", "pagedserve.restarts")} == {
        "gen_ai.response.model": MODEL, "gen_ai.request.temperature": 0.5, "gen_ai.request.top_p": 0.9,
        "gen_ai.request.max_tokens": MAX_TOKENS, "gen_ai.usage.prompt_tokens": usage["prompt_tokens"],
        "gen_ai.usage.completion_tokens": usage["completion_tokens"], "gen_ai.response.finish_reasons": ["length"],
        "pagedserve.restarts": 0}
    queued, prefill, decode = phases = children(receiver, span, len(PHASES))
    assert [phase.name for phase in phases] == PHASES
    assert span.start_time_unix_nano == queued.start_time_unix_nano  # the request's arrival
    assert queued.end_time_unix_nano == prefill.start_time_unix_nano  # first scheduled
    assert prefill.end_time_unix_nano == decode.start_time_unix_nano  # the first token
    assert prefill.start_time_unix_nano < prefill.end_time_unix_nano < decode.end_time_unix_nano
    assert decode.end_time_unix_nano <= span.end_time_unix_nano
    for name, phase in (("gen_ai.latency.time_in_queue", queued), ("gen_ai.latency.time_in_model_prefill", prefill),
                        ("gen_ai.latency.time_in_model_decode", decode)):
        assert attributes[name] == pytest.approx((phase.end_time_unix_nano - phase.start_time_unix_nano) * S, abs=1e-6)
    assert attributes["gen_ai.latency.time_to_first_token"] == pytest.approx(
        (prefill.end_time_unix_nano - span.start_time_unix_nano) * S, abs=1e-6)
    assert attributes["gen_ai.latency.e2e"] == pytest.approx(
        (span.end_time_unix_nano - span.start_time_unix_nano) * S, abs=1e-6)


def test_a_request_with_a_traceparent_joins_the_callers_trace(server, receiver):
    trace_id, parent_id = os.urandom(16).hex(), os.urandom(8).hex()
    completion = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=MAX_TOKENS,
        extra_headers={"traceparent": f"00-{trace_id}-{parent_id}-01", "tracestate": "vendor=1"})
    span = request_span(receiver, f"{completion.id}-0")
    assert (span.trace_id.hex(), span.parent_span_id.hex(), span.trace_state) == (trace_id, parent_id, "vendor=1")
    assert [phase.name for phase in children(receiver, span, len(PHASES))] == PHASES


def test_a_failed_request_has_an_error_status(server, receiver):
    trace_id = os.urandom(16).hex()
    with pytest.raises(openai.InternalServerError):
        server.client().responses.create(model=MODEL, input="Hello", max_output_tokens=MAX_TOKENS,
                                         extra_headers={"traceparent": f"00-{trace_id}-{os.urandom(8).hex()}-01"})
    [span] = receiver.wait_for_spans(lambda s: s.name == "llm_request" and s.trace_id.hex() == trace_id, 1,
                                     "the failed response's span")
    attributes = attributes_of(span)
    assert str(attributes["gen_ai.request.id"]).startswith("resp_")
    assert attributes["gen_ai.response.finish_reasons"] == ["error"]
    assert span.status.code == Status.STATUS_CODE_ERROR and "could not be completed" in span.status.message


def test_a_request_whose_worker_is_killed_mid_stream_has_a_requeued_phase(server, receiver):
    worker_pid = server.worker_pid
    completion_id, usage = stream_completion(server, LONG_MAX_TOKENS,
                                             on_first_chunk=lambda: os.kill(worker_pid, signal.SIGKILL))
    span = request_span(receiver, f"{completion_id}-0")
    attributes = attributes_of(span)
    assert (attributes["pagedserve.restarts"], attributes["gen_ai.usage.completion_tokens"]) == (1, LONG_MAX_TOKENS)
    assert span.status.code != Status.STATUS_CODE_ERROR  # recovery is invisible to the client, and to the span
    phases = children(receiver, span, len(PHASES) + 1)
    [requeued] = [phase for phase in phases if phase.name == "requeued"]
    assert [phase.name for phase in phases if phase.name != "requeued"] == PHASES
    assert attributes_of(requeued)["pagedserve.restart.cause"] == "signal"
    assert "SIGKILL" in str(attributes_of(requeued)["pagedserve.restart.description"])
    decode = next(phase for phase in phases if phase.name == "decode")
    # Killed after its first token: an instant within the decode, whose next token's time the frontend keeps not.
    assert decode.start_time_unix_nano < requeued.start_time_unix_nano == requeued.end_time_unix_nano
    assert requeued.end_time_unix_nano < decode.end_time_unix_nano
    assert server.worker_pid != worker_pid
