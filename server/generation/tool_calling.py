"""Tool calling: what a request's tools and tool_choice make of generation and of each choice's output.

Owns: ToolChoice (the checked tools and choice), the grammar that enforces
a forced choice, and which parser turns a choice's output into tool calls.
Must not know: request bodies (api/completions/tool_fields.py reads them),
HTTP, the engine.
How, per tool_choice (vLLM's behaviour):
- "none": the tools reach the chat template; the output is plain content.
- "auto": the model decides; the server's --tool-call-parser reads its
  calls out of the text (the server refuses "auto" without one), and with
  parallel_tool_calls false only the first call is returned.
- "required": a grammar makes the output a JSON array of one or more calls
  ({"name", "parameters"} of a tool), only one with parallel_tool_calls
  false.
- a named function: a grammar makes the output that function's arguments.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from server.generation.structured_output import GrammarKind, GrammarSpec
from server.generation.tool_parsers import ToolParser
from server.generation.tool_parsers.forced import NamedToolParser, RequiredToolParser

ANY_OBJECT = {"type": "object"}  # the parameters of a function that declares none
TOOL_CALLS = "tool_calls"  # OpenAI's finish reason for a choice that made calls


def hoist_definitions(parameters: dict, prefix: str, definitions: dict) -> dict:
    """A reference to `parameters` as one schema inside another: the parameters and their own `$defs` (or
    `definitions`, as Pydantic writes them) go into `definitions` under names starting with `prefix`, and
    their `$ref`s ("#", "#/$defs/X", "#/definitions/X") are rewritten to point there, so that the tool's
    references resolve inside the larger schema as they did in its own."""
    own = {**parameters.get("definitions", {}), **parameters.get("$defs", {})}
    body = {key: value for key, value in parameters.items() if key not in ("$defs", "definitions")}
    for name, definition in own.items():
        definitions[prefix + name] = _rewrite_refs(definition, prefix)
    definitions[prefix] = _rewrite_refs(body, prefix)
    return {"$ref": f"#/$defs/{prefix}"}


def _rewrite_refs(value: object, prefix: str) -> object:
    if isinstance(value, list):
        return [_rewrite_refs(item, prefix) for item in value]
    if not isinstance(value, dict):
        return value
    rewritten = {key: _rewrite_refs(item, prefix) for key, item in value.items()}
    ref = value.get("$ref")
    if isinstance(ref, str):
        if ref == "#":
            rewritten["$ref"] = f"#/$defs/{prefix}"
        for root in ("#/$defs/", "#/definitions/"):
            if ref.startswith(root):
                rewritten["$ref"] = f"#/$defs/{prefix}{ref[len(root):]}"
    return rewritten


class ToolChoiceMode(enum.Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    FUNCTION = "function"  # one named function


@dataclass(frozen=True, slots=True)
class ToolChoice:
    tools: list[dict]  # as the request gave them ({"type": "function", "function": {...}}), for the template
    mode: ToolChoiceMode
    function_name: str | None = None  # mode FUNCTION: the function's name
    parallel_tool_calls: bool = True

    def grammar_spec(self) -> GrammarSpec | None:
        """The constraint that enforces a forced choice; None for "none" and "auto"."""
        if self.mode is ToolChoiceMode.FUNCTION:
            return GrammarSpec(GrammarKind.JSON_SCHEMA, self._parameters(self.function_name), "tool_choice")
        if self.mode is not ToolChoiceMode.REQUIRED:
            return None
        definitions: dict = {}  # every tool's parameters and their own $defs, under names of the tool's
        calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                  "properties": {"name": {"const": name},
                                 "parameters": hoist_definitions(self._parameters(name), f"{name}.", definitions)}}
                 for name in self.function_names]
        schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": calls}, "$defs": definitions}
        if not self.parallel_tool_calls:
            schema["maxItems"] = 1
        return GrammarSpec(GrammarKind.JSON_SCHEMA, schema, "tools")

    def new_parser(self, auto_parser: type[ToolParser] | None) -> ToolParser | None:
        """A parser for one choice's output (`auto_parser`: the server's --tool-call-parser); None: plain content."""
        if self.mode is ToolChoiceMode.FUNCTION:
            return NamedToolParser(self.function_name or "")
        if self.mode is ToolChoiceMode.REQUIRED:
            return RequiredToolParser()
        if self.mode is ToolChoiceMode.AUTO and auto_parser is not None:
            parser = auto_parser()
            if not self.parallel_tool_calls:
                parser.max_tool_calls = 1
            return parser
        return None

    def finish_reason(self, parser: ToolParser, reason: str | None) -> str | None:
        """A choice's finish reason: "tool_calls" once it made calls, except with a named function, whose call
        OpenAI reports with the output's own reason."""
        if parser.num_tool_calls and self.mode is not ToolChoiceMode.FUNCTION and reason is not None:
            return TOOL_CALLS
        return reason

    @property
    def function_names(self) -> list[str]:
        return [tool["function"]["name"] for tool in self.tools]

    def _parameters(self, name: str | None) -> dict:
        for tool in self.tools:
            if tool["function"]["name"] == name:
                return tool["function"].get("parameters") or ANY_OBJECT
        raise ValueError(f"no tool is named {name!r}")
