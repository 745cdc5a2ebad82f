"""POST /start_profile and /stop_profile: a real server with a real worker on a tiny checkpoint, over real HTTP.

One server with --profile-dir and an API key serves the module; its tests
leave it not profiling, and the one that kills the worker comes last. A
second server, without --profile-dir, shows the endpoints are not there.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared.sampling_params import SamplingParams

from helpers.running_server import RunningServer, start_server, stop_server
from helpers.waiting import wait_until

API_KEY = "profile-key-456"
MODEL = "tiny"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_TOKENS = 8
SERVER_FLAGS = ("--served-model-name", MODEL, "--api-key", API_KEY, "--device", "cpu", "--dtype", "float32",
                "--num-kv-blocks", "256", "--max-num-seqs", "4")
HEADER = re.compile(r"# (\d+) steps profiled in ([0-9.]+) s wall time \(worker epoch (\d+)\)")
# What a Llama layer's matmuls show up as on the CPU: the project's own linear kernel (a named range around its
# native call), oneDNN's packed linear, or torch's own matmul.
MATMUL_OPERATORS = ("pagedserve::linear", "mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::linear",
                    "aten::matmul")
REPO_ROOT = Path(__file__).resolve().parent.parent
# bench_serving's main in a fresh interpreter, which must not have imported torch by the end of it.
BENCH = ("import sys; from tools.bench.serving import bench_serving; code = bench_serving.main(sys.argv[1:]); "
         "assert 'torch' not in sys.modules, 'the load generator imported torch'; sys.exit(code)")


@pytest.fixture(scope="module")
def server(tmp_path_factory, checkpoint) -> RunningServer:
    tmp = tmp_path_factory.mktemp("server")
    running = start_server(tmp, checkpoint, *SERVER_FLAGS, "--profile-dir", str(tmp / "profiles"))
    running.profile_dir = tmp / "profiles"
    yield running
    stop_server(running)


def post(server: RunningServer, path: str, headers: dict | None = AUTH) -> tuple[int, dict]:
    status, _, body = server.request("POST", path, b"", headers=headers)
    return status, json.loads(body) if body else {}


def complete(server: RunningServer, prompt: str) -> None:
    status, _, body = server.request("POST", "/v1/completions", {"model": MODEL, "prompt": prompt,
                                                                 "max_tokens": MAX_TOKENS, "ignore_eos": True},
                                     headers=AUTH)
    assert status == 200, body
    assert json.loads(body)["usage"]["completion_tokens"] == MAX_TOKENS


def assert_conflict(status: int, body: dict, *words: str) -> None:
    assert status == 409, body
    error = body["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert all(word in error["message"] for word in words), error["message"]


def test_stop_without_start_is_409(server):
    assert_conflict(*post(server, "/stop_profile"), "not profiling", "/start_profile")


def test_without_the_api_key_both_are_401(server):
    for path in ("/start_profile", "/stop_profile"):
        status, body = post(server, path, headers={})
        assert status == 401 and body["error"]["type"] == "authentication_error", body
        assert post(server, path, headers={"Authorization": "Bearer wrong"})[0] == 401
    assert_conflict(*post(server, "/stop_profile"), "not profiling")  # the refused start changed nothing


def test_a_profile_of_two_completions_names_real_operators_and_counts_the_steps(server):
    assert post(server, "/start_profile") == (200, {"status": "profiling"})
    complete(server, "Once upon a time")
    complete(server, "The quick brown fox")
    status, result = post(server, "/stop_profile")
    assert status == 200, result
    assert result["status"] == "stopped" and result["steps"] >= 2 * MAX_TOKENS and result["seconds"] > 0
    table, trace = server.profile_dir / os.path.basename(result["table"]), result["trace"]
    assert str(table) == result["table"] and re.fullmatch(r"worker-1-\d{8}T\d{6}\.\d{6}Z\.txt", table.name)
    assert trace == result["table"].removesuffix(".txt") + ".json"
    assert stat.S_IMODE(server.profile_dir.stat().st_mode) == 0o700
    text = table.read_text()
    assert text == result["table_text"]
    steps, seconds, epoch = HEADER.match(text).groups()
    assert (int(steps), float(seconds), int(epoch)) == (result["steps"], pytest.approx(result["seconds"], abs=1e-3), 1)
    assert any(name in text for name in MATMUL_OPERATORS), text
    [step_row] = [line for line in text.splitlines() if line.strip().startswith("worker step")]
    assert int(step_row.split()[-1]) == result["steps"], "one 'worker step' range per step profiled"
    assert "traceEvents" in json.loads(open(trace).read())
    log = server.log.read_text()
    assert "top operators by self CPU time" in log and result["table"] in log


def test_a_second_start_is_409_and_a_stop_ends_it(server):
    assert post(server, "/start_profile")[0] == 200
    assert_conflict(*post(server, "/start_profile"), "already profiling")
    status, result = post(server, "/stop_profile")
    assert status == 200 and result["steps"] == 0, result
    assert_conflict(*post(server, "/stop_profile"), "not profiling")


def run_bench(server: RunningServer, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BENCH, "--base-url", server.base_url, "--api-key",
                           API_KEY, "--num-requests", "4", "--prompt-len", "4", "8", "--output-len", "4", "8",
                           "--no-progress", *flags], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)


def test_bench_serving_profile_prints_the_table_under_the_load(server):
    bench = run_bench(server, "--profile")
    assert bench.returncode == 0, bench.stderr + bench.stdout
    figures, profile = bench.stdout.split("profile: ")
    assert "requests: 4 (0 failed)" in figures and "TTFT" in figures
    assert re.match(r"\d+ worker steps in [0-9.]+ s; table /\S+\.txt, chrome trace /\S+\.json\n# \d+ steps profiled",
                    profile), profile
    assert "worker step" in profile and any(name in profile for name in MATMUL_OPERATORS)
    assert_conflict(*post(server, "/stop_profile"), "not profiling")


def test_a_worker_killed_while_profiling_loses_the_profile_and_the_server_serves_on(server):
    assert post(server, "/start_profile")[0] == 200
    complete(server, "Once upon a time")
    killed = server.worker_pid
    os.kill(killed, signal.SIGKILL)
    assert_conflict(*post(server, "/stop_profile"), "lost", "exited while profiling")
    server.wait_for(lambda: server.worker_pid != killed and server.is_healthy(), "a new worker")
    complete(server, "The quick brown fox")
    assert_conflict(*post(server, "/stop_profile"), "lost")  # the new worker was never asked to profile
    assert post(server, "/start_profile")[0] == 200
    status, result = post(server, "/stop_profile")
    assert status == 200 and "worker-2-" in result["table"], result


# ---------------------------------------------------------------------------------------------- the frontend's wait


def test_a_stop_the_worker_never_answers_times_out_and_a_late_answer_is_dropped():
    from server.worker.profiling import ProfileSession, ProfileState, ProfileTimeout
    from shared.protocol import ProfileResult

    async def scenario() -> None:
        session = ProfileSession()
        session.start(epoch=3)
        with pytest.raises(ProfileTimeout, match="did not answer /stop_profile within 0.05 s"):
            await session.wait(session.stop(), timeout=0.05)
        assert session.state is ProfileState.IDLE
        session.finish(ProfileResult(3, "s" * 32, 1, 0.5, "/p/a.txt", "/p/a.json"))  # too late: nobody waits
        session.start(epoch=3)
        waiting = session.stop()
        session.finish(ProfileResult(3, "s" * 32, 2, 0.5, "/p/b.txt", "/p/b.json"))
        assert (await session.wait(waiting)).table_path == "/p/b.txt" and session.state is ProfileState.IDLE

    asyncio.run(scenario())


# ---------------------------------------------------------------------------------------------- the worker's side


def profile_steps(profiler, engine, num_tokens: int) -> None:
    """One greedy request through the real engine, every step under profiler.step(), as the worker loop runs it."""
    engine.add_request(f"profiled-{time.monotonic_ns()}", [3, 4, 5], SamplingParams(max_tokens=num_tokens,
                                                                                    temperature=0, ignore_eos=True))
    while engine.has_work():
        with profiler.step():
            engine.step()


def written(profiler, count: int) -> list:
    """The next `count` ProfileResults, as the worker loop takes them: polled until the side thread is done."""
    results = []

    def has_all() -> bool:
        results.extend(profiler.take_results())
        return len(results) >= count

    wait_until(has_all, timeout=60, interval=0.01, message="the profile to be written within 60 s")
    return results


def test_a_profile_that_cannot_be_written_is_an_error_and_the_next_one_is_written(in_process_engine, tmp_path):
    from gpu_worker.process.step_profiler import StepProfiler

    profiler = StepProfiler("cpu", epoch=7, secret="s" * 32)
    profiler.stop(str(tmp_path / "never"))
    profiler.start()
    profile_steps(profiler, in_process_engine, 4)
    (tmp_path / "a-file").write_text("")
    profiler.stop(str(tmp_path / "a-file" / "profiles"))
    not_profiling, unwritable = written(profiler, 2)
    assert "not profiling" in not_profiling.error and not_profiling.num_steps == 0
    assert "could not write" in unwritable.error and unwritable.num_steps == 4 and unwritable.table_path is None
    assert not profiler.is_profiling and not (tmp_path / "never").exists()
    profiler.start()
    profile_steps(profiler, in_process_engine, 3)
    profiler.stop(str(tmp_path / "profiles"))
    [result] = written(profiler, 1)
    assert result.error is None and result.num_steps == 3 and result.epoch == 7
    assert Path(result.table_path).read_text() == result.table and Path(result.trace_path).is_file()
    assert result.top_operators[0].self_cpu_ms >= result.top_operators[-1].self_cpu_ms


def test_without_a_profile_dir_the_endpoints_are_404(tmp_path, checkpoint):
    running = start_server(tmp_path, checkpoint, *SERVER_FLAGS)
    try:
        for path in ("/start_profile", "/stop_profile"):
            for headers in (AUTH, {}):
                status, body = post(running, path, headers=headers)
                assert status == 404 and body["error"]["type"] == "not_found_error", body
        bench = run_bench(running, "--profile")
        assert bench.returncode == 1 and "--profile-dir" in bench.stderr, bench.stderr
    finally:
        stop_server(running)
