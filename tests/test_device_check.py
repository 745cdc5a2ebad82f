"""tools/device/device_check.sh --cpu, the dry run of the GPU machine's check: every part passes, each with its log, and the
table comes last. The CUDA run is the same script with larger sizes, so this is what keeps it from being first run
on the device. The key-figure readers are checked on the lines the tools print.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools import REPO_ROOT
from tools.device.device_check import http_figure, offline_figure, pytest_summary

PARTS = ("environment", "checkpoint", "test-triton", "test-models", "test-engine", "test-worker-kill", "limits",
         "offline", "decode", "http")
DRY_RUN_TIMEOUT_S = 400  # the dry run's own budget is 240 s; past this it hangs


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("device-check")
    env = {**os.environ, "PYTHON": sys.executable}
    result = subprocess.run([str(REPO_ROOT / "tools" / "device" / "device_check.sh"), "--cpu", str(out)], env=env,
                            capture_output=True, text=True, timeout=DRY_RUN_TIMEOUT_S, check=False)
    return result, out


def table_rows(text: str) -> dict[str, list[str]]:
    """The table printed last: {part: [status, seconds, key figure...]}."""
    lines = text[text.rindex("part "):].splitlines()
    return {line.split()[0]: line.split()[1:] for line in lines[1:]}


def test_every_part_passes_with_its_log_and_the_table_comes_last(dry_run):
    result, out = dry_run
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rows = table_rows(result.stdout)
    assert list(rows) == [*PARTS, "total"]
    for part in PARTS:
        status, seconds, *figure = rows[part]
        assert status == "pass" and float(seconds) > 0, (part, rows[part])
        assert figure, f"{part} has no key figure"
        log = (out / f"{part}.log").read_text()
        assert log.startswith("$ "), f"{part}'s log starts with its command"
    assert result.stdout.rstrip().splitlines()[-1].startswith("total")
    assert (out / "summary.txt").read_text().strip() == result.stdout[result.stdout.rindex("part "):].strip()


def test_the_dry_run_stays_on_the_cpu_and_measures_each_batch(dry_run):
    result, out = dry_run
    rows = table_rows(result.stdout)
    assert rows["environment"][-1] == "cpu"
    decode = (out / "decode.log").read_text()
    assert "step ms at batch 1/4/16:" in decode and decode.count(" compute ") + decode.count(" memory ") == 3
    assert "transformers static x4:" in (out / "offline.log").read_text()


def test_key_figures_are_read_from_the_tools_lines():
    assert pytest_summary("....\n2 passed, 14 deselected in 2.89s\n") == "2 passed, 14 deselected in 2.89s"
    assert pytest_summary("=== 1 failed, 3 passed in 4.00s ===\n") == "1 failed, 3 passed in 4.00s"
    assert pytest_summary("tests/a.py::b\n\n2/16 tests collected (14 deselected) in 0.50s\n") == \
        "2/16 tests collected (14 deselected) in 0.50s"
    offline = ("pagedserve engine:             1.2 s    2000.0 output tokens/s  (40 steps)\n"
               "KV utilisation: paged 90.0%\n"
               "transformers static x4:      2.4 s    1000.0 output tokens/s\n")
    assert offline_figure(offline) == "2000.0 vs static batching 1000.0 tok/s (2.00x)"
    assert offline_figure("pagedserve engine:  1.2 s  2000.0 output tokens/s\n") == ""
    http = "HTTP / in-process output tokens/s: 90.0 / 100.0 = 0.900 (meets the >= 0.90 target)\n"
    assert http_figure(http) == "HTTP / in-process tok/s 90.0 / 100.0 = 0.900"


def test_the_wheel_list_holds_what_the_server_needs_and_not_what_the_device_has(tmp_path):
    """device_wheels --list, which needs no network: pins from this environment, the device's packages out."""
    command = [sys.executable, "-m", "tools.device.device_wheels", "--list"]
    pins = dict(line.split("==") for line in subprocess.run(command, capture_output=True, text=True,
                                                            check=True).stdout.split())
    assert {"pyzmq", "orjson", "httptools", "redis", "llguidance", "gguf", "openai"} <= set(pins)
    assert not {"torch", "triton", "transformers", "uvloop", "pytest"} & set(pins)
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("# the device's pip freeze\nPyZMQ==26.0.0\nopenai @ file:///wheels/openai.whl\n")
    pins = subprocess.run([*command, "--device-freeze", str(freeze)], capture_output=True, text=True,
                          check=True).stdout.split()
    assert not any(pin.startswith(("pyzmq==", "openai==")) for pin in pins) and "torch" not in " ".join(pins)


def test_a_short_budget_stops_the_part_it_reaches_and_skips_the_rest(tmp_path):
    """--budget-s fits the check into a shorter run: the part running when the budget ends is stopped (or the part
    after the last one to finish is not started), each later part is reported as skipped, and the run fails."""
    env = {**os.environ, "PYTHON": sys.executable}
    result = subprocess.run([str(REPO_ROOT / "tools" / "device" / "device_check.sh"), "--cpu", "--budget-s", "1.5",
                             str(tmp_path)], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    rows = table_rows(result.stdout)
    assert list(rows) == [*PARTS, "total"]
    statuses = [rows[part][0] for part in PARTS]
    ran = [status for status in statuses if status != "SKIPPED"]
    assert ran and statuses[len(ran):] == ["SKIPPED"] * (len(PARTS) - len(ran)), statuses
    assert len(ran) < len(PARTS) and float(rows["total"][0]) < 10, rows


def test_skip_tests_runs_the_measurements_only(tmp_path):
    """--skip-tests leaves out the four test parts and runs the rest, in order, on the dry run's sizes."""
    env = {**os.environ, "PYTHON": sys.executable}
    result = subprocess.run([str(REPO_ROOT / "tools" / "device" / "device_check.sh"), "--cpu", "--skip-tests",
                             str(tmp_path)], env=env, capture_output=True, text=True, timeout=DRY_RUN_TIMEOUT_S,
                            check=False)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rows = table_rows(result.stdout)
    assert list(rows) == [part for part in PARTS if not part.startswith("test-")] + ["total"]
    assert all(rows[part][0] == "pass" for part in rows if part != "total"), rows
    assert not list(tmp_path.glob("test-*.log"))
