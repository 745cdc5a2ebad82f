"""Recovery benchmark: how fast the supervisor heals a hung and a crashed worker under a steady streaming load.

    python tools/bench_recovery.py --model CKPT --server-args "--device cpu --dtype float32"
    python tools/bench_recovery.py --base-url http://127.0.0.1:8000 --server-pid PID --json -

Keeps --concurrency streams going (each a completion of --prompt-len random
token ids and --max-tokens tokens, EOS ignored, greedy; a finished stream is
followed at once by the next), then injects each fault of --faults into the
engine worker: `hang` (SIGSTOP: frozen, no heartbeats) and `crash` (SIGKILL).
The worker is found as the server process's child, so the server is either
started here (--model; its --worker-hang-timeout is --hang-timeout) or given
by --base-url and --server-pid. Per fault it reports:

- detection: fault -> the supervisor counts a restart (pagedserve:worker_restarts_total
  rises; /metrics polled every 20 ms). Target: within the hang timeout + 1 s.
- ready: detection -> /health is 200 again (the new worker is READY; the
  server's own figure, pagedserve:worker_last_recovery_seconds, counts from
  just before the kill and is in the JSON as server_recovery_s).
- first token: detection -> the first token any stream receives afterwards
  (kill to first new token; target: the model's load time + 2 s).
- recomputed tokens: what the new worker re-prefills: prompt + tokens already
  received, summed over the requests in flight at detection.
- requeued: the server's pagedserve:requests_requeued_total rise.
- lost: requests of the whole run that did not end with all --max-tokens
  tokens (errors, cut streams); must be 0.

Only the standard library on the client side; no torch.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shlex
import signal
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from local_server import start_server

FAULT_SIGNALS = {"hang": signal.SIGSTOP, "crash": signal.SIGKILL}
POLL_S = 0.02
TIMEOUT_S = 120.0
PROMPT_TOKEN_RANGE = (10, 250)  # ids every real vocabulary has


@dataclass
class Request:
    prompt_len: int
    start: float
    token_times: list[float] = field(default_factory=list)  # one entry per token received
    end: float | None = None
    error: str | None = None


class Load:
    """`concurrency` threads, each streaming one completion after another until stop()."""

    def __init__(self, base_url: str, model: str, concurrency: int, prompt_len: int, max_tokens: int, seed: int):
        self.url = urlsplit(base_url)
        self.model, self.prompt_len, self.max_tokens = model, prompt_len, max_tokens
        self.requests: list[Request] = []
        self._rng = random.Random(seed)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._lane, daemon=True) for _ in range(concurrency)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(TIMEOUT_S)

    def _lane(self) -> None:
        while not self._stop.is_set():
            prompt = [self._rng.randrange(*PROMPT_TOKEN_RANGE) for _ in range(self.prompt_len)]
            request = Request(len(prompt), time.monotonic())
            self.requests.append(request)
            try:
                self._stream(prompt, request)
            except Exception as exc:  # noqa: BLE001 - a lost request, reported
                request.error = repr(exc)
            request.end = time.monotonic()

    def _stream(self, prompt: list[int], request: Request) -> None:
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens, "stream": True,
                           "temperature": 0, "ignore_eos": True, "logprobs": 0})
        conn = http.client.HTTPConnection(self.url.hostname, self.url.port, timeout=TIMEOUT_S)
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
        for line in response:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[len(b"data: "):])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            now = time.monotonic()
            for choice in event["choices"]:
                request.token_times += [now] * len((choice.get("logprobs") or {}).get("tokens") or [])
        conn.close()

    def lost(self) -> list[Request]:
        return [r for r in self.requests if r.end is None or r.error or len(r.token_times) != self.max_tokens]


def get(base_url: str, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(base_url + path, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def scrape(base_url: str) -> dict[str, float]:
    """The /metrics samples by name with labels, e.g. 'pagedserve:worker_restarts_total{cause="hang",...}'."""
    samples = {}
    for line in get(base_url, "/metrics")[1].decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def total(samples: dict[str, float], name: str) -> float:
    """The sum of a metric over its label sets."""
    return sum(v for k, v in samples.items() if k.split("{")[0] == name)


def wait_until(predicate, what: str) -> float:
    deadline = time.monotonic() + TIMEOUT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(POLL_S)
    return time.monotonic()


def worker_pid(server_pid: int) -> int:
    """The server's child: the engine worker (scanning /proc/*/stat for its parent pid)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == server_pid:
            return int(stat.parent.name)
    raise RuntimeError(f"the server (pid {server_pid}) has no worker process")


