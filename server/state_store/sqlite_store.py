"""SqliteStateStore: stored responses in one SQLite file, the embedded default.

Owns: the file (created with its directory on open), the `responses` table,
and the one thread that talks to SQLite.
Must not know: HTTP, what a response contains (StoredResponse does).
How: sqlite3 blocks, so every call runs on a single worker thread that owns
the connection, and the event loop only awaits it. Each record is one row
written in one transaction. The file is in WAL mode with a busy timeout, so
several servers on one host (replicas, or a restart overlapping its
predecessor) may share it: readers never wait for the writer, and a writer
waits for another's transaction instead of failing at once. Any sqlite3 or
file-system error becomes a StateStoreError.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from server.state_store.store import StateStore, StateStoreError, StoredResponse

T = TypeVar("T")
DEFAULT_BUSY_TIMEOUT_S = 5.0
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
SCHEMA = "CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, record BLOB NOT NULL, created_at REAL NOT NULL)"


class SqliteStateStore(StateStore):
    def __init__(self, path: Path, *, busy_timeout: float = DEFAULT_BUSY_TIMEOUT_S):
        """busy_timeout: seconds a write waits for another connection's transaction before it fails."""
        if not path.is_absolute():
            raise ValueError(f"the SQLite store needs an absolute file path, got {str(path)!r}")
        if not busy_timeout >= 0:
            raise ValueError(f"busy_timeout must be >= 0 seconds, got {busy_timeout!r}")
        self.path = path
        self._busy_timeout = busy_timeout
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite-state-store")
        self._connection: sqlite3.Connection | None = None

    async def open(self) -> None:
        await self._call(self._open)

    async def put(self, record: StoredResponse) -> None:
        created_at = record.response.get("created_at", 0)
        await self._call(self._write, "INSERT OR REPLACE INTO responses (id, record, created_at) VALUES (?, ?, ?)",
                         (record.id, record.encode(), created_at))

    async def get(self, response_id: str) -> StoredResponse | None:
        row = await self._call(self._read, response_id)
        return None if row is None else StoredResponse.decode(row)

    async def delete(self, response_id: str) -> bool:
        return await self._call(self._write, "DELETE FROM responses WHERE id = ?", (response_id,)) > 0

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._thread, self._close)
        self._thread.shutdown(wait=True)

    # ------------------------------------------------------------------------------------------ the thread

    async def _call(self, function: Callable[..., T], *args) -> T:
        try:
            return await asyncio.get_running_loop().run_in_executor(self._thread, function, *args)
        except (sqlite3.Error, OSError) as exc:
            raise StateStoreError(f"the SQLite state store {str(self.path)!r} failed: {exc}") from exc

    def _open(self) -> None:
        # Conversations are private: a new directory is the owner's alone, a new file 0600 (SQLite gives its
        # -wal and -shm files the database file's mode). An existing file keeps the mode its owner gave it.
        self.path.parent.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
        os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, PRIVATE_FILE_MODE))
        connection = sqlite3.connect(self.path, timeout=self._busy_timeout, isolation_level=None)
        try:
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute(SCHEMA)
        except sqlite3.Error:
            connection.close()
            raise
        self._connection = connection

    def _write(self, statement: str, parameters: tuple) -> int:
        """One statement in its own transaction; the number of rows it changed."""
        connection = self._require_open()
        connection.execute("BEGIN IMMEDIATE")
        try:
            changed = connection.execute(statement, parameters).rowcount
            connection.execute("COMMIT")
        except BaseException:
            if connection.in_transaction:
                connection.execute("ROLLBACK")
            raise
        return changed

    def _read(self, response_id: str) -> bytes | None:
        row = self._require_open().execute("SELECT record FROM responses WHERE id = ?", (response_id,)).fetchone()
        return None if row is None else row[0]

    def _require_open(self) -> sqlite3.Connection:
        if self._connection is None:
            raise sqlite3.ProgrammingError("the SQLite state store is not open (call open() first)")
        return self._connection

    def _close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None
