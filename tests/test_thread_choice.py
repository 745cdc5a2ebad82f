"""gpu_worker/engine/thread_choice.py: which thread counts a worker times, and that it keeps the one its own timing
favours, on the real tiny model (tests/conftest.py's checkpoint)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from gpu_worker.engine import engine as engine_module
from gpu_worker.engine.engine import Engine
from gpu_worker.engine.thread_choice import TIE_MARGIN, candidate_counts, choose_threads, fastest

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(("cpus", "counts"), [(1, [1]), (2, [2]), (3, [3]), (4, [4, 2, 1]), (6, [6, 3, 1]),
                                              (16, [16, 8, 4]), (64, [64, 32, 16])])
def test_the_counts_tried_run_from_every_cpu_down_to_a_quarter(cpus, counts):
    assert candidate_counts(cpus) == counts


@pytest.mark.parametrize(("seconds", "chosen"), [
    ({16: 5.5, 8: 1.8, 4: 2.5}, 8),  # the 4-layer model on the 16-core Xeon
    ({16: 1.00, 8: 0.97, 4: 0.96}, 16),  # within the margin of all 16: noise takes no thread away
    ({16: 1.00, 8: 0.94, 4: 0.90}, 8),  # 8 beats 16 by 6%; 4 beats 8 by 4%, within the margin
    ({16: 1.00, 8: 1.20}, 16),  # the descent stopped at 8, slower: 4 was never timed
])
def test_a_smaller_count_is_kept_only_where_it_is_clearly_faster(seconds, chosen):
    assert fastest(list(seconds), seconds) == chosen


def test_the_count_kept_is_the_fastest_unless_a_larger_one_is_within_the_margin(in_process_engine, restore_threads):
    engine = in_process_engine
    config = engine.config
    choice = choose_threads(engine.runner, engine.sampler, [2, 1], config.max_num_batched_tokens,
                            config.max_num_seqs, engine.max_model_len)
    assert torch.get_num_threads() == choice.threads
    assert set(choice.seconds) == {2, 1} and all(seconds > 0 for seconds in choice.seconds.values())
    faster_alone = choice.seconds[1] < choice.seconds[2] * (1 - TIE_MARGIN)
    assert choice.threads == (1 if faster_alone else 2)
    assert f"{choice.threads} compute threads, the fastest of (2: " in choice.describe()


def test_an_engine_on_four_cpus_times_its_counts_unless_one_is_asked_for(engine_config, monkeypatch, caplog,
                                                                         restore_threads):
    """The CPU count is the one thing substituted: this machine may have fewer than four."""
    monkeypatch.setattr(engine_module, "available_cpus", lambda: 4)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    with caplog.at_level(logging.INFO, logger="pagedserve.worker"):
        engine = Engine(engine_config)
    choice = engine.thread_choice
    assert choice is not None and list(choice.seconds) in ([4, 2], [4, 2, 1])  # 1 only where 2 did not lose to 4
    assert choice.threads == fastest(list(choice.seconds), choice.seconds)
    assert torch.get_num_threads() == choice.threads
    assert f"CPU threads: {choice.describe()}" in caplog.text
    assert Engine(dataclasses.replace(engine_config, cpu_threads=3)).thread_choice is None
    assert torch.get_num_threads() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert Engine(engine_config).thread_choice is None
    assert torch.get_num_threads() == 2
