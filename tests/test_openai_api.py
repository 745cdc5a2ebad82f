"""The OpenAI endpoints: detokenizer, stop strings, request checks, and the real thing end to end.

Unit tests drive each piece on its own (the handlers against a fake engine
client and connection where a failure must be staged). The end-to-end tests
share one real worker process on a tiny checkpoint with a trained tokenizer,
served by server.http.server with a router defined here, and talk to it with the
official openai SDK and with curl.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import subprocess
import types
from types import SimpleNamespace

import openai
import pytest
import pytest_asyncio

from server.api.admission import Admission
from server.api.completions.handlers import CompletionsHandlers
from server.api.completions.params import parse_chat_request, parse_completion_request, parse_json_body
from server.generation.chat_template import ChatTemplate, load_chat_template
from server.generation.detokenizer import Detokenizer
from server.generation.service import GenerationService
from server.generation.stop_strings import StopMatcher
from server.generation.tokenizer import Tokenizer
from server.http.errors import ApiError
from server.http.server import HttpRequest, Responder, serve
from server.worker.engine_client import EngineClient
from server.worker.request_state import RequestState
from server.worker.runtime_dir import RuntimeDir
from shared.config import EngineConfig

from helpers.tiny_tokenizer import CHAT_TEMPLATE, make_served_checkpoint, write_tokenizer
from helpers.waiting import wait_until_async

MODEL = "tiny-llama"
MAX_MODEL_LEN = 128
WAIT_S = 20.0
module_loop = pytest.mark.asyncio(loop_scope="module")


def byte_token_ids(tokenizer: Tokenizer, data: bytes) -> list[int]:
    """One token per byte, through byte-level BPE's byte -> printable character table (GPT-2's)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return [tokenizer._tokenizer.token_to_id(table[b]) for b in data]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(path)
    return Tokenizer.from_dir(path)


# ---------------------------------------------------------------------------------------------- detokenizer

def detokenize(tokenizer: Tokenizer, token_ids: list[int], prompt: list[int] | None = None) -> list[str]:
    detokenizer = Detokenizer(tokenizer, prompt)
    pieces = [detokenizer.step(t) for t in token_ids]
    return [*pieces, detokenizer.flush()]


def test_tokenizer_ids_match_the_checkpoint(tokenizer):
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.vocab_size) == (1, 2, 512)
    assert tokenizer.encode("hello")[0] == 1 and tokenizer.encode("hello", add_special_tokens=False)[0] != 1
    assert tokenizer.decode(tokenizer.encode("Hi 😀 你好")) == "Hi 😀 你好"


def test_detokenizer_byte_by_byte_never_splits_a_character(tokenizer):
    text = "héllo 😀 你好, world 👍🏽!"
    pieces = detokenize(tokenizer, byte_token_ids(tokenizer, text.encode()))
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert pieces.count("") >= len(text.encode()) - len(text)  # a multi-byte character waits for its last byte


def test_detokenizer_pieces_concatenate_to_the_whole_decode(tokenizer):
    rng = random.Random(0)
    for _ in range(200):  # random ids: stray continuation bytes, cut characters, special tokens
        token_ids = [rng.randrange(0, 512) for _ in range(rng.randint(1, 30))]
        assert "".join(detokenize(tokenizer, token_ids)) == tokenizer.decode(token_ids)
    text = "The capital of France is Paris. 你好世界 😀"
    prompt = tokenizer.encode("Question: ")
    assert "".join(detokenize(tokenizer, tokenizer.encode(text, add_special_tokens=False), prompt)) == text
    cut = byte_token_ids(tokenizer, "你".encode())
    assert "".join(detokenize(tokenizer, cut[1:], prompt=cut[:1])) == tokenizer.decode(cut[1:])  # prompt ends mid-character


# ---------------------------------------------------------------------------------------------- stop strings

