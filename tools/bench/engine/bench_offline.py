"""Offline throughput: our Engine vs transformers' generate() with static batches, same model, same process.

The workload is mixed-length and seeded: prompts of 32-512 random tokens,
outputs of 16-256 tokens, every request ignoring EOS so both sides produce
exactly the requested tokens. The baseline runs static batches of 16 (left
padded, each batch running to its longest output), as a server without
continuous batching would. Both use the same weights, dtype, threads and
device (CUDA when torch sees a GPU, as the engine's --device auto).

Also reports KV utilisation: tokens held / token slots allocated, averaged
over engine steps, ours (paged blocks) vs one contiguous max_model_len
reservation per running request.

With `--workload json-schema` it measures structured output's cost instead:
the same requests free and constrained by a JSON schema, same seeds, and
the schema's compile times (bench_structured_output.py, beside this one).

With `--workload shared-prefix` it measures prefix caching instead: 64
requests sharing a 1,024-token prefix, each with 32-128 tokens of its own
and 64 output tokens, through the engine with caching on and then off
(prefill tokens computed, mean time to first token, throughput), and the
mixed workload on and off, where nothing is shared, to show the cost of the
hashing.

After the engine's tokens/s it prints the run's roofline (tools/benchlib/roofline.py):
the matmul rate and bandwidth of the device it ran on (tools/benchlib/machine_limits.py:
the CPU's, or the GPU's under CUDA), measured after the run, the
workload's FLOPs and bytes, the lower bound on its time and the share of it
achieved. With --profile the engine's steps run under torch.profiler and the
top operators by self CPU time are printed (the profiler's overhead is in
that run's seconds). --shared-kv-cache runs the engine as a server's worker
runs it by default on the CPU: the KV cache in a /dev/shm segment and each
step's KV progress reported (computed; there is no frontend to send it to).

    python -m tools.bench.engine.bench_offline                    # SmolLM-135M shape, random weights
    python -m tools.bench.engine.bench_offline --num-requests 16 --max-output 64   # a quick look
    python -m tools.bench.engine.bench_offline --workload shared-prefix --dtype bfloat16
    python -m tools.bench.engine.bench_offline --workload json-schema --max-output 128 --dtype bfloat16
    python -m tools.bench.engine.bench_offline --model shared/default_model --num-requests 8 --skip-baseline --profile
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# isort: off
import gpu_worker  # noqa: F401 - before torch: under $PAGEDSERVE_CPU_ISA it holds torch to that tier
# isort: on
import torch

from gpu_worker.engine.engine import Engine
from gpu_worker.engine.generate import generate
from gpu_worker.models.config import read_model_config
from gpu_worker.runner.model_runner import select_device
from shared.config import EngineConfig
from shared.cpu_tier import current_tier
from shared.sampling_params import SamplingParams

from tools.bench.engine.bench_structured_output import run_json_schema
from tools.benchlib.checkpoints import SMOLLM_135M_VOCAB_SIZE, ensure_tokenizer, write_weights
from tools.benchlib.machine_limits import device_limits
from tools.benchlib.roofline import Roofline, workload_cost
from tools.benchlib.workload import MIN_TOKEN_ID, BenchRequest, synthetic_workload, vocab_size_of

SMOLLM_MAX_LENGTH = 2048
NUM_PROFILE_OPERATORS = 15


def make_checkpoint(directory: Path, dtype: torch.dtype) -> Path:
    """A SmolLM-135M-shaped Llama with random weights (seeded), saved in the Hugging Face layout, no tokenizer."""
    path = directory / f"smollm-135m-shape-{str(dtype).removeprefix('torch.')}"
    if not (path / "config.json").exists():
        write_weights(path, "smollm-135m", SMOLLM_135M_VOCAB_SIZE, dtype, SMOLLM_MAX_LENGTH, seed=0)
    return path


def mixed_workload(args: argparse.Namespace, vocab_size: int) -> list[BenchRequest]:
    """Prompts of --min-prompt to --max-prompt random ids, --min-output to --max-output tokens, seeded."""
    return synthetic_workload(args.num_requests, (args.min_prompt, args.max_prompt), (args.min_output, args.max_output),
                              vocab_size, args.seed)


@dataclass(slots=True)
class EngineRun:
    seconds: float
    mean_ttft: float  # seconds from submission (all at once) to each request's first token, averaged
    prefill_tokens_computed: int  # prompt tokens not served from the prefix cache (recompute excluded)
    num_preemptions: int
    paged_kv_utilisation: float  # tokens held / token slots allocated, averaged over steps
    contiguous_kv_utilisation: float  # the same against a max_model_len reservation per running request
    num_steps: int
    profile: torch.profiler.profile | None  # the steps' operators, with --profile


def run_engine(path: Path, workload: list[BenchRequest], dtype: str, max_num_seqs: int,
               max_num_batched_tokens: int, enable_prefix_caching: bool = True, profile: bool = False,
               shared_kv: bool = False) -> EngineRun:
    engine = Engine(EngineConfig(model=str(path), dtype=dtype, max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=max_num_batched_tokens,
                                 enable_prefix_caching=enable_prefix_caching))
    if engine.thread_choice is not None:  # from 4 CPUs the engine times its thread counts; the run uses the fastest
        print(f"CPU threads: {engine.thread_choice.describe()}")
    generate(engine, [[3] * 64] * 2, SamplingParams(max_tokens=4, temperature=0))  # warm up allocator and threads
    with contextlib.ExitStack() as cleanup:
        if shared_kv:  # as a worker with --shared-kv-cache: the pool in /dev/shm, its KV progress after each step
            segment = cleanup.enter_context(tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="bench-kv-"))
            engine.use_kv_segment(Path(segment.name))
        return _timed_run(engine, workload, profile, shared_kv)


def _timed_run(engine: Engine, workload: list[BenchRequest], profile: bool, shared_kv: bool) -> EngineRun:
    engine.block_manager.num_prefix_query_tokens = engine.block_manager.num_prefix_hit_tokens = 0
    held = paged_slots = contiguous_slots = num_steps = 0
    first_token_times: dict[str, float] = {}
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profile else None
    start = time.perf_counter()
    for i, request in enumerate(workload):
        engine.add_request(f"bench-{i}", request.prompt,
                           SamplingParams(max_tokens=request.max_tokens, temperature=0, ignore_eos=True))
    with profiler or contextlib.nullcontext():
        while engine.has_work():
            scheduled = engine.schedule()
            outputs = engine.run(scheduled)
            if shared_kv:
                engine.kv_progress(scheduled)
            num_steps += 1
            now = time.perf_counter() - start
            for out in outputs:
                first_token_times.setdefault(out.request_id, now)
            running = engine.scheduler.running
            held += sum(seq.num_computed_tokens for seq in running)
            paged_slots += sum(len(seq.block_table) for seq in running) * engine.block_manager.block_size
            contiguous_slots += len(running) * engine.max_model_len
    seconds = time.perf_counter() - start
    prompt_tokens = sum(len(r.prompt) for r in workload)
    return EngineRun(seconds, sum(first_token_times.values()) / len(first_token_times),
                     prompt_tokens - engine.block_manager.num_prefix_hit_tokens, engine.scheduler.num_preemptions,
                     held / max(paged_slots, 1), held / max(contiguous_slots, 1), num_steps, profiler)


def shared_prefix_workload(num_requests: int, prefix_len: int, min_suffix: int, max_suffix: int, output_len: int,
                           vocab_size: int, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    prefix = [rng.randrange(MIN_TOKEN_ID, vocab_size) for _ in range(prefix_len)]
    return [BenchRequest(prefix + [rng.randrange(MIN_TOKEN_ID, vocab_size)
                                   for _ in range(rng.randint(min_suffix, max_suffix))], output_len)
            for _ in range(num_requests)]


def run_static_batches(path: Path, workload: list[BenchRequest], dtype: torch.dtype, batch_size: int) -> float:
    """transformers' generate() on static, left-padded batches, on the device the engine picks (CUDA when torch
    sees a GPU); returns seconds."""
    from transformers import AutoModelForCausalLM

    device = select_device("auto")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    pad_id = 0
    start = time.perf_counter()
    for first in range(0, len(workload), batch_size):
        batch = workload[first:first + batch_size]
        width = max(len(r.prompt) for r in batch)
        input_ids = torch.tensor([[pad_id] * (width - len(r.prompt)) + r.prompt for r in batch], device=device)
        attention_mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch],
                                      device=device)
        longest = max(r.max_tokens for r in batch)
        with torch.inference_mode():
            model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=longest,
                           min_new_tokens=longest, do_sample=False, pad_token_id=pad_id)
    if device.type == "cuda":
        torch.cuda.synchronize()  # the clock stops when the device is done, not when its work is queued
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a Hugging Face checkpoint directory (default: SmolLM-135M shape, random)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--min-prompt", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=512)
    parser.add_argument("--min-output", type=int, default=16)
    parser.add_argument("--max-output", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16, help="static batch size of the baseline")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--workload", default="mixed", choices=["mixed", "shared-prefix", "json-schema"])
    parser.add_argument("--rounds", type=int, default=3, help="json-schema workload: free/constrained pairs")
    parser.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix workload: common prefix tokens")
    parser.add_argument("--profile", action="store_true", help="print the engine steps' top operators by self CPU time")
    parser.add_argument("--shared-kv-cache", action="store_true",
                        help="hold the KV cache in /dev/shm and report each step's KV progress, as a server's worker "
                             "does with --shared-kv-cache")
    args = parser.parse_args(argv)

    torch_dtype = getattr(torch, args.dtype)
    path = Path(args.model) if args.model else make_checkpoint(Path(tempfile.gettempdir()), torch_dtype)
    vocab_size = SMOLLM_135M_VOCAB_SIZE if not args.model else vocab_size_of(path)
    workload = mixed_workload(args, vocab_size)
    useful_tokens = sum(r.max_tokens for r in workload)
    print(f"model {path} dtype {args.dtype} threads {torch.get_num_threads()}")
    if args.workload == "shared-prefix":
        compare_prefix_caching(path, args, vocab_size)
        return
    if args.workload == "json-schema":
        compare_json_schema(path, args, vocab_size)
        return
    print(f"requests {len(workload)} prompt tokens {sum(len(r.prompt) for r in workload)} "
          f"output tokens {useful_tokens}")
    run = run_engine(path, workload, args.dtype, args.max_num_seqs, args.max_num_batched_tokens, profile=args.profile,
                     shared_kv=args.shared_kv_cache)
    ours = useful_tokens / run.seconds
    print(f"pagedserve engine:        {run.seconds:8.1f} s  {ours:8.1f} output tokens/s  ({run.num_steps} steps)")
    print(run_roofline(path, workload, args.dtype, run.num_steps).format(tier_label(args.dtype), run.seconds))
    if run.profile is not None:
        print(format_profile(run.profile, run.seconds))
    print(f"KV utilisation: paged {run.paged_kv_utilisation:.1%}   "
          f"contiguous max_model_len reservation {run.contiguous_kv_utilisation:.1%}")
    if args.skip_baseline:
        return
    baseline_seconds = run_static_batches(path, workload, torch_dtype, args.batch_size)
    baseline = useful_tokens / baseline_seconds
    print(f"transformers static x{args.batch_size}: {baseline_seconds:8.1f} s  {baseline:8.1f} output tokens/s")
    print(f"throughput ratio (ours / static batching): {ours / baseline:.2f}x")


def run_roofline(path: Path, workload: list[BenchRequest], dtype: str, num_steps: int) -> Roofline:
    """The run's FLOPs and bytes against the ceilings of the device it ran on, measured now (after the run, not
    during it)."""
    torch_dtype = getattr(torch, dtype)
    cost = workload_cost(read_model_config(path), torch_dtype.itemsize,
                         [(len(r.prompt), r.max_tokens) for r in workload], num_steps)
    return Roofline(cost, *device_limits(select_device("auto").type, torch_dtype))


def tier_label(dtype: str) -> str:
    """"float32, CPU tier avx2" on the CPU (the tier its figures are for); the dtype alone on a GPU."""
    return f"{dtype}, CPU tier {current_tier().name}" if select_device("auto").type == "cpu" else dtype


def format_profile(profiler: torch.profiler.profile, seconds: float) -> str:
    """The top operators by self CPU time, as shares of the run; what no torch operator covers is the rest."""
    events = sorted(profiler.key_averages(), key=lambda event: event.self_cpu_time_total, reverse=True)
    total_s = sum(event.self_cpu_time_total for event in events) / 1e6
    lines = [f"profile: {seconds:.2f} s under the profiler, {total_s:.2f} s self CPU time in torch operators",
             f"  {'operator':<40}{'calls':>8}{'self ms':>10}{'share':>8}"]
    for event in events[:NUM_PROFILE_OPERATORS]:
        self_ms = event.self_cpu_time_total / 1e3
        lines.append(f"  {event.key[:40]:<40}{event.count:>8}{self_ms:>10.1f}{self_ms / 1e3 / seconds:>8.1%}")
    rest_s = seconds - total_s
    lines.append(f"  {'outside torch operators (Python, C decode attention)':<58}{rest_s * 1e3:>10.1f}{rest_s / seconds:>8.1%}")
    return "\n".join(lines)


def compare_prefix_caching(path: Path, args: argparse.Namespace, vocab_size: int) -> None:
    """Prefix caching on vs off: the shared-prefix workload, then the mixed one where nothing is shared."""
    shared = shared_prefix_workload(args.num_requests, args.prefix_len, 32, 128, 64, vocab_size, args.seed)
    mixed = mixed_workload(args, vocab_size)
    for name, workload in (("shared prefix", shared), ("no sharing", mixed)):
        output_tokens = sum(r.max_tokens for r in workload)
        print(f"{name}: {len(workload)} requests, {sum(len(r.prompt) for r in workload)} prompt tokens, "
              f"{output_tokens} output tokens")
        runs = {caching: run_engine(path, workload, args.dtype, args.max_num_seqs, args.max_num_batched_tokens,
                                    enable_prefix_caching=caching) for caching in (True, False)}
        for caching, run in runs.items():
            print(f"{name:13s} caching {'on ' if caching else 'off'}: {run.seconds:7.1f} s  "
                  f"{output_tokens / run.seconds:7.1f} output tokens/s  mean TTFT {run.mean_ttft:6.2f} s  "
                  f"prefill tokens computed {run.prefill_tokens_computed:6d}  preemptions {run.num_preemptions}")
        on, off = runs[True], runs[False]
        print(f"{name:13s} on/off: throughput x{off.seconds / on.seconds:.2f}, "
              f"mean TTFT /{off.mean_ttft / on.mean_ttft:.2f}")


def compare_json_schema(path: Path, args: argparse.Namespace, vocab_size: int) -> None:
    """Every request constrained by a JSON schema vs free, same seeds, decode-heavy (prompts of 32-64 tokens)."""
    ensure_tokenizer(path, vocab_size)
    rng = random.Random(args.seed)
    workload = [BenchRequest([rng.randrange(MIN_TOKEN_ID, vocab_size) for _ in range(rng.randint(32, 64))],
                             args.max_output) for _ in range(args.num_requests)]
    print(f"json-schema: {len(workload)} requests at once, {args.max_output} output tokens each")
    free = run_json_schema(path, args.dtype, [r.prompt for r in workload], args.max_output,
                           args.max_num_seqs, args.max_num_batched_tokens, args.rounds)
    print(run_roofline(path, workload, args.dtype, free.num_steps).format(tier_label(args.dtype), free.seconds))


if __name__ == "__main__":
    sys.exit(main())
