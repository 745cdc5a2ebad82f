"""The decode attention benchmark (tools/bench/kernels/bench_attention.py): the KV it says the kernel read per second
and per tile is the workload's own, counted from its contexts, and a run of the 4-layer shape prints it for every
case against the torch path's output."""

from __future__ import annotations

import re

import pytest
import torch

from gpu_worker.attention.cpu_decode import load_cpu_decode_kernel

from tools.bench.kernels import bench_attention


def test_the_rate_counts_each_context_once_in_k_and_v(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    step = bench_attention.decode_step([16, 40], 0, 16, 1, torch.float32, 0, bench_attention.SHAPES["tiny-4l"])
    timing = bench_attention.Timing([2e-6, 1e-6, 0.5e-6], torch.empty(0))
    # 56 positions, K and V, 2 kv heads of 64 float32: 57,344 bytes in the median 1 us; 1 + 3 tiles of 16 keys on
    # 2 threads: 2 us of thread time over 4 tiles.
    # A tile's arithmetic: 4 query heads x 16 keys x 4 x 64 = 16,384 FLOPs, 164 ns a thread at 200 GFLOP/s on 2.
    assert bench_attention.rate(step, timing, 114.688e9, 200e9) == (
        "  57.3 GB/s ( 50% of the machine's),    500 ns per tile of 16 keys on a thread (its arithmetic at the "
        "float32 matmul rate: 164 ns)")


@pytest.mark.skipif(load_cpu_decode_kernel() is None, reason="the C decode kernel does not build here")
def test_a_warm_run_of_the_4_layer_shape_reports_every_case(capsys):
    bench_attention.main(["--shape", "tiny-4l", "--batch", "2", "--layers", "1", "--repeats", "1", "--warm",
                          "--threads", str(torch.get_num_threads())])
    printed = capsys.readouterr().out
    assert re.search(r"memory bandwidth \d+\.\d GB/s \(read\), float32 matmul \d+\.\d GFLOP/s", printed), printed
    assert "heads 4/2 kv" in printed, printed
    assert "warm caches" in printed, printed
    assert len(re.findall(r"kernel reads +\d+\.\d GB/s \( *\d+% of the machine's\), +\d+ ns per tile of 16 keys on a "
                          r"thread \(its arithmetic at the float32 matmul rate: \d+ ns\)", printed)) == 4, printed
    differences = [float(d) for d in re.findall(r"torch .*? max diff (\S+)", printed)]
    assert len(differences) == 4 and max(differences) < 2e-2, printed
