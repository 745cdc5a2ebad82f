"""bench_serving --compare-in-process: one workload through the in-process Engine, then through the server.

Both sides get the same checkpoint and engine flags (parsed by
shared/engine_args, so the EngineConfig is identical), the same token-id
prompts, greedy sampling with EOS ignored (so both produce exactly the same
number of tokens), and the same cap on requests in flight. Each side is
warmed up first; the clock runs from the first request to the last token.
The engine goes first and is freed before the server starts, so they never
share the accelerator. Not a script of its own: bench_serving imports it for
that mode only, since it imports torch.
"""

from __future__ import annotations

import argparse
import gc
import shlex
import time
from collections import deque
from pathlib import Path

from shared.config import EngineConfig
from shared.engine_args import add_engine_arguments, engine_config_from_args
from shared.sampling_params import SamplingParams

from tools.benchlib.http_load import WARM_UP, format_table, run_through_server
from tools.benchlib.workload import BenchRequest

TARGET_RATIO = 0.9


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
