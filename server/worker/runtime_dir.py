"""RuntimeDir: the private directory that holds the ipc:// sockets between the frontend and its worker.

Its mode is 0700, so no other local user can reach the worker's sockets.
`--runtime-dir DIR` names it; without it, a fresh `pagedserve-XXXXXX`
directory is made under $XDG_RUNTIME_DIR when that is set and writable, else
under the system's temp dir.

A directory made here is removed on exit. Beside it lies its owner lock
(`pagedserve-XXXXXX.lock`), a file this frontend keeps locked (flock) while
it runs: a frontend killed with SIGKILL cannot remove its directory, and the
next one this user starts removes every directory there whose lock no one
holds (as the KV segments of servers that are gone are removed). An
existing one is accepted only
when it is a real directory (not a link) that this user owns and no one else
may access; it is left in place on exit (systemd's RuntimeDirectory= may
have made it, and it may hold other things): only the sockets in it are
removed, by the EngineClient that made them.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from server.worker.owner_lock import abandoned

_PRIVATE_MODE = 0o700
_PREFIX = "pagedserve-"
LOCK_SUFFIX = ".lock"

logger = logging.getLogger("pagedserve.runtime_dir")


class RuntimeDirError(ValueError):
    """The runtime directory cannot be made, or is not private to this user."""


@dataclass(slots=True)
class RuntimeDir:
    path: Path
    is_created: bool  # made here, so removed by remove()
    owner_lock: int | None = None  # the descriptor of its owner lock, locked while this frontend runs

    @classmethod
    def create(cls, requested: Path | str | None = None) -> RuntimeDir:
        if requested is None:
            parent = _default_parent()
            remove_stale(Path(parent or tempfile.gettempdir()))
            path = Path(tempfile.mkdtemp(prefix=_PREFIX, dir=parent))
            lock = os.open(owner_lock_path(path), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            fcntl.flock(lock, fcntl.LOCK_EX)
            return cls(path, is_created=True, owner_lock=lock)
        path = Path(requested).absolute()
        try:
            os.mkdir(path, _PRIVATE_MODE)
        except FileExistsError:
            check_private(path)
            return cls(path, is_created=False)
        except OSError as exc:
            raise RuntimeDirError(f"cannot create the runtime directory {str(path)!r}: {exc.strerror}") from exc
        os.chmod(path, _PRIVATE_MODE)  # mkdir's mode passes through the umask, which may only have narrowed it
        return cls(path, is_created=True)

    def remove(self) -> None:
        if self.is_created:
            shutil.rmtree(self.path, ignore_errors=True)
        if self.owner_lock is not None:
            with contextlib.suppress(FileNotFoundError):
                owner_lock_path(self.path).unlink()
            os.close(self.owner_lock)
            self.owner_lock = None

    def __enter__(self) -> RuntimeDir:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()


def check_private(path: Path) -> None:
    """Raise RuntimeDirError unless `path` is a directory (not a link) of this user's with mode 0700 or narrower."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise RuntimeDirError(f"the runtime directory {str(path)!r} must be a directory, not a link or a file")
    if info.st_uid != os.geteuid():
        raise RuntimeDirError(f"the runtime directory {str(path)!r} must belong to this user (uid {os.geteuid()}), "
                              f"but uid {info.st_uid} owns it")
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        raise RuntimeDirError(f"the runtime directory {str(path)!r} must allow no access to group or others "
                              f"(mode 0700), got mode {mode:04o}; run chmod 700 on it or pick another")


def owner_lock_path(path: Path) -> Path:
    return path.with_name(path.name + LOCK_SUFFIX)


def remove_stale(parent: Path) -> list[Path]:
    """Remove this user's runtime directories under `parent` whose frontend is gone (an owner lock no one holds),
    and their locks; the directories removed. A directory without a lock is left alone: nothing says whose."""
    removed = []
    for lock in abandoned(parent.glob(f"{_PREFIX}*{LOCK_SUFFIX}")):
        path = lock.with_name(lock.name.removesuffix(LOCK_SUFFIX))
        if path.is_dir() and not path.is_symlink() and os.lstat(path).st_uid == os.getuid():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            logger.warning("removed %s, the runtime directory a server that is gone left behind", path)
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()
    return removed


def _default_parent() -> str | None:
    """$XDG_RUNTIME_DIR when it is a writable directory; None (the system temp dir) otherwise."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK | os.X_OK):
        return xdg
    return None
