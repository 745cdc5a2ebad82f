"""KVSegmentFile: the shared-memory file that holds the workers' KV cache, so that it outlives any one of them.

The frontend owns the file's life: it creates it empty in /dev/shm (mode
0600, a name no other server takes: `pagedserve-kv-<pid>-<random>`), holds
an exclusive flock on it for as long as it runs, hands its path to every
worker it starts, and removes it when it exits, whatever the path out
(drain, giving up, an error). The workers size it and lay the cache out in it
(gpu_worker/kv/kv_segment.py); the frontend never maps it, and never imports
torch for it.

A frontend that is SIGKILLed cannot remove it. Its lock goes with it,
though, so the next server started by the same user removes every segment of
its name whose lock it can take: no live server holds those. The CUDA
equivalent would be device memory exported with the CUDA virtual memory API
(cuMemCreate with a POSIX file descriptor handle), whose descriptor the
frontend would hold; this build shares the cache on the CPU only.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
from pathlib import Path

from server.worker.owner_lock import abandoned

SEGMENT_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "pagedserve-kv-"

logger = logging.getLogger("pagedserve.kv_segment")


class KVSegmentFile:
    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd  # holds the lock

    @classmethod
    def create(cls, directory: Path = SEGMENT_DIR) -> KVSegmentFile:
        """Remove this user's stale segments, then create and lock a new, empty one. OSError when it cannot."""
        remove_stale_segments(directory)
        path = directory / f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        return cls(path, fd)

    def remove(self) -> None:
        """Delete the file and let go of its lock; the memory is freed once the last worker has unmapped it."""
        if self._fd is None:
            return
        self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> KVSegmentFile:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()


def remove_stale_segments(directory: Path = SEGMENT_DIR) -> list[Path]:
    """Remove the segments of this user's servers that are gone (no lock held on them); the paths removed."""
    removed = []
    for path in abandoned(directory.glob(f"{SEGMENT_PREFIX}*")):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        removed.append(path)
        logger.warning("removed %s, the KV cache segment a server that is gone left behind", path)
    return removed
