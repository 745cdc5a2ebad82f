"""Running out of file descriptors around a worker restart: the frontend refuses the start, and never aborts.

A client holding many connections can use up RLIMIT_NOFILE. A worker start
then fails (sockets, pipes), and worse, libzmq aborts the whole process when
its ipc listener's accept() meets EMFILE. Here a real EngineClient with a
real worker runs in a subprocess under `ulimit -n 256`; the script exhausts
the descriptors with /dev/null, has another process connect where the
sockets were, kills the worker and tries to start another.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

from server.worker.process import START_DESCRIPTOR_RESERVE

RLIMIT_NOFILE = 256
CONNECT = """
import socket, sys
sys.stdin.readline()
try:
    socket.socket(socket.AF_UNIX).connect(sys.argv[1])
    print("connected", flush=True)
except OSError as exc:
    print(type(exc).__name__, flush=True)
"""
SCRIPT = """
import asyncio, json, os, resource, signal, subprocess, sys
from server.worker.engine_client import EngineClient
from server.worker.request_state import RequestState
from server.worker.runtime_dir import RuntimeDir
from server.worker.process import WorkerStartError
from shared.config import EngineConfig
from shared.sampling_params import SamplingParams

resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[2]), resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
num_free_to_try = json.loads(sys.argv[3])

async def generate(client, request_id):
    state = RequestState(request_id, [5, 6, 7], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    client.add(state)
    while not state.is_finished:
        await asyncio.wait_for(state.wait_for_update(), 20)
    return state.output_token_ids

async def try_start(client):
    try:
        await client.start()
        return "started"
    except WorkerStartError as exc:
        return {"out_of_descriptors": exc.out_of_descriptors, "message": str(exc)}

def exhaust_now():
    held = []
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        return held

async def exhaust():
    # libzmq's reaper thread and the loop's transports close some descriptors a moment after a failed start or
    # a dead worker: take those too once they are free, so the next start sees exactly the number this frees.
    held = exhaust_now()
    await asyncio.sleep(0.5)
    return held + exhaust_now()

async def main():
    report = {}
    with RuntimeDir.create() as runtime_dir:
        client = EngineClient(EngineConfig(**json.loads(sys.argv[1])), runtime_dir.path,
                              supervised=True, start_timeout=60)
        await client.start()
        report["socket_files"] = sorted(path.name for path in runtime_dir.path.iterdir() if path.is_socket())
        connector = subprocess.Popen([sys.executable, "-c", sys.argv[4], str(runtime_dir.path / "output")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        held = await exhaust()
        connector.stdin.write("go\\n")
        connector.stdin.flush()
        report["connect_while_exhausted"] = connector.stdout.readline().strip()
        await asyncio.sleep(0.5)  # time for libzmq to accept the connection, were there a listener
        report["served_while_exhausted"] = await generate(client, "while-exhausted")
        os.kill(client.worker_pid, signal.SIGKILL)
        await client.worker_exited.wait()
        report["starts"] = {}
        for num_free in num_free_to_try:
            for fd in held[len(held) - num_free:]:
                os.close(fd)
            report["starts"][num_free] = await try_start(client)
            held = held[:len(held) - num_free] + await exhaust()
        for fd in held:
            os.close(fd)
        report["start_once_freed"] = await try_start(client)
        report["served_after"] = await generate(client, "after")
        await client.close()
    print(json.dumps(report))

asyncio.run(main())
"""


def test_a_start_without_descriptors_fails_with_out_of_descriptors_and_the_next_succeeds(engine_config):
    num_free_to_try = [0, 3, 8, START_DESCRIPTOR_RESERVE - 1]
    finished = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(dataclasses.asdict(engine_config)),
                               str(RLIMIT_NOFILE), json.dumps(num_free_to_try), CONNECT],
                              capture_output=True, text=True, timeout=180)
    assert finished.returncode == 0, finished.stderr[-3000:]
    report = json.loads(finished.stdout.splitlines()[-1])
    assert report["socket_files"] == [], "no socket file left to connect to once the worker is connected"
    assert report["connect_while_exhausted"] == "FileNotFoundError"
    assert len(report["served_while_exhausted"]) == 4, "a running worker needs no new descriptor"
    for num_free, outcome in report["starts"].items():
        assert outcome != "started" and outcome["out_of_descriptors"], (num_free, outcome)
    assert report["start_once_freed"] == "started"
    assert report["served_after"] == report["served_while_exhausted"]
