"""RuntimeDir: private (0700), made fresh by default, an existing one accepted only when private, cleaned up; the one
a SIGKILLed frontend left behind removed by the next."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from server.worker.runtime_dir import RuntimeDir, RuntimeDirError


def mode_of(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_default_is_a_fresh_private_dir_under_xdg_runtime_dir_and_is_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    with RuntimeDir.create() as runtime_dir:
        assert runtime_dir.path.parent == tmp_path and runtime_dir.path.name.startswith("pagedserve-")
        assert mode_of(runtime_dir.path) == 0o700
        (runtime_dir.path / "input").touch()
    assert not runtime_dir.path.exists()


def test_default_falls_back_to_a_temp_dir_without_a_usable_xdg_runtime_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "missing"))
    with RuntimeDir.create() as runtime_dir:
        assert runtime_dir.path.exists() and mode_of(runtime_dir.path) == 0o700
        assert "missing" not in str(runtime_dir.path)
    assert not runtime_dir.path.exists()


def test_a_named_dir_that_does_not_exist_is_made_private_and_removed(tmp_path):
    old_umask = os.umask(0)  # even a permissive umask must not loosen it
    try:
        runtime_dir = RuntimeDir.create(tmp_path / "rt")
    finally:
        os.umask(old_umask)
    assert runtime_dir.is_created and mode_of(runtime_dir.path) == 0o700
    runtime_dir.remove()
    assert not (tmp_path / "rt").exists()


def test_an_existing_private_dir_is_used_and_left_in_place(tmp_path):
    existing = tmp_path / "rt"
    existing.mkdir(mode=0o700)
    (existing / "other-file").touch()
    with RuntimeDir.create(existing) as runtime_dir:
        assert runtime_dir.path == existing and not runtime_dir.is_created
    assert (existing / "other-file").exists()


@pytest.mark.parametrize("mode", [0o755, 0o770, 0o701, 0o707])
def test_an_existing_dir_open_to_others_is_refused(tmp_path, mode):
    existing = tmp_path / "rt"
    existing.mkdir()
    existing.chmod(mode)
    with pytest.raises(RuntimeDirError, match=f"got mode {mode:04o}"):
        RuntimeDir.create(existing)


def test_a_link_or_a_file_is_refused(tmp_path):
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(target)
    (tmp_path / "file").touch()
    for name in ("link", "file"):
        with pytest.raises(RuntimeDirError, match="must be a directory"):
            RuntimeDir.create(tmp_path / name)


def test_a_dir_of_another_owner_is_refused(tmp_path, monkeypatch):
    existing = tmp_path / "rt"
    existing.mkdir(mode=0o700)
    monkeypatch.setattr(os, "geteuid", lambda: os.lstat(existing).st_uid + 1)
    with pytest.raises(RuntimeDirError, match="must belong to this user"):
        RuntimeDir.create(existing)


def test_a_dir_that_cannot_be_made_says_why(tmp_path):
    with pytest.raises(RuntimeDirError, match="cannot create"):
        RuntimeDir.create(tmp_path / "no" / "such" / "parent")


def test_the_directory_of_a_sigkilled_frontend_is_removed_by_the_next_and_a_live_ones_is_not(tmp_path, monkeypatch):
    """A real process makes its runtime directory (a ledger in it) and dies of SIGKILL, holding the owner lock."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    killed = subprocess.run([sys.executable, "-c", (
        "import os, signal\n"
        "from server.worker.runtime_dir import RuntimeDir\n"
        "runtime_dir = RuntimeDir.create()\n"
        "(runtime_dir.path / 'scheduled-1').write_text('ledger')\n"
        "print(runtime_dir.path, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n")], capture_output=True, text=True, env={**os.environ})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    left_behind = Path(killed.stdout.strip())
    unrelated = tmp_path / "pagedserve-not-a-runtime-dir"  # no owner lock beside it: nothing says whose it is
    unrelated.mkdir()
    with RuntimeDir.create() as live:
        assert not left_behind.exists(), "the dead frontend's directory, ledgers and all, is removed"
        assert not left_behind.with_name(left_behind.name + ".lock").exists() and unrelated.is_dir()
        with RuntimeDir.create() as second:  # a second server of this user: the first is running
            assert live.path.is_dir() and second.path.is_dir()
    assert sorted(path.name for path in tmp_path.iterdir()) == [unrelated.name], "each removed its own, lock and all"