def run_stop(pieces: list[str], stop: list[str], include: bool = False) -> tuple[list[str], str | None]:
    matcher = StopMatcher(stop, include)
    out = []
    for piece in pieces:
        result = matcher.feed(piece)
        out.append(result.text)
        if result.stop is not None:
            return out, result.stop
    return [*out, matcher.flush()], None


def test_stop_string_across_pieces_is_cut_and_never_sent():
    out, stop = run_stop(["Hel", "lo w", "orld", "!"], ["o wor"])
    assert (out, stop) == (["", "Hel", "l"], "o wor")  # "lo w" could begin "o wor": held back, then cut
    assert "".join(run_stop(["Hel", "lo w", "orld"], ["o wor"], include=True)[0]) == "Hello wor"


def test_stop_string_hold_back_and_release():
    out, stop = run_stop(["ab", "cd", "ef"], ["xyz"])
    assert stop is None and out == ["", "ab", "cd", "ef"] and "".join(out) == "abcdef"
    assert run_stop(["one two three"], ["three", "two"]) == (["one "], "two")  # the earliest match wins
    assert run_stop(["abc"], []) == (["abc", ""], None)


# ---------------------------------------------------------------------------------------------- request checks

@pytest.mark.parametrize("body, param", [
    ({"prompt": ""}, "prompt"), ({"prompt": []}, "prompt"), ({"prompt": [[]]}, "prompt"), ({}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"), ({"prompt": 5}, "prompt"), ({"prompt": [-1]}, "prompt"),
    ({"prompt": "x", "n": 0}, "n"), ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "9"}, "max_tokens"), ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "temperature": 2.5}, "temperature"), ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "stop": [""]}, "stop"), ({"prompt": "x", "stop": 4}, "stop"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"), ({"prompt": "x", "logprobs": True}, "logprobs"),
    ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"), ({"prompt": "x", "logit_bias": {"5": 200}}, "logit_bias"),
    ({"prompt": "x", "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"prompt": "x", "stop_token_ids": [1.5]}, "stop_token_ids"), ({"prompt": "x", "top_k": -3}, "top_k"),
    ({"prompt": "x", "model": 7}, "model"), ({"prompt": "x", "seed": 1.0}, "seed"),
])
def test_bad_completion_fields_are_400_naming_the_field(body, param):
    with pytest.raises(ApiError) as info:
        parse_completion_request(body)
    assert (info.value.status, info.value.param, info.value.type) == (400, param, "invalid_request_error")


def test_chat_fields_and_unknown_fields():
    request = parse_chat_request({"messages": [], "max_completion_tokens": 5, "max_tokens": 9, "logprobs": True,
                                  "top_logprobs": 3, "whatever": {"x": 1}, "user": "u"})
    assert (request.max_tokens, request.num_logprobs) == (5, 3)
    with pytest.raises(ApiError) as info:
        parse_chat_request({"messages": [], "top_logprobs": 2})
    assert info.value.param == "top_logprobs"
    with pytest.raises(ApiError) as info:
        parse_chat_request({"messages": [], "top_logprobs": 21, "logprobs": True})
    assert info.value.param == "top_logprobs"
    for body in (b"{", b"[1]", b"\xff\xfe"):
        with pytest.raises(ApiError) as info:
            parse_json_body(body)
        assert info.value.status == 400


# ---------------------------------------------------------------------------------------------- handlers, faked engine

class FakeConnection:
    def __init__(self):
        self.disconnected = asyncio.Event()
        self.is_draining = False
        self.data = bytearray()

    def write(self, *parts: bytes) -> None:
        self.data.extend(b"".join(parts))

    async def drain(self) -> None:
        await asyncio.sleep(0)


class FakeEngine:
    """Plays `script(state)` on each added request, soon after add()."""

    def __init__(self, script, tokenizer):
        # What a worker's Ready tells the frontend: this fake serves the tokenizer's vocabulary at MAX_MODEL_LEN.
        self.worker_info = SimpleNamespace(max_model_len=MAX_MODEL_LEN, vocab_size=tokenizer.vocab_size,
                                           eos_token_ids=[])
        self.is_ready = True
        self.script = script
        self.added: list[RequestState] = []
        self.aborted: list[str] = []

    def add(self, state: RequestState) -> None:
        self.added.append(state)
        asyncio.get_running_loop().call_soon(self.script, state)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


ADMISSION = Admission(capacity=64, max_seqs_per_request=64)


def fake_handlers(tokenizer, script, done=None) -> tuple[CompletionsHandlers, FakeEngine]:
    engine = FakeEngine(script, tokenizer)
    generation = GenerationService(engine, tokenizer, MODEL, ChatTemplate(CHAT_TEMPLATE),
                                   on_request_done=lambda state, outcome: done.append(outcome) if done is not None
                                   else None)
    return CompletionsHandlers(generation), engine


def post(body: dict) -> HttpRequest:
    return HttpRequest("POST", "/v1/completions", "", {}, json.dumps(body).encode(), "req-1")


def fail_after_tokens(state: RequestState) -> None:
    state.append([40, 41], None, None)
    state.fail("the engine worker died", "server_error")


@pytest.mark.asyncio
async def test_handler_checks_model_and_context_length(tokenizer):
    handlers, engine = fake_handlers(tokenizer, lambda state: None)
    responder = Responder(FakeConnection(), "r")
    cases = [({"prompt": "hi", "model": "gpt-4"}, 404, "model_not_found"),
             ({"prompt": [5] * MAX_MODEL_LEN}, 400, "context_length_exceeded"),
             ({"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, 400, "context_length_exceeded"),
             ({"prompt": [600]}, 400, None)]
    for body, status, code in cases:
        with pytest.raises(ApiError) as info:
            await handlers.completions(post(body), responder, ADMISSION.admit)
        assert (info.value.status, info.value.code) == (status, code), body
        if code == "context_length_exceeded":
            assert str(MAX_MODEL_LEN) in info.value.message
    assert engine.added == []  # nothing reaches the engine before every check passed


@pytest.mark.asyncio
async def test_error_after_the_stream_started_is_one_error_event(tokenizer):
    done = []
    handlers, engine = fake_handlers(tokenizer, fail_after_tokens, done)
    conn = FakeConnection()
    await handlers.completions(post({"prompt": "hi", "stream": True}), Responder(conn, "r"), ADMISSION.admit)
    data = bytes(conn.data)
    events = [line for line in data.split(b"\r\n") if line.startswith(b"data: ")]
    assert json.loads(events[-1][6:])["error"]["message"] == "the engine worker died"
    assert b"[DONE]" not in data and done == ["error"]


@pytest.mark.asyncio
async def test_failed_request_without_stream_is_a_5xx(tokenizer):
    handlers, _ = fake_handlers(tokenizer, fail_after_tokens)
    with pytest.raises(ApiError) as info:
        await handlers.completions(post({"prompt": "hi"}), Responder(FakeConnection(), "r"), ADMISSION.admit)
    assert info.value.status == 500 and info.value.type == "server_error"


@pytest.mark.asyncio
async def test_client_leaving_aborts_every_choice(tokenizer):
    done = []
    handlers, engine = fake_handlers(tokenizer, lambda state: None, done)  # the engine never answers
    conn = FakeConnection()
    task = asyncio.create_task(handlers.completions(post({"prompt": "hi", "n": 3}), Responder(conn, "r"),
                                                   ADMISSION.admit))
    await asyncio.sleep(0.05)
    conn.disconnected.set()
    with pytest.raises(ConnectionError):
        await asyncio.wait_for(task, WAIT_S)
    assert sorted(engine.aborted) == sorted(s.request_id for s in engine.added) and len(engine.added) == 3
    assert done == ["abort"] * 3


# ---------------------------------------------------------------------------------------------- end to end

@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def live(tmp_path_factory):
    checkpoint = make_served_checkpoint(tmp_path_factory.mktemp("served"))
    config = EngineConfig(model=str(checkpoint), dtype="float32", block_size=4, num_kv_blocks=256,
                          max_num_batched_tokens=64, max_num_seqs=8, max_model_len=MAX_MODEL_LEN)
    tokenizer = Tokenizer.from_dir(checkpoint)
    done: list[str] = []
    with RuntimeDir.create() as runtime_dir:
        engine = EngineClient(config, runtime_dir.path, start_timeout=60.0)
        await engine.start()
        generation = GenerationService(engine, tokenizer, MODEL,
                                       load_chat_template(checkpoint, tokenizer.chat_template),
                                       on_request_done=lambda state, outcome: done.append(outcome))
        handlers = CompletionsHandlers(generation)
        routes = {"/v1/completions": handlers.completions, "/v1/chat/completions": handlers.chat_completions}
        admission = Admission(capacity=64, max_seqs_per_request=64)

        async def router(request: HttpRequest, responder: Responder) -> None:
            if request.method != "POST" or request.path not in routes:
                raise ApiError(404, f"no route {request.method} {request.path}")
            await routes[request.path](request, responder, admission.admit)

        http = await serve(router, "127.0.0.1", 0)
        base_url = f"http://127.0.0.1:{http.port}/v1"
        sdk = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=WAIT_S)
        yield types.SimpleNamespace(sdk=sdk, base_url=base_url, engine=engine, done=done, tokenizer=tokenizer)
        await sdk.close()
        http.close()
        await http.wait_idle(2.0)
        await engine.close()


GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})
PROMPT = "Once upon a time"


