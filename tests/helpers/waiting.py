"""Waiting in tests for a condition to hold: a bounded poll, in a thread or in a coroutine.

    from helpers.waiting import wait_until, wait_until_async
    wait_until(lambda: server.scrape()[name] >= 2, timeout=20.0, message="two failed audits in /metrics")
    await wait_until_async(lambda: client.stats.num_running == 0)
    wait_until(is_ready, timeout=10.0, message=lambda: f"redis to answer; log:\n{read_log()}", give_up=exited)

Both call predicate() every `interval` s until it returns something true, and return that value. After
`timeout` s, or as soon as give_up() is true, they raise an AssertionError: "timed out waiting for MESSAGE"
(or "gave up waiting for MESSAGE"). `message` may be a callable, called only then, e.g. to add a log that is
read at the moment of failure. Every wait in tests/ goes through these two, so a broken server or worker
fails its test within a bound instead of hanging it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
WAIT_S = 20.0  # the default bound on one wait


def wait_until(predicate: Callable[[], T], timeout: float = WAIT_S, interval: float = 0.05,
               message: str | Callable[[], str] = "the condition",
               give_up: Callable[[], object] | None = None) -> T:
    """Poll predicate() every `interval` s (time.sleep between calls) until it is true; its value."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        _fail_if_over(deadline, message, give_up)
        time.sleep(interval)
    return value


async def wait_until_async(predicate: Callable[[], T], timeout: float = WAIT_S, interval: float = 0.02,
                           message: str | Callable[[], str] = "the condition",
                           give_up: Callable[[], object] | None = None) -> T:
    """wait_until for a coroutine: asyncio.sleep between the calls, so the event loop runs meanwhile."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        _fail_if_over(deadline, message, give_up)
        await asyncio.sleep(interval)
    return value


def _fail_if_over(deadline: float, message: str | Callable[[], str], give_up: Callable[[], object] | None) -> None:
    if give_up is not None and give_up():
        raise AssertionError(f"gave up waiting for {message() if callable(message) else message}")
    if time.monotonic() >= deadline:
        raise AssertionError(f"timed out waiting for {message() if callable(message) else message}")
