"""Structured output as clients meet it: `python -m server` on a tiny random checkpoint, spoken to by the openai SDK.

The checkpoint's unconstrained output is garbage (shown below for the same requests), so every valid output is the
grammar's doing, not luck. Outputs are checked by `jsonschema`, `re` and pydantic, independently of the server.
The worker is SIGKILLed in the middle of constrained streams: they complete, valid, and identical to a fault-free
run (the re-queued requests rebuild their matchers from the tokens they already have).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pydantic
import pytest

from helpers.completion_streams import run_streams
from helpers.running_server import WAIT_S, RunningServer, start_server, stop_server
from helpers.tiny_tokenizer import make_served_checkpoint

MODEL = "tiny"
SERVER_FLAGS = ("--served-model-name", MODEL, "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "1024",
                "--max-num-seqs", "16", "--worker-hang-timeout", "2")
NUM_SAMPLES = 50
MAX_TOKENS = 200

SCHEMAS = {
    "nested objects": {
        "type": "object", "additionalProperties": False, "required": ["user", "meta"],
        "properties": {"user": {"type": "object", "additionalProperties": False, "required": ["name", "id"],
                                "properties": {"name": {"type": "string", "maxLength": 8},
                                               "id": {"type": "integer", "minimum": 0, "maximum": 999}}},
                       "meta": {"type": "object", "additionalProperties": False, "required": ["ok"],
                                "properties": {"ok": {"type": "boolean"}}}}},
    "arrays": {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9}, "minItems": 1,
               "maxItems": 6},
    "enums": {"type": "object", "additionalProperties": False, "required": ["color", "size"],
              "properties": {"color": {"enum": ["red", "green", "blue"]},
                             "size": {"type": "string", "enum": ["S", "M", "L", "XL"]}}},
    "bounded numbers": {"type": "object", "additionalProperties": False, "required": ["t", "n"],
                        "properties": {"t": {"type": "integer", "minimum": -40, "maximum": 60},
                                       "n": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}}},
    "anyOf": {"type": "object", "additionalProperties": False, "required": ["v"],
              "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"},
                                             {"type": "null"}, {"type": "string", "maxLength": 4}]}}},
}


class Pet(pydantic.BaseModel):
    kind: str = pydantic.Field(pattern="^(cat|dog|fish)$")
    legs: int = pydantic.Field(ge=0, le=8)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    pets: list[Pet] = pydantic.Field(max_length=3)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> RunningServer:
    yield from serve(tmp_path_factory, "server", {})


@pytest.fixture(scope="module")
def paced_server(tmp_path_factory) -> RunningServer:
    """The same server with every step held to at least 10 ms (PAGEDSERVE_FAULT=pace@0): a few constrained streams
    then last long enough for a kill to land mid-stream, however fast the machine decodes them."""
    yield from serve(tmp_path_factory, "paced-server", {"PAGEDSERVE_FAULT": "pace@0"})


def serve(tmp_path_factory, name: str, env: dict[str, str]) -> Iterator[RunningServer]:
    checkpoint: Path = make_served_checkpoint(tmp_path_factory.mktemp(f"{name}-checkpoint"))  # sharpened logits
    running = start_server(tmp_path_factory.mktemp(name), checkpoint, *SERVER_FLAGS, env=env)
    yield running
    stop_server(running)


def is_valid(schema: dict, text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@pytest.mark.parametrize("name", SCHEMAS)
def test_every_sample_of_a_schema_validates_where_unconstrained_output_does_not(server, name):
    schema, client = SCHEMAS[name], server.client()
    request = dict(model=MODEL, prompt=f"A {name} value:", max_tokens=MAX_TOKENS, temperature=1.0, seed=3,
                   n=NUM_SAMPLES)
    constrained = client.completions.create(**request, extra_body={"guided_json": schema})
    assert len(constrained.choices) == NUM_SAMPLES
    for choice in constrained.choices:
        assert choice.finish_reason == "stop" and is_valid(schema, choice.text), choice.text
    free = client.completions.create(**{**request, "max_tokens": 40})
    assert sum(is_valid(schema, choice.text) for choice in free.choices) == 0


def test_chat_parse_returns_the_pydantic_object(server):
    completion = server.client().chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe a person."}], response_format=Person,
        max_tokens=MAX_TOKENS, temperature=1.0, seed=5)
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and completion.choices[0].finish_reason == "stop"
    assert Person.model_validate_json(completion.choices[0].message.content) == person


class Tag(pydantic.BaseModel):
    label: str = pydantic.Field(max_length=8)


class User(pydantic.BaseModel):  # its schema says nothing of other keys, as pydantic writes it
    name: str = pydantic.Field(max_length=10)
    age: int = pydantic.Field(ge=0, le=120)
    tag: Tag


class StrictUser(User, extra="forbid"):  # what the outputs are held to: no key the schema does not list
    tag: StrictTag


class StrictTag(Tag, extra="forbid"):
    pass


StrictUser.model_rebuild()
USER_MESSAGES = [{"role": "user", "content": "Describe a user."}]


def test_a_pydantic_schema_without_additional_properties_gives_only_its_keys_through_the_sdk(server):
    schema = User.model_json_schema()
    assert "additionalProperties" not in schema and "additionalProperties" not in schema["$defs"]["Tag"]
    completion = server.client().chat.completions.create(
        model=MODEL, messages=USER_MESSAGES, max_tokens=MAX_TOKENS, temperature=1.0, seed=7, n=16,
        response_format={"type": "json_schema", "json_schema": {"name": "User", "schema": schema}})
    for choice in completion.choices:
        assert choice.finish_reason == "stop"
        StrictUser.model_validate_json(choice.message.content)


def test_instructor_gets_the_object_in_json_schema_and_tools_modes(server):
    import instructor

    for mode in (instructor.Mode.JSON_SCHEMA, instructor.Mode.TOOLS):
        client = instructor.from_openai(server.client(), mode=mode)
        user, completion = client.chat.completions.create_with_completion(
            model=MODEL, messages=USER_MESSAGES, response_model=User, max_tokens=MAX_TOKENS, temperature=1.0, seed=1,
            max_retries=0)
        message = completion.choices[0].message
        raw = message.content if mode is instructor.Mode.JSON_SCHEMA else message.tool_calls[0].function.arguments
        assert StrictUser.model_validate_json(raw).model_dump() == user.model_dump(), mode


def test_langchain_structured_output_and_bound_tools_give_only_the_schemas_keys(server):
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", model=MODEL, temperature=1.0,
                      max_tokens=MAX_TOKENS, seed=3, max_retries=0)
    for method in ("json_schema", "function_calling"):
        result = chat.with_structured_output(User, method=method, include_raw=True).invoke(USER_MESSAGES)
        assert result["parsing_error"] is None and isinstance(result["parsed"], User), method
        StrictUser.model_validate(result["parsed"].model_dump())
    message = chat.bind_tools([User], tool_choice="any").invoke(USER_MESSAGES)
    assert message.response_metadata["finish_reason"] == "tool_calls"
    [call] = message.tool_calls
    assert call["name"] == "User"
    StrictUser.model_validate(call["args"])


def test_choice_regex_and_json_object_outputs_match(server):
    client = server.client()
    choices = ["north", "south", "east", "west"]
    picked = client.completions.create(model=MODEL, prompt="Go", max_tokens=20, temperature=1.0, seed=1, n=20,
                                       extra_body={"guided_choice": choices})
    assert all(c.text in choices for c in picked.choices) and len({c.text for c in picked.choices}) > 1
    pattern = r"[A-Z]{2}-[0-9]{3}( ok)?"
    matched = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Code?"}],
                                             max_tokens=20, temperature=1.0, seed=2, n=10,
                                             extra_body={"structured_outputs": {"regex": pattern}})
    assert all(re.fullmatch(pattern, c.message.content) for c in matched.choices)
    objects = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "JSON?"}],
                                             max_tokens=MAX_TOKENS, temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(objects.choices[0].message.content), dict)


def test_the_responses_api_follows_text_format(server):
    schema = SCHEMAS["enums"]
    response = server.client().responses.create(
        model=MODEL, input="Pick a colour.", max_output_tokens=MAX_TOKENS, temperature=1.0,
        text={"format": {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}})
    assert response.status == "completed" and is_valid(schema, response.output_text)
    assert response.text.format.type == "json_schema"


def test_streaming_gives_the_same_text_as_not_streaming(server):
    client, schema = server.client(), SCHEMAS["nested objects"]
    request = dict(model=MODEL, prompt="User:", max_tokens=MAX_TOKENS, temperature=1.0, seed=9,
                   extra_body={"guided_json": schema})
    whole = client.completions.create(**request).choices[0].text
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(**request, stream=True)
                       if chunk.choices)
    assert streamed == whole and is_valid(schema, whole)


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format.json_schema.schema"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_regex": "a{99999999}"}, "guided_regex"),
    ({"guided_choice": [f"choice {i}" for i in range(100000)]}, "guided_choice"),
    ({"guided_json": {"type": "object", "properties": {f"p{i}": {"enum": [f"v{i}-{j}" for j in range(50)]}
                                                       for i in range(3000)}}}, "guided_json"),
])
def test_a_constraint_that_cannot_compile_is_a_400_and_harms_nothing(server, extra, param):
    worker_pid, client = server.worker_pid, server.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=8, extra_body=extra)
    assert info.value.body["param"] == param
    after = client.completions.create(model=MODEL, prompt="Hi", max_tokens=8, extra_body={"guided_regex": "[a-z]+"})
    assert re.fullmatch("[a-z]+", after.choices[0].text) and server.worker_pid == worker_pid


def test_constrained_streams_complete_unchanged_through_a_worker_sigkill(paced_server):
    server = paced_server
    schema = {"type": "array", "items": {"type": "object", "additionalProperties": False, "required": ["k", "v"],
                                         "properties": {"k": {"enum": ["a", "b", "c"]},
                                                        "v": {"type": "integer", "minimum": 0, "maximum": 99}}},
              "minItems": 8, "maxItems": 8}
    requests = [{"model": MODEL, "prompt": f"List #{i}:", "max_tokens": MAX_TOKENS, "temperature": 1.0,
                 "seed": 100 + i, "extra_body": {"guided_json": schema}} for i in range(8)]
    client = server.client()
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        expected = [c.choices[0].text for c in pool.map(lambda r: client.completions.create(**r), requests)]
    assert all(is_valid(schema, text) for text in expected)
    worker_pid = server.worker_pid
    streams, futures = run_streams(server, requests)
    server.wait_for(lambda: all(len(s.pieces) >= 4 for s in streams), "the streams to be under way")
    os.kill(worker_pid, signal.SIGKILL)
    received_at_fault = [len("".join(s.pieces)) for s in streams]
    results = [future.result(timeout=WAIT_S) for future in futures]
    assert any(0 < n < len(text) for n, text in zip(received_at_fault, expected)), "the kill must strike mid-stream"
    assert [stream.text for stream in results] == expected
    assert all(stream.finish_reason == "stop" for stream in results) and server.worker_pid != worker_pid
