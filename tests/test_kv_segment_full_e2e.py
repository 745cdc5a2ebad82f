"""A server whose /dev/shm has no room for the shared KV cache: its first worker keeps a private cache and the server
says so (its log, /metrics); every later worker, the standby included, is private too; and a standby that takes
over a stream after a SIGKILL finishes it (it used to map the segment's holes and die of SIGBUS, and the request
in flight was failed as a poison).

The server runs in a private mount namespace over a small tmpfs /dev/shm that a filler file has nearly filled
(root, or the right to unshare and mount, is needed: the test is skipped without it). The stream is greedy with
EOS ignored; a fault-free stream of the same request is the reference.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from shared.default_model import DEFAULT_MODEL_NAME

from helpers.completion_streams import Stream, run_streams
from helpers.metrics_scrape import rise
from helpers.running_server import WAIT_S, RunningServer, start_server, stop_server

SMALL_SHM = 'mount -t tmpfs -o size=48m tmpfs /dev/shm && fallocate -l 40m /dev/shm/filler && exec "$@"'
LAUNCHER = ("unshare", "--mount", "sh", "-c", SMALL_SHM, "sh", sys.executable, "-m", "server")
FLAGS = ("--device", "cpu", "--dtype", "float32", "--standby-workers", "1")
PROMPT = "Is there no exorcist"
MAX_TOKENS = 320
KILL_AFTER_TOKENS = 24


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[RunningServer]:
    probe = subprocess.run(["unshare", "--mount", "sh", "-c", SMALL_SHM, "sh", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot give the server a small /dev/shm of its own here: {probe.stderr.strip()}")
    running = start_server(tmp_path_factory.mktemp("full-shm"), None, *FLAGS, launcher=LAUNCHER)
    try:
        yield running
    finally:
        stop_server(running)


def greedy() -> dict:
    return {"model": DEFAULT_MODEL_NAME, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
            "logprobs": 0, "extra_body": {"ignore_eos": True}}


def standby_ready(server: RunningServer) -> bool:
    return server.scrape()[f'pagedserve:standby_worker_ready{{model_name="{DEFAULT_MODEL_NAME}"}}'] == 1


def test_a_standby_takes_over_with_a_private_cache_and_finishes_the_stream(server):
    reference = Stream().read(server.client(), greedy())
    assert (reference.finish_reason, reference.completion_tokens) == ("length", MAX_TOKENS), server.log.read_text()
    server.wait_for(lambda: standby_ready(server), "the standby's load")
    before, worker = server.scrape(), server.worker_pid
    [faulted], [future] = run_streams(server, [greedy()])
    server.wait_for(lambda: len(faulted.tokens) >= KILL_AFTER_TOKENS, f"{KILL_AFTER_TOKENS} tokens streamed")
    os.kill(worker, signal.SIGKILL)
    future.result(timeout=WAIT_S)

    log = server.log.read_text()
    assert (faulted.finish_reason, faulted.tokens) == ("length", reference.tokens), log
    assert server.worker_pid != worker
    assert rise(before, server.scrape(), "pagedserve:worker_restarts_total", cause="signal",
                model_name=DEFAULT_MODEL_NAME) == 1, log
    assert "SIGBUS" not in log and "suspect" not in log, log
    assert log.count("keeps its KV cache private") == 1, "the first worker's private cache is told, once"
    assert "KV blocks of 16 tokens (private)" in log, log
    assert server.scrape()[f'pagedserve:kv_cache_shared{{model_name="{DEFAULT_MODEL_NAME}"}}'] == 0
