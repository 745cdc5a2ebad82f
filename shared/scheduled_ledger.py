"""The scheduled ledger: a file in which the worker notes each request before its first forward pass.

Owns: the ledger's name in the runtime directory, its line format, the
worker's writer (ScheduledLedger) and the frontend's reader (read_ledger).
Both sides live here because the server and the worker never import each
other. Must not know: sockets, processes, what a death is blamed on.

Why a file: a worker can die at any instant (SIGKILL, os._exit, a
segfault, the OOM killer), and a ZMQ message it sent just before is then
often lost in its socket's queue. Bytes that os.write took are in the
kernel's page cache once it returns, and the death of the process does not
take them back. So before a step's forward pass the worker appends the ids
of the requests it runs for the first time, in one os.write (none in a
steady decode), and the frontend reads the file once the worker has exited.

How: `<runtime_dir>/scheduled-<epoch>`, mode 0600, emptied when the worker
opens it, one JSON string per line, since a request id may hold any
character, a newline too. A last line without its newline is a write the
death cut short: the step it came before never ran, so it is left out. A
request stays noted until it finishes. Once the file holds more than
max(compact_after_lines, twice the unfinished) lines, the worker writes the
unfinished ones to a new file and renames it over the old, which is atomic:
a death leaves one whole file or the other, and a long-lived worker's
ledger stays small.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path

import orjson

LEDGER_PREFIX = "scheduled-"
FILE_MODE = 0o600
COMPACT_AFTER_LINES = 1024  # lines a ledger grows to before it is rewritten without the finished requests
_COMPACTING_SUFFIX = ".new"
_OPEN_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC


def ledger_path(runtime_dir: Path, epoch: int) -> Path:
    return Path(runtime_dir) / f"{LEDGER_PREFIX}{epoch}"


def _compacting_path(path: Path) -> Path:
    return path.with_name(path.name + _COMPACTING_SUFFIX)


def encode_request_ids(request_ids: Iterable[str]) -> bytes:
    """One line per id, each a JSON string (its newlines escaped)."""
    return b"".join(orjson.dumps(request_id) + b"\n" for request_id in request_ids)


def decode_request_ids(data: bytes) -> list[str]:
    """The ids on the whole lines of `data` (a last line without its newline is left out); ValueError for a line
    that is not a JSON string."""
    *lines, _cut_short = data.split(b"\n")
    request_ids = []
    for number, line in enumerate(lines, 1):
        try:
            request_id = orjson.loads(line)
        except orjson.JSONDecodeError:
            request_id = None
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"line {number} of the scheduled ledger must be a request id as a JSON string, "
                             f"got {line[:100]!r}")
        request_ids.append(request_id)
    return request_ids


class ScheduledLedger:
    """The worker's side: notes the requests it is about to run for the first time, forgets those that finished."""

    def __init__(self, path: Path, compact_after_lines: int = COMPACT_AFTER_LINES) -> None:
        self.path = Path(path)
        self.compact_after_lines = compact_after_lines
        self._fd = os.open(self.path, _OPEN_FLAGS, FILE_MODE)
        self._unfinished: set[str] = set()  # noted and not finished since
        self._num_lines = 0  # in the file now

    def note(self, request_ids: Iterable[str]) -> list[str]:
        """Append those of request_ids not noted yet, and return them (the requests run for the first time); once
        this returns they outlive any death of the process."""
        new_ids = [request_id for request_id in request_ids if request_id not in self._unfinished]
        if not new_ids:
            return new_ids
        _write_all(self._fd, encode_request_ids(new_ids))
        self._unfinished.update(new_ids)
        self._num_lines += len(new_ids)
        if self._num_lines > max(self.compact_after_lines, 2 * len(self._unfinished)):
            self._compact()
        return new_ids

    def forget(self, request_ids: Iterable[str]) -> None:
        """These requests finished: the next compaction drops them, and one that comes back is noted again."""
        self._unfinished.difference_update(request_ids)

    def _compact(self) -> None:
        """Rewrite the file with only the unfinished requests: a new file, renamed over the old one."""
        new_path = _compacting_path(self.path)
        fd = os.open(new_path, _OPEN_FLAGS, FILE_MODE)
        try:
            _write_all(fd, encode_request_ids(self._unfinished))
            os.rename(new_path, self.path)
        except BaseException:
            os.close(fd)
            raise
        os.close(self._fd)
        self._fd, self._num_lines = fd, len(self._unfinished)

    def close(self) -> None:
        os.close(self._fd)


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


def read_ledger(path: Path) -> list[str]:
    """The frontend's side, once the worker has exited: the ids its ledger names ([] without a ledger).
    OSError when the file cannot be read, ValueError when a line is not a request id."""
    try:
        return decode_request_ids(Path(path).read_bytes())
    except FileNotFoundError:
        return []  # the worker died before it opened its ledger


def remove_ledger(path: Path) -> None:
    """Remove the ledger, and a new one that a death cut short while it was being written."""
    for each in (Path(path), _compacting_path(Path(path))):
        with contextlib.suppress(FileNotFoundError):
            each.unlink()
