"""The body of a completions or chat request, checked: OpenAI's fields (and vLLM's extensions) -> GenerationRequest.

Owns: JSON decoding, the type and range of every field, and the ApiError
(400, naming the field in `param`) for a bad one. Which fields are taken,
accepted without effect, refused or unknown is fields.py's table. Null
counts as absent.
Must not know: tokens, the model's limits (the handler checks lengths, and
hands in the context length so that a huge token id list is refused before
it is walked), HTTP.
"""

from __future__ import annotations

import orjson

from server.api.body_fields import get_field, get_int, get_number, is_int, is_number
from server.api.completions.fields import Endpoint, check_fields
from server.api.completions.tool_fields import parse_tool_choice
from server.api.structured_fields import grammar_spec
from server.api.tool_choice_fields import output_grammar
from server.generation.request import DEFAULT_MAX_LOGPROBS, GenerationRequest
from server.http.errors import ApiError, describe_value
from shared.sampling_params import MAX_INT32

MAX_N = 128  # choices per request; each one is a sequence in the engine
DEFAULT_COMPLETION_MAX_TOKENS = 16
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
MAX_TOKEN_ID_DIGITS = len(str(MAX_INT32))
# chat_template_kwargs keys that name what the request sets otherwise, each with where it is set. All are a 400
# here; vLLM refuses chat_template and tokenize, fails on messages and tools, and silently lets its own
# add_generation_prompt and continue_final_message win, which would hide the client's mistake.
SERVER_TEMPLATE_VARIABLES = {
    "messages": "the template is given the request's messages under that name",
    "tools": "the template is given the request's tools under that name",
    "add_generation_prompt": "set the request field add_generation_prompt instead",
    "continue_final_message": "set the request field continue_final_message instead",
    "chat_template": "set the request field chat_template instead",
    "tokenize": "the server tokenizes the rendered prompt itself",
}


def parse_json_body(body: bytes) -> dict:
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"expected a JSON object as the request body, got invalid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ApiError(400, f"expected a JSON object as the request body, got a JSON {type(value).__name__}")
    return value


def parse_completion_request(body: dict, max_prompt_tokens: int | None = None,
                             max_logprobs: int = DEFAULT_MAX_LOGPROBS) -> GenerationRequest:
    """max_prompt_tokens: the context length, if known; a token id prompt that long is refused unread.
    max_logprobs: the most alternatives `logprobs` and `prompt_logprobs` may ask for (--max-logprobs)."""
    check_fields(body, Endpoint.COMPLETIONS)
    request = _parse_common(body)
    request.prompts = _prompts(body.get("prompt"), max_prompt_tokens)
    request.echo = get_field(body, "echo", bool, "a boolean", False)
    request.max_tokens = get_int(body, "max_tokens", minimum=0)
    if request.max_tokens == 0 and not request.echo:
        raise ApiError(400, "max_tokens must be >= 1, got 0: 0 is taken only with echo (the prompt alone, scored "
                            "with logprobs), and without echo there would be nothing to return", param="max_tokens")
    request.add_special_tokens = get_field(body, "add_special_tokens", bool, "a boolean", True)
    request.num_logprobs = get_top_k(body, "logprobs", max_logprobs)
    # As vLLM's: echo with logprobs scores the prompt's tokens too, with as many alternatives.
    _parse_prompt_logprobs(body, request, max_logprobs, request.num_logprobs if request.echo else None)
    return request


def get_top_k(body: dict, name: str, max_logprobs: int) -> int | None:
    """A number of most likely alternatives to return, bounded by the server's --max-logprobs."""
    value = get_int(body, name, minimum=0)
    if value is not None and value > max_logprobs:
        raise ApiError(400, f"{name} must be at most {max_logprobs} (this server's --max-logprobs), got {value}",
                       param=name)
    return value


def _parse_prompt_logprobs(body: dict, request: GenerationRequest, max_logprobs: int, default: int | None) -> None:
    """vLLM's prompt_logprobs: the prompt tokens' own logprobs and top alternatives, in the whole response only."""
    value = get_top_k(body, "prompt_logprobs", max_logprobs)
    if value and request.stream:
        raise ApiError(400, "`prompt_logprobs` are not available when `stream=True` (vLLM's rule): they come in "
                            "the whole response only", param="prompt_logprobs")
    request.num_prompt_logprobs = value if value is not None else default


