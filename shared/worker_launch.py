"""How the frontend starts a worker, and where the two meet.

The worker's command line is `python -m gpu_worker --runtime-dir DIR --epoch N
--parent-pid PID --config JSON [--kv-segment PATH] [--standby] [--debug-memory]`, PID
the frontend's (a worker that finds another parent, the frontend having died
while it started, exits), JSON being the EngineConfig's fields, its device
resolved already (cpu or cuda, never auto, when the server starts it:
server/worker/sharing.py resolve_device), and PATH the shared-memory file
that holds the KV cache when it is shared (server/worker/kv_segment.py);
--standby for a worker started ahead of need, which starts at idle CPU
priority (gpu_worker/process/priority.py); --debug-memory for a server run
with --debug-memory, the worker then answering SIGUSR2 by logging its memory
(gpu_worker/process/memory_report.py). What the frontend decides for a
worker travels here, never in the environment the worker inherits. Its stdin carries one
line, the secret the frontend drew for this start (SECRET_BYTES random bytes
in hex), which the worker reads first and puts in every message it sends:
a pipe, not the command line, because any local user can read a process's
argv in /proc. Both sockets are ipc:// files in the runtime directory; the
frontend binds them, the worker connects. The worker also keeps its
scheduled ledger there (shared/scheduled_ledger.py), which the frontend
reads once the worker has exited. Each name carries the worker's epoch N, as
a standby worker starts while the active one runs:

    ipc://DIR/input-N    frontend PUSH -> worker PULL    Add, Resume, Abort, Shutdown
    ipc://DIR/output-N   worker PUSH -> frontend PULL    Ready, Outputs, Heartbeat, Fatal
    DIR/scheduled-N      worker appends, frontend reads  the requests worker N has run

Both packages import this module (the server and the worker never import
each other), so the command line and the secret's form are written and read
in one place; so is the command with which the frontend asks, once, what
device auto means to a worker (device_probe_command).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from shared.config import EngineConfig

INPUT_SOCKET = "input"
OUTPUT_SOCKET = "output"
SECRET_BYTES = 16
_SECRET = re.compile(f"[0-9a-f]{{{2 * SECRET_BYTES}}}")
_MAX_SOCKET_PATH = 107  # Linux sun_path holds 108 bytes, the last one a NUL


def socket_path(runtime_dir: Path, name: str, epoch: int) -> Path:
    path = Path(runtime_dir) / f"{name}-{epoch}"
    if len(str(path).encode()) > _MAX_SOCKET_PATH:
        raise ValueError(f"the socket path {str(path)!r} is over the {_MAX_SOCKET_PATH}-byte limit of Unix sockets; "
                         "choose a shorter --runtime-dir")
    return path


def ipc_address(runtime_dir: Path, name: str, epoch: int) -> str:
    return f"ipc://{socket_path(runtime_dir, name, epoch)}"


@dataclass(slots=True)
class WorkerArgs:
    runtime_dir: Path
    epoch: int
    config: EngineConfig
    kv_segment: Path | None = None  # the shared KV cache's file; None: a private cache
    parent_pid: int = field(default_factory=os.getpid)  # the frontend's: a worker whose parent is gone exits
    is_standby: bool = False  # started ahead of need: it loads at idle CPU priority
    debug_memory: bool = False  # the server's --debug-memory: the worker logs a memory snapshot on SIGUSR2


def worker_command(args: WorkerArgs) -> list[str]:
    """argv that starts a worker with this Python interpreter."""
    config_json = json.dumps(dataclasses.asdict(args.config))
    segment = [] if args.kv_segment is None else ["--kv-segment", str(args.kv_segment)]
    standby = ["--standby"] if args.is_standby else []
    debug_memory = ["--debug-memory"] if args.debug_memory else []
    return [sys.executable, "-m", "gpu_worker", "--runtime-dir", str(args.runtime_dir), "--epoch", str(args.epoch),
            "--parent-pid", str(args.parent_pid), "--config", config_json, *segment, *standby, *debug_memory]


def device_probe_command() -> list[str]:
    """argv that prints the device a worker given device auto runs on, cpu or cuda: the worker's own
    select_device, run with this Python interpreter, so that the frontend, which never imports torch, learns it
    once and hands it to every worker it starts (server/worker/sharing.py resolve_device)."""
    return [sys.executable, "-c", "from gpu_worker.runner.model_runner import select_device; "
                                  "print(select_device('auto').type)"]


def parse_worker_args(argv: list[str] | None = None) -> WorkerArgs:
    parser = argparse.ArgumentParser(prog="python -m gpu_worker",
                                     description="pagedserve's worker process; started by the frontend, not by hand.")
    parser.add_argument("--runtime-dir", type=Path, required=True, help="directory holding the ipc:// sockets")
    parser.add_argument("--epoch", type=int, required=True, help="this worker's number, sent on every message")
    parser.add_argument("--config", type=_engine_config, required=True, help="EngineConfig fields as a JSON object")
    parser.add_argument("--kv-segment", type=Path, default=None, help="the shared-memory file to hold the KV cache")
    parser.add_argument("--parent-pid", type=int, default=None,
                        help="the frontend's pid: exit at once when it is no longer this process's parent")
    parser.add_argument("--standby", action="store_true",
                        help="a standby worker: import, load and warm up at idle CPU priority")
    parser.add_argument("--debug-memory", action="store_true",
                        help="log a memory snapshot on SIGUSR2 (the server's --debug-memory)")
    args = parser.parse_args(argv)
    return WorkerArgs(args.runtime_dir, args.epoch, args.config, args.kv_segment,
                      os.getppid() if args.parent_pid is None else args.parent_pid, args.standby, args.debug_memory)


def _engine_config(text: str) -> EngineConfig:
    try:
        fields = json.loads(text)
        if not isinstance(fields, dict):
            raise TypeError(f"expected a JSON object, got {type(fields).__name__}")
        return EngineConfig(**fields)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object of EngineConfig fields: {exc}") from exc


def new_secret() -> str:
    """A fresh secret for one worker start: unguessable, and as hex safe in a JSON header."""
    return secrets.token_hex(SECRET_BYTES)


def secret_line(secret: str) -> bytes:
    """What the frontend writes on the worker's stdin."""
    return f"{secret}\n".encode()


def read_secret(stdin: TextIO) -> str:
    """The worker's side: the secret line from stdin; ValueError when it is missing or malformed."""
    secret = stdin.readline(2 * SECRET_BYTES + 2).strip()
    if not _SECRET.fullmatch(secret):
        raise ValueError(f"expected the frontend's secret on stdin ({2 * SECRET_BYTES} hex digits and a newline), "
                         f"got {len(secret)} characters")
    return secret
