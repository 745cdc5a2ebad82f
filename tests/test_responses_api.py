"""The Responses API end to end: real `python -m server` processes, the openai SDK, http.client, a real redis-server.

Two replicas share one redis-server, so a conversation begun on one goes on on the other; a server on a
SQLite file is stopped and a new one started on the same file. The model is the embedded default with
"\\n" as a second end-of-sequence token (as Llama 3 has two): each answer is one line that ends by
itself (status "completed"), so greedy turns are short and reproducible. The replicas take an API key.
The test that stops redis-server comes last among the replicas' tests.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import redis

from server.generation.tokenizer import Tokenizer
from server.http.sse import encode_event
from shared.default_model import DEFAULT_MODEL_DIR

from helpers.redis_server import restart_redis, start_redis, stop_redis
from helpers.running_server import RunningServer, free_port, start_server, stop_server

MODEL = "pagedserve-shakespeare"
API_KEY = "responses-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SERVER_FLAGS = ("--served-model-name", MODEL, "--api-key", API_KEY, "--device", "cpu", "--dtype", "float32",
                "--num-kv-blocks", "256")
GREEDY = {"model": MODEL, "temperature": 0, "max_output_tokens": 24}
RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")
UNKNOWN_ID = "resp_" + "0" * 32
PROMPT_STORE_FAILURE_S = 8.0  # a 503 for a dead store: well under a client's patience, with room for a slow CI


def one_line_checkpoint(tmp: Path) -> Path:
    """The default model (linked, not copied) with "\\n" as a second end-of-sequence token."""
    path = tmp / "one-line-model"
    path.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (path / name).symlink_to(DEFAULT_MODEL_DIR / name)
    [newline] = Tokenizer.from_dir(DEFAULT_MODEL_DIR).encode("\n", add_special_tokens=False)
    generation = json.loads((DEFAULT_MODEL_DIR / "generation_config.json").read_text())
    generation["eos_token_id"] = [generation["eos_token_id"], newline]
    (path / "generation_config.json").write_text(json.dumps(generation))
    return path


def num_prompt_tokens(server: RunningServer, messages: list[dict]) -> int:
    """What the chat template makes of `messages`, counted by the server's /tokenize."""
    status, _, body = server.request("POST", "/tokenize", {"model": MODEL, "messages": messages})
    assert status == 200, body
    return json.loads(body)["count"]


def post(server: RunningServer, body: dict, headers: dict | None = AUTH) -> tuple[int, dict, dict]:
    status, response_headers, data = server.request("POST", "/v1/responses", body, headers)
    return status, response_headers, json.loads(data)


def assert_error(status: int, body: bytes | dict, expected_status: int, param: str | None = None) -> dict:
    error = (body if isinstance(body, dict) else json.loads(body))["error"]
    assert status == expected_status, error
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["param"] == param, error
    return error


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return one_line_checkpoint(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    stop_redis(server)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, checkpoint, redis_server):
    flags = (*SERVER_FLAGS, "--state-store", redis_server.url)
    a = start_server(tmp_path_factory.mktemp("replica-a"), checkpoint, *flags)
    try:
        b = start_server(tmp_path_factory.mktemp("replica-b"), checkpoint, *flags)
    except BaseException:
        stop_server(a)
        raise
    yield a, b
    stop_server(a)
    stop_server(b)


@pytest.fixture(scope="module")
def client(replicas) -> openai.OpenAI:
    return replicas[0].client(API_KEY)


# ---------------------------------------------------------------------------------------------- conversations

def test_a_conversation_goes_on_on_another_replica(replicas):
    a, b = replicas
    first = a.client(API_KEY).responses.create(input="Speak, friend.", **GREEDY)
    assert RESPONSE_ID.fullmatch(first.id) and first.object == "response" and first.status == "completed"
    assert first.output_text and first.output[0].role == "assistant" and first.output[0].id.startswith("msg_")
    assert first.usage.total_tokens == first.usage.input_tokens + first.usage.output_tokens
    assert first.store is True and first.previous_response_id is None and first.model == MODEL

    second = b.client(API_KEY).responses.create(input="Who goes there?", previous_response_id=first.id, **GREEDY)
    messages = [{"role": "user", "content": "Speak, friend."}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "Who goes there?"}]
    assert second.previous_response_id == first.id and second.status == "completed"
    assert second.usage.input_tokens == num_prompt_tokens(a, messages)  # the first turn is in the prompt
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens

    chat = a.client(API_KEY).chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24)
    assert chat.choices[0].message.content == second.output_text
    assert chat.usage.prompt_tokens == second.usage.input_tokens
    assert a.client(API_KEY).responses.retrieve(second.id).model_dump() == second.model_dump()
    assert b.client(API_KEY).responses.retrieve(first.id).model_dump() == first.model_dump()


