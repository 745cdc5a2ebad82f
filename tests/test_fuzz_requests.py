"""Fuzzing every endpoint's request body against one real server: no input earns a 5xx or kills the worker.

One server (`python -m server`, tiny checkpoint, cpu) serves the module.
Hypothesis builds a valid body for an endpoint and sets one of its known
fields, sometimes one more field, known or not, to a value of the field's
own shape or to any JSON value: extreme numbers (1e-46, 1e308, -0.0, 10**20,
2**63...), nested lists and objects, long and odd strings (NUL, lone
surrogates, right-to-left marks). Some bodies are no JSON object at all,
some requests put an odd name in the path. Properties:

- every answer is a 200 (a stream that ends with its endpoint's end event)
  or a 4xx in the OpenAI error schema; never a 5xx, never a dropped
  connection, and the engine worker never dies;
- a sampling setting that leaves a single candidate token (a tiny
  temperature or top_p, top_k 1, min_p 1) answers what greedy answers.

The server fails a request at the first worker death it sees and may
restart its worker without limit, so that a crash is charged to the example
that caused it: each example first waits for /health 200, and checks
afterwards that the worker it started with is still the one serving.
Failing examples are kept in .pytest_cache/hypothesis and replayed first on
the next run.
"""

from __future__ import annotations

import http.client
import json
import re
from pathlib import Path
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from hypothesis.database import DirectoryBasedExampleDatabase

from server.http.errors import ERROR_TYPES

from helpers.metrics_scrape import num_restarts
from helpers.running_server import WORKER_PID, RunningServer, start_server, stop_server
from helpers.tiny_tokenizer import make_served_checkpoint

MODEL = "tiny"
MAX_MODEL_LEN = 64  # bounds what any valid max_tokens can cost
EXCHANGE_TIMEOUT_S = 30.0
SERVER_FLAGS = ("--served-model-name", MODEL, "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "512",
                "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "16",
                "--max-request-restarts", "1", "--max-worker-restarts", "1000", "--restart-window", "1")
SERVER_ERROR_TYPES = frozenset(t for status, t in ERROR_TYPES.items() if status >= 500)
STREAM_ENDS = (b"[DONE]", b"response.completed", b"response.incomplete")
SHOWN_BYTES = 400
EXAMPLES_DB = DirectoryBasedExampleDatabase(Path(__file__).resolve().parents[1] / ".pytest_cache" / "hypothesis")


def fuzz_settings(max_examples: int) -> settings:
    """No explain phase: it re-runs each failing example, and one that kills the worker costs a restart."""
    return settings(max_examples=max_examples, deadline=None, database=EXAMPLES_DB,
                    phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])


# ---------------------------------------------------------------------------------------------- JSON values

EXTREME_INTS = (0, 1, -1, 2, 100, 101, 127, 128, 129, 511, 512, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1,
                2**63, 2**64 - 1, -2**63, -2**63 - 1, 10**20, -10**20, 10**100)
EXTREME_FLOATS = (-0.0, 0.5, 1e-46, 1e-40, 1e-38, 5e-324, 1e-308, 1e-7, 1.0000001, 0.9999999, 2.0000001, -1e-46,
                  1e308, -1e308, 1.7976931348623157e308, 100.5, -100.5, 1e20)
ODD_STRINGS = ("", " ", "\x00", "a\x00b", "\ud800", "\u202e", "\ufeff", "null", "NaN", "-1", "1e-46", "1e400",
               "10" * 10, MODEL, "<s>", "</s>", "<|assistant|>", "{{ bos_token }}", "{% for %}", "\r\n\r\n",
               "data: [DONE]\n\n", "😀" * 300, "你好", "a" * 20_000, "\x00" * 1000, "\U0010ffff")
ROLES = ("user", "system", "assistant", "developer", "tool", "function", "wizard", "", "USER")


