"""The suite's own machinery: the one wait (helpers/waiting.py), the one /metrics reader (helpers/metrics_scrape.py),
and the rule of tests/conftest.py that puts each test in its tier (e2e, slow, or the fast lane)."""

from __future__ import annotations

import asyncio
import functools
import subprocess
import sys

import pytest
from conftest import E2E_MODULES, E2E_NAMES, SLOW_NAMES, Reach

from helpers.metrics_scrape import labels_of, num_restarts, parse_metrics, rise, total
from helpers.running_server import start_server
from helpers.waiting import wait_until, wait_until_async

# ---------------------------------------------------------------------------------------------- waiting


def test_wait_until_polls_until_true_and_returns_the_value():
    calls = []

    def third_time() -> str | None:
        calls.append(None)
        return "ready" if len(calls) == 3 else None

    assert wait_until(third_time, timeout=5.0, interval=0.001) == "ready"
    assert len(calls) == 3


def test_wait_until_times_out_naming_what_it_waited_for_and_reads_a_callable_message_only_then():
    read = []

    def message() -> str:
        read.append(None)
        return "the moon; log: empty"

    assert wait_until(lambda: True, timeout=0.0, message=message) is True
    assert read == []
    with pytest.raises(AssertionError, match=r"^timed out waiting for the moon; log: empty$"):
        wait_until(lambda: False, timeout=0.05, interval=0.01, message=message)
    assert read == [None]


def test_wait_until_gives_up_at_once_when_told():
    with pytest.raises(AssertionError, match="^gave up waiting for a port$"):
        wait_until(lambda: False, timeout=60.0, message="a port", give_up=lambda: True)


def test_wait_until_async_lets_the_loop_run_while_it_waits():
    async def main() -> int:
        done = asyncio.Event()
        asyncio.get_running_loop().call_later(0.02, done.set)
        assert await wait_until_async(done.is_set, timeout=5.0) is True
        with pytest.raises(AssertionError, match="^timed out waiting for the condition$"):
            await wait_until_async(lambda: False, timeout=0.03)
        return 1

    assert asyncio.run(main()) == 1


# ---------------------------------------------------------------------------------------------- /metrics

METRICS = '''\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="tiny"} 2.0
# TYPE pagedserve:worker_restarts counter
pagedserve:worker_restarts_total{cause="signal",model_name="tiny"} 1.0
pagedserve:worker_restarts_total{cause="memory",model_name="tiny"} 3.0
pagedserve:worker_restarts_forgiven_total{model_name="tiny"} 5.0
pagedserve:note{text="a \\"quoted\\" value, with {braces}",model_name="tiny"} 1.0
process_start_time_seconds 1.7e+09
'''


def test_parse_metrics_keys_each_series_by_name_and_labels_and_skips_comments():
    samples = parse_metrics(METRICS)
    assert samples['vllm:num_requests_running{model_name="tiny"}'] == 2.0
    assert samples["process_start_time_seconds"] == 1.7e9
    assert len(samples) == 6 and not any(key.startswith("#") for key in samples)


def test_labels_of_reads_escaped_quotes_and_a_bare_name():
    assert labels_of('pagedserve:note{text="a \\"quoted\\" value, with {braces}",model_name="tiny"}') == (
        "pagedserve:note", {"text": 'a \\"quoted\\" value, with {braces}', "model_name": "tiny"})
    assert labels_of("process_start_time_seconds") == ("process_start_time_seconds", {})


def test_total_sums_the_series_of_one_name_whose_labels_include_those_asked():
    samples = parse_metrics(METRICS)
    assert total(samples, "pagedserve:worker_restarts_total") == 4.0  # the forgiven counter is another name
    assert total(samples, "pagedserve:worker_restarts_total", cause="memory") == 3.0
    assert total(samples, "pagedserve:worker_restarts_total", cause="hang") == 0.0
    assert total(samples, "vllm:num_requests_running", model_name="other") == 0.0
    assert num_restarts(samples) == 4.0 and num_restarts(samples, cause="signal") == 1.0


def test_rise_is_the_difference_of_two_scrapes():
    before = parse_metrics(METRICS)
    after = {**before, 'pagedserve:worker_restarts_total{cause="hang",model_name="tiny"}': 2.0}
    assert rise(before, after, "pagedserve:worker_restarts_total") == 2.0
    assert rise(before, after, "pagedserve:worker_restarts_total", cause="memory") == 0.0


# ---------------------------------------------------------------------------------------------- the tiers

def _starts_a_server(tmp_path):
    return start_server(tmp_path, None)


def _calls_a_function_that_starts_one(tmp_path):
    return _starts_a_server(tmp_path)


class _Cluster:
    def __init__(self, tmp_path):
        self.server = _starts_a_server(tmp_path)


def _runs_the_server_cli():
    return subprocess.run([sys.executable, "-m", "server", "--help"], check=False)


def _runs_the_worker_cli():
    return subprocess.run([sys.executable, "-m", "gpu_worker", "--help"], check=False)


SCRIPT = "from server.worker.engine_client import EngineClient; EngineClient(config, path)"


def _runs_a_script_that_starts_a_worker():
    return subprocess.run([sys.executable, "-c", SCRIPT], check=False)


def _nested_lambda_starts_one(tmp_path):
    later = [lambda: start_server(tmp_path, None)]
    return later


def _asks_for_a_fixture_that_starts_one(request):
    return request.getfixturevalue("_served")


@pytest.fixture
def _served(tmp_path):
    return _starts_a_server(tmp_path)


_serve = functools.partial(start_server, flags=())


def _starts_one_through_a_partial(tmp_path):
    return _serve(tmp_path, None)


def _runs_another_python():
    return subprocess.run([sys.executable, "-c", "print(1)"], check=False)


def _in_process(samples):
    return total(samples, "vllm:num_requests_running") + len(parse_metrics(METRICS))


@pytest.mark.parametrize("function", [_starts_a_server, _calls_a_function_that_starts_one, _Cluster,
                                      _runs_the_server_cli, _runs_the_worker_cli, _runs_a_script_that_starts_a_worker,
                                      _nested_lambda_starts_one, _asks_for_a_fixture_that_starts_one,
                                      _starts_one_through_a_partial])
def test_code_that_starts_a_process_is_e2e(function):
    assert Reach(E2E_NAMES, E2E_MODULES, scripts=True).found_in(function)


@pytest.mark.parametrize("function", [_runs_another_python, _in_process, total])
def test_code_that_starts_none_is_not_e2e(function):
    assert not Reach(E2E_NAMES, E2E_MODULES, scripts=True).found_in(function)


@pytest.mark.parametrize("function, is_slow", [(_runs_another_python, True), (_in_process, False)])
def test_code_that_runs_another_program_is_slow(function, is_slow):
    assert Reach(SLOW_NAMES).found_in(function) is is_slow


def test_this_file_is_in_the_fast_lane(request):
    assert request.node.get_closest_marker("e2e") is None and request.node.get_closest_marker("slow") is None
