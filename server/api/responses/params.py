"""The body of POST /v1/responses, checked: the Responses API's fields -> ResponsesRequest.

Owns: the type and range of every field (the input items in
input_items.py, the tools in tool_fields.py), and the ApiError (400,
naming the field in `param`) for a bad field or one this server cannot
honour.
Must not know: tokens, the stored conversation, HTTP.
How: unlike the chat endpoints, a field this server does not know is
refused rather than ignored: the Responses API's extras (reasoning,
built-in tools, background mode...) change what a response is, and a
client relying on one must hear that it did not happen. A few fields are
accepted at their neutral value (truncation "disabled", ...) and a few
that change nothing here are ignored (user, service_tier, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from server.api.body_fields import get_field, get_int, get_number
from server.api.completions.params import check_temperature
from server.api.responses.format import RESPONSE_ID_PATTERN, is_response_id
from server.api.responses.input_items import input_messages
from server.api.responses.tool_fields import DEFAULT_TOOL_CHOICE, parse_tool_choice
from server.api.structured_fields import text_format_spec
from server.api.tool_choice_fields import output_grammar
from server.generation.request import GenerationRequest
from server.generation.structured_output import GrammarSpec
from server.generation.tool_calling import ToolChoice
from server.http.errors import ApiError, describe_value

MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
PARSED_FIELDS = frozenset({"model", "input", "instructions", "previous_response_id", "store", "stream",
                           "max_output_tokens", "temperature", "top_p", "seed", "metadata", "text", "tools",
                           "tool_choice", "parallel_tool_calls"})
IGNORED_FIELDS = frozenset({"user", "safety_identifier", "prompt_cache_key", "service_tier", "stream_options"})
NEUTRAL_VALUES = {"truncation": ["disabled"], "background": [False], "include": [[]], "top_logprobs": [0]}


@dataclass(slots=True)
class ResponsesRequest:
    model: str | None
    input: list[dict]  # this turn's chat messages (input_items.py)
    instructions: str | None = None  # a system message for this turn only
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = None  # None: what the context leaves
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    text: dict = field(default_factory=lambda: {"format": {"type": "text"}})  # as the response echoes it
    grammar: GrammarSpec | None = None  # text.format json_object or json_schema, or a forced tool choice's
    tool_choice: ToolChoice | None = None  # the tools in chat's shape, and how the output becomes calls
    tool_fields: dict = field(default_factory=dict)  # tools, tool_choice and parallel_tool_calls as the response echoes them

    def generation_request(self) -> GenerationRequest:
        """What the shared generation path takes: one choice, these sampling fields."""
        sampling = {name: value for name in ("temperature", "top_p") if (value := getattr(self, name)) is not None}
        return GenerationRequest(model=self.model, max_tokens=self.max_output_tokens, stream=self.stream,
                                 seed=self.seed, sampling=sampling, grammar=self.grammar)


def parse_responses_request(body: dict) -> ResponsesRequest:
    _check_fields(body)
    if body.get("input") is None:
        raise ApiError(400, "input is required: a string or a list of messages", param="input")
    request = ResponsesRequest(model=get_field(body, "model", str, "a string", None), input=input_messages(body["input"]))
    request.instructions = get_field(body, "instructions", str, "a string", None)
    request.previous_response_id = _previous_response_id(body.get("previous_response_id"))
    request.store = get_field(body, "store", bool, "a boolean", True)
    request.stream = get_field(body, "stream", bool, "a boolean", False)
    request.max_output_tokens = get_int(body, "max_output_tokens", minimum=1)
    request.temperature = get_number(body, "temperature")
    check_temperature(request.temperature)
    request.top_p = get_number(body, "top_p")
    request.seed = get_int(body, "seed")
    request.metadata = _metadata(get_field(body, "metadata", dict, "an object of strings", {}))
    grammar = text_format_spec(body.get("text"))
    if grammar is not None:
        request.text = body["text"]
    request.tool_choice = parse_tool_choice(body)
    request.grammar = output_grammar(request.tool_choice, grammar, body.get("tool_choice"))
    request.tool_fields = {"tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or DEFAULT_TOOL_CHOICE,
                    "parallel_tool_calls": body.get("parallel_tool_calls") is not False}
    return request


def _check_fields(body: dict) -> None:
    for name, value in body.items():
        if name in PARSED_FIELDS or name in IGNORED_FIELDS or value is None:
            continue
        if name in NEUTRAL_VALUES:
            if value not in NEUTRAL_VALUES[name]:
                neutral = " or ".join(describe_value(v) for v in NEUTRAL_VALUES[name])
                raise ApiError(400, f"{name} is not supported by this server (only {neutral}), got {describe_value(value)}",
                               param=name)
            continue
        raise ApiError(400, f"unsupported parameter {name!r}: this server's Responses API takes "
                            f"{', '.join(sorted(PARSED_FIELDS))}", param=name)


def _previous_response_id(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not is_response_id(value):
        raise ApiError(400, f"previous_response_id must be a response id ({RESPONSE_ID_PATTERN}), got "
                            f"{describe_value(value)}", param="previous_response_id")
    return value


def _metadata(metadata: dict) -> dict[str, str]:
    if len(metadata) > MAX_METADATA_PAIRS:
        raise ApiError(400, f"metadata takes at most {MAX_METADATA_PAIRS} pairs, got {len(metadata)}", param="metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS or not isinstance(value, str) or len(value) > MAX_METADATA_VALUE_CHARS:
            raise ApiError(400, f"metadata must map keys of at most {MAX_METADATA_KEY_CHARS} characters to strings of "
                                f"at most {MAX_METADATA_VALUE_CHARS}, got {key!r:.80}: {describe_value(value)}",
                           param=f"metadata.{key}"[:80])
    return dict(metadata)
