"""The worker as a real process behind an EngineClient, on a tiny (sharpened) Llama checkpoint.

One worker serves most tests of the module (start-up is a Python + torch
import, seconds); the tests that kill, restart or close a worker start their
own. Greedy outputs are checked against the in-process Engine on the same
prompts (engine_config, in_process_engine and long_case are tests/conftest.py's).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import pytest
import pytest_asyncio

from gpu_worker.process.fault_injection import ENV_VAR as FAULT_ENV_VAR
from server.worker.engine_client import EngineClient
from server.worker.process import WorkerStartError, WorkerState
from server.worker.runtime_dir import RuntimeDir
from shared.config import EngineConfig
from shared.sampling_params import SamplingParams
from shared.vocabulary import HEARTBEAT_INTERVAL_S, MIN_HANG_TIMEOUT_S

from helpers.waiting import wait_until_async
from helpers.worker_helpers import MAX_MODEL_LEN, START_TIMEOUT_S, WAIT_S, greedy, module_loop, run_to_end


@pytest.fixture(scope="module")
def greedy_cases(in_process_engine) -> list[tuple[list[int], int, list[int]]]:
    """(prompt, max_tokens, the in-process Engine's greedy output) for a few prompts."""
    from gpu_worker.engine.generate import generate

    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(3, 40))] for _ in range(6)]
    max_tokens = [rng.randint(8, 24) for _ in prompts]
    params = [SamplingParams(max_tokens=n, temperature=0) for n in max_tokens]
    completions = generate(in_process_engine, prompts, params)
    return [(p, n, c.token_ids) for p, n, c in zip(prompts, max_tokens, completions)]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(engine_config):
    with RuntimeDir.create() as runtime_dir:
        client = EngineClient(engine_config, runtime_dir.path, start_timeout=START_TIMEOUT_S)
        await client.start()
        yield client
        await client.close()


@module_loop
async def test_an_idle_worker_keeps_the_heartbeat_promise(client):
    """shared/vocabulary.py: a message at least every HEARTBEAT_INTERVAL_S between steps, so that silence
    longer than the frontend's tolerance (MIN_HANG_TIMEOUT_S) means a hung worker, never an idle one."""
    seen, deadline = [], time.monotonic() + 12 * HEARTBEAT_INTERVAL_S
    while time.monotonic() < deadline:
        if not seen or client.last_message_time != seen[-1]:
            seen.append(client.last_message_time)
        await asyncio.sleep(HEARTBEAT_INTERVAL_S / 20)
    gaps = [later - earlier for earlier, later in zip(seen[1:], seen[2:])]  # the first gap began before we looked
    assert len(gaps) >= 6, f"{len(seen)} messages in {12 * HEARTBEAT_INTERVAL_S:g} s"
    assert max(gaps) < MIN_HANG_TIMEOUT_S, gaps


@module_loop
async def test_ready_reports_the_model(client):
    info = client.worker_info
    assert (info.epoch, info.pid) == (1, client.worker_pid)
    assert (info.vocab_size, info.eos_token_ids, info.max_model_len) == (512, (2,), MAX_MODEL_LEN)
    assert (info.num_kv_blocks, info.block_size, info.device, info.dtype) == (128, 4, "cpu", "float32")
    assert client.is_ready and client.totals.stats.kv_cache_usage == 0


@module_loop
async def test_concurrent_greedy_requests_stream_the_engines_output(client, greedy_cases):
    states = [greedy(f"greedy-{i}", prompt, n) for i, (prompt, n, _) in enumerate(greedy_cases)]
    for state in states:
        client.add(state)
    num_updates = await asyncio.gather(*(run_to_end(s) for s in states))
    for state, (_, _, expected) in zip(states, greedy_cases):
        assert state.error is None and state.finish_reason in ("stop", "length")
        assert state.output_token_ids == expected, state.request_id
    assert all(n >= 2 for n, (_, _, tokens) in zip(num_updates, greedy_cases) if len(tokens) >= 2), \
        f"tokens must arrive step by step, got updates {num_updates}"
    assert not client.in_flight
    assert client.totals.num_generation_tokens >= sum(len(s.output_token_ids) for s in states)


@module_loop
async def test_abort_mid_way_frees_the_requests_blocks(client):
    state = greedy("to-abort", [5, 6, 7, 8, 9], 80, ignore_eos=True)
    client.add(state)
    # Polled every millisecond: a step of this tiny model takes a fraction of one, so at the default 20 ms the whole
    # request could finish before the abort.
    await wait_until_async(lambda: len(state.output_token_ids) >= 3, interval=0.001)
    assert client.totals.stats.kv_cache_usage > 0
    client.abort("to-abort")
    assert state.finish_reason == "abort" and "to-abort" not in client.in_flight
    num_tokens = len(state.output_token_ids)
    await wait_until_async(lambda: client.totals.stats.kv_cache_usage == 0 and client.totals.stats.num_running == 0)
    assert len(state.output_token_ids) == num_tokens < 80


