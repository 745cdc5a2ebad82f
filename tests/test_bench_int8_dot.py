"""The W8A8 probe (tools/bench/kernels/bench_int8_dot.py): both inner loops build, agree with numpy's product (the
tool checks this itself before it times them, and exits otherwise) and are timed; below AVX2 it says it has none."""

from __future__ import annotations

import re

import pytest

from shared.cpu_tier import current_tier

from tools.bench.kernels import bench_int8_dot


def test_both_loops_compute_the_product_and_are_timed(capsys):
    if current_tier().vector_bits < 256:
        with pytest.raises(SystemExit, match="below AVX2"):
            bench_int8_dot.main(["--passes", "10", "--turns", "1"])
        return
    bench_int8_dot.main(["--passes", "10", "--turns", "2", "--inputs", "64"])
    printed = capsys.readouterr().out
    assert re.search(r"dequantize +\d+\.\d G multiply-adds/s", printed), printed
    assert re.search(r"W8A8 +\d+\.\d G multiply-adds/s", printed), printed
    assert re.search(r"W8A8 / dequantize: \d+\.\d\dx", printed), printed
