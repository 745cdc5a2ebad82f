"""Chat messages as a client sends them -> the plain dicts a chat template renders, or a 400 naming the bad field.

Owns: the shape of a message (OpenAI's roles, string or text-part content,
an assistant's `tool_calls`, a tool result's `tool_call_id`) and how each is
handed to the template.
Must not know: the template itself, tokens, HTTP framing.
How: content given as a list of {"type": "text"} parts is joined into one
string, which every text-only template understands. A tool call's
`arguments` arrive as a JSON string (OpenAI's API) and go to the template
parsed, as vLLM and transformers hand them over: tool-calling templates
(Qwen, Hermes, Llama 3) render them with `tool_call.arguments | tojson`,
which would quote a string a second time. Keys whose value is null are
dropped, as transformers does, so that a template's `is defined` tests see
them absent.
"""

from __future__ import annotations

import json

from server.http.errors import ApiError, describe_value

PART_SEPARATOR = "\n"
ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's chat roles
NULL_CONTENT_ROLES = ("assistant",)  # an assistant turn may carry tool calls instead of text
TOOL_CALL_TYPE = "function"  # the only kind of tool call OpenAI's chat API has


def check_messages(messages: object) -> list[dict]:
    """Messages as the template wants them: role and string content; ApiError 400 naming the bad field."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, f"messages must be a non-empty list, got {_describe(messages)}", param="messages")
    return [_check_message(i, m) for i, m in enumerate(messages)]


def _check_message(index: int, message: object) -> dict:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise ApiError(400, f"{where} must be an object, got {_describe(message)}", param=where)
    role = message.get("role")
    if role not in ROLES:
        raise ApiError(400, f"{where}.role must be one of {', '.join(ROLES)}, got {_describe(role)}",
                       param=f"{where}.role")
    content = message.get("content")
    if content is None and role not in NULL_CONTENT_ROLES:
        raise ApiError(400, f"{where}.content is required for a {role} message, got null", param=f"{where}.content")
    checked = {key: value for key, value in message.items() if value is not None}
    checked["content"] = _content_text(content, f"{where}.content")
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        _check_tool_calls_role(role, where)
        checked.pop("tool_calls")
        if tool_calls != []:  # an empty list is no tool call: the template takes its plain assistant path (vLLM)
            checked["tool_calls"] = _tool_calls(tool_calls, f"{where}.tool_calls")
    tool_call_id = message.get("tool_call_id")
    if tool_call_id is not None and not isinstance(tool_call_id, str):
        raise ApiError(400, f"{where}.tool_call_id must be a string, got {_describe(tool_call_id)}",
                       param=f"{where}.tool_call_id")
    return checked


def _check_tool_calls_role(role: str, where: str) -> None:
    if role != "assistant":
        raise ApiError(400, f"{where}.tool_calls is only allowed on an assistant message, got a {role} message",
                       param=f"{where}.tool_calls")


def _tool_calls(tool_calls: object, where: str) -> list[dict]:
    if not isinstance(tool_calls, list):
        raise ApiError(400, f"{where} must be a list of tool calls, got {_describe(tool_calls)}", param=where)
    return [_tool_call(call, f"{where}[{i}]") for i, call in enumerate(tool_calls)]


def _tool_call(call: object, where: str) -> dict:
    """{"id", "type": "function", "function": {"name", "arguments"}} with the arguments parsed from JSON."""
    expected = f'{{"id": string, "type": "{TOOL_CALL_TYPE}", "function": {{"name": string, "arguments": string}}}}'
    function = call.get("function") if isinstance(call, dict) else None
    if (not isinstance(call, dict) or not isinstance(call.get("id"), str) or call.get("type") != TOOL_CALL_TYPE
            or not isinstance(function, dict) or not isinstance(function.get("name"), str)):
        raise ApiError(400, f"{where} must be {expected}, got {_describe(call)}", param=where)
    return {**call, "function": {**function, "arguments": _arguments(function.get("arguments"), where)}}


def _arguments(arguments: object, where: str) -> object:
    """The arguments as JSON values: a JSON string parsed, an object or list as it is, null or "" as {} (vLLM's
    rule for what templates are given)."""
    if arguments is None or arguments == "":
        return {}
    if isinstance(arguments, (dict, list)):
        return arguments
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than Python's stack
            raise ApiError(400, f"{where}.function.arguments must be a JSON string, got invalid JSON ({exc}): "
                                f"{describe_value(arguments)}", param=where) from None
    raise ApiError(400, f"{where}.function.arguments must be a JSON string, got {_describe(arguments)}", param=where)


def _content_text(content: object, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or a list of parts, got {_describe(content)}", param=where)
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ApiError(400, f"{where}[{i}] must be {{\"type\": \"text\", \"text\": string}} (only text parts are "
                                f"supported), got {_describe(part)}", param=f"{where}[{i}]")
        texts.append(part["text"])
    return PART_SEPARATOR.join(texts)


def _describe(value: object) -> str:
    return f"{type(value).__name__} {describe_value(value)}"
