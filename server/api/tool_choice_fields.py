"""What chat and the Responses API share in reading tools: one function definition checked, the tool_choice rule.

Owns: the check of a function definition ({"name", "description",
"parameters", "strict"}: names unique, 1-64 letters, digits, "_" or "-"),
the defaults and checks of tool_choice once each endpoint has read its own
shapes, the rule that a forced choice and a structured-output format
cannot both constrain one output, and the 400 for "auto" on a server
without a --tool-call-parser.
Must not know: where a function sits in a request (chat nests it under
"function", the Responses API flattens it beside "type"), HTTP.
How: each endpoint's tool_fields.py walks its own shapes and calls these
with `where`, the path of the object being checked, so every 400 names the
field as the client wrote it.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from server.api.body_fields import get_field
from server.generation.structured_output import GrammarSpec
from server.generation.tool_calling import ToolChoice, ToolChoiceMode
from server.generation.tool_parsers import ToolParser
from server.http.errors import ApiError, describe_value

FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})
MODES = ("none", "auto", "required")  # tool_choice's strings; a named function is an object


def check_function(function: dict, where: str, names: set[str], *, extra_keys: frozenset[str] = frozenset()) -> str:
    """The name of the function definition at `where` ("tools[0].function" or "tools[0]"), added to `names`;
    `extra_keys`: keys beside the definition's own that the caller has checked (the Responses API's "type")."""
    unknown = sorted(set(function) - FUNCTION_KEYS - extra_keys)
    if unknown:
        raise ApiError(400, f"{where}.{unknown[0]} is not a field of a function", param=f"{where}.{unknown[0]}")
    name = function.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise ApiError(400, f"{where}.name must be 1-64 letters, digits, underscores or dashes, got "
                            f"{describe_value(name)}", param=f"{where}.name")
    if name in names:
        raise ApiError(400, f"{where}.name {name!r} is given twice", param=f"{where}.name")
    names.add(name)
    get_field(function, "description", str, "a string", None, where=f"{where}.")
    _check_parameters(function, where)
    get_field(function, "strict", bool, "a boolean", None, where=f"{where}.")
    return name


def _check_parameters(function: dict, where: str) -> None:
    """`parameters`, when given, is a JSON schema of an object, as OpenAI requires: the arguments are one."""
    if "parameters" not in function:
        return
    parameters, param = function["parameters"], f"{where}.parameters"
    if not isinstance(parameters, dict):
        raise ApiError(400, f"{param} must be a JSON schema of type \"object\" (or left out for no parameters), got "
                            f"{describe_value(parameters)}", param=param)
    kind = parameters.get("type", "object")
    if kind != "object":
        raise ApiError(400, f"{param} must be a JSON schema of type \"object\": a function's arguments are an "
                            f"object, got type {describe_value(kind)}", param=param)


def tool_choice(tools: list[dict], value: object, parallel_tool_calls: bool,
                named_function: Callable[[object], str]) -> ToolChoice | None:
    """`tools` in chat's shape, checked; `value` the request's tool_choice, defaulting to "auto" with tools and
    "none" without; anything but "none" needs tools. `named_function` reads the name out of an object value, in
    the endpoint's own shape. None when there are no tools and the choice is "none"."""
    if value is None:
        value = "auto" if tools else "none"
    if value == "none" and not tools:
        return None
    if not tools:
        raise ApiError(400, f"tool_choice {describe_value(value)} needs tools", param="tool_choice")
    if isinstance(value, str) and value in MODES:
        return ToolChoice(tools, ToolChoiceMode(value), parallel_tool_calls=parallel_tool_calls)
    name = named_function(value)
    if name not in {tool["function"]["name"] for tool in tools}:
        raise ApiError(400, f"tool_choice names the function {name!r}, which is not among the tools",
                       param="tool_choice")
    return ToolChoice(tools, ToolChoiceMode.FUNCTION, name, parallel_tool_calls)


def output_grammar(choice: ToolChoice | None, grammar: GrammarSpec | None, value: object) -> GrammarSpec | None:
    """The one constraint on the output: a forced choice's grammar, else the structured-output `grammar`; both
    is a 400 naming the structured-output field (`value`: the request's tool_choice, for the message)."""
    forced = choice.grammar_spec() if choice is not None else None
    if forced is None:
        return grammar
    if grammar is not None:
        raise ApiError(400, f"{grammar.param} cannot be combined with tool_choice {describe_value(value)}, which "
                            "constrains the output itself", param=grammar.param)
    return forced


def check_auto_servable(choice: ToolChoice | None, auto_parser: type[ToolParser] | None) -> None:
    """tool_choice "auto" needs the server's --tool-call-parser to read calls out of the text."""
    if choice is not None and choice.mode is ToolChoiceMode.AUTO and auto_parser is None:
        raise ApiError(400, 'tool_choice "auto" (the default with tools) needs the server started with '
                            '--enable-auto-tool-choice and --tool-call-parser', param="tool_choice")
