"""The JSON shapes of the Responses API: response ids, the response object at each stage, and its stream events.

Owns: `resp_<32 hex>`, `msg_<32 hex>`, `fc_<32 hex>` and `call_<32 hex>`
ids, the response object (with the neutral values of the features this
server does not have, and the text format and tools as the request gave
them), the shapes of its output items (a message, a function call), the
usage block, and every streaming event's payload with its `type` and
`sequence_number`.
Must not know: HTTP, SSE framing, the engine, the store, which items an
output has (output_items.py builds them).
How: a ResponseFormat is made per request once its prompt and sampling
parameters are known; `response()` renders the object in progress (no
output yet) or finished (its items and why it ended), and `event()`
numbers the stream's events in the order they are made.
"""

from __future__ import annotations

import re
import time
import uuid

from shared.sampling_params import SamplingParams
from shared.vocabulary import FinishReason

RESPONSE_ID_PATTERN = "resp_ followed by 32 lower-case hex digits"
_RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")
IN_PROGRESS = "in_progress"
COMPLETED = "completed"
INCOMPLETE = "incomplete"


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def is_response_id(value: str) -> bool:
    return _RESPONSE_ID.fullmatch(value) is not None


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message(message_id: str, text: str | None, status: str) -> dict:
    """An output message item; no content part while `text` is None (just added to a stream)."""
    return {"id": message_id, "type": "message", "role": "assistant", "status": status,
            "content": [] if text is None else [output_text(text)]}


def function_call(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    """An output function_call item: `call_id` is what the client's function_call_output answers."""
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def new_function_call_ids() -> tuple[str, str]:
    """A function_call item's id and its call_id."""
    return f"fc_{uuid.uuid4().hex}", f"call_{uuid.uuid4().hex}"


class ResponseFormat:
    def __init__(self, response_id: str, model: str, params: SamplingParams, *, text: dict, instructions: str | None,
                 previous_response_id: str | None, max_output_tokens: int | None, store: bool, metadata: dict,
                 tool_fields: dict):
        """tool_fields: the request's tools, tool_choice and parallel_tool_calls, as the response echoes them."""
        self.id = response_id
        self.created_at = int(time.time())
        self._fields = {"instructions": instructions, "max_output_tokens": max_output_tokens, "metadata": metadata,
                        "model": model, "previous_response_id": previous_response_id, "store": store,
                        "temperature": params.temperature, "top_p": params.top_p, "text": text, **tool_fields}
        self._sequence_number = 0

    @staticmethod
    def status(finish_reason: str | None) -> str:
        """The response's status once its output ended for `finish_reason`."""
        return INCOMPLETE if finish_reason == FinishReason.LENGTH else COMPLETED

    def response(self, output: list[dict] | None = None, finish_reason: str | None = None,
                 num_tokens: tuple[int, int] | None = None) -> dict:
        """The response object: in progress while `output` is None, else finished with (input, output) token
        counts."""
        status = IN_PROGRESS if output is None else self.status(finish_reason)
        usage = None
        if num_tokens is not None:
            num_input, num_output = num_tokens
            usage = {"input_tokens": num_input, "input_tokens_details": {"cached_tokens": 0},
                     "output_tokens": num_output, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": num_input + num_output}
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "completed_at": int(time.time()) if status == COMPLETED else None, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == INCOMPLETE else None,
                "output": output or [], "usage": usage, "background": False, "reasoning": None,
                "service_tier": "default", "top_logprobs": 0,
                "truncation": "disabled", "user": None, **self._fields}

    def event(self, type: str, **fields) -> dict:
        """A stream event's payload, numbered after the previous one."""
        payload = {"type": type, "sequence_number": self._sequence_number, **fields}
        self._sequence_number += 1
        return payload
