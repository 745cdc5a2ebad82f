"""The latency-aware scheduler against the fixed token budget: throughput and inter-token latency, side by side.

A fixed token budget per step (--max-num-batched-tokens) lets a step that
takes in long prefills run for hundreds of milliseconds, and every decoding
stream waits that long for its next token: the ITL tail. The latency-aware
scheduler (--target-itl-ms, automatic by default, 0 for the old fixed budget)
sizes each step to a target time instead. This measures what it buys and
what it costs, on the same workload, in one command:

    python -m tools.bench.serving.bench_itl_target --rounds 3 --json itl.json --plot itl.png
    python -m tools.bench.serving.bench_itl_target --dtypes bfloat16 --loads 16 --policy latency-aware= \\
        --policy t50="--target-itl-ms 50" --policy fixed-budget="--target-itl-ms 0"

Checkpoints: the SmolLM-135M shape with random weights, in each dtype,
built by bench_checkpoint (tools/bench/engine/) into --checkpoint-dir as smollm-float32
and smollm-bfloat16 when missing (the names BENCHMARKS.md uses). Workload:
the mixed one (64 requests, prompts of 32-512 token ids, outputs of 16-256
tokens, greedy, EOS ignored), the same on every side. Cases: each dtype
under each load, a cap of 16 requests in flight and of 64 (all at once).
Policies: --policy NAME=FLAGS, server flags of each side (default:
latency-aware, no flag, and fixed-budget, --target-itl-ms 0); the last is
the reference. Each (case, policy, round) starts its own `python -m server`,
warms it up with 16 requests of the same kind (another seed), sends the
workload and stops it; the policies' order alternates from round to round
(ABBA...), so a trend in the machine's load falls on all of them alike.

Prints a table per case: output tokens/s, TTFT p50/p99, ITL p50/p90/p99 and
p99/p50 of every run, then for each policy but the reference the acceptance
bars, each as the median over the rounds: tokens/s as a ratio of the
reference's in the same round (>= 0.95) and ITL p99 <= 3x ITL p50; at the
end, each dtype's best run against the machine's roofline (tools/benchlib/roofline.py).
--json writes all of it with every ITL gap; --plot draws the ITL gaps of each
policy as empirical CDFs, one panel per case (needs the `bench` extra,
matplotlib). Gaps are timed as chunks arrive: two chunks read at once give a
gap of 0, drawn at the left edge of the log axis.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tools import REPO_ROOT
from tools.benchlib.http_load import RequestResult, load_through_server, summarize, write_json
from tools.benchlib.local_server import Policy, parse_policy
from tools.benchlib.roofline import format_roofline
from tools.benchlib.stats import percentile
from tools.benchlib.workload import BenchRequest, synthetic_workload, vocab_size_of

SHAPE = "smollm-135m"
DTYPES = ("float32", "bfloat16")
DEFAULT_POLICIES = ("latency-aware=", "fixed-budget=--target-itl-ms 0")
WARM_UP_REQUESTS = 16
MIN_THROUGHPUT_RATIO = 0.95
MAX_ITL_TAIL_RATIO = 3.0  # ITL p99 / p50
PLOT_FLOOR_MS = 0.01  # a log axis cannot show the gaps of 0 between chunks read at once


@dataclass(slots=True)
class Case:
    dtype: str
    max_concurrency: int
    model_dir: Path
    num_requests: int

    @property
    def label(self) -> str:
        load = "at once" if self.max_concurrency >= self.num_requests else "in flight"
        return f"{self.dtype}, {self.max_concurrency} {load}"


@dataclass(slots=True)
class Run:
    policy: str
    round_index: int
    summary: dict
    itls_ms: list[float]


def checkpoint(directory: Path, dtype: str) -> Path:
    """directory/smollm-DTYPE, written by bench_checkpoint unless it is there (its tokenizer comes last); in a
    process of its own, so that torch is first imported here by the roofline, held to $PAGEDSERVE_CPU_ISA's tier."""
    model_dir = directory / f"smollm-{dtype}"
    if not (model_dir / "tokenizer.json").exists():
        subprocess.run([sys.executable, "-m", "tools.bench.engine.bench_checkpoint", "--shape", SHAPE, "--dtype", dtype,
                        str(model_dir.resolve())], cwd=REPO_ROOT, check=True)
    return model_dir