def test_instructions_lead_their_own_turn_only(client, replicas):
    a = replicas[0]
    first = client.responses.create(input="Speak, friend.", instructions="Answer in verse.", **GREEDY)
    assert first.instructions == "Answer in verse."
    assert first.usage.input_tokens == num_prompt_tokens(a, [{"role": "system", "content": "Answer in verse."},
                                                             {"role": "user", "content": "Speak, friend."}])
    second = client.responses.create(input="Again.", previous_response_id=first.id, **GREEDY)
    assert second.instructions is None
    assert second.usage.input_tokens == num_prompt_tokens(a, [{"role": "user", "content": "Speak, friend."},
                                                              {"role": "assistant", "content": first.output_text},
                                                              {"role": "user", "content": "Again."}])


def test_message_items_render_like_chat_messages(client, replicas):
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "input_text", "text": "Speak,"}, {"type": "input_text", "text": "friend."}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Mellon."}]},
             {"role": "user", "content": "And now?"}]
    response = client.responses.create(input=items, metadata={"case": "items"}, **GREEDY)
    assert response.metadata == {"case": "items"}
    assert response.usage.input_tokens == num_prompt_tokens(replicas[0], [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Speak,\nfriend."},
        {"role": "assistant", "content": "Mellon."}, {"role": "user", "content": "And now?"}])


def test_deleting_a_parent_leaves_its_children_whole(client):
    parent = client.responses.create(input="Speak, friend.", **GREEDY)
    child = client.responses.create(input="Who goes there?", previous_response_id=parent.id, **GREEDY)
    client.responses.delete(parent.id)
    grandchild = client.responses.create(input="Speak again.", previous_response_id=child.id, **GREEDY)
    assert grandchild.usage.input_tokens > child.usage.input_tokens + child.usage.output_tokens


def test_store_false_keeps_nothing_but_may_continue_a_stored_parent(client, replicas):
    parent = client.responses.create(input="Speak, friend.", **GREEDY)
    unstored = client.responses.create(input="Who goes there?", previous_response_id=parent.id, store=False, **GREEDY)
    assert unstored.store is False and unstored.status == "completed"
    status, _, body = replicas[1].request("GET", f"/v1/responses/{unstored.id}", headers=AUTH)
    assert_error(status, body, 404)
    status, _, body = post(replicas[0], {"input": "More.", "previous_response_id": unstored.id})
    assert_error(status, body, 404, "previous_response_id")


def test_max_output_tokens_makes_an_incomplete_response(client):
    response = client.responses.create(input="Speak, friend.", model=MODEL, temperature=0, max_output_tokens=2)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 2 and response.output[0].status == "incomplete"
    assert client.responses.retrieve(response.id).status == "incomplete"


# ---------------------------------------------------------------------------------------------- streaming

