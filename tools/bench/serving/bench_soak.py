"""Soak: a mixed load against a running server for --duration seconds, its memory sampled, and a verdict on growth.

    python -m server &                                  # the default model, or any --model
    python -m tools.bench.serving.bench_soak --duration 1800 --out soak/

The load: --concurrency clients (32), each sending one request after another:
completions and chat, streamed and not, max_tokens drawn from 1 to 200, and
a share (--disconnect-share, 0.15) of clients that hang up before the answer
ends (mid-stream, or while waiting for a whole body). Every --interval
seconds (10) it scrapes /metrics: the worker's RSS and its split
(pagedserve:worker_memory_bytes: weights, KV cache, malloc's cache,
unexplained) and the frontend's RSS, into OUT/soak.csv and a plot,
OUT/soak.svg (an SVG: matplotlib is no dependency of the project).

The verdict: a least-squares slope of the worker's unexplained memory and of
the frontend's RSS over the samples after --warmup seconds, in MB per 10
minutes, against --tolerance (1 MB per 10 minutes): "flat"; "growing" when
the slope over the last half of those samples exceeds it too; "settling"
when only the earlier part grew (a bounded cache filling up). Exit status 0
when both are flat or settling, 1 when one grows.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tools.benchlib.metrics import scrape as scrape_metrics
from tools.benchlib.target import Target, served_model

MB = 1e6
TEN_MINUTES_S = 600.0
REQUEST_TIMEOUT_S = 300.0
COLUMNS = ("seconds", "worker_rss", "worker_weights", "worker_kv_cache", "worker_allocator_cache",
           "worker_unexplained", "frontend_rss", "requests_done", "requests_failed", "requests_disconnected")
WORDS = ("the king", "my lord", "a rose", "to be", "the night", "fair lady", "the sea", "good morrow", "the crown",
         "sweet love", "the storm", "thy name")


# ---------------------------------------------------------------------------------------------- the verdict


def slope(times: list[float], values: list[float]) -> float:
    """The least-squares slope of values over times (units per second); 0 with fewer than 2 points."""
    n = len(times)
    if n < 2:
        return 0.0
    mean_t, mean_v = sum(times) / n, sum(values) / n
    var_t = sum((t - mean_t) ** 2 for t in times)
    if var_t == 0:
        return 0.0
    return sum((t - mean_t) * (v - mean_v) for t, v in zip(times, values)) / var_t


@dataclass(frozen=True, slots=True)
class Verdict:
    kind: str  # "flat", "settling" (grew, then flat) or "growing"
    mb_per_10_min: float  # over the samples after warm-up
    last_half_mb_per_10_min: float
    num_samples: int

    @property
    def is_growing(self) -> bool:
        return self.kind == "growing"

    def describe(self, name: str) -> str:
        return (f"{name}: {self.kind} ({self.mb_per_10_min:+.2f} MB per 10 min after warm-up, "
                f"{self.last_half_mb_per_10_min:+.2f} over its last half; {self.num_samples} samples)")


def judge(times: list[float], values: list[float], warmup_s: float, tolerance_mb_per_10_min: float) -> Verdict:
    """The verdict on a series (seconds, bytes) after warm_up seconds."""
    kept = [(t, v) for t, v in zip(times, values) if t >= warmup_s]
    late = kept[len(kept) // 2:]
    per_10_min = TEN_MINUTES_S / MB
    whole = slope([t for t, _ in kept], [v for _, v in kept]) * per_10_min
    last_half = slope([t for t, _ in late], [v for _, v in late]) * per_10_min
    if whole <= tolerance_mb_per_10_min:
        kind = "flat"
    elif last_half <= tolerance_mb_per_10_min:
        kind = "settling"
    else:
        kind = "growing"
    return Verdict(kind, whole, last_half, len(kept))


# ---------------------------------------------------------------------------------------------- the load


@dataclass(slots=True)
class Tally:
    done: int = 0
    failed: int = 0
    disconnected: int = 0
    failures: dict[str, int] = field(default_factory=dict)  # first line of a failure -> how many


def random_request(rng: random.Random, model: str) -> tuple[str, dict]:
    """One request of the mix: completion or chat, streamed or not, max_tokens in [1, 200]."""
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))
    body: dict = {"model": model, "max_tokens": rng.randint(1, 200), "temperature": rng.choice([0.0, 0.8]),
                  "stream": rng.random() < 0.5}
    if rng.random() < 0.5:
        return "/v1/completions", {**body, "prompt": text}
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": text}]}


async def send(target: Target, path: str, body: dict, hang_up_after_s: float | None) -> str:
    """"done", "disconnected" (we hung up first, on purpose) or the first line of what went wrong."""
    reader, writer = await asyncio.open_connection(target.host, target.port, ssl=target.is_tls or None)
    try:
        writer.write(target.post(path, json.dumps(body).encode()))
        try:  # Connection: close, so the response ends where the stream does
            response = await asyncio.wait_for(reader.read(), hang_up_after_s or REQUEST_TIMEOUT_S)
        except asyncio.TimeoutError:
            return "disconnected" if hang_up_after_s is not None else f"no answer within {REQUEST_TIMEOUT_S:g} s"
    finally:
        writer.close()
    status_line = response.split(b"\r\n", 1)[0].decode(errors="replace")
    if " 200 " not in status_line:
        return status_line or "an empty response"
    if body.get("stream") and b"data: [DONE]" not in response:
        return "a stream without [DONE]"
    return "done"


async def client_loop(target: Target, rng: random.Random, deadline: float, disconnect_share: float,
                      tally: Tally) -> None:
    while time.monotonic() < deadline:
        path, body = random_request(rng, target.model)
        hang_up = rng.uniform(0.05, 1.0) if rng.random() < disconnect_share else None
        try:
            outcome = await send(target, path, body, hang_up)
        except OSError as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        if outcome == "done":
            tally.done += 1
        elif outcome == "disconnected":
            tally.disconnected += 1
        else:
            tally.failed += 1
            tally.failures[outcome] = tally.failures.get(outcome, 0) + 1


# ---------------------------------------------------------------------------------------------- sampling


def scrape(base_url: str) -> dict[str, float]:
    """/metrics samples by name with labels, the model_name label left out."""
    return {_drop_model_label(name): value for name, value in scrape_metrics(base_url).items()}


def _drop_model_label(name: str) -> str:
    """'m{kind="rss",model_name="x"}' -> 'm{kind="rss"}'."""
    if "model_name=" not in name:
        return name
    head, labels = name.split("{", 1)
    kept = [label for label in labels.rstrip("}").split(",") if not label.startswith("model_name=")]
    return f"{head}{{{','.join(kept)}}}" if kept else head


def memory_row(samples: dict[str, float], seconds: float, tally: Tally) -> dict[str, float]:
    worker = {kind: samples.get(f'pagedserve:worker_memory_bytes{{kind="{kind}"}}', float("nan"))
              for kind in ("rss", "weights", "kv_cache", "allocator_cache", "unexplained")}
    return {"seconds": round(seconds, 1), **{f"worker_{kind}": value for kind, value in worker.items()},
            "frontend_rss": samples.get("pagedserve:frontend_memory_bytes", float("nan")),
            "requests_done": tally.done, "requests_failed": tally.failed, "requests_disconnected": tally.disconnected}


async def sample_memory(base_url: str, interval: float, deadline: float, tally: Tally, started: float,
                        rows: list[dict[str, float]]) -> None:
    """A row every `interval` seconds until the deadline."""
    while time.monotonic() < deadline:
        samples = await asyncio.to_thread(scrape, base_url)
        rows.append(memory_row(samples, time.monotonic() - started, tally))
        print(" ".join(f"{key}={value:.0f}" for key, value in rows[-1].items()), flush=True)
        await asyncio.sleep(max(0.0, min(interval, deadline - time.monotonic())))


# ---------------------------------------------------------------------------------------------- output


def write_csv(path: Path, rows: list[dict[str, float]]) -> None:
    with open(path, "w", newline="") as out:
        writer = csv.DictWriter(out, COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


SERIES = (("worker_rss", "#1f77b4"), ("worker_unexplained", "#d62728"), ("worker_kv_cache", "#2ca02c"),
          ("frontend_rss", "#9467bd"))


def svg_plot(rows: list[dict[str, float]], warmup_s: float, width: int = 900, height: int = 420) -> str:
    """The memory series (MB) over time, one polyline each, the warm-up shaded."""
    left, right, top, bottom = 70, 200, 20, 40
    times = [row["seconds"] for row in rows] or [0.0]
    values = [row[name] / MB for row in rows for name, _ in SERIES if row[name] == row[name]] or [0.0]
    t_max, v_max = max(max(times), 1.0), max(max(values) * 1.1, 1.0)

    def x(t: float) -> float:
        return left + (width - left - right) * t / t_max

    def y(v: float) -> float:
        return height - bottom - (height - top - bottom) * v / v_max

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
             f'font-size="12"><rect width="100%" height="100%" fill="white"/>',
             f'<rect x="{x(0):.1f}" y="{top}" width="{x(min(warmup_s, t_max)) - x(0):.1f}" '
             f'height="{height - top - bottom}" fill="#eeeeee"/>',
             f'<line x1="{left}" y1="{y(0):.1f}" x2="{width - right}" y2="{y(0):.1f}" stroke="black"/>',
             f'<line x1="{left}" y1="{top}" x2="{left}" y2="{y(0):.1f}" stroke="black"/>']
    for i in range(6):
        v, t = v_max * i / 5, t_max * i / 5
        parts.append(f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.0f}</text>')
        parts.append(f'<text x="{x(t):.1f}" y="{height - bottom + 16}" text-anchor="middle">{t:.0f}</text>')
    parts.append(f'<text x="{(left + width - right) / 2}" y="{height - 6}" text-anchor="middle">seconds '
                 f'(warm-up shaded)</text><text x="14" y="{top + 10}">MB</text>')
    for i, (name, colour) in enumerate(SERIES):
        points = " ".join(f"{x(row['seconds']):.1f},{y(row[name] / MB):.1f}" for row in rows if row[name] == row[name])
        parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{points}"/>')
        parts.append(f'<text x="{width - right + 10}" y="{top + 16 * (i + 1)}" fill="{colour}">{name}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------- main


async def soak(args: argparse.Namespace, target: Target) -> tuple[list[dict[str, float]], Tally]:
    tally, rows = Tally(), []
    started = time.monotonic()
    deadline = started + args.duration
    rng = random.Random(args.seed)
    clients = [asyncio.create_task(client_loop(target, random.Random(rng.random()), deadline, args.disconnect_share,
                                               tally)) for _ in range(args.concurrency)]
    await sample_memory(args.base_url, args.interval, deadline, tally, started, rows)
    await asyncio.gather(*clients)
    rows.append(memory_row(await asyncio.to_thread(scrape, args.base_url), time.monotonic() - started, tally))
    return rows, tally


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds of load (default 1800)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between memory samples")
    parser.add_argument("--warmup", type=float, default=None,
                        help="seconds left out of the verdict (default: a fifth of --duration, at most 300)")
    parser.add_argument("--tolerance", type=float, default=1.0, help="MB per 10 minutes still called flat")
    parser.add_argument("--disconnect-share", type=float, default=0.15, help="share of requests hung up early")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("soak"), help="directory for soak.csv and soak.svg")
    args = parser.parse_args(argv)
    warmup = args.warmup if args.warmup is not None else min(300.0, args.duration / 5)
    target = Target.from_url(args.base_url, served_model(args.base_url, args.api_key), args.api_key)
    rows, tally = asyncio.run(soak(args, target))
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "soak.csv", rows)
    (args.out / "soak.svg").write_text(svg_plot(rows, warmup))
    times = [row["seconds"] for row in rows]
    verdicts = {name: judge(times, [row[column] for row in rows], warmup, args.tolerance)
                for name, column in (("worker unexplained", "worker_unexplained"), ("frontend RSS", "frontend_rss"))}
    print(f"{tally.done} requests done, {tally.disconnected} hung up on purpose, {tally.failed} failed"
          + (f" ({tally.failures})" if tally.failures else ""))
    for name, verdict in verdicts.items():
        print(verdict.describe(name))
    print(f"wrote {args.out / 'soak.csv'} and {args.out / 'soak.svg'}")
    return 1 if any(v.is_growing for v in verdicts.values()) or tally.failed else 0


if __name__ == "__main__":
    sys.exit(main())