def parse_chat_request(body: dict, max_logprobs: int = DEFAULT_MAX_LOGPROBS) -> GenerationRequest:
    """max_logprobs: the most alternatives `top_logprobs` and `prompt_logprobs` may ask for (--max-logprobs)."""
    check_fields(body, Endpoint.CHAT)
    request = _parse_common(body)
    if "messages" not in body:
        raise ApiError(400, "messages is required", param="messages")
    request.messages = body["messages"]
    max_tokens = get_int(body, "max_completion_tokens", minimum=1)
    request.max_tokens = max_tokens if max_tokens is not None else get_int(body, "max_tokens", minimum=1)
    _parse_chat_template_fields(body, request)
    _parse_tool_choice(body, request)
    request.add_special_tokens = get_field(body, "add_special_tokens", bool, "a boolean", False)
    top_logprobs = get_top_k(body, "top_logprobs", max_logprobs)
    if get_field(body, "logprobs", bool, "a boolean", False):
        request.num_logprobs = top_logprobs or 0
    elif top_logprobs:
        raise ApiError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
    _parse_prompt_logprobs(body, request, max_logprobs, None)
    return request


def _parse_tool_choice(body: dict, request: GenerationRequest) -> None:
    """tools and tool_choice; a forced choice (required, a named function) becomes the request's grammar."""
    request.tool_choice = parse_tool_choice(body)
    request.grammar = output_grammar(request.tool_choice, request.grammar, body.get("tool_choice"))


def _parse_chat_template_fields(body: dict, request: GenerationRequest) -> None:
    """add_generation_prompt, continue_final_message, chat_template and chat_template_kwargs (vLLM's fields)."""
    request.add_generation_prompt = get_field(body, "add_generation_prompt", bool, "a boolean", True)
    request.continue_final_message = get_field(body, "continue_final_message", bool, "a boolean", False)
    if request.continue_final_message and request.add_generation_prompt:
        # vLLM refuses both set to true; left at its default of true, add_generation_prompt fails the same way there
        raise ApiError(400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True "
                            "(add_generation_prompt defaults to true: send it as false)", param="continue_final_message")
    request.chat_template = get_field(body, "chat_template", str, "a string (a jinja2 template)", None)
    kwargs = get_field(body, "chat_template_kwargs", dict, "an object (variable name -> value)", {})
    for name in kwargs:
        if name in SERVER_TEMPLATE_VARIABLES:
            raise ApiError(400, f"chat_template_kwargs must not set {name!r}: {SERVER_TEMPLATE_VARIABLES[name]}",
                           param=f"chat_template_kwargs.{name}")
    request.chat_template_kwargs = kwargs


def _parse_common(body: dict) -> GenerationRequest:
    request = GenerationRequest(model=get_field(body, "model", str, "a string", None))
    request.n = get_int(body, "n", minimum=1, maximum=MAX_N, default=1)
    request.stream = get_field(body, "stream", bool, "a boolean", False)
    options = get_field(body, "stream_options", dict, "an object", {})
    request.include_usage = get_field(options, "include_usage", bool, "a boolean", False, where="stream_options.")
    request.continuous_usage_stats = get_field(options, "continuous_usage_stats", bool, "a boolean", False,
                                               where="stream_options.")
    if options and not request.stream:
        raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options")
    request.stop = _stop_strings(body.get("stop"))
    request.include_stop_str_in_output = get_field(body, "include_stop_str_in_output", bool, "a boolean", False)
    request.seed = get_int(body, "seed")
    request.priority = get_int(body, "priority", minimum=-MAX_INT32, maximum=MAX_INT32, default=0)
    request.sampling = _sampling_fields(body)
    request.grammar = grammar_spec(body)
    return request


