"""FailoverClient against real replicas: `python -m server` processes serving the default model.

Three replicas serve the module: `healthy`; `unready`, whose worker was
SIGSTOPped while it loaded after a restart, so the replica answers 503 with
Retry-After (its /health says so) for as long as the module runs; and
`down_url`, a port bound but not listening, so a connect is refused. The
stream-break test starts its own replica and SIGKILLs it mid-stream; the
error-event test starts one that gives up on its worker mid-stream. The SSE
parser is also checked on its own, sans I/O.
"""

from __future__ import annotations

import contextlib
import email.utils
import os
import re
import signal
import socket
import time

import pytest

from shared.failover_client import (
    AllAttemptsFailed,
    FailoverClient,
    RequestRejected,
    StreamFailed,
    StreamInterrupted,
    _retry_after,
)
from shared.sse_parser import SseEvent, SseParser

from running_server import RunningServer, start_server, stop_server

FLAGS = ("--device", "cpu", "--dtype", "float32")
COMPLETION = {"prompt": "ROMEO:", "max_tokens": 8}
CHAT = {"messages": [{"role": "user", "content": "Speak, friend."}], "max_tokens": 8}
LONG_STREAM = {"prompt": "ROMEO:", "max_tokens": 400, "ignore_eos": True}
NOT_READY = "no engine worker is ready"
QUICK = {"backoff_base": 0.01, "backoff_max": 0.05}  # keep back-off out of the timings


@pytest.fixture(scope="module")
def healthy(tmp_path_factory) -> RunningServer:
    server = start_server(tmp_path_factory.mktemp("healthy"), None, *FLAGS)
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def unready(tmp_path_factory) -> RunningServer:
    """A replica whose restarted worker is stopped before READY: 503 + Retry-After on /health and generation."""
    server = start_server(tmp_path_factory.mktemp("unready"), None, *FLAGS)
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


def attempt_log(attempts) -> list[tuple[str, int | None]]:
    return [(attempt.url, attempt.status) for attempt in attempts]


def counts(server: RunningServer) -> dict[str, float]:
    """What would rise if the replica had been sent a generation request."""
    samples = server.scrape()
    totals = {}
    for prefix in ("vllm:prompt_tokens_total", "vllm:e2e_request_latency_seconds_count", "vllm:num_requests_running"):
        totals[prefix] = sum(value for name, value in samples.items() if name.startswith(prefix + "{"))
    return totals


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
    assert error.error == {"message": "max_tokens must be an integer >= 1, got 0", "type": "invalid_request_error",
                           "param": "max_tokens", "code": None}
    assert "max_tokens must be an integer >= 1, got 0" in str(error) and "HTTP 400" in str(error)
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


def test_a_stream_broken_after_output_is_not_retried(tmp_path, healthy):
    victim = start_server(tmp_path, None, *FLAGS)
    try:
        before = counts(healthy)
        client = FailoverClient([victim.base_url, healthy.base_url], first_replica=0, **QUICK)
        stream = client.stream("/v1/completions", LONG_STREAM)
        events = []
        with pytest.raises(StreamInterrupted) as interrupted:
            for event in stream:
                events.append(event)
                if len(events) == 3:
                    victim.process.kill()  # the frontend; its worker follows (PR_SET_PDEATHSIG)
        error = interrupted.value
        assert error.url == victim.base_url and error.num_events == len(events) >= 3
        assert 1 <= error.num_output_events <= len(events)
        assert f"after {len(events)} events ({error.num_output_events} carrying output)" in str(error)
        assert "not retried on another replica because output had already been delivered" in str(error)
        assert attempt_log(error.attempts) == [(victim.base_url, 200)]
        assert counts(healthy) == before, "the healthy replica must not have been sent the request"
    finally:
        stop_server(victim)


def test_an_error_event_after_output_is_raised(tmp_path, healthy):
    """A replica whose worker dies at its 4th step and which may not restart it: it fails the stream and exits."""
    dying = start_server(tmp_path, None, *FLAGS, "--max-worker-restarts", "0", env={"PAGEDSERVE_FAULT": "exit@3"})
    try:
        client = FailoverClient([dying.base_url, healthy.base_url], first_replica=0, **QUICK)
        stream = client.stream("/v1/completions", LONG_STREAM)
        events = []
        with pytest.raises(StreamFailed) as failed:
            events.extend(stream)
        error = failed.value
        assert events and error.url == dying.base_url and error.num_events == len(events)
        assert error.error["type"] == "server_error" and "could not be kept running" in error.error["message"]
        assert "could not be kept running" in str(error)
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
