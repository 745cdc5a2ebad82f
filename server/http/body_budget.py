"""The request body bytes all HTTP connections hold at once, and one request's share of them.

Owns: the shared bound on buffered request bodies (--max-buffered-body-bytes)
and the charge of one request against it.
Must not know: HTTP syntax, sockets, asyncio.
How: a body is charged for the bytes that have arrived, as they arrive, never
for what its head announces: a head costs the server a few hundred bytes, so
charging the announced Content-Length would let heads alone, with no body
behind them, fill the budget and have every other upload refused. A charge
that would pass the bound is refused, charging nothing, and the assembler
answers 503 with Retry-After (a retry may fit once others are done), where a
body over max_body_bytes gets 413 (no retry helps). An arriving body's charge
is its BodyCharge's; a delivered request's (len(body)) is the connection's to
release once it is answered or dropped.
"""

from __future__ import annotations


class BodyBudget:
    """The request body bytes all connections may hold at once; their assemblers share one."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.num_bytes = 0

    def reserve(self, num_bytes: int) -> bool:
        """Charge `num_bytes` if they fit beside what is held; False, charging nothing, if not."""
        if self.num_bytes + num_bytes > self.max_bytes:
            return False
        self.num_bytes += num_bytes
        return True

    def release(self, num_bytes: int) -> None:
        if num_bytes > self.num_bytes:
            raise RuntimeError(f"BodyBudget.release expected at most the {self.num_bytes} bytes held, "
                               f"got {num_bytes}")
        self.num_bytes -= num_bytes


class BodyCharge:
    """The bytes of one arriving body charged to the budget: added as they arrive, dropped or handed over."""

    def __init__(self, budget: BodyBudget):
        self.budget = budget
        self.num_bytes = 0

    def add(self, num_bytes: int) -> bool:
        """Charge `num_bytes` more; False, charging nothing, if they do not fit beside what all hold."""
        if not self.budget.reserve(num_bytes):
            return False
        self.num_bytes += num_bytes
        return True

    def drop(self) -> None:
        """The body will not be delivered: give its bytes back."""
        self.budget.release(self.num_bytes)
        self.num_bytes = 0

    def hand_over(self) -> None:
        """The body went out with its request: its bytes are now the connection's to release."""
        self.num_bytes = 0
