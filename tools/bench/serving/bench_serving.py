"""Online serving benchmark: an OpenAI-compatible load generator, and HTTP vs in-process on one workload.

Streams completions from any OpenAI-compatible server (ours, vLLM, ...) and
reports time to first token (TTFT), inter-token latency (ITL, the gaps
between streamed chunks), end-to-end latency (E2E) at p50/p90/p99, requests/s
and output tokens/s, as a table and, with --json, as JSON.

    python tools/bench_serving.py --base-url http://127.0.0.1:8000 --num-requests 200 \\
        --prompt-len 32 512 --output-len 16 256 --request-rate 8 --max-concurrency 64
    python tools/bench_serving.py --workload requests.jsonl --request-rate inf --json result.json
    python tools/bench_serving.py --compare-in-process --model-dir CKPT --num-requests 256

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
load is followed by the run's roofline (tools/roofline.py): this machine's
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
import random
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httptools
import orjson

PERCENTILES = (50, 90, 99)
PROGRESS_INTERVAL_S = 1.0
MIN_TOKEN_ID = 3  # past the usual <unk>, <s>, </s>
DEFAULT_VOCAB_SIZE = 500  # random ids below this are valid in any real vocabulary (and in the tests' tiny one)
PROFILE_TIMEOUT_S = 660.0  # /stop_profile answers once the profile is written; the server waits up to 600 s


@dataclass(slots=True)
class BenchRequest:
    prompt: str | list[int]
    max_tokens: int


@dataclass(slots=True)
class RequestResult:
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0


# ---------------------------------------------------------------------------------------------- workloads


def synthetic_workload(num_requests: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int,
                       seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [BenchRequest([rng.randrange(MIN_TOKEN_ID, vocab_size) for _ in range(rng.randint(*prompt_len))],
                         rng.randint(*output_len)) for _ in range(num_requests)]


def load_workload(path: Path) -> list[BenchRequest]:
    requests = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            item = json.loads(line)
            if not isinstance(item.get("prompt"), (str, list)) or not isinstance(item.get("max_tokens"), int):
                raise ValueError(f"{path}:{number}: expected {{\"prompt\": str | [ids], \"max_tokens\": int}}, "
                                 f"got {line[:100]}")
            requests.append(BenchRequest(item["prompt"], item["max_tokens"]))
    return requests


def vocab_size_of(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


# ---------------------------------------------------------------------------------------------- one streamed request


class _SseCollector:
    """httptools callbacks: the status, then SSE events timed as they arrive, into a RequestResult."""

    def __init__(self, result: RequestResult, start: float):
        self.result, self.start = result, start
        self.status: int | None = None
        self.is_complete = False
        self._buffer = b""
        self._last_time: float | None = None
        self.parser = httptools.HttpResponseParser(self)

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self._buffer += body
        if self.status != 200:
            return
        *events, self._buffer = self._buffer.replace(b"\r\n", b"\n").split(b"\n\n")
        now = time.perf_counter()
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                    self._on_data(orjson.loads(line[5:]), now)

    def _on_data(self, data: dict, now: float) -> None:
        if "error" in data:
            self.result.error = str(data["error"].get("message"))
        if any(choice.get("text") or (choice.get("delta") or {}).get("content") for choice in data.get("choices") or ()):
            if self._last_time is None:
                self.result.ttft = now - self.start
            else:
                self.result.itls.append(now - self._last_time)
            self._last_time = now
            self.result.output_tokens += 1  # until the usage chunk says how many
        if data.get("usage"):
            self.result.output_tokens = data["usage"]["completion_tokens"]

    def on_message_complete(self) -> None:
        self.is_complete = True
        if self.status != 200:
            self.result.error = f"HTTP {self.status}: {self._buffer[:200].decode(errors='replace')}"


@dataclass(slots=True)
class Target:
    host: str
    port: int
    is_tls: bool
    api_key: str | None
    model: str

    @classmethod
    def from_url(cls, base_url: str, api_key: str | None, model: str) -> Target:
        url = urlsplit(base_url)
        port = url.port or (443 if url.scheme == "https" else 80)
        return cls(url.hostname or "127.0.0.1", port, url.scheme == "https", api_key, model)

    def completion_request(self, request: BenchRequest, ignore_eos: bool) -> bytes:
        body = orjson.dumps({"model": self.model, "prompt": request.prompt, "max_tokens": request.max_tokens,
                             "temperature": 0, "ignore_eos": ignore_eos, "stream": True,
                             "stream_options": {"include_usage": True}})
        auth = f"Authorization: Bearer {self.api_key}\r\n" if self.api_key else ""
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                f"Accept: text/event-stream\r\n{auth}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
        return head.encode() + body


async def run_request(target: Target, request: BenchRequest, ignore_eos: bool) -> RequestResult:
    result = RequestResult()
    start = time.perf_counter()
    try:
        reader, writer = await asyncio.open_connection(target.host, target.port, ssl=target.is_tls or None)
    except OSError as exc:
        result.error = f"cannot connect: {exc}"
        return result
    collector = _SseCollector(result, start)
    try:
        writer.write(target.completion_request(request, ignore_eos))
        while not collector.is_complete and (data := await reader.read(1 << 16)):
            collector.parser.feed_data(data)
    except (OSError, httptools.HttpParserError, orjson.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        writer.close()
    result.e2e = time.perf_counter() - start
    result.ok = result.error is None and collector.is_complete and result.ttft is not None
    if not result.ok and result.error is None:
        result.error = "the stream ended without output"
    return result


# ---------------------------------------------------------------------------------------------- the load


async def run_load(target: Target, workload: list[BenchRequest], request_rate: float, max_concurrency: int,
                   ignore_eos: bool, seed: int, show_progress: bool) -> tuple[list[RequestResult], float]:
    """Send every request (Poisson arrivals at request_rate/s, or all at once); results and wall seconds."""
    rng = random.Random(seed)
    slots = asyncio.Semaphore(max_concurrency)
    results: list[RequestResult] = []

    async def one(request: BenchRequest) -> None:
        async with slots:
            results.append(await run_request(target, request, ignore_eos))

    start = time.perf_counter()
    progress = asyncio.create_task(_report_progress(results, len(workload), start)) if show_progress else None
    tasks = []
    for request in workload:
        tasks.append(asyncio.create_task(one(request)))
        if math.isfinite(request_rate):
            await asyncio.sleep(rng.expovariate(request_rate))
    await asyncio.gather(*tasks)
    seconds = time.perf_counter() - start
    if progress is not None:
        progress.cancel()
        print(file=sys.stderr)
    return results, seconds


async def _report_progress(results: list[RequestResult], total: int, start: float) -> None:
    width = 30
    while True:
        await asyncio.sleep(PROGRESS_INTERVAL_S)
        done = len(results)
        tokens = sum(r.output_tokens for r in results)
        bar = "#" * (width * done // max(total, 1))
        print(f"\r[{bar:<{width}}] {done}/{total} requests, {tokens / (time.perf_counter() - start):8.1f} output tok/s",
              end="", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- the report


def percentile(values: list[float], p: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(results: list[RequestResult], seconds: float) -> dict:
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    latencies = {"ttft": [r.ttft for r in ok], "itl": [gap for r in ok for gap in r.itls], "e2e": [r.e2e for r in ok]}
    summary = {"num_requests": len(results), "num_failed": len(results) - len(ok), "seconds": seconds,
               "requests_per_s": len(ok) / seconds, "output_tokens": output_tokens,
               "output_tokens_per_s": output_tokens / seconds}
    for name, values in latencies.items():
        summary[f"{name}_ms"] = {f"p{p}": _ms(percentile(values, p)) for p in PERCENTILES} | {
            "mean": _ms(sum(values) / len(values) if values else None)}
    errors = [r.error for r in results if not r.ok]
    if errors:
        summary["first_error"] = errors[0]
    return summary


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def format_table(summary: dict) -> str:
    lines = [f"requests: {summary['num_requests']} ({summary['num_failed']} failed) in {summary['seconds']:.2f} s",
             f"throughput: {summary['requests_per_s']:.2f} requests/s, {summary['output_tokens_per_s']:.1f} output "
             f"tokens/s ({summary['output_tokens']} tokens)",
             f"{'latency (ms)':<14}" + "".join(f"{k:>10}" for k in ("mean", *(f"p{p}" for p in PERCENTILES)))]
    for name in ("ttft", "itl", "e2e"):
        row = summary[f"{name}_ms"]
        lines.append(f"{name.upper():<14}" + "".join(
            f"{'-' if row[k] is None else f'{row[k]:.1f}':>10}" for k in ("mean", *(f"p{p}" for p in PERCENTILES))))
    if "first_error" in summary:
        lines.append(f"first error: {summary['first_error']}")
    return "\n".join(lines)


def write_json(summary: dict, destination: str) -> None:
    text = json.dumps(summary, indent=2)
    if destination == "-":
        print(text)
    else:
        Path(destination).write_text(text + "\n")


def served_model(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with urllib.request.urlopen(urllib.request.Request(f"{base_url}/v1/models", headers=headers), timeout=10) as r:
        return json.load(r)["data"][0]["id"]


def post_profile(base_url: str, api_key: str | None, path: str) -> dict:
    """POST /start_profile or /stop_profile; the JSON answer. A refusal is a RuntimeError with the server's words."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    request = urllib.request.Request(f"{base_url}{path}", data=b"", headers=headers, method="POST")
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