def one_in(n: int, rare: st.SearchStrategy, usual: st.SearchStrategy) -> st.SearchStrategy:
    """`rare` once in n draws, else `usual`. (st.one_of weighs each branch alike once nested ones are flattened.)"""
    return st.integers(1, n).flatmap(lambda i: rare if i == n else usual)


# Extremes two draws in three: they are where the bugs live.
ints = one_in(3, st.integers(-5, 600), st.sampled_from(EXTREME_INTS))
floats = one_in(3, st.floats(allow_nan=False, allow_infinity=False), st.sampled_from(EXTREME_FLOATS))
strings = st.sampled_from(ODD_STRINGS) | st.text(max_size=30)
scalars = st.none() | st.booleans() | ints | floats | strings
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(strings, inner, max_size=4),
                           max_leaves=12)


def messages(part_types: tuple[str, ...]) -> st.SearchStrategy:
    """Chat or Responses API messages: odd roles, and content as a string, a list of parts or anything."""
    parts = st.lists(st.fixed_dictionaries({"type": st.sampled_from(part_types) | strings, "text": strings | json_values}),
                     max_size=3)
    message = st.fixed_dictionaries({"role": st.sampled_from(ROLES) | json_values, "content": strings | parts | json_values})
    return st.lists(message, max_size=3)


# Shapes that pass a field's type check, so the values inside reach deeper code.
BIASES = st.integers(-100, 100) | st.floats(-100, 100)
SHAPED = {
    "prompt": strings | st.lists(ints, min_size=1, max_size=5) | st.lists(strings, min_size=1, max_size=4)
    | st.lists(st.lists(ints, max_size=4), max_size=3),
    "messages": messages(("text", "image_url")),
    "input": strings | messages(("input_text", "output_text", "input_image")),
    "logit_bias": st.dictionaries(one_in(3, strings, ints.map(str)), one_in(2, ints | floats | json_values, BIASES),
                                  min_size=1, max_size=2),
    "stop": strings | st.lists(strings, max_size=3),
    "stop_token_ids": st.lists(ints, max_size=3),
    "tokens": st.lists(ints, max_size=5),
    "stream_options": st.fixed_dictionaries({"include_usage": json_values}),
    "metadata": st.dictionaries(strings, strings | json_values, max_size=3),
    "previous_response_id": st.just("resp_" + "0" * 32) | strings,
}
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


def field_values(name: str) -> st.SearchStrategy:
    """Three values in four of the field's own shape (a number: two in three of its own kind), one any JSON value."""
    shaped = SHAPED.get(name, one_in(3, ints, floats) if name in FLOAT_FIELDS else one_in(3, floats, ints))
    return one_in(4, json_values, shaped)


# ---------------------------------------------------------------------------------------------- requests

SAMPLING_FIELDS = ("model", "max_tokens", "n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "logit_bias",
                   "stream", "stream_options", "presence_penalty", "frequency_penalty", "repetition_penalty",
                   "min_tokens", "stop_token_ids", "priority", "ignore_eos", "include_stop_str_in_output", "user")
