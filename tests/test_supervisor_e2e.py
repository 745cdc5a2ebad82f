"""The supervisor as users meet it: `python -m server` in a subprocess, its worker frozen, killed or unable to start,
spoken to by the openai SDK while it happens; SIGTERM during streams; the systemd notify protocol.

Recovered streams must equal a fault-free run's text exactly. That holds because the CPU path in float32 is
deterministic and the checkpoint is sharpened (tests/helpers/checkpoints.py multiplies the final norm by 16): its top
logits are units apart, so a last-bit difference between batch compositions (the new worker re-prefills each
request in other batches than the fault-free run did) cannot flip a greedy pick or move a seeded draw across
a boundary. Seeded draws are keyed by (seed, output index), so a resumed request draws the same noise.

The server runs on $PAGEDSERVE_TEST_DEVICE (tests/helpers/test_device.py): the CPU unless tools/device/device_check.sh
asks for CUDA, where the killed worker's replacement creates a new CUDA context.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import signal
import socket
import tempfile
import threading
import time

import pytest

from helpers.completion_streams import mixed_completions, run_streams
from helpers.running_server import START_TIMEOUT_S, WAIT_S, RunningServer, start_server, stop_server, watch_health
from helpers.test_device import TEST_DEVICE

MODEL = "tiny"
HANG_TIMEOUT_S = 2.0
NUM_STREAMS = 16  # half greedy, half seeded sampling
MAX_TOKENS = 64  # long enough that the worker is still generating when the fault strikes, not just the streams
SERVER_FLAGS = ("--served-model-name", MODEL, "--device", TEST_DEVICE, "--dtype", "float32", "--num-kv-blocks", "512",
                "--max-num-seqs", "16", "--worker-hang-timeout", str(HANG_TIMEOUT_S))


def workload(max_tokens: int = MAX_TOKENS) -> list[dict]:
    return mixed_completions(MODEL, NUM_STREAMS, max_tokens)


# ---------------------------------------------------------------------------------------------- hang and crash


@pytest.fixture(scope="module")
def fault_server(tmp_path_factory, checkpoint) -> RunningServer:
    # Every step held to 10 ms or more (PAGEDSERVE_FAULT=pace@0): the MAX_TOKENS then take 0.64 s or more, so a
    # signal sent once the streams are under way lands while the worker still generates, however fast it runs.
    server = start_server(tmp_path_factory.mktemp("faults"), checkpoint, *SERVER_FLAGS,
                          env={"PAGEDSERVE_FAULT": "pace@0"})
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def expected_texts(fault_server) -> list[str]:
    """The fault-free, non-streamed texts of workload(), run before any fault."""
    with concurrent.futures.ThreadPoolExecutor(NUM_STREAMS) as pool:
        completions = list(pool.map(lambda params: fault_server.client().completions.create(**params), workload()))
    assert all(c.usage.completion_tokens == MAX_TOKENS for c in completions)
    return [c.choices[0].text for c in completions]


# (the signal, the restart cause the supervisor counts)
FAULTS = {"sigstop": (signal.SIGSTOP, "hang"), "sigkill": (signal.SIGKILL, "signal")}


@pytest.mark.parametrize("fault", FAULTS)
def test_every_stream_completes_unchanged_through_a_worker_fault(fault_server, expected_texts, fault):
    signum, cause = FAULTS[fault]
    server, label = fault_server, f'model_name="{MODEL}"'
    server.wait_for(server.is_healthy, "/health 200 before the fault")
    before, worker_pid = server.scrape(), server.worker_pid
    streams, futures = run_streams(server, workload())
    server.wait_for(lambda: sum(len(s.pieces) for s in streams) >= 3 * NUM_STREAMS, "the streams to be under way")
    os.kill(worker_pid, signum)
    received_at_fault = [len(s.pieces) for s in streams]
    stop_polling = threading.Event()
    health = watch_health(server, stop_polling)
    results = [future.result(timeout=WAIT_S) for future in futures]
    server.wait_for(server.is_healthy, "/health 200 after recovery")
    stop_polling.set()
    assert any(0 < n < MAX_TOKENS for n in received_at_fault), "the fault must strike mid-generation"
    for i, (stream, expected) in enumerate(zip(results, expected_texts)):
        assert (stream.finish_reason, stream.completion_tokens) == ("length", MAX_TOKENS), i
        assert stream.text == expected, f"stream {i}: a piece was duplicated, lost or changed"
    if signum == signal.SIGSTOP:
        assert 503 in health, "/health must say 503 while the worker hangs"
    after = server.scrape()
    assert after[f'pagedserve:worker_restarts_total{{cause="{cause}",{label}}}'] == \
        before[f'pagedserve:worker_restarts_total{{cause="{cause}",{label}}}'] + 1
    assert after[f"pagedserve:requests_requeued_total{{{label}}}"] > before[f"pagedserve:requests_requeued_total{{{label}}}"]
    assert after[f"pagedserve:requests_poisoned_total{{{label}}}"] == 0
    assert 0 < after[f"pagedserve:worker_last_recovery_seconds{{{label}}}"] < START_TIMEOUT_S
    assert after[f"pagedserve:worker_ready{{{label}}}"] == 1 and server.worker_pid != worker_pid
    assert not os.path.exists(f"/proc/{worker_pid}"), "the old worker was reaped"


# ---------------------------------------------------------------------------------------------- crash loop


def test_a_worker_that_cannot_restart_gets_prompt_503s_then_the_server_exits_non_zero(tmp_path, checkpoint):
    model_dir = tmp_path / "model"
    shutil.copytree(checkpoint, model_dir)
    server = start_server(tmp_path, model_dir, *SERVER_FLAGS, "--max-worker-restarts", "2", "--restart-window", "60")
    try:
        model_dir.rename(tmp_path / "model-gone")  # the next workers cannot load it
        os.kill(server.worker_pid, signal.SIGKILL)
        server.wait_for(lambda: server.get("/health")[0] == 503, "/health 503")
        started = time.monotonic()
        status, headers, body = server.request("POST", "/v1/completions",
                                               {"model": MODEL, "prompt": "Hi", "max_tokens": 4})
        assert status == 503 and time.monotonic() - started < 2.0, "a new request is answered at once, not held"
        assert int(headers["retry-after"]) >= 1 and b'"type":"service_unavailable"' in body
        assert int(server.get("/health")[1]["retry-after"]) >= 1
        assert server.get("/livez")[0] == 200, "the frontend itself is alive"
        assert server.process.wait(timeout=WAIT_S) != 0, "giving up exits non-zero"
        log = server.log.read_text()
        assert "giving up" in log and log.count("start_failure") >= 2
        assert not server.runtime_dir.exists()
    finally:
        stop_server(server)


# ---------------------------------------------------------------------------------------------- SIGTERM and systemd


def receive_notifications(receiver: socket.socket, messages: list[str], stop: threading.Event) -> None:
    receiver.settimeout(0.1)
    while not stop.is_set():
        try:
            messages.extend(receiver.recv(4096).decode().split("\n"))
        except TimeoutError:
            continue


def test_sigterm_drains_8_streams_and_systemd_hears_ready_watchdog_status_stopping(tmp_path, checkpoint):
    directory = tempfile.mkdtemp(prefix="sdn-", dir="/tmp")  # a short path: sun_path holds 108 bytes
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(f"{directory}/notify")
    messages: list[str] = []
    stop_receiving = threading.Event()
    listener = threading.Thread(target=receive_notifications, args=(receiver, messages, stop_receiving), daemon=True)
    listener.start()
    env = {"NOTIFY_SOCKET": f"{directory}/notify", "WATCHDOG_USEC": "2000000"}  # a WATCHDOG=1 every second
    server = start_server(tmp_path, checkpoint, *SERVER_FLAGS, "--shutdown-timeout", "30", env=env)
    try:
        worker_pid = server.worker_pid
        streams, futures = run_streams(server, workload(max_tokens=64)[:8])
        server.wait_for(lambda: all(s.pieces for s in streams), "every stream under way")
        server.wait_for(lambda: messages.count("WATCHDOG=1") >= 2, "periodic WATCHDOG=1")
        server.process.send_signal(signal.SIGTERM)
        results = [future.result(timeout=WAIT_S) for future in futures]
        assert server.process.wait(timeout=WAIT_S) == 0, server.log.read_text()
        for stream in results:
            assert (stream.finish_reason, stream.completion_tokens) == ("length", 64)
        assert not server.runtime_dir.exists(), "the runtime dir and its sockets are removed"
        assert not os.path.exists(f"/proc/{worker_pid}"), "no worker process is left"
        server.wait_for(lambda: "STOPPING=1" in messages, "STOPPING=1")
    finally:
        stop_server(server)
        stop_receiving.set()
        listener.join()
        receiver.close()
        shutil.rmtree(directory)
    assert "READY=1" in messages and messages.index("READY=1") < messages.index("STOPPING=1")
    assert any(m.startswith("STATUS=engine worker ready: pid") for m in messages)
    assert any(m.startswith("EXTEND_TIMEOUT_USEC=") for m in messages)