def format_roofline(model_dir: Path, dtype: str, workload: list[BenchRequest], max_concurrency: int,
                    seconds: float) -> str:
    """The load's roofline; imports torch, so it runs only after the load."""
    if not all(isinstance(r.prompt, list) for r in workload):
        return "roofline: skipped (text prompts: their token counts are the server's to know)"
    # isort: off
    from machine_limits import matmul_rate, memory_bandwidth  # first: it holds torch to $PAGEDSERVE_CPU_ISA's tier
    # isort: on
    import torch

    from gpu_worker.models.config import read_model_config
    from gpu_worker.models.dtype_policy import compute_dtype
    from shared.cpu_tier import current_tier

    from roofline import Roofline, min_num_steps, workload_cost

    config = read_model_config(model_dir)
    tier = current_tier()
    requested = dtype if dtype == "auto" else getattr(torch, dtype)
    torch_dtype = compute_dtype(requested, config.torch_dtype, torch.device("cpu"), tier).dtype  # as the server
    requests = [(len(r.prompt), r.max_tokens) for r in workload]
    cost = workload_cost(config, torch_dtype.itemsize, requests, min_num_steps(requests, max_concurrency))
    roofline = Roofline(cost, matmul_rate(torch_dtype), memory_bandwidth())
    return roofline.format(f"{str(torch_dtype).removeprefix('torch.')}, CPU tier {tier.name}", seconds)


def measure_server(args: argparse.Namespace, workload: list[BenchRequest]) -> dict:
    """The load against --base-url (profiled with --profile); prints its figures and returns its summary."""
    model = args.model or served_model(args.base_url, args.api_key)
    target = Target.from_url(args.base_url, args.api_key, model)
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
        from bench_compare import compare_in_process  # torch; only for this mode

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
