"""The device check: prove the CUDA path on a fresh GPU machine in one command, or dry-run it on the CPU.

    tools/device/device_check.sh OUTDIR        # on a CUDA machine, with the wheels of device_wheels in .whl/
    tools/device/device_check.sh --cpu OUTDIR  # the same parts at small sizes on the CPU (tests/test_device_check.py)
    tools/device/device_check.sh --skip-tests OUTDIR  # the measurements only, where the tests already passed

Each part runs as a subprocess with its own timeout, in order, under one
budget for the whole run (8 minutes on CUDA): a part that fails or runs out
of time is reported and the next still runs. Its full output goes to
OUTDIR/<part>.log; OUTDIR/summary.txt and the last lines printed are the
table: part, status, seconds, key figure.

Parts: environment (install the carried wheels, then import what the check
needs), checkpoint (a random-weight Llama: the Llama-3.2-1B shape in bf16 on
CUDA, tiny-4l on the CPU), the device tests (Triton kernels against the torch
reference, compiled on CUDA; model logits against transformers in fp32 and
bf16; the engine end to end; a server whose worker is SIGKILLed and
restarted), limits (the device's bf16 matmul rate and memory bandwidth),
offline (tokens/s, the engine vs transformers' static batching), decode
(step time at a batch ladder against the limits) and http (the same workload
through the HTTP server and in-process).

With --cpu, CUDA_VISIBLE_DEVICES is emptied for every part, so even a GPU
machine runs the dry run on its CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shared.cpu_tier import current_tier

from tools import REPO_ROOT
from tools.device.device_sizes import CUDA_SIZES, Sizes, cpu_sizes

WHEELS = REPO_ROOT / ".whl"
PYTEST = ("-m", "pytest", "-q", "-p", "no:cacheprovider")
REQUIRED_MODULES = ("torch", "triton", "transformers", "zmq", "orjson", "httptools", "uvloop", "redis", "llguidance",
                    "prometheus_client", "pytest", "openai")
# a run's ("3 passed, 1 failed in 4.00s") or, collecting only, what it collected ("2/16 tests collected ...")
PYTEST_SUMMARY = re.compile(r"^=*\s*(\d+(?:/\d+)? (?:passed|failed|error|tests? collected)[^=]*?)\s*=*$",
                            re.MULTILINE)
ENGINE_TOKENS_S = re.compile(r"^pagedserve engine:.*?([\d.]+) output tokens/s", re.MULTILINE)
STATIC_TOKENS_S = re.compile(r"^transformers static x\d+:.*?([\d.]+) output tokens/s", re.MULTILINE)
TEST_PART_PREFIX = "test-"  # the parts --skip-tests leaves out
HTTP_RATIO = re.compile(r"^HTTP / in-process output tokens/s: (\S+ / \S+ = \S+)", re.MULTILINE)


def last_match(pattern: re.Pattern, text: str) -> str:
    matches = pattern.findall(text)
    return matches[-1] if matches else ""


def key_line(text: str) -> str:
    """The last line a part printed as `key: FIGURE`."""
    return last_match(re.compile(r"^key: (.*)$", re.MULTILINE), text)


def pytest_summary(text: str) -> str:
    return last_match(PYTEST_SUMMARY, text)


def offline_figure(text: str) -> str:
    ours, static = last_match(ENGINE_TOKENS_S, text), last_match(STATIC_TOKENS_S, text)
    if not (ours and static):
        return ""
    return f"{float(ours):.1f} vs static batching {float(static):.1f} tok/s ({float(ours) / float(static):.2f}x)"


def http_figure(text: str) -> str:
    ratio = last_match(HTTP_RATIO, text)
    return f"HTTP / in-process tok/s {ratio}" if ratio else ""


@dataclass(slots=True)
class Part:
    name: str
    command: list[str]
    timeout_s: float
    figure: Callable[[str], str]  # the key figure, read from the part's log


@dataclass(slots=True)
class Result:
    name: str
    status: str  # pass, FAIL (exit N), TIMEOUT, SKIPPED (no time left)
    seconds: float
    figure: str


def python(*args: str) -> list[str]:
    return [sys.executable, *args]


def module(name: str, *args: str) -> list[str]:
    """`python -m tools.NAME ARGS` (the parts run in the repository root)."""
    return python("-m", f"tools.{name}", *args)


def parts(sizes: Sizes, out: Path, checkpoint: Path, site: Path) -> list[Part]:
    limits = out / "limits.json"

    def pytest(test: str) -> list[str]:
        return python(*PYTEST, *sizes.pytest_flags, test)

    num_wheels = len(list(WHEELS.glob("*.whl"))) if sizes.install_wheels else 0
    install = (f"{sys.executable} -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "
               f"--target {site} {WHEELS}/*.whl && " if num_wheels else "")
    imports = "; ".join(f"import {module}" for module in REQUIRED_MODULES)
    wheels = f", {num_wheels} wheels from .whl/" if num_wheels else ""
    report = f"print('key: torch', torch.__version__, 'on', ('cuda' if torch.cuda.is_available() else 'cpu') + '{wheels}')"
    return [
        Part("environment", ["bash", "-c", f"{install}{sys.executable} -c \"{imports}; {report}\""], 120, key_line),
        Part("checkpoint", module("bench.engine.bench_checkpoint", str(checkpoint), *sizes.checkpoint_flags),
             120, lambda text: sizes.checkpoint_name),
        Part("test-triton", pytest("tests/test_triton_attention.py"), 120, pytest_summary),
        Part("test-models", pytest("tests/test_models.py"), 120, pytest_summary),
        Part("test-engine", pytest("tests/test_engine.py"), 120, pytest_summary),
        Part("test-worker-kill", pytest("tests/test_supervisor_e2e.py::"
                                        "test_every_stream_completes_unchanged_through_a_worker_fault[sigkill]"),
             120, pytest_summary),
        Part("limits", module("device.device_measure", "limits", "--device", sizes.device, "--dtype", sizes.dtype,
                              "--json", str(limits)), 60, key_line),
        Part("offline", module("bench.engine.bench_offline", "--model", str(checkpoint), *sizes.offline_flags),
             180, offline_figure),
        Part("decode", module("device.device_measure", "decode", "--model", str(checkpoint), "--limits", str(limits),
                              *sizes.decode_flags), 150, key_line),
        Part("http", module("bench.serving.bench_serving", "--compare-in-process", "--model-dir", str(checkpoint),
                            "--no-progress", *sizes.http_flags), 150, http_figure),
    ]


def environment(sizes: Sizes, site: Path) -> dict[str, str]:
    """The parts' environment: the carried wheels and this checkout first on the path, the tests' device."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PAGEDSERVE_TEST_DEVICE": sizes.device}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    if sizes.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the dry run stays on the CPU even where a GPU is present
    else:
        env.pop("TRITON_INTERPRET", None)  # the Triton tests must run compiled on the GPU
    return env