@module_loop
async def test_completion_stream_concatenates_to_the_non_streamed_text(live):
    full = await live.sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, **GREEDY)
    [choice] = full.choices
    assert (full.object, choice.finish_reason, full.usage.completion_tokens) == ("text_completion", "length", 24)
    assert full.id.startswith("cmpl-") and full.usage.prompt_tokens == len(live.tokenizer.encode(PROMPT))
    chunks = [c async for c in await live.sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24,
                                                                  stream=True, **GREEDY)]
    assert "".join(c.choices[0].text for c in chunks) == choice.text and choice.text
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"


@module_loop
async def test_chat_streaming_starts_with_the_role(live):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Say hello"}]}]
    full = await live.sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, **GREEDY)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    stream = await live.sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, stream=True,
                                                    stream_options={"include_usage": True}, **GREEDY)
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == full.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == "length" and all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert full.usage.completion_tokens == 16


@module_loop
async def test_n_choices_with_a_seed_repeat(live):
    async def sample():
        result = await live.sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, n=2, seed=123,
                                                   temperature=1.0, extra_body={"ignore_eos": True})
        return [(c.index, c.text) for c in result.choices], result.usage.completion_tokens

    first, num_tokens = await sample()
    assert [i for i, _ in first] == [0, 1] and num_tokens == 24
    assert await sample() == (first, num_tokens)


