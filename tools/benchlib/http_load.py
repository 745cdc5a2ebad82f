"""The OpenAI-compatible load generator: streamed completions timed as their chunks arrive, and the report.

Each request is one streamed POST /v1/completions on a connection of its own
(greedy, usage included), read with httptools: time to first token (TTFT),
the gaps between streamed chunks (ITL) and end-to-end latency (E2E).
run_load sends a workload with Poisson arrivals (or all at once), never more
than max_concurrency in flight; summarize and format_table give p50/p90/p99,
requests/s and output tokens/s. run_through_server: a workload through a
`python -m server` started here, warmed up first. Only the standard library,
orjson and httptools: no torch.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httptools
import orjson

from tools import REPO_ROOT
from tools.benchlib.local_server import start_server
from tools.benchlib.process_cpu import CpuMeter, CpuSplit
from tools.benchlib.stats import percentile
from tools.benchlib.target import Target
from tools.benchlib.workload import BenchRequest

PERCENTILES = (50, 90, 99)
PROGRESS_INTERVAL_S = 1.0
STOP_TIMEOUT_S = 30.0
WARM_UP = BenchRequest([5, 6, 7, 8], 8)


@dataclass(slots=True)
class RequestResult:
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0


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


def completion_request(target: Target, request: BenchRequest, ignore_eos: bool) -> bytes:
    body = orjson.dumps({"model": target.model, "prompt": request.prompt, "max_tokens": request.max_tokens,
                         "temperature": 0, "ignore_eos": ignore_eos, "stream": True,
                         "stream_options": {"include_usage": True}})
    return target.post("/v1/completions", body, ["Accept: text/event-stream"])


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
        writer.write(completion_request(target, request, ignore_eos))
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


# ---------------------------------------------------------------------------------------------- a server started here


def run_through_server(model_dir: Path, engine_flags: list[str], workload: list[BenchRequest], concurrency: int,
                       ignore_eos: bool, show_progress: bool, *, warm_up: list[BenchRequest] | None = None,
                       checkout: Path = REPO_ROOT, env: dict[str, str] | None = None) -> dict:
    """`python -m server` from `checkout` (with `env`), warmed up (by default with one short request), under the
    whole workload; its summary."""
    results, seconds, cpu = load_through_server(model_dir, engine_flags, workload, concurrency, ignore_eos,
                                                show_progress, warm_up=warm_up, checkout=checkout, env=env)
    summary = summarize(results, seconds)
    if cpu is not None:
        summary["cpu_seconds"] = cpu.as_dict()
    return summary


def load_through_server(model_dir: Path, engine_flags: list[str], workload: list[BenchRequest], concurrency: int,
                        ignore_eos: bool, show_progress: bool, *, warm_up: list[BenchRequest] | None = None,
                        checkout: Path = REPO_ROOT,
                        env: dict[str, str] | None = None) -> tuple[list[RequestResult], float, CpuSplit | None]:
    """As run_through_server, but the per-request results (every ITL gap), the wall seconds and the CPU seconds of
    the server's processes and of this one (the load generator) over the workload, not their summary."""
    with tempfile.TemporaryDirectory() as tmp:
        process, port = start_server(["--model", str(model_dir), *engine_flags], Path(tmp) / "server.log",
                                     checkout=checkout, env=env)
        try:
            target = Target("127.0.0.1", port, str(model_dir))
            asyncio.run(run_load(target, warm_up or [WARM_UP], float("inf"), concurrency, ignore_eos, 0, False))
            meter = CpuMeter(process.pid)
            meter.start()
            results, seconds = asyncio.run(run_load(target, workload, float("inf"), concurrency, ignore_eos, 0,
                                                    show_progress))
            cpu = meter.stop()
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(STOP_TIMEOUT_S)
    return results, seconds, cpu


# ---------------------------------------------------------------------------------------------- the report


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
    if "cpu_seconds" in summary:
        lines.append(CpuSplit(**summary["cpu_seconds"]).describe(summary["output_tokens"]))
    if "first_error" in summary:
        lines.append(f"first error: {summary['first_error']}")
    return "\n".join(lines)


def write_json(summary: dict, destination: str) -> None:
    """The summary as JSON into a file, or on stdout for '-'."""
    text = json.dumps(summary, indent=2)
    if destination == "-":
        print(text)
    else:
        Path(destination).write_text(text + "\n")
