"""Start `python -m server` on a free port for a benchmark and wait until it is ready; the `--policy NAME=FLAGS`
argument with which a benchmark names the server flags of each side it compares. Only the standard library."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tools import REPO_ROOT

START_TIMEOUT_S = 600.0
LISTENING = re.compile(rb"listening on http://127\.0\.0\.1:(\d+)")


@dataclass(slots=True)
class Policy:
    name: str
    flags: list[str]


def parse_policy(text: str) -> Policy:
    """NAME=FLAGS -> Policy; FLAGS are server flags, split as a shell would."""
    name, is_assignment, flags = text.partition("=")
    if not is_assignment or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=FLAGS (e.g. t50='--target-itl-ms 50'), got {text!r}")
    return Policy(name, shlex.split(flags))


def start_server(flags: list[str], log: Path, timeout: float = START_TIMEOUT_S, checkout: Path = REPO_ROOT,
                 env: dict[str, str] | None = None) -> tuple[subprocess.Popen, int]:
    """`python -m server --port 0 *flags`, its output in `log`; returns (process, port) once /health says 200.

    The server and its worker run the code of `checkout` (this one by default; another, such as a worktree of
    an earlier commit, for a side-by-side comparison): it is their working directory and first on PYTHONPATH.
    `env` adds to (or overrides) this process's environment for them, e.g. OMP_WAIT_POLICY.
    Without a --state-store flag, the Responses API's store is a file beside the log, not the user's own.
    """
    if "--state-store" not in flags:
        flags = [*flags, "--state-store", f"sqlite://{log.resolve().with_suffix('.responses.db')}"]
    command = [sys.executable, "-m", "server", "--port", "0", *flags]
    with open(log, "wb") as log_file:
        python_path = os.pathsep.join(filter(None, (str(checkout), os.environ.get("PYTHONPATH"))))
        process = subprocess.Popen(command, cwd=checkout, env={**os.environ, **(env or {}), "PYTHONPATH": python_path},
                                   stdout=log_file, stderr=subprocess.STDOUT)
    deadline, port = time.monotonic() + timeout, None
    while time.monotonic() < deadline and process.poll() is None:
        match = port is None and LISTENING.search(log.read_bytes())
        port = int(match.group(1)) if match else port
        if port is not None and _is_healthy(port):
            return process, port
        time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"the server did not become healthy (exit {process.poll()}); its log:\n{log.read_text()}")


def _is_healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False