def _sampling_fields(body: dict) -> dict:
    fields = {}
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = get_number(body, name)
        if value is not None:
            fields[name] = value
    check_temperature(fields.get("temperature"))
    top_k = get_int(body, "top_k", maximum=MAX_INT32)
    if top_k is not None and top_k < -1:
        raise ApiError(400, f"top_k must be -1 (off) or an integer >= 1, got {top_k}", param="top_k")
    if top_k is not None:  # vLLM's spelling of "no top-k" is -1 (or 0): set, so that no default top_k applies
        fields["top_k"] = top_k if top_k > 0 else None
    fields["min_tokens"] = get_int(body, "min_tokens", minimum=0, default=0)
    fields["ignore_eos"] = get_field(body, "ignore_eos", bool, "a boolean", False)
    stop_token_ids = get_field(body, "stop_token_ids", list, "a list of token ids", [])
    if not all(is_int(t) and t >= 0 for t in stop_token_ids):
        raise ApiError(400, f"stop_token_ids must be a list of token ids >= 0, got {stop_token_ids!r:.100}",
                       param="stop_token_ids")
    fields["stop_token_ids"] = tuple(stop_token_ids)
    fields["logit_bias"] = _logit_bias(get_field(body, "logit_bias", dict, "an object", {}))
    return fields


def check_temperature(temperature: float | None) -> None:
    if temperature is not None and not 0 <= temperature <= MAX_TEMPERATURE:
        raise ApiError(400, f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], got {temperature!r}",
                       param="temperature")


def count_sequences(body: dict) -> tuple[int, int]:
    """(n, number of prompts) of a completions body, found without walking the prompts: admission takes their
    product before a list of a million prompts is looked at."""
    n = get_int(body, "n", minimum=1, maximum=MAX_N, default=1)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return n, len(prompt)
    return n, 1


def _prompts(prompt: object, max_prompt_tokens: int | None) -> list[str | list[int]]:
    """A string, a list of strings, a list of token ids, or a list of token id lists -> one entry per prompt.

    A token id list of max_prompt_tokens or more cannot fit the context: it is refused before its ids are walked.
    """
    if prompt is None:
        raise ApiError(400, "prompt is required", param="prompt")
    if isinstance(prompt, list) and not prompt:
        raise ApiError(400, "prompt must not be empty", param="prompt")
    prompts: list[str | list[int]]
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and _types(prompt) == {int}:
        prompts = [prompt]
    elif isinstance(prompt, list) and _types(prompt) in ({str}, {list}):
        prompts = list(prompt)
    else:
        raise _bad_prompt(prompt)
    if max_prompt_tokens is not None and any(isinstance(p, list) and len(p) >= max_prompt_tokens for p in prompts):
        longest = max(len(p) for p in prompts if isinstance(p, list))
        raise ApiError(400, f"this model's maximum context length is {max_prompt_tokens} tokens, but the request has "
                            f"{longest} prompt tokens", param="prompt", code="context_length_exceeded")
    if any(isinstance(p, list) and p and _types(p) != {int} for p in prompts):
        raise _bad_prompt(prompt)
    if any(len(p) == 0 for p in prompts):
        raise ApiError(400, "prompt must not be empty", param="prompt")
    if any(isinstance(p, list) and min(p) < 0 for p in prompts):
        raise ApiError(400, "prompt token ids must be >= 0", param="prompt")
    return prompts


def _types(values: list) -> set[type]:
    """The types in `values`, at C speed (bool is its own type, so True is no token id)."""
    return set(map(type, values))


def _bad_prompt(prompt: object) -> ApiError:
    return ApiError(400, "prompt must be a string, a list of strings, a list of token ids or a list of token id "
                         f"lists, got {describe_value(prompt)}", param="prompt")


def _stop_strings(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, f"stop must be a non-empty string or a list of them, got {describe_value(stop)}", param="stop")
    return tuple(stops)


def _logit_bias(bias: dict) -> dict[int, float]:
    result = {}
    for key, value in bias.items():
        token_id = int(key) if key.isascii() and key.isdigit() and len(key) <= MAX_TOKEN_ID_DIGITS else None
        if token_id is None or token_id > MAX_INT32:
            raise ApiError(400, f"logit_bias keys must be token ids (integers in [0, {MAX_INT32}]), got "
                                f"{describe_value(key)}", param="logit_bias")
        if not is_number(value) or not -100 <= value <= 100:
            raise ApiError(400, f"logit_bias[{key}] must be a number in [-100, 100], got {describe_value(value)}",
                           param="logit_bias")
        result[token_id] = float(value)
    return result
