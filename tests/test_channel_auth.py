"""The worker's channel with another local process on it: without the worker's secret, nothing it sends counts.

A rogue PUSH socket connects to the frontend's output socket while a real
worker starts, then sends well-formed messages with the right epoch but no
secret or a wrong one, while the worker is stopped (SIGSTOP) so that only
the rogue talks: a forged Heartbeat must not look like a sign of life, a
forged Outputs must not touch a request in flight.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import orjson
import zmq

from gpu_worker.process.fault_injection import ENV_VAR as FAULT_ENV_VAR
from server.worker.engine_client import EngineClient
from server.worker.runtime_dir import RuntimeDir
from shared.worker_launch import OUTPUT_SOCKET, socket_path

from helpers.waiting import wait_until_async
from helpers.worker_helpers import START_TIMEOUT_S, greedy, module_loop, run_to_end

SILENCE_S = 0.3  # no message for this long after the SIGSTOP: what the worker sent before it has arrived
FORGED_SECRETS = (None, "0" * 32, "f" * 5000, "\N{SNOWMAN}" * 32)  # None: no secret field at all
FORGED_STATS = {"num_running": 99, "num_waiting": 99}


def forged_heartbeat(epoch: int, secret: str | None) -> list[bytes]:
    header = {"kind": "HEARTBEAT", "epoch": epoch, "stats": FORGED_STATS}
    return [orjson.dumps(header if secret is None else {**header, "secret": secret})]


def forged_outputs(epoch: int, secret: str | None, request_id: str) -> list[bytes]:
    """Three tokens and a finish for `request_id`: the header an Outputs has, then the token frame."""
    header = {"kind": "OUTPUTS", "epoch": epoch, "stats": FORGED_STATS, "num_prompt_tokens": 0,
              "request_ids": [request_id], "num_new_tokens": [3], "finish_reasons": ["stop"], "errors": [None],
              "error_kinds": [None], "num_top_logprobs": [None]}
    header = header if secret is None else {**header, "secret": secret}
    return [orjson.dumps(header), np.array([7, 7, 7], dtype="<i4").tobytes()]


async def until_quiet(client: EngineClient) -> None:
    """Until no message has arrived for SILENCE_S: on a loaded machine the worker's last ones come late."""
    last_seen, quiet_since = client.last_message_time, time.monotonic()
    while time.monotonic() - quiet_since < SILENCE_S:
        await asyncio.sleep(0.02)
        if client.last_message_time != last_seen:
            last_seen, quiet_since = client.last_message_time, time.monotonic()


@module_loop
async def test_messages_without_the_workers_secret_are_dropped(engine_config, long_case, caplog, monkeypatch):
    # Every step held to at least 10 ms (pace@0): the victim's 70 tokens take 0.7 s or more, so the SIGSTOP finds it
    # under way however fast the worker (unpaced, a fresh clone's whole suite once saw it finish first).
    monkeypatch.setenv(FAULT_ENV_VAR, "pace@0")
    caplog.set_level(logging.WARNING)
    context = zmq.Context()
    rogue = context.socket(zmq.PUSH)
    rogue.setsockopt(zmq.LINGER, 0)
    try:
        await _forge_while_the_worker_is_stopped(engine_config, long_case, rogue)
    finally:  # a context left to the garbage collector would block the test session in term()
        rogue.close()
        context.term()
    drops = [record for record in caplog.records if "dropped" in record.getMessage()]
    assert [record.levelname for record in drops] == ["WARNING"], "one line per worker, not one per message"


async def _forge_while_the_worker_is_stopped(engine_config, long_case, rogue: zmq.Socket) -> None:
    with RuntimeDir.create() as runtime_dir:
        client = EngineClient(engine_config, runtime_dir.path, start_timeout=START_TIMEOUT_S)
        output_path = socket_path(runtime_dir.path, OUTPUT_SOCKET, 1)
        starting = asyncio.create_task(client.start())
        await wait_until_async(output_path.exists)
        rogue.connect(f"ipc://{output_path}")
        await starting
        secret = client.worker_info.secret
        for name in ("cmdline", "environ"):  # what other local users may read
            assert secret.encode() not in Path(f"/proc/{client.worker_pid}/{name}").read_bytes()
        assert secret not in repr(client.worker_info)
        rogue.send(b"not a message")  # once dropped, the rogue is known to be connected
        await wait_until_async(lambda: client.num_dropped_messages_total == 1)

        prompt, expected = long_case
        victim = greedy("victim", prompt, len(expected), ignore_eos=True)
        client.add(victim)
        await wait_until_async(lambda: len(victim.output_token_ids) >= 2)
        os.kill(client.worker_pid, signal.SIGSTOP)
        try:
            await until_quiet(client)
            tokens, last_message_time, stats = list(victim.output_token_ids), client.last_message_time, client.totals.stats
            for secret in FORGED_SECRETS:
                rogue.send_multipart(forged_heartbeat(client.epoch, secret))
                rogue.send_multipart(forged_outputs(client.epoch, secret, "victim"))
            await wait_until_async(lambda: client.num_dropped_messages_total == 1 + 2 * len(FORGED_SECRETS))
            assert victim.output_token_ids == tokens and not victim.is_finished
            assert client.last_message_time == last_message_time and client.totals.stats == stats
        finally:
            os.kill(client.worker_pid, signal.SIGCONT)
        await run_to_end(victim)
        assert victim.output_token_ids == expected and victim.error is None
        await client.close()


def test_a_worker_without_a_secret_on_stdin_refuses_to_start(tmp_path):
    command = [sys.executable, "-m", "gpu_worker", "--runtime-dir", str(tmp_path), "--epoch", "1",
               "--config", '{"model": "unused"}']
    for stdin in (b"", b"not-hex\n"):
        finished = subprocess.run(command, input=stdin, capture_output=True, timeout=60)
        assert finished.returncode == 2 and b"secret on stdin" in finished.stderr
