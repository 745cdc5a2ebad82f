"""The "llama3_json" format (Llama 3.1, 3.2): the output is the calls, as JSON objects.

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

The output is a call object ({"name": ..., "parameters": {...}}, or
"arguments" for the parameters), or several separated by ";", optionally
after `<|python_tag|>`. If the first object is not a well-formed call, the
whole output is content; text after the last well-formed call (a malformed
object, prose) is content too.
How: the text since the last call is held while it may still lead to the
next call's "{" (whitespace and the tag first, a ";" between calls); from
that brace a JsonObjectScanner finds where the object closes, and the
closed object is parsed. From the first text that cannot be a call on, all
is content.
"""

from __future__ import annotations

from server.generation.tool_parsers.base import ToolParser, ToolParserDelta, parse_call
from server.generation.tool_parsers.json_scan import JsonObjectScanner

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"
ARGUMENT_KEYS = ("parameters", "arguments")


class _NotToolCall(Exception):
    """The held text cannot be the next call: it and the rest of the output are content."""


class Llama3JsonToolParser(ToolParser):
    def __init__(self):
        super().__init__()
        self._pending = ""  # the text since the last call (or the start), not sent yet
        self._object_start: int | None = None  # where in it the object being scanned opens
        self._scanner = JsonObjectScanner()
        self._is_plain_text = False  # no more calls can follow: the rest of the output is content

    def feed(self, text: str) -> ToolParserDelta:
        delta = ToolParserDelta()
        if self._is_plain_text:
            self._send_content(delta, text)
            return delta
        self._pending += text
        try:
            self._send_calls(delta, len(self._pending) - len(text))
        except _NotToolCall:
            self._send_content(delta, self._pending)
            self._pending, self._is_plain_text = "", True
        return delta

    def finish(self) -> ToolParserDelta:
        delta = ToolParserDelta()
        self._send_content(delta, self._pending)  # a lead, or an object never closed: no call
        self._pending = ""
        return self._finish_content(delta)

    def _send_calls(self, delta: ToolParserDelta, unscanned: int) -> None:
        """Send every call the held text completes; `unscanned`: where the text the scanner has not seen begins."""
        while True:
            if self._object_start is None:
                self._object_start = self._find_object_start()
                if self._object_start is None:
                    return
                unscanned = self._object_start
            end = self._scanner.feed(self._pending[unscanned:])
            if end is None:
                return
            end += unscanned
            call = parse_call(self._pending[self._object_start:end], ARGUMENT_KEYS)
            if call is None:
                raise _NotToolCall
            self._send_call(delta, call)
            self._pending = self._pending[end:]
            self._object_start, self._scanner, unscanned = None, JsonObjectScanner(), 0

    def _find_object_start(self) -> int | None:
        """Where the next call's "{" is in the held text; None while the text before it may still grow into one."""
        rest = self._pending.lstrip()
        if self.tool_calls:
            if not rest:
                return None
            if not rest.startswith(SEPARATOR):
                raise _NotToolCall
            rest = rest[len(SEPARATOR):].lstrip()
        elif rest.startswith(PYTHON_TAG):
            rest = rest[len(PYTHON_TAG):].lstrip()
        elif PYTHON_TAG.startswith(rest):
            return None  # nothing yet, or the start of the tag
        if not rest:
            return None
        if not rest.startswith("{"):
            raise _NotToolCall
        return len(self._pending) - len(rest)
