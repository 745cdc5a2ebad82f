"""The bound on a whole (not streamed) response's size, checked before any work: a small request can ask for a
huge one (64 prompts x n 4 x 20 prompt logprobs of 471 tokens made 172 MB of JSON, and the frontend held
several times that while it built it).

Owns the estimate: each choice's text and, per token, its logprobs entries
(the token and its top alternatives), for the generated tokens (up to
max_tokens, or what the context leaves), the prompt's (prompt_logprobs, and
echo with logprobs), n choices per prompt. Entries are counted at the JSON
bytes they measure to (ENTRY_BYTES: a prompt_logprobs entry, {"id":
{"logprob", "rank", "decoded_token"}}, is the larger); over
the server's --max-response-size (64 MiB by default) the request is a 400
that says what to ask for instead.
Streamed responses are not bound: each chunk is sent as it is made.
"""

from __future__ import annotations

from server.generation.request import GenerationRequest
from server.http.errors import ApiError

TEXT_BYTES_PER_TOKEN = 8  # a generated token's text, escaped
ENTRY_BYTES = {"logprobs": 32, "prompt_logprobs": 72}  # one alternative of one token, in the response's JSON


def check_response_size(request: GenerationRequest, prompt_ids: list[list[int]], max_model_len: int | None,
                        default_max_tokens: int | None, max_bytes: int) -> None:
    """400 when the whole response `request` asks for could pass `max_bytes` (max_model_len None: not known yet,
    and the generated tokens count only as far as max_tokens says)."""
    if request.stream:
        return
    estimate = sum(_choice_bytes(request, len(ids), max_model_len, default_max_tokens) for ids in prompt_ids)
    estimate *= request.n
    if estimate > max_bytes:
        asked = ", ".join(part for part in (
            f"{len(prompt_ids)} prompts" if len(prompt_ids) > 1 else "", f"n {request.n}" if request.n > 1 else "",
            f"logprobs {request.num_logprobs}" if request.num_logprobs is not None else "",
            f"prompt_logprobs {request.num_prompt_logprobs}" if request.num_prompt_logprobs is not None else "")
            if part)
        raise ApiError(400, f"the response could be {estimate / 2**20:,.0f} MiB ({asked or 'its tokens'}), more than "
                            f"the {max_bytes / 2**20:,.0f} MiB a whole response may be (--max-response-size); ask for "
                            f"fewer prompts, choices, alternatives or tokens in one request, or stream it",
                       param="prompt_logprobs" if request.num_prompt_logprobs is not None else "max_tokens")


def _choice_bytes(request: GenerationRequest, prompt_len: int, max_model_len: int | None,
                  default_max_tokens: int | None) -> int:
    """The most bytes one choice of a prompt of `prompt_len` tokens could take."""
    limit = request.max_tokens if request.max_tokens is not None else default_max_tokens
    room = None if max_model_len is None else max(max_model_len - prompt_len, 0)
    bounds = [size for size in (limit, room) if size is not None]
    generated = min(bounds) if bounds else 0
    size = generated * TEXT_BYTES_PER_TOKEN
    if request.num_logprobs is not None:
        echoed = prompt_len if request.echo else 0
        size += (generated + echoed) * (request.num_logprobs + 1) * ENTRY_BYTES["logprobs"]
    if request.num_prompt_logprobs is not None:
        size += prompt_len * (request.num_prompt_logprobs + 1) * ENTRY_BYTES["prompt_logprobs"]
    return size
