"""The smaller shapes vLLM clients read, through a real server: stop_reason, stop-token text, system_fingerprint
in chunks, continuous usage stats, add_special_tokens on both endpoints, /tokenize's chat and token-string fields.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.running_server import RunningServer, start_server, stop_server
from helpers.tiny_tokenizer import make_served_checkpoint

MODEL = "tiny"
EOS = 2
FORCED = 65  # a plain (not special) token that logit_bias makes certain
GREEDY = {"model": MODEL, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> RunningServer:
    checkpoint: Path = make_served_checkpoint(tmp_path_factory.mktemp("checkpoint"))
    running = start_server(tmp_path_factory.mktemp("server"), checkpoint, "--served-model-name", MODEL, "--device",
                           "cpu", "--dtype", "float32")
    yield running
    stop_server(running)


def events(server: RunningServer, path: str, body: dict) -> list[dict]:
    status, _, raw = server.request("POST", path, {**body, "stream": True})
    assert status == 200, raw
    return [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]


def test_stop_reason_names_the_stop_string_or_token_and_is_null_otherwise(server):
    plain = server.post_ok("/v1/completions", {**GREEDY, "prompt": "Once upon a time", "max_tokens": 12})["choices"][0]
    assert (plain["finish_reason"], plain["stop_reason"]) == ("length", None)
    stop = plain["text"][3:6]
    by_string = server.post_ok("/v1/completions", {**GREEDY, "prompt": "Once upon a time", "max_tokens": 12,
                                                 "stop": [stop]})["choices"][0]
    assert (by_string["finish_reason"], by_string["stop_reason"]) == ("stop", stop)
    by_token = server.post_ok("/v1/completions", {**GREEDY, "prompt": "Once", "max_tokens": 12,
                                                "logit_bias": {str(FORCED): 100}, "stop_token_ids": [FORCED]})
    choice = by_token["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", FORCED)
    expected = server.post_ok("/detokenize", {"tokens": [FORCED]})["prompt"]
    assert choice["text"] == expected and by_token["usage"]["completion_tokens"] == 1  # a plain token keeps its text
    by_eos = server.post_ok("/v1/completions", {**GREEDY, "prompt": "Once", "max_tokens": 12,
                                              "logit_bias": {str(EOS): 100}})["choices"][0]
    assert (by_eos["finish_reason"], by_eos["stop_reason"], by_eos["text"]) == ("stop", None, "")
    chat = server.post_ok("/v1/chat/completions", {**GREEDY, "messages": [{"role": "user", "content": "Hi"}],
                                                 "max_tokens": 12, "stop_token_ids": [FORCED],
                                                 "logit_bias": {str(FORCED): 100}})["choices"][0]
    assert chat["stop_reason"] == FORCED
    last = events(server, "/v1/completions", {**GREEDY, "prompt": "Once upon a time", "max_tokens": 12,
                                              "stop": [stop]})[-1]["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", stop)


def test_every_chunk_has_system_fingerprint_and_continuous_usage_counts_up(server):
    body = {**GREEDY, "prompt": "Once upon a time", "max_tokens": 6,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = events(server, "/v1/completions", body)
    assert all("system_fingerprint" in chunk for chunk in chunks)
    counts = [chunk["usage"]["completion_tokens"] for chunk in chunks]
    assert counts == sorted(counts) and counts[-1] == 6 and all(c["usage"]["prompt_tokens"] > 0 for c in chunks)
    plain = events(server, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert all(chunk["usage"] is None for chunk in plain[:-1]) and plain[-1]["usage"]["completion_tokens"] == 6


def test_add_special_tokens_on_both_endpoints(server):
    prompt = {**GREEDY, "prompt": "Once upon a time", "max_tokens": 1}
    with_bos = server.post_ok("/v1/completions", prompt)["usage"]["prompt_tokens"]
    without = server.post_ok("/v1/completions", {**prompt, "add_special_tokens": False})["usage"]["prompt_tokens"]
    assert without == with_bos - 1
    chat = {**GREEDY, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    template_bos_only = server.post_ok("/v1/chat/completions", chat)["usage"]["prompt_tokens"]
    assert server.post_ok("/v1/chat/completions", {**chat, "add_special_tokens": False})["usage"]["prompt_tokens"] \
        == template_bos_only  # false is the default: the template places the BOS


def test_tokenize_takes_add_generation_prompt_and_return_token_strs(server):
    messages = [{"role": "user", "content": "Hi there"}]
    with_prompt = server.post_ok("/tokenize", {"messages": messages})
    without = server.post_ok("/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert without["count"] < with_prompt["count"] and with_prompt["token_strs"] is None
    spelled = server.post_ok("/tokenize", {"prompt": "Hi there", "return_token_strs": True})
    assert len(spelled["token_strs"]) == spelled["count"] and spelled["token_strs"][0] == "<s>"
    assert "Ġthere" in spelled["token_strs"] or any("there" in s for s in spelled["token_strs"])
