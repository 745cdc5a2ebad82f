"""server/tracing.py without a server: a request's phases and span attributes from its times, the exporter's set-up
errors, and what --otlp-traces-endpoint costs when off (OpenTelemetry is not even imported). The spans as a
collector receives them from a real server: test_tracing_e2e.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from server.__main__ import build_parser, server_config_from_args
from server.server import request_tracer
from server.tracing import GRPC_PACKAGE, PROTOCOL_ENV, phases, request_attributes, span_exporter
from server.worker.request_state import RequestState, Requeue
from shared.sampling_params import SamplingParams

ARRIVAL, END = 10.0, 20.0


def request(scheduled: float | None = None, first: float | None = None, last: float | None = None,
            requeues: tuple[float, ...] = ()) -> RequestState:
    state = RequestState("cmpl-1-0", [1, 2, 3], SamplingParams(max_tokens=4), arrival_time=ARRIVAL)
    state.scheduled_time, state.first_token_time, state.last_token_time = scheduled, first, last
    state.requeues = [Requeue(time, "signal", f"killed at {time}") for time in requeues]
    return state


def spans_of(state: RequestState) -> list[tuple[str, float, float]]:
    return [(phase.name, phase.start, phase.end) for phase in phases(state, END)]


def test_the_phases_go_as_far_as_the_request_got():
    assert spans_of(request()) == [("queued", ARRIVAL, END)]  # never scheduled: queued to its end
    assert spans_of(request(11.0)) == [("queued", ARRIVAL, 11.0), ("prefill", 11.0, END)]
    assert spans_of(request(11.0, 12.0, 15.0)) == [("queued", ARRIVAL, 11.0), ("prefill", 11.0, 12.0),
                                                   ("decode", 12.0, 15.0)]


@pytest.mark.parametrize(("requeued_at", "resumed_at"), [
    (10.5, 11.0),  # waiting in the worker: until a worker first ran it
    (11.5, 12.0),  # in prefill: until its first token
    (13.0, 13.0),  # mid-decode: an instant (the next token's time is not kept)
])
def test_a_requeue_lasts_until_the_next_event_the_request_keeps(requeued_at, resumed_at):
    [requeued] = [phase for phase in phases(request(11.0, 12.0, 15.0, (requeued_at,)), END)
                  if phase.name == "requeued"]
    assert (requeued.start, requeued.end) == (requeued_at, resumed_at)
    assert requeued.attributes == {"pagedserve.restart.cause": "signal",
                                   "pagedserve.restart.description": f"killed at {requeued_at}"}


def test_the_attributes_hold_only_the_latencies_the_request_reached():
    attributes = request_attributes(request(11.0, requeues=(10.5,)), "abort", END, "tiny")
    assert {name: value for name, value in attributes.items() if name.startswith("gen_ai.latency.")} == {
        "gen_ai.latency.time_in_queue": 1.0, "gen_ai.latency.e2e": END - ARRIVAL}
    assert (attributes["gen_ai.request.id"], attributes["gen_ai.response.model"]) == ("cmpl-1-0", "tiny")
    assert (attributes["gen_ai.usage.prompt_tokens"], attributes["gen_ai.usage.completion_tokens"]) == (3, 0)
    assert (attributes["gen_ai.response.finish_reasons"], attributes["pagedserve.restarts"]) == (("abort",), 1)


def test_the_exporter_follows_the_protocol_variable(monkeypatch):
    monkeypatch.delenv(PROTOCOL_ENV, raising=False)
    with pytest.raises(ValueError, match="http:// or https:// URL"):
        span_exporter("127.0.0.1:4318")
    span_exporter("http://127.0.0.1:4318/v1/traces").shutdown()
    monkeypatch.setenv(PROTOCOL_ENV, "http/json")
    with pytest.raises(ValueError, match="http/protobuf or grpc, got 'http/json'"):
        span_exporter("http://127.0.0.1:4318/v1/traces")
    monkeypatch.setenv(PROTOCOL_ENV, "grpc")
    try:
        import opentelemetry.exporter.otlp.proto.grpc  # noqa: F401  # pyright: ignore[reportMissingImports]
    except ImportError:
        with pytest.raises(ValueError, match=f"needs the package {GRPC_PACKAGE}"):
            span_exporter("http://127.0.0.1:4317")
    else:
        span_exporter("http://127.0.0.1:4317").shutdown()


def test_the_flag_without_opentelemetry_is_a_start_up_error_naming_the_extra(monkeypatch):
    config = server_config_from_args(build_parser().parse_args(["--otlp-traces-endpoint", "http://x:4318/v1/traces"]))
    assert config.otlp_traces_endpoint == "http://x:4318/v1/traces"
    monkeypatch.setitem(sys.modules, "server.tracing", None)  # what an import without the package meets
    with pytest.raises(ValueError, match=r"pip install 'pagedserve\[otel\]'"):
        request_tracer(config)


def test_tracing_off_imports_no_opentelemetry():
    check = ("import sys\n"
             "from server.__main__ import build_parser, server_config_from_args\n"
             "from server.server import request_tracer\n"
             "assert request_tracer(server_config_from_args(build_parser().parse_args([]))) is None\n"
             "print(sorted(name for name in sys.modules if name.startswith('opentelemetry')))\n")
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout) == (0, "[]\n"), result.stderr
