"""The chat request's tool-calling fields, checked: `tools`, `tool_choice`, `parallel_tool_calls` -> ToolChoice.

Each tool is OpenAI's {"type": "function", "function": {"name", "description",
"parameters", "strict"}}; names are unique, 1-64 letters, digits, "_" or "-".
tool_choice is "none", "auto", "required" or {"type": "function",
"function": {"name"}} naming one of the tools; it defaults to "auto" with
tools and "none" without, and anything but "none" needs tools. Whether
"auto" can be served is the handler's to say (it needs the server's
--tool-call-parser). Every error is a 400 naming the field.
"""

from __future__ import annotations

import re

from server.api.body_fields import get_field
from server.generation.tool_calling import ToolChoice, ToolChoiceMode
from server.http.errors import ApiError, describe_value

FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})


def parse_tool_choice(body: dict) -> ToolChoice | None:
    """None when the request has no tools and no tool_choice other than "none"."""
    tools = _tools(body.get("tools"))
    parallel = get_field(body, "parallel_tool_calls", bool, "a boolean", True)
    value = body.get("tool_choice")
    if value is None:
        value = "auto" if tools else "none"
    if value == "none" and not tools:
        return None
    if not tools:
        raise ApiError(400, f"tool_choice {describe_value(value)} needs tools", param="tool_choice")
    if isinstance(value, str) and value in ("none", "auto", "required"):
        return ToolChoice(tools, ToolChoiceMode(value), parallel_tool_calls=parallel)
    name = _named_function(value)
    if name not in {tool["function"]["name"] for tool in tools}:
        raise ApiError(400, f"tool_choice names the function {name!r}, which is not among the tools",
                       param="tool_choice")
    return ToolChoice(tools, ToolChoiceMode.FUNCTION, name, parallel)


def _tools(value: object) -> list[dict]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ApiError(400, f"tools must be a list, got {describe_value(value)}", param="tools")
    names: set[str] = set()
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ApiError(400, f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}, got "
                                f"{describe_value(tool)}", param=where)
        function = tool["function"]
        unknown = sorted(set(function) - FUNCTION_KEYS)
        if unknown:
            raise ApiError(400, f"{where}.function.{unknown[0]} is not a field of a function",
                           param=f"{where}.function.{unknown[0]}")
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise ApiError(400, f"{where}.function.name must be 1-64 letters, digits, underscores or dashes, got "
                                f"{describe_value(name)}", param=f"{where}.function.name")
        if name in names:
            raise ApiError(400, f"{where}.function.name {name!r} is given twice", param=f"{where}.function.name")
        names.add(name)
        get_field(function, "description", str, "a string", None, where=f"{where}.function.")
        get_field(function, "parameters", dict, "a JSON schema (an object)", None, where=f"{where}.function.")
        get_field(function, "strict", bool, "a boolean", None, where=f"{where}.function.")
    return value


def _named_function(value: object) -> str:
    function = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ApiError(400, "tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                            f"\"function\": {{\"name\": ...}}}}, got {describe_value(value)}", param="tool_choice")
    return name
