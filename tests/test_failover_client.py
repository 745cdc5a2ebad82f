"""FailoverClient against real replicas: `python -m server` processes serving the default model.

Three replicas serve the module: `healthy`; `unready`, whose worker was
SIGSTOPped while it loaded after a restart, so the replica answers 503 with
Retry-After (its /health says so) for as long as the module runs; and
`down_url`, a port bound but not listening, so a connect is refused. The
stream-break test starts its own replica and SIGKILLs it mid-stream; the
error-event test starts one that gives up on its worker mid-stream. Streams
of both shapes go through: completions chunks up to data: [DONE], and the
Responses API's named events up to response.completed or .incomplete. The
SSE parser and the stream reader are also checked on their own, sans I/O.
"""

from __future__ import annotations

import contextlib
import email.utils
import itertools
import json
import os
import re
import signal
import socket
import time

import pytest

from helpers.metrics_scrape import total
from helpers.running_server import RunningServer, start_server, stop_server
from tools.client.failover_client import (
    AllAttemptsFailed,
    FailoverClient,
    RequestRejected,
    StreamFailed,
    StreamInterrupted,
    _retry_after,
)
from tools.client.failover_stream import ErrorEvent, StreamEvent, StreamReader
from tools.client.sse_parser import SseEvent, SseParser

FLAGS = ("--device", "cpu", "--dtype", "float32")
COMPLETION = {"prompt": "ROMEO:", "max_tokens": 8}
CHAT = {"messages": [{"role": "user", "content": "Speak, friend."}], "max_tokens": 8}
LONG_STREAM = {"prompt": "ROMEO:", "max_tokens": 400, "ignore_eos": True}
RESPONSE = {"input": "Speak, friend.", "max_output_tokens": 8}
LONG_RESPONSE = {"input": "Speak, friend.", "max_output_tokens": 400, "temperature": 0}  # greedy runs all 400 tokens
RESPONSE_PRELUDE = ["response.created", "response.in_progress", "response.output_item.added",
                    "response.content_part.added"]  # the events before the first output
DELTA = "response.output_text.delta"
NOT_READY = "no engine worker is ready"
QUICK = {"backoff_base": 0.01, "backoff_max": 0.05}  # keep back-off out of the timings


@pytest.fixture(scope="module")
def healthy(tmp_path_factory) -> RunningServer:
    server = start_server(tmp_path_factory.mktemp("healthy"), None, *FLAGS)
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def unready(tmp_path_factory) -> RunningServer:
    """A replica whose restarted worker is stopped before READY: 503 + Retry-After on /health and generation.
    No standby, which would be ready before the first worker dies."""
    server = start_server(tmp_path_factory.mktemp("unready"), None, *FLAGS, "--standby-workers", "0")
    stopped_pid = None
    try:
        first_pid = server.worker_pid
        os.kill(first_pid, signal.SIGKILL)
        server.wait_for(lambda: server.worker_pid != first_pid, "the restarted worker's pid")
        stopped_pid = server.worker_pid
        os.kill(stopped_pid, signal.SIGSTOP)  # it is still importing torch: seconds from READY
        server.wait_for(lambda: server.get("/health")[0] == 503, "/health 503 while the worker is stopped", timeout=10)
        yield server
    finally:
        if stopped_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped_pid, signal.SIGKILL)
        stop_server(server)


