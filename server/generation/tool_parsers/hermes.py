"""The "hermes" format (Hermes 2 Pro, Qwen2.5): calls in tags, anywhere in the output.

    Let me look.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Each `<tool_call>...</tool_call>` block whose body is a well-formed call
({"name": ..., "arguments": {...}}) is a call; a block that is not stays
content, tags and all, as does every text outside blocks. A block the
output ends inside (no closing tag) is a call if its body is one.
How: outside a block, text is sent up to a possible start of the opening
tag; inside, the body is held until the closing tag (or the end) decides.
"""

from __future__ import annotations

from server.generation.tool_parsers.base import ToolParser, ToolParserDelta, parse_call

START_TAG = "<tool_call>"
END_TAG = "</tool_call>"
ARGUMENT_KEYS = ("arguments",)


def partial_tag_len(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `tag`."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


class HermesToolParser(ToolParser):
    def __init__(self):
        super().__init__()
        self._pending = ""  # outside a block: a possible start of START_TAG; inside: the body so far
        self._is_in_block = False

    def feed(self, text: str) -> ToolParserDelta:
        delta = ToolParserDelta()
        searched = max(0, len(self._pending) - len(END_TAG) + 1) if self._is_in_block else 0  # the held body has no END_TAG
        text, self._pending = self._pending + text, ""
        while text:
            if self._is_in_block:
                text = self._feed_block(delta, text, searched)
            else:
                text = self._feed_outside(delta, text)
            searched = 0
        return delta

    def finish(self) -> ToolParserDelta:
        delta = ToolParserDelta()
        if self._is_in_block:
            self._end_block(delta, self._pending)
        else:
            self._send_content(delta, self._pending)
        self._pending = ""
        return self._finish_content(delta)

    def _feed_outside(self, delta: ToolParserDelta, text: str) -> str:
        """Send the content before the next block; the text left after its opening tag."""
        start = text.find(START_TAG)
        if start < 0:
            cut = len(text) - partial_tag_len(text, START_TAG)
            self._send_content(delta, text[:cut])
            self._pending = text[cut:]
            return ""
        self._send_content(delta, text[:start])
        self._is_in_block = True
        return text[start + len(START_TAG):]

    def _feed_block(self, delta: ToolParserDelta, text: str, searched: int) -> str:
        """End the block if `text` (a body, from `searched` on not yet searched) closes it; the text after it."""
        end = text.find(END_TAG, searched)
        if end < 0:
            self._pending = text
            return ""
        self._end_block(delta, text[:end], END_TAG)
        return text[end + len(END_TAG):]

    def _end_block(self, delta: ToolParserDelta, body: str, end_tag: str = "") -> None:
        call = parse_call(body, ARGUMENT_KEYS)
        if call is None:
            self._send_content(delta, START_TAG + body + end_tag)
        else:
            self._send_call(delta, call)
        self._is_in_block = False
