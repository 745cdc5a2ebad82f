"""The Responses API's `input` items -> chat messages, the shape the chat template renders and the store keeps.

Owns: the items this server understands and their 400s, naming the item:
- message ({"type": "message"} or no type): role user, system, developer
  (a system message to the template) or assistant; string content or
  input_text/output_text parts, joined.
- function_call ({"call_id", "name", "arguments"}: a call the model made):
  an assistant message's `tool_calls` entry, as chat has it. Consecutive
  calls, and calls right after an assistant message, join that one
  assistant message: the turn the model made, as the response's output
  had it (a message item, then its function_call items).
- function_call_output ({"call_id", "output"}): a tool message.
Must not know: the template, the store, tokens.
"""

from __future__ import annotations

import json

from server.generation.chat_messages import PART_SEPARATOR
from server.http.errors import ApiError, describe_value

ROLES = ("user", "system", "developer", "assistant")
TEMPLATE_ROLE = {"developer": "system"}  # chat templates know system, not OpenAI's newer name for it
TEXT_PART_TYPES = ("input_text", "output_text")
ITEM_TYPES = ("message", "function_call", "function_call_output")


def input_messages(value: object) -> list[dict]:
    """`input` (a string or a non-empty list of items) as chat messages."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise ApiError(400, f"input must be a string or a non-empty list of items, got {describe_value(value)}",
                       param="input")
    messages: list[dict] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ApiError(400, f"{where} must be an item object, got {describe_value(item)}", param=where)
        kind = item.get("type", "message")
        if kind == "function_call":
            _add_call(messages, _tool_call(where, item))
        elif kind == "function_call_output":
            messages.append(_tool_message(where, item))
        elif kind == "message":
            messages.append(_message(where, item))
        else:
            raise ApiError(400, f"{where}.type must be one of {', '.join(ITEM_TYPES)}, got {describe_value(kind)}",
                           param=f"{where}.type")
    return messages


def _add_call(messages: list[dict], call: dict) -> None:
    """The call joins the assistant message just before it, or begins one."""
    last = messages[-1] if messages else None
    if last is None or last["role"] != "assistant":
        last = {"role": "assistant", "content": None}
        messages.append(last)
    last.setdefault("tool_calls", []).append(call)


def _tool_call(where: str, item: dict) -> dict:
    call_id, name = _string(where, item, "call_id"), _string(where, item, "name")
    arguments = _string(where, item, "arguments")
    try:
        json.loads(arguments)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than Python's stack
        raise ApiError(400, f"{where}.arguments must be a JSON string, got invalid JSON ({exc}): "
                            f"{describe_value(arguments)}", param=f"{where}.arguments") from None
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _tool_message(where: str, item: dict) -> dict:
    return {"role": "tool", "tool_call_id": _string(where, item, "call_id"),
            "content": _content(f"{where}.output", item.get("output"))}


def _message(where: str, item: dict) -> dict:
    role = item.get("role")
    if role not in ROLES:
        raise ApiError(400, f"{where}.role must be one of {', '.join(ROLES)}, got {describe_value(role)}",
                       param=f"{where}.role")
    return {"role": TEMPLATE_ROLE.get(role, role), "content": _content(f"{where}.content", item.get("content"))}


def _string(where: str, item: dict, key: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ApiError(400, f"{where}.{key} must be a string, got {describe_value(value)}", param=f"{where}.{key}")
    return value


def _content(where: str, content: object) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or a list of text parts, got {describe_value(content)}", param=where)
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PART_TYPES or not isinstance(part.get("text"), str):
            raise ApiError(400, f"{where}[{i}] must be {{\"type\": \"input_text\" or \"output_text\", \"text\": string}} "
                                f"(only text is supported), got {describe_value(part)}", param=f"{where}[{i}]")
        texts.append(part["text"])
    return PART_SEPARATOR.join(texts)
