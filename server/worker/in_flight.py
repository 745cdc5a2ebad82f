"""InFlightRequests: every request sent, or to be sent, to a worker and not finished; what a worker's Outputs do to
each; the message that sends one again, with what remains of it.

A first send and a re-queue after a worker death are one code path:
add_message() builds an Add from the request's prompt, the tokens it already
has and what remains of max_tokens / min_tokens (without prompt logprobs once
all have come), and resume() one Resume of every request for the next
worker, with their KV holds when that worker shares the cache. route()
applies a worker's Outputs: tokens and logprobs to RequestState.append(),
prompt logprobs first to add_prompt_logprobs() (a gap fails that request
alone and stops it in the worker), fail() for a request the worker refused
(an invalid_request_error) or failed (a server_error).

Whom to blame for a worker's death: `scheduled_on_worker` holds the requests
in flight that the worker had scheduled (its scheduled ledger, noted before
its first forward pass, read once it has exited: note_scheduled()).
Must not know the worker's process or sockets: messages go out through `send`.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Callable, Iterable, Iterator, Mapping

from server.worker.request_state import RequestState
from shared.protocol import FAILED, REFUSED, Abort, Add, Message, Outputs, RequestUpdate, Resume
from shared.vocabulary import SEED_BITS, FinishReason
from shared.wire import as_token_ids

logger = logging.getLogger("pagedserve.engine_client")


class InFlightRequests(Mapping[str, RequestState]):
    """A read-only mapping of request id to RequestState; only its methods change it."""

    def __init__(self, seed: int, send: Callable[[Message], None]) -> None:
        self._requests: dict[str, RequestState] = {}
        self._scheduled: set[str] = set()  # what the last worker's ledger named; pruned as requests end
        self._seed_rng = random.Random(seed)  # seeds requests that bring none, as the Engine would
        self._send = send

    def __getitem__(self, request_id: str) -> RequestState:
        return self._requests[request_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._requests)

    def __len__(self) -> int:
        return len(self._requests)

    @property
    def scheduled_on_worker(self) -> frozenset[str]:
        """Ids of the requests in flight that the last worker scheduled at least once, as its ledger named them
        once it exited; requests that only waited in its queue are not here."""
        return frozenset(self._scheduled.intersection(self._requests))

    def note_scheduled(self, request_ids: Iterable[str]) -> None:
        self._scheduled.update(request_ids)

    def forget_scheduled(self) -> None:
        """A new worker starts: nothing is scheduled on it yet."""
        self._scheduled.clear()

    def add(self, state: RequestState) -> None:
        """Put a request in flight. A request without a seed is given one here, so that a re-queue draws the same
        tokens."""
        if state.request_id in self._requests:
            raise ValueError(f"request id {state.request_id!r} is already in flight")
        if state.params.seed is None:
            state.params = dataclasses.replace(state.params, seed=self._seed_rng.getrandbits(SEED_BITS))
        self._requests[state.request_id] = state

    def pop(self, request_id: str) -> RequestState | None:
        """Take a request out of flight (a re-queue never revives it); None when it is not in flight."""
        self._scheduled.discard(request_id)
        return self._requests.pop(request_id, None)

    def fail_all(self, message: str) -> None:
        """Fail every request in flight with `message` and forget them."""
        states, self._requests = list(self._requests.values()), {}
        self._scheduled.clear()
        for state in states:
            state.fail(message)

    def add_message(self, state: RequestState, with_kv: bool) -> Add | None:
        """The request with what remains of it: the tokens it has, the rest of max_tokens and min_tokens, its
        prompt logprobs unless all have come, and (with_kv) its KV hold. None, and the request finished, when
        nothing remains to generate."""
        num_done = len(state.output_token_ids)
        if num_done >= state.params.max_tokens:  # nothing left to generate (it reached max_tokens right then)
            del self._requests[state.request_id]
            state.append([], None, FinishReason.LENGTH.value)
            return None
        params = dataclasses.replace(state.params, max_tokens=state.params.max_tokens - num_done,
                                     min_tokens=max(0, state.params.min_tokens - num_done))
        if state.has_all_prompt_logprobs:  # nothing left to compute of them: the new worker may use its cache
            params = dataclasses.replace(params, prompt_logprobs=None)
        return Add(state.request_id, as_token_ids("prompt_token_ids", state.prompt_token_ids), params,
                   as_token_ids("output_token_ids", state.output_token_ids), state.priority, state.kv if with_kv else None)

    def resume(self, with_kv: bool) -> Resume | None:
        """Every request in flight for a new worker, in one Resume, with their KV holds when it shares the cache
        (`with_kv`); None when there are none."""
        adds = [add for state in list(self._requests.values())
                if (add := self.add_message(state, with_kv=with_kv)) is not None]
        return Resume(adds) if adds else None

    def route(self, outputs: Outputs) -> int:
        """Apply a worker's Outputs to the requests they name; how many finished."""
        num_finished = 0
        for update in outputs.requests:
            state = self._requests.get(update.request_id)
            if state is None:
                continue  # aborted here already
            if update.error_kind == REFUSED:
                state.fail(f"the engine refused the request: {update.error}", error_type="invalid_request_error")
            elif update.error_kind == FAILED:
                state.fail(f"{update.error}; the request could not be completed", error_type="server_error")
            elif not self._take_prompt_logprobs(state, update):
                continue  # failed, and out of flight already
            else:
                state.append(update.new_token_ids.tolist(), update.logprobs, update.finish_reason)
            if update.is_finished:
                del self._requests[update.request_id]
                num_finished += 1
        for progress in outputs.kv_progress:
            state = self._requests.get(progress.request_id)
            if state is not None:
                state.kv = progress.apply_to(state.kv)
        for request_id, started in outputs.scheduled.items():
            state = self._requests.get(request_id)
            if state is not None and state.scheduled_time is None:  # a re-queued request keeps its first
                state.scheduled_time = started
        return num_finished

    def _take_prompt_logprobs(self, state: RequestState, update: RequestUpdate) -> bool:
        """Record the update's prompt logprobs. Ones that would leave a gap are the worker's error: the request
        fails (and is stopped in the worker) and False is returned; the other requests go on."""
        if update.prompt_logprobs is None:
            return True
        try:
            state.add_prompt_logprobs(update.prompt_logprobs_start, update.prompt_logprobs)
        except RuntimeError as exc:
            logger.error("%s", exc)
            del self._requests[state.request_id]
            self._send(Abort((state.request_id,)))
            state.fail(f"{exc}; the request could not be completed")
            return False
        return True