def run_part(part: Part, log: Path, env: dict[str, str], timeout_s: float) -> Result:
    """Run one part in its own process group (so a timeout also ends the servers it started); log everything."""
    start = time.perf_counter()
    with open(log, "wb") as log_file:
        log_file.write(f"$ {' '.join(part.command)}\n".encode())
        log_file.flush()
        process = subprocess.Popen(part.command, cwd=REPO_ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            returncode = process.wait(timeout_s)
            status = "pass" if returncode == 0 else f"FAIL (exit {returncode})"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            status = f"TIMEOUT ({timeout_s:.0f} s)"
    seconds = time.perf_counter() - start
    return Result(part.name, status, seconds, part.figure(log.read_text(errors="replace")))


def format_table(results: list[Result], total_s: float) -> str:
    lines = [f"{'part':<18}{'status':<16}{'seconds':>8}  key figure"]
    lines += [f"{r.name:<18}{r.status:<16}{r.seconds:>8.1f}  {r.figure}" for r in results]
    lines.append(f"{'total':<18}{'':<16}{total_s:>8.1f}")
    return "\n".join(lines)


def run_check(sizes: Sizes, out: Path, skip_tests: bool = False) -> list[Result]:
    """Run every part in order (but the tests with `skip_tests`), each cut to what is left of `sizes.budget_s`;
    print and write the table."""
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="pagedserve-device-check-"))
    site, checkpoint = work / "site", work / "checkpoint"
    env = environment(sizes, site)
    deadline = time.perf_counter() + sizes.budget_s
    started, results = time.perf_counter(), []
    try:
        for part in parts(sizes, out, checkpoint, site):
            if skip_tests and part.name.startswith(TEST_PART_PREFIX):
                continue
            left = deadline - time.perf_counter()
            if left < 1:
                results.append(Result(part.name, "SKIPPED", 0.0, "no time left in the budget"))
                continue
            result = run_part(part, out / f"{part.name}.log", env, min(part.timeout_s, left))
            print(f"{result.name}: {result.status} in {result.seconds:.1f} s  {result.figure}", flush=True)
            results.append(result)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table = format_table(results, time.perf_counter() - started)
    (out / "summary.txt").write_text(table + "\n")
    print(f"\nlogs in {out}\n{table}")
    return results


def cpu_dtype() -> str:
    """bfloat16 where this CPU (or $PAGEDSERVE_CPU_ISA's tier) computes it natively, else float32."""
    return "bfloat16" if current_tier().has_native_bf16 else "float32"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="the dry run: CPU, small sizes")
    parser.add_argument("--budget-s", type=float,
                        help="the whole run's seconds, when a shorter run must fit (default: 480 on CUDA, 240 --cpu); "
                             "the parts past it are reported as skipped")
    parser.add_argument("--skip-tests", action="store_true",
                        help="run the measurements only (limits, offline, decode, http), on a machine whose tests "
                             "already passed: the whole budget goes to the figures")
    parser.add_argument("outdir", type=Path, help="where the logs and summary.txt go (created)")
    args = parser.parse_args()
    sizes = cpu_sizes(cpu_dtype()) if args.cpu else CUDA_SIZES
    if args.budget_s is not None:
        sizes = dataclasses.replace(sizes, budget_s=args.budget_s)
    results = run_check(sizes, args.outdir.resolve(), args.skip_tests)
    return 0 if all(r.status == "pass" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
