"""The chat request's tool-calling fields, checked: `tools`, `tool_choice`, `parallel_tool_calls` -> ToolChoice.

Each tool is OpenAI's {"type": "function", "function": {"name", "description",
"parameters", "strict"}}; tool_choice is "none", "auto", "required" or
{"type": "function", "function": {"name"}} naming one of the tools. The
function definitions and the choice's defaults are checked as the
Responses API checks them (api/tool_choice_fields.py). Whether "auto" can
be served is the handler's to say (it needs the server's
--tool-call-parser). Every error is a 400 naming the field.
"""

from __future__ import annotations

from server.api.body_fields import get_field
from server.api.tool_choice_fields import check_function, tool_choice
from server.generation.tool_calling import ToolChoice
from server.http.errors import ApiError, describe_value


def parse_tool_choice(body: dict) -> ToolChoice | None:
    """None when the request has no tools and no tool_choice other than "none"."""
    parallel = get_field(body, "parallel_tool_calls", bool, "a boolean", True)
    return tool_choice(_tools(body.get("tools")), body.get("tool_choice"), parallel, _named_function)


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
        check_function(tool["function"], f"{where}.function", names)
    return value


def _named_function(value: object) -> str:
    function = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ApiError(400, "tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                            f"\"function\": {{\"name\": ...}}}}, got {describe_value(value)}", param="tool_choice")
    return name
