"""The conversation store of the Responses API: what a stored response is, where it lives, how a store is named.

Owns: StoredResponse (one record: the response object a client reads back,
plus the conversation needed to continue from it), its one codec, the
StateStore interface (put / get / delete), StateStoreError, and the
`--state-store` URL: `sqlite:///absolute/path.db` (embedded, the default
under $XDG_STATE_HOME/pagedserve) or `redis://host:port/db` (shared by
replicas).
Must not know: HTTP, the engine, how a response is generated.
How: a record is written once, when its response is complete, in one
atomic write (one SQL transaction, one Redis SET), so a reader finds a
whole record or none. Records are denormalised: each holds the whole
conversation up to and including its own output (every earlier turn's
input and output, oldest first), not a pointer to its parent. Continuing
from a response therefore reads one record; deleting or expiring a parent
never breaks its children, and no write has to touch two records. The
cost is storage that grows with the square of a chain's length, which
conversations bounded by the model's context length keep small.
"""

from __future__ import annotations

import contextlib
import os
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import orjson

SQLITE_SCHEME = "sqlite"
REDIS_SCHEMES = ("redis", "rediss")
DEFAULT_STORE_FILE = Path("pagedserve") / "responses.db"


class StateStoreError(Exception):
    """The store could not be reached or failed to read or write; nothing was written."""


class CorruptRecordError(Exception):
    """A stored record is not one this server wrote; retrying will not help, unlike a StateStoreError."""


@dataclass(slots=True, frozen=True)
class StoredResponse:
    """One stored response: `response` as GET /v1/responses/{id} answers it, `messages` to continue from it.

    messages: the conversation including this response's output, oldest first,
    each {"role": ..., "content": str}; no turn's instructions (they apply to
    their own turn only).
    """

    response: dict
    messages: list[dict]

    def __post_init__(self) -> None:
        if not isinstance(self.response, dict) or not isinstance(self.response.get("id"), str):
            raise ValueError(f"response must be a response object with a string id, got {self.response!r:.100}")
        if not isinstance(self.messages, list) or not all(_is_message(m) for m in self.messages):
            raise ValueError(f"messages must be a list of {{'role': str, 'content': str}}, got {self.messages!r:.100}")

    @property
    def id(self) -> str:
        return self.response["id"]

    def encode(self) -> bytes:
        return orjson.dumps({"response": self.response, "messages": self.messages})

    @classmethod
    def decode(cls, data: bytes | str) -> StoredResponse:
        """The record `encode` wrote; CorruptRecordError if the bytes are not one (written by something else).

        A str too, as redis-py's types allow (a client with decode_responses): orjson reads either."""
        try:
            value = orjson.loads(data)
            return cls(value["response"], value["messages"])
        except (orjson.JSONDecodeError, TypeError, KeyError, ValueError) as exc:
            raise CorruptRecordError(f"expected a stored response record, got unreadable data ({exc})") from None


def _is_message(message: object) -> bool:
    return isinstance(message, dict) and isinstance(message.get("role"), str) and isinstance(message.get("content"), str)


class StateStore(ABC):
    """Where stored responses live. Every method raises StateStoreError when the store fails."""

    @abstractmethod
    async def open(self) -> None:
        """Connect (create the file or check the server answers); StateStoreError if the store cannot be used."""

    @abstractmethod
    async def put(self, record: StoredResponse) -> None:
        """Write `record` in one atomic write (a new id; an existing one is replaced)."""

    @abstractmethod
    async def get(self, response_id: str) -> StoredResponse | None:
        """The record stored under `response_id`, or None."""

    @abstractmethod
    async def delete(self, response_id: str) -> bool:
        """Remove the record; False if there was none."""

    @abstractmethod
    async def close(self) -> None:
        """Release connections and threads; the store is not used afterwards."""


@dataclass(slots=True, frozen=True)
class StoreUrl:
    """A checked `--state-store` URL: a SQLite file, or a Redis server's URL."""

    url: str
    sqlite_path: Path | None = None  # set for sqlite:///..., else the URL is a Redis one

    def __str__(self) -> str:
        """The URL without a password, for logs and messages."""
        parts = urlsplit(self.url)
        if parts.password is None:
            return self.url
        return parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@", 1)).geturl()


def parse_store_url(url: str) -> StoreUrl:
    """`sqlite:///absolute/path.db` or `redis://[:password@]host[:port][/db]`; ValueError naming what is wrong."""
    expected = "expected sqlite:///absolute/path.db or redis://host:port/db"
    parts = urlsplit(url)
    if parts.scheme == SQLITE_SCHEME:
        if parts.netloc or not parts.path.startswith("/") or parts.path.endswith("/") or parts.query:
            raise ValueError(f"state store: {expected}, got {url!r} (a sqlite URL takes three slashes and an "
                             "absolute file path)")
        return StoreUrl(url, Path("/" + parts.path.lstrip("/")))  # SQLAlchemy's four slashes mean the same
    if parts.scheme in REDIS_SCHEMES:
        try:
            port = parts.port
        except ValueError:
            port = -1
        db = parts.path.strip("/")
        if not parts.hostname or port == -1 or (db and not db.isdigit()):
            raise ValueError(f"state store: {expected}, got {url!r} (a redis URL takes a host, an optional port "
                             "and an optional database number)")
        return StoreUrl(url)
    raise ValueError(f"state store: {expected}, got {url!r}")


def default_store_url(environ: Mapping[str, str] | None = None) -> str:
    """sqlite:// at $XDG_STATE_HOME/pagedserve/responses.db, or ~/.local/state/pagedserve/responses.db."""
    env: Mapping[str, str] = os.environ if environ is None else environ
    state_home = env.get("XDG_STATE_HOME") or ""
    base = Path(state_home) if Path(state_home).is_absolute() else Path.home() / ".local" / "state"
    return f"{SQLITE_SCHEME}://{base / DEFAULT_STORE_FILE}"


@contextlib.asynccontextmanager
async def opened_state_store(url: StoreUrl) -> AsyncIterator[StateStore]:
    """`async with opened_state_store(url) as store:` the store, open (StateStoreError if it cannot be), closed after."""
    store = state_store_for(url)
    try:
        await store.open()
        yield store
    finally:
        await store.close()


def state_store_for(url: StoreUrl) -> StateStore:
    """The store for `url`, not yet opened."""
    # Imported here: each backend imports this module, and redis-py is loaded only where Redis is used.
    if url.sqlite_path is not None:
        from server.state_store.sqlite_store import SqliteStateStore
        return SqliteStateStore(url.sqlite_path)
    from server.state_store.redis_store import RedisStateStore
    return RedisStateStore(url.url)
