"""WorkerLoop in-process: a real Engine between two inproc ZMQ sockets, the loop in a thread.

What the frontend can know and when: every request is noted in the worker's
scheduled ledger before the Outputs of its first step, and only once, so a
steady decode writes nothing to it. The stats come with the Outputs of a
step where a request started or finished, and between those now and then
only.
A ResetPrefixCache is answered once the cache is empty.
"""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from shared.config import EngineConfig
from shared.protocol import Add, Heartbeat, Outputs, PrefixCacheReset, ResetPrefixCache, Shutdown, decode, encode
from shared.sampling_params import SamplingParams
from shared.scheduled_ledger import ScheduledLedger, read_ledger

RECEIVE_TIMEOUT_MS = 20_000
SECRET = "0123456789abcdef0123456789abcdef"


@pytest.fixture(scope="module")
def engine(checkpoint):
    from gpu_worker.engine.engine import Engine

    return Engine(EngineConfig(model=str(checkpoint), dtype="float32", block_size=4, num_kv_blocks=64,
                               max_num_batched_tokens=32, max_num_seqs=2))


@pytest.fixture
def frontend(engine, tmp_path):
    """(send, receive, ledger path) on the frontend's side of a WorkerLoop that runs in a thread until Shutdown."""
    from gpu_worker.process.worker_loop import WorkerLoop

    context = zmq.Context()
    to_worker, from_worker = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    to_worker.bind("inproc://input")
    from_worker.bind("inproc://output")
    inbox, outbox = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    inbox.connect("inproc://input")
    outbox.connect("inproc://output")
    ledger = ScheduledLedger(tmp_path / "scheduled-3")
    loop = WorkerLoop(engine, inbox, outbox, ledger, epoch=3, secret=SECRET)
    thread = threading.Thread(target=loop.run)
    thread.start()
    from_worker.setsockopt(zmq.RCVTIMEO, RECEIVE_TIMEOUT_MS)
    yield ((lambda msg: to_worker.send_multipart(encode(msg))), (lambda: decode(from_worker.recv_multipart())),
           ledger.path)
    to_worker.send_multipart(encode(Shutdown()))
    thread.join()
    ledger.close()
    for socket in (to_worker, from_worker, inbox, outbox):
        socket.close(linger=0)
    context.term()


def outputs_until_finished(receive, request_ids: set[str], ledger_path) -> int:
    """Receive until every one of request_ids has finished; returns how many Outputs came. Each names only
    requests that the ledger already held when it arrived."""
    num_outputs, unfinished = 0, set(request_ids)
    while unfinished:
        msg = receive()
        if isinstance(msg, Outputs):
            num_outputs += 1
            assert (msg.epoch, msg.secret) == (3, SECRET)
            noted = read_ledger(ledger_path)
            assert all(u.request_id in noted for u in msg.requests), f"an output before its request was noted: {msg}"
            unfinished -= {u.request_id for u in msg.requests if u.is_finished}
    return num_outputs


def test_each_request_is_noted_once_before_its_first_output(frontend):
    send, receive, ledger_path = frontend
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    for request_id, prompt in (("a", [5, 6, 7]), ("b", [8, 9]), ("c", [10, 11, 12, 13])):  # c waits: 2 seqs at most
        send(Add(request_id, prompt, params))
    num_outputs = outputs_until_finished(receive, {"a", "b", "c"}, ledger_path)
    assert num_outputs >= 20  # c decodes after a and b: twenty steps or more
    assert sorted(read_ledger(ledger_path)) == ["a", "b", "c"], "each request noted once, none in a steady decode"

    send(Add("a", [5, 6, 7], params))  # an id that finished is noted again when it comes back
    outputs_until_finished(receive, {"a"}, ledger_path)
    assert read_ledger(ledger_path)[3:] == ["a"]


def test_each_request_is_reported_scheduled_once_with_the_start_of_its_first_step(frontend):
    send, receive, _ = frontend
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    added = time.monotonic()
    for request_id, prompt in (("a", [5, 6, 7]), ("b", [8, 9]), ("c", [10, 11, 12, 13])):  # c waits: 2 seqs at most
        send(Add(request_id, prompt, params))
    scheduled: dict[str, list[float]] = {}
    first_output: dict[str, float] = {}
    unfinished = {"a", "b", "c"}
    while unfinished:  # to the end, so that the next test's engine is idle
        msg = receive()
        if not isinstance(msg, Outputs):
            continue
        for request_id, started in msg.scheduled.items():
            scheduled.setdefault(request_id, []).append(started)
        for update in msg.requests:
            first_output.setdefault(update.request_id, time.monotonic())
            if update.is_finished:
                unfinished.discard(update.request_id)
    assert all(len(times) == 1 for times in scheduled.values()), scheduled
    for request_id in "abc":
        assert added <= scheduled[request_id][0] <= first_output[request_id]
    assert scheduled["c"][0] > max(scheduled["a"][0], scheduled["b"][0]), "c ran once a or b had finished"


def test_outputs_carry_the_stats_when_requests_start_or_finish_and_otherwise_now_and_then(frontend):
    send, receive, _ = frontend
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    for request_id, prompt in (("a", [5, 6, 7]), ("b", [8, 9]), ("c", [10, 11, 12, 13])):  # c waits: 2 seqs at most
        send(Add(request_id, prompt, params))
    outputs: list[Outputs] = []
    unfinished = {"a", "b", "c"}
    while unfinished:
        msg = receive()
        if isinstance(msg, Outputs):
            outputs.append(msg)
            unfinished -= {u.request_id for u in msg.requests if u.is_finished}
    assert all(msg.stats is not None for msg in outputs if msg.scheduled or any(u.is_finished for u in msg.requests))
    last = outputs[-1].stats
    assert last is not None and (last.num_running, last.num_waiting) == (0, 0), "the idle engine's counts are exact"
    with_stats = [msg.stats for msg in outputs if msg.stats is not None]
    assert len(with_stats) < len(outputs) / 2, f"{len(with_stats)} of {len(outputs)} steps' Outputs carried stats"

    send(Add("d", [5, 6, 7], SamplingParams(max_tokens=1, temperature=0)))  # starts and ends in one step
    while not isinstance(msg := receive(), Outputs):
        pass
    assert msg.requests[0].is_finished and msg.stats is not None
    assert msg.stats.prefix_cache_queries_total > last.prefix_cache_queries_total


def test_a_prefix_cache_reset_empties_the_cache_and_is_answered(frontend, engine):
    send, receive, ledger_path = frontend
    send(Add("cached", list(range(5, 15)), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)))
    outputs_until_finished(receive, {"cached"}, ledger_path)
    assert engine.block_manager.prefix_cache.num_cached_blocks > 0
    num_parked = engine.block_manager.prefix_cache.num_evictable
    send(ResetPrefixCache())
    answer = receive()
    while isinstance(answer, Heartbeat):
        answer = receive()
    assert isinstance(answer, PrefixCacheReset) and (answer.epoch, answer.secret) == (3, SECRET)
    assert answer.num_freed_blocks == num_parked > 0
    assert engine.block_manager.prefix_cache.num_cached_blocks == 0