ENDPOINTS = {  # path: (a valid body, its known fields)
    "/v1/completions": ({"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                        (*SAMPLING_FIELDS, "prompt", "logprobs", "echo", "suffix", "best_of",
                         "prompt_logprobs")),
    "/v1/chat/completions": ({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
                             (*SAMPLING_FIELDS, "messages", "max_completion_tokens", "logprobs", "top_logprobs",
                              "add_generation_prompt", "response_format", "tools", "tool_choice",
                              "prompt_logprobs")),
    "/v1/responses": ({"model": MODEL, "input": "Hi", "max_output_tokens": 2, "store": False},
                      ("model", "input", "instructions", "previous_response_id", "max_output_tokens", "metadata",
                       "temperature", "top_p", "seed", "stream", "store", "tools", "tool_choice", "text", "truncation",
                       "background", "include", "top_logprobs", "reasoning", "user")),
    "/tokenize": ({"model": MODEL, "prompt": "Hi"}, ("model", "prompt", "messages", "add_special_tokens")),
    "/detokenize": ({"model": MODEL, "tokens": [1, 72]}, ("model", "tokens")),
}
STREAMING = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
GET_PATHS = ("/v1/models", "/health", "/metrics", "/version")
NOT_OBJECTS = (b"", b"{", b"}", b"[]", b"null", b"0", b'"prompt"', b'{"prompt": NaN}', b'{"max_tokens": Infinity}',
               b'{"top_p": -Infinity}', b'{"prompt": "Hi"}{"prompt": "Hi"}', b'{"prompt": "Hi", "prompt": 1}',
               b"\xef\xbb\xbf{}", b"\xff\xfe{\x00}\x00", b'{"prompt": "\xc3\x28"}', b"[" * 5000 + b"]" * 5000,
               b'{"a":' * 2000 + b"1" + b"}" * 2000, b"\x00" * 64)


ENDPOINT_FIELDS = [(path, name) for path, (_, fields) in ENDPOINTS.items() for name in fields]


@st.composite
def mutated_bodies(draw) -> tuple[str, str, bytes]:
    """A valid body for an endpoint with one known field set to anything, maybe one more field, known or not.

    Each (endpoint, field) pair is drawn alike; most bodies change one field only, so that a bad value is
    not hidden behind another field's 400.
    """
    path, name = draw(st.sampled_from(ENDPOINT_FIELDS))
    base, fields = ENDPOINTS[path]
    body = {**base, **({"stream": draw(st.booleans())} if path in STREAMING else {}), name: draw(field_values(name))}
    for extra in draw(st.lists(one_in(2, strings, st.sampled_from(fields)), max_size=1)):
        body[extra] = draw(field_values(extra))
    text = json.dumps(body, allow_nan=False, ensure_ascii=draw(st.booleans()))
    return "POST", path, text.encode("utf-8", "surrogatepass")


@st.composite
def other_requests(draw) -> tuple[str, str, bytes]:
    """A body that is no JSON object, a GET with a body, or an odd name in the path."""
    body = draw(st.sampled_from(NOT_OBJECTS) | st.binary(max_size=64)
                | json_values.filter(lambda v: not isinstance(v, dict)).map(lambda v: json.dumps(v).encode()))
    name = quote(draw(strings), safe="", errors="surrogatepass")
    method, path = draw(st.sampled_from([("POST", p) for p in sorted(ENDPOINTS)] + [("GET", p) for p in GET_PATHS]
                                        + [("GET", f"/v1/models/{name}"), ("GET", f"/v1/responses/{name}"),
                                           ("DELETE", f"/v1/responses/{name}")]))
    return method, path, body


http_requests = one_in(4, other_requests(), mutated_bodies())


def post(path: str, **fields) -> tuple[str, str, bytes]:
    """The endpoint's valid body with these fields set: for the examples every run tries first."""
    return "POST", path, json.dumps({**ENDPOINTS[path][0], **fields}).encode()


# ---------------------------------------------------------------------------------------------- checks

@pytest.fixture(scope="module")
def server(tmp_path_factory) -> RunningServer:
    tmp = tmp_path_factory.mktemp("fuzz")
    running = start_server(tmp, make_served_checkpoint(tmp), *SERVER_FLAGS)
    yield running
    stop_server(running)


def is_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def send(server: RunningServer, method: str, path: str, body: bytes) -> tuple[int, str, bytes]:
    """One exchange on a fresh connection: (status, content type, body)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=EXCHANGE_TIMEOUT_S)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.getheader("Content-Type", ""), response.read()
    finally:
        conn.close()


def exchange(server: RunningServer, method: str, path: str, body: bytes) -> tuple[int, str, bytes, str]:
    """Send one request to a ready worker; fail on a dropped connection, a dead worker or a 5xx.
    (status, content type, body, a description of the exchange for failure messages)"""
    server.wait_for(server.is_healthy, "/health 200 before the request")
    pid, log_start = server.worker_pid, server.log.stat().st_size
    what = f"{method} {path[:SHOWN_BYTES]} body {body[:SHOWN_BYTES]!r}{'...' if len(body) > SHOWN_BYTES else ''}"
    try:
        status, content_type, payload = send(server, method, path, body)
    except (OSError, http.client.HTTPException) as exc:
        raise AssertionError(f"no whole answer: {what} -> {exc!r}{new_log(server, log_start)}") from None
    what += f" -> {status} {payload[:SHOWN_BYTES]!r}"
    worker_survived = is_alive(pid) and server.worker_pid == pid
    assert worker_survived, f"the engine worker died: {what}{new_log(server, log_start)}"
    assert status < 500, f"a server error: {what}{new_log(server, log_start)}"
    return status, content_type, payload, what


def new_log(server: RunningServer, start: int) -> str:
    lines = server.log.read_bytes()[start:].decode(errors="replace").strip().splitlines()
    return "\nserver log:\n" + "\n".join(line[:SHOWN_BYTES] for line in lines[-12:]) if lines else ""


def openai_error_type(payload: bytes) -> str | None:
    """The `type` of an OpenAI error body {"error": {"message", "type", "param", "code"}}; None if it is none."""
    value = json.loads(payload) if parses_as_json(payload) else None
    error = value.get("error") if isinstance(value, dict) else None
    is_schema = (isinstance(error, dict) and isinstance(error.get("message"), str) and isinstance(error.get("type"), str)
                 and {"param", "code"} <= set(error))
    return error["type"] if is_schema else None


def stream_error_kind(data: bytes) -> str | None:
    """What a stream's error event says went wrong: an OpenAI error's type, or the code of a Responses API
    `error` event {"type": "error", "code", "message", "param"}; None if `data` is neither."""
    value = json.loads(data) if parses_as_json(data) else None
    if isinstance(value, dict) and value.get("type") == "error" and isinstance(value.get("message"), str):
        return str(value.get("code"))
    return openai_error_type(data)


def sse_events(payload: bytes) -> list[tuple[bytes, bytes]]:
    """(event name, data) of each event in an SSE body; comments (pings) left out."""
    events = []
    for block in payload.split(b"\n\n"):
        lines = block.split(b"\n")
        data = b"\n".join(line[len(b"data: "):] for line in lines if line.startswith(b"data: "))
        name = next((line[len(b"event: "):] for line in lines if line.startswith(b"event: ")), b"")
        if data or name:
            events.append((name, data))
    return events


def check_answer(status: int, content_type: str, payload: bytes, what: str) -> None:
    if status >= 400:
        assert openai_error_type(payload) is not None, f"a {status} without the OpenAI error schema: {what}"
    elif content_type.startswith("text/event-stream"):
        events = sse_events(payload)
        name, data = events[-1] if events else (b"", b"")
        if data not in STREAM_ENDS and name not in STREAM_ENDS:
            kind = stream_error_kind(data)
            assert kind is not None, f"a stream that ended without its end event: {what} ... {payload[-SHOWN_BYTES:]!r}"
            assert kind not in SERVER_ERROR_TYPES, f"a stream that ended in a server error: {what} ... {data!r}"
    elif content_type.startswith("application/json") and payload:  # /health's 200 is empty
        assert parses_as_json(payload), f"a 200 whose JSON body does not parse: {what}"


def parses_as_json(payload: bytes) -> bool:
    try:
        json.loads(payload)
    except ValueError:
        return False
    return True


@fuzz_settings(max_examples=2000)
@given(http_request=http_requests)
@example(http_request=post("/v1/completions", top_p=1e-46))
@example(http_request=post("/v1/chat/completions", top_p=1e-46, stream=True))
@example(http_request=post("/v1/responses", top_p=1e-46))
@example(http_request=post("/v1/completions", logit_bias={str(10**20): 1}))
def test_any_request_gets_a_200_or_a_4xx_in_the_openai_schema(server, http_request):
    check_answer(*exchange(server, *http_request))


# ---------------------------------------------------------------------------------------------- one candidate

# Below float32's smallest normal (1.2e-38) and subnormal (1.4e-45) numbers, and up to 1e-5. No float range:
# shrinking one would try many values, and each that kills the worker costs a restart.
TINY_POSITIVE = st.sampled_from((1e-46, 1e-40, 5e-324, 1e-308, 1.4e-45, 1e-44, 1e-38, 1e-30, 1e-20, 1e-10, 1e-6, 1e-5))
TINY_TEMPERATURE_OR_TOP_P = (st.fixed_dictionaries({"temperature": TINY_POSITIVE})
                             | st.fixed_dictionaries({"temperature": st.floats(0.5, 2), "top_p": TINY_POSITIVE}))
ONE_CANDIDATE = (TINY_TEMPERATURE_OR_TOP_P
                 | st.fixed_dictionaries({"temperature": st.floats(0.5, 2), "top_k": st.just(1)})
                 | st.fixed_dictionaries({"temperature": st.floats(0.5, 2), "min_p": st.just(1.0)}))
GENERATION = {  # path: (a body without sampling fields, where its text is)
    "/v1/completions": ({"model": MODEL, "max_tokens": 6, "ignore_eos": True}, lambda r: r["choices"][0]["text"]),
    "/v1/chat/completions": ({"model": MODEL, "max_tokens": 6, "ignore_eos": True},
                             lambda r: r["choices"][0]["message"]["content"]),
    "/v1/responses": ({"model": MODEL, "max_output_tokens": 6, "store": False},
                      lambda r: r["output"][0]["content"][0]["text"]),
}
PROMPTS = ("Hi", "Once upon a time", "The quick brown fox", "你好 😀", "What is the capital of France?")


def generation_body(path: str, prompt: str, sampling: dict) -> bytes:
    prompt_field = {"/v1/completions": {"prompt": prompt}, "/v1/responses": {"input": prompt}}.get(
        path, {"messages": [{"role": "user", "content": prompt}]})
    return json.dumps({**GENERATION[path][0], **prompt_field, **sampling}).encode()


def generated_text(server: RunningServer, path: str, prompt: str, sampling: dict) -> tuple[str, str]:
    status, _, payload, what = exchange(server, "POST", path, generation_body(path, prompt, sampling))
    assert status == 200, f"a valid request refused: {what}"
    return GENERATION[path][1](json.loads(payload)), what


SINGLE_CANDIDATE_CASES = (st.tuples(st.sampled_from(("/v1/completions", "/v1/chat/completions")), ONE_CANDIDATE)
                          | st.tuples(st.just("/v1/responses"), TINY_TEMPERATURE_OR_TOP_P))  # no top_k, min_p there


@fuzz_settings(max_examples=60)
@given(case=SINGLE_CANDIDATE_CASES, prompt=st.sampled_from(PROMPTS))
@example(case=("/v1/completions", {"temperature": 1e-40}), prompt="Hi")
def test_a_single_candidate_sampling_setting_answers_as_greedy(server, case, prompt):
    path, sampling = case
    greedy, _ = generated_text(server, path, prompt, {"temperature": 0})
    text, what = generated_text(server, path, prompt, sampling)
    assert text == greedy, f"{sampling} answered {text!r}, greedy answers {greedy!r}: {what}"


# ---------------------------------------------------------------------------------------------- afterwards

def test_the_first_worker_outlived_all_of_it(server):
    first_pid = int(WORKER_PID.findall(server.log.read_bytes())[0])
    assert server.get("/health")[0] == 200
    restarts = re.findall(r"restarting the engine worker[^\n]*", server.log.read_text())
    assert (server.worker_pid, num_restarts(server.scrape())) == (first_pid, 0), "worker restarts:\n" + "\n".join(restarts)
