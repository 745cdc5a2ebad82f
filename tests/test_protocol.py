"""The wire protocol: every message kind round-trips, arrays arrive without a copy, bad frames raise ProtocolError.

First on frames handed over in memory (as bytes, as the encoder's own
objects), then over real ZMQ sockets with copy=False on both sides.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path

import numpy as np
import orjson
import pytest
import zmq

from shared.kv_hold import KVHold, KVProgress
from shared.logprobs import TokenLogprobs
from shared.protocol import (
    FAILED,
    REFUSED,
    Abort,
    Add,
    EngineStats,
    Fatal,
    Heartbeat,
    OperatorTime,
    Outputs,
    PrefixCacheReset,
    ProfileResult,
    ProtocolError,
    Ready,
    RequestUpdate,
    ResetPrefixCache,
    Resume,
    Shutdown,
    StartProfile,
    StopProfile,
    decode,
    encode,
)
from shared.sampling_params import SamplingParams
from shared.step_metrics import StepHistograms


def logprobs_for(token_ids: list[int], k: int) -> list[TokenLogprobs]:
    # Values exact in float32, so a round trip through the float32 frames compares equal.
    return [TokenLogprobs(t, -0.25 * (i + 1), [t, *range(100, 100 + k - 1)][:k],
                          [-0.25 * (i + 1) - j for j in range(k)]) for i, t in enumerate(token_ids)]


def prompt_logprobs_for(token_ids: list[int], k: int) -> list[TokenLogprobs]:
    return [dataclasses.replace(lp, rank=i + 1) for i, lp in enumerate(logprobs_for(token_ids, k))]


SECRET = "6f1c0e7a9b2d4c8e5a3f7b1d9c0e2a4b"
STATS = EngineStats(num_running=3, num_waiting=2, kv_cache_usage=0.375, num_preemptions_total=7)
MESSAGES = {
    "add": Add("req-1", [1, 2, 3, 4], SamplingParams(max_tokens=7, min_tokens=2, temperature=0.5, top_k=5,
                                                     logit_bias={17: -3.5, 4: 2.0}, stop_token_ids=(9, 11),
                                                     seed=1234, logprobs=3)),
    "add-requeued": Add("req-2", np.array([5, 6], dtype=np.int32), SamplingParams(max_tokens=3), [7, 8, 9],
                        priority=-2),
    "add-with-kv": Add("req-3", [5, 6, 7], SamplingParams(max_tokens=3), [8],
                       kv=KVHold(np.array([4, 9], dtype=np.int32), np.array([70, 2**40], dtype=np.int64), 3)),
    "resume": Resume([Add("req-2", [5, 6], SamplingParams(max_tokens=3), [7, 8, 9]),
                      Add("req-3", [5, 6, 7], SamplingParams(max_tokens=3, seed=9), [8],
                          kv=KVHold(np.array([4], dtype=np.int32), np.array([70], dtype=np.int64), 3)),
                      Add("req-4", [1], SamplingParams(max_tokens=1))]),
    "resume-nothing": Resume([]),
    "abort": Abort(("req-1", "req-2")),
    "shutdown": Shutdown(),
    "ready": Ready(epoch=2, secret=SECRET, pid=4242, max_model_len=2048, vocab_size=32000, eos_token_ids=(2, 32001),
                   num_kv_blocks=512, block_size=16, device="cuda:0", dtype="bfloat16"),
    "ready-cpu": Ready(epoch=3, secret=SECRET, pid=4243, max_model_len=2048, vocab_size=32000, eos_token_ids=(2,),
                       num_kv_blocks=512, block_size=16, device="cpu", dtype="float32", cpu_threads=8),
    "outputs": Outputs(epoch=2, secret=SECRET, requests=[RequestUpdate("a", [11]), RequestUpdate("b", [12], "stop"),
                                          RequestUpdate("c", [], error="the prompt is too long", error_kind=REFUSED),
                                          RequestUpdate("d", [], "abort"),
                                          RequestUpdate("e", [], error="the engine failed", error_kind=FAILED)],
                       stats=STATS, num_prompt_tokens=40),
    "outputs-logprobs": Outputs(epoch=3, secret=SECRET, stats=STATS, requests=[
        RequestUpdate("a", [11], logprobs=logprobs_for([11], 2)),
        RequestUpdate("b", [12]),
        RequestUpdate("c", [13, 14], "length", logprobs=logprobs_for([13, 14], 0)),
        RequestUpdate("d", [15], logprobs=logprobs_for([15], 4))]),
    "outputs-prompt-logprobs": Outputs(epoch=3, secret=SECRET, stats=STATS, requests=[
        RequestUpdate("a", [], prompt_logprobs=prompt_logprobs_for([5, 6, 7], 2)),  # a first prefill chunk
        RequestUpdate("b", [12]),
        RequestUpdate("c", [13], "length", logprobs=logprobs_for([13], 1),
                      prompt_logprobs=prompt_logprobs_for([8, 9], 0), prompt_logprobs_start=4),
        RequestUpdate("d", [14], prompt_logprobs=[])]),  # a one-token prompt: no position to score
    "outputs-empty": Outputs(epoch=1, secret=SECRET, requests=[], stats=EngineStats()),
    "outputs-without-stats": Outputs(epoch=1, secret=SECRET, requests=[RequestUpdate("a", [11])], stats=None),
    "outputs-scheduled": Outputs(epoch=1, secret=SECRET, requests=[], stats=STATS,
                                 scheduled={"a": 1234.5, "b": 1234.75}),  # first prefill chunks, no token yet
    "outputs-kv-progress": Outputs(epoch=2, secret=SECRET, stats=STATS, requests=[RequestUpdate("a", [11])],
                                   kv_progress=[KVProgress("a", 17, np.array([3, 5], dtype=np.int32),
                                                           np.array([12, 13], dtype=np.int64)),
                                                KVProgress("b", 40),  # a prefill chunk: no token, same table
                                                KVProgress("c", 0, np.empty(0, np.int32), np.empty(0, np.int64))]),
    "heartbeat": Heartbeat(epoch=5, secret=SECRET, stats=STATS),
    "fatal": Fatal(epoch=5, secret=SECRET, message="RuntimeError: CUDA error",
                   traceback="Traceback (most recent call last):\n  ..."),
    "fatal-in-a-step": Fatal(epoch=5, secret=SECRET, message="RuntimeError: CUDA error", traceback="...",
                             request_ids=("req-1", "req-2")),
    "start-profile": StartProfile(),
    "stop-profile": StopProfile("/var/lib/pagedserve/profiles"),
    "profile-result": ProfileResult(epoch=4, secret=SECRET, num_steps=12, seconds=1.5,
                                    table_path="/p/worker-4-20261201T062314.860477Z.txt",
                                    trace_path="/p/worker-4-20261201T062314.860477Z.json",
                                    table="# 12 steps profiled in 1.500 s\n  aten::mm ...\n",
                                    top_operators=[OperatorTime("aten::mm", 96, 812.25),
                                                   OperatorTime("worker step", 12, 0.0)]),
    "profile-result-failed": ProfileResult(epoch=4, secret=SECRET, num_steps=3, seconds=0.25,
                                           error="could not write the profile into /p: Permission denied"),
    "reset-prefix-cache": ResetPrefixCache(),
    "prefix-cache-reset": PrefixCacheReset(epoch=4, secret=SECRET, num_freed_blocks=17),
}


def plain(value: object) -> object:
    """A message as nested plain values (arrays as dtype + list), for comparing two messages."""
    if dataclasses.is_dataclass(value):
        return type(value).__name__, {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, np.ndarray):
        return str(value.dtype), value.tolist()
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


@pytest.mark.parametrize("name", MESSAGES)
def test_round_trip_through_bytes(name):
    msg = MESSAGES[name]
    frames = [bytes(memoryview(frame)) for frame in encode(msg)]
    assert plain(decode(frames)) == plain(msg)


@pytest.mark.parametrize("name", MESSAGES)
def test_round_trip_of_the_encoders_own_frames(name):
    msg = MESSAGES[name]
    assert plain(decode(encode(msg))) == plain(msg)


def test_header_is_json_with_the_kind_and_arrays_are_raw_frames():
    frames = encode(MESSAGES["outputs"])
    header = orjson.loads(frames[0])
    assert header["kind"] == "OUTPUTS" and header["request_ids"] == ["a", "b", "c", "d", "e"]
    assert header["num_new_tokens"] == [1, 1, 0, 0, 0] and header["errors"][2] == "the prompt is too long"
    assert header["error_kinds"] == [None, None, "refused", None, "failed"]
    assert len(frames) == 2, "one concatenated token frame for all requests, not one per request"
    assert frames[1].dtype == np.dtype("<i4") and frames[1].tolist() == [11, 12]


def test_decoded_arrays_are_views_of_the_received_frames():
    add_frames = [bytearray(memoryview(f)) for f in encode(MESSAGES["add-requeued"])]
    add = decode(add_frames)
    assert np.shares_memory(add.prompt_token_ids, np.frombuffer(add_frames[1], np.uint8))
    assert np.shares_memory(add.output_token_ids, np.frombuffer(add_frames[2], np.uint8))
    out_frames = [bytearray(memoryview(f)) for f in encode(MESSAGES["outputs"])]
    outputs = decode(out_frames)
    out_frames[1][0:4] = (99).to_bytes(4, "little")  # writing the frame shows through the decoded view
    assert outputs.requests[0].new_token_ids.tolist() == [99]


def test_derived_counts():
    outputs = MESSAGES["outputs-logprobs"]
    assert outputs.num_generation_tokens == 5
    assert [r.num_top_logprobs for r in outputs.requests] == [2, None, 0, 4]
    assert [r.is_finished for r in MESSAGES["outputs"].requests] == [False, True, True, True, True]


# ----------------------------------------------------------------------------- malformed input


def with_header(frames: list, **changes) -> list:
    header = orjson.loads(bytes(memoryview(frames[0])))
    header.update(changes)
    return [orjson.dumps({k: v for k, v in header.items() if v is not DELETE}), *frames[1:]]


DELETE = object()


@pytest.mark.parametrize("frames, expected", [
    ([], "no frames"),
    ([b"not json"], "JSON"),
    ([b"[1, 2]"], "kind"),
    ([b'{"kind": "EXPLODE"}'], "kind"),
    ([b'{"epoch": 1}'], "kind"),
    (with_header(encode(MESSAGES["heartbeat"]), epoch="5"), "epoch"),
    (with_header(encode(MESSAGES["heartbeat"]), epoch=DELETE), "epoch"),
    (with_header(encode(MESSAGES["heartbeat"]), surprise=1), "surprise"),
    (with_header(encode(MESSAGES["heartbeat"]), secret=DELETE), "secret"),
    (with_header(encode(MESSAGES["heartbeat"]), secret=""), "secret"),
    (with_header(encode(MESSAGES["outputs"]), secret=None), "secret"),
    (with_header(encode(MESSAGES["fatal-in-a-step"]), secret=7), "secret"),
    (with_header(encode(MESSAGES["ready"]), secret=DELETE), "secret"),
    (with_header(encode(MESSAGES["fatal"]), secret=DELETE), "secret"),
    (with_header(encode(MESSAGES["ready"]), eos_token_ids=[2, -1]), "eos_token_ids"),
    (with_header(encode(MESSAGES["abort"]), request_ids=[]), "request_ids"),
    (with_header(encode(MESSAGES["fatal"]), message=None), "message"),
    (with_header(encode(MESSAGES["fatal-in-a-step"]), request_ids="req-1"), "request_ids"),
    (with_header(encode(MESSAGES["abort"]), request_ids=DELETE), "request_ids"),
    (with_header(encode(MESSAGES["fatal-in-a-step"]), request_ids=["req-1", ""]), r"request_ids\[\]"),
    (with_header(encode(MESSAGES["stop-profile"]), profile_dir="profiles"), "absolute path"),
    (with_header(encode(MESSAGES["stop-profile"]), profile_dir=DELETE), "profile_dir"),
    (with_header(encode(MESSAGES["start-profile"]), profile_dir="/p"), "profile_dir"),
    (with_header(encode(MESSAGES["profile-result"]), secret=DELETE), "secret"),
    (with_header(encode(MESSAGES["profile-result"]), num_steps=-1), "num_steps"),
    (with_header(encode(MESSAGES["profile-result"]), seconds="1.5"), "seconds"),
    (with_header(encode(MESSAGES["profile-result"]), seconds=-1.0), "seconds"),
    (with_header(encode(MESSAGES["profile-result"]), table_path=None), "table_path"),
    (with_header(encode(MESSAGES["profile-result"]), top_operators=[["aten::mm", 1, 2.0]]), "list of objects"),
    (with_header(encode(MESSAGES["profile-result"]), top_operators=[{"name": "", "num_calls": 1, "self_cpu_ms": 2}]),
     "name"),
    (with_header(encode(MESSAGES["profile-result"]), top_operators=DELETE), "top_operators"),
    (with_header(encode(MESSAGES["profile-result-failed"]), table_path="/p/x.txt"), "carries no paths"),
    ([*encode(MESSAGES["profile-result"]), b"\0\0\0\0"], "0 array frame"),
    ([*encode(MESSAGES["heartbeat"]), b"\0\0\0\0"], "0 array frame"),
    (encode(MESSAGES["add"])[:2], "2 array frame"),
    ([*encode(MESSAGES["add"])[:2], b"\1\0\0"], "whole int32"),
    ([*encode(MESSAGES["add"])[:2], np.array([-5], np.int32)], "output_token_ids"),
    (with_header(encode(MESSAGES["add"]), params={**dataclasses.asdict(SamplingParams()), "max_tokens": 0}),
     "max_tokens"),
    (with_header(encode(MESSAGES["add"]), params={"max_tokens": 5, "temperature": "hot"}), "temperature"),
    (with_header(encode(MESSAGES["add"]), params={"max_tokens": 5, "warp": 9}), "warp"),
    (with_header(encode(MESSAGES["add"]), request_id=""), "request_id"),
    (with_header(encode(MESSAGES["outputs"]), num_new_tokens=[1, 1, 0, 1, 0]), "add up to 3"),
    (with_header(encode(MESSAGES["outputs"]), finish_reasons=[None]), "one length"),
    (with_header(encode(MESSAGES["outputs"]), error_kinds=DELETE), "error_kinds"),
    (with_header(encode(MESSAGES["outputs"]), errors=["no", None, "x", None, "y"],
                 error_kinds=["failed", None, "refused", None, "failed"]), "ends in an error"),
    (with_header(encode(MESSAGES["outputs"]), error_kinds=[None, None, "refused", None, None]), "come together"),
    (with_header(encode(MESSAGES["outputs"]), error_kinds=[None, None, "refused", None, "exploded"]),
     "error_kind must be one of"),
    (with_header(encode(MESSAGES["outputs"]), stats={"num_running": -1}), "num_running"),
    (with_header(encode(MESSAGES["outputs"]), stats={"kv_cache_usage": 1.5}), "kv_cache_usage"),
    (with_header(encode(MESSAGES["outputs"]), stats=[]), "dict or null"),
    (with_header(encode(MESSAGES["outputs"]), stats=DELETE), "'stats' is missing"),
    (with_header(encode(MESSAGES["outputs-logprobs"]), num_top_logprobs=[2, None, 0, 5]), "shorter"),
    (with_header(encode(MESSAGES["outputs-logprobs"]), num_top_logprobs=[2, None, 0, 3]), "accounts for"),
    (encode(MESSAGES["outputs-logprobs"])[:3], "4 array frame"),
    (with_header(encode(MESSAGES["outputs"]), num_top_logprobs=[1, None, None, None, None]), "4 array frame"),
    (with_header(encode(MESSAGES["outputs-kv-progress"]), kv_table_lengths=[3, -1, 0]), "do not match"),
    (with_header(encode(MESSAGES["outputs-kv-progress"]), kv_num_computed=[17, 40]), "one length"),
    (encode(MESSAGES["outputs-kv-progress"])[:3], "3 array frame"),
    (with_header(encode(MESSAGES["add-with-kv"]), kv_num_computed=-1), "num_computed"),
    (encode(MESSAGES["add-with-kv"])[:4], "4 array frame"),
    (with_header(encode(MESSAGES["resume"]), num_frames=[2, 4, 1]), "add up to 7"),
], ids=lambda value: None if isinstance(value, list) else value)
def test_malformed_frames_raise_protocol_error(frames, expected):
    with pytest.raises(ProtocolError, match=expected):
        decode(frames)


def test_every_truncation_of_a_token_frame_is_rejected():
    frames = [bytes(memoryview(f)) for f in encode(MESSAGES["outputs"])]
    for cut in range(len(frames[1])):
        with pytest.raises(ProtocolError):
            decode([frames[0], frames[1][:cut]])
    with pytest.raises(ProtocolError):
        decode([frames[0], frames[1] + b"\0\0\0\0"])  # trailing data


def histograms_with(count: object) -> dict:
    """Step histograms on the wire, one count of the first replaced by `count`."""
    wire = StepHistograms().to_wire()
    name = next(iter(wire))
    wire[name][1] = count
    return wire


@pytest.mark.parametrize("build, expected", [
    (lambda: Add("r", [1.5, 2], SamplingParams()), "integer token ids"),
    (lambda: Add("r", [True], SamplingParams()), "integer token ids"),
    (lambda: Add("r", [[1, 2]], SamplingParams()), "1-D"),
    (lambda: Add("r", [2**31], SamplingParams()), "token ids in"),
    (lambda: Add("r", [1], {"max_tokens": 3}), "SamplingParams"),
    (lambda: RequestUpdate("r", np.array([-1], dtype=np.int32)), "token ids >= 0"),  # one token: read, not reduced
    (lambda: RequestUpdate("r", np.array([3, -2, 5], dtype=np.int32)), "token ids >= 0"),
    (lambda: EngineStats(step_histograms=histograms_with(True)), "counts >= 0"),
    (lambda: EngineStats(step_histograms=histograms_with(-1)), "counts >= 0"),
    (lambda: EngineStats(step_histograms=histograms_with(1.0)), "counts >= 0"),
    (lambda: RequestUpdate("r", [1], error="refused", error_kind=REFUSED), "ends in an error"),
    (lambda: RequestUpdate("r", [], error="refused"), "come together"),
    (lambda: RequestUpdate("r", [1, 2], logprobs=logprobs_for([1], 1)), "one entry per new token"),
    (lambda: RequestUpdate("r", [1, 2], logprobs=[*logprobs_for([1], 1), *logprobs_for([2], 2)]), "same number"),
    (lambda: Outputs(1, SECRET, [("r", [1])], STATS), "RequestUpdate"),
    (lambda: Ready(-1, SECRET, 1, 2, 3, (2,), 4, 16, "cpu", "float32"), "epoch"),
    (lambda: Ready(1, SECRET, 1, 2, 3, (2,), 4, 16, "cpu", "float32", cpu_threads=-2), "cpu_threads"),
    (lambda: Heartbeat(1, "", STATS), "secret"),
    (lambda: StopProfile("profiles"), "absolute path"),
    (lambda: PrefixCacheReset(1, SECRET, -1), "num_freed_blocks"),
    (lambda: OperatorTime("aten::mm", 1, -1.0), "self_cpu_ms"),
    (lambda: ProfileResult(1, SECRET, 0, 0.0, table_path="/p/x.txt"), "trace_path"),
    (lambda: ProfileResult(1, SECRET, 0, 0.0, "/p/x.txt", "/p/x.json", top_operators=[("aten::mm", 1, 2.0)]),
     "OperatorTime"),
])
def test_messages_validate_on_construction(build, expected):
    with pytest.raises(ValueError, match=expected):
        build()


def test_encode_refuses_what_is_not_a_message():
    with pytest.raises(TypeError, match="protocol message"):
        encode(STATS)


# ----------------------------------------------------------------------------- over real sockets


@pytest.fixture
def socket_pair():
    """A PUSH bound on an ipc:// socket in a short private directory, and a PULL connected to it."""
    directory = Path(tempfile.mkdtemp(prefix="proto-"))
    context = zmq.Context()
    push, pull = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    push.bind(f"ipc://{directory}/sock")
    pull.connect(f"ipc://{directory}/sock")
    pull.setsockopt(zmq.RCVTIMEO, 5000)
    yield push, pull
    push.close(linger=0)
    pull.close(linger=0)
    context.term()
    shutil.rmtree(directory)


