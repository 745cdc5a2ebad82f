"""Recovery benchmark: how fast the supervisor heals a hung and a crashed worker under a steady streaming load,
and (--hostile) whether honest streams are served while a hostile client sends bad requests.

    python tools/bench_recovery.py --model CKPT --server-args "--device cpu --dtype float32"
    python tools/bench_recovery.py --base-url http://127.0.0.1:8000 --server-pid PID --json -
    python tools/bench_recovery.py --hostile --model CKPT --api-key KEY --server-args "--device cpu --dtype float32"

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

--hostile: no faults. The streams (16 by default, 128 tokens each) run while
one hostile client sends one bad request per second for --duration s, each
from its own thread, cycling through hostile_requests(): a top_p of 1e-46
(completions, chat, responses), a temperature of 1e-40, a logit_bias key of
10**20, 1000 prompts times n 20, an 8 MB prompt to /tokenize and to
/v1/completions, an 8 MiB upload without the API key announced with Expect:
100-continue (with --api-key), a 100 KB model name, Transfer-Encoding:
gzip, chunked, an HTTP/1.1 request without Host, a client that leaves
mid-stream, and a chat message of role 'wizard'. It reports, as markdown:
honest clients whose every stream had exactly --max-tokens tokens, worker
restarts (from /metrics), the frontend's RSS (VmRSS of the server process,
sampled) idle, max and final, /health latency sampled every 100 ms
during the attack against an idle baseline of --idle-baseline s taken first,
and each hostile request's answers (status codes, or what happened instead).
The server started here keeps its default --worker-hang-timeout unless
--hang-timeout is given. The exit status is 1 if an honest stream came
short or the worker restarted.

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
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from hostile_client import HOSTILE_INTERVAL_S, Sampler, Target, attack, auth_header, hostile_requests, rss_mib
from local_server import start_server

FAULT_SIGNALS = {"hang": signal.SIGSTOP, "crash": signal.SIGKILL}
POLL_S = 0.02
TIMEOUT_S = 120.0
PROMPT_TOKEN_RANGE = (10, 250)  # ids every real vocabulary has
ERROR_PAUSE_S = 0.5


@dataclass
class Request:
    lane: int  # which of the load's concurrent clients sent it
    prompt_len: int
    start: float
    token_times: list[float] = field(default_factory=list)  # one entry per token received
    end: float | None = None
    error: str | None = None


class Load:
    """`concurrency` threads, each streaming one completion after another until stop()."""

    def __init__(self, base_url: str, model: str, concurrency: int, prompt_len: int, max_tokens: int, seed: int,
                 api_key: str | None = None):
        self.url = urlsplit(base_url)
        self.model, self.prompt_len, self.max_tokens = model, prompt_len, max_tokens
        self.headers = {"Content-Type": "application/json", **auth_header(api_key)}
        self.requests: list[Request] = []
        self._rng = random.Random(seed)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._lane, args=(lane,), daemon=True) for lane in range(concurrency)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(TIMEOUT_S)

    def _lane(self, lane: int) -> None:
        while not self._stop.is_set():
            prompt = [self._rng.randrange(*PROMPT_TOKEN_RANGE) for _ in range(self.prompt_len)]
            request = Request(lane, len(prompt), time.monotonic())
            self.requests.append(request)
            try:
                self._stream(prompt, request)
            except Exception as exc:  # noqa: BLE001 - a lost request, reported
                request.error = repr(exc)
                self._stop.wait(ERROR_PAUSE_S)  # a server that is gone refuses at once: no busy loop
            request.end = time.monotonic()

    def _stream(self, prompt: list[int], request: Request) -> None:
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens, "stream": True,
                           "temperature": 0, "ignore_eos": True, "logprobs": 0})
        conn = http.client.HTTPConnection(self.url.hostname, self.url.port, timeout=TIMEOUT_S)
        conn.request("POST", "/v1/completions", body, self.headers)
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


def get(base_url: str, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(base_url + path, headers=headers or {}), timeout=10) as response:
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


def run_faults(args: argparse.Namespace, base_url: str, server_pid: int, model: str) -> tuple[str, dict, bool]:
    """Each fault of --faults under load: (markdown, JSON summary, whether no request was lost)."""
    load = Load(base_url, model, args.concurrency, args.prompt_len, args.max_tokens, args.seed, args.api_key)
    load.start()
    results = []
    for fault in args.faults:
        time.sleep(args.warmup)
        results.append(inject(base_url, server_pid, load, fault))
    time.sleep(args.warmup)
    load.stop()
    lost = load.lost()
    summary = {"results": results, "requests": len(load.requests), "lost": len(lost),
               "lost_errors": [r.error for r in lost][:10], "concurrency": args.concurrency,
               "prompt_len": args.prompt_len, "max_tokens": args.max_tokens}
    return format_table(results, len(lost), len(load.requests)), summary, not lost


# ---------------------------------------------------------------------------------------------- --hostile

HOSTILE_CONCURRENCY, HOSTILE_MAX_TOKENS = 16, 128
FAULT_CONCURRENCY, FAULT_MAX_TOKENS, FAULT_HANG_TIMEOUT_S = 8, 32, 2.0
def worker_restarts(base_url: str) -> float | None:
    """pagedserve:worker_restarts_total; None if the server does not answer (it has exited)."""
    try:
        return total(scrape(base_url), "pagedserve:worker_restarts_total")
    except OSError:
        return None


def run_hostile(args: argparse.Namespace, base_url: str, server_pid: int, model: str) -> tuple[str, dict, bool]:
    """Honest streams under a hostile client: (markdown, JSON summary, whether every stream was whole and the
    worker never restarted)."""
    url = urlsplit(base_url)
    requests = hostile_requests(Target(url.hostname, url.port, model, args.api_key))
    with Sampler(base_url, server_pid) as idle:
        time.sleep(args.idle_baseline)
    restarts_before = worker_restarts(base_url)
    load = Load(base_url, model, args.concurrency, args.prompt_len, args.max_tokens, args.seed, args.api_key)
    load.start()
    time.sleep(args.warmup)
    with Sampler(base_url, server_pid) as attacked:
        results = attack(requests, args.duration)
        load.stop()
    restarts_after = worker_restarts(base_url)
    restarts = restarts_after - restarts_before if restarts_after is not None else None
    exited = rss_mib(server_pid) is None
    lost = load.lost()
    text = "\n".join([*honest_lines(args, load, restarts, idle, attacked, exited), "",
                      *hostile_table([name for name, _ in requests], results)])
    summary = {"concurrency": args.concurrency, "streams": len(load.requests), "streams_lost": len(lost),
               "honest_clients_whole": args.concurrency - len({r.lane for r in lost}),
               "lost_errors": [r.error for r in lost][:10], "worker_restarts": restarts, "server_exited": exited,
               "rss_mib": {"idle": idle.rss_mib[0], "max": max(attacked.rss_mib), "final": attacked.rss_mib[-1]},
               "health_s": {"idle": idle.health, "attacked": attacked.health},
               "hostile": [{"request": n, "outcome": o, "seconds": s} for n, o, s in results]}
    return text, summary, not lost and restarts == 0


def honest_lines(args: argparse.Namespace, load: Load, restarts: float | None, idle: Sampler, attacked: Sampler,
                 exited: bool) -> list[str]:
    lost = load.lost()
    return [f"{args.concurrency} honest streams at a time ({args.prompt_len}-token prompts, {args.max_tokens} tokens, "
            f"greedy, EOS ignored) while one hostile client sent a bad request every {HOSTILE_INTERVAL_S:g} s "
            f"for {args.duration:g} s", "",
            f"- honest clients whose every stream had exactly {args.max_tokens} tokens: "
            f"{args.concurrency - len({r.lane for r in lost})}/{args.concurrency} "
            f"({len(load.requests) - len(lost)}/{len(load.requests)} streams whole)",
            f"- worker restarts: {restarts:.0f}" if restarts is not None else
            "- worker restarts: unknown, the server no longer answers /metrics",
            f"- frontend RSS: {idle.rss_mib[0]:.0f} MiB idle, max {max(attacked.rss_mib):.0f} MiB, final "
            f"{attacked.rss_mib[-1]:.0f} MiB" + (" (then the server process exited)" if exited else ""), "",
            "| /health | samples | p50 | p99 | max | not 200 |", "|---|---|---|---|---|---|",
            idle.latency_row("idle"), attacked.latency_row("under attack")]


def hostile_table(names: list[str], results: list[tuple[str, str, float]]) -> list[str]:
    lines = ["| hostile request | sent | answers | slowest |", "|---|---|---|---|"]
    for name in names:
        mine = [(outcome, seconds) for n, outcome, seconds in results if n == name]
        answers = ", ".join(f"{outcome} x{count}" for outcome, count in Counter(o for o, _ in mine).most_common())
        slowest = f"{max(s for _, s in mine):.2f} s" if mine else "-"
        lines.append(f"| {name} | {len(mine)} | {answers} | {slowest} |")
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--model", help="a checkpoint: start `python -m server` on it here")
    target.add_argument("--base-url", help="a running server (without /v1); needs --server-pid")
    parser.add_argument("--server-pid", type=int, default=None, help="with --base-url: the server's pid")
    parser.add_argument("--server-args", default="", help="extra flags for the server started with --model")
    parser.add_argument("--hang-timeout", type=float, default=None,
                        help=f"--worker-hang-timeout of the server started (default: {FAULT_HANG_TIMEOUT_S:g}; "
                             "--hostile: the server's own)")
    parser.add_argument("--api-key", default=None, help="the server's API key (the server started here requires it)")
    parser.add_argument("--served-model", default=None, help="the model name to send (default: /v1/models' first)")
    parser.add_argument("--faults", nargs="+", choices=tuple(FAULT_SIGNALS), default=list(FAULT_SIGNALS))
    parser.add_argument("--hostile", action="store_true", help="no faults: a hostile client's bad requests instead")
    parser.add_argument("--duration", type=float, default=60.0, help="--hostile: seconds of bad requests")
    parser.add_argument("--idle-baseline", type=float, default=5.0,
                        help="--hostile: seconds of /health sampling on the idle server first")
    parser.add_argument("--concurrency", type=int, default=None,
                        help=f"streams at once (default: {FAULT_CONCURRENCY}; --hostile: {HOSTILE_CONCURRENCY})")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=None,
                        help=f"tokens per stream (default: {FAULT_MAX_TOKENS}; --hostile: {HOSTILE_MAX_TOKENS})")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of steady load before each fault")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON ('-': stdout)")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.base_url and args.server_pid is None:
        parser.error("--base-url needs --server-pid (the worker is found as its child)")
    if args.hang_timeout is None and not args.hostile:
        args.hang_timeout = FAULT_HANG_TIMEOUT_S
    if args.concurrency is None:
        args.concurrency = HOSTILE_CONCURRENCY if args.hostile else FAULT_CONCURRENCY
    if args.max_tokens is None:
        args.max_tokens = HOSTILE_MAX_TOKENS if args.hostile else FAULT_MAX_TOKENS
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    process, base_url, server_pid = None, args.base_url, args.server_pid
    log_path = Path(tempfile.mkdtemp(prefix="bench-recovery-")) / "server.log"
    if args.model:
        hang_timeout = ["--worker-hang-timeout", str(args.hang_timeout)] if args.hang_timeout is not None else []
        api_key = ["--api-key", args.api_key] if args.api_key else []
        process, port = start_server(["--model", args.model, *hang_timeout, *api_key, *shlex.split(args.server_args)],
                                     log_path)
        base_url = f"http://127.0.0.1:{port}"
        server_pid = process.pid
        print(f"server log: {log_path}", file=sys.stderr)
    try:
        model = args.served_model or json.loads(get(base_url, "/v1/models", auth_header(args.api_key))[1])["data"][0]["id"]
        text, summary, ok = (run_hostile if args.hostile else run_faults)(args, base_url, server_pid, model)
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)
            process.wait(TIMEOUT_S)
    print(text)
    if args.json == "-":
        print(json.dumps(summary, indent=2))
    elif args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
