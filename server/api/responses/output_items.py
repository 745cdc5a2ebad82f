"""One response's output items, built from its text as it comes: the stream's item events and the final `output`.

Owns: which items an output has and in what order, the events that open,
grow and close each, and the assistant message the store keeps for them.
Must not know: HTTP, the engine, the store, how a tool parser reads text.
How: without a tool parser the output is one message, opened before any
text (so an empty output is still a message). With one (any tool_choice
but "none"), the parser's content opens a message item and each of its
calls a function_call item, in the order they come; opening an item closes
the one before, and `finish` closes the last with the response's status.
An output that is neither content nor calls is an empty message. The whole
text fed at once gives the same items as a stream of pieces, so a response
is built the same way streamed or not (its events then go unsent).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from server.api.responses.format import (
    COMPLETED,
    IN_PROGRESS,
    ResponseFormat,
    function_call,
    message,
    new_function_call_ids,
    new_message_id,
    output_text,
)
from server.generation.tool_parsers import ToolParser


@dataclass(slots=True)
class _Item:
    output_index: int
    id: str
    call_id: str | None  # None: a message
    name: str = ""  # a call's function
    text: str = ""  # a message's text, a call's arguments so far
    status: str = IN_PROGRESS

    def body(self, text: str | None) -> dict:
        """The item with `text` (None: a message just opened, with no content part yet)."""
        if self.call_id is None:
            return message(self.id, text, self.status)
        return function_call(self.id, self.call_id, self.name, text or "", self.status)


class OutputItems:
    def __init__(self, fmt: ResponseFormat, parser: ToolParser | None):
        """parser: reads calls out of the text (the request's tool choice); None: the text is one message."""
        self._fmt = fmt
        self._parser = parser
        self._items: list[_Item] = []
        self._calls: dict[int, _Item] = {}  # the parser's call index -> its item

    def start(self) -> list[dict]:
        """The events before any text: a plain output's message opens at once."""
        return self._open(None) if self._parser is None else []

    def feed(self, text: str) -> list[dict]:
        """The events for the next piece of output text."""
        if self._parser is None:
            return self._add_text(text)
        parsed = self._parser.feed(text)
        return [*self._add_text(parsed.content or ""), *self._add_calls(parsed.tool_calls)]

    def finish(self, status: str) -> list[dict]:
        """The events at the end of the output; the last item closes with `status`."""
        events = []
        if self._parser is not None:
            parsed = self._parser.finish()
            events = [*self._add_text(parsed.content or ""), *self._add_calls(parsed.tool_calls)]
        if not self._items:
            events += self._open(None)
        return [*events, *self._close(status)]

    @property
    def output(self) -> list[dict]:
        """The response's `output`, once finished."""
        return [item.body(item.text) for item in self._items]

    def assistant_message(self) -> dict:
        """The output as the chat message the conversation keeps: its text and its calls in chat's shape. A call
        whose arguments are not whole JSON (cut short by max_output_tokens) is kept as text: the next turn checks
        the history's calls, and a client could not repair one stored here."""
        calls = [item for item in self._items if item.call_id is not None and _is_json(item.text)]
        text = "".join(item.text for item in self._items if item not in calls)
        tool_calls = [{"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.text}}
                      for item in calls]
        return {"role": "assistant", "content": text, **({"tool_calls": tool_calls} if tool_calls else {})}

    def _add_text(self, text: str) -> list[dict]:
        if not text:
            return []
        events = [] if self._items and self._items[-1].call_id is None else self._open(None)
        item = self._items[-1]
        item.text += text
        return [*events, self._text_event(item, "response.output_text.delta", delta=text, logprobs=[])]

    def _add_calls(self, deltas: list[dict]) -> list[dict]:
        """The parser's chat-shaped deltas: one with an id opens a call, one with arguments extends it."""
        events = []
        for delta in deltas:
            if "id" in delta:
                events += self._open(delta["function"]["name"])
                self._calls[delta["index"]] = self._items[-1]
            arguments = delta["function"].get("arguments")
            if arguments:
                item = self._calls[delta["index"]]
                item.text += arguments
                events.append(self._fmt.event("response.function_call_arguments.delta", item_id=item.id,
                                              output_index=item.output_index, delta=arguments))
        return events

    def _open(self, name: str | None) -> list[dict]:
        """A new item (a call of `name`, or a message for None), closing the one before."""
        events = self._close(COMPLETED)
        if name is None:
            item = _Item(len(self._items), new_message_id(), None)
        else:
            item_id, call_id = new_function_call_ids()
            item = _Item(len(self._items), item_id, call_id, name)
        self._items.append(item)
        events.append(self._fmt.event("response.output_item.added", output_index=item.output_index,
                                      item=item.body(None)))
        if item.call_id is None:
            events.append(self._text_event(item, "response.content_part.added", part=output_text("")))
        return events

    def _close(self, status: str) -> list[dict]:
        if not self._items or self._items[-1].status != IN_PROGRESS:
            return []
        item = self._items[-1]
        item.status = status
        fmt = self._fmt
        if item.call_id is None:
            events = [self._text_event(item, "response.output_text.done", text=item.text, logprobs=[]),
                      self._text_event(item, "response.content_part.done", part=output_text(item.text))]
        else:
            events = [fmt.event("response.function_call_arguments.done", item_id=item.id,
                                output_index=item.output_index, name=item.name, arguments=item.text)]
        return [*events, fmt.event("response.output_item.done", output_index=item.output_index,
                                   item=item.body(item.text))]

    def _text_event(self, item: _Item, type: str, **fields) -> dict:
        """An event about a message's one text part."""
        return self._fmt.event(type, item_id=item.id, output_index=item.output_index, content_index=0, **fields)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True
