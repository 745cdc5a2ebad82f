"""The scheduled ledger: ids of any characters round-trip, a write cut short is left out, what the worker noted
outlives its death however it dies, and compaction keeps a long-lived worker's ledger small.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from shared.scheduled_ledger import (
    FILE_MODE,
    ScheduledLedger,
    decode_request_ids,
    encode_request_ids,
    ledger_path,
    read_ledger,
    remove_ledger,
)

ODD_IDS = ["chatcmpl-0f3a", "new\nline", "\r\n", 'quote"', "back\\slash", "\N{SNOWMAN}", "\u2028", " ", "{}"]
DIE_AFTER_NOTE = """
import os, signal, sys
from shared.scheduled_ledger import ScheduledLedger
ledger = ScheduledLedger(sys.argv[1])
ledger.note(["early", "poison\\nwith a newline"])
ledger.note(["early", "late"])
os.kill(os.getpid(), signal.SIGKILL) if sys.argv[2] == "SIGKILL" else os._exit(1)
"""


def test_ids_of_any_characters_round_trip_one_line_each():
    data = encode_request_ids(ODD_IDS)
    assert data.count(b"\n") == len(ODD_IDS)
    assert decode_request_ids(data) == ODD_IDS
    assert decode_request_ids(b"") == []


def test_a_last_line_cut_short_is_left_out():
    data = encode_request_ids(["a", "b"])
    for cut in range(len(data)):
        whole_lines = data[:cut].count(b"\n")
        assert decode_request_ids(data[:cut]) == ["a", "b"][:whole_lines]


@pytest.mark.parametrize("line", [b"a", b"", b"17", b'["a"]', b'""', b'"a" "b"'])
def test_a_whole_line_that_is_no_request_id_raises(line):
    with pytest.raises(ValueError, match="line 2 of the scheduled ledger"):
        decode_request_ids(encode_request_ids(["ok"]) + line + b"\n")


def test_a_ledger_is_private_and_starts_empty(tmp_path):
    ScheduledLedger(ledger_path(tmp_path, 1)).close()
    assert stat.S_IMODE(os.stat(ledger_path(tmp_path, 1)).st_mode) == FILE_MODE
    stale = ledger_path(tmp_path, 2)
    stale.write_bytes(encode_request_ids(["left-by-an-earlier-frontend"]))
    ScheduledLedger(stale).close()
    assert read_ledger(stale) == []


def test_each_request_is_noted_once_until_it_finishes(tmp_path):
    path = ledger_path(tmp_path, 7)
    ledger = ScheduledLedger(path)
    ledger.note(ODD_IDS[:2])
    ledger.note(ODD_IDS[:3])
    ledger.note([])
    ledger.forget([ODD_IDS[0]])
    ledger.note(ODD_IDS[:3])  # the finished one came back
    ledger.close()
    assert read_ledger(path) == [*ODD_IDS[:3], ODD_IDS[0]]


def test_compaction_keeps_the_unfinished_and_bounds_the_file(tmp_path):
    path = ledger_path(tmp_path, 1)
    ledger = ScheduledLedger(path, compact_after_lines=8)
    ledger.note(["long-running-1", "long-running-2"])
    max_lines = 0
    for i in range(200):
        ledger.note([f"short-{i}", f"short-{i}-twin"])
        max_lines = max(max_lines, len(read_ledger(path)))
        ledger.forget([f"short-{i}", f"short-{i}-twin"])
    ledger.note(["last"])
    ledger.close()
    assert max_lines <= 8, "rewritten once it holds more than compact_after_lines"
    assert {"long-running-1", "long-running-2", "last"} <= set(read_ledger(path))
    assert not set(read_ledger(path)) & {f"short-{i}" for i in range(190)}
    assert [p.name for p in tmp_path.iterdir()] == [path.name], "no file left from a compaction"


@pytest.mark.parametrize("death", ["SIGKILL", "os._exit"])
def test_what_was_noted_outlives_the_process(tmp_path, death):
    path = ledger_path(tmp_path, 3)
    finished = subprocess.run([sys.executable, "-c", DIE_AFTER_NOTE, str(path), death], timeout=60)
    assert finished.returncode == (-9 if death == "SIGKILL" else 1)
    assert read_ledger(path) == ["early", "poison\nwith a newline", "late"]


def test_without_a_ledger_none_is_named_and_removing_takes_the_compaction_file_too(tmp_path):
    path = ledger_path(tmp_path, 2)
    assert read_ledger(path) == []
    path.write_bytes(b"")
    path.with_name(path.name + ".new").write_bytes(b"")
    remove_ledger(path)
    remove_ledger(path)
    assert list(tmp_path.iterdir()) == []