@pytest.fixture(scope="module")
def down_url() -> str:
    """A port that refuses connections: bound (so nobody else takes it) but never listening."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def assert_finished_response(events: list[dict]) -> dict:
    """A whole Responses stream, each event once and in order: the finished response (its last event's)."""
    assert [event["type"] for event in events[:4]] == RESPONSE_PRELUDE
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    last = events[-1]["response"]
    assert events[-1]["type"] == f"response.{last['status']}" and last["status"] in ("completed", "incomplete")
    text = "".join(event["delta"] for event in events if event["type"] == DELTA)
    assert text and text == last["output"][0]["content"][0]["text"]
    return last


def attempt_log(attempts) -> list[tuple[str, int | None]]:
    return [(attempt.url, attempt.status) for attempt in attempts]


def counts(server: RunningServer) -> dict[str, float]:
    """What would rise if the replica had been sent a generation request."""
    samples = server.scrape()
    names = ("vllm:prompt_tokens_total", "vllm:e2e_request_latency_seconds_count", "vllm:num_requests_running")
    return {name: total(samples, name) for name in names}


# ---------------------------------------------------------------------------------------------- non-streaming


def test_a_down_replica_is_skipped_and_every_call_succeeds(healthy, down_url):
    client = FailoverClient([down_url, healthy.base_url], first_replica=0, **QUICK)
    for number in range(4):
        reply = client.request("POST", "/v1/completions", COMPLETION)
        assert reply.status == 200 and reply.url == healthy.base_url
        assert reply.body["choices"][0]["text"] and reply.body["usage"]["completion_tokens"] == 8
        if number % 2 == 0:  # the call started at the down replica
            assert attempt_log(reply.attempts) == [(down_url, None), (healthy.base_url, 200)]
            assert reply.attempts[0].outcome == "connection refused"
        else:
            assert attempt_log(reply.attempts) == [(healthy.base_url, 200)]
    assert client.post("/v1/chat/completions", CHAT)["choices"][0]["message"]["role"] == "assistant"
    assert client.request("GET", "/v1/models").body["data"][0]["id"]


def test_a_responses_call_fails_over_and_is_stored_once(healthy, down_url):
    before = counts(healthy)
    client = FailoverClient([down_url, healthy.base_url], first_replica=0, **QUICK)
    reply = client.request("POST", "/v1/responses", RESPONSE)
    assert attempt_log(reply.attempts) == [(down_url, None), (healthy.base_url, 200)]
    assert reply.body["object"] == "response" and reply.body["output"][0]["content"][0]["text"]
    status, _, body = healthy.get(f"/v1/responses/{reply.body['id']}")
    assert status == 200 and json.loads(body) == reply.body
    assert counts(healthy)["vllm:e2e_request_latency_seconds_count"] == before["vllm:e2e_request_latency_seconds_count"] + 1


def test_a_replica_answering_503_is_skipped(healthy, unready):
    status, headers, body = unready.request("POST", "/v1/completions", COMPLETION)
    assert status == 503 and headers["retry-after"] == "1" and NOT_READY in body.decode()
    client = FailoverClient([unready.base_url, healthy.base_url], first_replica=0, **QUICK)
    for _ in range(2):
        assert client.post("/v1/completions", COMPLETION)["choices"][0]["text"]
    reply = client.request("POST", "/v1/chat/completions", CHAT)
    assert attempt_log(reply.attempts) == [(unready.base_url, 503), (healthy.base_url, 200)]
    assert reply.attempts[0].retry_after == 1.0 and NOT_READY in reply.attempts[0].outcome


def test_a_replica_that_does_not_answer_times_out(healthy, unready):
    os.kill(unready.process.pid, signal.SIGSTOP)  # the whole frontend: the kernel accepts, nothing answers
    try:
        client = FailoverClient([unready.base_url, healthy.base_url], timeout=1.0, first_replica=0, **QUICK)
        reply = client.request("GET", "/v1/models")  # no generation: the healthy replica answers within the timeout
    finally:
        os.kill(unready.process.pid, signal.SIGCONT)
    assert reply.url == healthy.base_url and attempt_log(reply.attempts) == [(unready.base_url, None), (healthy.base_url, 200)]
    assert reply.attempts[0].outcome == "timed out (nothing within 1 s)" and reply.attempts[0].seconds >= 1.0


def test_retry_after_is_waited_out_up_to_the_cap(unready):
    started = time.monotonic()
    with pytest.raises(AllAttemptsFailed) as failed:
        FailoverClient([unready.base_url], max_attempts=3, retry_after_max=30, **QUICK).post("/v1/completions", COMPLETION)
    waited = time.monotonic() - started
    assert attempt_log(failed.value.attempts) == [(unready.base_url, 503)] * 3
    assert 1.9 <= waited < 6.0, f"two retries after Retry-After: 1 should take about 2 s, took {waited:.2f} s"

    started = time.monotonic()
    with pytest.raises(AllAttemptsFailed):
        FailoverClient([unready.base_url], max_attempts=3, retry_after_max=0.2, **QUICK).post("/v1/completions", COMPLETION)
    waited = time.monotonic() - started
    assert 0.35 <= waited < 1.5, f"Retry-After capped at 0.2 s should make two retries take about 0.4 s, took {waited:.2f} s"


def test_all_replicas_failing_raise_one_error_listing_every_attempt(unready, down_url):
    client = FailoverClient([down_url, unready.base_url], max_attempts=4, retry_after_max=0.2, first_replica=0, **QUICK)
    started = time.monotonic()
    with pytest.raises(AllAttemptsFailed) as failed:
        client.post("/v1/completions", COMPLETION)
    assert time.monotonic() - started < 3.0
    assert attempt_log(failed.value.attempts) == [(down_url, None), (unready.base_url, 503)] * 2
    lines = str(failed.value).splitlines()
    assert lines[0] == "POST /v1/completions failed on all 4 attempts:"
    assert lines[1].startswith(f"  1. {down_url}: connection refused")
    assert lines[2].startswith(f"  2. {unready.base_url}: HTTP 503: {NOT_READY}") and "Retry-After 1 s" in lines[2]
    assert len(lines) == 5


def test_a_bad_request_is_raised_at_once_with_the_servers_error(healthy, down_url):
    client = FailoverClient([healthy.base_url, down_url], first_replica=0, **QUICK)
    with pytest.raises(RequestRejected) as rejected:
        client.post("/v1/completions", {**COMPLETION, "max_tokens": 0})
    error = rejected.value
    assert error.status == 400 and error.url == healthy.base_url
    assert error.error == {"message": "max_tokens must be >= 1, got 0: 0 is taken only with echo (the prompt alone, "
                                      "scored with logprobs), and without echo there would be nothing to return",
                           "type": "invalid_request_error", "param": "max_tokens", "code": None}
    assert "max_tokens must be >= 1, got 0" in str(error) and "HTTP 400" in str(error)
    assert attempt_log(error.attempts) == [(healthy.base_url, 400)], "a 400 must not be retried on another replica"

    client = FailoverClient([healthy.base_url, down_url], first_replica=0, **QUICK)
    with pytest.raises(RequestRejected) as rejected:
        next(iter(client.stream("/v1/chat/completions", {**CHAT, "messages": []})))
    assert rejected.value.status == 400 and rejected.value.error["param"] == "messages"
    assert len(rejected.value.attempts) == 1


# ---------------------------------------------------------------------------------------------- streaming


def test_a_stream_fails_over_before_its_first_token(healthy, unready, down_url):
    client = FailoverClient([down_url, unready.base_url, healthy.base_url], first_replica=0, retry_after_max=0.2,
                            **QUICK)
    with client.stream("/v1/chat/completions", CHAT) as stream:
        events = list(stream)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"  # held back until output came, then delivered
    assert "".join(event["choices"][0]["delta"].get("content", "") for event in events)
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert stream.url == healthy.base_url and stream.num_events == len(events)
    assert attempt_log(stream.attempts) == [(down_url, None), (unready.base_url, 503), (healthy.base_url, 200)]
    assert stream.attempts[-1].outcome == "HTTP 200, stream complete"


def test_a_responses_stream_ends_at_its_last_event_on_one_attempt(healthy, down_url):
    before = counts(healthy)
    client = FailoverClient([healthy.base_url, down_url], first_replica=0, **QUICK)
    with client.stream("/v1/responses", RESPONSE) as stream:
        events = list(stream)
    response = assert_finished_response(events)
    assert stream.url == healthy.base_url and stream.num_events == len(events)
    assert stream.num_output_events == [event["type"] for event in events].count(DELTA)
    assert attempt_log(stream.attempts) == [(healthy.base_url, 200)], "a complete stream must not be tried again"
    assert stream.attempts[0].outcome == "HTTP 200, stream complete"
    status, _, body = healthy.get(f"/v1/responses/{response['id']}")
    assert status == 200 and json.loads(body) == response
    assert counts(healthy)["vllm:e2e_request_latency_seconds_count"] == before["vllm:e2e_request_latency_seconds_count"] + 1


@pytest.mark.parametrize("path, body", [("/v1/completions", LONG_STREAM), ("/v1/responses", LONG_RESPONSE)])
def test_a_stream_broken_after_output_is_not_retried(tmp_path, healthy, path, body):
    victim = start_server(tmp_path, None, *FLAGS)
    try:
        before = counts(healthy)
        client = FailoverClient([victim.base_url, healthy.base_url], first_replica=0, **QUICK)
        stream = client.stream(path, body)
        events = []
        with pytest.raises(StreamInterrupted) as interrupted:
            for event in stream:
                events.append(event)
                if len(events) == 3:  # output has arrived: the Responses prelude is held back until it does
                    victim.process.kill()  # the frontend; its worker follows (PR_SET_PDEATHSIG)
        error = interrupted.value
        assert error.url == victim.base_url and error.num_events == len(events) >= 3
        assert 1 <= error.num_output_events <= len(events)
        if path == "/v1/responses":
            assert [event["type"] for event in events[:5]] == [*RESPONSE_PRELUDE, DELTA]
        assert f"after {len(events)} events ({error.num_output_events} carrying output)" in str(error)
        assert "not retried on another replica because output had already been delivered" in str(error)
        assert attempt_log(error.attempts) == [(victim.base_url, 200)]
        assert counts(healthy) == before, "the healthy replica must not have been sent the request"
    finally:
        stop_server(victim)


@pytest.mark.parametrize("path, body", [("/v1/completions", LONG_STREAM), ("/v1/responses", LONG_RESPONSE)])
def test_an_error_event_after_output_is_raised(tmp_path, healthy, path, body):
    """A replica whose worker dies at its 4th step and which may not restart it: it fails the stream and exits."""
    dying = start_server(tmp_path, None, *FLAGS, "--max-worker-restarts", "0", env={"PAGEDSERVE_FAULT": "exit@3"})
    try:
        client = FailoverClient([dying.base_url, healthy.base_url], first_replica=0, **QUICK)
        stream = client.stream(path, body)
        events = []
        with pytest.raises(StreamFailed) as failed:
            events.extend(stream)
        error = failed.value
        assert events and error.url == dying.base_url and error.num_events == len(events) and stream.num_output_events
        assert error.kind == "server_error" and "could not be kept running" in error.error["message"]
        assert "server_error: " in str(error) and "could not be kept running" in str(error)
        if path == "/v1/responses":  # the Responses API's error event: its kind is in code
            assert error.error["type"] == "error" and error.error["code"] == "server_error"
        assert attempt_log(error.attempts) == [(dying.base_url, 200)]
    finally:
        stop_server(dying)


# ---------------------------------------------------------------------------------------------- SSE, sans I/O

SSE_BYTES = (b': ping\n\ndata: {"a": 1}\n\nevent: error\r\ndata: {"message": "x"}\r\n\r\n'
             b"data: line one\ndata: line two\nid: 7\n\n\n\ndata: [DONE]\n\n")
SSE_EVENTS = [SseEvent('{"a": 1}'), SseEvent('{"message": "x"}', "error"), SseEvent("line one\nline two"),
              SseEvent("[DONE]")]


def test_sse_parser_on_the_whole_input_and_byte_by_byte():
    assert SseParser().feed(SSE_BYTES) == SSE_EVENTS
    parser = SseParser()
    assert [event for index in range(len(SSE_BYTES)) for event in parser.feed(SSE_BYTES[index:index + 1])] == SSE_EVENTS


def test_sse_parser_keeps_an_unfinished_event_until_its_blank_line():
    parser = SseParser()
    assert parser.feed(SSE_BYTES + b'data: {"b": 2}\n') == SSE_EVENTS
    assert parser.feed(b"\n") == [SseEvent('{"b": 2}')]


# ---------------------------------------------------------------------------------------------- stream reader, sans I/O


def responses_event(event_type: str, sequence_number: int, **fields) -> bytes:
    """A Responses API event as a replica sends it."""
    payload = json.dumps({"type": event_type, "sequence_number": sequence_number, **fields})
    return f"event: {event_type}\ndata: {payload}\n\n".encode()


PRELUDE_BYTES = b"".join(responses_event(event_type, number) for number, event_type in enumerate(RESPONSE_PRELUDE))
ROLE_CHUNK = b'data: {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}\n\n'
CONTENT_CHUNK = b'data: {"choices": [{"index": 0, "delta": {"content": "Hi"}}]}\n\n'


def test_a_replicas_responses_stream_read_whole_and_byte_by_byte(healthy):
    status, headers, data = healthy.request("POST", "/v1/responses", {**RESPONSE, "stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream"), data[:200]
    sent = [json.loads(sse.data) for sse in SseParser().feed(data)]
    assert_finished_response(sent)
    reader = StreamReader()
    events = list(reader.feed(data + CONTENT_CHUNK))  # nothing after the last event is read
    assert reader.is_complete and [event.payload for event in events] == sent
    assert [event.is_output for event in events] == [payload["type"] == DELTA for payload in sent]
    assert [event.is_last for event in events] == [False] * (len(sent) - 1) + [True]

    reader, releases = StreamReader(), []
    for index in range(len(data)):
        releases += [(index, event.payload) for event in reader.feed(data[index:index + 1])]
    first_output_end = data.index(b"\n\n", data.index(b"event: " + DELTA.encode())) + 1  # its blank line's last byte
    assert [payload for _, payload in releases] == sent
    assert {index for index, _ in releases[:5]} == {first_output_end}, "the prelude is released with the first output"


def test_a_responses_stream_with_no_output_is_released_at_its_end():
    reader = StreamReader()
    assert list(reader.feed(PRELUDE_BYTES + responses_event(DELTA, 4, delta=""))) == [], "an empty delta is no output"
    events = list(reader.feed(responses_event("response.output_text.done", 5, text="")
                              + responses_event("response.incomplete", 6, response={"status": "incomplete"})))
    assert [event.payload["sequence_number"] for event in events] == list(range(7))
    assert not any(event.is_output for event in events) and events[-1].is_last and reader.is_complete


def test_a_chat_stream_holds_its_role_chunk_until_output_and_ends_at_done():
    reader = StreamReader()
    assert list(reader.feed(ROLE_CHUNK)) == []
    events = list(reader.feed(CONTENT_CHUNK + b"data: [DONE]\n\n" + CONTENT_CHUNK))
    assert events == [StreamEvent(json.loads(ROLE_CHUNK[6:])), StreamEvent(json.loads(CONTENT_CHUNK[6:]), is_output=True),
                      StreamEvent(None, is_last=True)]
    assert reader.is_complete


RESPONSES_ERROR = {"type": "error", "sequence_number": 5, "code": "service_unavailable",
                   "message": "the conversation store is unavailable", "param": None}
CHAT_ERROR = {"message": "the engine worker could not be kept running", "type": "server_error", "param": None, "code": None}


@pytest.mark.parametrize("error_bytes, error, kind, is_callers_fault", [
    (b"event: error\ndata: " + json.dumps(RESPONSES_ERROR).encode() + b"\n\n", RESPONSES_ERROR, "service_unavailable", False),
    (responses_event("error", 5, code="invalid_request_error", message="m", param=None),
     {"type": "error", "sequence_number": 5, "code": "invalid_request_error", "message": "m", "param": None},
     "invalid_request_error", True),
    (b"data: " + json.dumps({"error": CHAT_ERROR}).encode() + b"\n\n", CHAT_ERROR, "server_error", False),
])
def test_an_error_event_is_raised_after_the_events_before_it(error_bytes, error, kind, is_callers_fault):
    events = StreamReader().feed(PRELUDE_BYTES + responses_event(DELTA, 4, delta="To") + error_bytes)
    assert [event.payload["type"] for event in itertools.islice(events, 5)] == [*RESPONSE_PRELUDE, DELTA]
    with pytest.raises(ErrorEvent) as raised:
        next(events)
    assert raised.value.error == error and raised.value.kind == kind and raised.value.is_callers_fault is is_callers_fault


@pytest.mark.parametrize("line", [b"data: [1, 2]\n\n", b"data: not json\n\n"])
def test_a_data_line_that_is_not_a_json_object_is_refused(line):
    with pytest.raises(ValueError):
        list(StreamReader().feed(PRELUDE_BYTES + line))


@pytest.mark.parametrize("value, seconds", [("1", 1.0), ("0.5", 0.5), ("-3", 0.0), ("soon", None), (None, None)])
def test_retry_after_values(value, seconds):
    assert _retry_after(value) == seconds


def test_retry_after_as_an_http_date():
    assert 55 <= _retry_after(email.utils.formatdate(time.time() + 60, usegmt=True)) <= 60


# ---------------------------------------------------------------------------------------------- configuration


@pytest.mark.parametrize("kwargs, message", [
    ({"urls": []}, "urls must be a non-empty list"),
    ({"urls": "http://a:1"}, "urls must be a non-empty list"),
    ({"urls": ["ftp://a:1"]}, "a replica URL looks like 'http://host:port'"),
    ({"urls": ["http://a:1"], "timeout": 0}, "timeout must be a number of seconds > 0, got 0"),
    ({"urls": ["http://a:1"], "max_attempts": 0}, "max_attempts must be an integer >= 1, got 0"),
    ({"urls": ["http://a:1"], "backoff_base": 2, "backoff_max": 1}, "need 0 <= backoff_base <= backoff_max"),
    ({"urls": ["http://a:1"], "retry_after_max": -1}, "retry_after_max must be a number of seconds >= 0, got -1"),
    ({"urls": ["http://a:1"], "first_replica": 1}, "first_replica must be an index into urls, 0 to 0, got 1"),
    ({"urls": ["http://a:1"], "api_key": ""}, "api_key must be a non-empty string or None"),
])
def test_bad_settings_are_refused(kwargs, message):
    urls = kwargs.pop("urls")
    with pytest.raises(ValueError, match=re.escape(message)):
        FailoverClient(urls, **kwargs)
