"""Tool calls out of a choice's output text, in the formats vLLM's `--tool-call-parser` names.

Pure text in, content and OpenAI tool calls out; no I/O, no tokens. One file
per format; base.py holds the shapes and the streaming interface they share.
"""

from server.generation.tool_parsers.base import ExtractedToolCalls, ToolCall, ToolParser, ToolParserDelta
from server.generation.tool_parsers.registry import TOOL_PARSERS, get_tool_parser

__all__ = ["TOOL_PARSERS", "ExtractedToolCalls", "ToolCall", "ToolParser", "ToolParserDelta", "get_tool_parser"]