@module_loop
async def test_logprobs_shapes(live):
    result = await live.sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, logprobs=3, **GREEDY)
    logprobs = result.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.text_offset) == 6
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        # keyed by text: tokens that decode alike (partial characters show as U+FFFD) share a key
        assert 1 <= len(top) <= 4 and token in top and logprob == pytest.approx(max(top.values())) and logprob <= 0
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    chat = await live.sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=5, logprobs=True, top_logprobs=2, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(item.top_logprobs) == 2 for item in content)
    assert all(item.bytes == list(item.token.encode()) and item.logprob <= 0 for item in content)
    # greedy: the sampled token is the most likely one
    assert all(item.logprob == pytest.approx(item.top_logprobs[0].logprob) for item in content)


@module_loop
async def test_stop_string_cuts_the_output(live):
    full = await live.sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, **GREEDY)
    text = full.choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    expected = text[:text.index(stop)]
    cut = await live.sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, stop=[stop], **GREEDY)
    assert (cut.choices[0].text, cut.choices[0].finish_reason) == (expected, "stop")
    assert cut.usage.completion_tokens < 32
    chunks = [c async for c in await live.sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32,
                                                                  stop=stop, stream=True, **GREEDY)]
    assert "".join(c.choices[0].text for c in chunks) == expected
    await wait_until_async(lambda: not live.engine.in_flight)  # the worker was told to stop


