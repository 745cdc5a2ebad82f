"""How the frontend starts a worker, and where the two meet.

The worker's command line is `python -m gpu_worker --runtime-dir DIR --epoch N
--config JSON`, JSON being the EngineConfig's fields. Both sockets are
ipc:// files in the runtime directory; the frontend binds them, the worker
connects:

    ipc://DIR/input    frontend PUSH -> worker PULL    Add, Abort, Shutdown
    ipc://DIR/output   worker PUSH -> frontend PULL    Ready, Outputs, Heartbeat, Fatal

Both packages import this module (the server and the worker never import
each other), so the command line is written and read in one place.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from shared.config import EngineConfig

INPUT_SOCKET = "input"
OUTPUT_SOCKET = "output"
_MAX_SOCKET_PATH = 107  # Linux sun_path holds 108 bytes, the last one a NUL


def socket_path(runtime_dir: Path, name: str) -> Path:
    path = Path(runtime_dir) / name
    if len(str(path).encode()) > _MAX_SOCKET_PATH:
        raise ValueError(f"the socket path {str(path)!r} is over the {_MAX_SOCKET_PATH}-byte limit of Unix sockets; "
                         "choose a shorter --runtime-dir")
    return path


def ipc_address(runtime_dir: Path, name: str) -> str:
    return f"ipc://{socket_path(runtime_dir, name)}"


@dataclass(slots=True)
class WorkerArgs:
    runtime_dir: Path
    epoch: int
    config: EngineConfig


def worker_command(args: WorkerArgs) -> list[str]:
    """argv that starts a worker with this Python interpreter."""
    config_json = json.dumps(dataclasses.asdict(args.config))
    return [sys.executable, "-m", "gpu_worker", "--runtime-dir", str(args.runtime_dir), "--epoch", str(args.epoch),
            "--config", config_json]


def parse_worker_args(argv: list[str] | None = None) -> WorkerArgs:
    parser = argparse.ArgumentParser(prog="python -m gpu_worker",
                                     description="pagedserve's worker process; started by the frontend, not by hand.")
    parser.add_argument("--runtime-dir", type=Path, required=True, help="directory holding the ipc:// sockets")
    parser.add_argument("--epoch", type=int, required=True, help="this worker's number, sent on every message")
    parser.add_argument("--config", type=_engine_config, required=True, help="EngineConfig fields as a JSON object")
    args = parser.parse_args(argv)
    return WorkerArgs(args.runtime_dir, args.epoch, args.config)


def _engine_config(text: str) -> EngineConfig:
    try:
        fields = json.loads(text)
        if not isinstance(fields, dict):
            raise TypeError(f"expected a JSON object, got {type(fields).__name__}")
        return EngineConfig(**fields)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object of EngineConfig fields: {exc}") from exc