def inject(base_url: str, server_pid: int, load: Load, fault: str) -> dict:
    """One fault under load; its figures."""
    wait_until(lambda: get(base_url, "/health")[0] == 200, "/health 200 before the fault")
    before = scrape(base_url)
    pid = worker_pid(server_pid)
    fault_time = time.monotonic()
    os.kill(pid, FAULT_SIGNALS[fault])
    restarts = "pagedserve:worker_restarts_total"
    detect_time = wait_until(lambda: total(scrape(base_url), restarts) > total(before, restarts),
                             "the supervisor to notice")
    in_flight = [r for r in load.requests if r.start < detect_time and (r.end is None or r.end > detect_time)]
    recomputed = sum(r.prompt_len + sum(t < detect_time for t in r.token_times) for r in in_flight)
    ready_time = wait_until(lambda: get(base_url, "/health")[0] == 200, "the new worker to be ready")
    wait_until(lambda: any(r.token_times and r.token_times[-1] > detect_time for r in load.requests),
               "the first token after recovery")
    first_token = min(t for r in load.requests for t in r.token_times if t > detect_time)
    after = scrape(base_url)
    return {"fault": fault, "signal": FAULT_SIGNALS[fault].name, "detection_s": detect_time - fault_time,
            "ready_s": ready_time - detect_time,
            "server_recovery_s": total(after, "pagedserve:worker_last_recovery_seconds"),
            "first_token_s": first_token - detect_time,
            "fault_to_first_token_s": first_token - fault_time, "requests_in_flight": len(in_flight),
            "recomputed_tokens": recomputed,
            "requeued": total(after, "pagedserve:requests_requeued_total")
            - total(before, "pagedserve:requests_requeued_total")}


def format_table(results: list[dict], lost: int, total_requests: int) -> str:
    lines = ["| fault | detection | READY after detection | first token after detection | fault to first token "
             "| in flight | recomputed tokens | requeued |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['fault']} ({r['signal']}) | {r['detection_s']:.2f} s | {r['ready_s']:.2f} s "
                     f"| {r['first_token_s']:.2f} s | {r['fault_to_first_token_s']:.2f} s | {r['requests_in_flight']} "
                     f"| {r['recomputed_tokens']} | {r['requeued']:.0f} |")
    lines.append(f"\nrequests: {total_requests}, lost: {lost}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--model", help="a checkpoint: start `python -m server` on it here")
    target.add_argument("--base-url", help="a running server (without /v1); needs --server-pid")
    parser.add_argument("--server-pid", type=int, default=None, help="with --base-url: the server's pid")
    parser.add_argument("--server-args", default="", help="extra flags for the server started with --model")
    parser.add_argument("--hang-timeout", type=float, default=2.0, help="--worker-hang-timeout of the server started")
    parser.add_argument("--served-model", default=None, help="the model name to send (default: /v1/models' first)")
    parser.add_argument("--faults", nargs="+", choices=tuple(FAULT_SIGNALS), default=list(FAULT_SIGNALS))
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of steady load before each fault")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON ('-': stdout)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.base_url and args.server_pid is None:
        build_parser().error("--base-url needs --server-pid (the worker is found as its child)")
    process, base_url, server_pid = None, args.base_url, args.server_pid
    log_path = Path(tempfile.mkdtemp(prefix="bench-recovery-")) / "server.log"
    if args.model:
        process, port = start_server(["--model", args.model, "--worker-hang-timeout", str(args.hang_timeout),
                                      *shlex.split(args.server_args)], log_path)
        base_url = f"http://127.0.0.1:{port}"
        server_pid = process.pid
    try:
        model = args.served_model or json.loads(get(base_url, "/v1/models")[1])["data"][0]["id"]
        load = Load(base_url, model, args.concurrency, args.prompt_len, args.max_tokens, args.seed)
        load.start()
        results = []
        for fault in args.faults:
            time.sleep(args.warmup)
            results.append(inject(base_url, server_pid, load, fault))
        time.sleep(args.warmup)
        load.stop()
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)
            process.wait(TIMEOUT_S)
    lost = load.lost()
    print(format_table(results, len(lost), len(load.requests)))
    summary = {"results": results, "requests": len(load.requests), "lost": len(lost),
               "lost_errors": [r.error for r in lost][:10], "concurrency": args.concurrency,
               "prompt_len": args.prompt_len, "max_tokens": args.max_tokens}
    if args.json == "-":
        print(json.dumps(summary, indent=2))
    elif args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0 if not lost else 1


if __name__ == "__main__":
    sys.exit(main())