@module_loop
async def test_echo_and_errors(live):
    result = await live.sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, echo=True, **GREEDY)
    assert result.choices[0].text.startswith(PROMPT) and len(result.choices[0].text) > len(PROMPT)
    with pytest.raises(openai.NotFoundError):
        await live.sdk.completions.create(model="gpt-4", prompt=PROMPT)
    with pytest.raises(openai.BadRequestError) as info:
        await live.sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_MODEL_LEN)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as info:
        await live.sdk.completions.create(model=MODEL, prompt="", max_tokens=4)
    assert info.value.body["param"] == "prompt"


@module_loop
async def test_tool_choice_auto_needs_the_servers_tool_call_parser(live):
    """This server runs without --enable-auto-tool-choice: tools with tool_choice "auto" (the default) are a 400
    that says which flags to set, as vLLM answers; "none" renders the tools and generates text."""
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    for tool_choice in ("auto", openai.NOT_GIVEN):
        with pytest.raises(openai.BadRequestError) as info:
            await live.sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=4, tools=tools, tool_choice=tool_choice)
        assert info.value.body["param"] == "tool_choice"
        assert "--enable-auto-tool-choice" in info.value.body["message"] and "--tool-call-parser" in info.value.body["message"]
    plain = await live.sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=4, tools=tools, tool_choice="none", **GREEDY)
    assert plain.choices[0].message.tool_calls is None and plain.usage.completion_tokens == 4


@module_loop
async def test_fields_the_sdk_sends_are_taken_refused_or_logged(live, caplog):
    """The field table through the SDK and a real worker: a field that would change the output but is not
    implemented is a 400 naming it, before anything reaches the engine; an unknown one is a 200 and one warning."""
    with pytest.raises(openai.BadRequestError) as info:
        await live.sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                               extra_body={"use_beam_search": True})
    assert info.value.body["param"] == "use_beam_search" and "not supported" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        await live.sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, best_of=2)
    assert info.value.body["param"] == "best_of"
    with pytest.raises(openai.BadRequestError) as info:  # a server not started with --trust-request-chat-template
        await live.sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                               extra_body={"chat_template": "{{ messages[0].content }}"})
    assert info.value.body["param"] == "chat_template" and "--trust-request-chat-template" in info.value.body["message"]
    with caplog.at_level("WARNING", logger="pagedserve.api"):
        for _ in range(2):
            result = await live.sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                                                       extra_body={"ignore_eos": True, "a_field_of_our_own": 1})
            assert result.usage.completion_tokens == 4
    assert ["a_field_of_our_own" in r.getMessage() for r in caplog.records].count(True) == 1


@module_loop
@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
async def test_curl_streams_well_formed_sse(live):
    body = json.dumps({"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 8, "stream": True, "ignore_eos": True})
    process = await asyncio.create_subprocess_exec(
        "curl", "-sN", f"{live.base_url}/completions", "-H", "Content-Type: application/json", "-d", body,
        stdout=subprocess.PIPE)
    out, _ = await asyncio.wait_for(process.communicate(), WAIT_S)
    events = out.decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-2]]
    assert all(event.startswith("data: {") and "\n" not in event for event in events[:-2])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "text_completion" and c["model"] == MODEL for c in chunks)


@module_loop
async def test_client_that_leaves_mid_stream_is_aborted(live):
    body = json.dumps({"prompt": PROMPT, "max_tokens": MAX_MODEL_LEN - 8, "stream": True, "ignore_eos": True})
    reader, writer = await asyncio.open_connection("127.0.0.1", int(live.base_url.split(":")[2].split("/")[0]))
    writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
    await reader.readuntil(b"data: ")
    num_done = len(live.done)
    writer.close()
    await wait_until_async(lambda: not live.engine.in_flight and len(live.done) > num_done)
    assert live.done[-1] == "abort"
