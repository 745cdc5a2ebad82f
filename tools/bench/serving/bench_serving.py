"""Online serving benchmark: an OpenAI-compatible load generator, and HTTP vs in-process on one workload.

Streams completions from any OpenAI-compatible server (ours, vLLM, ...) and
reports time to first token (TTFT), inter-token latency (ITL, the gaps
between streamed chunks), end-to-end latency (E2E) at p50/p90/p99, requests/s
and output tokens/s, as a table and, with --json, as JSON.

    python -m tools.bench.serving.bench_serving --base-url http://127.0.0.1:8000 --num-requests 200 \\
        --prompt-len 32 512 --output-len 16 256 --request-rate 8 --max-concurrency 64
    python -m tools.bench.serving.bench_serving --workload requests.jsonl --request-rate inf --json result.json
    python -m tools.bench.serving.bench_serving --compare-in-process --model-dir CKPT --num-requests 256

Workload: synthetic prompts of random token ids (the completions API takes a
list of ids as the prompt), lengths drawn uniformly from the ranges, EOS
ignored so every request yields exactly its output length; or a JSONL file,
one {"prompt": text or token ids, "max_tokens": n} per line. Arrivals: a
Poisson process at --request-rate per second, or all at once (inf), never
more than --max-concurrency in flight.

--compare-in-process runs the same workload through gpu_worker's Engine in
this process and then through `python -m server` (started here on a free
port) with 64 concurrent streams, and prints both output tokens/s and their
ratio: the serving path should keep >= 90% of the engine's throughput.
Only the standard library, orjson and httptools on the client side.

With --model-dir (the checkpoint the server serves) and token-id prompts, the
load is followed by the run's roofline (tools/benchlib/roofline.py): this machine's
matmul rate and bandwidth, measured after the load with torch, the
workload's FLOPs and bytes, the lower bound on its time and the share
achieved. The server's steps are not visible from here, so the weights are
counted as read once per step of the fewest steps possible: every request's
decodes, --max-concurrency at a time.

With --profile the load runs between POST /start_profile and /stop_profile
(the server must have been started with --profile-dir): the worker's steps
under torch.profiler, whose operator table is printed under the load's
figures; the table and a chrome trace stay in the server's profile directory.
The profiler's own cost is in the figures of a profiled load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import urllib.error
import urllib.request
from pathlib import Path

from tools.benchlib.http_load import format_table, run_load, summarize, write_json
from tools.benchlib.roofline import format_roofline
from tools.benchlib.target import Target, auth_header, served_model
from tools.benchlib.workload import DEFAULT_VOCAB_SIZE, BenchRequest, load_workload, synthetic_workload, vocab_size_of

PROFILE_TIMEOUT_S = 660.0  # /stop_profile answers once the profile is written; the server waits up to 600 s


# ---------------------------------------------------------------------------------------------- profiling


def post_profile(base_url: str, api_key: str | None, path: str) -> dict:
    """POST /start_profile or /stop_profile; the JSON answer. A refusal is a RuntimeError with the server's words."""
    request = urllib.request.Request(f"{base_url}{path}", data=b"", headers=auth_header(api_key), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=PROFILE_TIMEOUT_S) as response:
            return json.load(response)
    except urllib.error.HTTPError as exc:
        hint = " (start the server with --profile-dir DIR)" if exc.code == 404 else ""
        raise RuntimeError(f"POST {path}: HTTP {exc.code} {exc.read()[:300].decode(errors='replace')}{hint}") from None


def format_profile(result: dict) -> str:
    return (f"profile: {result['steps']} worker steps in {result['seconds']:.2f} s; table {result['table']}, "
            f"chrome trace {result['trace']}\n{result['table_text']}")


# ---------------------------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    parser.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--workload", type=Path, default=None, help="JSONL of {prompt, max_tokens} (default: synthetic)")
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 128), metavar=("MIN", "MAX"))
    parser.add_argument("--vocab-size", type=int, default=None,
                        help=f"random prompt ids are below this (default: --model-dir's, else {DEFAULT_VOCAB_SIZE})")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson; inf: all at once")
    parser.add_argument("--max-concurrency", type=int, default=64, help="most requests in flight")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="generate exactly max_tokens (a vLLM extension of the API)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the summary as JSON ('-': stdout)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--profile", action="store_true",
                        help="profile the worker's steps during the load (POST /start_profile, /stop_profile; the "
                             "server needs --profile-dir) and print its top operators")
    compare = parser.add_argument_group("--compare-in-process (needs torch)")
    compare.add_argument("--compare-in-process", action="store_true",
                         help="measure the workload in-process and through `python -m server`; print the ratio")
    compare.add_argument("--model-dir", type=Path, default=None,
                         help="the checkpoint both sides load; without --compare-in-process, the one the server "
                         "serves, for the roofline")
    compare.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                         help="the server's dtype, for the roofline (auto: the checkpoint's)")
    compare.add_argument("--engine-args", default="", help="extra engine flags for both sides, e.g. "
                         "'--dtype bfloat16 --max-num-seqs 128'")
    return parser


def measure_server(args: argparse.Namespace, workload: list[BenchRequest]) -> dict:
    """The load against --base-url (profiled with --profile); prints its figures and returns its summary."""
    model = args.model or served_model(args.base_url, args.api_key)
    target = Target.from_url(args.base_url, model, args.api_key)
    if args.profile:
        post_profile(args.base_url, args.api_key, "/start_profile")
    try:
        results, seconds = asyncio.run(run_load(target, workload, args.request_rate, args.max_concurrency,
                                                args.ignore_eos, args.seed, not args.no_progress))
    finally:  # an interrupted load must not leave the server profiling
        profile = post_profile(args.base_url, args.api_key, "/stop_profile") if args.profile else None
    summary = summarize(results, seconds)
    print(format_table(summary))
    if args.model_dir:
        print(format_roofline(args.model_dir, args.dtype, workload, args.max_concurrency, seconds))
    if profile is not None:
        print(format_profile(profile))
    return summary


def make_workload(args: argparse.Namespace) -> list[BenchRequest]:
    if args.workload is not None:
        return load_workload(args.workload)
    vocab_size = args.vocab_size or (vocab_size_of(args.model_dir) if args.model_dir else DEFAULT_VOCAB_SIZE)
    return synthetic_workload(args.num_requests, tuple(args.prompt_len), tuple(args.output_len), vocab_size, args.seed)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.profile and args.compare_in_process:
        parser.error("--profile profiles a running server (--base-url), not --compare-in-process")
    workload = make_workload(args)
    if args.compare_in_process:
        from tools.bench.serving.bench_compare import compare_in_process  # torch; only for this mode

        summary = compare_in_process(args, workload)
    else:
        try:
            summary = measure_server(args, workload)
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    if args.json:
        write_json(summary, args.json)
    return 0 if summary.get("num_failed", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
