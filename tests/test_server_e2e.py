"""The server as users run it: `python -m server` in a subprocess, spoken to by the openai SDK, curl and sockets.

One server serves the whole module (start-up is a torch import and a model
load in the worker: seconds). It runs with an API key, so every /v1 call
here carries one, and with a small in-flight cap (max_num_seqs 4, no waiting
room) so the 429 path is reachable with a few streams. The SIGTERM test
stops it, so it comes last.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from helpers.metrics_scrape import labels_of, rise
from helpers.running_server import JSON, RunningServer, start_server, stop_server
from helpers.tiny_tokenizer import make_served_checkpoint
from helpers.waiting import wait_until

API_KEY = "test-key-123"
MODEL = "tiny"
MAX_NUM_SEQS = 4
MAX_BODY = 64 * 1024
AUTH = {"Authorization": f"Bearer {API_KEY}"}
LONG_STREAM = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True,
               "stream": True}
SERVER_FLAGS = ("--served-model-name", MODEL, "--api-key", API_KEY, "--device", "cpu", "--dtype", "float32",
                "--num-kv-blocks", "512", "--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting-requests", "0",
                "--max-body-size", str(MAX_BODY))


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> RunningServer:
    tmp = tmp_path_factory.mktemp("server")
    running = start_server(tmp, make_served_checkpoint(tmp), *SERVER_FLAGS)
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client(API_KEY, timeout=30)


def raw_exchange(server: RunningServer, data: bytes) -> bytes:
    """Send raw bytes, read until the server closes (or 10 s)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def assert_error(status: int, body: bytes, expected_status: int) -> dict:
    assert status == expected_status, body
    error = json.loads(body)["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["message"]
    return error


def open_stream(server: RunningServer, payload: dict) -> socket.socket:
    """A streaming completion on a raw socket, returned once its first event has arrived."""
    body = json.dumps(payload).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    received = b""
    while b"data: {" not in received:
        chunk = sock.recv(65536)
        assert chunk, f"the stream ended before its first event: {received!r}"
        received += chunk
    assert received.startswith(b"HTTP/1.1 200"), received
    return sock


# ---------------------------------------------------------------------------------------------- the OpenAI API


def test_models_lists_the_served_model(client):
    [model] = client.models.list().data
    assert model.id == MODEL and model.owned_by == "pagedserve"
    assert model.model_extra["max_model_len"] == 1024 and model.model_extra["root"]
    [permission] = model.model_extra["permission"]  # vLLM's list, which some clients read
    assert permission["object"] == "model_permission" and permission["id"].startswith("modelperm-")
    assert permission["allow_sampling"] and permission["allow_logprobs"] and not permission["is_blocking"]


def test_completion_streamed_text_equals_the_whole_text(client):
    whole = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=0)
    [choice] = whole.choices
    assert whole.usage.completion_tokens <= 12 and choice.finish_reason in ("stop", "length")
    stream = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=0,
                                       stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == choice.text


def test_curl_streams_sse_a_line_parser_accepts(server):
    payload = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 5, "stream": True})
    result = subprocess.run(["curl", "-sS", "-N", "-H", f"Authorization: Bearer {API_KEY}", "-H",
                             "Content-Type: application/json", "-d", payload, f"{server.base_url}/v1/completions"],
                            capture_output=True, timeout=30, check=True)
    events = [line for line in result.stdout.decode().split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    for event in events[:-1]:
        assert event.startswith("data: ") and "text" in json.loads(event.removeprefix("data: "))["choices"][0]


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="Hi", max_tokens=2)


def test_wrong_or_missing_api_key_is_401_but_probes_stay_open(server):
    bad = server.client("wrong")
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert_error(*server.request("GET", "/v1/models")[::2], 401)
    for path in ("/health", "/version", "/metrics"):
        assert server.request("GET", path)[0] == 200, path


# ---------------------------------------------------------------------------------------------- the other endpoints


