"""The device check's measurements: the device's ceilings, and decode step time against them at a batch ladder.

    python -m tools.device.device_measure limits --device cuda --json OUT/limits.json
    python -m tools.device.device_measure decode --model CKPT --limits OUT/limits.json --batches 1 16 64 256
    python -m tools.device.device_measure profile --model CKPT --batch 64

`limits` measures the two ceilings of a roofline on the device the check runs
on (tools/benchlib/machine_limits.py): on CUDA an 8192^3 bf16 matrix product
on random data and a 1 GiB device-to-device copy, counting bytes read plus
written, timed with CUDA events; on the CPU the matmul rate and read
bandwidth. It prints them and writes them as JSON for `decode`.

`decode` runs bench_host_time's measurement (tools/bench/engine/; greedy,
128-token prompts) in a fresh process per batch size, so each engine has the
device to itself, and prints each batch's median decode step against its
floor: max(FLOPs / matmul rate, bytes / bandwidth), where a step's FLOPs are
two per matmul parameter per sequence and its bytes are the weights plus the
KV cache it reads. Attention FLOPs, norms and sampling are left out, so the
floor is a true lower bound.

`profile` runs decode steps of one batch under torch.profiler (the CPU, and
CUDA where the model is on it) and prints what a step spends: its wall
time, the host's self time in the top operators, and per step how many
kernels it launched and how often the host waited for the device
(synchronisations and device-to-host copies). A step far above its floor
at every batch size, as the device check's decode part shows on a GPU, is
either launch-bound (many small kernels) or sync-bound (the host waits on
the device inside the step); this says which.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

GREEDY = json.dumps({"temperature": 0.0})


def run_limits(args: argparse.Namespace) -> None:
    import platform

    import torch

    from tools.benchlib.machine_limits import device_limits

    rate, bandwidth = device_limits(args.device, getattr(torch, args.dtype))
    name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
    args.json.write_text(json.dumps({"device": name, "matmul_flops": rate, "bandwidth_bytes_per_s": bandwidth}))
    print(f"device: {name}")
    print(f"key: {args.dtype} matmul {rate / 1e12:.2f} TFLOP/s, bandwidth {bandwidth / 1e9:.1f} GB/s")


def step_flops(model_dir: Path, num_seqs: int) -> int:
    """Two FLOPs per matmul parameter per sequence: the projections, the MLP and the LM head."""
    from gpu_worker.models.config import read_model_config

    from tools.benchlib.roofline import layer_parameters, lm_head_parameters

    config = read_model_config(model_dir)
    return 2 * num_seqs * (layer_parameters(config) + lm_head_parameters(config))


def measure_batch(args: argparse.Namespace, num_seqs: int) -> dict:
    """bench_host_time's decode steps at one batch size, in a fresh process: its JSON result."""
    command = [sys.executable, "-m", "tools.bench.engine.bench_host_time", "--measure-json", GREEDY, "--model",
               str(args.model), "--num-seqs", str(num_seqs), "--steps", str(args.steps), "--dtype", args.dtype]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode:
        raise SystemExit(f"batch {num_seqs}: the measurement failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_decode(args: argparse.Namespace) -> None:
    limits = json.loads(args.limits.read_text())
    rate, bandwidth = limits["matmul_flops"], limits["bandwidth_bytes_per_s"]
    print(f"ceilings ({limits['device']}): bf16 matmul {rate / 1e12:.2f} TFLOP/s, bandwidth {bandwidth / 1e9:.1f} GB/s")
    print(f"{'batch':>6}{'step ms':>10}{'floor ms':>10}{'bound':>9}{'floor/step':>12}")
    step_ms = []
    for num_seqs in args.batches:
        result = measure_batch(args, num_seqs)
        step_s = statistics.median(result["step"])
        compute_s, memory_s = step_flops(args.model, num_seqs) / rate, result["read_bytes"] / bandwidth
        floor_s = max(compute_s, memory_s)
        bound = "compute" if compute_s > memory_s else "memory"
        print(f"{num_seqs:>6}{step_s * 1e3:>10.2f}{floor_s * 1e3:>10.3f}{bound:>9}{floor_s / step_s:>12.1%}",
              flush=True)
        step_ms.append(f"{step_s * 1e3:.1f}")
    batches = "/".join(str(b) for b in args.batches)
    print(f"key: step ms at batch {batches}: {'/'.join(step_ms)}")


PROFILE_WARM_UP_STEPS = 5
HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync",
              "cudaMemcpy")


