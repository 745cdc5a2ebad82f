"""The same HTTP load against two servers, this checkout's and a baseline, in alternating rounds: the speed-up.

Absolute tokens/s on a shared machine move by tens of percent from minute to
minute; a ratio of two servers measured back to back moves much less. Each
round starts `python -m server` from one side's checkout with its flags on
the checkpoint, warms it up (16 requests of the same kind, other lengths),
sends the workload (token-id prompts, greedy, EOS ignored, so both sides
produce exactly the same tokens), stops it, then does the same for the other
side; the order alternates from round to round (ABBA...), so a trend in
the machine's load falls on both sides alike. The baseline is another
checkout of pagedserve (e.g. a worktree of an earlier commit), other server
flags (--baseline-engine-args) or environment (--env, --baseline-env), or
any of them together:

    git worktree add /tmp/pagedserve-base <commit>
    python -m tools.bench.serving.bench_against --baseline /tmp/pagedserve-base --model-dir CKPT --rounds 3 \
        --num-requests 64 --prompt-len 32 512 --output-len 16 256 --max-concurrency 16
    python -m tools.bench.serving.bench_against --model-dir CKPT --engine-args "--cpu-threads 1" --baseline-engine-args ""

--cold leaves out the warm-up (but for one short request): the workload is
then the first requests a fresh server serves, while it is still starting
whatever it starts after READY (a standby worker, with the defaults):

    python -m tools.bench.serving.bench_against --model-dir CKPT --cold --engine-args "--dtype float32" \
        --baseline-engine-args "--dtype float32 --standby-workers 0" --rounds 4

Prints each run's output tokens/s, TTFT p50 and ITL p50/p99, and the CPU
time per output token of the server's frontend, its worker and the load
generator (tools/benchlib/process_cpu.py: on a small machine they share the
cores), each round's ratio (this / baseline) and their median, then this
checkout's best run against the machine's roofline (tools/benchlib/roofline.py).
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
from pathlib import Path

from tools import REPO_ROOT
from tools.benchlib.http_load import run_through_server
from tools.benchlib.process_cpu import CpuSplit
from tools.benchlib.roofline import format_roofline
from tools.benchlib.workload import BenchRequest, synthetic_workload, vocab_size_of

WARM_UP_REQUESTS = 16


def run_side(checkout: Path, engine_flags: list[str], env: dict[str, str], model_dir: Path,
             warm_up: list[BenchRequest] | None, workload: list[BenchRequest], concurrency: int) -> dict:
    """One server from `checkout`, warmed up (None: one short request), under the whole workload; the load's
    summary (http_load.summarize)."""
    summary = run_through_server(model_dir, engine_flags, workload, concurrency, True, False, warm_up=warm_up,
                                 checkout=checkout, env=env)
    if summary["num_failed"]:
        raise SystemExit(f"{summary['num_failed']} requests failed against {checkout}")
    return summary


def parse_env(assignments: list[str]) -> dict[str, str]:
    """NAME=VALUE strings -> {NAME: VALUE}."""
    if bad := [a for a in assignments if "=" not in a]:
        raise SystemExit(f"--env and --baseline-env take NAME=VALUE, got {bad}")
    return dict(a.split("=", 1) for a in assignments)


def describe(name: str, summary: dict) -> str:
    line = (f"{name:<9} {summary['output_tokens_per_s']:8.1f} tok/s  TTFT p50 {summary['ttft_ms']['p50']:7.0f} ms  "
            f"ITL p50 {summary['itl_ms']['p50']:6.1f} ms  p99 {summary['itl_ms']['p99']:7.1f} ms  "
            f"({summary['seconds']:.1f} s)")
    if "cpu_seconds" in summary:
        line += "\n" + " " * 12 + CpuSplit(**summary["cpu_seconds"]).describe(summary["output_tokens"])
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, default=REPO_ROOT,
                        help="the checkout to compare against (default: this one, with other flags)")
    parser.add_argument("--model-dir", type=Path, required=True, help="the checkpoint both servers serve")
    parser.add_argument("--engine-args", default="", help="server flags, e.g. '--dtype bfloat16'")
    parser.add_argument("--baseline-engine-args", default=None,
                        help="the baseline's server flags (default: --engine-args)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable for this side's server, e.g. OMP_WAIT_POLICY=passive")
    parser.add_argument("--baseline-env", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable for the baseline's server")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cold", action="store_true",
                        help="no warm-up load (one short request only): time the first requests after READY")
    args = parser.parse_args()
    workload = synthetic_workload(args.num_requests, tuple(args.prompt_len), tuple(args.output_len),
                                  vocab_size_of(args.model_dir), args.seed)
    # A server's first steps of each size pay one-time costs (the matrix library's kernels for a new row count,
    # the allocator's first pages): a short load of the same kind, with other lengths, takes them before the clock.
    warm_up = None if args.cold else synthetic_workload(WARM_UP_REQUESTS, tuple(args.prompt_len),
                                                        tuple(args.output_len), vocab_size_of(args.model_dir),
                                                        args.seed + 1)
    flags = shlex.split(args.engine_args)
    baseline_flags = flags if args.baseline_engine_args is None else shlex.split(args.baseline_engine_args)
    sides = {"this": (REPO_ROOT, flags, parse_env(args.env)),
             "baseline": (args.baseline.resolve(), baseline_flags, parse_env(args.baseline_env))}
    ratios, ours = [], []
    for round_index in range(args.rounds):
        order = list(sides) if round_index % 2 == 0 else list(reversed(sides))
        summaries = {name: run_side(*sides[name], args.model_dir, warm_up, workload, args.max_concurrency)
                     for name in order}
        ratio = summaries["this"]["output_tokens_per_s"] / summaries["baseline"]["output_tokens_per_s"]
        ratios.append(ratio)
        ours.append(summaries["this"])
        print(f"round {round_index + 1}: ratio {ratio:.3f}")
        for name in order:
            print("  " + describe(name, summaries[name]))
    print(f"output tokens/s, this / baseline: median {statistics.median(ratios):.3f} over {len(ratios)} rounds "
          f"({', '.join(f'{r:.3f}' for r in ratios)})")
    best = max(ours, key=lambda summary: summary["output_tokens_per_s"])
    dtype = flag_value(flags, "--dtype") or "auto"
    quantization = flag_value(flags, "--quantization", "-q")
    os.environ.update(sides["this"][2])  # its ceilings measured as this side ran: under its PAGEDSERVE_CPU_ISA
    print(format_roofline(args.model_dir, dtype, workload, args.max_concurrency, best["seconds"], quantization))


def flag_value(flags: list[str], *names: str) -> str | None:
    """The value of the last of `names` in a server command line (`--flag value` or `--flag=value`), or None."""
    value = None
    for i, flag in enumerate(flags):
        name, equals, attached = flag.partition("=")
        if name in names:
            value = attached if equals else (flags[i + 1] if i + 1 < len(flags) else None)
    return value


if __name__ == "__main__":
    main()
