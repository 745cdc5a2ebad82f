"""The endpoints vLLM users probe, end to end: a real `python -m server` on the default model, over http.client
and the openai SDK.

/ping and /health answer an empty 200 with no Content-Type; /load counts the generation requests in flight;
POST /v1/responses/{id}/cancel is OpenAI's 400 for a response that was not created in the background;
POST /reset_prefix_cache empties the worker's prefix cache, seen in /metrics' hit counter, while a request
running across it completes. CORS, switched on with --allowed-origins: a preflight from an allowed origin
gets the Access-Control-* headers without the API key, one from another origin gets none, and responses to
an allowed origin (a 401 included) carry Access-Control-Allow-Origin.
"""

from __future__ import annotations

import json

import openai
import pytest

from helpers.running_server import RunningServer, start_server, stop_server

API_KEY = "endpoints-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ALLOWED_ORIGIN, OTHER_ORIGIN = "https://app.example", "https://elsewhere.example"
SERVER_FLAGS = ("--api-key", API_KEY, "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "256",
                "--allowed-origins", json.dumps([ALLOWED_ORIGIN]))
UNKNOWN_ID = "resp_" + "0" * 32
LONG_PROMPT = "O Romeo, Romeo! wherefore art thou Romeo? Deny thy father and refuse thy name. " * 4


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> RunningServer:
    running = start_server(tmp_path_factory.mktemp("server"), None, *SERVER_FLAGS)
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client(API_KEY)


@pytest.mark.parametrize(("method", "path"), [("GET", "/ping"), ("POST", "/ping"), ("GET", "/health")])
def test_readiness_probes_are_an_empty_untyped_200(server, method, path):
    status, headers, body = server.request(method, path)
    assert (status, body, headers["content-length"]) == (200, b"", "0")
    assert "content-type" not in headers, headers


def test_load_counts_the_generation_requests_in_flight(server, client):
    assert json.loads(server.get("/load")[2]) == {"server_load": 0}
    model = client.models.list().data[0]
    num_tokens = model.model_extra["max_model_len"] // 2  # far more than the test takes to look
    stream = client.completions.create(model=model.id, prompt="O Romeo", max_tokens=num_tokens, stream=True,
                                       extra_body={"min_tokens": num_tokens})
    next(iter(stream))  # the request is admitted and generating
    assert json.loads(server.get("/load")[2]) == {"server_load": 1}
    stream.close()  # the server aborts it
    server.wait_for(lambda: json.loads(server.get("/load")[2]) == {"server_load": 0}, "/load to go back to 0")


def test_cancelling_a_stored_response_is_openais_400_for_one_not_in_the_background(client):
    response = client.responses.create(model=client.models.list().data[0].id, input="Hi", max_output_tokens=4)
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.cancel(response.id)
    assert client.responses.retrieve(response.id).status == response.status  # nothing changed


def test_cancelling_an_unknown_response_is_404_and_other_methods_405(server, client):
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel(UNKNOWN_ID)
    status, headers, _ = server.request("GET", f"/v1/responses/{UNKNOWN_ID}/cancel", headers=AUTH)
    assert (status, headers["allow"]) == (405, "POST")


def prefix_cache_hits(server: RunningServer) -> float:
    [hits] = [value for name, value in server.scrape().items() if name.startswith("vllm:prefix_cache_hits")]
    return hits


def test_reset_prefix_cache_drops_the_cached_prefixes(server, client):
    model = client.models.list().data[0].id

    def complete() -> float:
        """The prefix cache hits, in tokens, of one more request for LONG_PROMPT."""
        before = prefix_cache_hits(server)
        client.completions.create(model=model, prompt=LONG_PROMPT, max_tokens=1)
        return prefix_cache_hits(server) - before

    complete()
    assert complete() > 0, "the second request for one prompt should hit the cache"
    status, headers, body = server.request("POST", "/reset_prefix_cache", headers=AUTH)
    assert (status, body) == (200, b""), body
    assert "content-type" not in headers
    assert complete() == 0, "after the reset, nothing of the prompt is cached"
    assert complete() > 0, "caching goes on after a reset"


def test_a_request_running_across_a_reset_completes(server, client):
    model = client.models.list().data[0]
    num_tokens = model.model_extra["max_model_len"] // 4
    stream = client.completions.create(model=model.id, prompt=LONG_PROMPT, max_tokens=num_tokens, stream=True,
                                       extra_body={"min_tokens": num_tokens}, temperature=0)
    chunks = iter(stream)
    text = next(chunks).choices[0].text
    assert server.request("POST", "/reset_prefix_cache", headers=AUTH)[0] == 200
    finish_reasons = []
    for chunk in chunks:
        text += chunk.choices[0].text
        finish_reasons.append(chunk.choices[0].finish_reason)
    assert finish_reasons[-1] == "length"
    again = client.completions.create(model=model.id, prompt=LONG_PROMPT, max_tokens=num_tokens, temperature=0,
                                      extra_body={"min_tokens": num_tokens})
    assert text == again.choices[0].text, "the running request's KV should be untouched by the reset"


def test_reset_prefix_cache_takes_the_api_key_and_post_only(server):
    assert server.request("POST", "/reset_prefix_cache")[0] == 401
    status, headers, _ = server.request("GET", "/reset_prefix_cache", headers=AUTH)
    assert (status, headers["allow"]) == (405, "POST")


def preflight(server: RunningServer, origin: str, method: str = "POST") -> tuple[int, dict[str, str], bytes]:
    return server.request("OPTIONS", "/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": method,
        "Access-Control-Request-Headers": "authorization, content-type"})


def cors_headers(headers: dict[str, str]) -> dict[str, str]:
    return {name: value for name, value in headers.items() if name.startswith("access-control-")}


def test_a_preflight_from_an_allowed_origin_gets_the_headers_without_the_api_key(server):
    status, headers, _ = preflight(server, ALLOWED_ORIGIN)
    assert status == 200, headers
    assert headers["access-control-allow-origin"] == ALLOWED_ORIGIN and headers["vary"] == "Origin"
    assert "POST" in headers["access-control-allow-methods"].split(", ")
    assert headers["access-control-allow-headers"] == "authorization, content-type"
    assert "access-control-allow-credentials" not in headers


def test_a_preflight_from_another_origin_gets_none(server):
    status, headers, _ = preflight(server, OTHER_ORIGIN)
    assert (status, cors_headers(headers)) == (400, {})


@pytest.mark.parametrize(("origin", "expected"), [(ALLOWED_ORIGIN, ALLOWED_ORIGIN), (OTHER_ORIGIN, None), (None, None)])
def test_responses_name_an_allowed_origin_only(server, origin, expected):
    origin_header = {} if origin is None else {"Origin": origin}
    status, headers, _ = server.request("GET", "/v1/models", headers={**AUTH, **origin_header})
    assert status == 200 and headers.get("access-control-allow-origin") == expected
    status, headers, _ = server.request("GET", "/v1/models", headers=origin_header)  # no key: refused
    assert status == 401 and headers.get("access-control-allow-origin") == expected
