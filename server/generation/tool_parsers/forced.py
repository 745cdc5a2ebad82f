"""The outputs of a forced tool choice, which a grammar has already shaped: no markers, no stray content.

    tool_choice "required":  [{"name": "get_weather", "parameters": {"city": "Paris"}}, ...]
    tool_choice {"type": "function", "function": {"name": "get_weather"}}:  {"city": "Paris"}

"required" (as vLLM has it): the output is a JSON array of one or more
calls, each object parsed as it closes. A named function: the output is
the arguments object itself; its name goes out first and its arguments
stream as they are generated. Both are driven like the format parsers
(`feed`, `finish`), so the chat handler treats every tool-calling output
alike. A "required" output cut short (max_tokens) before any call closed
is content; a named function's arguments cut short are sent as they are.
"""

from __future__ import annotations

import uuid

from server.generation.tool_parsers.base import TOOL_CALL_ID_PREFIX, ToolCall, ToolParser, ToolParserDelta, parse_call
from server.generation.tool_parsers.json_scan import JsonObjectScanner

ARGUMENT_KEYS = ("parameters",)


class RequiredToolParser(ToolParser):
    """The output is `[call, call, ...]`: each call is sent when its object closes."""

    def __init__(self):
        super().__init__()
        self._text = ""  # all the output, for the content of an output cut short
        self._object = ""  # the call object being scanned, from its "{"
        self._scanner: JsonObjectScanner | None = None

    def feed(self, text: str) -> ToolParserDelta:
        delta = ToolParserDelta()
        self._text += text
        while text:
            if self._scanner is None:
                start = text.find("{")
                if start < 0:
                    return delta  # "[", ",", whitespace or "]" between calls
                text, self._scanner, self._object = text[start:], JsonObjectScanner(), ""
            end = self._scanner.feed(text)
            if end is None:
                self._object += text
                return delta
            self._object += text[:end]
            text, self._scanner = text[end:], None
            call = parse_call(self._object, ARGUMENT_KEYS)
            if call is not None:
                self._send_call(delta, call)
        return delta

    def finish(self) -> ToolParserDelta:
        delta = ToolParserDelta()
        if not self.tool_calls:
            self._send_content(delta, self._text)
        return self._finish_content(delta)


class NamedToolParser(ToolParser):
    """The output is the named function's arguments: the name at once, then the arguments as they come."""

    def __init__(self, name: str):
        super().__init__()
        self.call = ToolCall(TOOL_CALL_ID_PREFIX + uuid.uuid4().hex, name, "")

    def feed(self, text: str) -> ToolParserDelta:
        delta = ToolParserDelta()
        if not self.tool_calls:
            self.tool_calls.append(self.call)
            delta.tool_calls.append(self.call.name_delta(0))
        if text:
            self.call.arguments += text
            delta.tool_calls.append({"index": 0, "function": {"arguments": text}})
        return delta

    def finish(self) -> ToolParserDelta:
        return self.feed("") if not self.tool_calls else ToolParserDelta()
