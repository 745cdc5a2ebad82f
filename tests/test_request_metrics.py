"""vLLM's per-request series (server/request_metrics.py) from a choice's timestamps, rendered by prometheus-client.

The phases are vLLM's (queue = scheduled - arrival, prefill = first token - scheduled, decode = last - first token,
inference = last token - scheduled), n and the largest output are observed once per prompt, and the token-count
edges are vLLM's 1-2-5 series up to max_model_len.
"""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from server.request_metrics import RequestMetrics, one_two_five_buckets
from server.worker.request_state import RequestState
from shared.sampling_params import SamplingParams

from helpers.metrics_scrape import parse_metrics, total


@pytest.mark.parametrize("max_value, edges", [(96, (1, 2, 5, 10, 20, 50)),
                                              (2048, (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)),
                                              (1024, (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)),
                                              (1, (1,))])
def test_token_edges_are_vllms_one_two_five_series(max_value, edges):
    assert one_two_five_buckets(max_value) == edges


def finished_choice(arrival: float, scheduled: float | None, first: float | None, last: float | None,
                    num_outputs: int, choices: list[RequestState] | None = None) -> RequestState:
    state = RequestState("r", [1] * 7, SamplingParams(max_tokens=8), prompt_choices=choices)
    state.arrival_time, state.scheduled_time, state.first_token_time, state.last_token_time = \
        arrival, scheduled, first, last
    state.output_token_ids = [5] * num_outputs
    if choices is not None:
        choices.append(state)
    return state


def scraped(registry: CollectorRegistry) -> dict[str, float]:
    return parse_metrics(generate_latest(registry).decode())


def test_a_choice_is_observed_in_vllms_phases():
    registry = CollectorRegistry()
    metrics = RequestMetrics(registry, "m", lambda: 96)
    now = time.monotonic()
    metrics.observe(finished_choice(now - 10.0, now - 9.0, now - 7.5, now - 1.5, num_outputs=5), "length")
    samples = scraped(registry)
    for name, seconds in (("queue_time", 1.0), ("prefill_time", 1.5), ("decode_time", 6.0),
                          ("inference_time", 7.5), ("time_per_output_token", 1.5)):
        assert total(samples, f"vllm:request_{name}_seconds_sum") == pytest.approx(seconds), name
    assert total(samples, "vllm:time_to_first_token_seconds_sum") == pytest.approx(2.5)
    assert total(samples, "vllm:e2e_request_latency_seconds_sum") == pytest.approx(10.0, abs=0.1)
    assert total(samples, "vllm:inter_token_latency_seconds_count") == 4
    assert total(samples, "vllm:time_per_output_token_seconds_count") == 4, "the deprecated name, the same values"
    assert total(samples, "vllm:request_success_total", finished_reason="length") == 1
    assert total(samples, "vllm:request_success_total") == 1
    assert total(samples, "vllm:request_prompt_tokens_sum") == 7
    assert total(samples, "vllm:request_params_max_tokens_sum") == 8
    assert 'vllm:request_prompt_tokens_bucket{engine="0",le="50.0",model_name="m"}' in samples


def test_a_choice_failed_before_any_step_counts_as_an_error_with_no_phases():
    registry = CollectorRegistry()
    metrics = RequestMetrics(registry, "m", lambda: None)
    state = finished_choice(time.monotonic(), None, None, None, num_outputs=0)
    state.fail("no worker")
    metrics.observe(state, "abort")
    samples = scraped(registry)
    assert total(samples, "vllm:request_success_total", finished_reason="error") == 1
    assert total(samples, "vllm:request_queue_time_seconds_count") == 0
    assert total(samples, "vllm:e2e_request_latency_seconds_count") == 1
    assert total(samples, "vllm:request_prompt_tokens_count") == 0, "no edges before a worker tells max_model_len"


def test_n_and_the_largest_output_are_observed_once_per_prompt_when_its_last_choice_is_done():
    registry = CollectorRegistry()
    metrics = RequestMetrics(registry, "m", lambda: 96)
    now, choices = time.monotonic(), []
    states = [finished_choice(now - 2, now - 1.5, now - 1, now, num_outputs=count, choices=choices)
              for count in (3, 6, 2)]
    for state in states[:2]:
        metrics.observe(state, "stop")
    assert total(scraped(registry), "vllm:request_params_n_count") == 0
    metrics.observe(states[2], "stop")
    samples = scraped(registry)
    assert total(samples, "vllm:request_params_n_sum") == 3 and total(samples, "vllm:request_params_n_count") == 1
    assert total(samples, "vllm:request_max_num_generation_tokens_sum") == 6
    assert total(samples, "vllm:request_generation_tokens_sum") == 11
