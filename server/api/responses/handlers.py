"""ResponsesHandlers: POST /v1/responses, GET and DELETE /v1/responses/{id}, with the conversation in a StateStore.

Owns: building a turn's messages (the stored conversation of
previous_response_id, this turn's input, its instructions first) and its
tools, answering with one response object or the Responses API's stream of
events (its items built by output_items.py), and writing the finished
response to the store.
Must not know: routing, auth, admission limits (the router hands in its
`admit`), how the store keeps records, HTTP framing, torch.
How: the prompt is the messages rendered by the chat template and checked
against the context length by the GenerationService, which the chat
endpoints use too, and the one choice is generated through the same
ChoiceRun. A response is stored only once complete (status completed or
incomplete), in one write; a failed or abandoned generation stores nothing.
When the store fails the client gets a 503 with Retry-After, or, once a
stream has begun, an `error` event in place of response.completed: either
way nothing is stored and nothing claims to be.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass

import orjson

from server.api.completions.handlers import Admit
from server.api.completions.params import parse_json_body
from server.api.responses.format import RESPONSE_ID_PATTERN, ResponseFormat, is_response_id, new_response_id
from server.api.responses.output_items import OutputItems
from server.api.responses.params import ResponsesRequest, parse_responses_request
from server.api.tool_choice_fields import check_auto_servable
from server.generation.choice_output import ChoiceOutput
from server.generation.choice_run import ChoiceRun
from server.generation.service import GenerationService
from server.generation.tool_parsers import ToolParser
from server.http.errors import RETRY_AFTER_S, ApiError
from server.http.server import HttpRequest, Responder
from server.http.sse import encode_event, stream_events
from server.http.trace_context import trace_context
from server.state_store.store import CorruptRecordError, StateStore, StateStoreError, StoredResponse

STORE_UNAVAILABLE = "service_unavailable"  # the code of a stream's error event when the store failed


class ResponsesHandlers:
    def __init__(self, generation: GenerationService, store: StateStore,
                 tool_call_parser: type[ToolParser] | None = None):
        """tool_call_parser: reads the calls out of tool_choice "auto" outputs; None: "auto" is refused."""
        self.generation = generation
        self.store = store
        self.tool_call_parser = tool_call_parser

    # ------------------------------------------------------------------------------------------ endpoints

    async def create(self, admit: Admit, request: HttpRequest, responder: Responder) -> None:
        """POST /v1/responses. Readiness (503 while no worker is ready) is checked after the store has been
        read. `admit(num_seqs, param)` is the router's admission, held while the response is generated."""
        params = parse_responses_request(parse_json_body(request.body))
        check_auto_servable(params.tool_choice, self.tool_call_parser)
        history = await self._history(params.previous_response_id)
        self.generation.check_ready()
        self.generation.check_model(params.model)
        with admit(1, "input"):
            await self._create(params, history, trace_context(request.headers), responder)

    async def _create(self, params: ResponsesRequest, history: list[dict], trace: dict[str, str] | None,
                      responder: Responder) -> None:
        generation = self.generation
        conversation = [*history, *params.input]
        instructions = [] if params.instructions is None else [{"role": "system", "content": params.instructions}]
        tool_choice = params.tool_choice
        prompt_ids = await generation.chat_prompt_ids([*instructions, *conversation],
                                                      tools=tool_choice.tools if tool_choice is not None else None)
        response_id = new_response_id()
        request = params.generation_request()
        [out] = generation.choices(request, [prompt_ids], None, response_id, max_tokens_param="max_output_tokens",
                                   grammar=await generation.compile_grammar(request.grammar), trace_context=trace)
        fmt = ResponseFormat(response_id, generation.model_name, out.state.params, text=params.text,
                             instructions=params.instructions,
                             previous_response_id=params.previous_response_id,
                             max_output_tokens=params.max_output_tokens, store=params.store, metadata=params.metadata,
                             tool_fields=params.tool_fields)
        parser = tool_choice.new_parser(self.tool_call_parser) if tool_choice is not None else None
        turn = _Turn(params, fmt, out, conversation, OutputItems(fmt, parser))
        async with generation.run([out], responder) as run:
            if params.stream:
                await stream_events(responder, self._stream_events(run, turn))
                return
            [collected] = await run.collect()
        turn.items.feed(collected.text)
        turn.finish()
        response = turn.response()
        try:
            await self._store(turn, response)
        except StateStoreError as exc:
            raise _store_unavailable(exc) from exc
        await responder.send(200, orjson.dumps(response))

    async def retrieve(self, response_id: str, responder: Responder) -> None:
        """GET /v1/responses/{response_id}."""
        record = await self._load(_checked_id(response_id, None), None)
        await responder.send(200, orjson.dumps(record.response))

    async def delete(self, response_id: str, responder: Responder) -> None:
        """DELETE /v1/responses/{response_id}."""
        _checked_id(response_id, None)
        try:
            deleted = await self.store.delete(response_id)
        except StateStoreError as exc:
            raise _store_unavailable(exc) from exc
        if not deleted:
            raise _not_found(response_id, None)
        await responder.send(200, orjson.dumps({"id": response_id, "object": "response", "deleted": True}))

    async def cancel(self, response_id: str) -> None:
        """POST /v1/responses/{response_id}/cancel. OpenAI cancels only a response created with background true,
        while it is queued or in progress; this server runs none in the background, so every response it stored
        is complete and the answer is OpenAI's 400 for one created without background (404 when none is stored)."""
        await self._load(_checked_id(response_id, None), None)
        raise ApiError(400, f"response {response_id!r} was not created with background true: only a background "
                            "response can be cancelled, and this server runs none in the background")

    # ------------------------------------------------------------------------------------------ the store

    async def _history(self, previous_response_id: str | None) -> list[dict]:
        """The conversation to continue: the previous response's messages (its output last), or none."""
        if previous_response_id is None:
            return []
        return (await self._load(previous_response_id, "previous_response_id")).messages

    async def _load(self, response_id: str, param: str | None) -> StoredResponse:
        try:
            record = await self.store.get(response_id)
        except StateStoreError as exc:
            raise _store_unavailable(exc) from exc
        except CorruptRecordError as exc:
            raise ApiError(500, f"the stored response {response_id!r} cannot be read: {exc}") from exc
        if record is None:
            raise _not_found(response_id, param)
        return record

    async def _store(self, turn: _Turn, response: dict) -> None:
        if turn.params.store:
            messages = [*turn.conversation, turn.items.assistant_message()]
            await self.store.put(StoredResponse(response, messages))

    # ------------------------------------------------------------------------------------------ streaming

    async def _stream_events(self, run: ChoiceRun, turn: _Turn) -> AsyncGenerator[bytes, None]:
        fmt, items = turn.fmt, turn.items
        in_progress = fmt.response()
        yield _event(fmt.event("response.created", response=in_progress))
        yield _event(fmt.event("response.in_progress", response=in_progress))
        for event in items.start():
            yield _event(event)
        while not run.is_finished:
            out, piece = await run.next()
            if out.state.error is not None:
                yield _event(fmt.event("error", code=out.state.error_type or "server_error", message=out.state.error,
                                       param=None))
                return
            if piece is not None and piece.text:
                for event in items.feed(piece.text):
                    yield _event(event)
        for event in turn.finish():
            yield _event(event)
        response = turn.response()
        try:
            await self._store(turn, response)
        except StateStoreError as exc:
            error = _store_unavailable(exc)
            yield _event(fmt.event("error", code=STORE_UNAVAILABLE, message=error.message, param=None))
            return
        yield _event(fmt.event(f"response.{response['status']}", response=response))


