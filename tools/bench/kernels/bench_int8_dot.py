"""Does W8A8 (integer dot products on quantized activations) beat widening int8 weights to float32, on this CPU?

Times the two inner loops of int8_dot_probe.c, one thread, data in the
first-level cache (576 inputs, SmolLM-135M's hidden size; a 6-row by
16-column register tile, the linear kernel's on AVX2): "dequantize" widens
each int8 weight to float32 and multiplies with an FMA, as the linear
kernel does; "W8A8" multiplies uint8 activations by int8 weights with
vpmaddubsw + vpmaddwd, four products per 32-bit lane. Where a layer is
bound by arithmetic (16 rows and more at these sizes: BENCHMARKS.md), this
ratio bounds what a W8A8 kernel could gain, before what it adds: quantizing
each row's activations, converting and scaling the int32 sums, and the
accuracy lost to 8-bit activations. The loops take turns; printed: each
one's multiply-adds per second (median of the turns) and the median ratio.

    python -m tools.bench.kernels.bench_int8_dot
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from gpu_worker.native.compiled_library import default_cache_dir, default_compiler, load_library
from shared.cpu_tier import current_tier

SOURCE = Path(__file__).with_name("int8_dot_probe.c")
ROWS, COLUMNS = 6, 16
_pointer, _i64 = ctypes.c_void_p, ctypes.c_int64


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inputs", type=int, default=576, help="inputs of the layer (a multiple of 4)")
    parser.add_argument("--passes", type=int, default=20_000, help="passes over the inputs per turn")
    parser.add_argument("--turns", type=int, default=9)
    args = parser.parse_args(argv)
    tier = current_tier()
    library = load_library(SOURCE, default_cache_dir(), default_compiler(), tier)
    for name in ("probe_dequantize", "probe_w8a8"):
        function = getattr(library, name)
        function.argtypes, function.restype = [_pointer, _pointer, _pointer, _i64, _i64], _i64
    rng = np.random.default_rng(0)
    k = args.inputs
    weights = rng.integers(-64, 64, size=(k, COLUMNS), dtype=np.int8)  # small: vpmaddubsw's int16 sums never saturate
    x_float = rng.integers(0, 64, size=(ROWS, k)).astype(np.float32)
    x_uint8 = x_float.astype(np.uint8)
    four_per_lane = np.ascontiguousarray(weights.reshape(k // 4, 4, COLUMNS).transpose(0, 2, 1))  # [k/4][16][4]
    out_float = np.zeros((ROWS, COLUMNS), dtype=np.float32)
    out_int = np.zeros((ROWS, COLUMNS), dtype=np.int32)
    calls = {
        "dequantize": lambda passes: library.probe_dequantize(weights.ctypes.data, x_float.ctypes.data,
                                                              out_float.ctypes.data, k, passes),
        "W8A8": lambda passes: library.probe_w8a8(four_per_lane.ctypes.data, x_uint8.ctypes.data,
                                                  out_int.ctypes.data, k, passes),
    }
    if calls["W8A8"](1) < 0:
        sys.exit(f"this CPU's tier ({tier.name}) is below AVX2: the probe has no loops for it")
    expected = x_float.astype(np.int64) @ weights.astype(np.int64)
    calls["dequantize"](1)
    if not (np.array_equal(out_int, expected) and np.array_equal(out_float, expected.astype(np.float32))):
        sys.exit("the two loops disagree with numpy's product; their timings would mean nothing")
    rates: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(args.turns):
        for name, call in calls.items():
            start = time.perf_counter()
            multiply_adds = call(args.passes)
            rates[name].append(multiply_adds / (time.perf_counter() - start))
    print(f"{tier.name} build, one thread, {ROWS} rows x {COLUMNS} columns x {k} inputs in the L1 cache, "
          f"median of {args.turns} turns")
    for name, values in rates.items():
        print(f"{name:10s} {statistics.median(values) / 1e9:7.1f} G multiply-adds/s")
    ratio = statistics.median(w8a8 / dequantize for w8a8, dequantize in zip(rates["W8A8"], rates["dequantize"]))
    print(f"W8A8 / dequantize: {ratio:.2f}x")


if __name__ == "__main__":
    main()