@module_loop
async def test_a_refused_request_fails_alone_and_the_worker_carries_on(client, greedy_cases):
    pid = client.worker_pid
    too_long = greedy("too-long", list(range(3, 3 + MAX_MODEL_LEN + 4)), 4)
    client.add(too_long)
    await run_to_end(too_long)
    assert "max_model_len" in too_long.error and too_long.error_type == "invalid_request_error"
    assert too_long.output_token_ids == [] and "too-long" not in client.in_flight
    prompt, max_tokens, expected = greedy_cases[0]
    after = greedy("after-refusal", prompt, max_tokens)
    client.add(after)
    await run_to_end(after)
    assert after.output_token_ids == expected and client.worker_pid == pid and client.is_ready


@module_loop
async def test_an_idle_worker_heartbeats(client):
    await wait_until_async(lambda: not client.totals.stats.num_running)
    arrivals = []
    deadline = time.monotonic() + 1.2
    while time.monotonic() < deadline:
        if not arrivals or client.last_message_time != arrivals[-1]:
            arrivals.append(client.last_message_time)
        await asyncio.sleep(0.02)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert len(gaps) >= 3 and max(gaps) < 0.5, f"heartbeat gaps {gaps}"


@module_loop
async def test_a_killed_worker_fails_its_requests_clearly(engine_config, monkeypatch):
    monkeypatch.setenv(FAULT_ENV_VAR, "pace@0")  # steps of 10 ms or more: the kill finds both requests under way
    with RuntimeDir.create() as runtime_dir:
        client = EngineClient(engine_config, runtime_dir.path, start_timeout=START_TIMEOUT_S)
        await client.start()
        states = [greedy(f"doomed-{i}", [4 + i, 5, 6], 80, ignore_eos=True) for i in range(2)]
        for state in states:
            client.add(state)
        await wait_until_async(lambda: all(s.output_token_ids for s in states))
        os.kill(client.worker_pid, signal.SIGKILL)
        await asyncio.wait_for(client.worker_exited.wait(), WAIT_S)
        for state in states:
            assert "killed by SIGKILL" in state.error and state.error_type == "server_error"
        assert client.state is WorkerState.EXITED and not client.in_flight
        late = greedy("late", [4, 5], 4)
        client.add(late)
        assert "no engine worker is running" in late.error
        await client.close()


@module_loop
async def test_a_restarted_worker_continues_requests_from_their_tokens(engine_config, long_case, monkeypatch):
    """The supervisor's path: a supervised client keeps requests in flight and start() re-sends them."""
    monkeypatch.setenv(FAULT_ENV_VAR, "pace@0")  # steps of 10 ms or more: the SIGTERM finds the survivor under way
    with RuntimeDir.create() as runtime_dir:
        client = EngineClient(engine_config, runtime_dir.path, supervised=True,
                              start_timeout=START_TIMEOUT_S)
        await client.start()
        threads = client.worker_info.cpu_threads
        assert threads >= 1 and client.engine_config.cpu_threads == threads  # its successors start on its count
        prompt, expected = long_case
        state = greedy("survivor", prompt, len(expected), ignore_eos=True)
        client.add(state)
        await wait_until_async(lambda: len(state.output_token_ids) >= 2)
        os.kill(client.worker_pid, signal.SIGTERM)
        await asyncio.wait_for(client.worker_exited.wait(), WAIT_S)
        assert (client.worker_exit.epoch, client.worker_exit.returncode) == (1, 0)  # SIGTERM: a clean exit
        assert state.error is None and "survivor" in client.in_flight
        await client.start()
        assert client.epoch == client.worker_info.epoch == 2
        assert client.worker_info.cpu_threads == threads
        num_before_restart = len(state.output_token_ids)
        await run_to_end(state)
        assert 2 <= num_before_restart < len(expected)
        assert state.output_token_ids == expected and state.error is None
        await client.close()


@module_loop
async def test_close_stops_the_worker_and_leaves_nothing_behind(engine_config):
    with RuntimeDir.create() as runtime_dir:
        client = EngineClient(engine_config, runtime_dir.path, start_timeout=START_TIMEOUT_S)
        await client.start()
        state = greedy("cut-short", [4, 5, 6], 80, ignore_eos=True)
        client.add(state)
        await wait_until_async(lambda: bool(state.output_token_ids))
        pid = client.worker_pid
        await client.close()
        assert client.worker_exit.returncode == 0, "a SHUTDOWN message makes a clean exit"
        assert "shutting down" in state.error
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)
        assert list(runtime_dir.path.iterdir()) == []
    assert not runtime_dir.path.exists()


@module_loop
async def test_a_worker_that_cannot_load_reports_why(engine_config, tmp_path):
    bad_config = EngineConfig(model=str(tmp_path / "no-such-model"), dtype="float32")
    with RuntimeDir.create() as runtime_dir:
        client = EngineClient(bad_config, runtime_dir.path, start_timeout=START_TIMEOUT_S)
        with pytest.raises(WorkerStartError, match="exited with status 1 after a fatal error") as raised:
            await client.start()
        assert "no-such-model" in raised.value.worker_exit.fatal.traceback
        assert client.state is WorkerState.EXITED
        await client.close()
