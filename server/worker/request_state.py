"""RequestState: the frontend's one object per request, from admission to the last byte sent.

It holds everything needed to send the request to a worker again: the
prompt, every token generated so far, the sampling parameters (with the seed
picked at admission) and the priority. The EngineClient appends each step's
tokens (each step's RequestUpdate from the wire) and wakes the handler; the
handler reads what it has not yet sent (ChoiceOutput). This form of a token
exists because a request outlives its worker: it is what a new worker is
sent to resume from. Nothing here knows HTTP or ZMQ.

Prompt logprobs (params.prompt_logprobs set) arrive by prompt position, in
runs that start at some position (RequestUpdate.prompt_logprobs_start): a
prefill in chunks sends several, and a recompute (preemption, a new worker)
may send a position again. The first entry for each position is kept; a run
that starts past the next missing position would leave a gap, which is the
worker's error.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.kv_hold import KVHold
from shared.logprobs import TokenLogprobs, unseen_prompt_logprobs
from shared.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class Requeue:
    """A worker died (or was recycled) with the request in flight, and it was kept to be re-sent to the next."""

    time: float  # time.monotonic() when the supervisor took the worker's death
    cause: str  # the restart cause: exit, signal, hang, memory, max_requests
    description: str  # what happened, as the supervisor logged it


@dataclass(slots=True, eq=False)
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # max_tokens / min_tokens as the client asked, for the whole request
    priority: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # positions 1, 2, ... (0 has none)
    finish_reason: str | None = None
    error: str | None = None  # set when the request failed; the handler reports it
    error_type: str | None = None  # the OpenAI error type of `error`: "server_error" or "invalid_request_error"
    arrival_time: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None  # when a worker first ran a step of it (queued until then)
    first_token_time: float | None = None
    last_token_time: float | None = None
    requeues: list[Requeue] = field(default_factory=list)  # each worker death it lived through, in order
    prompt_choices: list[RequestState] | None = None  # the n choices of its prompt, itself among them
    kv: KVHold | None = None  # with a shared KV cache: its blocks as the worker last reported them
    trace_context: dict[str, str] | None = None  # the client's W3C trace context (traceparent, tracestate)
    # Called on every change, by whoever made it (the EngineClient as it routes a step's updates): a handler's
    # ChoiceRun queues its choice there, with no task of its own to wake for each token.
    listener: Callable[[], None] | None = None
    _updated: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    @property
    def has_all_prompt_logprobs(self) -> bool:
        """Whether every prompt position after the first has its prompt logprobs."""
        return len(self.prompt_logprobs) == len(self.prompt_token_ids) - 1

    def add_prompt_logprobs(self, start: int, entries: list[TokenLogprobs]) -> None:
        """Record the prompt logprobs of positions start, start + 1, ...: those not recorded yet."""
        next_position = len(self.prompt_logprobs) + 1
        try:
            new = unseen_prompt_logprobs(len(self.prompt_logprobs), start, entries)
        except ValueError as exc:
            raise RuntimeError(f"request {self.request_id}: {exc}") from None
        if start + len(entries) > len(self.prompt_token_ids):
            raise RuntimeError(f"request {self.request_id}: prompt logprobs up to position {start + len(entries) - 1}, "
                               f"past the prompt's last position {len(self.prompt_token_ids) - 1}")
        expected = self.prompt_token_ids[next_position:next_position + len(new)]
        if [entry.token_id for entry in new] != expected:
            raise RuntimeError(f"request {self.request_id}: prompt logprobs from position {next_position} are for "
                               f"tokens {[entry.token_id for entry in new][:8]}, the prompt has {expected[:8]}")
        self.prompt_logprobs.extend(new)
        self._changed()

    def append(self, token_ids: list[int], logprobs: list[TokenLogprobs] | None, finish_reason: str | None) -> None:
        """Record one step's tokens from the worker and wake whoever waits on this request."""
        now = time.monotonic()
        if token_ids and self.first_token_time is None:
            self.first_token_time = now
        if token_ids:
            self.last_token_time = now
        self.output_token_ids.extend(token_ids)
        if logprobs:
            self.logprobs.extend(logprobs)
        if finish_reason is not None:
            self.finish_reason = finish_reason
        self._changed()

    def fail(self, message: str, error_type: str = "server_error") -> None:
        self.error = message
        self.error_type = error_type
        self._changed()

    def _changed(self) -> None:
        self._updated.set()
        if self.listener is not None:
            self.listener()

    async def wait_for_update(self) -> None:
        """Return once something was appended since the last call (or the request ended)."""
        await self._updated.wait()
        self._updated.clear()
