"""The latency target as a user sees it: one stream's token gaps while another client sends long prompts.

Two servers on one checkpoint, big enough that a long prompt's prefill takes
the time of many decode steps: one with the default (automatic) target, and
one with `--target-itl-ms 0`, the fixed token budget, as the control that
shows the stalls this test is there to catch. The gaps are timed here, from
the arrival of the openai SDK's streamed chunks, and compared as ratios to
the same stream's gaps while it ran alone, never as absolute times. The
stream is biased to single-character tokens: a token that ends inside a
UTF-8 character is held back by the detokenizer until the next one, which
would look like a stall that no scheduler could prevent. Then
/metrics: the step histograms count the steps and survive a worker restart.
"""

from __future__ import annotations

import os
import signal
import statistics
import threading
import time

import pytest
from tokenizers import Tokenizer

from shared.config import TARGET_ITL_AUTO_FACTOR

from helpers.running_server import RunningServer, start_server, stop_server
from helpers.tiny_tokenizer import make_served_checkpoint

MODEL = "itl"
# About 30M parameters: a decode step of a few milliseconds, a 1,800-token prefill of hundreds.
SHAPE = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
# One compute thread: on a two-core machine a worker on both would leave the frontend and this client waiting for a
# core, and the gaps measured would be theirs.
FLAGS = ("--served-model-name", MODEL, "--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "256MiB",
         "--cpu-threads", "1")
# The automatic target lets a step take TARGET_ITL_AUTO_FACTOR x the decode step of every stream, the waiting long prompt counted
# as one (with its long context, so a little longer than the stream's step alone); a client's gaps add the frontend.
MAX_GAP_RATIO = 2 * TARGET_ITL_AUTO_FACTOR
ALONE_TOKENS = 40  # gaps of the stream alone: the yardstick
LONG_PROMPT_TOKENS = 1800
NUM_LONG_PROMPTS = 4
LABEL = f'{{model_name="{MODEL}"}}'
VLLM_LABEL = f'{{engine="0",model_name="{MODEL}"}}'


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_served_checkpoint(tmp_path_factory.mktemp("itl"), **SHAPE)


def ascii_letter_bias(checkpoint) -> dict[str, int]:
    """logit_bias lifting every token that is one ASCII letter above all others."""
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    return {str(tokenizer.token_to_id(letter)): 100 for letter in "abcdefghijklmnopqrstuvwxyz"}


def serve(tmp_path, checkpoint, *flags: str) -> RunningServer:
    """A server whose standby has loaded: a standby still calibrating takes a core from the measured worker."""
    tmp_path.mkdir()
    server = start_server(tmp_path, checkpoint, *FLAGS, *flags)
    try:
        server.wait_for(lambda: server.scrape()[f"pagedserve:standby_worker_ready{LABEL}"] == 1, "the standby's load")
    except BaseException:
        stop_server(server)
        raise
    return server


def gaps_alone_and_under_long_prompts(server: RunningServer, logit_bias: dict[str, int], salt: int = 0
                                      ) -> tuple[list[float], list[float]]:
    """One greedy stream: its gaps alone, then those while long prompts are prefilled one after another (after
    one more, unmeasured, that warms the server up to this load).

    `salt` varies the prompts, so that a second load on one server finds none of them in the prefix cache."""
    client = server.client(timeout=120)
    arrivals: list[float] = []
    alone_done, load_done = threading.Event(), threading.Event()
    load_window: list[float] = []

    def send_long_prompts() -> None:
        alone_done.wait(120)
        for i in range(1 + NUM_LONG_PROMPTS):  # the first warms up: new chunk shapes, the cost model at long contexts
            if i == 1:
                load_window.append(time.monotonic())
            prompt = [3 + (i * 7 + j + salt) % 500 for j in range(LONG_PROMPT_TOKENS)]
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
        load_window.append(time.monotonic())
        load_done.set()

    loader = threading.Thread(target=send_long_prompts)
    loader.start()
    stream = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=3000, temperature=0,
                                       logit_bias=logit_bias, stream=True, extra_body={"ignore_eos": True})
    for _ in stream:
        arrivals.append(time.monotonic())
        if len(arrivals) == ALONE_TOKENS + 1:
            alone_done.set()
        if load_done.is_set():
            break
    stream.close()
    loader.join()
    assert load_done.is_set(), "the stream ended before the long prompts were served"
    gaps = [(start, end) for start, end in zip(arrivals, arrivals[1:])]
    alone = [end - start for start, end in gaps[5:ALONE_TOKENS]]  # past the first steps' one-time costs
    # Every gap that overlaps the load: the last prompt's step also ends a gap of the stream, and which of the two
    # clients hears of it first is a race.
    loaded = [end - start for start, end in gaps if start < load_window[1] and end > load_window[0]]
    return alone, loaded


