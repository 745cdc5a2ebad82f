"""Each fact the frontend and the worker share has one home: no other module defines it again.

A grep over the project's packages: the old spellings (a second SEED_BITS, a
finish reason as a module constant, a heartbeat interval in the worker loop,
restart-policy defaults outside RestartPolicy) fail here by file and line.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("server", "gpu_worker", "shared", "tools")

HOMES = {
    r"class FinishReason\b": "shared/vocabulary.py",
    r"SEED_BITS\s*[:=]": "shared/vocabulary.py",
    r"HEARTBEAT_INTERVAL_S\s*[:=]": "shared/vocabulary.py",
    r"MIN_HANG_TIMEOUT_S\s*[:=]": "shared/vocabulary.py",
    r"RETRY_AFTER_S\s*[:=]": "server/http/errors.py",
    r"class RestartPolicy\b": "server/worker/restart_policy.py",
}
# A finish reason spelled as a module constant of its own: `STOP = "stop"`, `ABORT = "abort"`, `FAILED = "error"`.
FINISH_REASON_CONSTANT = re.compile(r"""^[A-Z_]+\s*=\s*["'](stop|length|abort)["']|"""
                                    r"""^[A-Z_]*(FAILED|OUTCOME|REASON)[A-Z_]*\s*=\s*["']error["']""")
# A finish reason compared or assigned as a literal: `finish_reason == "stop"`, `append([], None, "abort")`.
FINISH_REASON_LITERAL = re.compile(r"""finish_reason\s*(==|!=|=)\s*["'](stop|length|abort|error)["']|"""
                                   r"""append\(\[\], None, ["'](stop|length|abort|error)["']\)""")
# Restart-policy defaults written as keyword defaults outside RestartPolicy.
POLICY_DEFAULT = re.compile(r"\b(hang_timeout|start_timeout|max_request_restarts|max_worker_restarts|restart_window)"
                            r"\s*:\s*(float|int)\s*=\s*[\d.]+")


def _sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def _lines(path: Path) -> list[tuple[int, str]]:
    return [(i, line) for i, line in enumerate(path.read_text().splitlines(), start=1)
            if not line.lstrip().startswith("#")]


def test_the_sources_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in _sources()}
    assert set(HOMES.values()) <= names, "a home moved: update HOMES"


def test_each_shared_fact_is_defined_only_in_its_home():
    strays = [f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
              for pattern, home in HOMES.items()
              for path in _sources() if path.relative_to(ROOT).as_posix() != home
              for i, line in _lines(path) if re.match(rf"\s*{pattern}", line)]
    assert strays == []


def test_each_home_defines_its_fact():
    for pattern, home in HOMES.items():
        assert any(re.match(rf"\s*{pattern}", line) for _, line in _lines(ROOT / home)), (pattern, home)


def test_finish_reasons_are_spelled_by_the_enum():
    strays = [f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
              for path in _sources() if path.relative_to(ROOT).as_posix() != "shared/vocabulary.py"
              for i, line in _lines(path) if FINISH_REASON_CONSTANT.match(line) or FINISH_REASON_LITERAL.search(line)]
    assert strays == []


def test_restart_policy_defaults_are_written_once():
    strays = [f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
              for path in _sources() if path.relative_to(ROOT).as_posix() != "server/worker/restart_policy.py"
              for i, line in _lines(path) if POLICY_DEFAULT.search(line)]
    assert strays == []