def run_policy(case: Case, policy: Policy, round_index: int, workload: list[BenchRequest],
               warm_up: list[BenchRequest]) -> Run:
    """One server with the policy's flags, warmed up, under the whole workload."""
    results, seconds, _ = load_through_server(case.model_dir, ["--dtype", case.dtype, *policy.flags], workload,
                                              case.max_concurrency, True, False, warm_up=warm_up)
    summary = summarize(results, seconds)
    if summary["num_failed"]:
        raise SystemExit(f"{case.label}, {policy.name}: {summary['num_failed']} requests failed "
                         f"({summary['first_error']})")
    print(f"  {case.label}, round {round_index + 1}, {policy.name}: {summary['output_tokens_per_s']:.1f} tok/s "
          f"in {seconds:.1f} s", flush=True)
    return Run(policy.name, round_index, summary, itl_gaps_ms(results))


def itl_gaps_ms(results: list[RequestResult]) -> list[float]:
    return [round(gap * 1000, 3) for result in results if result.ok for gap in result.itls]


def run_case(case: Case, policies: list[Policy], num_rounds: int, workload: list[BenchRequest],
             warm_up: list[BenchRequest]) -> list[Run]:
    runs = []
    for round_index in range(num_rounds):
        order = policies if round_index % 2 == 0 else policies[::-1]
        runs += [run_policy(case, policy, round_index, workload, warm_up) for policy in order]
    return runs


def tail_ratio(summary: dict) -> float:
    return summary["itl_ms"]["p99"] / summary["itl_ms"]["p50"]


def acceptance_bars(runs: list[Run], policies: list[Policy]) -> dict:
    """For each policy but the reference (the last): per-round tok/s ratios and ITL p99/p50, medians, verdicts."""
    by_round: dict[int, dict[str, dict]] = {}
    for run in runs:
        by_round.setdefault(run.round_index, {})[run.policy] = run.summary
    reference = policies[-1].name
    bars = {}
    for policy in policies[:-1]:
        ratios = [r[policy.name]["output_tokens_per_s"] / r[reference]["output_tokens_per_s"] for r in by_round.values()]
        tails = [tail_ratio(r[policy.name]) for r in by_round.values()]
        bars[policy.name] = {
            "reference": reference, "throughput_ratios": ratios, "throughput_ratio": statistics.median(ratios),
            "meets_throughput": statistics.median(ratios) >= MIN_THROUGHPUT_RATIO,
            "itl_tail_ratios": tails, "itl_tail_ratio": statistics.median(tails),
            "meets_itl_tail": statistics.median(tails) <= MAX_ITL_TAIL_RATIO}
    return bars


def format_case(case: Case, runs: list[Run], bars: dict) -> str:
    header = (f"{'policy':<16}{'round':>6}{'tok/s':>9}{'TTFT p50':>10}{'p99':>8}{'ITL p50':>9}{'p90':>8}{'p99':>8}"
              f"{'p99/p50':>9}   (ms)")
    lines = [f"== {case.label}", header]
    for run in runs:
        ttft, itl = run.summary["ttft_ms"], run.summary["itl_ms"]
        lines.append(f"{run.policy:<16}{run.round_index + 1:>6}{run.summary['output_tokens_per_s']:>9.1f}"
                     f"{ttft['p50']:>10.0f}{ttft['p99']:>8.0f}{itl['p50']:>9.1f}{itl['p90']:>8.1f}{itl['p99']:>8.1f}"
                     f"{tail_ratio(run.summary):>9.2f}")
    for name, bar in bars.items():
        lines.append(f"{name}: tok/s / {bar['reference']}'s {bar['throughput_ratio']:.3f} "
                     f"({', '.join(f'{r:.3f}' for r in bar['throughput_ratios'])}): "
                     f"{'meets' if bar['meets_throughput'] else 'MISSES'} >= {MIN_THROUGHPUT_RATIO}; "
                     f"ITL p99/p50 {bar['itl_tail_ratio']:.2f}: "
                     f"{'meets' if bar['meets_itl_tail'] else 'MISSES'} <= {MAX_ITL_TAIL_RATIO:g}")
    return "\n".join(lines)


def format_best_roofline(cases: list[Case], runs_by_case: list[list[Run]], workload: list[BenchRequest],
                         dtype: str) -> str:
    """The dtype's fastest run against the machine's roofline (measures the machine: run it after the loads)."""
    case, run = max(((case, run) for case, runs in zip(cases, runs_by_case) if case.dtype == dtype for run in runs),
                    key=lambda pair: pair[1].summary["output_tokens_per_s"])
    return (f"{dtype}, best run ({case.label}, {run.policy}, round {run.round_index + 1}):\n"
            + format_roofline(case.model_dir, dtype, workload, case.max_concurrency, run.summary["seconds"]))


