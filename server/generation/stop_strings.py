"""Stop strings, matched on the output text in the frontend as it streams.

Owns: finding the first occurrence of any stop string in a stream of text
pieces, cutting the output there, and holding back just enough text that a
stop string split across pieces is never half sent.
Must not know: tokens, HTTP, the engine (the handler aborts the request in
the worker when `feed` reports a match).
How: the text not yet emitted is searched on each piece; the last
max(len(stop)) - 1 characters stay held back, since they could be the start
of a stop string the next piece completes. A match can never begin in text
already emitted: it would have ended inside the held-back part and been found
then.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StopResult:
    text: str  # safe to emit now
    stop: str | None = None  # the stop string that matched; the output ends here


class StopMatcher:
    def __init__(self, stop: list[str] | tuple[str, ...] = (), include_stop_str_in_output: bool = False):
        if any(not s for s in stop):
            raise ValueError(f"stop strings must be non-empty, got {list(stop)!r}")
        self.stop = tuple(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self._num_hold = max((len(s) for s in self.stop), default=1) - 1
        self._pending = ""
        self.matched: str | None = None

    def feed(self, piece: str) -> StopResult:
        """Add the next piece of output; the text to emit now and, on a match, the stop string."""
        if self.matched is not None:
            raise RuntimeError(f"feed() after the stop string {self.matched!r} ended the output")
        text = self._pending + piece
        match = self._first_match(text)
        if match is not None:
            position, stop = match
            self.matched, self._pending = stop, ""
            end = position + len(stop) if self.include_stop_str_in_output else position
            return StopResult(text[:end], stop)
        cut = max(0, len(text) - self._num_hold)
        self._pending = text[cut:]
        return StopResult(text[:cut])

    def flush(self) -> str:
        """At the end of the output: the held-back text (it held no stop string)."""
        text, self._pending = self._pending, ""
        return text

    def _first_match(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self.stop:
            position = text.find(stop)
            if position >= 0 and (best is None or position < best[0]):
                best = (position, stop)
        return best
