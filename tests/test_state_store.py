"""The conversation store on its own: URL parsing, the record codec, SQLite files and a real redis-server.

Every backend test runs the same contract (put / get / delete, replace, absence) against SQLite and
Redis; then each backend's own failure: a SQLite file another connection holds locked, a path that
cannot be created, a Redis that is stopped and started again under a store that stays open.
"""

from __future__ import annotations

import asyncio
import sqlite3
import stat
import time
import uuid
from pathlib import Path

import pytest
import redis

from server.state_store.redis_store import KEY_PREFIX, SOCKET_TIMEOUT_S, RedisStateStore
from server.state_store.sqlite_store import SqliteStateStore
from server.state_store.store import (
    CorruptRecordError,
    StateStoreError,
    StoredResponse,
    default_store_url,
    opened_state_store,
    parse_store_url,
)

from helpers.redis_server import restart_redis, start_redis, stop_redis

MESSAGES = [{"role": "user", "content": "Speak, friend."}, {"role": "assistant", "content": "Mellon."}]


def record(text: str = "Mellon.") -> StoredResponse:
    response_id = f"resp_{uuid.uuid4().hex}"
    response = {"id": response_id, "object": "response", "created_at": 1700000000, "status": "completed",
                "output": [{"type": "message", "content": [{"type": "output_text", "text": text}]}]}
    return StoredResponse(response, [MESSAGES[0], {"role": "assistant", "content": text}])


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    stop_redis(server)