def plot_itl_cdfs(cases: list[Case], runs_by_case: list[list[Run]], policies: list[Policy], destination: Path) -> None:
    """Each case's ITL gaps (all rounds together) as one empirical CDF per policy, p50 and p99 marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    dtypes = list(dict.fromkeys(case.dtype for case in cases))
    loads = list(dict.fromkeys(case.max_concurrency for case in cases))
    figure, axes = plt.subplots(len(dtypes), len(loads), figsize=(6 * len(loads), 4.5 * len(dtypes)), squeeze=False)
    for case, runs in zip(cases, runs_by_case):
        ax = axes[dtypes.index(case.dtype)][loads.index(case.max_concurrency)]
        for policy, color in zip(policies, plt.rcParams["axes.prop_cycle"].by_key()["color"]):
            gaps = sorted(max(gap, PLOT_FLOOR_MS) for run in runs if run.policy == policy.name for gap in run.itls_ms)
            p50, p99 = percentile(gaps, 50), percentile(gaps, 99)
            ax.step(gaps, [(i + 1) / len(gaps) for i in range(len(gaps))], where="post", color=color,
                    label=f"{policy.name}: p50 {p50:.1f} ms, p99 {p99:.1f} ms")
            ax.axvline(p50, color=color, linestyle="--", linewidth=0.8)
            ax.axvline(p99, color=color, linestyle=":", linewidth=0.8)
        ax.set(xscale="log", title=case.label, xlabel="inter-token latency (ms); -- p50, : p99",
               ylabel="share of gaps at most x")
        ax.xaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower right", fontsize="small")
    figure.suptitle("inter-token latency, all rounds together")
    figure.tight_layout()
    figure.savefig(destination, dpi=120)
    plt.close(figure)


def report(args: argparse.Namespace, policies: list[Policy], cases: list[Case], runs_by_case: list[list[Run]],
           bars_by_case: list[dict], rooflines: dict[str, str]) -> dict:
    """Everything, for --json: the arguments, the policies' flags, each case's bars and runs with every ITL gap."""
    arguments = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "policies"}
    return {"arguments": arguments, "policies": {p.name: p.flags for p in policies}, "rooflines": rooflines,
            "cases": [{"dtype": case.dtype, "max_concurrency": case.max_concurrency, "label": case.label, "bars": bars,
                       "runs": [{"policy": r.policy, "round": r.round_index + 1, "summary": r.summary,
                                 "itl_ms": r.itls_ms} for r in runs]}
                      for case, runs, bars in zip(cases, runs_by_case, bars_by_case)]}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("/tmp/ckpt"),
                        help="holds (or gets) smollm-float32 and smollm-bfloat16")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    parser.add_argument("--loads", nargs="+", type=int, default=[16, 64], metavar="MAX_CONCURRENCY",
                        help="most requests in flight, one case each")
    parser.add_argument("--policy", dest="policies", action="append", type=parse_policy, metavar="NAME=FLAGS",
                        help="a policy's server flags, repeatable; the last is the reference (default: "
                        f"{' and '.join(repr(p) for p in DEFAULT_POLICIES)})")
    parser.add_argument("--rounds", type=int, default=2, help="ABBA...: each policy goes first as often")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, metavar="FILE", help="write every figure and ITL gap ('-': stdout)")
    parser.add_argument("--plot", type=Path, default=None, metavar="FILE.png", help="draw the ITL CDFs")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    policies = args.policies or [parse_policy(p) for p in DEFAULT_POLICIES]
    if len(policies) < 2 or len({p.name for p in policies}) < len(policies):
        parser.error("--policy: at least two, with distinct names")
    cases = [Case(dtype, load, checkpoint(args.checkpoint_dir, dtype), args.num_requests)
             for dtype in args.dtypes for load in args.loads]
    vocab_size = vocab_size_of(cases[0].model_dir)
    workload = synthetic_workload(args.num_requests, tuple(args.prompt_len), tuple(args.output_len), vocab_size,
                                  args.seed)
    # A server's first steps of each size pay one-time costs; a short load of the same kind takes them off the clock.
    warm_up = synthetic_workload(WARM_UP_REQUESTS, tuple(args.prompt_len), tuple(args.output_len), vocab_size,
                                 args.seed + 1)
    runs_by_case, bars_by_case = [], []
    for case in cases:
        runs_by_case.append(run_case(case, policies, args.rounds, workload, warm_up))
        bars_by_case.append(acceptance_bars(runs_by_case[-1], policies))
        print(format_case(case, runs_by_case[-1], bars_by_case[-1]), flush=True)
    rooflines = {dtype: format_best_roofline(cases, runs_by_case, workload, dtype) for dtype in args.dtypes}
    print("\n".join(rooflines.values()))
    if args.plot:
        plot_itl_cdfs(cases, runs_by_case, policies, args.plot)
    if args.json:
        write_json(report(args, policies, cases, runs_by_case, bars_by_case, rooflines), args.json)


if __name__ == "__main__":
    main()
