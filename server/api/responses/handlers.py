"""ResponsesHandlers: POST /v1/responses, GET and DELETE /v1/responses/{id}, with the conversation in a StateStore.

Owns: building a turn's messages (the stored conversation of
previous_response_id, this turn's input, its instructions first), answering
with one response object or the Responses API's stream of events, and
writing the finished response to the store.
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
from server.api.responses.format import RESPONSE_ID_PATTERN, ResponseFormat, is_response_id, new_response_id, output_text
from server.api.responses.params import ResponsesRequest, parse_responses_request
from server.generation.choice_output import ChoiceOutput
from server.generation.choice_run import ChoiceRun
from server.generation.service import GenerationService
from server.http.errors import RETRY_AFTER_S, ApiError
from server.http.server import HttpRequest, Responder
from server.http.sse import encode_event, stream_events
from server.state_store.store import CorruptRecordError, StateStore, StateStoreError, StoredResponse

STORE_UNAVAILABLE = "service_unavailable"  # the code of a stream's error event when the store failed


class ResponsesHandlers:
    def __init__(self, generation: GenerationService, store: StateStore):
        self.generation = generation
        self.store = store

    # ------------------------------------------------------------------------------------------ endpoints

    async def create(self, admit: Admit, request: HttpRequest, responder: Responder) -> None:
        """POST /v1/responses. Readiness (503 while no worker is ready) is checked after the store has been
        read. `admit(num_seqs, param)` is the router's admission, held while the response is generated."""
        params = parse_responses_request(parse_json_body(request.body))
        history = await self._history(params.previous_response_id)
        self.generation.check_ready()
        self.generation.check_model(params.model)
        with admit(1, "input"):
            await self._create(params, history, responder)

    async def _create(self, params: ResponsesRequest, history: list[dict], responder: Responder) -> None:
        generation = self.generation
        conversation = [*history, *params.input]
        instructions = [] if params.instructions is None else [{"role": "system", "content": params.instructions}]
        prompt_ids = await generation.chat_prompt_ids([*instructions, *conversation])
        response_id = new_response_id()
        request = params.generation_request()
        [out] = generation.choices(request, [prompt_ids], None, response_id, max_tokens_param="max_output_tokens",
                                   grammar=await generation.compile_grammar(request.grammar))
        fmt = ResponseFormat(response_id, generation.model_name, out.state.params, text=params.text,
                             instructions=params.instructions,
                             previous_response_id=params.previous_response_id,
                             max_output_tokens=params.max_output_tokens, store=params.store, metadata=params.metadata)
        turn = _Turn(params, fmt, out, conversation)
        async with generation.run([out], responder) as run:
            if params.stream:
                await stream_events(responder, self._stream_events(run, turn))
                return
            [collected] = await run.collect()
            text = collected.text
        response = turn.finished(text)
        try:
            await self._store(turn, response, text)
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

    async def _store(self, turn: _Turn, response: dict, text: str) -> None:
        if turn.params.store:
            messages = [*turn.conversation, {"role": "assistant", "content": text}]
            await self.store.put(StoredResponse(response, messages))

    # ------------------------------------------------------------------------------------------ streaming

    async def _stream_events(self, run: ChoiceRun, turn: _Turn) -> AsyncGenerator[bytes, None]:
        fmt = turn.fmt
        in_progress = fmt.response()
        yield _event(fmt.event("response.created", response=in_progress))
        yield _event(fmt.event("response.in_progress", response=in_progress))
        yield _event(fmt.event("response.output_item.added", output_index=0, item=fmt.message(None, "in_progress")))
        yield _event(fmt.text_event("response.content_part.added", part=output_text("")))
        texts = []
        while not run.is_finished:
            out, piece = await run.next()
            if out.state.error is not None:
                yield _event(fmt.event("error", code=out.state.error_type or "server_error", message=out.state.error,
                                       param=None))
                return
            if piece is not None and piece.text:
                texts.append(piece.text)
                yield _event(fmt.text_event("response.output_text.delta", delta=piece.text, logprobs=[]))
        text = "".join(texts)
        response = turn.finished(text)
        yield _event(fmt.text_event("response.output_text.done", text=text, logprobs=[]))
        yield _event(fmt.text_event("response.content_part.done", part=output_text(text)))
        yield _event(fmt.event("response.output_item.done", output_index=0, item=response["output"][0]))
        try:
            await self._store(turn, response, text)
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

    def finished(self, text: str) -> dict:
        out = self.out
        return self.fmt.response(text, out.finish_reason, (len(out.state.prompt_token_ids), out.num_tokens))


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
