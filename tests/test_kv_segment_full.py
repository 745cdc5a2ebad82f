"""The shared KV segment on a file system with too little room for it (a full /dev/shm), or room that it would take
to the last bytes: the worker that sizes it gets an OSError at start-up and leaves the file empty, and so does
every worker after it; none maps a file with holes, whose first touch past the room would be a SIGBUS in the
middle of a step.

On a real tmpfs, a few MiB large, mounted for the test (which needs the right to mount: root, or the test is
skipped); a filler file takes the room a process outside the server would.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gpu_worker.kv.kv_segment import KVSegment, map_kv_segment, segment_size

SMALL_TMPFS = "6m"
FILLER_BYTES = 3 << 20  # another process's files: what is left is less than the segment needs
# 2 layers x 2 x 64 blocks x 16 positions x 4 heads x 64 x 4 bytes: 4 MiB of pool and a page of serials
LAYERS, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 2, 64, 16, 4, 64
SEGMENT_BYTES = segment_size(BLOCKS, 2 * LAYERS * BLOCK_SIZE * KV_HEADS * HEAD_DIM * 4)
# room for the segment, but it would leave 100 KiB of the 6 MiB free, under the margin of a sixteenth
TOO_LITTLE_LEFT = (6 << 20) - SEGMENT_BYTES - (100 << 10)


def map_segment(path: Path) -> KVSegment:
    return map_kv_segment(path, LAYERS, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, torch.float32)


@pytest.fixture
def small_tmpfs(tmp_path) -> Iterator[Path]:
    mount_point = tmp_path / "shm"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SMALL_TMPFS}", "tmpfs", str(mount_point)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "--lazy", str(mount_point)], check=True)  # lazily: a mapping may outlive the test


@pytest.mark.parametrize("filler_bytes", [FILLER_BYTES, TOO_LITTLE_LEFT], ids=["no-room", "room-but-no-margin"])
def test_a_segment_that_does_not_fit_is_refused_by_every_worker_and_holds_nothing(small_tmpfs, filler_bytes: int):
    filler = small_tmpfs / "filler"
    with filler.open("wb") as file:
        os.posix_fallocate(file.fileno(), 0, filler_bytes)
    segment = small_tmpfs / "pagedserve-kv"
    segment.touch()
    for worker in ("the first worker", "its standby"):
        with pytest.raises(OSError) as raised:
            map_segment(segment)
        assert raised.value.errno == errno.ENOSPC, worker
        assert segment.stat().st_size == 0 and segment.stat().st_blocks == 0, f"{worker} left the file holding room"
    filler.unlink()
    mapped = map_segment(segment)
    mapped.kv_caches[-1][1].fill_(1.0)  # every page of the pool is there to be written
    assert segment.stat().st_blocks * 512 >= segment.stat().st_size


def test_a_sized_file_with_holes_is_reserved_or_refused_never_mapped_as_it_is(small_tmpfs):
    segment = small_tmpfs / "pagedserve-kv"
    with segment.open("wb") as file:
        file.truncate(SEGMENT_BYTES)  # sized, nothing reserved: what a file system may hold
    with (small_tmpfs / "filler").open("wb") as file:
        os.posix_fallocate(file.fileno(), 0, FILLER_BYTES)
    with pytest.raises(OSError) as raised:
        map_segment(segment)
    assert raised.value.errno == errno.ENOSPC

    (small_tmpfs / "filler").unlink()
    mapped = map_segment(segment)  # now there is room: reserved, then mapped
    assert segment.stat().st_blocks * 512 >= SEGMENT_BYTES
    mapped.kv_caches[0][0].fill_(1.0)
