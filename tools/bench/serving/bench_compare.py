"""bench_serving.py --compare-in-process: one workload through the in-process Engine, then through the server.

Both sides get the same checkpoint and engine flags (parsed by
shared/engine_args, so the EngineConfig is identical), the same token-id
prompts, greedy sampling with EOS ignored (so both produce exactly the same
number of tokens), and the same cap on requests in flight. Each side is
warmed up first; the clock runs from the first request to the last token.
The engine goes first and is freed before the server starts, so they never
share the accelerator.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import shlex
import signal
import tempfile
import time
from collections import deque
from pathlib import Path

from bench_serving import BenchRequest, RequestResult, Target, format_table, run_load, summarize
from local_server import REPO_ROOT, start_server

from shared.config import EngineConfig
from shared.engine_args import add_engine_arguments, engine_config_from_args
from shared.sampling_params import SamplingParams

TARGET_RATIO = 0.9
STOP_TIMEOUT_S = 30.0
WARM_UP = BenchRequest([5, 6, 7, 8], 8)


def engine_config(model_dir: Path, engine_flags: list[str]) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return engine_config_from_args(parser.parse_args(["--model", str(model_dir), *engine_flags]))


def run_in_process(config: EngineConfig, workload: list[BenchRequest], concurrency: int,
                   ignore_eos: bool) -> tuple[int, float]:
    """(output tokens, seconds) of the workload through an Engine, at most `concurrency` requests at a time."""
    import torch

    from gpu_worker.engine.engine import Engine
    from gpu_worker.engine.generate import generate

    engine = Engine(config)
    generate(engine, [WARM_UP.prompt], SamplingParams(max_tokens=WARM_UP.max_tokens, temperature=0))
    pending = deque(enumerate(workload))
    num_in_flight = num_tokens = 0
    start = time.perf_counter()
    while pending or engine.has_work():
        while pending and num_in_flight < concurrency:
            i, request = pending.popleft()
            engine.add_request(f"bench-{i}", request.prompt, SamplingParams(max_tokens=request.max_tokens,
                                                                              temperature=0, ignore_eos=ignore_eos))
            num_in_flight += 1
        for output in engine.step():
            num_tokens += len(output.new_token_ids)
            num_in_flight -= output.is_finished
    seconds = time.perf_counter() - start
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return num_tokens, seconds


def run_through_server(model_dir: Path, engine_flags: list[str], workload: list[BenchRequest], concurrency: int,
                       ignore_eos: bool, show_progress: bool, *, warm_up: list[BenchRequest] | None = None,
                       checkout: Path = REPO_ROOT, env: dict[str, str] | None = None) -> dict:
    """`python -m server` from `checkout` (with `env`), warmed up (by default with one short request), under the
    whole workload; bench_serving's summary."""
    return summarize(*load_through_server(model_dir, engine_flags, workload, concurrency, ignore_eos, show_progress,
                                          warm_up=warm_up, checkout=checkout, env=env))


def load_through_server(model_dir: Path, engine_flags: list[str], workload: list[BenchRequest], concurrency: int,
                        ignore_eos: bool, show_progress: bool, *, warm_up: list[BenchRequest] | None = None,
                        checkout: Path = REPO_ROOT,
                        env: dict[str, str] | None = None) -> tuple[list[RequestResult], float]:
    """As run_through_server, but the per-request results (every ITL gap) and the wall seconds, not their summary."""
    with tempfile.TemporaryDirectory() as tmp:
        process, port = start_server(["--model", str(model_dir), *engine_flags], Path(tmp) / "server.log",
                                     checkout=checkout, env=env)
        try:
            target = Target("127.0.0.1", port, False, None, str(model_dir))
            asyncio.run(run_load(target, warm_up or [WARM_UP], float("inf"), concurrency, ignore_eos, 0, False))
            results, seconds = asyncio.run(run_load(target, workload, float("inf"), concurrency, ignore_eos, 0,
                                                    show_progress))
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(STOP_TIMEOUT_S)
    return results, seconds


def compare_in_process(args: argparse.Namespace, workload: list[BenchRequest]) -> dict:
    if args.model_dir is None:
        raise SystemExit("--compare-in-process needs --model-dir")
    if not all(isinstance(r.prompt, list) for r in workload):
        raise SystemExit("--compare-in-process needs token-id prompts (the synthetic workload has them)")
    flags = shlex.split(args.engine_args)
    num_tokens, seconds = run_in_process(engine_config(args.model_dir, flags), workload, args.max_concurrency,
                                         args.ignore_eos)
    engine_tps = num_tokens / seconds
    print(f"in-process Engine: {num_tokens} output tokens in {seconds:.2f} s = {engine_tps:.1f} tokens/s")
    http = run_through_server(args.model_dir, flags, workload, args.max_concurrency, args.ignore_eos,
                              not args.no_progress)
    print(f"through HTTP ({args.max_concurrency} concurrent streams):")
    print(format_table(http))
    ratio = http["output_tokens_per_s"] / engine_tps
    verdict = "meets" if ratio >= TARGET_RATIO else "MISSES"
    print(f"HTTP / in-process output tokens/s: {http['output_tokens_per_s']:.1f} / {engine_tps:.1f} = {ratio:.3f} "
          f"({verdict} the >= {TARGET_RATIO:.2f} target)")
    return {"in_process": {"output_tokens": num_tokens, "seconds": seconds, "output_tokens_per_s": engine_tps},
            "http": http, "ratio": ratio, "num_failed": http["num_failed"]}
