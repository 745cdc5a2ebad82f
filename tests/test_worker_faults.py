"""Faults inside a real worker process, injected with $PAGEDSERVE_FAULT (gpu_worker/process/fault_injection.py), or a kill.

A request whose sampling raises fails alone, as a server error, and the
worker serves on. A step that raises, exits or hangs takes the worker down,
and the frontend can tell which requests were in it: the Fatal names them
when there is one, and however the worker died, scheduled_on_worker holds
every request it had run (its scheduled ledger outlives it), but none that
only waited in its queue.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time

from server.worker.engine_client import EngineClient
from server.worker.runtime_dir import RuntimeDir
from shared.config import EngineConfig
from shared.sampling_params import SamplingParams

from helpers.waiting import wait_until_async
from helpers.worker_helpers import START_TIMEOUT_S, WAIT_S, greedy, module_loop, run_to_end

HUNG_SILENCE_S = 2.0  # eight heartbeat intervals without a message: the worker is stuck in a step
NUM_DEATHS = 2
LONG_CONTEXT = 500  # the tiny engine's KV cache holds 512 tokens


@module_loop
async def test_a_request_whose_sampling_raises_fails_alone_and_the_worker_serves_on(engine_config, in_process_engine,
                                                                                     monkeypatch):
    from gpu_worker.engine.generate import generate  # torch, in the test process only

    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    expected = [c.token_ids for c in generate(in_process_engine, prompts, SamplingParams(max_tokens=12,
                                                                                         temperature=0))]
    monkeypatch.setenv("PAGEDSERVE_FAULT", "fail-on-request=doomed")
    with RuntimeDir.create() as runtime_dir:
        client = EngineClient(engine_config, runtime_dir.path, start_timeout=START_TIMEOUT_S)
        await client.start()
        pid = client.worker_pid
        healthy = [greedy(f"healthy-{i}", prompt, 12) for i, prompt in enumerate(prompts)]
        doomed = greedy("doomed", [5, 6, 7, 8], 12)
        for state in [healthy[0], doomed, *healthy[1:]]:
            client.add(state)
        await asyncio.gather(*(run_to_end(state) for state in [*healthy, doomed]))
        assert doomed.error_type == "server_error" and "engine failed" in doomed.error
        assert doomed.output_token_ids == [] and "InjectedFault" not in doomed.error
        assert [state.output_token_ids for state in healthy] == expected
        assert all(state.error is None for state in healthy)
        assert client.worker_pid == pid and client.is_ready and not client.in_flight
        await client.close()


def poison_client(engine_config: EngineConfig, runtime_dir: RuntimeDir) -> EngineClient:
    """A supervised client of a worker that runs 2 requests at most, for start_a_step_with_the_poison."""
    return EngineClient(dataclasses.replace(engine_config, max_num_seqs=2), runtime_dir.path, supervised=True,
                        start_timeout=START_TIMEOUT_S)


async def start_a_step_with_the_poison(client: EngineClient) -> None:
    """'early' runs alone; then 'poison' joins it in a step, and 'queued' waits: the worker runs 2 requests at most."""
    early = greedy("early", [4, 5, 6], 80, ignore_eos=True)
    client.add(early)
    await wait_until_async(lambda: len(early.output_token_ids) >= 2)
    client.add(greedy("poison", [7, 8, 9], 8))
    client.add(greedy("queued", [10, 11], 8))


@module_loop
async def test_a_step_that_raises_names_its_requests_in_the_fatal(engine_config, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_FAULT", "raise-on-request=poison")
    with RuntimeDir.create() as runtime_dir:
        client = poison_client(engine_config, runtime_dir)
        await client.start()
        await start_a_step_with_the_poison(client)
        await asyncio.wait_for(client.worker_exited.wait(), WAIT_S)
        worker_exit = client.worker_exit
        assert worker_exit.returncode == 1 and "InjectedFault" in worker_exit.fatal.message
        assert sorted(worker_exit.fatal.request_ids) == ["early", "poison"]
        assert client.in_flight.scheduled_on_worker == {"early", "poison"}
        assert set(client.in_flight) == {"early", "poison", "queued"}
        await client.start()
        assert client.in_flight.scheduled_on_worker == frozenset(), "a new worker has scheduled nothing yet"
        await client.close()


@module_loop
async def test_a_worker_that_exits_before_the_forward_pass_leaves_that_steps_requests_in_scheduled_on_worker(
        engine_config, monkeypatch):
    """os._exit right after scheduling, every time the poison is in a step: no Fatal, no last message, no
    clean-up. Each death, the restarted worker's first one included, names the step's requests."""
    monkeypatch.setenv("PAGEDSERVE_FAULT", "exit-on-request=poison")
    with RuntimeDir.create() as runtime_dir:
        client = poison_client(engine_config, runtime_dir)
        await client.start()
        await start_a_step_with_the_poison(client)
        for death in range(NUM_DEATHS):
            if death:
                await client.start()  # re-sends all three; the poison kills this worker too
            await asyncio.wait_for(client.worker_exited.wait(), WAIT_S)
            assert (client.worker_exit.returncode, client.worker_exit.fatal) == (1, None)
            assert client.in_flight.scheduled_on_worker == {"early", "poison"}, "'queued' only waited"
            assert set(client.in_flight) == {"early", "poison", "queued"}
        await client.close()
        assert list(runtime_dir.path.iterdir()) == [], "each worker's ledger is removed once read"


@module_loop
async def test_a_step_that_hangs_then_is_killed_leaves_its_requests_in_scheduled_on_worker(engine_config,
                                                                                           monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_FAULT", "hang-on-request=poison")
    with RuntimeDir.create() as runtime_dir:
        client = poison_client(engine_config, runtime_dir)
        await client.start()
        await start_a_step_with_the_poison(client)
        await wait_until_async(lambda: time.monotonic() - client.last_message_time > HUNG_SILENCE_S)
        client.kill_worker()  # as the supervisor does with a hung worker
        await asyncio.wait_for(client.worker_exited.wait(), WAIT_S)
        assert client.worker_exit.signal_name == "SIGKILL" and client.worker_exit.fatal is None
        assert client.in_flight.scheduled_on_worker == {"early", "poison"}
        client.abort("poison")
        assert client.in_flight.scheduled_on_worker == {"early"}
        await client.close()


@module_loop
async def test_a_worker_killed_while_it_steps_leaves_what_it_ran_and_not_what_it_queued(engine_config):
    """One sequence at a time: 'running' decodes, 'queued' waits behind it, 'done' finished before; then SIGKILL."""
    with RuntimeDir.create() as runtime_dir:
        # A long generation (all the KV cache holds), so that it still runs when the kill comes on a loaded machine.
        client = EngineClient(dataclasses.replace(engine_config, max_num_seqs=1, max_model_len=LONG_CONTEXT),
                              runtime_dir.path,
                              supervised=True, start_timeout=START_TIMEOUT_S)
        await client.start()
        done = greedy("done", [4, 5], 3, ignore_eos=True)
        client.add(done)
        await run_to_end(done)
        running = greedy("running", [4, 5, 6], LONG_CONTEXT - 8, ignore_eos=True)
        client.add(running)
        await wait_until_async(lambda: len(running.output_token_ids) >= 3)
        client.add(greedy("queued", [7, 8, 9], 8))
        await wait_until_async(lambda: client.totals.stats.num_waiting == 1)  # the worker holds it
        os.kill(client.worker_pid, signal.SIGKILL)
        await asyncio.wait_for(client.worker_exited.wait(), WAIT_S)
        assert len(running.output_token_ids) < LONG_CONTEXT - 8, "killed mid-generation"
        assert client.in_flight.scheduled_on_worker == {"running"}
        assert set(client.in_flight) == {"running", "queued"}
        await client.close()
