"""Files a running server holds a lock on (flock), so that the next server of the same user can tell the ones a
server that is gone left behind: the KV cache segment (kv_segment.py) and the runtime directory's owner lock
(runtime_dir.py)."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterable, Iterator
from pathlib import Path


def abandoned(paths: Iterable[Path]) -> Iterator[Path]:
    """Those of `paths` that are this user's and that no process holds a lock on, each yielded while this process
    holds it (to be removed then); another user's, a link, or one already gone is passed over."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if os.fstat(fd).st_uid != os.getuid():
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a running server's
            yield path
        finally:
            os.close(fd)
