"""Load: `concurrency` threads, each streaming one completion after another, every token's arrival timed.

Each stream is a greedy completion of random token ids with EOS ignored and
logprobs on (so every chunk says how many tokens it carries); a finished
stream is followed at once by the next. What the recovery benchmark and the
hostile-client run read from it: which requests were lost (not all their
tokens), which were in flight at a moment, when the first token after a
moment arrived, tokens/s over a window. Only the standard library.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from tools.benchlib.metrics import TIMEOUT_S, wait_until
from tools.benchlib.target import auth_header

PROMPT_TOKEN_RANGE = (10, 250)  # ids every real vocabulary has
ERROR_PAUSE_S = 0.5


@dataclass
class Request:
    lane: int  # which of the load's concurrent clients sent it
    prompt_len: int
    start: float
    token_times: list[float] = field(default_factory=list)  # one entry per token received
    end: float | None = None
    error: str | None = None

    def is_in_flight(self, since: float, until: float) -> bool:
        """Sent before `since` and not over before `until`."""
        return self.start < since and (self.end is None or self.end > until)

    def overlaps(self, start: float, end: float) -> bool:
        """Sent before `end` and not over before `start`."""
        return self.is_in_flight(end, start)


class Load:
    """`concurrency` threads, each streaming one completion after another until stop()."""

    def __init__(self, base_url: str, model: str, concurrency: int, prompt_len: int, max_tokens: int, seed: int,
                 api_key: str | None = None):
        self.url = urlsplit(base_url)
        self.model, self.prompt_len, self.max_tokens = model, prompt_len, max_tokens
        self.headers = {"Content-Type": "application/json", **auth_header(api_key)}
        self.requests: list[Request] = []
        self.last_arrival = 0.0  # when any stream last received a token
        self._rng = random.Random(seed)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._lane, args=(lane,), daemon=True) for lane in range(concurrency)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(TIMEOUT_S)

    def _lane(self, lane: int) -> None:
        while not self._stop.is_set():
            prompt = [self._rng.randrange(*PROMPT_TOKEN_RANGE) for _ in range(self.prompt_len)]
            request = Request(lane, len(prompt), time.monotonic())
            self.requests.append(request)
            try:
                self._stream(prompt, request)
            except Exception as exc:  # noqa: BLE001 - a lost request, reported
                request.error = repr(exc)
                self._stop.wait(ERROR_PAUSE_S)  # a server that is gone refuses at once: no busy loop
            request.end = time.monotonic()

    def _stream(self, prompt: list[int], request: Request) -> None:
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens, "stream": True,
                           "temperature": 0, "ignore_eos": True, "logprobs": 0})
        conn = http.client.HTTPConnection(self.url.hostname, self.url.port, timeout=TIMEOUT_S)
        conn.request("POST", "/v1/completions", body, self.headers)
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
        for line in response:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[len(b"data: "):])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            now = time.monotonic()
            for choice in event["choices"]:
                num_tokens = len((choice.get("logprobs") or {}).get("tokens") or [])
                request.token_times += [now] * num_tokens
                self.last_arrival = now if num_tokens else self.last_arrival
        conn.close()

    def lost(self) -> list[Request]:
        return [r for r in self.requests if r.end is None or r.error or len(r.token_times) != self.max_tokens]

    def wait_cycled(self) -> None:
        """Waits until every lane has sent and finished a request from now on: past a new worker's first steps."""
        since = time.monotonic()
        wait_until(lambda: len({r.lane for r in self.requests if r.start > since and r.end}) == len(self._threads),
                   "every stream to finish a request")

    def first_token_after(self, moment: float) -> float:
        """When the first token after `moment` arrived (waiting for it)."""
        wait_until(lambda: self.last_arrival > moment, "the first token after the fault")
        return min(t for r in self.requests for t in r.token_times if t > moment)

    def tokens_per_s(self, start: float, end: float) -> float:
        return sum(start <= t < end for r in self.requests for t in r.token_times) / (end - start)
