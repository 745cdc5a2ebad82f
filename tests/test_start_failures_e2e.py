"""A worker that can never start, as users meet it: `python -m server` on a broken checkpoint exits non-zero after
two worker starts, with one line naming the load error, which /health's 503 names too while the server is up. A
standby that cannot load beside a serving worker stops nothing."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from helpers.processes import stop_process, wait_until_ready
from helpers.running_server import LISTENING, http_exchange, start_server, stop_server
from helpers.test_device import TEST_DEVICE

FLAGS = ("--device", TEST_DEVICE, "--num-kv-blocks", "64", "--max-num-seqs", "4")
EXIT_TIMEOUT_S = 60.0  # two worker starts, each a torch import and a failed load
VERDICT = "the engine worker cannot start: "
STARTED = re.compile(r"started engine worker pid \d+")
STANDBY_STARTED = re.compile(r"started standby engine worker pid (\d+)")
STANDBY_EXITED = re.compile(r"the standby engine worker \(pid \d+, epoch \d+\) exited")


def truncate_weights(model_dir: Path) -> str:
    """Cut model.safetensors in half, in a new file moved over the old one (a worker that mapped it keeps it)."""
    weights = model_dir / "model.safetensors"
    data = weights.read_bytes()
    (model_dir / "truncated").write_bytes(data[: len(data) // 2])
    os.replace(model_dir / "truncated", weights)
    return f"CheckpointError: {weights}: not a readable safetensors file"


def rewrite_config(model_dir: Path, edit: Callable[[dict], None]) -> None:
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    edit(config)
    config_path.write_text(json.dumps(config))


def break_config_json(model_dir: Path) -> str:
    (model_dir / "config.json").write_text('{"model_type": "llama",')
    return f"CheckpointError: {model_dir / 'config.json'}: not valid JSON"


def negative_hidden_size(model_dir: Path) -> str:
    rewrite_config(model_dir, lambda config: config.update(hidden_size=-64))
    return f"CheckpointError: {model_dir / 'config.json'}: hidden_size must be a positive integer, got -64"


def float8_dtype(model_dir: Path) -> str:
    """A checkpoint dtype the worker cannot serve, with --dtype auto taking it from config.json."""
    def edit(config: dict) -> None:
        config.pop("dtype", None)
        config["torch_dtype"] = "float8_e4m3fn"

    rewrite_config(model_dir, edit)
    return "config.json: dtype must be one of float32, float16, bfloat16, got 'float8_e4m3fn'"


BREAKAGES = {"truncated-safetensors": truncate_weights, "invalid-config-json": break_config_json,
             "negative-hidden-size": negative_hidden_size, "float8-dtype": float8_dtype}


def run_until_exit(tmp_path: Path, model_dir: Path, *flags: str) -> tuple[int, str, list[bytes]]:
    """Run the server until it exits, polling /health meanwhile: (exit status, log, the 503 bodies seen)."""
    log = tmp_path / "server.log"
    command = [sys.executable, "-m", "server", "--model", str(model_dir), "--port", "0", "--runtime-dir",
               str(tmp_path / "runtime"), "--state-store", f"sqlite://{(tmp_path / 'responses.db').resolve()}", *flags]
    with open(log, "wb") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        wait_until_ready(process, lambda: LISTENING.search(log.read_bytes()), "the server logged no port",
                         log.read_text, EXIT_TIMEOUT_S, stop=lambda: stop_process(process))
        port = int(LISTENING.search(log.read_bytes()).group(1))
        bodies, deadline = [], time.monotonic() + EXIT_TIMEOUT_S
        while process.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(OSError):  # refused once it has stopped listening
                status, _, body = http_exchange(port, "GET", "/health")
                assert status == 503, body
                bodies.append(body)
            time.sleep(0.05)
        return process.wait(timeout=1.0), log.read_text(), bodies
    finally:
        stop_process(process)


@pytest.mark.parametrize("breakage", BREAKAGES)
def test_a_worker_that_cannot_load_the_checkpoint_stops_the_server_after_two_starts(tmp_path, checkpoint, breakage):
    model_dir = tmp_path / "model"
    shutil.copytree(checkpoint, model_dir)
    error = BREAKAGES[breakage](model_dir)
    returncode, log, bodies = run_until_exit(tmp_path, model_dir, *FLAGS)
    assert returncode != 0, log
    assert len(STARTED.findall(log)) == 2, log
    verdicts = [line for line in log.splitlines() if VERDICT in line]
    assert len(verdicts) == 1, log
    assert error in verdicts[0] and "(the same error at 2 starts in a row); giving up" in verdicts[0], log
    assert any(error in json.loads(body)["error"]["message"] for body in bodies), bodies


def test_a_standby_that_cannot_load_leaves_the_serving_worker_serving(tmp_path, checkpoint):
    model_dir = tmp_path / "model"
    shutil.copytree(checkpoint, model_dir)
    server = start_server(tmp_path, model_dir, *FLAGS, "--dtype", "float32", "--standby-workers", "1",
                          "--served-model-name", "tiny")
    try:
        server.wait_for(lambda: STANDBY_STARTED.search(server.log.read_text()), "a standby")
        error = truncate_weights(model_dir)  # the serving worker holds its weights already
        os.kill(int(STANDBY_STARTED.search(server.log.read_text()).group(1)), signal.SIGKILL)
        server.wait_for(lambda: len(STANDBY_EXITED.findall(server.log.read_text())) >= 3, "two standbys to fail to load")
        log = server.log.read_text()
        assert log.count(error) >= 2 and VERDICT not in log, log
        assert server.process.poll() is None and server.is_healthy()
        completion = server.client().completions.create(model="tiny", prompt="to be", max_tokens=2)
        assert completion.usage.completion_tokens == 2
    finally:
        stop_server(server)


FRONTEND_FILES = {  # a checkpoint part the frontend reads at start-up, broken -> what the one error line says
    "tokenizer.json": ("{not json", "tokenizer.json: not a readable tokenizer ("),
    "tokenizer_config.json": ("{not json", "tokenizer_config.json: not a readable tokenizer config ("),
    "generation_config.json": ("{not json", "generation_config.json: Expecting property name"),
    "chat_template.jinja": ("{% if %}", "chat_template.jinja: the chat template is not valid jinja2 (line 1)"),
}


@pytest.mark.parametrize("part", FRONTEND_FILES)
def test_a_broken_checkpoint_part_the_frontend_reads_stops_the_start_naming_its_file(tmp_path, checkpoint, part):
    model_dir = tmp_path / "model"
    shutil.copytree(checkpoint, model_dir)
    text, message = FRONTEND_FILES[part]
    (model_dir / part).write_text(text)
    result = subprocess.run([sys.executable, "-m", "server", "--model", str(model_dir), "--port", "0",
                             "--runtime-dir", str(tmp_path / "runtime"), *FLAGS],
                            capture_output=True, text=True, timeout=EXIT_TIMEOUT_S)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    [line] = [line for line in output.splitlines() if "cannot start: " in line]
    assert f"cannot start: {model_dir / part}" in line and message in line, output
    assert "Traceback" not in output, output
