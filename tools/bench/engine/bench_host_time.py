"""Per-step host time: what the engine's decode steps spend outside the model, at a batch of running sequences.

On a GPU a small model's decode step takes a few milliseconds, and what the
host does around it (scheduling, input preparation, sampling, packing the
outputs) adds to every step unless it is cheap. This measures it on the CPU:
a batch of sequences (default 64) is prefilled, then each decode step is
timed whole and split into the model's time (its forward pass and the LM
head, with the argmax it takes on the way in a greedy step, timed around the
model's own calls, or the runner's kernel step
where it runs the forward pass) and the rest, the host time. The steps run
as the checkout's worker loop runs them: in Engine.serving() where it has
one (inference mode held throughout), else each on its own.
Sampling runs with the checkpoint's generation_config.json values
(temperature, top_p, top_k; the default model's are 0.8 and 0.95) and, in a
second row, greedy.

With --baseline DIR the same measurement runs on another checkout of
pagedserve (a worktree of an earlier commit) in alternating rounds, each side
in its own process, and the per-round ratio of host times is printed: the
speed-up, robust to the machine's load moving between rounds.

    python -m tools.bench.engine.bench_host_time                         # the default model, 64 sequences
    python -m tools.bench.engine.bench_host_time --num-seqs 16 --steps 40
    git worktree add /tmp/pagedserve-base <commit>
    python -m tools.bench.engine.bench_host_time --baseline /tmp/pagedserve-base --rounds 4

The model's time is set against the machine: the bytes a decode step must
read (the weights and the KV cache in use) over the memory bandwidth
measured in the same run, the floor of the forward pass.

Each side's measurement (--measure-json) runs this file by its path, in a
process that imports pagedserve from the checkout measured (an earlier
commit's may have no tools package): so nothing of tools/ is imported at
module level, only in main().
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT_LEN = 128
WARM_UP_STEPS = 8


def measure(model_dir: Path, num_seqs: int, num_steps: int, sampling: dict, dtype: str) -> dict:
    """Decode steps of `num_seqs` running sequences: per-step seconds, whole and in the model, and the KV read."""
    import torch

    from gpu_worker.engine.engine import Engine
    from shared.config import EngineConfig
    from shared.sampling_params import SamplingParams

    engine = Engine(EngineConfig(model=str(model_dir), dtype=dtype, max_num_seqs=num_seqs,
                                 max_num_batched_tokens=max(2048, num_seqs * PROMPT_LEN)))
    vocab_size = engine.runner.model_config.vocab_size
    rng = random.Random(0)
    max_tokens = WARM_UP_STEPS + num_steps + 1
    for i in range(num_seqs):
        engine.add_request(f"seq-{i}", [rng.randrange(3, vocab_size) for _ in range(PROMPT_LEN)],
                           SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=i, **sampling))
    while any(seq.num_computed_tokens < PROMPT_LEN for seq in engine.scheduler.running + engine.scheduler.waiting):
        engine.step()
    model_seconds = [0.0]
    model = engine.runner.model
    for name in ("forward", "compute_logits", "compute_logits_and_argmax"):  # the last where the checkout has it
        if hasattr(model, name):
            setattr(model, name, _timed(getattr(model, name), model_seconds))
    kernel_step = getattr(engine.runner, "kernel_step", None)  # the forward pass as the C kernels' calls, if any
    if kernel_step is not None:
        kernel_step.forward = _timed(kernel_step.forward, model_seconds)
    steps, in_model = [], []
    # The steps run as the worker loop runs them: in the engine's serving context, where the checkout has one.
    serving = getattr(engine, "serving", contextlib.nullcontext)
    with serving():
        for index in range(WARM_UP_STEPS + num_steps):
            model_seconds[0] = 0.0
            start = time.perf_counter()
            engine.run(engine.schedule())
            if index >= WARM_UP_STEPS:
                steps.append(time.perf_counter() - start)
                in_model.append(model_seconds[0])
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    config = engine.runner.model_config
    kv_bytes_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * (
        torch.finfo(engine.runner.dtype).bits // 8)
    kv_bytes = kv_bytes_per_token * num_seqs * (PROMPT_LEN + WARM_UP_STEPS + num_steps // 2)
    return {"step": steps, "model": in_model, "read_bytes": weight_bytes + kv_bytes}


def _timed(function, total: list[float]):
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            total[0] += time.perf_counter() - start
    return timed


def sampling_of(model_dir: Path) -> dict:
    """The checkpoint's sampling defaults (generation_config.json), as SamplingParams fields."""
    path = model_dir / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    return {name: config[name] for name in ("temperature", "top_p", "top_k") if name in config}


