"""Where a JSON object that arrives in pieces ends, without parsing it.

Owns: bracket depth and string state across pieces, so the end of an object
is found in one pass over the text however it is split.
Must not know: what the object means (json.loads judges the closed text).
How: brackets count outside strings only; inside a string a backslash
escapes the next character. The object ends where the depth returns to 0;
mismatched brackets are not checked here, json.loads refuses them.
"""

from __future__ import annotations

OPENERS = "{["
CLOSERS = "}]"


class JsonObjectScanner:
    def __init__(self):
        self._depth = 0
        self._is_in_string = False
        self._is_escaped = False

    def feed(self, text: str) -> int | None:
        """The next piece, from the object's opening brace on; the offset in it just past the closing one, if there."""
        for offset, char in enumerate(text):
            if self._is_in_string:
                if self._is_escaped:
                    self._is_escaped = False
                elif char == "\\":
                    self._is_escaped = True
                elif char == '"':
                    self._is_in_string = False
            elif char == '"':
                self._is_in_string = True
            elif char in OPENERS:
                self._depth += 1
            elif char in CLOSERS:
                self._depth -= 1
                if self._depth == 0:
                    return offset + 1
        return None
