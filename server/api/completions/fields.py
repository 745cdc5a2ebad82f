"""Which request fields /v1/completions and /v1/chat/completions take: one table for both endpoints.

Every field a client may send is one of:
- implemented: params.py reads it and it changes what is generated or returned;
- harmless: accepted and without effect on the output (`user`, `metadata`, `service_tier`, ...);
- not implemented: a 400 naming the field in `param`, unless it carries the value that means what this
  server does anyway (`best_of` equal to `n`, `use_beam_search` false, `skip_special_tokens` true, ...);
- unknown: accepted, and logged once per field name at warning level (as vLLM does, so that clients
  that send extra fields keep working); the first MAX_WARNED_NAMES names only, so that a client
  inventing names can neither grow memory nor flood the log.
Null counts as absent, for every kind.
"""

from __future__ import annotations

import enum
import logging

from server.http.errors import ApiError, describe_value

logger = logging.getLogger("pagedserve.api")


class Endpoint(enum.Enum):
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"


_BOTH = frozenset({"model", "n", "stream", "stream_options", "stop", "include_stop_str_in_output", "seed",
                      "priority", "max_tokens", "temperature", "top_p", "min_p", "presence_penalty",
                      "frequency_penalty", "repetition_penalty", "top_k", "min_tokens", "ignore_eos",
                      "stop_token_ids", "logit_bias", "response_format", "structured_outputs", "guided_json",
                      "guided_regex", "guided_choice", "guided_grammar", "guided_whitespace_pattern"})
IMPLEMENTED = {
    Endpoint.COMPLETIONS: _BOTH | {"prompt", "echo", "logprobs", "prompt_logprobs", "add_special_tokens"},
    Endpoint.CHAT: _BOTH | {"messages", "max_completion_tokens", "add_generation_prompt", "logprobs", "top_logprobs",
                            "continue_final_message", "chat_template", "chat_template_kwargs", "tools", "tool_choice",
                            "parallel_tool_calls", "add_special_tokens", "prompt_logprobs"},
}
HARMLESS = {
    Endpoint.COMPLETIONS: frozenset({"user", "service_tier", "request_id", "guided_decoding_backend"}),
    Endpoint.CHAT: frozenset({"user", "service_tier", "request_id", "guided_decoding_backend", "metadata", "store"}),
}
# Not implemented: each with the values that mean what this server does anyway, so a client that spells
# out a default is not refused. `n` stands for the request's own n.
_SHARED_NOT_IMPLEMENTED: dict[str, tuple[object, ...]] = {
    "best_of": ("n",), "use_beam_search": (False,), "length_penalty": (1, 1.0), "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,), "truncate_prompt_tokens": (),
    "allowed_token_ids": (), "bad_words": (), "logits_processors": (), "return_tokens_as_token_ids": (False,),
}
NOT_IMPLEMENTED = {
    Endpoint.COMPLETIONS: {**_SHARED_NOT_IMPLEMENTED, "suffix": ("",)},
    Endpoint.CHAT: {**_SHARED_NOT_IMPLEMENTED, "functions": ([],),
                    "function_call": ("none",), "documents": ([],),
                    "echo": (False,), "reasoning_effort": (), "modalities": (["text"],), "audio": (),
                    "prediction": (), "web_search_options": ()},
}

MAX_WARNED_NAMES = 1024  # unknown names remembered (and logged); a client inventing names cannot grow it further
_warned: set[tuple[Endpoint, str]] = set()


def check_fields(body: dict, endpoint: Endpoint) -> None:
    """400 for a field this server does not implement (unless it has its neutral value); one warning per
    unknown field name; implemented and harmless fields pass."""
    implemented, harmless, not_implemented = IMPLEMENTED[endpoint], HARMLESS[endpoint], NOT_IMPLEMENTED[endpoint]
    for name, value in body.items():
        if value is None or name in implemented or name in harmless:
            continue
        if name in not_implemented:
            neutral = tuple(body.get("n", 1) if v == "n" else v for v in not_implemented[name])
            if value not in neutral:
                only = f" (only {' or '.join(describe_value(v) for v in neutral)})" if neutral else ""
                raise ApiError(400, f"{name} is not supported by this server{only}, got {describe_value(value)}",
                               param=name)
            continue
        key = (endpoint, name[:100])
        if key not in _warned and len(_warned) < MAX_WARNED_NAMES:
            _warned.add(key)
            logger.warning("%s: ignoring the unknown request field %r (said once per field name%s)", endpoint.value,
                           key[1], "; no more are logged" if len(_warned) == MAX_WARNED_NAMES else "")