@pytest.fixture(params=["sqlite", "redis"])
def store_url(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite://{tmp_path / 'state' / 'responses.db'}"
    return request.getfixturevalue("redis_server").url


# ---------------------------------------------------------------------------------------------- URLs and records

@pytest.mark.parametrize("url, sqlite_path", [
    ("sqlite:///var/lib/pagedserve/responses.db", Path("/var/lib/pagedserve/responses.db")),
    ("sqlite:////var/lib/pagedserve/responses.db", Path("/var/lib/pagedserve/responses.db")),  # SQLAlchemy's spelling
    ("redis://127.0.0.1:6379/0", None),
    ("redis://:secret@redis.internal/3", None),
    ("rediss://redis.internal:6380", None),
])
def test_good_urls_parse(url, sqlite_path):
    assert parse_store_url(url).sqlite_path == sqlite_path


@pytest.mark.parametrize("url", ["", "responses.db", "/var/lib/responses.db", "sqlite://relative.db",
                                 "sqlite:///", "sqlite:///dir/", "sqlite:///x.db?mode=ro", "redis://", "redis://host:port/0",
                                 "redis://host:6379/zero", "memcached://host:11211", "postgres://db/x"])
def test_bad_urls_say_what_was_expected(url):
    with pytest.raises(ValueError, match=r"expected sqlite:///absolute/path\.db or redis://host:port/db, got"):
        parse_store_url(url)


def test_a_password_stays_out_of_messages():
    assert str(parse_store_url("redis://:hunter2@redis.internal:6379/0")) == "redis://:***@redis.internal:6379/0"


def test_default_url_follows_xdg_state_home(tmp_path):
    assert default_store_url({"XDG_STATE_HOME": str(tmp_path)}) == f"sqlite://{tmp_path}/pagedserve/responses.db"
    home_default = f"sqlite://{Path.home()}/.local/state/pagedserve/responses.db"
    assert default_store_url({}) == home_default
    assert default_store_url({"XDG_STATE_HOME": "relative/dir"}) == home_default  # the spec ignores relative ones


def test_record_round_trips_and_refuses_bad_shapes():
    stored = record()
    assert StoredResponse.decode(stored.encode()) == stored and stored.id.startswith("resp_")
    with pytest.raises(ValueError, match="response must be a response object"):
        StoredResponse({"object": "response"}, MESSAGES)
    with pytest.raises(ValueError, match="messages must be a list"):
        StoredResponse(stored.response, [{"role": "user", "content": ["parts"]}])
    for data in (b"not json", b"[]", b'{"response": {"id": 1}, "messages": []}'):
        with pytest.raises(CorruptRecordError, match="expected a stored response record"):
            StoredResponse.decode(data)


# ---------------------------------------------------------------------------------------------- both backends

@pytest.mark.asyncio
async def test_put_get_delete_round_trip(store_url):
    first, second = record("one"), record("two")
    async with opened_state_store(parse_store_url(store_url)) as store:
        assert await store.get(first.id) is None
        await store.put(first)
        await store.put(second)
        assert await store.get(first.id) == first and await store.get(second.id) == second
        replaced = StoredResponse({**first.response, "status": "incomplete"}, first.messages)
        await store.put(replaced)
        assert await store.get(first.id) == replaced
        assert await store.delete(first.id) is True
        assert await store.delete(first.id) is False
        assert await store.get(first.id) is None and await store.get(second.id) == second


@pytest.mark.asyncio
async def test_records_outlive_the_store_object(store_url):
    stored = record()
    async with opened_state_store(parse_store_url(store_url)) as store:
        await store.put(stored)
    async with opened_state_store(parse_store_url(store_url)) as store:  # a restarted server, or another replica
        assert await store.get(stored.id) == stored


# ---------------------------------------------------------------------------------------------- SQLite

@pytest.mark.asyncio
async def test_sqlite_creates_its_directory_in_wal_mode(tmp_path):
    path = tmp_path / "deep" / "er" / "responses.db"
    async with opened_state_store(parse_store_url(f"sqlite://{path}")) as store:
        await store.put(record())
    with sqlite3.connect(path) as connection:
        assert connection.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        assert connection.execute("SELECT count(*) FROM responses").fetchone() == (1,)


@pytest.mark.asyncio
async def test_sqlite_keeps_conversations_private_to_their_owner(tmp_path):
    path = tmp_path / "state" / "responses.db"
    async with opened_state_store(parse_store_url(f"sqlite://{path}")) as store:
        await store.put(record())
        files = [path, *path.parent.glob("responses.db-*")]  # the -wal and -shm files while it is open
        modes = {file.name: stat.S_IMODE(file.stat().st_mode) for file in files}
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert modes and set(modes.values()) == {0o600}, modes


@pytest.mark.asyncio
async def test_sqlite_that_cannot_be_created_fails_on_open(tmp_path):
    (tmp_path / "a-file").write_text("not a directory")
    with pytest.raises(StateStoreError, match="a-file"):
        async with opened_state_store(parse_store_url(f"sqlite://{tmp_path / 'a-file' / 'responses.db'}")):
            pass


@pytest.mark.asyncio
async def test_sqlite_write_that_fails_leaves_nothing_and_never_blocks_the_loop(tmp_path):
    """Another process holds the file locked: the write waits its busy timeout on the store's thread while the
    event loop keeps running, then fails with StateStoreError, and the record is absent, not half there."""
    path = tmp_path / "responses.db"
    store = SqliteStateStore(path, busy_timeout=0.5)
    await store.open()
    try:
        blocker = sqlite3.connect(path, isolation_level=None)
        blocker.execute("BEGIN EXCLUSIVE")
        stored = record()
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        started = time.monotonic()
        with pytest.raises(StateStoreError, match="locked"):
            await store.put(stored)
        ticker.cancel()
        assert time.monotonic() - started >= 0.4 and ticks >= 10  # the loop ran all the while
        blocker.execute("ROLLBACK")
        blocker.close()
        assert await store.get(stored.id) is None
        await store.put(stored)  # the lock is gone: the same store writes again
        assert await store.get(stored.id) == stored
    finally:
        await store.close()


@pytest.mark.asyncio
async def test_sqlite_file_shared_by_two_stores(tmp_path):
    url = parse_store_url(f"sqlite://{tmp_path / 'responses.db'}")
    async with opened_state_store(url) as a, opened_state_store(url) as b:
        stored = [record(str(i)) for i in range(20)]
        await asyncio.gather(*(store.put(r) for store, r in zip([a, b] * 10, stored)))
        assert [await b.get(r.id) for r in stored] == stored
        assert await a.delete(stored[0].id) and await b.get(stored[0].id) is None


# ---------------------------------------------------------------------------------------------- Redis

@pytest.mark.asyncio
async def test_redis_keeps_one_key_per_record(redis_server):
    stored = record()
    async with opened_state_store(parse_store_url(redis_server.url)) as store:
        await store.put(stored)
    value = redis.Redis.from_url(redis_server.url).get(KEY_PREFIX + stored.id)
    assert KEY_PREFIX == "pagedserve:response:" and StoredResponse.decode(value) == stored


@pytest.mark.asyncio
async def test_dead_redis_fails_on_open(tmp_path):
    dead = start_redis(tmp_path / "redis")
    stop_redis(dead)
    with pytest.raises(StateStoreError, match=f"127.0.0.1:{dead.port}"):
        async with opened_state_store(parse_store_url(dead.url)):
            pass


@pytest.mark.asyncio
async def test_redis_stopped_then_started_under_an_open_store(tmp_path):
    """Redis goes away: every call fails promptly with StateStoreError and writes nothing; Redis comes back on
    the same port: the same store object (its pool reconnects) serves again, with what Redis kept."""
    server = start_redis(tmp_path / "redis")
    store = RedisStateStore(server.url)
    try:
        await store.open()
        kept = record("kept")
        await store.put(kept)
        stop_redis(server)
        lost = record("lost")
        for call in (store.put(lost), store.get(kept.id), store.delete(kept.id)):
            started = time.monotonic()
            with pytest.raises(StateStoreError, match="Redis state store"):
                await call
            assert time.monotonic() - started < 2 * SOCKET_TIMEOUT_S + 1
        restart_redis(server)
        assert await store.get(kept.id) == kept  # the append-only file kept it
        assert await store.get(lost.id) is None
        await store.put(lost)
        assert await store.get(lost.id) == lost
    finally:
        await store.close()
        stop_redis(server)
