"""CompletionsHandlers: POST /v1/completions and /v1/chat/completions, from request body to the last byte.

Owns: turning a checked request (params.py) into prompts and choices
through the GenerationService, and answering: SSE chunks as the engine
produces tokens, or one JSON body at the end.
Must not know: routing, auth, admission limits (the router hands in its
`admit`), metrics (the service reports every finished choice); HTTP framing
(the Responder); torch.
How: a request is parsed, then admitted for its number of sequences (the
router's `admit`, held until the response is done), and only then tokenized
(by the service: bounded in characters, long texts off the event loop). A
ChoiceRun holds the request's choices in flight and yields each one's new
piece (detokenizer + stop strings, in ChoiceOutput) as the engine produces
tokens; the endpoint's format (format.py) renders it. A streamed choice's
first chunk waits until its format can start it (echo with logprobs: once
the prompt's logprobs have come).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, Callable
from contextlib import AbstractContextManager

import orjson

from server.api.completions.format import ChatFormat, CompletionFormat
from server.api.completions.params import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    count_sequences,
    parse_chat_request,
    parse_completion_request,
    parse_json_body,
)
from server.api.completions.response_bound import check_response_size
from server.api.tool_choice_fields import check_auto_servable
from server.generation.choice_output import ChoiceOutput
from server.generation.choice_run import ChoiceRun
from server.generation.request import GenerationRequest
from server.generation.service import GenerationService
from server.generation.tool_parsers import ToolParser
from server.http.server import HttpRequest, Responder
from server.http.sse import DONE, encode_error, encode_event, stream_events
from server.http.trace_context import trace_context

Format = CompletionFormat | ChatFormat
Admit = Callable[[int, str], AbstractContextManager]


class CompletionsHandlers:
    def __init__(self, generation: GenerationService, tool_call_parser: type[ToolParser] | None = None):
        """tool_call_parser: reads the calls out of tool_choice "auto" outputs; None: "auto" is refused."""
        self.generation = generation
        self.tokenizer = generation.tokenizer
        self.tool_call_parser = tool_call_parser

    async def completions(self, request: HttpRequest, responder: Responder, admit: Admit) -> None:
        """admit(num_seqs, param): the router's admission, held while the request is served."""
        body = parse_json_body(request.body)
        n, num_prompts = count_sequences(body)
        with admit(n * num_prompts, "prompt" if num_prompts > 1 else "n"):
            params = parse_completion_request(body, self.generation.max_model_len, self.generation.logprobs_limit)
            self.generation.check_model(params.model)
            echoed = None
            if params.echo:
                echoed = [await self.generation.echoed_prompt(p, params.add_special_tokens) for p in params.prompts]
                prompt_ids = [prompt.token_ids for prompt in echoed]
            else:
                prompt_ids = [await self.generation.prompt_ids(p, params.add_special_tokens) for p in params.prompts]
            fmt = CompletionFormat(self.tokenizer, echoed, params.num_logprobs is not None, params.n)
            await self._generate(params, prompt_ids, fmt, DEFAULT_COMPLETION_MAX_TOKENS, request, responder)

    async def chat_completions(self, request: HttpRequest, responder: Responder, admit: Admit) -> None:
        params = parse_chat_request(parse_json_body(request.body), self.generation.logprobs_limit)
        self.generation.check_model(params.model)
        with admit(params.n, "n"):
            tool_choice = params.tool_choice
            check_auto_servable(tool_choice, self.tool_call_parser)
            prompt_ids = await self.generation.chat_prompt_ids(
                params.messages, params.add_generation_prompt, continue_final_message=params.continue_final_message,
                chat_template=params.chat_template, chat_template_kwargs=params.chat_template_kwargs,
                tools=tool_choice.tools if tool_choice is not None else None,
                add_special_tokens=params.add_special_tokens)
            fmt = ChatFormat(self.tokenizer, params.num_logprobs is not None, tool_choice, self.tool_call_parser)
            await self._generate(params, [prompt_ids], fmt, None, request, responder)

    async def _generate(self, params: GenerationRequest, prompt_ids: list[list[int]], fmt: Format,
                        default_max_tokens: int | None, request: HttpRequest, responder: Responder) -> None:
        check_response_size(params, prompt_ids, self.generation.max_model_len, default_max_tokens,
                            self.generation.max_response_bytes)
        request_id = f"{fmt.id_prefix}-{uuid.uuid4().hex}"
        grammar = await self.generation.compile_grammar(params.grammar)
        outputs = self.generation.choices(params, prompt_ids, default_max_tokens, request_id, grammar=grammar,
                                          trace_context=trace_context(request.headers))
        envelope = {"id": request_id, "object": fmt.chunk_object if params.stream else fmt.object,
                    "created": int(time.time()), "model": self.generation.model_name, "system_fingerprint": None}
        num_prompt_tokens = sum(len(ids) for ids in prompt_ids)
        async with self.generation.run(outputs, responder) as run:
            if params.stream:
                await stream_events(responder, self._stream_events(run, fmt, envelope, params, num_prompt_tokens))
            else:
                body = await self._full_response(run, fmt, envelope, num_prompt_tokens)
                await responder.send(200, orjson.dumps(body))

    async def _stream_events(self, run: ChoiceRun, fmt: Format, envelope: dict, params: GenerationRequest,
                             num_prompt_tokens: int) -> AsyncGenerator[bytes, None]:
        """The SSE events of a streamed response. With stream_options.include_usage, a last chunk carries the
        usage (every other chunk has usage null); with continuous_usage_stats too, every chunk carries it so far."""
        include_usage = params.include_usage
        if include_usage:
            envelope = {**envelope, "usage": None}

        def chunk(choice: dict) -> bytes:
            if params.continuous_usage_stats and include_usage:
                return encode_event({**envelope, "choices": [choice], "usage": _usage(num_prompt_tokens, run.outputs)})
            return encode_event({**envelope, "choices": [choice]})

        unstarted = list(run.outputs)  # choices whose first chunk (the role; the echoed prompt) is still to come

        def start_chunks() -> list[bytes]:
            ready = [out for out in unstarted if fmt.can_start(out)]
            for out in ready:
                unstarted.remove(out)
            return [chunk(first) for out in ready if (first := fmt.start_choice(out)) is not None]

        for event in start_chunks():
            yield event
        while not run.is_finished:
            out, piece = await run.next()
            if out.state.error is not None:
                yield encode_error(out.state.error, out.state.error_type or "server_error")
                return
            for event in start_chunks():
                yield event
            choice = fmt.piece_choice(out, piece) if piece is not None and (piece.text or piece.entries) else None
            if choice is not None:
                yield chunk(choice)
            if out.is_finished:
                yield chunk(fmt.finish_choice(out))
        if include_usage:
            yield encode_event({**envelope, "choices": [], "usage": _usage(num_prompt_tokens, run.outputs)})
        yield DONE

    async def _full_response(self, run: ChoiceRun, fmt: Format, envelope: dict, num_prompt_tokens: int) -> dict:
        collected = await run.collect()
        choices = [fmt.full_choice(out, collected[out.index].text, collected[out.index].entries)
                   for out in run.outputs]
        return {**envelope, "choices": choices, "usage": _usage(num_prompt_tokens, run.outputs),
                **fmt.response_fields(run.outputs)}


def _usage(num_prompt_tokens: int, outputs: list[ChoiceOutput]) -> dict:
    num_completion_tokens = sum(out.num_tokens for out in outputs)
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}
