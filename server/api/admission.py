"""Admission: how many sequences may be in flight, counted from a request's admission to its end.

Owns: the bound on sequences in flight (running in the worker's batch or
waiting in its queue) and the per-request bound on sequences, with the 429
(Retry-After) and 400 that enforce them.
Must not know: HTTP framing, request bodies, the engine.
How: a generation request holds one place per sequence it will put in the
engine (n choices for each of its prompts) from the moment it is admitted,
before its prompts are tokenized, until its handler returns. The count is
exact because places are taken and given back on the event loop; no
request can slip in while another tokenizes. A request that asks for more
sequences than one request may hold gets 400 (it would never fit); one
that does not fit now gets 429.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from server.http.errors import RETRY_AFTER_S, ApiError


class Admission:
    def __init__(self, capacity: int, max_seqs_per_request: int):
        """capacity: sequences in flight at once; max_seqs_per_request: n x prompts of one request."""
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity!r}")
        if max_seqs_per_request < 1:
            raise ValueError(f"max_seqs_per_request must be >= 1, got {max_seqs_per_request!r}")
        self.capacity = capacity
        self.max_seqs_per_request = min(max_seqs_per_request, capacity)
        self.num_admitted = 0  # sequences of the requests admitted and not yet done
        self.num_requests = 0  # the requests admitted and not yet done (GET /load)

    @contextlib.contextmanager
    def admit(self, num_seqs: int, param: str = "n") -> Iterator[None]:
        """Hold `num_seqs` places for the `with` block; 400 when a request may never hold that many, 429 when
        they are not free now. `param`: the request field to name in the 400."""
        if num_seqs > self.max_seqs_per_request:
            raise ApiError(400, f"a request may ask for at most {self.max_seqs_per_request} sequences (n x the "
                                f"number of prompts), got {num_seqs}", param=param)
        if self.num_admitted + num_seqs > self.capacity:
            raise ApiError(429, f"the server is at capacity ({self.num_admitted} sequences in flight, at most "
                                f"{self.capacity}; this request needs {num_seqs}); retry shortly",
                           headers={"Retry-After": RETRY_AFTER_S})
        self.num_admitted += num_seqs
        self.num_requests += 1
        try:
            yield
        finally:
            self.num_admitted -= num_seqs
            self.num_requests -= 1