def test_every_kind_round_trips_over_zmq_without_a_copy(socket_pair):
    push, pull = socket_pair
    big = Add("big", np.arange(50_000, dtype=np.int32) % 30_000, SamplingParams(max_tokens=4),
              np.arange(30_000, dtype=np.int32))  # large enough that ZMQ does not copy it on send either
    for msg in [*MESSAGES.values(), big]:
        push.send_multipart(encode(msg), copy=False)
        frames = pull.recv_multipart(copy=False)
        received = decode(frames)
        assert plain(received) == plain(msg)
        for array, frame in _array_frames(received, frames):
            assert np.shares_memory(array, np.frombuffer(frame.buffer, np.uint8))
            assert _backing_object(array) is frame


def _array_frames(msg, frames) -> list:
    """(decoded array, the frame it came in) for every non-empty array of the message."""
    pairs = []
    if isinstance(msg, Add):
        pairs = [(msg.prompt_token_ids, frames[1]), (msg.output_token_ids, frames[2])]
    elif isinstance(msg, Outputs):
        pairs = [(r.new_token_ids, frames[1]) for r in msg.requests]
    return [(array, frame) for array, frame in pairs if array.size]


def _backing_object(array: np.ndarray) -> object:
    """Follow the base chain: a slice -> the frame's array -> the memoryview -> the object it views."""
    base = array
    while isinstance(base, np.ndarray):
        base = base.base
    return base.obj if isinstance(base, memoryview) else base


@pytest.mark.parametrize("finish_reason", [None, "stop", "length"])
def test_the_engines_unchecked_update_is_the_checked_one(finish_reason):
    """RequestUpdate.sampled skips __post_init__'s checks: every field it sets equals the constructor's, and one
    added to the dataclass and not set there fails here."""
    step_tokens = np.array([7, 4095, 9], dtype=np.int32)  # the engine hands each request its row of these
    fast = RequestUpdate.sampled("r-1", step_tokens[1:2], finish_reason)
    checked = RequestUpdate("r-1", [4095], finish_reason)
    for field in dataclasses.fields(RequestUpdate):
        got, expected = getattr(fast, field.name), getattr(checked, field.name)
        if isinstance(expected, np.ndarray):
            assert got.dtype == expected.dtype and np.array_equal(got, expected)
        else:
            assert got == expected, field.name
    decoded = decode(encode(Outputs(0, "s", [fast], EngineStats())))
    assert decoded.requests[0].new_token_ids.tolist() == [4095]
