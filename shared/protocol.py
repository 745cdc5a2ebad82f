"""The wire protocol between the frontend and the worker: one dataclass per message kind, one codec.

Sans-I/O: `encode(msg)` returns the frames of one multipart ZMQ message and
`decode(frames)` turns received frames back into a message; neither touches a
socket. Frame 0 is an orjson header, `{"kind": ..., small fields}`. Token ids
and logprobs never go through JSON: they follow as raw little-endian int32 /
float32 frames, meant to be sent with `copy=False`; `decode` reads them with
`np.frombuffer` on the received frames' memory, so neither side copies them.
Anything malformed raises ProtocolError, saying what was expected.

Frontend -> worker: Add, Resume, Abort, Shutdown, StartProfile, StopProfile,
ResetPrefixCache.
Worker -> frontend: Ready, Outputs, Heartbeat, Fatal, ProfileResult,
PrefixCacheReset. Each
carries the worker's epoch (one per worker start) and its secret: a random
string the frontend draws for each start and hands to that worker on its
stdin, never on its command line (which any local user can read). The
frontend drops a message without both, so neither a dead worker's late
messages nor those of another process that reaches the socket count.

Which requests a failure can be blamed on: a Fatal raised in a step names
that step's requests. A worker that hangs or is killed says nothing more,
and a message sent just before such a death is often lost; the requests it
ran are in its scheduled ledger, a file and no message
(shared/scheduled_ledger.py).

A request the worker refuses (Engine.add_request raised ValueError, e.g. a
prompt longer than max_model_len) comes back as an Outputs entry with `error`
set, `error_kind` REFUSED and no tokens; one whose sampling or update raised
inside a step, likewise with `error_kind` FAILED. Either way that request is
over and the worker carries on.

Profiling (POST /start_profile, /stop_profile): StartProfile turns the
profiler on around the worker's steps; StopProfile turns it off and names the
directory the profile goes to, and the worker answers it with one
ProfileResult: where the files went and the operator table, or `error` when
they could not be written. A profile lives and dies with its worker: there
is no message to say one was lost, the frontend learns it from the exit.

POST /reset_prefix_cache: ResetPrefixCache has the worker forget every
cached prefix between two steps; it answers each with one PrefixCacheReset,
in the order they came (one socket each way keeps it), once done.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeAlias, Union, cast

import numpy as np
import orjson

from shared.kv_hold import KVHold, KVProgress
from shared.logprobs import TokenLogprobs
from shared.sampling_params import SamplingParams
from shared.step_metrics import STEP_COST_TERMS, StepHistograms
from shared.wire import (
    BLOCK_ID_DTYPE,
    BLOCK_SERIAL_DTYPE,
    LOGPROB_DTYPE,
    TOKEN_DTYPE,
    as_token_ids,
    check_float,
    check_int,
    check_request_ids,
    check_str,
    empty_token_ids,
    frames_as_arrays,
    pack_logprobs,
    pack_prompt_logprobs,
    split_by_counts,
    take,
    unpack_logprobs,
    unpack_prompt_logprobs,
)

if TYPE_CHECKING:
    import zmq
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12 on

# A frame is anything with the buffer protocol: bytes, memoryview, np.ndarray, zmq.Frame. zmq.Frame is named because
# pyzmq's stubs do not declare its buffer protocol; numpy's declare it only from Python 3.12 on, so encode says it.
Frame: TypeAlias = "Buffer | zmq.Frame"
Header: TypeAlias = "dict[str, Any]"  # a decoded JSON header: its values are checked by each message's __post_init__
REFUSED = "refused"  # the engine would not take the request (add_request raised ValueError): the request is at fault
FAILED = "failed"  # the request failed inside a step (its sampling or update raised): the server is at fault
ERROR_KINDS = (REFUSED, FAILED)


class ProtocolError(ValueError):
    """Frames that are not a well-formed message of a known kind."""


class _HeaderOnly:
    """Wire form of a message whose fields all fit in the JSON header."""

    __slots__ = ()
    # What each subclass, a dataclass with a KIND of its own, has; declared here for the type checker.
    KIND: ClassVar[str]
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field]]

    def _to_wire(self) -> tuple[Header, list[np.ndarray]]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, []

    @classmethod
    def _from_wire(cls, header: Header, frames: list[memoryview]):
        frames_as_arrays(cls.KIND, frames, ())
        return cls(**header)


# ----------------------------------------------------------------------------- frontend -> worker


@dataclass(slots=True, eq=False)
class Add:
    """Queue a request. A re-queued request (after a worker death) carries the tokens it already has,
    and `params.max_tokens` / `params.min_tokens` count only what remains to generate; with a shared KV
    cache, also the blocks that hold its KV (`kv`), for the new worker to adopt rather than recompute."""

    KIND: ClassVar[str] = "ADD"
    request_id: str
    prompt_token_ids: np.ndarray  # int32 [num_prompt_tokens]; lists are converted
    params: SamplingParams
    output_token_ids: np.ndarray = field(default_factory=empty_token_ids)  # int32 [num_output_tokens]
    priority: int = 0
    kv: KVHold | None = None

    def __post_init__(self) -> None:
        check_str("request_id", self.request_id)
        self.prompt_token_ids = as_token_ids("prompt_token_ids", self.prompt_token_ids)
        self.output_token_ids = as_token_ids("output_token_ids", self.output_token_ids)
        if not isinstance(self.params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(self.params).__name__}")
        check_int("priority", self.priority, minimum=None)
        if self.kv is not None and not isinstance(self.kv, KVHold):
            raise ValueError(f"kv must be a KVHold, got {type(self.kv).__name__}")

    def _to_wire(self) -> tuple[Header, list[np.ndarray]]:
        params = dataclasses.asdict(self.params)
        params["logit_bias"] = list(self.params.logit_bias.items())  # pairs: JSON object keys would be strings
        header = {"request_id": self.request_id, "priority": self.priority, "params": params,
                  "kv_num_computed": None if self.kv is None else self.kv.num_computed}
        kv_frames = [] if self.kv is None else [self.kv.block_ids, self.kv.serials]
        return header, [self.prompt_token_ids, self.output_token_ids, *kv_frames]

    @classmethod
    def _from_wire(cls, header: Header, frames: list[memoryview]) -> Add:
        num_computed = header.pop("kv_num_computed", None)
        dtypes = (TOKEN_DTYPE, TOKEN_DTYPE) + (() if num_computed is None else (BLOCK_ID_DTYPE, BLOCK_SERIAL_DTYPE))
        prompt, output, *kv_arrays = frames_as_arrays(cls.KIND, frames, dtypes)
        kv = None if num_computed is None else KVHold(kv_arrays[0], kv_arrays[1], num_computed)
        params = take(header, "params", dict)
        params["logit_bias"] = {token_id: bias for token_id, bias in params.get("logit_bias", [])}
        return cls(header.pop("request_id", None), prompt, SamplingParams(**params), output,
                   header.pop("priority", 0), kv, **header)


@dataclass(slots=True, eq=False)
class Resume:
    """The requests in flight, re-sent at once to a worker that takes over from a dead one.

    One message, so that the new worker adopts every request's KV blocks before
    its first step hands any block out again."""

    KIND: ClassVar[str] = "RESUME"
    adds: list[Add]

    def __post_init__(self) -> None:
        if not isinstance(self.adds, list) or not all(isinstance(add, Add) for add in self.adds):
            raise ValueError("adds must be a list of Add")

    def _to_wire(self) -> tuple[Header, list[np.ndarray]]:
        wires = [add._to_wire() for add in self.adds]
        return ({"adds": [header for header, _ in wires], "num_frames": [len(frames) for _, frames in wires]},
                [frame for _, frames in wires for frame in frames])

    @classmethod
    def _from_wire(cls, header: Header, frames: list[memoryview]) -> Resume:
        headers, counts = take(header, "adds", list), take(header, "num_frames", list)
        if len(headers) != len(counts) or not all(isinstance(h, dict) for h in headers):
            raise ValueError("adds and num_frames must be lists of one length, of headers and frame counts")
        for count in counts:
            check_int("num_frames[]", count)
        if sum(counts) != len(frames):
            raise ValueError(f"num_frames add up to {sum(counts)} but the message has {len(frames)} array frames")
        bounds = np.cumsum([0, *counts]).tolist()
        adds = [Add._from_wire(dict(h), frames[start:end]) for h, start, end in zip(headers, bounds, bounds[1:])]
        return cls(adds, **header)


@dataclass(slots=True)
class Abort(_HeaderOnly):
    KIND: ClassVar[str] = "ABORT"
    request_ids: tuple[str, ...]

    def __post_init__(self) -> None:
        self.request_ids = check_request_ids("request_ids", self.request_ids, allow_empty=False)


@dataclass(slots=True)
class Shutdown(_HeaderOnly):
    """Stop now: the worker exits without finishing its requests (draining is the frontend's job)."""

    KIND: ClassVar[str] = "SHUTDOWN"


@dataclass(slots=True)
class StartProfile(_HeaderOnly):
    """Profile the steps from now on, until a StopProfile; the worker ignores it when it already profiles."""

    KIND: ClassVar[str] = "START_PROFILE"


@dataclass(slots=True)
class StopProfile(_HeaderOnly):
    """Stop profiling, write the profile into `profile_dir` (created 0700 if missing), answer a ProfileResult."""

    KIND: ClassVar[str] = "STOP_PROFILE"
    profile_dir: str  # absolute: the worker needs no configuration of its own for it

    def __post_init__(self) -> None:
        check_str("profile_dir", self.profile_dir)
        if not self.profile_dir.startswith("/"):
            raise ValueError(f"profile_dir must be an absolute path, got {self.profile_dir!r:.200}")


@dataclass(slots=True)
class ResetPrefixCache(_HeaderOnly):
    """Forget every cached prefix (the blocks running requests hold stay theirs), answer a PrefixCacheReset."""

    KIND: ClassVar[str] = "RESET_PREFIX_CACHE"


# ----------------------------------------------------------------------------- worker -> frontend


@dataclass(slots=True)
class EngineStats:
    """The engine's gauges, sent with every Outputs and Heartbeat (for /metrics and /health)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, in [0, 1]
    num_preemptions_total: int = 0  # since this worker started
    prefix_cache_queries_total: int = 0  # tokens of admitted requests looked up in the prefix cache
    prefix_cache_hits_total: int = 0  # of those, tokens whose KV came from the cache
    num_cached_blocks: int = 0  # full blocks the prefix cache knows, referenced or not
    step_histograms: dict = field(default_factory=dict)  # StepHistograms.to_wire() since this worker started
    step_cost: dict = field(default_factory=dict)  # the step-cost model's coefficients, seconds per unit of each term
    num_adopted_tokens_total: int = 0  # of requests resumed from a dead worker: positions it computed, adopted
    num_recomputed_tokens_total: int = 0  # ... and positions it computed that are computed again
    num_block_audit_failures_total: int = 0  # idle block audits that found a block neither free nor cached
    cpu_threads: int = 0  # the worker's compute threads on the CPU now (0 on a GPU): fewer while its CPUs are contended
    # The worker's resident memory (gpu_worker/process/memory_report.py), in bytes: the whole, what explains it, the rest.
    rss_bytes: int = 0
    weights_bytes: int = 0
    kv_cache_bytes: int = 0
    allocator_cache_bytes: int = 0
    unexplained_bytes: int = 0
    cuda_allocated_bytes: int = 0  # device memory, beside the RSS: torch's allocated and reserved bytes
    cuda_reserved_bytes: int = 0

    # The counts since the worker started, which the frontend carries over worker restarts.
    CUMULATIVE: ClassVar[tuple[str, ...]] = ("num_preemptions_total", "prefix_cache_queries_total",
                                             "prefix_cache_hits_total", "num_adopted_tokens_total",
                                             "num_recomputed_tokens_total", "num_block_audit_failures_total")
    MEMORY: ClassVar[tuple[str, ...]] = ("rss_bytes", "weights_bytes", "kv_cache_bytes", "allocator_cache_bytes",
                                         "unexplained_bytes", "cuda_allocated_bytes", "cuda_reserved_bytes")

    def __post_init__(self) -> None:
        for name in ("num_running", "num_waiting", "num_cached_blocks", "cpu_threads", *self.CUMULATIVE, *self.MEMORY):
            check_int(name, getattr(self, name))
        check_float("kv_cache_usage", self.kv_cache_usage, 0.0, 1.0)
        if self.step_histograms:
            StepHistograms.from_wire(self.step_histograms)
        if not isinstance(self.step_cost, dict) or set(self.step_cost) - set(STEP_COST_TERMS):
            raise ValueError(f"step_cost must map terms of {STEP_COST_TERMS} to seconds, got {self.step_cost!r:.100}")
        for term, seconds in self.step_cost.items():
            check_float(f"step_cost[{term!r}]", seconds, 0.0, math.inf)

    def to_wire(self) -> dict:
        """The fields as a header dict. Shallow, unlike dataclasses.asdict, whose deep copy of the histograms' lists
        cost more than the rest of an Outputs message."""
        return {name: getattr(self, name) for name in self.__slots__}

    def histograms(self) -> StepHistograms:
        """The step histograms, zeros before the worker's first stats."""
        return StepHistograms.from_wire(self.step_histograms) if self.step_histograms else StepHistograms()


@dataclass(slots=True)
class Ready(_HeaderOnly):
    """The model is loaded and warmed up; the facts the frontend validates requests against."""

    KIND: ClassVar[str] = "READY"
    epoch: int
    secret: str = field(repr=False)  # kept out of logs
    pid: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    num_kv_blocks: int
    block_size: int
    device: str
    dtype: str
    kv_shared: bool = False  # its KV cache is the shared-memory segment: it reports and adopts KV holds
    cpu_threads: int = 0  # its compute threads on the CPU (0 on a GPU), which the frontend gives the workers after it

    def __post_init__(self) -> None:
        for name in ("epoch", "pid", "max_model_len", "vocab_size", "num_kv_blocks", "block_size", "cpu_threads"):
            check_int(name, getattr(self, name))
        check_str("secret", self.secret)
        if not isinstance(self.eos_token_ids, (list, tuple)):
            raise ValueError(f"eos_token_ids must be a list of token ids, got {self.eos_token_ids!r:.100}")
        self.eos_token_ids = tuple(self.eos_token_ids)
        for token_id in self.eos_token_ids:
            check_int("eos_token_ids[]", token_id)
        check_str("device", self.device)
        check_str("dtype", self.dtype)


@dataclass(slots=True, eq=False)
class RequestUpdate:
    """What one request gained in one step: the Engine's output, sent as it is in Outputs.

    The worker's only form of a new token; the frontend appends it to the request's RequestState, which
    outlives the worker (for a restart) and feeds ChoiceOutput (detokenizing, stop strings).

    `error` set: the worker refused the request or it failed (`error_kind` says which); it is over, with no tokens.

    `prompt_logprobs`: with SamplingParams.prompt_logprobs, those of the prompt positions this step computed,
    consecutive from position `prompt_logprobs_start` (position 0, which nothing predicts, has none). A prefill in
    chunks sends them chunk by chunk, in updates without tokens until the last; every one of them has come by the
    first token's update. A request recomputed (preempted, or re-run by a new worker) may send a position again:
    the receiver keeps the first.
    """

    request_id: str
    new_token_ids: np.ndarray  # int32 [num_new_tokens]; decoded, a view of the received frame
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when the request asked for logprobs
    error_kind: str | None = None  # REFUSED or FAILED when `error` is set, else None
    prompt_logprobs: list[TokenLogprobs] | None = None  # one per prompt position from prompt_logprobs_start on
    prompt_logprobs_start: int = 1

    @classmethod
    def sampled(cls, request_id: str, new_token_ids: np.ndarray, finish_reason: str | None) -> RequestUpdate:
        """The engine's everyday update, its sampled tokens (`new_token_ids`, int32 1-D: a view of the step's tokens)
        and no logprobs or error, built without __post_init__'s checks (a third of the cost): the engine made the
        values, and the receiver checks every update it decodes (column by column: _plain_updates)."""
        update = object.__new__(cls)
        update.request_id, update.finish_reason, update.prompt_logprobs_start = request_id, finish_reason, 1
        update.new_token_ids = new_token_ids
        update.error = update.logprobs = update.error_kind = update.prompt_logprobs = None
        return update

    def __post_init__(self) -> None:
        check_str("request_id", self.request_id)
        check_int("prompt_logprobs_start", self.prompt_logprobs_start, minimum=1)
        self.new_token_ids = as_token_ids("new_token_ids", self.new_token_ids)
        if self.finish_reason is not None:
            check_str("finish_reason", self.finish_reason)
        if (self.error is None) != (self.error_kind is None):
            raise ValueError(f"error and error_kind come together, got {self.error!r:.100} and {self.error_kind!r}")
        if self.error is not None:
            check_str("error", self.error)
            if self.error_kind not in ERROR_KINDS:
                raise ValueError(f"error_kind must be one of {ERROR_KINDS}, got {self.error_kind!r:.100}")
            if (len(self.new_token_ids) or self.finish_reason is not None or self.logprobs is not None
                    or self.prompt_logprobs is not None):
                raise ValueError(f"a request that ends in an error ({self.request_id}) carries no tokens, finish "
                                 "reason or logprobs")
        if self.logprobs is not None:
            token_ids = self.new_token_ids.tolist()
            if [lp.token_id for lp in self.logprobs] != token_ids:
                raise ValueError(f"logprobs must hold one entry per new token {token_ids}, got "
                                 f"{[lp.token_id for lp in self.logprobs]}")
            _check_top_counts(self.logprobs)
        if self.prompt_logprobs is not None:
            if not all(isinstance(lp.rank, int) and lp.rank >= 1 for lp in self.prompt_logprobs):
                raise ValueError(f"every prompt logprob of request {self.request_id} must have a rank >= 1")
            _check_top_counts(self.prompt_logprobs)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    @property
    def num_top_logprobs(self) -> int | None:
        return _num_top(self.logprobs)

    @property
    def num_top_prompt_logprobs(self) -> int | None:
        return _num_top(self.prompt_logprobs)


def _check_top_counts(logprobs: list[TokenLogprobs]) -> None:
    counts = {(len(lp.top_token_ids), len(lp.top_logprobs)) for lp in logprobs}
    if len(counts) > 1 or any(ids != lps for ids, lps in counts):
        raise ValueError(f"every token of one request must have the same number of top logprobs, got {counts}")


def _num_top(logprobs: list[TokenLogprobs] | None) -> int | None:
    if logprobs is None:
        return None
    return len(logprobs[0].top_token_ids) if logprobs else 0


@dataclass(slots=True, eq=False)
class Outputs:
    """One engine step: every request that advanced (or finished, or was refused), and the engine's stats when due
    (None: as the last ones sent; shared.vocabulary.STATS_INTERVAL_S)."""

    KIND: ClassVar[str] = "OUTPUTS"
    epoch: int
    secret: str = field(repr=False)  # kept out of logs
    requests: list[RequestUpdate]
    stats: EngineStats | None
    num_prompt_tokens: int = 0  # prompt tokens of the requests whose first token came in this step
    kv_progress: list[KVProgress] = field(default_factory=list)  # with a shared KV cache: each request run
    # requests this worker ran for the first time since the last Outputs -> the start of that step, in
    # time.monotonic() seconds (CLOCK_MONOTONIC: one clock for every process of the machine)
    scheduled: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_int("epoch", self.epoch)
        check_str("secret", self.secret)
        check_int("num_prompt_tokens", self.num_prompt_tokens)
        if not isinstance(self.scheduled, dict) or not all(
                isinstance(k, str) and isinstance(v, float) for k, v in self.scheduled.items()):
            raise ValueError("scheduled must map request ids to times in seconds")
        if not isinstance(self.kv_progress, list) or not all(isinstance(p, KVProgress) for p in self.kv_progress):
            raise ValueError("kv_progress must be a list of KVProgress")
        if not isinstance(self.requests, list) or not all(isinstance(r, RequestUpdate) for r in self.requests):
            raise ValueError("requests must be a list of RequestUpdate")
        if self.stats is not None and not isinstance(self.stats, EngineStats):
            raise ValueError(f"stats must be EngineStats or None, got {type(self.stats).__name__}")

    @property
    def num_generation_tokens(self) -> int:
        return sum(len(r.new_token_ids) for r in self.requests)

    def _to_wire(self) -> tuple[Header, list[np.ndarray]]:
        header = {"epoch": self.epoch, "secret": self.secret,
                  "stats": None if self.stats is None else self.stats.to_wire(),
                  "num_prompt_tokens": self.num_prompt_tokens, "scheduled": self.scheduled,
                  "request_ids": [r.request_id for r in self.requests],
                  "num_new_tokens": [len(r.new_token_ids) for r in self.requests],
                  "finish_reasons": [r.finish_reason for r in self.requests],
                  "errors": [r.error for r in self.requests],
                  "error_kinds": [r.error_kind for r in self.requests],
                  "num_top_logprobs": [r.num_top_logprobs for r in self.requests]}
        token_ids = (np.concatenate([r.new_token_ids for r in self.requests]) if self.requests
                     else empty_token_ids())
        prompt_header, prompt_frames = _pack_prompt_logprobs(self.requests)
        kv_header, kv_frames = _pack_kv_progress(self.kv_progress)
        return ({**header, **prompt_header, **kv_header},
                [token_ids, *pack_logprobs([r.logprobs for r in self.requests]), *prompt_frames, *kv_frames])

    @classmethod
    def _from_wire(cls, header: Header, frames: list[memoryview]) -> Outputs:
        request_ids, num_new_tokens, finish_reasons, errors, error_kinds, num_top_logprobs = columns = [
            take(header, name, list) for name in
            ("request_ids", "num_new_tokens", "finish_reasons", "errors", "error_kinds", "num_top_logprobs")]
        if len({len(column) for column in columns}) != 1:
            raise ValueError(f"per-request header lists must have one length, got {[len(c) for c in columns]}")
        has_logprobs = any(k is not None for k in num_top_logprobs)
        dtypes = (TOKEN_DTYPE, LOGPROB_DTYPE, TOKEN_DTYPE, LOGPROB_DTYPE) if has_logprobs else (TOKEN_DTYPE,)
        prompt_columns = [header.pop(name, None) for name in _PROMPT_LOGPROB_COLUMNS]
        has_prompt_logprobs = prompt_columns[0] is not None
        if has_prompt_logprobs:
            dtypes += (TOKEN_DTYPE, TOKEN_DTYPE, LOGPROB_DTYPE, TOKEN_DTYPE, LOGPROB_DTYPE)
        kv_columns = [header.pop(name, []) for name in _KV_COLUMNS]
        if kv_columns[0]:
            dtypes += (BLOCK_ID_DTYPE, BLOCK_SERIAL_DTYPE)
        arrays = frames_as_arrays(cls.KIND, frames, dtypes)
        kv_progress = _unpack_kv_progress(kv_columns, arrays[-2:]) if kv_columns[0] else []
        if kv_columns[0]:
            arrays = arrays[:-2]
        token_ids = split_by_counts(arrays[0], num_new_tokens)
        if not has_logprobs and not has_prompt_logprobs and errors.count(None) == len(errors):
            requests = _plain_updates(request_ids, arrays[0], token_ids, finish_reasons, error_kinds)
        else:
            logprobs = (unpack_logprobs(token_ids, num_top_logprobs, arrays[1:4]) if has_logprobs
                        else [None] * len(token_ids))
            starts, prompt_logprobs = (_unpack_prompt_logprobs(prompt_columns, len(request_ids), arrays[-5:])
                                       if has_prompt_logprobs else ([1] * len(request_ids), [None] * len(request_ids)))
            requests = [RequestUpdate(*row) for row in
                        zip(request_ids, token_ids, finish_reasons, errors, logprobs, error_kinds, prompt_logprobs,
                            starts)]
        raw_stats = take(header, "stats", object)  # null while not due
        if raw_stats is not None and not isinstance(raw_stats, dict):
            raise ValueError(f"header field 'stats' must be a dict or null, got {raw_stats!r:.100}")
        stats = None if raw_stats is None else EngineStats(**raw_stats)
        return cls(take(header, "epoch", int), take(header, "secret", str), requests, stats,
                   kv_progress=kv_progress, **header)


def _plain_updates(request_ids: list, token_frame: np.ndarray, token_ids: list[np.ndarray], finish_reasons: list,
                   error_kinds: list) -> list[RequestUpdate]:
    """A step's everyday updates (no error, no logprobs of either kind), checked as RequestUpdate.__post_init__
    would, but column by column: one object each, built as the engine builds them (RequestUpdate.sampled), costs
    a third of one checked on its own."""
    if not all(type(r) is str and r for r in request_ids):
        raise ValueError(f"request_id must be a non-empty string, got one of {request_ids!r:.100}")
    if not all(f is None or type(f) is str and f for f in finish_reasons):
        raise ValueError(f"finish_reason must be a non-empty string, got one of {finish_reasons!r:.100}")
    if error_kinds.count(None) != len(error_kinds):
        raise ValueError(f"error and error_kind come together, got no error and {error_kinds!r:.100}")
    if token_frame.size and token_frame.min() < 0:
        raise ValueError(f"new_token_ids must be token ids >= 0, got {token_frame.min()}")
    return [RequestUpdate.sampled(request_id, ids, finish_reason)
            for request_id, ids, finish_reason in zip(request_ids, token_ids, finish_reasons)]


_PROMPT_LOGPROB_COLUMNS = ("prompt_logprobs_starts", "num_prompt_logprobs", "num_top_prompt_logprobs")


def _pack_prompt_logprobs(requests: list[RequestUpdate]) -> tuple[Header, list[np.ndarray]]:
    """Outputs' prompt logprob columns and their five frames; none when no request carries any."""
    per_request = [r.prompt_logprobs for r in requests]
    if all(entries is None for entries in per_request):
        return {}, []
    header = {"prompt_logprobs_starts": [r.prompt_logprobs_start for r in requests],
              "num_prompt_logprobs": [0 if entries is None else len(entries) for entries in per_request],
              "num_top_prompt_logprobs": [r.num_top_prompt_logprobs for r in requests]}
    return header, pack_prompt_logprobs(per_request)


def _unpack_prompt_logprobs(columns: list, num_requests: int, arrays: list[np.ndarray]
                            ) -> tuple[list, list[list[TokenLogprobs] | None]]:
    if not all(isinstance(column, list) and len(column) == num_requests for column in columns):
        raise ValueError(f"the prompt logprob columns must be lists of {num_requests}, one per request")
    starts, counts, num_top = columns
    return starts, unpack_prompt_logprobs(counts, num_top, arrays)


_KV_COLUMNS = ("kv_request_ids", "kv_num_computed", "kv_table_lengths")  # a table length of -1: unchanged


def _pack_kv_progress(progress: list[KVProgress]) -> tuple[Header, list[np.ndarray]]:
    """Outputs' KV columns and their two frames (every changed table's block ids, then their serials)."""
    if not progress:
        return {}, []
    tables = [table for table in (p.table for p in progress) if table is not None]
    header = {"kv_request_ids": [p.request_id for p in progress], "kv_num_computed": [p.num_computed for p in progress],
              "kv_table_lengths": [-1 if p.block_ids is None else len(p.block_ids) for p in progress]}
    block_ids = np.concatenate([ids for ids, _ in tables]) if tables else np.empty(0, BLOCK_ID_DTYPE)
    serials = np.concatenate([serials for _, serials in tables]) if tables else np.empty(0, BLOCK_SERIAL_DTYPE)
    return header, [block_ids.astype(BLOCK_ID_DTYPE, copy=False), serials.astype(BLOCK_SERIAL_DTYPE, copy=False)]


def _unpack_kv_progress(columns: list, arrays: list[np.ndarray]) -> list[KVProgress]:
    request_ids, num_computed, lengths = columns
    if not all(isinstance(c, list) for c in columns) or len({len(c) for c in columns}) != 1:
        raise ValueError("the kv_ columns must be lists of one length")
    block_ids, serials = arrays
    changed = [n for n in lengths if n != -1]
    if len(block_ids) != len(serials) or sum(changed) != len(block_ids) or min(changed, default=0) < 0:
        raise ValueError(f"the kv tables' lengths {changed} do not match the frames of {len(block_ids)} block ids "
                         f"and {len(serials)} serials")
    if not all(type(r) is str and r for r in request_ids):
        raise ValueError(f"kv_request_ids[] must be non-empty strings, got one of {request_ids!r:.100}")
    if not all(type(n) is int and n >= 0 for n in num_computed):
        raise ValueError(f"num_computed must be integers >= 0, got one of {num_computed!r:.100}")
    progress, offset = [], 0
    for request_id, computed, length in zip(request_ids, num_computed, lengths):
        if length == -1:
            progress.append(KVProgress.unchecked(request_id, computed))
            continue
        progress.append(KVProgress(request_id, computed, block_ids[offset:offset + length],
                                   serials[offset:offset + length]))
        offset += length
    return progress


@dataclass(slots=True)
class Heartbeat:
    """Sent from the worker's loop thread when nothing else went out for a while: the loop is alive."""

    KIND: ClassVar[str] = "HEARTBEAT"
    epoch: int
    secret: str = field(repr=False)  # kept out of logs
    stats: EngineStats

    def __post_init__(self) -> None:
        check_int("epoch", self.epoch)
        check_str("secret", self.secret)
        if not isinstance(self.stats, EngineStats):
            raise ValueError(f"stats must be EngineStats, got {type(self.stats).__name__}")

    def _to_wire(self) -> tuple[Header, list[np.ndarray]]:
        return {"epoch": self.epoch, "secret": self.secret, "stats": self.stats.to_wire()}, []

    @classmethod
    def _from_wire(cls, header: Header, frames: list[memoryview]) -> Heartbeat:
        frames_as_arrays(cls.KIND, frames, ())
        return cls(take(header, "epoch", int), take(header, "secret", str), EngineStats(**take(header, "stats", dict)),
                   **header)


@dataclass(slots=True)
class Fatal(_HeaderOnly):
    """The worker hit an unrecoverable error and is about to exit non-zero.

    `request_ids`: the requests of the step the error was raised in; empty when it came outside a step (loading
    the model, reading the inbox, scheduling).
    """

    KIND: ClassVar[str] = "FATAL"
    epoch: int
    secret: str = field(repr=False)  # kept out of logs
    message: str
    traceback: str
    request_ids: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_int("epoch", self.epoch)
        check_str("secret", self.secret)
        check_str("message", self.message, allow_empty=True)
        check_str("traceback", self.traceback, allow_empty=True)
        self.request_ids = check_request_ids("request_ids", self.request_ids, allow_empty=True)


@dataclass(slots=True)
class OperatorTime:
    """One row of a profile's operator table: an operator, how often it ran, its self CPU time."""

    name: str
    num_calls: int
    self_cpu_ms: float

    def __post_init__(self) -> None:
        check_str("name", self.name)
        check_int("num_calls", self.num_calls)
        check_float("self_cpu_ms", self.self_cpu_ms, 0.0, math.inf)


@dataclass(slots=True)
class ProfileResult:
    """The answer to a StopProfile: the profile's files, its table and its top operators by self CPU time.

    `error` set: no profile was written (the worker was not profiling, or the directory or a file could not be
    written); then there are no paths, no table and no operators.
    """

    KIND: ClassVar[str] = "PROFILE_RESULT"
    epoch: int
    secret: str = field(repr=False)  # kept out of logs
    num_steps: int  # engine steps run while the profiler was on
    seconds: float  # wall time from StartProfile to StopProfile
    table_path: str | None = None  # the operator table, as text
    trace_path: str | None = None  # the chrome trace (chrome://tracing, Perfetto)
    table: str = ""  # the table file's text
    top_operators: list[OperatorTime] = field(default_factory=list)  # the table's rows, most self CPU time first
    error: str | None = None

    def __post_init__(self) -> None:
        check_int("epoch", self.epoch)
        check_str("secret", self.secret)
        check_int("num_steps", self.num_steps)
        check_float("seconds", self.seconds, 0.0, math.inf)
        if not isinstance(self.top_operators, list) or not all(isinstance(o, OperatorTime)
                                                               for o in self.top_operators):
            raise ValueError("top_operators must be a list of OperatorTime")
        check_str("table", self.table, allow_empty=True)
        if self.error is not None:
            check_str("error", self.error)
            if self.table_path is not None or self.trace_path is not None or self.table or self.top_operators:
                raise ValueError(f"a profile that failed ({self.error:.100}) carries no paths, table or operators")
            return
        check_str("table_path", self.table_path)
        check_str("trace_path", self.trace_path)

    def _to_wire(self) -> tuple[Header, list[np.ndarray]]:
        header = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        header["top_operators"] = [dataclasses.asdict(o) for o in self.top_operators]
        return header, []

    @classmethod
    def _from_wire(cls, header: Header, frames: list[memoryview]) -> ProfileResult:
        frames_as_arrays(cls.KIND, frames, ())
        rows = take(header, "top_operators", list)
        if not all(isinstance(row, dict) for row in rows):
            raise ValueError(f"top_operators must be a list of objects, got {rows!r:.100}")
        return cls(**header, top_operators=[OperatorTime(**row) for row in rows])


@dataclass(slots=True)
class PrefixCacheReset(_HeaderOnly):
    """The answer to a ResetPrefixCache: the worker's prefix cache is empty now."""

    KIND: ClassVar[str] = "PREFIX_CACHE_RESET"
    epoch: int
    secret: str = field(repr=False)  # kept out of logs
    num_freed_blocks: int  # cached blocks no request held, free again

    def __post_init__(self) -> None:
        check_int("epoch", self.epoch)
        check_str("secret", self.secret)
        check_int("num_freed_blocks", self.num_freed_blocks)


_FRONTEND_MESSAGES = (Add, Resume, Abort, Shutdown, StartProfile, StopProfile, ResetPrefixCache)
WORKER_MESSAGES = (Ready, Outputs, Heartbeat, Fatal, ProfileResult, PrefixCacheReset)  # the kinds a worker sends
Message = Union[Add, Resume, Abort, Shutdown, StartProfile, StopProfile, ResetPrefixCache, Ready, Outputs, Heartbeat,
                Fatal, ProfileResult, PrefixCacheReset]
WorkerMessage = Union[Ready, Outputs, Heartbeat, Fatal, ProfileResult, PrefixCacheReset]
_MESSAGE_CLASSES: dict[str, type] = {cls.KIND: cls for cls in (*_FRONTEND_MESSAGES, *WORKER_MESSAGES)}


def encode(msg: Message) -> list[Frame]:
    """Frames of one multipart message: the JSON header, then the raw arrays (send them with copy=False)."""
    kind = getattr(msg, "KIND", None)
    if not isinstance(kind, str) or _MESSAGE_CLASSES.get(kind) is not type(msg):
        raise TypeError(f"expected a protocol message ({', '.join(_MESSAGE_CLASSES)}), got {type(msg).__name__}")
    header, arrays = msg._to_wire()
    # An np.ndarray has the buffer protocol on every Python; numpy's stubs declare it only from Python 3.12 on.
    return [orjson.dumps({"kind": kind, **header}), *cast("list[Buffer]", arrays)]


def decode(frames: Sequence[Frame]) -> Message:
    """Frames of one received multipart message (bytes, memoryviews, zmq.Frames) -> the message, without copying
    the array frames: the decoded arrays are views of the frames' memory."""
    if not frames:
        raise ProtocolError("expected a multipart message with a header frame, got no frames")
    buffers = cast("Sequence[Buffer]", frames)  # a zmq.Frame has the buffer protocol; pyzmq's stubs do not declare it
    try:
        header = orjson.loads(memoryview(buffers[0]))
    except (orjson.JSONDecodeError, TypeError) as exc:
        raise ProtocolError(f"header frame must be a JSON object: {exc}") from exc
    kind = header.pop("kind", None) if isinstance(header, dict) else None
    cls = _MESSAGE_CLASSES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"header must name a kind among {', '.join(_MESSAGE_CLASSES)}, got {header!r:.200}")
    try:
        return cls._from_wire(header, [memoryview(f) for f in buffers[1:]])
    except ProtocolError:
        raise
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"malformed {kind} message: {exc}") from exc
