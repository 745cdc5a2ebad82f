"""python -m gpu_worker: one worker process, started by the frontend (shared/worker_launch.py has the command line).

Reads the secret the frontend wrote on its stdin (every message sent carries
it), connects to the frontend's two sockets, opens this epoch's scheduled
ledger in the runtime directory, loads the model and warms it up with one
tiny generation (on a private KV cache), moves its KV cache into the shared
segment when it was given one (--kv-segment; a segment that cannot be
mapped leaves the cache private, and says why in the log), sends Ready, then
runs the WorkerLoop. A standby worker (--standby) is no different, but for
one thing: all of that up to Ready, torch's import included, runs on a
thread at idle CPU priority (gpu_worker/process/priority.py), so as not to slow the
worker in service. That is why what brings in torch or numpy (the engine,
the WorkerLoop, shared.protocol) is imported by load_engine, on that
thread, and only then, at no cost, where it is used. Its main thread, at
normal priority, then runs the WorkerLoop, which the frontend sends nothing
until it takes over. Exits 0 on
a Shutdown message or SIGTERM, 2 without a secret or a frontend. Any other exception, from
loading the model through the last step, is unrecoverable: Fatal (message,
traceback, and the requests of the step it was raised in), exit 1.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

import zmq

from gpu_worker.process import fault_injection
from gpu_worker.process.priority import run_at_idle_priority
from shared.config import EngineConfig
from shared.scheduled_ledger import ScheduledLedger, ledger_path
from shared.worker_launch import INPUT_SOCKET, OUTPUT_SOCKET, ipc_address, parse_worker_args, read_secret

if TYPE_CHECKING:
    from gpu_worker.engine.engine import Engine
    from gpu_worker.engine.step_hooks import StepHooks
    from gpu_worker.process.worker_loop import WorkerLoop
    from shared.protocol import Ready

_FINAL_SEND_LINGER_MS = 1000  # time for a last Fatal to reach a live frontend; bounds exit when it is gone
_PR_SET_PDEATHSIG = 1
_NO_SECRET_EXIT_CODE = 2  # as for a bad command line: the worker was not started the way the frontend starts it

logger = logging.getLogger("pagedserve.worker")


def main(argv: list[str] | None = None) -> int:
    args = parse_worker_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"worker[%(process)d] epoch {args.epoch} %(levelname)s %(message)s")
    try:
        secret = read_secret(sys.stdin)
    except ValueError as exc:
        logger.error("cannot talk to the frontend: %s", exc)
        return _NO_SECRET_EXIT_CODE
    if not _die_with_parent(args.parent_pid):
        logger.error("the frontend (pid %d) is gone: exiting", args.parent_pid)
        return _NO_SECRET_EXIT_CODE
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    outbox = context.socket(zmq.PUSH)
    inbox.setsockopt(zmq.LINGER, 0)
    outbox.setsockopt(zmq.LINGER, _FINAL_SEND_LINGER_MS)
    ledger: ScheduledLedger | None = None
    loop: WorkerLoop | None = None
    try:
        inbox.connect(ipc_address(args.runtime_dir, INPUT_SOCKET, args.epoch))
        outbox.connect(ipc_address(args.runtime_dir, OUTPUT_SOCKET, args.epoch))
        ledger = ScheduledLedger(ledger_path(args.runtime_dir, args.epoch))
        hooks = fault_injection.step_hooks(args.epoch)  # None unless $PAGEDSERVE_FAULT is set (tests only)
        load = functools.partial(load_engine, args.config, args.kv_segment, hooks)
        engine, kv_shared = run_at_idle_priority(load) if args.is_standby else load()
        from gpu_worker.process.worker_loop import WorkerLoop  # imported by load_engine: no cost here
        from shared.protocol import encode
        ready = ready_message(engine, args.epoch, secret, kv_shared)
        logger.info("ready: %s on %s (%s%s), %d KV blocks of %d tokens (%s), max_model_len %d", args.config.model,
                    ready.device, ready.dtype, cpu_tier_note(engine), ready.num_kv_blocks, ready.block_size,
                    f"shared, in {args.kv_segment}" if kv_shared else "private", ready.max_model_len)
        outbox.send_multipart(encode(ready))
        loop = WorkerLoop(engine, inbox, outbox, ledger, args.epoch, secret)
        loop.memory.install_debug_signal(args.debug_memory)  # a no-op unless the frontend runs with --debug-memory
        loop.run()
        return 0
    except Exception as exc:  # noqa: BLE001 - anything left here is fatal, and the frontend must hear why
        text = traceback.format_exc()
        request_ids = loop.step_request_ids if loop is not None else ()
        logger.error("fatal, in a step of requests %s: %s", list(request_ids), text)
        _send_last_words(outbox, args.epoch, secret, f"{type(exc).__name__}: {exc}", text, request_ids)
        return 1
    finally:
        if ledger is not None:
            ledger.close()
        inbox.close()
        outbox.close()
        context.term()


def load_engine(config: EngineConfig, kv_segment: Path | None, hooks: StepHooks | None) -> tuple[Engine, bool]:
    """The heavy part of a start: torch's import, the engine loaded and warmed up, its KV cache moved into the
    shared segment when there is one (and whether that worked)."""
    import gpu_worker.process.worker_loop  # noqa: F401 - torch, numpy, and all else main imports after this
    engine = start_engine(config, hooks)
    return engine, kv_segment is not None and share_kv_cache(engine, kv_segment)


def start_engine(config: EngineConfig, hooks: StepHooks | None) -> Engine:
    """Load the model and warm it up, so the first real request pays no warm-up cost."""
    from gpu_worker.engine.engine import Engine
    engine = Engine(config, hooks)
    engine.warm_up()
    return engine


def cpu_tier_note(engine: Engine) -> str:
    """", CPU tier avx2" for the ready line of a worker on the CPU; "" on a GPU."""
    runner = engine.runner
    return f", CPU tier {runner.cpu_tier.name}" if runner.device.type == "cpu" else ""


def share_kv_cache(engine: Engine, segment: Path) -> bool:
    """Move the warmed-up engine's KV cache into the shared segment; False (and why, in the log) when it cannot."""
    try:
        engine.use_kv_segment(segment)
    except OSError as exc:
        logger.warning("the KV cache stays private to this worker, so a successor will recompute what it held: "
                       "cannot map the shared segment %s: %s", segment, exc)
        return False
    return True