def test_a_stream_keeps_its_pace_while_long_prompts_arrive(tmp_path, checkpoint):
    server = serve(tmp_path / "target", checkpoint)
    try:
        alone, loaded = gaps_alone_and_under_long_prompts(server, ascii_letter_bias(checkpoint))
    finally:
        stop_server(server)
    usual = statistics.median(alone)
    assert len(loaded) >= 4 * NUM_LONG_PROMPTS, "the stream got too few tokens while the prompts were prefilled"
    # A stall per prompt would be NUM_LONG_PROMPTS long gaps; half as many are allowed, for a busy machine (on two
    # cores the worst of the gaps measured here ran 3.8-4.4x, now and then one past 5x).
    long_gaps = [gap for gap in loaded if gap > MAX_GAP_RATIO * usual]
    assert len(long_gaps) <= NUM_LONG_PROMPTS // 2, f"gaps of {sorted(loaded)[-5:]} s against {usual:.4f} s alone"


def test_with_the_fixed_budget_the_same_load_stalls_the_stream(tmp_path, checkpoint):
    """The control: without a target, each long prompt is one step, and the stream waits for all of it."""
    server = serve(tmp_path / "fixed", checkpoint, "--target-itl-ms", "0")
    try:
        alone, loaded = gaps_alone_and_under_long_prompts(server, ascii_letter_bias(checkpoint))
    finally:
        stop_server(server)
    stalls = [gap for gap in loaded if gap > 10 * statistics.median(alone)]
    assert len(stalls) >= NUM_LONG_PROMPTS, f"gaps of {sorted(loaded)[-5:]} s against {statistics.median(alone)} s"


def test_step_metrics_count_steps_and_survive_a_worker_restart(tmp_path, checkpoint):
    server = serve(tmp_path / "metrics", checkpoint)
    try:
        client = server.client(timeout=60)
        client.completions.create(model=MODEL, prompt=[9] * 100, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
        server.wait_for(lambda: server.scrape()[f"vllm:iteration_tokens_total_sum{VLLM_LABEL}"] >= 107,
                        "the steps of the request in /metrics")
        before = server.scrape()
        assert before[f"pagedserve:step_seconds_count{LABEL}"] == before[f"vllm:iteration_tokens_total_count{VLLM_LABEL}"]
        assert before[f"pagedserve:step_predicted_seconds_count{LABEL}"] >= 8
        assert before[f'pagedserve:step_cost_seconds{{model_name="{MODEL}",term="step"}}'] > 0
        old_pid = server.worker_pid
        os.kill(old_pid, signal.SIGKILL)
        server.wait_for(lambda: server.worker_pid != old_pid and server.is_healthy(), "a new worker")
        client.completions.create(model=MODEL, prompt=[9] * 10, max_tokens=2, temperature=0)
        server.wait_for(lambda: server.scrape()[f"vllm:iteration_tokens_total_count{VLLM_LABEL}"]
                        > before[f"vllm:iteration_tokens_total_count{VLLM_LABEL}"], "the new worker's steps")
        after = server.scrape()
        for name, label in (("vllm:iteration_tokens_total", VLLM_LABEL), ("pagedserve:step_seconds", LABEL)):
            assert after[f"{name}_sum{label}"] >= before[f"{name}_sum{label}"], name
            buckets = [key for key in before if key.startswith(f"{name}_bucket")]
            assert buckets and all(after[key] >= before[key] for key in buckets), name
    finally:
        stop_server(server)
