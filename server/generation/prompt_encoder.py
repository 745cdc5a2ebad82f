"""PromptEncoder: prompt text -> token ids without letting one prompt stall the event loop.

Owns: the bound on a prompt's length in characters, checked before any
tokenizing, and where tokenizing runs: short texts on the event loop, long
ones on a small thread pool with a bounded queue (503 with Retry-After when
it is full). Echo's prompts go the same way: a text with its tokens' text
offsets, or token ids decoded piece by piece (EchoedPrompt).
Must not know: HTTP framing, request bodies, the engine.
How: no token of the vocabulary spans more characters than its longest
entry, so a text longer than max_model_len x that many characters cannot fit
the context and is refused at once (400, context_length_exceeded) instead
of being tokenized for seconds and refused afterwards. The Tokenizer
releases the GIL while it encodes, so a pool thread working on a long text
leaves the event loop free: /health and the streams in flight never wait
on someone's prompt.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import TypeVar

from server.generation.echoed_prompt import EchoedPrompt, decoded_prompt
from server.generation.tokenizer import Tokenizer
from server.http.errors import RETRY_AFTER_S, ApiError

INLINE_MAX_CHARS = 16 * 1024  # tokenized on the event loop: well under a millisecond's work
INLINE_MAX_DECODED_TOKENS = 256  # decoded one by one on the event loop: two short decodes each

_T = TypeVar("_T")


class PromptEncoder:
    def __init__(self, tokenizer: Tokenizer, *, max_threads: int = 1, max_queued: int = 32):
        self.tokenizer = tokenizer
        self._pool = concurrent.futures.ThreadPoolExecutor(max_threads, thread_name_prefix="tokenize")
        self._max_queued = max_queued
        self._num_queued = 0

    async def encode(self, text: str, max_model_len: int | None, *, add_special_tokens: bool = True,
                     param: str = "prompt") -> list[int]:
        """Token ids of `text`; 400 naming `param` when it is too long for the context (None: not known yet),
        503 when busy."""
        self.check_length(len(text), max_model_len, param)
        return await self._run(len(text) <= INLINE_MAX_CHARS,
                               lambda: self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def echoed_text(self, text: str, max_model_len: int | None, *, add_special_tokens: bool = True
                          ) -> EchoedPrompt:
        """A text prompt as echo returns it: the text as sent, its token ids (as encode's) and their offsets."""
        self.check_length(len(text), max_model_len, "prompt")
        ids, offsets = await self._run(len(text) <= INLINE_MAX_CHARS,
                                       lambda: self.tokenizer.encode_with_offsets(text, add_special_tokens))
        return EchoedPrompt(text, ids, offsets)

    async def echoed_token_ids(self, token_ids: list[int]) -> EchoedPrompt:
        """A token id prompt as echo returns it: decoded, each token's offset where its piece starts."""
        return await self._run(len(token_ids) <= INLINE_MAX_DECODED_TOKENS,
                               lambda: decoded_prompt(self.tokenizer, token_ids))

    async def _run(self, inline: bool, work: Callable[[], _T]) -> _T:
        """work() on the event loop when `inline`, else on the pool (503 when its queue is full)."""
        if inline:
            return work()
        if self._num_queued >= self._max_queued:
            raise ApiError(503, f"the tokenizer is busy with {self._num_queued} long prompts; retry shortly",
                           headers={"Retry-After": RETRY_AFTER_S})
        self._num_queued += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, work)
        finally:
            self._num_queued -= 1

    def check_length(self, num_chars: int, max_model_len: int | None, param: str = "prompt") -> None:
        """400 naming `param` when `num_chars` characters cannot fit max_model_len tokens (None: not known yet)."""
        max_chars = max_model_len * self.tokenizer.max_token_chars if max_model_len is not None else None
        if max_chars is not None and num_chars > max_chars:
            raise ApiError(400, f"the prompt is {num_chars} characters, more than the {max_chars} that "
                                f"this model's maximum context length of {max_model_len} tokens can hold "
                                f"(at most {self.tokenizer.max_token_chars} characters per token)",
                           param=param, code="context_length_exceeded")

    def close(self) -> None:
        """Drop the texts waiting for the pool; one being tokenized finishes (exit waits at most that long)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
