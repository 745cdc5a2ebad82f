"""generate(): prompts run to completion together in this process, the Engine's continuous batching without a server.

For tests, benchmarks and the offline command line (gpu_worker/engine/offline.py):
each request's RequestUpdates are gathered into one Completion, in prompt
order.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from gpu_worker.engine.engine import Engine
from shared.logprobs import TokenLogprobs, unseen_prompt_logprobs
from shared.protocol import RequestUpdate
from shared.sampling_params import SamplingParams


@dataclass(slots=True)
class Completion:
    """A whole request's result, as the offline `generate` returns it."""

    token_ids: list[int]
    finish_reason: str  # "" when the request failed
    logprobs: list[TokenLogprobs] | None
    error: str | None = None
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # positions 1.., when asked

    def add(self, out: RequestUpdate) -> None:
        """Take in one step's output of the request."""
        if out.prompt_logprobs is not None:
            try:
                self.prompt_logprobs.extend(unseen_prompt_logprobs(len(self.prompt_logprobs), out.prompt_logprobs_start,
                                                                   out.prompt_logprobs))
            except ValueError as exc:
                raise RuntimeError(f"request {out.request_id}: {exc}") from None
        self.token_ids.extend(out.new_token_ids.tolist())
        if out.logprobs is not None:
            if self.logprobs is None:
                raise RuntimeError(f"request {out.request_id} got logprobs it did not ask for")
            self.logprobs.extend(out.logprobs)
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason
        self.error = out.error


def generate(engine: Engine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
             ) -> list[Completion]:
    """Run prompts to completion together (continuous batching), results in prompt order."""
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    request_ids = [f"generate-{uuid.uuid4().hex}" for _ in prompts]
    results = {rid: Completion([], "", [] if p.logprobs is not None else None)
               for rid, p in zip(request_ids, params_list)}
    for request_id, prompt, request_params in zip(request_ids, prompts, params_list):
        engine.add_request(request_id, prompt, request_params)
    while engine.has_work():
        for out in engine.step():
            completion = results.get(out.request_id)
            if completion is not None:
                completion.add(out)
    return [results[rid] for rid in request_ids]
