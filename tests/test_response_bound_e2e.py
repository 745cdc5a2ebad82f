"""The bound on a whole response's size, through `python -m server`: a small request that asks for a huge response
(many prompts x n x prompt logprobs, the hostile case) is a 400 before any work, with the frontend's memory flat;
one within the bound is answered whole and its size is within the estimate the bound is checked on."""

from __future__ import annotations

import time
from collections.abc import Iterator

import orjson
import pytest

from server.api.completions.response_bound import ENTRY_BYTES, TEXT_BYTES_PER_TOKEN
from server.generation.request import DEFAULT_MAX_RESPONSE_BYTES
from shared.default_model import DEFAULT_MODEL_NAME

from helpers.running_server import RunningServer, start_server, stop_server

PROMPT = "KING HENRY: " * 40  # 120-odd tokens
MAX_RSS_GROWTH = 32 << 20
REFUSED_WITHIN_S = 2.0


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[RunningServer]:
    running = start_server(tmp_path_factory.mktemp("bound"), None, "--standby-workers", "0", "--max-logprobs", "20")
    try:
        yield running
    finally:
        stop_server(running)


def rss(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def test_a_request_for_a_huge_response_is_refused_before_any_work(server):
    body = {"model": DEFAULT_MODEL_NAME, "prompt": [PROMPT * 4] * 64, "n": 4, "prompt_logprobs": 20, "logprobs": 20,
            "max_tokens": 16}
    before, started = rss(server.process.pid), time.monotonic()
    status, _, raw = server.request("POST", "/v1/completions", body)
    elapsed = time.monotonic() - started
    error = orjson.loads(raw)["error"]
    assert status == 400 and error["param"] == "prompt_logprobs", raw
    assert f"more than the {DEFAULT_MAX_RESPONSE_BYTES >> 20} MiB a whole response may be (--max-response-size)" \
        in error["message"], raw
    assert "64 prompts, n 4, logprobs 20, prompt_logprobs 20" in error["message"], raw
    assert elapsed < REFUSED_WITHIN_S, f"refused after {elapsed:.1f} s: the work was done first"
    assert rss(server.process.pid) - before < MAX_RSS_GROWTH
    assert server.scrape()[f'vllm:num_requests_running{{engine="0",model_name="{DEFAULT_MODEL_NAME}"}}'] == 0


def test_the_bound_is_the_operators_to_set(server, tmp_path):
    """A request of about 12 MiB: served under the default bound, a 400 under --max-response-size 1MiB."""
    body = {"model": DEFAULT_MODEL_NAME, "prompt": [PROMPT] * 16, "n": 4, "prompt_logprobs": 20, "max_tokens": 1}
    status, _, raw = server.request("POST", "/v1/completions", body)
    assert status == 200 and len(orjson.loads(raw)["choices"]) == 64, raw[:300]
    running = start_server(tmp_path, None, "--standby-workers", "0", "--max-logprobs", "20",
                           "--max-response-size", "1MiB")
    try:
        status, _, raw = running.request("POST", "/v1/completions", body)
        assert status == 400 and b"more than the 1 MiB" in raw, raw[:300]
    finally:
        stop_server(running)


def test_a_response_within_the_bound_is_whole_and_within_its_estimate(server):
    body = {"model": DEFAULT_MODEL_NAME, "prompt": [PROMPT] * 2, "n": 2, "prompt_logprobs": 20, "logprobs": 20,
            "max_tokens": 16, "ignore_eos": True}
    status, _, raw = server.request("POST", "/v1/completions", body)
    assert status == 200, raw[:300]
    response = orjson.loads(raw)
    assert len(response["choices"]) == 4 and all(len(choice["prompt_logprobs"]) > 100 for choice in response["choices"])
    prompt_tokens = response["usage"]["prompt_tokens"] // 2
    per_choice = (16 * TEXT_BYTES_PER_TOKEN + 16 * 21 * ENTRY_BYTES["logprobs"]
                  + prompt_tokens * 21 * ENTRY_BYTES["prompt_logprobs"])
    estimate = 4 * per_choice  # response_bound's, for these fields
    assert len(raw) <= estimate, (len(raw), estimate)