def test_stream_through_the_sdk(client):
    events = list(client.responses.create(input="Speak, friend.", stream=True, **GREEDY))
    types = [event.type for event in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    deltas = [event.delta for event in events[4:-4]]
    assert set(types[4:-4]) == {"response.output_text.delta"} and len(deltas) >= 2
    assert [event.sequence_number for event in events] == list(range(len(events)))
    created, final = events[0].response, events[-1].response
    assert created.status == "in_progress" and created.output == [] and created.id == final.id
    assert "".join(deltas) == events[-4].text == final.output_text
    assert {event.item_id for event in events[3:-1] if hasattr(event, "item_id")} == {final.output[0].id}
    assert client.responses.retrieve(final.id).model_dump() == final.model_dump()
    whole = client.responses.create(input="Speak, friend.", **GREEDY)
    assert whole.output_text == final.output_text and whole.usage.output_tokens == final.usage.output_tokens


def test_stream_helper_and_incomplete_stream(client):
    with client.responses.stream(input="Speak, friend.", **GREEDY) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and "".join(deltas) == final.output_text
    events = list(client.responses.create(input="Speak, friend.", stream=True, model=MODEL, max_output_tokens=2))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_stream_on_the_wire_names_each_event(replicas):
    a = replicas[0]
    body = json.dumps({"input": "Speak, friend.", "stream": True, **GREEDY}).encode()
    with socket.create_connection(("127.0.0.1", a.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
                     b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    head, _, chunked = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"content-type: text/event-stream" in head.lower()
    events = re.findall(rb"event: (\S+)\ndata: (\{.*?\})\n\n", chunked)
    assert events and all(json.loads(data)["type"] == name.decode() for name, data in events)
    assert events[-1][0] == b"response.completed" and b"[DONE]" not in chunked
    assert encode_event({"type": "x"}, event="x") == b'event: x\ndata: {"type":"x"}\n\n'
    with pytest.raises(ValueError, match="one non-empty line"):
        encode_event({}, event="two\nlines")


# ---------------------------------------------------------------------------------------------- ids and bodies

@pytest.mark.parametrize("method", ["GET", "DELETE"])
@pytest.mark.parametrize("response_id, status", [("resp_123", 400), ("resp_" + "A" * 32, 400), ("x", 400),
                                                 (UNKNOWN_ID, 404)])
def test_ids_in_the_path(replicas, method, response_id, status):
    got, _, body = replicas[0].request(method, f"/v1/responses/{response_id}", headers=AUTH)
    error = assert_error(got, body, status)
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


@pytest.mark.parametrize("previous_response_id, status", [("resp_123", 400), (42, 400), (UNKNOWN_ID, 404)])
def test_previous_response_id_is_checked(replicas, previous_response_id, status):
    got, _, body = post(replicas[0], {"input": "Hi", "previous_response_id": previous_response_id})
    assert_error(got, body, status, "previous_response_id")


def test_a_record_this_server_did_not_write_is_a_500_not_a_retry_forever(replicas, redis_server):
    corrupt_id = "resp_" + "c" * 32
    with redis.Redis(port=redis_server.port) as store:
        store.set(f"pagedserve:response:{corrupt_id}", b"not a record")
    status, headers, body = replicas[0].request("GET", f"/v1/responses/{corrupt_id}", headers=AUTH)
    assert "cannot be read" in assert_error(status, body, 500)["message"] and "retry-after" not in headers
    status, _, body = post(replicas[1], {"input": "Hi", "previous_response_id": corrupt_id})
    assert_error(status, body, 500)


def test_delete_then_get_is_404(client, replicas):
    response = client.responses.create(input="Hi", model=MODEL, max_output_tokens=1)
    status, _, body = replicas[1].request("DELETE", f"/v1/responses/{response.id}", headers=AUTH)
    assert status == 200 and json.loads(body) == {"id": response.id, "object": "response", "deleted": True}
    for method in ("GET", "DELETE"):
        status, _, body = replicas[0].request(method, f"/v1/responses/{response.id}", headers=AUTH)
        assert_error(status, body, 404)


@pytest.mark.parametrize("body, status, param", [
    ({}, 400, "input"),
    ({"input": 42}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, 400, "input[0].role"),
    ({"input": [{"type": "reasoning", "summary": []}]}, 400, "input[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 7}]}, 400, "input[0].output"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input[0].content[0]"),
    ({"input": [{"role": "user", "content": 7}]}, 400, "input[0].content"),
    ({"input": "Hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "Hi", "max_output_tokens": 100000}, 400, "max_output_tokens"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ({"input": "Hi", "tools": [{"type": "function", "name": "f"}]}, 400, "tool_choice"),  # "auto" needs a parser
    ({"input": "Hi", "reasoning": {"effort": "high"}}, 400, "reasoning"),
    ({"input": "Hi", "text": {"format": {"type": "xml"}}}, 400, "text.format.type"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}}}, 400,
     "text.format.schema"),
    ({"input": "Hi", "background": True}, 400, "background"),
    ({"input": "Hi", "temperature": 3}, 400, "temperature"),
    ({"input": "Hi", "top_p": 0}, 400, "top_p"),
    ({"input": "Hi", "store": "yes"}, 400, "store"),
    ({"input": "Hi", "instructions": ["Be brief."]}, 400, "instructions"),
    ({"input": "Hi", "metadata": {"k": 1}}, 400, "metadata.k"),
    ({"input": "Hi", "model": "gpt-4o"}, 404, "model"),
])
def test_bad_bodies_get_clear_errors(replicas, body, status, param):
    got, _, error_body = post(replicas[0], body)
    error = assert_error(got, error_body, status, param)
    if "max_output_tokens" in body and body["max_output_tokens"] > 1:
        assert error["code"] == "context_length_exceeded"


def test_neutral_values_and_tools_unused_are_accepted(replicas):
    status, _, body = post(replicas[0], {"input": "Hi", "model": MODEL, "max_output_tokens": 1, "tools": [],
                                         "tool_choice": "auto", "text": {"format": {"type": "text"}}, "user": "u",
                                         "parallel_tool_calls": True, "truncation": "disabled"})
    assert status == 200 and body["tools"] == [] and body["text"] == {"format": {"type": "text"}}


def test_the_api_key_guards_responses(replicas):
    a = replicas[0]
    status, _, body = post(a, {"input": "Hi"}, headers=None)
    assert_error(status, body, 401)
    status, _, body = a.request("GET", f"/v1/responses/{UNKNOWN_ID}")
    assert_error(status, body, 401)


# ---------------------------------------------------------------------------------------------- the store fails

def test_redis_going_away_is_a_prompt_503_and_its_return_heals(client, replicas, redis_server):
    a, b = replicas
    before = client.responses.create(input="Speak, friend.", **GREEDY)
    stop_redis(redis_server)
    try:
        requests = [("POST", "/v1/responses", {"input": "Hi", "max_output_tokens": 4}),
                    ("POST", "/v1/responses", {"input": "Hi", "previous_response_id": before.id}),
                    ("GET", f"/v1/responses/{before.id}", None), ("DELETE", f"/v1/responses/{before.id}", None)]
        for method, path, body in requests:
            started = time.monotonic()
            status, headers, data = a.request(method, path, body, AUTH)
            assert time.monotonic() - started < PROMPT_STORE_FAILURE_S
            assert assert_error(status, data, 503)["type"] == "service_unavailable" and headers["retry-after"]
        events = list(client.responses.create(input="Speak, friend.", stream=True, **GREEDY))
        assert events[0].type == "response.created" and events[-2].type == "response.output_item.done"
        assert events[-1].type == "error" and events[-1].code == "service_unavailable"
        assert "unavailable" in events[-1].message
    finally:
        restart_redis(redis_server)
    assert b.client(API_KEY).responses.retrieve(before.id).output_text == before.output_text  # its append-only file
    status, _, body = b.request("GET", f"/v1/responses/{events[0].response.id}", headers=AUTH)
    assert_error(status, body, 404)  # the stream whose write failed left nothing behind
    after = b.client(API_KEY).responses.create(input="Who goes there?", previous_response_id=before.id, **GREEDY)
    assert after.status == "completed"


# ---------------------------------------------------------------------------------------------- SQLite, start-up

def test_sqlite_conversation_outlives_its_server(tmp_path, checkpoint):
    flags = (*SERVER_FLAGS, "--state-store", f"sqlite://{tmp_path / 'state' / 'responses.db'}")
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    server = start_server(tmp_path / "first", checkpoint, *flags)
    try:
        first = server.client(API_KEY).responses.create(input="Speak, friend.", **GREEDY)
        os.kill(server.worker_pid, signal.SIGKILL)  # no worker: generation waits, the store still serves
        server.wait_for(lambda: not server.is_healthy(), "/health 503 after the worker died")
        status, _, body = server.request("GET", f"/v1/responses/{first.id}", headers=AUTH)
        assert status == 200 and json.loads(body)["id"] == first.id
        status, _, body = post(server, {"input": "Hi"})
        assert_error(status, body, 503)
    finally:
        stop_server(server)
    server = start_server(tmp_path / "second", checkpoint, *flags)
    try:
        client = server.client(API_KEY)
        assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
        second = client.responses.create(input="Who goes there?", previous_response_id=first.id, **GREEDY)
        assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    finally:
        stop_server(server)


@pytest.mark.parametrize("store, exit_status, reason", [
    ("mysql://db/responses", 2, "expected sqlite:///absolute/path.db or redis://host:port/db, got 'mysql://db/responses'"),
    ("sqlite://relative.db", 2, "a sqlite URL takes three slashes and an absolute file path"),
    ("redis://127.0.0.1:{port}/0", 1, "cannot start: the Redis state store 'redis://127.0.0.1:{port}/0' failed"),
    ("sqlite://{tmp}/a-file/responses.db", 1, "cannot start: the SQLite state store"),
])
def test_an_unusable_store_stops_the_server_at_start(tmp_path, store, exit_status, reason):
    (tmp_path / "a-file").write_text("not a directory")
    port = free_port()
    store, reason = store.format(port=port, tmp=tmp_path), reason.format(port=port)
    result = subprocess.run([sys.executable, "-m", "server", "--port", "0", "--runtime-dir", str(tmp_path / "runtime"),
                             "--state-store", store], capture_output=True, text=True, timeout=60)
    output = result.stdout + result.stderr
    assert result.returncode == exit_status and reason in output, output
    assert "listening on" not in output