def test_tokenize_and_detokenize_round_trip(server):
    text = "Hello world, 你好 😀"
    status, _, body = server.request("POST", "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert status == 200, body
    result = json.loads(body)
    assert result["count"] == len(result["tokens"]) > 0 and result["max_model_len"] == 1024
    status, _, body = server.request("POST", "/detokenize", {"tokens": result["tokens"]})
    assert status == 200 and json.loads(body) == {"prompt": text}
    with_bos = json.loads(server.request("POST", "/tokenize", {"prompt": text})[2])["tokens"]
    assert with_bos == [1] + result["tokens"]  # bos, as the checkpoint's tokenizer_config asks
    chat = server.request("POST", "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]})
    assert chat[0] == 200 and json.loads(chat[2])["tokens"][0] == 1  # the template puts bos first


def test_version_and_health(server):
    status, _, body = server.request("GET", "/version")
    assert status == 200 and json.loads(body)["version"]
    assert server.request("GET", "/health")[::2] == (200, b"")


def test_metrics_use_vllm_names_labels_and_buckets_and_count_requests(server, client):
    vllm = f'engine="0",model_name="{MODEL}"'
    before = server.scrape()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:num_preemptions_total"):
        assert f"{name}{{{vllm}}}" in before, name
    for reason in ("stop", "length", "abort", "error"):  # there from the start, as vLLM's, for rate() to see a rise
        assert f'vllm:request_success_total{{engine="0",finished_reason="{reason}",model_name="{MODEL}"}}' in before
    client.completions.create(model=MODEL, prompt="Count to five:", max_tokens=6, n=2, temperature=1, seed=3,
                              extra_body={"ignore_eos": True})
    after = server.scrape()

    def rose(name: str) -> float:
        return rise(before, after, name, model_name=MODEL)
    assert rose("vllm:generation_tokens_total") == 12 and rose("vllm:prompt_tokens_total") > 0
    assert rose('vllm:request_success_total') == 2 and rise(before, after, "vllm:request_success_total",
                                                            finished_reason="length") == 2
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
                 "vllm:request_time_per_output_token_seconds", "vllm:request_prompt_tokens",
                 "vllm:request_generation_tokens", "vllm:request_params_max_tokens"):
        assert rose(f"{name}_count") == 2, name  # one per choice
    for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):  # the second deprecated
        assert rose(f"{name}_count") == 10, name  # each gap between tokens
    assert rose("vllm:request_generation_tokens_sum") == 12 and rose("vllm:request_params_max_tokens_sum") == 12
    assert rose("vllm:request_params_n_count") == 1 and rose("vllm:request_params_n_sum") == 2, "once per prompt"
    assert rose("vllm:request_max_num_generation_tokens_sum") == 6
    phases = rose("vllm:request_prefill_time_seconds_sum") + rose("vllm:request_decode_time_seconds_sum")
    assert phases == pytest.approx(rose("vllm:request_inference_time_seconds_sum"))
    assert rose("vllm:request_queue_time_seconds_sum") + phases <= rose("vllm:e2e_request_latency_seconds_sum")
    # vLLM's bucket edges: the 1-2-5 token series up to max_model_len (1024), its request-latency edges
    edges = {labels_of(key)[1]["le"] for key in after if key.startswith("vllm:request_prompt_tokens_bucket")}
    assert edges == {"1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "500.0", "1000.0", "+Inf"}
    assert f'vllm:request_queue_time_seconds_bucket{{engine="0",le="7680.0",model_name="{MODEL}"}}' in after


def test_prefix_cache_metrics_count_a_repeated_prompt(server, client):
    label = f'{{engine="0",model_name="{MODEL}"}}'
    prompt = "A long shared preamble that fills several KV blocks before the question. " * 3
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    before = server.scrape()
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    after = server.scrape()
    queried = after[f"vllm:prefix_cache_queries_total{label}"] - before[f"vllm:prefix_cache_queries_total{label}"]
    hit = after[f"vllm:prefix_cache_hits_total{label}"] - before[f"vllm:prefix_cache_hits_total{label}"]
    assert queried > 16 and hit >= 16 and hit < queried  # whole blocks from the cache; the last token computed
    assert after[f"pagedserve:prefix_cache_blocks{{model_name=\"{MODEL}\"}}"] >= hit // 16


# ---------------------------------------------------------------------------------------------- bad input


def test_unknown_route_is_404_and_wrong_method_405(server):
    assert_error(*server.request("GET", "/v1/nothing-here", headers=AUTH)[::2], 404)
    assert_error(*server.request("GET", "/nothing")[::2], 404)
    status, headers, body = server.request("GET", "/v1/completions", headers=AUTH)
    assert_error(status, body, 405)
    assert headers["allow"] == "POST"


def test_malformed_json_is_400_and_the_server_still_serves(server, client):
    error = assert_error(*server.request("POST", "/v1/completions", b'{"model": "tiny", "prompt": ',
                                         headers={**AUTH, **JSON})[::2], 400)
    assert "JSON" in error["message"]
    assert_error(*server.request("POST", "/tokenize", b"[1, 2", headers=JSON)[::2], 400)
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text is not None


def test_invalid_utf8_body_is_400(server):
    body = b'{"model": "tiny", "prompt": "caf\xc3 \xff"}'
    assert_error(*server.request("POST", "/v1/completions", body, headers={**AUTH, **JSON})[::2], 400)
    assert_error(*server.request("POST", "/tokenize", body, headers=JSON)[::2], 400)


def test_oversized_body_is_413(server):
    body = json.dumps({"model": MODEL, "prompt": "x" * MAX_BODY}).encode()
    response = raw_exchange(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                            + API_KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body))
    assert response.startswith(b"HTTP/1.1 413"), response[:200]