def ready_message(engine: Engine, epoch: int, secret: str, kv_shared: bool) -> Ready:
    import torch

    from shared.protocol import Ready
    runner = engine.runner
    return Ready(epoch=epoch, secret=secret, pid=os.getpid(), max_model_len=engine.max_model_len,
                 vocab_size=runner.model_config.vocab_size, eos_token_ids=engine.eos_token_ids,
                 num_kv_blocks=engine.block_manager.num_blocks, block_size=engine.block_manager.block_size,
                 device=str(runner.device), dtype=str(runner.dtype).removeprefix("torch."), kv_shared=kv_shared,
                 cpu_threads=torch.get_num_threads() if runner.device.type == "cpu" else 0)


def _send_last_words(outbox: zmq.Socket, epoch: int, secret: str, message: str, text: str,
                     request_ids: tuple[str, ...]) -> None:
    from shared.protocol import Fatal, encode  # imported already, unless the start failed before load_engine
    try:
        outbox.send_multipart(encode(Fatal(epoch, secret, message, text, request_ids)), zmq.NOBLOCK)
    except zmq.ZMQError:
        pass  # the frontend is gone or not reading: it learns of the death from the exit status alone


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(0)  # unwinds through main's `finally`, which closes the sockets


def _die_with_parent(parent_pid: int) -> bool:
    """Ask Linux to SIGKILL this process when the frontend dies, so no orphan worker keeps the accelerator. False
    when the frontend has died already: while this process imported torch, say, before it could ask."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: an orphan worker then lingers until killed
    return os.getppid() == parent_pid


if __name__ == "__main__":
    exit_code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter's teardown (most of a second with torch loaded): main closed what matters, and a
    # recycled worker's successor takes over only once this process has exited.
    os._exit(exit_code)
