"""Faults inside a real worker process, injected with $PAGEDSERVE_FAULT (gpu_worker/fault_injection.py).

A request whose sampling raises fails alone, as a server error, and the
worker serves on.
"""

from __future__ import annotations

import asyncio

from server.engine_client import EngineClient
from server.runtime_dir import RuntimeDir
from shared.sampling_params import SamplingParams

from test_worker_process import START_TIMEOUT_S, greedy, module_loop, run_to_end
from test_worker_process import engine_config  # noqa: F401 - a fixture: the same tiny checkpoint and config


@module_loop
async def test_a_request_whose_sampling_raises_fails_alone_and_the_worker_serves_on(engine_config, monkeypatch):
    from gpu_worker.engine import Engine, generate  # torch, in the test process only

    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    expected = [c.token_ids for c in generate(Engine(engine_config), prompts, SamplingParams(max_tokens=12,
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