def test_garbage_request_line_is_400(server):
    response = raw_exchange(server, b"\x16\x03\x01 hello there\r\n\r\n")
    assert response.startswith(b"HTTP/1.1 400"), response[:200]
    assert server.request("GET", "/health")[0] == 200


# ---------------------------------------------------------------------------------------------- load and disconnects


def test_full_queue_is_429_with_retry_after(server):
    streams = [open_stream(server, LONG_STREAM) for _ in range(MAX_NUM_SEQS)]
    try:
        status, headers, body = server.request("POST", "/v1/completions",
                                               {"model": MODEL, "prompt": "Hi", "max_tokens": 2}, headers=AUTH)
        assert_error(status, body, 429)
        assert int(headers["retry-after"]) >= 1
    finally:
        for sock in streams:
            sock.close()


def test_client_closing_mid_stream_frees_its_kv_blocks(server):
    usage = f'vllm:kv_cache_usage_perc{{engine="0",model_name="{MODEL}"}}'
    # the previous test's streams may still be winding down
    server.wait_for(lambda: server.scrape()[usage] == 0, "an empty KV cache before the test", timeout=5.0)
    sock = open_stream(server, LONG_STREAM)
    assert server.scrape()[usage] > 0
    sock.close()
    wait_until(lambda: server.scrape()[usage] == 0, timeout=1.0, interval=0.02,
               message="the KV blocks of a closed stream to be freed within 1 s")
    assert server.scrape()[f'vllm:num_requests_running{{engine="0",model_name="{MODEL}"}}'] == 0


def test_metrics_name_what_the_frontend_holds(server):
    label = f'model_name="{MODEL}"'
    tokens, bodies = f"pagedserve:frontend_request_tokens{{{label}}}", \
        f'pagedserve:frontend_held_bytes{{holder="request_bodies",{label}}}'
    server.wait_for(lambda: server.scrape()[tokens] == 0, "no request tokens held before the test", timeout=5)
    assert f'pagedserve:frontend_held_bytes{{holder="write_buffers",{label}}}' in server.scrape()
    stream = open_stream(server, LONG_STREAM)
    upload = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    try:
        upload.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 1000\r\n\r\n" + b" " * 400)
        # the stream's body, held while it is answered, and the part of the upload that has arrived
        held_bodies = len(json.dumps(LONG_STREAM).encode()) + 400
        server.wait_for(lambda: server.scrape()[bodies] == held_bodies, "the request bodies, held", timeout=5)
        held = server.scrape()
        assert held[f"pagedserve:frontend_requests_in_flight{{{label}}}"] == 1
        assert held[tokens] >= 5, "the stream's prompt and its first tokens"
    finally:
        stream.close()
        upload.close()
    server.wait_for(lambda: server.scrape()[tokens] == 0 and server.scrape()[bodies] == 0, "all given back",
                    timeout=5)


# ---------------------------------------------------------------------------------------------- last: shutdown


def test_sigterm_exits_0_and_removes_the_runtime_dir(server):
    assert server.runtime_dir.is_dir()
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=15) == 0, server.log.read_text()
    assert not server.runtime_dir.exists()
    assert b"stopped" in server.log.read_bytes()


@pytest.mark.skipif(shutil.which("pagedserve") is None and not (Path(sys.executable).parent / "pagedserve").exists(),
                    reason="the pagedserve console script is not installed")
def test_console_script_shows_help():
    script = shutil.which("pagedserve") or str(Path(sys.executable).parent / "pagedserve")
    result = subprocess.run([script, "--help"], capture_output=True, timeout=30, check=True)
    for flag in (b"--model", b"--api-key", b"--max-waiting-requests", b"--served-model-name", b"--port"):
        assert flag in result.stdout
