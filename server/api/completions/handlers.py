"""OpenAIHandlers: POST /v1/completions and /v1/chat/completions, from request body to the last byte.

Owns: turning a checked request (openai_params) into prompts and one
RequestState per choice (checked against the model's context length), and
answering: SSE chunks as the engine produces tokens, or one JSON body at
the end.
Must not know: routing, auth, admission limits, metrics (the app wires
those, and hears of every finished choice through `on_request_done`);
HTTP framing (the Responder); torch.
How: a request is parsed, then admitted for its number of sequences (the
app's `admit`, held until the response is done), and only then tokenized
(by the PromptEncoder: bounded in characters, long texts off the event
loop). A ChoiceRun (choice_run) holds the request's choices in flight and
yields each one's new piece (detokenizer + stop strings, in ChoiceOutput)
as the engine produces tokens; the endpoint's format (openai_format)
renders it. The Responses API (responses_api) builds its prompt and choice
with the public helpers here (chat_prompt_ids, choices, run) as well.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager

import orjson

from server.api.completions.format import ChatFormat, CompletionFormat
from server.api.completions.params import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    GenerationRequest,
    build_sampling_params,
    count_sequences,
    parse_chat_request,
    parse_completion_request,
    parse_json_body,
)
from server.generation.chat_template import ChatTemplate, check_messages, require_template
from server.generation.choice_output import ChoiceOutput, TokenEntry
from server.generation.choice_run import ChoiceRun
from server.generation.prompt_encoder import PromptEncoder
from server.http.errors import ApiError, describe_value
from server.http.server import HttpRequest, Responder
from server.http.sse import DONE, encode_error, encode_event, stream_with_keepalive
from server.worker.request_state import RequestState
from shared.vocabulary import SEED_BITS

Format = CompletionFormat | ChatFormat
Admit = Callable[[int, str], AbstractContextManager]


class OpenAIHandlers:
    def __init__(self, engine_client, prompt_encoder: PromptEncoder, model_name: str, max_model_len: int,
                 chat_template: ChatTemplate | None, *,
                 on_request_done: Callable[[RequestState, str], None] | None = None):
        """on_request_done(state, outcome): once per choice when it ends; outcome is its finish reason
        ("stop", "length", "abort" when the client left or another choice failed) or "error"."""
        self.engine_client = engine_client
        self.prompt_encoder = prompt_encoder
        self.tokenizer = prompt_encoder.tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.chat_template = chat_template
        self.on_request_done = on_request_done

    # ------------------------------------------------------------------------------------------ endpoints

    async def completions(self, request: HttpRequest, responder: Responder, admit: Admit) -> None:
        """admit(num_seqs, param): the app's admission, held while the request is served."""
        body = parse_json_body(request.body)
        n, num_prompts = count_sequences(body)
        with admit(n * num_prompts, "prompt" if num_prompts > 1 else "n"):
            params = parse_completion_request(body, self.max_model_len)
            self.check_model(params.model)
            prompt_ids = [await self._encode_prompt(p) for p in params.prompts]
            echo_texts = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in params.prompts]
            fmt = CompletionFormat(self.tokenizer, echo_texts if params.echo else None, prompt_ids,
                                   params.num_logprobs is not None, params.n)
            await self._generate(params, prompt_ids, fmt, DEFAULT_COMPLETION_MAX_TOKENS, responder)

    async def chat_completions(self, request: HttpRequest, responder: Responder, admit: Admit) -> None:
        params = parse_chat_request(parse_json_body(request.body))
        self.check_model(params.model)
        with admit(params.n, "n"):
            prompt_ids = await self.chat_prompt_ids(params.messages, params.add_generation_prompt)
            fmt = ChatFormat(self.tokenizer, params.num_logprobs is not None)
            await self._generate(params, [prompt_ids], fmt, None, responder)

    # ------------------------------------------------------------------------------------------ admission

    async def chat_prompt_ids(self, messages: object, add_generation_prompt: bool = True) -> list[int]:
        """`messages` checked and rendered by the chat template, as the prompt's token ids."""
        template = require_template(self.chat_template, self.model_name)
        checked = check_messages(messages)
        self.prompt_encoder.check_length(sum(len(m["content"]) for m in checked), param="messages")
        text = template.render(checked, bos_token=self.tokenizer.bos_token, eos_token=self.tokenizer.eos_token,
                               add_generation_prompt=add_generation_prompt)
        # The template wrote any BOS itself.
        prompt_ids = await self.prompt_encoder.encode(text, add_special_tokens=False, param="messages")
        if not prompt_ids:
            raise ApiError(400, "the chat template rendered these messages as an empty prompt", param="messages")
        return self._check_token_ids(prompt_ids)

    def check_model(self, model: str | None) -> None:
        check_model_name(model, self.model_name)

    async def _encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self._check_token_ids(await self.prompt_encoder.encode(prompt))
        if len(prompt) >= self.max_model_len:
            raise _context_error(self.max_model_len, len(prompt), None, "prompt")
        return self._check_token_ids(list(prompt))

    def _check_token_ids(self, token_ids: list[int]) -> list[int]:
        vocab_size = self._vocab_size()
        if max(token_ids) >= vocab_size:
            raise ApiError(400, f"prompt token ids must be below the vocabulary size {vocab_size}, got "
                                f"{max(token_ids)}", param="prompt")
        return token_ids

    def _check_logit_bias(self, logit_bias: dict[int, float]) -> None:
        vocab_size = self._vocab_size()
        if logit_bias and max(logit_bias) >= vocab_size:
            raise ApiError(400, f"logit_bias keys must be token ids below the vocabulary size {vocab_size}, got "
                                f"{max(logit_bias)}", param="logit_bias")

    def _vocab_size(self) -> int:
        info = self.engine_client.worker_info
        return info.vocab_size if info is not None else self.tokenizer.vocab_size

    def _max_tokens(self, requested: int | None, num_prompt_tokens: int, default: int | None,
                    max_tokens_param: str) -> int:
        room = self.max_model_len - num_prompt_tokens
        if room < 1 or (requested is not None and requested > room):
            raise _context_error(self.max_model_len, num_prompt_tokens, requested,
                                 max_tokens_param if room >= 1 else "prompt")
        if requested is not None:
            return requested
        return room if default is None else min(default, room)

    def choices(self, params: GenerationRequest, prompt_ids: list[list[int]], default_max_tokens: int | None,
                request_id: str, *, max_tokens_param: str = "max_tokens") -> list[ChoiceOutput]:
        """One ChoiceOutput per (prompt, i < n), all checked before any is admitted.

        max_tokens_param: the request field a too-large max_tokens is reported on.
        """
        self._check_logit_bias(params.sampling.get("logit_bias", {}))
        eos_token_ids = self._eos_token_ids()
        outputs = []
        for token_ids in prompt_ids:
            max_tokens = self._max_tokens(params.max_tokens, len(token_ids), default_max_tokens, max_tokens_param)
            for i in range(params.n):
                # A client's seed gives choice i seed + i; otherwise EngineClient.add fixes one before the first send.
                seed = (params.seed + i) % 2**SEED_BITS if params.seed is not None else None
                index = len(outputs)
                state = RequestState(f"{request_id}-{index}", token_ids, build_sampling_params(params, max_tokens, seed),
                                     priority=params.priority)
                outputs.append(ChoiceOutput(index, state, self.tokenizer, stop=params.stop,
                                            include_stop_str_in_output=params.include_stop_str_in_output,
                                            eos_token_ids=eos_token_ids))
        return outputs

    def _eos_token_ids(self) -> tuple[int, ...]:
        info = self.engine_client.worker_info
        ids = set(info.eos_token_ids) if info is not None else set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(ids)

    # ------------------------------------------------------------------------------------------ answering

    def run(self, outputs: list[ChoiceOutput], responder: Responder) -> ChoiceRun:
        """`async with handlers.run(outputs, responder) as run:` puts the choices in flight for that block."""
        return ChoiceRun(self.engine_client, outputs, responder, self.on_request_done)

    async def _generate(self, params: GenerationRequest, prompt_ids: list[list[int]], fmt: Format,
                        default_max_tokens: int | None, responder: Responder) -> None:
        request_id = f"{fmt.id_prefix}-{uuid.uuid4().hex}"
        outputs = self.choices(params, prompt_ids, default_max_tokens, request_id)
        envelope = {"id": request_id, "object": fmt.chunk_object if params.stream else fmt.object,
                    "created": int(time.time()), "model": self.model_name}
        num_prompt_tokens = sum(len(ids) for ids in prompt_ids)
        async with self.run(outputs, responder) as run:
            if params.stream:
                await responder.start_stream()
                events = self._stream_events(run, fmt, envelope, params.include_usage, num_prompt_tokens)
                async with contextlib.aclosing(events):
                    await stream_with_keepalive(responder, events)
                await responder.end_stream()
            else:
                body = await self._full_response(run, fmt, envelope, num_prompt_tokens)
                await responder.send(200, orjson.dumps(body))

    async def _stream_events(self, run: ChoiceRun, fmt: Format, envelope: dict, include_usage: bool,
                             num_prompt_tokens: int) -> AsyncIterator[bytes]:
        if include_usage:
            envelope = {**envelope, "usage": None}

        def chunk(choice: dict) -> bytes:
            return encode_event({**envelope, "choices": [choice]})

        for out in run.outputs:
            first = fmt.start_choice(out)
            if first is not None:
                yield chunk(first)
        while not run.is_finished:
            out, piece = await run.next()
            if out.state.error is not None:
                yield encode_error(out.state.error, out.state.error_type or "server_error")
                return
            if piece is not None and (piece.text or piece.entries):
                yield chunk(fmt.piece_choice(out, piece))
            if out.is_finished:
                yield chunk(fmt.finish_choice(out))
        if include_usage:
            yield encode_event({**envelope, "choices": [], "usage": _usage(num_prompt_tokens, run.outputs)})
        yield DONE

    async def _full_response(self, run: ChoiceRun, fmt: Format, envelope: dict, num_prompt_tokens: int) -> dict:
        outputs = run.outputs
        texts: list[list[str]] = [[] for _ in outputs]
        entries: list[list[TokenEntry]] = [[] for _ in outputs]
        while not run.is_finished:
            out, piece = await run.next()
            if out.state.error is not None:
                raise choice_error(out)
            if piece is not None:
                texts[out.index].append(piece.text)
                entries[out.index].extend(piece.entries)
        choices = [fmt.full_choice(out, "".join(texts[out.index]), entries[out.index]) for out in outputs]
        return {**envelope, "choices": choices, "usage": _usage(num_prompt_tokens, outputs),
                "system_fingerprint": None}


def check_model_name(model: object, served: str) -> None:
    """404 unless `model` is None (any) or the served model's name."""
    if model is not None and model != served:
        raise ApiError(404, f"the model {describe_value(model)} does not exist; this server serves {served!r}",
                       param="model", code="model_not_found")


def _context_error(max_model_len: int, num_prompt_tokens: int, requested: int | None, param: str) -> ApiError:
    asked = f"{requested} tokens to generate" if requested is not None else "at least 1 token to generate"
    return ApiError(400, f"this model's maximum context length is {max_model_len} tokens, but the request has "
                         f"{num_prompt_tokens} prompt tokens and asks for {asked}", param=param,
                    code="context_length_exceeded")


def choice_error(out: ChoiceOutput) -> ApiError:
    """The error response for a choice that failed before a response was started."""
    status = 400 if out.state.error_type == "invalid_request_error" else 500
    return ApiError(status, out.state.error, type=out.state.error_type)


def _usage(num_prompt_tokens: int, outputs: list[ChoiceOutput]) -> dict:
    num_completion_tokens = sum(out.num_tokens for out in outputs)
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}
