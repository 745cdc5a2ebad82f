"""WorkerLoop in-process: a real Engine between two inproc ZMQ sockets, the loop in a thread.

What the frontend is told and when: every request is named in a Scheduled
message before the Outputs of its first step, and only once, so a steady
decode sends no Scheduled at all.
"""

from __future__ import annotations

import threading

import pytest
import zmq

from shared.config import EngineConfig
from shared.protocol import Add, Outputs, Scheduled, Shutdown, decode, encode
from shared.sampling_params import SamplingParams

from checkpoints import make_checkpoint

RECEIVE_TIMEOUT_MS = 20_000
SECRET = "0123456789abcdef0123456789abcdef"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from gpu_worker.engine import Engine

    checkpoint = make_checkpoint(tmp_path_factory.mktemp("loop"), arch="llama")
    return Engine(EngineConfig(model=str(checkpoint), dtype="float32", block_size=4, num_kv_blocks=64,
                               max_num_batched_tokens=32, max_num_seqs=2))


@pytest.fixture
def frontend(engine):
    """(send, receive) on the frontend's side of a WorkerLoop that runs in a thread until Shutdown."""
    from gpu_worker.worker_loop import WorkerLoop

    context = zmq.Context()
    to_worker, from_worker = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    to_worker.bind("inproc://input")
    from_worker.bind("inproc://output")
    inbox, outbox = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    inbox.connect("inproc://input")
    outbox.connect("inproc://output")
    loop = WorkerLoop(engine, inbox, outbox, epoch=3, secret=SECRET)
    thread = threading.Thread(target=loop.run)
    thread.start()
    from_worker.setsockopt(zmq.RCVTIMEO, RECEIVE_TIMEOUT_MS)
    yield (lambda msg: to_worker.send_multipart(encode(msg))), (lambda: decode(from_worker.recv_multipart()))
    to_worker.send_multipart(encode(Shutdown()))
    thread.join()
    for socket in (to_worker, from_worker, inbox, outbox):
        socket.close(linger=0)
    context.term()


def receive_until_finished(receive, request_ids: set[str]) -> list:
    """Scheduled and Outputs messages (heartbeats left out) until every one of request_ids has finished."""
    messages, unfinished = [], set(request_ids)
    while unfinished:
        msg = receive()
        if isinstance(msg, (Scheduled, Outputs)):
            messages.append(msg)
        if isinstance(msg, Outputs):
            unfinished -= {u.request_id for u in msg.requests if u.is_finished}
    return messages


def test_each_request_is_announced_once_before_its_first_output(frontend):
    send, receive = frontend
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    for request_id, prompt in (("a", [5, 6, 7]), ("b", [8, 9]), ("c", [10, 11, 12, 13])):  # c waits: 2 seqs at most
        send(Add(request_id, prompt, params))
    messages = receive_until_finished(receive, {"a", "b", "c"})

    announced, num_outputs = [], 0
    for msg in messages:
        if isinstance(msg, Scheduled):
            assert (msg.epoch, msg.secret) == (3, SECRET)
            announced.extend(msg.request_ids)
        else:
            num_outputs += 1
            assert {u.request_id for u in msg.requests} <= set(announced), "an output before its Scheduled"
    assert sorted(announced) == ["a", "b", "c"], "each request is named exactly once"
    assert num_outputs >= 20  # c decodes after a and b: twenty steps or more, and three Scheduled at most

    send(Add("a", [5, 6, 7], params))  # an id that finished is named again when it comes back
    messages = receive_until_finished(receive, {"a"})
    assert [m.request_ids for m in messages if isinstance(m, Scheduled)] == [("a",)]