def run_profile(args: argparse.Namespace) -> None:
    import random
    import time

    import torch

    from gpu_worker.engine.engine import Engine
    from shared.config import EngineConfig
    from shared.sampling_params import SamplingParams

    engine = Engine(EngineConfig(model=str(args.model), dtype=args.dtype, max_num_seqs=args.batch,
                                 max_num_batched_tokens=max(2048, args.batch * 128)))
    vocab_size, rng = engine.runner.model_config.vocab_size, random.Random(0)
    for i in range(args.batch):
        engine.add_request(f"seq-{i}", [rng.randrange(3, vocab_size) for _ in range(128)],
                           SamplingParams(max_tokens=PROFILE_WARM_UP_STEPS + args.steps + 2, temperature=0,
                                          ignore_eos=True))
    while any(seq.num_computed_tokens < 128 for seq in engine.scheduler.running + engine.scheduler.waiting):
        engine.step()
    for _ in range(PROFILE_WARM_UP_STEPS):
        engine.step()
    on_cuda = engine.runner.device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_cuda else [])
    with torch.profiler.profile(activities=activities) as profiler:
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        seconds = time.perf_counter() - start
    events = profiler.key_averages()
    step_ms = seconds / args.steps * 1e3
    print(f"{args.batch} sequences, {args.steps} decode steps under the profiler: {step_ms:.2f} ms a step")
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    waits = {e.key: e.count / args.steps for e in events if e.key in HOST_WAITS and e.count}
    device_ms = sum(e.self_device_time_total for e in events) / 1e3 / args.steps if on_cuda else 0.0
    print(f"per step: {launches / args.steps:.0f} kernel launches, device busy {device_ms:.2f} ms; host waits "
          + (", ".join(f"{name} x{count:.1f}" for name, count in waits.items()) or "none"))
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:args.top]
    print(f"  {'operator (host self time)':<44}{'calls/step':>11}{'us/step':>10}")
    for event in top:
        print(f"  {event.key[:44]:<44}{event.count / args.steps:>11.1f}{event.self_cpu_time_total / args.steps:>10.1f}")
    print(f"key: batch {args.batch}: {step_ms:.1f} ms a step, {launches / args.steps:.0f} launches, "
          f"device busy {device_ms:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    limits = commands.add_parser("limits", help="the device's matmul rate and memory bandwidth")
    limits.add_argument("--device", choices=("cpu", "cuda"), required=True)
    limits.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    limits.add_argument("--json", type=Path, required=True, help="where to write them")
    decode = commands.add_parser("decode", help="decode step time at a batch ladder against the limits")
    decode.add_argument("--model", type=Path, required=True)
    decode.add_argument("--limits", type=Path, required=True, help="the JSON `limits` wrote")
    decode.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    decode.add_argument("--steps", type=int, default=30, help="decode steps timed per batch size")
    decode.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    profile = commands.add_parser("profile", help="one batch's decode steps under torch.profiler")
    profile.add_argument("--model", type=Path, required=True)
    profile.add_argument("--batch", type=int, default=64)
    profile.add_argument("--steps", type=int, default=10)
    profile.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    profile.add_argument("--top", type=int, default=15, help="operators listed")
    args = parser.parse_args()
    {"limits": run_limits, "decode": run_decode, "profile": run_profile}[args.command](args)


if __name__ == "__main__":
    main()
