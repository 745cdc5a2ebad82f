"""bench_soak's (tools/bench/serving/) verdict on synthetic memory series (flat, growing, growing then flat), its metrics parsing
and its plot."""

from __future__ import annotations

import random

from tools.bench.serving.bench_soak import Tally, _drop_model_label, judge, memory_row, slope, svg_plot

MB = 1e6
TIMES = [10.0 * i for i in range(181)]  # 30 minutes, a sample every 10 s
WARMUP_S = 300.0
TOLERANCE = 1.0  # MB per 10 minutes


def noisy(values: list[float], seed: int = 0, pages: int = 64) -> list[float]:
    """RSS-like noise: a few dozen pages either way."""
    rng = random.Random(seed)
    return [v + rng.randint(-pages, pages) * 4096 for v in values]


def test_the_slope_of_a_line_is_its_slope():
    assert slope([0, 1, 2, 3], [5, 7, 9, 11]) == 2.0
    assert slope([1.0], [3.0]) == 0.0 and slope([2.0, 2.0], [1.0, 5.0]) == 0.0


def test_a_flat_series_is_flat_despite_page_noise():
    verdict = judge(TIMES, noisy([1500 * MB] * len(TIMES)), WARMUP_S, TOLERANCE)
    assert verdict.kind == "flat" and abs(verdict.mb_per_10_min) < TOLERANCE
    assert verdict.num_samples == len([t for t in TIMES if t >= WARMUP_S])


def test_a_series_that_keeps_growing_is_growing():
    growing = [1500 * MB + t * (3 * MB / 600) for t in TIMES]  # 3 MB per 10 minutes
    verdict = judge(TIMES, noisy(growing), WARMUP_S, TOLERANCE)
    assert verdict.kind == "growing" and verdict.is_growing
    assert 2.5 < verdict.mb_per_10_min < 3.5 and 2.5 < verdict.last_half_mb_per_10_min < 3.5


def test_growth_that_ends_within_the_warm_up_is_flat():
    values = [1400 * MB + min(t, 240.0) * (100 * MB / 240) for t in TIMES]  # +100 MB in 4 minutes, then flat
    assert judge(TIMES, noisy(values), WARMUP_S, TOLERANCE).kind == "flat"
    assert judge(TIMES, noisy(values), 0.0, TOLERANCE).kind == "settling", "judged from the start, it grew then stopped"


def test_growth_that_ends_after_the_warm_up_is_settling_not_growing():
    values = [1400 * MB + min(t, 900.0) * (20 * MB / 900) for t in TIMES]  # +20 MB in 15 minutes, then flat
    verdict = judge(TIMES, noisy(values), WARMUP_S, TOLERANCE)
    assert verdict.kind == "settling" and not verdict.is_growing
    assert verdict.mb_per_10_min > TOLERANCE >= verdict.last_half_mb_per_10_min


def test_metric_names_lose_the_model_label_and_rows_read_the_split():
    assert _drop_model_label('pagedserve:worker_memory_bytes{kind="rss",model_name="m"}') == \
        'pagedserve:worker_memory_bytes{kind="rss"}'
    assert _drop_model_label('pagedserve:frontend_memory_bytes{model_name="m"}') == "pagedserve:frontend_memory_bytes"
    samples = {'pagedserve:worker_memory_bytes{kind="rss"}': 3e8, 'pagedserve:worker_memory_bytes{kind="unexplained"}':
               1e8, "pagedserve:frontend_memory_bytes": 6e7}
    row = memory_row(samples, 12.34, Tally(done=5))
    assert (row["seconds"], row["worker_rss"], row["worker_unexplained"], row["frontend_rss"], row["requests_done"]) \
        == (12.3, 3e8, 1e8, 6e7, 5)


def test_the_plot_is_an_svg_with_a_line_per_series():
    rows = [memory_row({'pagedserve:worker_memory_bytes{kind="rss"}': 3e8 + t,
                        'pagedserve:worker_memory_bytes{kind="unexplained"}': 1e8,
                        'pagedserve:worker_memory_bytes{kind="kv_cache"}': 5e7,
                        "pagedserve:frontend_memory_bytes": 6e7}, t, Tally()) for t in TIMES[:10]]
    svg = svg_plot(rows, WARMUP_S)
    assert svg.startswith("<svg") and svg.endswith("</svg>") and svg.count("<polyline") == 4
