"""Streaming completions read in threads, as many clients at once would: what each stream received, as it came.

    streams, futures = run_streams(server, [{"model": "tiny", "prompt": "Hi", "max_tokens": 8}, ...])
    server.wait_for(lambda: all(stream.pieces for stream in streams), "a first piece in every stream")
    results = [future.result(timeout=WAIT_S) for future in futures]  # the Streams, once each has ended

mixed_completions() builds such a list: half greedy, half seeded sampling, each prompt its own.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field

import openai

from helpers.running_server import RunningServer


@dataclass
class Stream:
    """One streamed completion: its tokens (from logprobs, when asked for) and text pieces, finish and usage."""

    tokens: list[str] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int | None = None

    def read(self, client: openai.OpenAI, params: dict) -> Stream:
        chunks = client.completions.create(**params, stream=True, stream_options={"include_usage": True})
        for chunk in chunks:
            if chunk.choices:
                choice = chunk.choices[0]
                self.pieces.append(choice.text)
                self.tokens.extend(choice.logprobs.tokens if choice.logprobs else [])
                self.finish_reason = choice.finish_reason or self.finish_reason
            if chunk.usage is not None:
                self.completion_tokens = chunk.usage.completion_tokens
        return self

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def run_streams(server: RunningServer, requests: list[dict]) -> tuple[list[Stream], list[concurrent.futures.Future]]:
    """Each request streamed in a thread of its own, all under way on return: the Streams and their futures."""
    streams = [Stream() for _ in requests]
    pool = concurrent.futures.ThreadPoolExecutor(len(requests))
    client = server.client()
    futures = [pool.submit(stream.read, client, params) for stream, params in zip(streams, requests)]
    pool.shutdown(wait=False)
    return streams, futures


PHRASES = ["Once upon a time", "The quick brown fox", "What is the capital", "Numbers: 0 1 2", "Hello there",
           "A paged attention server", "The weather today", "It said hello to"]


def mixed_completions(model: str, count: int, max_tokens: int) -> list[dict]:
    """`count` completion requests, half greedy, half seeded sampling (so a rerun gives the same texts), EOS ignored."""
    requests = []
    for i in range(count):
        sampling = {"temperature": 0.9, "top_p": 0.95, "seed": 1000 + i} if i % 2 else {"temperature": 0}
        requests.append({"model": model, "prompt": f"{PHRASES[i % len(PHRASES)]} #{i}", "max_tokens": max_tokens,
                         "extra_body": {"ignore_eos": True}, **sampling})
    return requests
