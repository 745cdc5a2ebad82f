"""The Responses API's tool-calling fields, checked: `tools`, `tool_choice`, `parallel_tool_calls` -> ToolChoice.

Each tool is a flattened function, {"type": "function", "name", "description",
"parameters", "strict"}; the Responses API's other tools (web_search,
file_search, computer_use, mcp, ...) are a 400 naming tools[i].type.
tool_choice is "none", "auto", "required" or {"type": "function", "name"};
"auto" without tools is no tool calling (OpenAI's default, echoed as such).
The definitions and the choice's defaults are checked as chat checks them
(api/tool_choice_fields.py); the ToolChoice holds the tools in chat's shape
({"type": "function", "function": {...}}), which the chat template and the
forced choice's grammar take.
"""

from __future__ import annotations

from server.api.body_fields import get_field
from server.api.tool_choice_fields import check_function, tool_choice
from server.generation.tool_calling import ToolChoice
from server.http.errors import ApiError, describe_value

FUNCTION_TYPE = "function"
DEFAULT_TOOL_CHOICE = "auto"  # the Responses API's, which a response echoes when the request gave none


def parse_tool_choice(body: dict) -> ToolChoice | None:
    """None when the request has no tools and no tool_choice other than "none" or "auto"."""
    parallel = get_field(body, "parallel_tool_calls", bool, "a boolean", True)
    tools, value = _tools(body.get("tools")), body.get("tool_choice")
    if value == DEFAULT_TOOL_CHOICE and not tools:
        value = None  # OpenAI's default, sent by clients whether or not they have tools: nothing to call
    return tool_choice(tools, value, parallel, _named_function)


def _tools(value: object) -> list[dict]:
    """The tools in chat's shape."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ApiError(400, f"tools must be a list, got {describe_value(value)}", param="tools")
    names: set[str] = set()
    tools = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ApiError(400, f"{where} must be a tool object, got {describe_value(tool)}", param=where)
        if tool.get("type") != FUNCTION_TYPE:
            raise ApiError(400, f"{where}.type must be \"function\" (the only tools this server has), got "
                                f"{describe_value(tool.get('type'))}", param=f"{where}.type")
        check_function(tool, where, names, extra_keys=frozenset({"type"}))
        function = {key: value for key, value in tool.items() if key != "type" and value is not None}
        tools.append({"type": FUNCTION_TYPE, "function": function})
    return tools


def _named_function(value: object) -> str:
    name = value.get("name") if isinstance(value, dict) and value.get("type") == FUNCTION_TYPE else None
    if not isinstance(name, str):
        raise ApiError(400, "tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                            f"\"name\": ...}}, got {describe_value(value)}", param="tool_choice")
    return name