def run_side(checkout: Path, args: argparse.Namespace, sampling: dict) -> dict:
    """One measurement in a fresh process importing pagedserve from `checkout`."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    command = [sys.executable, __file__, "--measure-json", json.dumps(sampling), "--model", str(args.model),
               "--num-seqs", str(args.num_seqs), "--steps", str(args.steps), "--dtype", args.dtype]
    result = subprocess.run(command, env=env, cwd=checkout, capture_output=True, text=True, check=False)
    if result.returncode:
        raise SystemExit(f"the measurement in {checkout} failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def summary(result: dict) -> dict:
    """Medians per step, in milliseconds: whole, in the model, and the host time (the rest)."""
    host = [step - model for step, model in zip(result["step"], result["model"])]
    return {"step_ms": 1e3 * statistics.median(result["step"]), "model_ms": 1e3 * statistics.median(result["model"]),
            "host_ms": 1e3 * statistics.median(host)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="a checkpoint (default: shared/default_model)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--steps", type=int, default=60, help="decode steps timed, after a few untimed")
    parser.add_argument("--baseline", type=Path, help="another checkout to measure in alternating rounds")
    parser.add_argument("--rounds", type=int, default=3, help="with --baseline: rounds of both sides")
    parser.add_argument("--measure-json", help=argparse.SUPPRESS)  # one side's run: prints its result as JSON
    args = parser.parse_args()
    if args.measure_json is not None:  # one side's run, from run_side, which names the model
        print(json.dumps(measure(args.model, args.num_seqs, args.steps, json.loads(args.measure_json), args.dtype)))
        return
    from tools import REPO_ROOT  # not at module level: see the module's docstring

    args.model = args.model or REPO_ROOT / "shared" / "default_model"
    workloads = {"generation_config": sampling_of(args.model), "greedy": {"temperature": 0.0}}
    sides = {"this": REPO_ROOT} if args.baseline is None else {"this": REPO_ROOT, "baseline": args.baseline.resolve()}
    rounds = args.rounds if args.baseline is not None else 1
    read_bytes = 0
    for name, sampling in workloads.items():
        print(f"{name} sampling {sampling}, {args.num_seqs} sequences, {args.dtype}:")
        ratios = []
        for round_index in range(rounds):
            order = list(sides) if round_index % 2 == 0 else list(reversed(sides))
            results = {side: run_side(sides[side], args, sampling) for side in order}
            read_bytes = results["this"]["read_bytes"]
            summaries = {side: summary(result) for side, result in results.items()}
            for side in order:
                s = summaries[side]
                print(f"  round {round_index + 1} {side:8s} step {s['step_ms']:6.2f} ms  model {s['model_ms']:6.2f} ms"
                      f"  host {s['host_ms']:5.2f} ms")
            if "baseline" in summaries:
                ratios.append(summaries["this"]["host_ms"] / summaries["baseline"]["host_ms"])
        if ratios:
            print(f"  host time this / baseline: median {statistics.median(ratios):.3f} "
                  f"({', '.join(f'{r:.3f}' for r in ratios)})")
    from tools.benchlib.machine_limits import memory_bandwidth

    bandwidth = memory_bandwidth()
    print(f"machine: memory bandwidth {bandwidth / 1e9:.1f} GB/s; a decode step reads {read_bytes / 1e6:.1f} MB "
          f"(weights + KV), a floor of {1e3 * read_bytes / bandwidth:.2f} ms for the model's part")


if __name__ == "__main__":
    main()
