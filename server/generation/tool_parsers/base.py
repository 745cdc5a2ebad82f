"""What every tool-call parser shares: the call and delta shapes, the rule for a well-formed call, the content rule.

Owns: turning one call's JSON text into a ToolCall (or refusing it), the
OpenAI delta shapes a call streams as, and the one streaming interface
(`feed` each text delta, `finish` at the end) the chat handler drives.
Must not know: HTTP, tokens, a format's markers (each parser's own file).
How: a parser is a per-choice state machine over the output text. Text is
content unless it is a well-formed call; text that may still become one is
held back until that is known. `extract` is the same machine fed the whole
text at once, so streamed and non-streamed results agree by construction.
A call is emitted whole, once its JSON is complete: its name delta, then
its whole arguments string in one delta. Content that is only whitespace
around tool calls (newlines between calls) is dropped: whitespace is held
until non-whitespace content follows, and at the end it is sent only if no
call was made.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, NoReturn

TOOL_CALL_ID_PREFIX = "chatcmpl-tool-"  # vLLM's, followed by 32 random hex digits


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # the arguments object as JSON text, as OpenAI sends it

    def to_openai(self) -> dict[str, Any]:
        """The call as a message's `tool_calls` entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def name_delta(self, index: int) -> dict[str, Any]:
        """The first streamed delta of the call: its id and name."""
        return {"index": index, "id": self.id, "type": "function", "function": {"name": self.name}}

    def arguments_delta(self, index: int) -> dict[str, Any]:
        return {"index": index, "function": {"arguments": self.arguments}}


@dataclass(slots=True)
class ExtractedToolCalls:
    content: str | None  # None when there is no content but whitespace
    tool_calls: list[ToolCall]


@dataclass(slots=True)
class ToolParserDelta:
    """What to send for one piece of output. Within a piece, content and calls lose their relative order."""
    content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI's delta.tool_calls entries


def _refuse_constant(name: str) -> NoReturn:
    raise ValueError(f"expected JSON, got {name}")  # NaN and Infinity: json.loads takes them, clients' parsers do not


def parse_call(text: str, argument_keys: tuple[str, ...]) -> ToolCall | None:
    """The call `text` holds: a JSON object with a non-empty string "name" and exactly one of
    `argument_keys` holding an object. None for anything else."""
    try:
        obj = json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    present = [key for key in argument_keys if key in obj]
    if len(present) != 1 or not isinstance(obj[present[0]], dict):
        return None
    arguments = json.dumps(obj[present[0]], ensure_ascii=False)
    return ToolCall(TOOL_CALL_ID_PREFIX + uuid.uuid4().hex, obj["name"], arguments)


class ToolParser(ABC):
    """One choice's parser: `feed` each new piece of output text, then `finish` once."""

    def __init__(self):
        self.tool_calls: list[ToolCall] = []
        self._held_whitespace = ""  # whitespace content not yet sent: it may only surround calls
        self._has_content = False  # non-whitespace content was sent
        self.max_tool_calls: int | None = None  # parallel_tool_calls false: 1, later calls are parsed and dropped

    @property
    def num_tool_calls(self) -> int:
        """Calls emitted so far; the handler's finish_reason is "tool_calls" when this is not 0."""
        return len(self.tool_calls)

    @abstractmethod
    def feed(self, text: str) -> ToolParserDelta:
        """The next piece of output text; what to send for it now."""

    @abstractmethod
    def finish(self) -> ToolParserDelta:
        """At the end of the output: what was held back, as content or as a last call."""

    @classmethod
    def extract(cls, text: str) -> ExtractedToolCalls:
        """The content and calls of a whole output, by a parser of its own."""
        return cls().parse(text)

    def parse(self, text: str) -> ExtractedToolCalls:
        """The content and calls of a whole output: fed at once, then finished (so this parser is done)."""
        deltas = (self.feed(text), self.finish())
        content = "".join(delta.content or "" for delta in deltas)
        return ExtractedToolCalls(content or None, self.tool_calls)

    def _send_content(self, delta: ToolParserDelta, text: str) -> None:
        if not self._has_content and text.isspace():
            self._held_whitespace += text
            return
        if text:
            delta.content = (delta.content or "") + self._held_whitespace + text
            self._held_whitespace, self._has_content = "", True

    def _send_call(self, delta: ToolParserDelta, call: ToolCall) -> None:
        index = len(self.tool_calls)
        if self.max_tool_calls is not None and index >= self.max_tool_calls:
            return
        self.tool_calls.append(call)
        delta.tool_calls += [call.name_delta(index), call.arguments_delta(index)]

    def _finish_content(self, delta: ToolParserDelta) -> ToolParserDelta:
        """The last step of `finish`: whitespace held back is content only in an output without calls."""
        if self._held_whitespace and not self.tool_calls:
            delta.content = (delta.content or "") + self._held_whitespace
        self._held_whitespace = ""
        return delta
