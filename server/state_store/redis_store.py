"""RedisStateStore: stored responses in a Redis server, shared by every replica that names it.

Owns: the Redis connection pool, the key of a record
(`pagedserve:response:<id>`), and how long a call may wait for Redis.
Must not know: HTTP, what a response contains (StoredResponse does).
How: redis-py's asyncio client; a record is one string value written with
one SET, so a reader sees all of it or nothing. Timeouts are short (a dead
Redis must turn into a prompt 503, not a request that hangs) and a failed
command is retried once at once: the retry reconnects, which is what a
pooled connection needs after Redis restarts, and a Redis that is back
serves the next request with no restart of the server. Any Redis or socket
error becomes a StateStoreError.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from server.state_store.store import StateStore, StateStoreError, StoredResponse, parse_store_url

T = TypeVar("T")
KEY_PREFIX = "pagedserve:response:"
SOCKET_TIMEOUT_S = 2.0  # connect, and each command's reply
NUM_RETRIES = 1


class RedisStateStore(StateStore):
    def __init__(self, url: str, *, timeout: float = SOCKET_TIMEOUT_S):
        self.url = parse_store_url(url)  # for messages: without the password
        if self.url.sqlite_path is not None:
            raise ValueError(f"expected a redis:// URL, got {str(self.url)!r}")
        self._client = aioredis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout,
                                               retry=Retry(NoBackoff(), NUM_RETRIES))

    async def open(self) -> None:
        await self._call(self._client.ping())

    async def put(self, record: StoredResponse) -> None:
        await self._call(self._client.set(KEY_PREFIX + record.id, record.encode()))

    async def get(self, response_id: str) -> StoredResponse | None:
        data = await self._call(self._client.get(KEY_PREFIX + response_id))
        return None if data is None else StoredResponse.decode(data)

    async def delete(self, response_id: str) -> bool:
        return await self._call(self._client.delete(KEY_PREFIX + response_id)) > 0

    async def close(self) -> None:
        await self._client.aclose()

    async def _call(self, command: Awaitable[T]) -> T:
        try:
            return await command
        except (RedisError, OSError) as exc:
            raise StateStoreError(f"the Redis state store {str(self.url)!r} failed: {exc}") from exc
