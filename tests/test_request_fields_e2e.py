"""Every implemented request field changes what comes back: the field table (server/api/completions/fields.py)
against a real server and worker.

For each field of IMPLEMENTED, on each endpoint, a request with the field is compared with the same request without
it (or with another value): the status, the choices (text or message, finish reason, logprobs), the usage or a chat
completion's prompt_logprobs must differ. A field added to the table without an entry here fails the test.
`priority` and `parallel_tool_calls` change what is scheduled or allowed, not one short response: they have tests of
their own, named below.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from server.api.completions.fields import IMPLEMENTED, Endpoint

from helpers.running_server import RunningServer, start_server, stop_server
from helpers.tiny_tokenizer import EOS_TOKEN, make_served_checkpoint
from helpers.tool_chat_template import TOOL_CHAT_TEMPLATE

MODEL = "tiny"
EOS = 2  # the id of EOS_TOKEN in the test tokenizer
FORCED = "65"  # a token id that logit_bias makes certain
SAMPLED = {"temperature": 2.0, "seed": 1, "max_tokens": 24}  # a flat distribution, so any change shows
REPEATING = {"logit_bias": {FORCED: 1.0}}  # greedy picks FORCED each time, until a penalty outweighs its bias
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
BASE = {Endpoint.COMPLETIONS: {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0},
        Endpoint.CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "Once upon a time"}], "max_tokens": 12,
                        "temperature": 0}}
TESTED_ELSEWHERE = {
    "priority": "test_scheduler.py and test_openai_api.py (which request runs first, not what it says)",
    "parallel_tool_calls": "test_tool_calling_e2e.py::test_parallel_tool_calls_false_gives_one_call",
}


def changes(endpoint: Endpoint, base_text: str) -> dict[str, tuple[dict, object]]:
    """field -> (the request's other fields, the field's value): with the value, the response must differ."""
    stop = base_text[2:5]
    shared = {
        "model": ({}, "not-the-served-model"), "n": ({}, 2), "stream": ({}, True),
        "stream_options": ({"stream": True}, {"include_usage": True}), "max_tokens": ({}, 3),
        "stop": ({}, [stop]), "include_stop_str_in_output": ({"stop": [stop]}, True),
        "seed": (SAMPLED, 2), "temperature": ({"seed": 1}, 2.0), "top_p": (SAMPLED, 0.05), "top_k": (SAMPLED, 1),
        "min_p": (SAMPLED, 0.9), "presence_penalty": (REPEATING, 2.0), "frequency_penalty": (REPEATING, 2.0),
        "repetition_penalty": (REPEATING, 100.0), "logit_bias": ({}, {FORCED: 100}),
        "min_tokens": ({"logit_bias": {str(EOS): 100}}, 4),
        "ignore_eos": ({"logit_bias": {str(EOS): 100}, "max_tokens": 4}, True),
        "stop_token_ids": ({"logit_bias": {FORCED: 100}}, [int(FORCED)]),
        "response_format": ({}, {"type": "json_object"}), "structured_outputs": ({}, {"choice": ["yes", "no"]}),
        "guided_json": ({}, {"type": "integer"}), "guided_regex": ({}, "[a-c]+"), "guided_choice": ({}, ["yes", "no"]),
        "guided_grammar": ({}, 'start: "yes" | "no"'),
        "guided_whitespace_pattern": ({**SAMPLED, "guided_json": {"type": "array", "items": {"type": "integer"}}},
                                      "[ ]{1,3}"),
    }
    if endpoint is Endpoint.COMPLETIONS:
        return {**shared, "prompt": ({}, "Hello there"), "echo": ({}, True), "logprobs": ({}, 2),
                "prompt_logprobs": ({}, 2), "add_special_tokens": ({}, False)}
    tool_template = {"chat_template": TOOL_CHAT_TEMPLATE}
    return {**shared, "messages": ({}, [{"role": "user", "content": "Hello there"}]),
            "max_completion_tokens": ({}, 3), "logprobs": ({}, True), "top_logprobs": ({"logprobs": True}, 3),
            "add_generation_prompt": ({}, False),
            "continue_final_message": ({"messages": [{"role": "user", "content": "Hi"},
                                                     {"role": "assistant", "content": "Once upon"}],
                                        "add_generation_prompt": False}, True),
            "chat_template": ({}, "{{ messages[0].content }}"),
            "chat_template_kwargs": ({"chat_template": "{{ greeting }}{{ messages[0].content }}"},
                                     {"greeting": "Hark! "}),
            "tools": ({**tool_template, "tool_choice": "none"}, TOOLS),
            "tool_choice": ({**tool_template, "tools": TOOLS, "tool_choice": "none"}, "required"),
            "add_special_tokens": ({"chat_template": "{{ messages[0].content }}"}, True),
            "prompt_logprobs": ({}, 2)}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> RunningServer:
    # Not sharpened: near-uniform logits, so that every sampling field moves the draws.
    checkpoint: Path = make_served_checkpoint(tmp_path_factory.mktemp("checkpoint"), sharpen=1.0)
    assert json.loads((checkpoint / "tokenizer_config.json").read_text())["eos_token"] == EOS_TOKEN
    running = start_server(tmp_path_factory.mktemp("server"), checkpoint, "--served-model-name", MODEL, "--device",
                           "cpu", "--dtype", "float32", "--trust-request-chat-template")
    yield running
    stop_server(running)


def observe(server: RunningServer, endpoint: Endpoint, body: dict) -> tuple:
    """What a client sees of a response, less what differs between any two (ids, times)."""
    status, _, raw = server.request("POST", endpoint.value, body)
    if status != 200:
        return status, raw
    events = [json.loads(line[6:]) for line in raw.decode().splitlines()
              if line.startswith("data: {")] if body.get("stream") else [json.loads(raw)]
    for event in events:
        for choice in event.get("choices", []):
            for call in (choice.get("message") or choice.get("delta") or {}).get("tool_calls") or []:
                call.pop("id", None)
    return status, [(event.get("choices"), event.get("usage"), event.get("prompt_logprobs")) for event in events]


@pytest.mark.parametrize("endpoint", list(Endpoint))
def test_every_implemented_field_changes_the_response(server, endpoint):
    base = BASE[endpoint]
    status, raw = server.request("POST", endpoint.value, base)[::2]
    assert status == 200
    choice = json.loads(raw)["choices"][0]
    table = changes(endpoint, choice.get("text") or choice["message"]["content"])
    elsewhere = set(TESTED_ELSEWHERE) & IMPLEMENTED[endpoint]
    assert set(table) | elsewhere == IMPLEMENTED[endpoint], "every implemented field has an entry"
    unchanged = []
    for name, (context, value) in table.items():
        without = {**base, **context}
        reference = observe(server, endpoint, without)
        assert reference[0] == 200, (name, reference)
        if observe(server, endpoint, {**without, name: value}) == reference:
            unchanged.append(name)
    assert unchanged == []
