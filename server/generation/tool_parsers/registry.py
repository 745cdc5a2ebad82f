"""The tool-call parsers by the name vLLM's `--tool-call-parser` gives them."""

from __future__ import annotations

from server.generation.tool_parsers.base import ToolParser
from server.generation.tool_parsers.hermes import HermesToolParser
from server.generation.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class named `name`; a ValueError listing the known names for any other."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}: expected one of {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]
