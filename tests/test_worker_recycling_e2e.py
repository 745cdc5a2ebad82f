"""Memory that stays accounted for, as users meet it: `python -m server` in a subprocess, with a worker made to leak
(PAGEDSERVE_FAULT, gpu_worker/process/fault_injection.py) or limited to a number of requests, spoken to over HTTP.

- The idle block audit catches a KV block leaked on purpose, and says so in /metrics and in the log;
  /debug/memory (--debug-memory) shows the frontend's allocation sites and has the worker log its snapshot.
- A worker made to grow past --worker-memory-limit is recycled while 8 streams run: every stream completes,
  identical to a fault-free run (the CPU path in float32 on a sharpened checkpoint, as in
  test_supervisor_e2e.py), and the restart is counted under cause "memory", off the restart budget.
- --worker-max-requests 50 under 200 requests: the worker is recycled at least 3 times and no request is lost.
- A memory limit below a fresh worker's memory is turned off with an error, not obeyed by recycling in a loop.
"""

from __future__ import annotations

import concurrent.futures
import json
import re

import pytest

from helpers.completion_streams import mixed_completions, run_streams
from helpers.running_server import WAIT_S, RunningServer, start_server, stop_server

MODEL = "tiny"
LABEL = f'model_name="{MODEL}"'
NUM_STREAMS = 8
MAX_TOKENS = 200
GROWTH_ALLOWED = 64 * 2**20  # the memory limit: the fault-free worker's unexplained memory plus this
SERVER_FLAGS = ("--served-model-name", MODEL, "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "512",
                "--max-num-seqs", "8", "--standby-workers", "1", "--shared-kv-cache")


def workload() -> list[dict]:
    """NUM_STREAMS completions, long enough to outlast a recycle."""
    return mixed_completions(MODEL, NUM_STREAMS, MAX_TOKENS)


def restarts(server: RunningServer, cause: str) -> float:
    return server.scrape()[f'pagedserve:worker_restarts_total{{cause="{cause}",{LABEL}}}']


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory, checkpoint) -> tuple[list[str], float]:
    """The fault-free streamed texts of workload(), and the worker's unexplained memory after them."""
    server = start_server(tmp_path_factory.mktemp("fault-free"), checkpoint, *SERVER_FLAGS)
    try:
        streams, futures = run_streams(server, workload())
        texts = [future.result(timeout=WAIT_S).text for future in futures]
        samples = server.scrape()
        assert samples[f"pagedserve:kv_block_audit_failures_total{{{LABEL}}}"] == 0
        assert samples[f'pagedserve:worker_memory_bytes{{kind="weights",{LABEL}}}'] > 0
        assert samples[f"pagedserve:frontend_memory_bytes{{{LABEL}}}"] > 0
        assert server.get("/debug/memory")[0] == 404, "off without --debug-memory"
        return texts, samples[f'pagedserve:worker_memory_bytes{{kind="unexplained",{LABEL}}}']
    finally:
        stop_server(server)


def test_the_idle_block_audit_reports_a_leaked_block(tmp_path, checkpoint):
    server = start_server(tmp_path, checkpoint, *SERVER_FLAGS, "--debug-memory", env={"PAGEDSERVE_FAULT": "leak@3"})
    try:
        for _ in range(2):  # each batch ends in an idle worker: one audit each
            streams, futures = run_streams(server, workload()[:2])
            assert all(future.result(timeout=WAIT_S).finish_reason == "length" for future in futures)
        metric = f"pagedserve:kv_block_audit_failures_total{{{LABEL}}}"
        server.wait_for(lambda: server.scrape()[metric] >= 2, "two failed audits in /metrics")
        log = server.log.read_text()
        assert "KV block audit failed: expected all 512 KV blocks free or held by the prefix cache" in log
        assert "1 still referenced" in log
        status, _, body = server.get("/debug/memory")
        snapshot = json.loads(body)
        assert status == 200 and snapshot["frontend"]["top_sites"] and snapshot["frontend"]["rss_bytes"] > 0
        assert snapshot["worker"]["rss_bytes"] >= snapshot["worker"]["unexplained_bytes"] > 0
        snapshot_line = re.compile(r"memory snapshot: RSS [0-9.]+ MiB .*; malloc's bytes in use [0-9.]+ MiB;")
        server.wait_for(lambda: snapshot_line.search(server.log.read_text()), "the worker's snapshot in the log")
    finally:
        stop_server(server)


def test_a_growing_worker_is_recycled_at_the_limit_while_8_streams_run(tmp_path, checkpoint, fault_free):
    expected, unexplained = fault_free
    limit = int(unexplained + GROWTH_ALLOWED)
    server = start_server(tmp_path, checkpoint, *SERVER_FLAGS, "--worker-memory-limit", str(limit),
                          env={"PAGEDSERVE_FAULT": "grow@0:epoch=1"})
    try:
        server.wait_for(lambda: server.scrape()["pagedserve:standby_worker_ready{" + LABEL + "}"] == 1,
                        "a ready standby")
        streams, futures = run_streams(server, workload())
        results = [future.result(timeout=WAIT_S) for future in futures]
        for i, (stream, text) in enumerate(zip(results, expected)):
            assert (stream.finish_reason, stream.completion_tokens) == ("length", MAX_TOKENS), i
            assert stream.text == text, f"stream {i}: a piece was duplicated, lost or changed"
        assert restarts(server, "memory") == 1
        assert sum(restarts(server, cause) for cause in ("exit", "signal", "hang", "start_failure")) == 0
        log = server.log.read_text()
        assert "is recycled: its unexplained memory is" in log and "not counted toward the restart limit" in log
        assert "requests in flight will be re-sent" in log and "a standby took over" in log
    finally:
        stop_server(server)


def test_a_worker_is_recycled_every_50_requests_and_no_request_is_lost(tmp_path, checkpoint):
    """Without a standby (the other test has one): each recycle drains the worker and starts a new one at once."""
    server = start_server(tmp_path, checkpoint, *SERVER_FLAGS, "--worker-max-requests", "50", "--standby-workers", "0")
    try:
        client = server.client()

        def complete(i: int):
            return client.completions.create(model=MODEL, prompt=f"Request number {i}", max_tokens=16,
                                             temperature=0, extra_body={"ignore_eos": True})

        with concurrent.futures.ThreadPoolExecutor(4) as pool:  # a recycle is seen within 50 ms: a few requests over
            completions = list(pool.map(complete, range(200)))
        assert [c.usage.completion_tokens for c in completions] == [16] * 200
        assert restarts(server, "max_requests") >= 3
        assert server.process.poll() is None, "recycling never spends the restart budget"
    finally:
        stop_server(server)


def test_a_memory_limit_below_a_fresh_worker_is_turned_off_not_looped(tmp_path, checkpoint):
    """A limit no new worker can start under would have the supervisor replace workers forever: it says so instead."""
    server = start_server(tmp_path, checkpoint, *SERVER_FLAGS, "--worker-memory-limit", "1MiB",
                          "--standby-workers", "0")
    try:
        server.wait_for(lambda: "starts over a memory limit" in server.log.read_text(), "the error in the log")
        completion = server.client().completions.create(model=MODEL, prompt="Still serving", max_tokens=8,
                                                        extra_body={"ignore_eos": True})
        assert completion.usage.completion_tokens == 8
        assert restarts(server, "memory") == 0
        assert "its unexplained memory is" in server.log.read_text() and "memory recycling is off" in server.log.read_text()
    finally:
        stop_server(server)
