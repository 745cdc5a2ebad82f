"""Recovery benchmark: how fast a server heals a hung and a crashed worker under a steady streaming load, for
several server configurations side by side; and (--hostile) whether honest streams are served while a hostile
client sends bad requests.

    python -m tools.bench.serving.bench_recovery --rounds 2 --concurrency 8 64 --json recovery.json
    python -m tools.bench.serving.bench_recovery --model CKPT --server-args "--device cpu --dtype float32" \\
        --policy a= --policy b="--max-num-seqs 32"
    python -m tools.bench.serving.bench_recovery --base-url http://127.0.0.1:8000 --server-pid PID --hang-timeout 30 --json -
    python -m tools.bench.serving.bench_recovery --hostile --model CKPT --api-key KEY --server-args "--device cpu --dtype float32"

Policies: --policy NAME=FLAGS, server flags of each side, repeatable
(default: today, `--standby-workers 0 --no-shared-kv-cache`, the restart
path of old, and new, no flag); the first is the reference of the tokens/s
ratio. Each (policy, concurrency, round) starts its own `python -m server`
on --model (the embedded default model when --model is left out) with
--worker-hang-timeout --hang-timeout, --server-args and then the policy's
flags; the policies' order alternates from round to round (ABBA...), so a
trend in the machine's load falls on all of them alike. --base-url and
--server-pid measure one running server instead (the policy `server`; its
hang timeout is its own, tell it with --hang-timeout).

Load: --concurrency streams (each value a case of its own, 8 and 64 by
default; each stream a completion of --prompt-len random token ids and --max-tokens
tokens, EOS ignored, greedy; a finished stream is followed at once by the
next). Faults, injected into the engine worker in the order of --faults,
each once every stream has finished a request sent after the server was
ready (past a new worker's first steps) and then after --warmup s more:

- hang: SIGSTOP (frozen, no heartbeats); the supervisor must notice the
  silence and kill it.
- crash: SIGSTOP, then SIGKILL once the tokens already on their way have
  arrived. Every token a client receives after the kill comes from the
  recovery, so the kill -> next token time cannot be a token that was in
  flight.

The worker is the server's child; with a standby worker beside it, the
active one is the child that uses the most CPU time under the load. Before
each fault the server must answer /health with 200 and, when it has a
standby worker (pagedserve:standby_worker_ready exists and the flags do not
say --standby-workers 0; with --base-url: the gauge is 1 at the start), the
standby must be ready. Per fault:

- tokens/s: what the streams received over the --warmup s before the fault,
  and its ratio to the reference policy's in the same round.
- fault -> next token: the fault (the SIGKILL; the SIGSTOP of a hang) to the
  first token any stream receives after it, tokens already on their way
  aside. Targets: <= 0.5 s after a kill, <= --hang-timeout + 0.5 s after a
  hang.
- detection: fault -> pagedserve:worker_restarts_total rises (/metrics
  polled every 20 ms, so up to that much late); detection -> next token
  (negative when the next token came before the poll saw the restart); the
  server's own figure, pagedserve:worker_recovery_first_token_seconds
  (detection -> first token generated), where it has it.
- adopted and recomputed tokens of the requests in flight: the rise of
  pagedserve:recovery_tokens_total{kind="adopted"} and {kind="recomputed"}
  where the server has the metric ("server"), else this bench's estimate
  ("estimate": prompt + tokens received of every request in flight, all
  recomputed; adopted unknown). Target: 0 recomputed where tokens were adopted.
- lost: requests alive between the fault and the recovery (the next token
  and /health 200) that did not end with all --max-tokens tokens (errors,
  refusals, cut streams); those lost away from any fault are counted per
  run. Must be 0: the exit status is 1 otherwise.

Prints a markdown table, one row per (policy, concurrency, fault), each
figure the median over the rounds (lost: the sum), with the targets met or
missed (0 recomputed: in every round where tokens were adopted); --json
writes every round's raw figures. The JSON has more: READY after detection
(/health 200 again), the server's pagedserve:worker_last_recovery_seconds,
requests re-queued, how long the tokens on their way took to arrive after
each SIGSTOP (the drain).

--hostile: no faults, one server (--base-url, or one started on --model
or the default model with --server-args). The streams (16 by default, 128 tokens each) run while
one hostile client sends one bad request per second for --duration s, each
from its own thread, cycling through hostile_requests(): a top_p of 1e-46
(completions, chat, responses), a temperature of 1e-40, a logit_bias key of
10**20, 1000 prompts times n 20, an 8 MB prompt to /tokenize and to
/v1/completions, an 8 MiB upload without the API key announced with Expect:
100-continue (with --api-key), a 100 KB model name, Transfer-Encoding:
gzip, chunked, an HTTP/1.1 request without Host, a client that leaves
mid-stream, a chat message of role 'wizard', 64 prompts times n 4 with
prompt_logprobs 20 (a response of about 170 MB, refused by the response
bound), tool parameters of type string, and a JSON schema whose $refs only
refer to each other. It reports, as markdown:
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
import contextlib
import json
import os
import shlex
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tools.benchlib.hostile_client import HOSTILE_INTERVAL_S, Sampler, attack, hostile_requests
from tools.benchlib.local_server import Policy, parse_policy, start_server
from tools.benchlib.metrics import POLL_S, TIMEOUT_S, has_metric, histogram_mean, is_healthy, scrape, total, wait_until
from tools.benchlib.server_process import active_worker_pid, rss_mib
from tools.benchlib.stream_load import Load, Request
from tools.benchlib.target import Target, served_model

FAULTS = ("hang", "crash")
FAULT_CONCURRENCY, FAULT_MAX_TOKENS, FAULT_HANG_TIMEOUT_S = (8, 64), 32, 2.0
HOSTILE_CONCURRENCY, HOSTILE_MAX_TOKENS = 16, 128
DEFAULT_POLICIES = ("today=--standby-workers 0 --no-shared-kv-cache", "new=")
STANDBY_TIMEOUT_S = 60.0
RECOVERY_OBSERVED_TIMEOUT_S = 5.0
DRAIN_QUIET_S = 0.15  # no token for this long after the SIGSTOP: the tokens on their way have arrived
DRAIN_MAX_S = 1.0
KILL_TARGET_S = 0.5
HANG_MARGIN_S = 0.5
RESTARTS = "pagedserve:worker_restarts_total"
REQUEUED = "pagedserve:requests_requeued_total"
RECOVERY_TOKENS = "pagedserve:recovery_tokens_total"
RECOVERY_FIRST_TOKEN = "pagedserve:worker_recovery_first_token_seconds"
STANDBY_READY = "pagedserve:standby_worker_ready"


# ---------------------------------------------------------------------------------------------- the standby worker


def standby_is_off(flags: list[str]) -> bool:
    """The flags ask for no standby worker (the last --standby-workers given wins)."""
    value = None
    for flag, following in zip(flags, [*flags[1:], None]):
        if flag == "--standby-workers":
            value = following
        elif flag.startswith("--standby-workers="):
            value = flag.partition("=")[2]
    return value == "0"


# ---------------------------------------------------------------------------------------------- faults


@dataclass(slots=True)
class Server:
    base_url: str
    pid: int
    flags: list[str] | None  # None: a running server given by --base-url
    has_standby: bool = False

    def note_standby(self) -> None:
        """Whether to wait for a standby worker before each fault (see the module's docstring)."""
        samples = scrape(self.base_url)
        if self.flags is None:
            self.has_standby = total(samples, STANDBY_READY) == 1
        else:
            self.has_standby = has_metric(samples, STANDBY_READY) and not standby_is_off(self.flags)

    def wait_steady(self) -> None:
        """/health 200, and the standby worker ready where there is one (a warning if it is not in time)."""
        wait_until(lambda: is_healthy(self.base_url), "/health 200 before the fault")
        if not self.has_standby:
            return
        try:
            wait_until(lambda: total(scrape(self.base_url), STANDBY_READY) == 1, "the standby worker",
                       STANDBY_TIMEOUT_S)
        except TimeoutError:
            print(f"warning: no standby worker ready after {STANDBY_TIMEOUT_S:g} s; injecting the fault anyway",
                  file=sys.stderr)


def drain(load: Load, frozen_at: float, limit_s: float) -> float:
    """Once the worker is frozen, waits for the tokens already on their way to arrive: until DRAIN_QUIET_S pass
    without one (at most limit_s after frozen_at). Returns that moment."""
    while True:
        now = time.monotonic()
        if now - max(load.last_arrival, frozen_at) >= DRAIN_QUIET_S or now - frozen_at >= limit_s:
            return now
        time.sleep(POLL_S / 4)


def inject(server: Server, load: Load, fault: str, warmup: float, hang_timeout: float) -> dict:
    """One fault after `warmup` s of steady load: its figures, and its window (freeze to recovery) in which lost
    requests count against it."""
    server.wait_steady()
    load.wait_cycled()
    time.sleep(warmup)
    before = scrape(server.base_url)
    pid = active_worker_pid(server.pid)
    frozen_at = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    drained_at = drain(load, frozen_at, min(DRAIN_MAX_S, hang_timeout / 2))
    if fault == "crash":
        os.kill(pid, signal.SIGKILL)
    fault_time = time.monotonic() if fault == "crash" else frozen_at
    detect_time = wait_until(lambda: total(scrape(server.base_url), RESTARTS) > total(before, RESTARTS),
                             "the supervisor to notice")
    in_flight = [r for r in load.requests if r.is_in_flight(frozen_at, drained_at)]
    next_token = load.first_token_after(max(fault_time, drained_at))
    ready_time = wait_until(lambda: is_healthy(server.base_url), "the new worker to be ready")
    after = scrape_after_recovery(server.base_url, before)
    return {"fault": fault, "worker_pid": pid, "tokens_per_s": load.tokens_per_s(frozen_at - warmup, frozen_at),
            "standby_ready": total(before, STANDBY_READY) if has_metric(before, STANDBY_READY) else None,
            "drain_s": drained_at - frozen_at, "detection_s": detect_time - fault_time,
            "fault_to_next_token_s": next_token - fault_time, "detection_to_next_token_s": next_token - detect_time,
            "server_detection_to_first_token_s": histogram_mean(before, after, RECOVERY_FIRST_TOKEN),
            "ready_s": ready_time - detect_time,
            "server_recovery_s": total(after, "pagedserve:worker_last_recovery_seconds"),
            "requests_in_flight": len(in_flight), **recovery_tokens(before, after, in_flight, drained_at),
            "requeued": total(after, REQUEUED) - total(before, REQUEUED),
            "window": (frozen_at, max(next_token, ready_time))}


def scrape_after_recovery(base_url: str, before: dict[str, float]) -> dict[str, float]:
    """/metrics once the server has timed the recovery's first token (it does so on a watch tick a little after
    the token), at once if it has no such histogram, and as it is after RECOVERY_OBSERVED_TIMEOUT_S."""
    count = f"{RECOVERY_FIRST_TOKEN}_count"
    deadline = time.monotonic() + RECOVERY_OBSERVED_TIMEOUT_S
    while True:
        samples = scrape(base_url)
        if (not has_metric(samples, count) or total(samples, count) > total(before, count)
                or time.monotonic() > deadline):
            return samples
        time.sleep(POLL_S)


def recovery_tokens(before: dict[str, float], after: dict[str, float], in_flight: list[Request],
                    frozen_until: float) -> dict:
    """Tokens adopted and recomputed by the recovery: the server's counters' rise, else an estimate (all
    recomputed: the prompts and the tokens received of the requests in flight; adoption unknown)."""
    if has_metric(after, RECOVERY_TOKENS):
        return {"tokens_from": "server",
                **{f"{kind}_tokens": total(after, RECOVERY_TOKENS, f'kind="{kind}"')
                   - total(before, RECOVERY_TOKENS, f'kind="{kind}"') for kind in ("adopted", "recomputed")}}
    recomputed = sum(r.prompt_len + sum(t < frozen_until for t in r.token_times) for r in in_flight)
    return {"tokens_from": "estimate", "adopted_tokens": None, "recomputed_tokens": recomputed}


def run_faults(args: argparse.Namespace, server: Server, model: str, concurrency: int) -> dict:
    """Each fault of --faults under one load: every fault's figures and the requests lost."""
    load = Load(server.base_url, model, concurrency, args.prompt_len, args.max_tokens, args.seed, args.api_key)
    server.note_standby()
    load.start()
    results = [inject(server, load, fault, args.warmup, args.hang_timeout) for fault in args.faults]
    time.sleep(args.warmup)
    load.stop()
    lost = load.lost()
    for result in results:
        start, end = result.pop("window")
        result["lost"] = sum(r.overlaps(start, end) for r in lost)
    return {"faults": results, "requests": len(load.requests), "lost": len(lost),
            "lost_away_from_faults": len(lost) - sum(r["lost"] for r in results),
            "lost_errors": [r.error for r in lost][:10]}


# ---------------------------------------------------------------------------------------------- side by side


@contextlib.contextmanager
def started_server(args: argparse.Namespace, flags: list[str], log: Path) -> Iterator[Server]:
    """`python -m server` on --model (or the default model) with these flags; SIGTERM on the way out."""
    model = ["--model", args.model] if args.model else []
    hang_timeout = ["--worker-hang-timeout", str(args.hang_timeout)] if args.hang_timeout is not None else []
    api_key = ["--api-key", args.api_key] if args.api_key else []
    process, port = start_server([*model, *hang_timeout, *api_key, *flags], log)
    print(f"server log: {log}", file=sys.stderr)
    try:
        yield Server(f"http://127.0.0.1:{port}", process.pid, flags)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(TIMEOUT_S)


def server_for(args: argparse.Namespace, policy: Policy, log: Path) -> contextlib.AbstractContextManager[Server]:
    """The server of --base-url, or one started here with --server-args and then the policy's flags."""
    if args.base_url:
        return contextlib.nullcontext(Server(args.base_url, args.server_pid, None))
    return started_server(args, [*shlex.split(args.server_args), *policy.flags], log)


def model_of(args: argparse.Namespace, server: Server) -> str:
    """--served-model, or the server's first."""
    return args.served_model or served_model(server.base_url, args.api_key)


def run_policies(args: argparse.Namespace, policies: list[Policy]) -> list[dict]:
    """Every (concurrency, round, policy), the policies' order reversed every other round: each run's figures."""
    runs, logs = [], Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    for concurrency in args.concurrency:
        for round_index in range(args.rounds):
            for policy in policies if round_index % 2 == 0 else policies[::-1]:
                with server_for(args, policy, logs / f"{policy.name}-{concurrency}-{round_index + 1}.log") as server:
                    run = run_faults(args, server, model_of(args, server), concurrency)
                runs.append({"policy": policy.name, "concurrency": concurrency, "round": round_index + 1, **run})
                print(progress_line(runs[-1]), file=sys.stderr, flush=True)
    return runs


def progress_line(run: dict) -> str:
    faults = ", ".join(f"{f['fault']}: next token {f['fault_to_next_token_s']:.2f} s after it" for f in run["faults"])
    return (f"{run['policy']}, {run['concurrency']} streams, round {run['round']}: {faults}; "
            f"{run['requests']} requests, {run['lost']} lost")


MEDIANS = ("tokens_per_s", "fault_to_next_token_s", "detection_s", "detection_to_next_token_s",
           "server_detection_to_first_token_s", "adopted_tokens", "recomputed_tokens", "ready_s", "requeued")


def median_of(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def summary_row(runs: list[dict], policy: str, reference: str, concurrency: int, fault: str,
                hang_timeout: float) -> dict:
    """One (policy, concurrency, fault): medians over the rounds, the tokens/s ratio to the reference's in the
    same round, the targets."""
    def figures(name: str) -> dict[int, dict]:
        return {run["round"]: f for run in runs if run["policy"] == name and run["concurrency"] == concurrency
                for f in run["faults"] if f["fault"] == fault}

    mine, theirs = figures(policy), figures(reference)
    target = KILL_TARGET_S if fault == "crash" else hang_timeout + HANG_MARGIN_S
    medians = {key: median_of([f[key] for f in mine.values()]) for key in MEDIANS}
    adopting = [f for f in mine.values() if f["adopted_tokens"]]
    return {"policy": policy, "concurrency": concurrency, "fault": fault, "rounds": len(mine), **medians,
            "tokens_per_s_ratio": median_of([f["tokens_per_s"] / theirs[r]["tokens_per_s"] for r, f in mine.items()]),
            "next_token_target_s": target, "meets_next_token": medians["fault_to_next_token_s"] <= target,
            "meets_no_recompute": all(f["recomputed_tokens"] == 0 for f in adopting) if adopting else None,
            "tokens_from": sorted({f["tokens_from"] for f in mine.values()}),
            "lost": sum(f["lost"] for f in mine.values())}


def summarize(args: argparse.Namespace, policies: list[Policy], runs: list[dict]) -> list[dict]:
    return [summary_row(runs, policy.name, policies[0].name, concurrency, fault, args.hang_timeout)
            for concurrency in args.concurrency for policy in policies for fault in args.faults]


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def verdict(is_met: bool | None) -> str:
    return {None: "-", True: "meets", False: "MISSES"}[is_met]


def format_summary(rows: list[dict], runs: list[dict], reference: str) -> str:
    lines = [f"| policy | streams | fault | tok/s before | / {reference} | fault → next token | target "
             "| detection | detection → next token | server: detection → first token | adopted | recomputed "
             "| 0 recomputed where adopted | tokens from | lost |", "|---" * 15 + "|"]
    for row in rows:
        count = "-" if row["adopted_tokens"] is None else f"{row['adopted_tokens']:.0f}"
        lines.append(
            f"| {row['policy']} | {row['concurrency']} | {row['fault']} | {row['tokens_per_s']:.0f} "
            f"| {row['tokens_per_s_ratio']:.2f} | {seconds(row['fault_to_next_token_s'])} "
            f"| <= {row['next_token_target_s']:g} s: {verdict(row['meets_next_token'])} "
            f"| {seconds(row['detection_s'])} | {seconds(row['detection_to_next_token_s'])} "
            f"| {seconds(row['server_detection_to_first_token_s'])} | {count} | {row['recomputed_tokens']:.0f} "
            f"| {verdict(row['meets_no_recompute'])} | {', '.join(row['tokens_from'])} | {row['lost']} |")
    rounds = max(row["rounds"] for row in rows)
    away = sum(run["lost_away_from_faults"] for run in runs)
    lines.append(f"\nmedians over {rounds} round(s); lost: summed over them. Requests: "
                 f"{sum(run['requests'] for run in runs)}, lost away from any fault: {away}")
    return "\n".join(lines)


def run_side_by_side(args: argparse.Namespace, policies: list[Policy]) -> tuple[str, dict, bool]:
    """Every policy under every load, --rounds times: (markdown, JSON, whether no request was lost)."""
    runs = run_policies(args, policies)
    rows = summarize(args, policies, runs)
    arguments = {k: v for k, v in vars(args).items() if k != "policies"}
    report = {"arguments": arguments, "policies": {p.name: p.flags for p in policies}, "summary": rows, "runs": runs}
    return format_summary(rows, runs, policies[0].name), report, not any(run["lost"] for run in runs)


# ---------------------------------------------------------------------------------------------- --hostile

def worker_restarts(base_url: str) -> float | None:
    """pagedserve:worker_restarts_total; None if the server does not answer (it has exited)."""
    try:
        return total(scrape(base_url), RESTARTS)
    except OSError:
        return None


def run_hostile(args: argparse.Namespace, base_url: str, server_pid: int, model: str) -> tuple[str, dict, bool]:
    """Honest streams under a hostile client: (markdown, JSON summary, whether every stream was whole and the
    worker never restarted)."""
    requests = hostile_requests(Target.from_url(base_url, model, args.api_key))
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
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--model", help="a checkpoint to start `python -m server` on here (default: the server's "
                                        "embedded default model)")
    target.add_argument("--base-url", help="a running server (without /v1); needs --server-pid")
    parser.add_argument("--server-pid", type=int, default=None, help="with --base-url: the server's pid")
    parser.add_argument("--server-args", default="", help="flags for every server started here, before a policy's")
    parser.add_argument("--policy", dest="policies", action="append", type=parse_policy, metavar="NAME=FLAGS",
                        help="a policy's server flags, repeatable; the first is the tokens/s reference (default: "
                        f"{' and '.join(repr(p) for p in DEFAULT_POLICIES)})")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each (policy, concurrency); ABBA... order")
    parser.add_argument("--hang-timeout", type=float, default=None,
                        help=f"--worker-hang-timeout of the servers started (default: {FAULT_HANG_TIMEOUT_S:g}; "
                             "--hostile: the server's own); with --base-url, say the server's (target, drain)")
    parser.add_argument("--api-key", default=None, help="the server's API key (the server started here requires it)")
    parser.add_argument("--served-model", default=None, help="the model name to send (default: /v1/models' first)")
    parser.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS))
    parser.add_argument("--hostile", action="store_true", help="no faults: a hostile client's bad requests instead")
    parser.add_argument("--duration", type=float, default=60.0, help="--hostile: seconds of bad requests")
    parser.add_argument("--idle-baseline", type=float, default=5.0,
                        help="--hostile: seconds of /health sampling on the idle server first")
    parser.add_argument("--concurrency", type=int, nargs="+", default=None,
                        help=f"streams at once, one case per value (default: {' '.join(map(str, FAULT_CONCURRENCY))}; "
                             f"--hostile: one value, {HOSTILE_CONCURRENCY})")
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
    if args.base_url and args.policies:
        parser.error("--policy starts servers here; --base-url measures a running one")
    if args.policies and len({p.name for p in args.policies}) < len(args.policies):
        parser.error("--policy: distinct names")
    if args.hostile and args.concurrency and len(args.concurrency) > 1:
        parser.error("--hostile takes one --concurrency")
    if args.hang_timeout is None and not args.hostile:
        args.hang_timeout = FAULT_HANG_TIMEOUT_S
    if args.hostile:  # one load: its number of streams
        args.concurrency = args.concurrency[0] if args.concurrency else HOSTILE_CONCURRENCY
    elif args.concurrency is None:
        args.concurrency = list(FAULT_CONCURRENCY)
    if args.max_tokens is None:
        args.max_tokens = HOSTILE_MAX_TOKENS if args.hostile else FAULT_MAX_TOKENS
    return args


def run_hostile_server(args: argparse.Namespace) -> tuple[str, dict, bool]:
    """--hostile on the server of --base-url or on one started here with --server-args."""
    log = Path(tempfile.mkdtemp(prefix="bench-recovery-")) / "server.log"
    with server_for(args, Policy("server", []), log) as server:
        return run_hostile(args, server.base_url, server.pid, model_of(args, server))


def policies_of(args: argparse.Namespace) -> list[Policy]:
    if args.base_url:
        return [Policy("server", [])]
    return args.policies or [parse_policy(p) for p in DEFAULT_POLICIES]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    text, summary, ok = run_hostile_server(args) if args.hostile else run_side_by_side(args, policies_of(args))
    print(text)
    if args.json == "-":
        print(json.dumps(summary, indent=2))
    elif args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