@dataclass(slots=True)
class _Turn:
    """One POST's parts that outlive its checks: the request, its format, its choice, its conversation."""

    params: ResponsesRequest
    fmt: ResponseFormat
    out: ChoiceOutput
    conversation: list[dict]  # earlier turns and this input, without instructions: they are not carried on
    items: OutputItems

    def finish(self) -> list[dict]:
        """Closes the output's items once the choice has finished; the stream's events for that."""
        return self.items.finish(self.fmt.status(self.out.finish_reason))

    def response(self) -> dict:
        """The finished response."""
        out = self.out
        return self.fmt.response(self.items.output, out.finish_reason,
                                 (len(out.state.prompt_token_ids), out.num_tokens))


def _event(payload: dict) -> bytes:
    return encode_event(payload, event=payload["type"])


def _checked_id(response_id: str, param: str | None) -> str:
    if not is_response_id(response_id):
        raise ApiError(400, f"expected a response id ({RESPONSE_ID_PATTERN}), got {response_id[:80]!r}", param=param)
    return response_id


def _not_found(response_id: str, param: str | None) -> ApiError:
    return ApiError(404, f"no response {response_id!r} is stored (it was created with store false, deleted, or never "
                         "existed)", param=param, code="previous_response_not_found" if param else None)


def _store_unavailable(exc: StateStoreError) -> ApiError:
    return ApiError(503, f"the conversation store is unavailable ({exc}); nothing was stored, retry shortly",
                    headers={"Retry-After": RETRY_AFTER_S})
